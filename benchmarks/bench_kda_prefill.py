#!/usr/bin/env python3
"""KDA prefill benchmark: cula's fused SM90 kernel side by side with FLA's Triton ``chunk_kda``
and MoonshotAI's FlashKDA, in one process, on identical inputs.

    python benchmarks/bench_kda_prefill.py                 # SM90 GPU: full default suite; CPU check elsewhere
    python benchmarks/bench_kda_prefill.py --quick         # a handful of rows
    python benchmarks/bench_kda_prefill.py --suite targets   # the target rows
    python benchmarks/bench_kda_prefill.py --save          # + benchmarks/results/<device>-<date>.{json,md,png}
    python benchmarks/bench_kda_prefill.py --help

The work is done by the package next to this file, ``benchmarks/kda_bench`` (suite, inputs,
timing, reference, baselines, report, plot); ``benchmarks/README.md`` describes the method.

Exit status: 0 when every error check passed, 1 when a cula check failed (an error above the
tolerance, cula raising on a supported configuration, two identical calls differing), 2 when the
check could not run.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# kda_bench lives next to this file; cula is imported from the repository root when it is not
# installed (the CPU check needs only its Python reference).
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from kda_bench.cli import main  # noqa: E402  (needs the path above)

if __name__ == "__main__":
    sys.exit(main())
