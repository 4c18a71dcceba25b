"""How much of a fused call's time is its code arriving cold from HBM.

    CULA_KDA_COOPERATIVE=0 python scripts/code_warmth_probe.py

For each shape, the CUDA-graph replay of the call is timed (CUDA events, median of 40) in four
ways: ``cold`` after a 256 MB write that flushes the L2 cache (code and data cold); ``warm_code``
after the flush and then a one-chunk, one-tile call of the same kernel instantiation (the kernel's
code in L2, the big call's data not); ``hot`` right after a replay of the same call (no flush);
``tiny_cold`` the one-chunk call alone after a flush (the fixed cost of a launch of one chunk).
``cold - warm_code`` is what a warm-code scheme (extra CTAs running the code ahead) could gain.
Measured on 2026-11-27 (H100, docs/perf-notes.md): 0.5 us of 134 at B1 T1024 H64.
"""

from __future__ import annotations

import os
import statistics
import sys

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
MODES = ("cold", "warm_code", "hot", "tiny_cold")


def probe(big_cfg: Config, tiny_cfg: Config, flush: torch.Tensor, reps: int = 40) -> dict[str, float]:
    """Median microseconds of the big call's graph replay per mode (``tiny_cold``: the tiny call's)."""
    dev, opt = flush.device, Options()
    gen = torch.Generator(device=dev).manual_seed(0)
    big = CulaBaseline(opt).prepare(make_inputs(big_cfg, opt, dev, torch.bfloat16, gen, None))
    tiny = CulaBaseline(opt).prepare(make_inputs(tiny_cfg, opt, dev, torch.bfloat16, gen, None))
    (big_graph, _), = capture_graphs([big])
    (tiny_graph, _), = capture_graphs([tiny])
    us: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(reps):
        for mode in MODES:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if mode == "hot":
                big_graph.replay()
            else:
                flush.zero_()
            if mode == "warm_code":
                tiny_graph.replay()
            torch.cuda.synchronize()
            start.record()
            (tiny_graph if mode == "tiny_cold" else big_graph).replay()
            end.record()
            torch.cuda.synchronize()
            us[mode].append(start.elapsed_time(end) * 1000)
    return {m: statistics.median(v) for m, v in us.items()}


def main() -> None:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    tiny = Config("fixed", 1, 64, 1, 1)
    for B, T, H in SHAPES:
        cfg = Config("fixed", B, T, H, H)
        r = probe(cfg, tiny, flush)
        print(f"B{B} T{T} H{H} [{cula_schedule(cfg, sm)}] tiny B1 T64 H1 [{cula_schedule(tiny, sm)}]: "
              + ", ".join(f"{m} {t:.1f} us" for m, t in r.items()), flush=True)


if __name__ == "__main__":
    main()
