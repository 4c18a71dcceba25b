"""How much of a fused call's time is its code arriving cold.

    CULA_KDA_COOPERATIVE=0 python scripts/code_warmth_probe.py

For each shape, the CUDA-graph replay of the call is timed (CUDA events, median of 40 rounds,
each round every mode once) after different preparations:

* ``hot``: right after a replay of the same call (code and data warm).
* ``l2_cold``: after a 256 MB write that flushes the L2 cache. The SMs' own instruction caches
  may still hold the kernel's code from the rounds before.
* ``l2_warm``: the flush, then a one-chunk, one-tile call of the same kernel instantiation (the
  kernel's code in L2 again, the big call's data not).
* ``all_cold``: a call of another kernel on every SM (the general-gate fused kernel, ~200 KB of
  other code, so the SMs' instruction caches hold that), then the flush.
* ``sm_cold_l2_warm``: as ``all_cold``, then the one-chunk call: the code in L2 but not in the
  caches of the SMs the big call runs on. What CTAs on idle SMs running the code ahead of the
  real ones could at best turn ``all_cold`` into.
* ``tiny_cold``: the one-chunk call's own replay after a flush (a launch of one chunk).

The big and the one-chunk calls must run the same kernel: run it with ``CULA_KDA_COOPERATIVE=0``
(the script prints both launches; both then run the pair form where it applies, or with
``CULA_KDA_PAIR=0`` as well the fused kernel with one CTA per tile, as measured on 2026-11-27 at
1cf332c, H100, docs/perf-notes.md).
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Callable

import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_REPO, "benchmarks"), _REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from kda_bench.baselines.cula import CulaBaseline, cula_schedule  # noqa: E402  (needs the path above)
from kda_bench.inputs import Options, make_inputs  # noqa: E402
from kda_bench.suite import Config  # noqa: E402
from kda_bench.timing import capture_graphs  # noqa: E402

SHAPES = ((1, 1024, 64), (1, 2048, 64), (1, 4096, 32), (2, 1024, 64))
MODES = ("hot", "l2_cold", "l2_warm", "all_cold", "sm_cold_l2_warm", "tiny_cold")


_KEEP: list[object] = []  # the captured calls' inputs and outputs, alive as long as their graphs


def graph_of(cfg: Config, opt: Options, gen: torch.Generator) -> torch.cuda.CUDAGraph:
    """One captured call of ``cfg`` on fresh random inputs (which stay alive: the graph reads them)."""
    call = CulaBaseline(opt).prepare(make_inputs(cfg, opt, torch.device("cuda"), torch.bfloat16, gen, None))
    (graph, out), = capture_graphs([call])
    _KEEP.extend((call, out))
    return graph


def probe(big_cfg: Config, tiny: torch.cuda.CUDAGraph, other: torch.cuda.CUDAGraph, flush: torch.Tensor,
          gen: torch.Generator, reps: int = 40) -> dict[str, float]:
    """Median microseconds of the big call's graph replay per mode (``tiny_cold``: the tiny call's)."""
    big = graph_of(big_cfg, Options(), gen)
    before: dict[str, list[Callable[[], object]]] = {
        "hot": [big.replay],
        "l2_cold": [flush.zero_],
        "l2_warm": [flush.zero_, tiny.replay],
        "all_cold": [other.replay, flush.zero_],
        "sm_cold_l2_warm": [other.replay, flush.zero_, tiny.replay],
        "tiny_cold": [flush.zero_],
    }
    us: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(reps):
        for mode in MODES:
            for step in before[mode]:
                step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            (tiny if mode == "tiny_cold" else big).replay()
            end.record()
            torch.cuda.synchronize()
            us[mode].append(start.elapsed_time(end) * 1000)
    return {m: statistics.median(v) for m, v in us.items()}


def main() -> None:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    tiny_cfg = Config("fixed", 1, 64, 1, 1)
    tiny = graph_of(tiny_cfg, Options(), gen)
    # Another kernel on every SM: the general-gate (softplus) fused kernel, one tile per SM.
    other_cfg = Config("fixed", 1, 1024, sm, sm)
    other = graph_of(other_cfg, Options(softplus_gate=True), gen)
    print(f"one-chunk call [{cula_schedule(tiny_cfg, sm)}]; other kernel B1 T1024 H{sm} softplus "
          f"[{cula_schedule(other_cfg, sm, general_gates=True)}]", flush=True)
    for B, T, H in SHAPES:
        cfg = Config("fixed", B, T, H, H)
        r = probe(cfg, tiny, other, flush, gen)
        print(f"B{B} T{T} H{H} [{cula_schedule(cfg, sm)}]: " + ", ".join(f"{m} {t:.1f} us" for m, t in r.items()),
              flush=True)


if __name__ == "__main__":
    main()
