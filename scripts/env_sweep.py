"""Same-process A/B of the launch knobs that cula reads per call (CULA_KDA_* environment variables).

    python scripts/env_sweep.py --shapes 1x32768x8,1x65536x4 --env CULA_KDA_SEGMENTS=1,3,4,6
    python scripts/env_sweep.py --shapes 1x8192x64 --env CULA_KDA_COOPERATIVE=0,1
    python scripts/env_sweep.py --shapes random:10x8192x64 --env CULA_KDA_SCHEDULE=index,longest_first

Each shape is ``BxTxH`` (fixed length) or ``DIST:NxTOTALxH`` (varlen: N sequences summing to
TOTAL tokens, lengths as in the benchmark's suite, DIST one of uniform, random, skewed); H = HV,
D = 128, with the benchmark's inputs and options
(`benchmarks/kda_bench`: gate in kernel with ``lower_bound=-5``, l2norm in kernel, final state
out; ``--softplus-gate`` for Kimi-Linear's unbounded gate). For every value of the variable the
script times single eager calls on the same inputs, interleaving the values call by call (so
drifts of the clock or the machine hit every value alike), and prints per value the CUDA-event
median, the spread (min-max of the middle half) and the relative L2 difference of o and of the
final state from the first value's results (launch variants must agree to within the numerics
contract).

``--order blocks`` times each value in blocks of consecutive calls instead (``--block`` calls,
after two untimed ones, values in turn, ``--reps`` calls per value in all), closer to a process that
runs one launch form throughout, as the benchmark's does (the two orders can disagree:
docs/perf-notes.md). ``--sets N`` rotates N input sets (the benchmark rotates enough sets to exceed
three times the L2 cache, so that no call finds its inputs there). ``--graph`` adds CUDA-graph
replay medians per value.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from typing import Iterator

import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_REPO, "benchmarks"), _REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from kda_bench.baselines.cula import CulaBaseline  # noqa: E402  (needs the path above)
from kda_bench.inputs import Options, cu_seqlens, make_inputs  # noqa: E402
from kda_bench.reference import rel_err  # noqa: E402
from kda_bench.suite import Config, varlen  # noqa: E402
from kda_bench.timing import TimingParams, capture_graphs, idle_call_ms, time_graphs  # noqa: E402


def parse_shape(text: str) -> Config:
    """``BxTxH`` -> a fixed-length row; ``DIST:NxTOTALxH`` -> the suite's varlen row."""
    dist, sep, dims = text.lower().partition(":")
    if not sep:
        dist, dims = "", text.lower()
    parts = dims.split("x")
    if len(parts) != 3 or not all(x.isdigit() for x in parts):
        raise ValueError(f"shape {text!r}: expected BxTxH or DIST:NxTOTALxH")
    a, b, H = (int(x) for x in parts)
    if dist:
        return varlen(dist, a, b, H, H, 128, 0)
    return Config("fixed", a, b, H, H)


@contextlib.contextmanager
def env_restored(name: str) -> Iterator[None]:
    """Whatever the block sets ``name`` to, its earlier value (or absence) afterwards."""
    saved = os.environ.get(name)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def timing_order(values: list[str], reps: int, order: str, block: int) -> list[tuple[str, bool]]:
    """The calls of a sweep in order, as (value, timed): interleaved, each value once per round;
    in blocks, per value two untimed calls and then up to ``block`` timed ones, values in turn.
    Each value gets ``reps`` timed calls either way."""
    if order == "interleaved":
        return [(x, True) for _ in range(reps) for x in values]
    calls, done = [], 0
    while done < reps:
        n = min(block, reps - done)
        for x in values:
            calls += [(x, False)] * 2 + [(x, True)] * n
        done += n
    return calls


def sweep(cfg: Config, name: str, values: list[str], reps: int, opt: Options, order: str = "interleaved",
          block: int = 10, sets: int = 1, graph: bool = False) -> list[str]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cu = cu_seqlens(cfg, dev)
    calls = [CulaBaseline(opt).prepare(make_inputs(cfg, opt, dev, torch.bfloat16, gen, cu)) for _ in range(sets)]
    n = 0

    def call():  # the next input set
        nonlocal n
        n += 1
        return calls[n % sets]()

    results, times = {}, {x: [] for x in values}
    graph_ms: dict[str, list[float]] = {x: [] for x in values}
    with env_restored(name):
        for x in values:
            os.environ[name] = x
            results[x] = calls[0]()
            for _ in range(3):
                call()
        for x, timed in timing_order(values, reps, order, block):
            os.environ[name] = x
            t = idle_call_ms(call)
            if timed:
                times[x].append(t)
        if graph:  # one CUDA graph per (value, input set), captured with the value set; replays in blocks
            graphs = {}
            for x in values:
                os.environ[name] = x
                graphs[x] = capture_graphs(calls)
    if graph:
        p = TimingParams(warmup=2, min_reps=block, max_reps=block, min_time_s=0.0)
        for _ in range(max(1, reps // block)):
            for x in values:
                graph_ms[x].append(time_graphs(graphs[x], p)[0])
    o0, s0 = results[values[0]]
    lines = []
    for x in values:
        t = sorted(times[x])
        mid = t[len(t) // 4: max(len(t) // 4 + 1, 3 * len(t) // 4)]
        o, s = results[x]
        g = f", graph {statistics.median(graph_ms[x]):.3f} ms" if graph else ""
        lines.append(f"{cfg.name} {name}={x}: {statistics.median(t):.3f} ms "
                     f"(middle half {mid[0]:.3f}-{mid[-1]:.3f}){g}, vs {name}={values[0]}: "
                     f"o {rel_err(o, o0):.1e} state {rel_err(s, s0):.1e}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", required=True, help="comma-separated BxTxH or DIST:NxTOTALxH")
    ap.add_argument("--env", required=True, help="NAME=v1,v2,...")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--softplus-gate", action="store_true", help="Kimi-Linear's gate (safe_gate=False)")
    ap.add_argument("--order", choices=("interleaved", "blocks"), default="interleaved",
                    help="values call by call, or in blocks of --block consecutive calls")
    ap.add_argument("--block", type=int, default=10, help="timed calls per block (--order blocks)")
    ap.add_argument("--sets", type=int, default=1, help="input sets, rotated call by call")
    ap.add_argument("--graph", action="store_true",
                    help="also the median of CUDA-graph replays per value (blocks of --block replays)")
    args = ap.parse_args()
    opt = Options(softplus_gate=args.softplus_gate)
    name, _, vals = args.env.partition("=")
    values = [x for x in vals.split(",") if x]
    if not name or not values:
        ap.error("--env needs NAME=v1,v2,...")
    try:
        cfgs = [parse_shape(shape) for shape in args.shapes.split(",")]
    except ValueError as e:
        ap.error(str(e))
    if args.reps < 1 or args.block < 1 or args.sets < 1:
        ap.error("--reps, --block and --sets must be >= 1")
    for cfg in cfgs:
        for line in sweep(cfg, name, values, args.reps, opt, args.order, args.block, args.sets,
                          args.graph):
            print(line, flush=True)


if __name__ == "__main__":
    main()
