"""Where the eager time of one ``kda_prefill`` call goes: host launch points against GPU work.

    python scripts/eager_timeline.py                      # the B1 / small / GVA rows
    python scripts/eager_timeline.py --rows "B1 T1024 H64" --env CULA_KDA_COOPERATIVE=0,1
    python scripts/eager_timeline.py --rows "B2 T8192 H64" --softplus-gate --no-trace

The benchmark's eager time is one call from an idle GPU (synchronise, start event, call, end
event), so it holds the host time before the first launch and any gap the host leaves between
launches; its CUDA-graph time holds neither. For each row (the benchmark's inputs and options)
this script prints

* the CUDA-event medians of eager calls and of graph replays (interleaved, ``--reps`` each), and
  their difference;
* from a ``torch.profiler`` trace of ``--traced`` eager calls and graph replays (medians over
  them; the profiler's callbacks add ~1-3 us to every runtime call): when each CUDA runtime call
  is made and when each kernel or memset runs and how long, in microseconds from the start of
  the call.

With ``--env NAME=v1,v2`` every value of the variable gets its own eager and graph medians (a
graph per value, captured with the variable set) in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_REPO, "benchmarks"), _REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from kda_bench.baselines.cula import CulaBaseline  # noqa: E402  (needs the path above)
from kda_bench.inputs import Options, cu_seqlens, make_inputs  # noqa: E402
from kda_bench.suite import LONG_PROMPT_WITH_SHORT, Config, given_lengths, varlen  # noqa: E402
from kda_bench.timing import capture_graphs, idle_call_ms  # noqa: E402

ROWS = {
    "B2 T8192 H64": Config("fixed", 2, 8192, 64, 64),
    "B8 T8192 H64": Config("fixed", 8, 8192, 64, 64),
    "B1 T1024 H64": Config("fixed", 1, 1024, 64, 64),
    "B1 T8192 H64": Config("fixed", 1, 8192, 64, 64),
    "B1 T2048 H64": Config("fixed", 1, 2048, 64, 64),
    "B1 T4096 H64": Config("fixed", 1, 4096, 64, 64),
    "B1 T32768 H8": Config("small", 1, 32768, 8, 8),
    "B1 T65536 H4": Config("small", 1, 65536, 4, 4),
    "B1 T131072 H2": Config("small", 1, 131072, 2, 2),
    "varlen 30000+3 H8": given_lengths("small", LONG_PROMPT_WITH_SHORT, 8, 8, 128),
    "B2 T8192 H16/HV64": Config("gva", 2, 8192, 16, 64),
    # the benchmark's varlen target rows (its default seed 0)
    "varlen 10 random H64": varlen("random", 10, 8192, 64, 64, 128, 0),
    "varlen 100x128 H64": varlen("uniform", 100, 100 * 128, 64, 64, 128, 0),
}


def event_medians(fns: dict[str, object], reps: int) -> dict[str, float]:
    """Median ms of single calls from an idle GPU, the functions interleaved call by call."""
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(idle_call_ms(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def capture(call) -> torch.cuda.CUDAGraph:
    """One call of ``call`` captured in a CUDA graph (the benchmark's capture)."""
    return capture_graphs([call])[0][0]


def trace(fn, label: str, n: int) -> list[str]:
    """Median timeline of ``n`` traced calls of ``fn``, each from an idle GPU."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            torch.cuda.synchronize()
            with record_function(f"{label}#{i}"):
                fn()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    os.unlink(path)
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(label + "#")),
                   key=lambda e: e["ts"])
    rows: dict[tuple[str, str, int], list[tuple[float, float]]] = defaultdict(list)
    for m in marks:
        t0, t1 = m["ts"], m["ts"] + m["dur"]
        seen: dict[tuple[str, str], int] = defaultdict(int)
        # GPU work may end after the annotation: take it up to the next annotation's start.
        nxt = min((x["ts"] for x in marks if x["ts"] > t0), default=float("inf"))
        for e in sorted(events, key=lambda e: e["ts"]):
            cat = e.get("cat", "")
            if cat == "cuda_runtime" and t0 <= e["ts"] <= t1 and "Synchronize" not in e["name"]:
                key = ("host", e["name"])
            elif cat in ("kernel", "gpu_memset", "gpu_memcpy") and t0 <= e["ts"] < nxt:
                key = ("gpu", e["name"][:60])
            else:
                continue
            k = seen[key]
            seen[key] += 1
            rows[(key[0], key[1], k)].append((e["ts"] - t0, e["dur"]))
        rows[("host", "<call returns>", 0)].append((t1 - t0, 0.0))
    out = []
    for (side, name, k), v in sorted(rows.items(), key=lambda kv: statistics.median(x[0] for x in kv[1])):
        at = statistics.median(x[0] for x in v)
        dur = statistics.median(x[1] for x in v)
        out.append(f"    {label:5s} {side:4s} at {at:8.1f} us  dur {dur:8.1f} us  {name}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fused_rows = ("B2 T8192 H64", "B8", "varlen 10", "varlen 100")
    ap.add_argument("--rows", default=",".join(r for r in ROWS if not r.startswith(fused_rows)),
                    help="comma-separated names of " + ", ".join(ROWS))
    ap.add_argument("--env", default="", help="NAME=v1,v2,... (each value gets its own eager and graph medians)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--traced", type=int, default=5)
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--softplus-gate", action="store_true",
                    help="Kimi-Linear's unbounded gate (safe_gate=False, the general-gate kernels) instead of the "
                    "benchmark's lower-bound gate")
    ap.add_argument("--save-outputs", default="", help="directory: save each row's (o, final state) of one call, "
                    "for a bitwise comparison of builds (torch.save, one file per row)")
    args = ap.parse_args()
    opt = Options(softplus_gate=args.softplus_gate)
    dev = torch.device("cuda")
    name, _, vals = args.env.partition("=")
    values = [x for x in vals.split(",") if x] or [None]
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for row in [r.strip() for r in args.rows.split(",") if r.strip()]:
        cfg = ROWS[row]
        gen = torch.Generator(device=dev).manual_seed(0)
        inputs = make_inputs(cfg, opt, dev, torch.bfloat16, gen, cu_seqlens(cfg, dev))
        call = CulaBaseline(opt).prepare(inputs)
        if args.save_outputs:
            os.makedirs(args.save_outputs, exist_ok=True)
            o, state = call()
            torch.save((o.cpu(), state.cpu()), os.path.join(args.save_outputs, row.replace(" ", "_").replace("/", "-") + ".pt"))
        fns = {}
        for x in values:
            if x is not None:
                os.environ[name] = x
            for _ in range(3):
                call()
            graph = capture(call)
            tag = "" if x is None else f"{name}={x} "

            def eager(x=x):
                if x is not None:
                    os.environ[name] = x
                call()
            fns[tag + "eager"] = eager
            fns[tag + "graph"] = graph.replay
        med = event_medians(fns, args.reps)
        print(f"== {row}", flush=True)
        for x in values:
            tag = "" if x is None else f"{name}={x} "
            e, g = med[tag + "eager"], med[tag + "graph"]
            print(f"  {tag}eager {e:.4f} ms  graph {g:.4f} ms  eager - graph {1e3 * (e - g):.1f} us", flush=True)
        if not args.no_trace:
            x = values[0]
            if x is not None:
                os.environ[name] = x
            print("\n".join(trace(call, "eager", args.traced)), flush=True)
            graph = capture(call)
            print("\n".join(trace(graph.replay, "graph", args.traced)), flush=True)
        if name:
            os.environ.pop(name, None)


if __name__ == "__main__":
    main()
