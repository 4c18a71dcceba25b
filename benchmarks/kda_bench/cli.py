"""Command line of ``benchmarks/bench_kda_prefill.py``."""
from __future__ import annotations

import argparse
import os

from kda_bench.env import REPO_ROOT, detect_device
from kda_bench.report import merge, resolve_paths, write_reports
from kda_bench.suite import MODES, SUITES
from kda_bench.util import log

DEFAULT_TOL = 5e-3   # docs/math.md, numerics contract: relative L2 error of o and of the final state


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (see ``--help``)."""
    p = argparse.ArgumentParser(
        description="KDA prefill benchmark: cula kda_prefill(backend='sm90') vs FLA chunk_kda and "
                    "FlashKDA. Without an SM90 GPU: a CPU check of the reference backend.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--suite", choices=SUITES, default="default",
                   help="default: the rows of --mode; quick: a handful of rows (= --quick); targets: "
                        "the target rows (B8/B2/B1 T8192 H64, B1 T1024 H64, GVA B2 T8192 H16/HV64, "
                        "varlen random N10 T8192 H64, varlen 100 x 128 H64, B1 T32768 H8, "
                        "B1 T65536 H4; --heads/--hv ignored)")
    p.add_argument("--mode", choices=[*MODES, "all"], default="all",
                   help="default suite: fixed B in {1,2,8} x T in {1k,4k,8k,16k}, H=HV=64; gva (H,HV) "
                        "in {(32,64),(16,64),(8,64)} at B=2,T=8192; varlen uniform/random/skewed x "
                        "{10,20,100} sequences x totals {4096,8192,16384}, H=HV=64; small: "
                        "(B=1,T=32768,H=8), (B=1,T=65536,H=4), (B=1,T=131072,H=2), varlen "
                        "30000+100+37+1 tokens H=8")
    p.add_argument("--quick", action="store_true",
                   help="--suite quick: B2 T8192 H64, B1 T8192 H64, GVA B2 T8192 H16/HV64, "
                        "varlen random N20 T8192 H64, B1 T32768 H8")
    p.add_argument("--configs", default=None,
                   help="only configurations whose name matches this regular expression "
                        "(names as printed, e.g. 'B8 T16384 H64', 'varlen skewed')")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="start no new configuration after this many seconds (0: no limit); the "
                        "ones left are listed in the report")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no benchmark: merge the rows of these JSON results (e.g. one per --mode, "
                        "run in separate device calls) into one report (--json/--md/--plot/--save)")
    p.add_argument("--heads", type=int, default=None, help="q/k heads H (all suites; GVA: the one pair)")
    p.add_argument("--hv", type=int, default=None, help="value heads HV (default H; GVA default 64)")
    p.add_argument("--batch", default=None, help="fixed suite batch sizes, comma separated")
    p.add_argument("--seqlen", default=None, help="fixed suite sequence lengths, comma separated")
    p.add_argument("--dim", type=int, default=128, help="head dim K = V (cula and FlashKDA need 128)")
    p.add_argument("--initial-state", action="store_true", help="pass a random fp32 initial state")
    p.add_argument("--state-layout", choices=["kv", "vk"], default="kv")
    p.add_argument("--beta-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="beta of cula and FLA (FlashKDA always gets bf16 logits)")
    p.add_argument("--no-l2norm", action="store_true",
                   help="use_qk_l2norm_in_kernel=False (FlashKDA: n/a)")
    p.add_argument("--precomputed-gate", action="store_true",
                   help="use_gate_in_kernel=False with gates lower_bound*sigmoid(N(0,1)) (FlashKDA: n/a)")
    p.add_argument("--softplus-gate", action="store_true",
                   help="Kimi-Linear's unbounded gate -exp(A_log)*softplus(g+dt_bias), safe_gate=False "
                        "(A_log ~ N(0,1), g ~ 2 N(0,1); FlashKDA: n/a)")
    p.add_argument("--no-cula", action="store_true", help="leave cula out")
    p.add_argument("--no-cula-safe", action="store_true",
                   help="with --softplus-gate: leave out cula's safe-gate time on the same tensors "
                        "(column 'cula safe gate', ratio 'softplus / safe')")
    p.add_argument("--require-cula", action="store_true",
                   help="exit 1 when cula cannot be timed on the SM90 GPU (e.g. extension not built)")
    p.add_argument("--no-fla", action="store_true", help="leave FLA out")
    p.add_argument("--no-flashkda", action="store_true", help="leave FlashKDA out")
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timings")
    p.add_argument("--no-check", action="store_true", help="skip the error check against the reference")
    p.add_argument("--check-tokens", type=int, default=8192,
                   help="error check: at most this many tokens per sequence (0: whole sequences)")
    p.add_argument("--check-mem-gib", type=float, default=6.0,
                   help="error check: fewer sequences / tokens until the fp32 reference fits this")
    p.add_argument("--tol", type=float, default=DEFAULT_TOL, help="relative L2 error limit for cula")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--min-reps", type=int, default=10)
    p.add_argument("--max-reps", type=int, default=200)
    p.add_argument("--min-time", type=float, default=0.25, help="seconds of timed calls per measurement")
    p.add_argument("--max-sets", type=int, default=8, help="input sets rotated for small problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--md", default=None, help="write a Markdown table here")
    p.add_argument("--plot", default=None, help="write a PNG bar chart of speedups here")
    p.add_argument("--save", action="store_true",
                   help="write <results-dir>/<device>-<date>.{json,md,png} (unless paths are given)")
    p.add_argument("--results-dir", default=os.path.join(REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)
    if args.quick:
        args.suite = "quick"
    return args


def merge_path(args: argparse.Namespace) -> int:
    """--merge: one report from several JSON results of one device and commit."""
    if not (args.json or args.md or args.plot or args.save):
        log("--merge needs --json, --md, --plot or --save to write something")
        return 2
    try:
        meta, rows, statements = merge(args.merge)
    except ValueError as exc:
        log(f"refusing to merge: {exc}")
        return 2
    write_reports(resolve_paths(args.json, args.md, args.plot, args.save, args.results_dir, meta),
                  meta, rows, statements)
    n_fail = sum(1 for r in rows if r.get("status") == "FAIL")
    log(f"merged {len(rows)} rows from {len(args.merge)} files ({n_fail} failed)")
    return 1 if n_fail else 0


def main(argv: list[str] | None = None) -> int:
    """Merge, or run: the GPU suite on an SM90 GPU, the CPU check elsewhere."""
    from kda_bench.runner import cpu_path, gpu_path

    args = parse_args(argv)
    if args.merge:
        return merge_path(args)
    device = detect_device(args.device)
    return gpu_path(device, args) if device.sm90 else cpu_path(device, args)
