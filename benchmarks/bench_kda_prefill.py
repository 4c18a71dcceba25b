#!/usr/bin/env python3
"""KDA prefill benchmark: cula's fused SM90 kernel side by side with FLA's Triton ``chunk_kda``.

One process, identical inputs and options for both, CUDA-event medians after warm-up:

* **eager**: each timed call starts from an idle GPU (synchronise, record a start event, call,
  record an end event), so host overhead (Python, validation, launches) counts;
* **graph**: the same call captured once per input set in a CUDA graph and replayed (a capture
  failure is recorded as "not capturable: <reason>" and the row keeps its eager numbers);
* small problems rotate over several input sets so that the working set exceeds the L2 cache.

Every row also carries the relative L2 error of o and of the final state of both kernels against
the fp32 token-by-token recurrence (``cula.kda.reference.kda_recurrent_reference``) and two floors
measured in the same run:

* HBM floor = bytes that must move (read q, k, v, g, beta, A_log, dt_bias and the initial state
  once; write o and the final state) / device-to-device copy bandwidth (bytes read + written);
* tensor-core floor = matmul flops of the chunked algorithm (chunk C = 64, per chunk of length c
  per value head: A_qk 2c^2K, A_kk 2c^2K, w 2c^2K, u 2c^2V, w.S 2cKV, q.S 2cKV, A_qk.v_new
  2c^2V, state update 2cKV; the 64x64 triangular inverse, gates and norms are not counted) /
  the bf16 rate of a torch.matmul 8192^3.

Without an SM90 GPU the script runs the reference backend of ``kda_prefill`` on a small problem
on the CPU, checks it against the fp64 recurrence, and says plainly what was not run and why.

    python benchmarks/bench_kda_prefill.py            # full default suite on Hopper; CPU check elsewhere
    python benchmarks/bench_kda_prefill.py --quick    # a handful of rows
    python benchmarks/bench_kda_prefill.py --save     # + benchmarks/results/<device>-<date>.{json,md,png}
    python benchmarks/bench_kda_prefill.py --help

Exit status: 0 when every error check passed, 1 when a cula error check failed (or cula raised
on a supported configuration, or two identical calls differed), 2 when the check could not run.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

CHUNK = 64                 # the chunk length of both implementations (flop count)
LOWER_BOUND = -5.0         # gate lower bound (safe_gate range)
DEFAULT_TOL = 5e-3         # DESIGN section 6: relative L2 error of o and final state
GIB = 1024 ** 3


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# configurations
# ------------------------------------------------------------------------------------------------


@dataclass
class Config:
    mode: str                       # fixed | gva | varlen | small | cpu
    B: int
    T: int                          # tokens per batch row (varlen: total tokens, B == 1)
    H: int
    HV: int
    D: int = 128
    lens: list[int] | None = None   # varlen sequence lengths (host), None for fixed length
    dist: str = ""                  # varlen distribution name

    @property
    def N(self) -> int:
        return len(self.lens) if self.lens is not None else self.B

    @property
    def seq_lens(self) -> list[int]:
        return list(self.lens) if self.lens is not None else [self.T] * self.B

    @property
    def name(self) -> str:
        heads = f"H{self.H}" if self.H == self.HV else f"H{self.H}/HV{self.HV}"
        d = "" if self.D == 128 else f" D{self.D}"
        if self.lens is not None:
            return f"varlen {self.dist} N{self.N} T{self.T} {heads}{d}"
        return f"B{self.B} T{self.T} {heads}{d}"


def varlen_lengths(dist: str, n: int, total: int, seed: int) -> list[int]:
    """Sequence lengths (each >= 1) summing to ``total``.

    uniform: equal lengths (the remainder spread over the first sequences);
    random:  n - 1 cut points drawn uniformly without replacement from 1..total-1;
    skewed:  lengths proportional to 1/(i+1)^2 (the longest holds ~60% of the tokens), in a
             shuffled order, so one long sequence dominates (tests longest-first scheduling).
    """
    if n > total:
        raise ValueError(f"{n} sequences do not fit in {total} tokens")
    rng = random.Random(f"{seed}-{dist}-{n}-{total}")
    if dist == "uniform":
        base, rem = divmod(total, n)
        return [base + (1 if i < rem else 0) for i in range(n)]
    if dist == "random":
        cuts = sorted(rng.sample(range(1, total), n - 1))
        edges = [0] + cuts + [total]
        return [b - a for a, b in zip(edges, edges[1:])]
    if dist == "skewed":
        w = [1.0 / (i + 1) ** 2 for i in range(n)]
        s = sum(w)
        lens = [max(1, int(total * x / s)) for x in w]
        lens[0] += total - sum(lens)
        rng.shuffle(lens)
        return lens
    raise ValueError(f"unknown varlen distribution {dist!r}")


def _int_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def build_suite(args: argparse.Namespace) -> list[Config]:
    D = args.dim
    fixed_B = _int_list(args.batch) or [1, 2, 8]
    fixed_T = _int_list(args.seqlen) or [1024, 4096, 8192, 16384]
    H_def = args.heads or 64
    HV_def = args.hv or H_def
    cfgs: list[Config] = []

    if args.quick:
        cfgs += [
            Config("fixed", 2, 8192, H_def, HV_def, D),
            Config("fixed", 1, 8192, H_def, HV_def, D),
            Config("gva", 2, 8192, args.heads or 16, args.hv or 64, D),
            Config("varlen", 1, 8192, H_def, HV_def, D,
                   varlen_lengths("random", 20, 8192, args.seed), "random"),
            Config("small", 1, 32768, args.heads or 8, args.hv or args.heads or 8, D),
        ]
        return cfgs

    modes = ["fixed", "gva", "varlen", "small"] if args.mode == "all" else [args.mode]
    if "fixed" in modes:
        for B in fixed_B:
            for T in fixed_T:
                cfgs.append(Config("fixed", B, T, H_def, HV_def, D))
    if "gva" in modes:
        if args.heads:
            pairs = [(args.heads, args.hv or 64)]
        else:
            pairs = [(32, 64), (16, 64), (8, 64)]
            if args.hv:
                pairs = [(h * args.hv // 64, args.hv) for h, _ in pairs]
        for H, HV in pairs:
            if H >= 1 and HV % H == 0:
                cfgs.append(Config("gva", 2, 8192, H, HV, D))
    if "varlen" in modes:
        for total in [4096, 8192, 16384]:
            for n in [10, 20, 100]:
                for dist in ["uniform", "random", "skewed"]:
                    cfgs.append(Config("varlen", 1, total, H_def, HV_def, D,
                                       varlen_lengths(dist, n, total, args.seed), dist))
    if "small" in modes:
        for T, H in [(32768, 8), (65536, 4)]:
            h = args.heads or H
            cfgs.append(Config("small", 1, T, h, args.hv or h, D))
    return cfgs


# ------------------------------------------------------------------------------------------------
# inputs, options, floors
# ------------------------------------------------------------------------------------------------


@dataclass
class Options:
    l2norm: bool = True
    gate_in_kernel: bool = True
    initial_state: bool = False
    state_layout: str = "kv"
    beta_dtype: torch.dtype = torch.float32
    lower_bound: float = LOWER_BOUND

    def describe(self) -> str:
        gate = ("use_gate_in_kernel=True (lower_bound*sigmoid(exp(A_log)*(g+dt_bias))), A_log, dt_bias"
                if self.gate_in_kernel else "precomputed gates in [lower_bound, 0)")
        return (f"safe_gate=True, lower_bound={self.lower_bound}, {gate}, "
                f"use_qk_l2norm_in_kernel={self.l2norm}, output_final_state=True, "
                f"initial_state={'random fp32' if self.initial_state else 'None'}, "
                f"state_layout={self.state_layout!r}, beta {str(self.beta_dtype).replace('torch.', '')}, "
                f"scale=K**-0.5")


def make_inputs(cfg: Config, opt: Options, device: torch.device, dtype: torch.dtype,
                gen: torch.Generator, cu: torch.Tensor | None) -> dict[str, Any]:
    """Random inputs. q, k, v ~ N(0,1); raw g ~ N(0,1); A_log = log U(1,16); dt_bias ~ 0.5 N(0,1);
    beta = sigmoid(N(0,1)); initial state (if asked) ~ 0.1 N(0,1). Precomputed gates (without the
    gate in kernel) are lower_bound * sigmoid(N(0,1))."""
    B, T, H, HV, D = cfg.B, cfg.T, cfg.H, cfg.HV, cfg.D

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    x: dict[str, Any] = {}
    x["q"] = randn(B, T, H, D)
    x["k"] = randn(B, T, H, D)
    x["v"] = randn(B, T, HV, D)
    if opt.gate_in_kernel:
        x["g"] = randn(B, T, HV, D)
        x["A_log"] = torch.empty(HV, device=device).uniform_(1.0, 16.0, generator=gen).log()
        x["dt_bias"] = 0.5 * torch.randn(HV * D, generator=gen, device=device)
    else:
        x["g"] = (opt.lower_bound * torch.sigmoid(randn(B, T, HV, D, dt=torch.float32))).to(dtype)
        x["A_log"] = None
        x["dt_bias"] = None
    x["beta"] = torch.sigmoid(randn(B, T, HV, dt=torch.float32)).to(opt.beta_dtype)
    x["h0"] = (0.1 * randn(cfg.N, HV, D, D, dt=torch.float32)) if opt.initial_state else None
    x["cu"] = cu
    return x


def input_bytes(cfg: Config, opt: Options, act_bytes: int = 2) -> int:
    """Minimal HBM traffic of one call: each input read once, each output written once."""
    tok = cfg.B * cfg.T
    D = cfg.D
    b = 2 * tok * cfg.H * D * act_bytes            # q, k
    b += tok * cfg.HV * D * act_bytes              # v
    b += tok * cfg.HV * D * act_bytes              # g
    b += tok * cfg.HV * torch.empty(0, dtype=opt.beta_dtype).element_size()   # beta
    if opt.gate_in_kernel:
        b += cfg.HV * 4 + cfg.HV * D * 4           # A_log, dt_bias (fp32)
    if cfg.lens is not None:
        b += (cfg.N + 1) * 8                       # cu_seqlens (int64)
    if opt.initial_state:
        b += cfg.N * cfg.HV * D * D * 4            # initial state (fp32)
    return b


def output_bytes(cfg: Config, act_bytes: int = 2) -> int:
    return cfg.B * cfg.T * cfg.HV * cfg.D * act_bytes + cfg.N * cfg.HV * cfg.D * cfg.D * 4


def chunked_flops(cfg: Config) -> int:
    """Matmul flops of the chunked algorithm (see the module docstring), summed over sequences,
    their chunks (the last one of length c = L mod 64) and value heads."""
    K = V = cfg.D
    total = 0
    for L in cfg.seq_lens:
        full, rem = divmod(L, CHUNK)
        for c, cnt in ((CHUNK, full), (rem, 1 if rem else 0)):
            per = 2 * c * c * (3 * K + 2 * V) + 6 * c * K * V
            total += cnt * per
    return total * cfg.HV


# ------------------------------------------------------------------------------------------------
# environment
# ------------------------------------------------------------------------------------------------


def git_commit() -> str:
    """Env COMMIT, else `git rev-parse HEAD` (+dirty when tracked files changed), else unknown."""
    env = os.environ.get("COMMIT")
    if env:
        return env
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=10)
        sha = r.stdout.strip()
        if r.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", sha):
            return "unknown (no git history here; set COMMIT=<sha>)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:
        return "unknown (git failed; set COMMIT=<sha>)"


def _version(mod: str, dist: str | None = None, do_import: bool = True) -> str | None:
    if dist and not do_import:
        try:
            from importlib.metadata import version
            return version(dist)
        except Exception:
            return None
    try:
        m = importlib.import_module(mod)
        v = getattr(m, "__version__", None)
        if v:
            return str(v)
    except Exception:
        pass
    if dist:
        try:
            from importlib.metadata import version
            return version(dist)
        except Exception:
            pass
    return None


@dataclass
class Env:
    device: torch.device
    device_name: str
    sm90: bool
    why_not_sm90: str = ""
    cula_prefill: Callable | None = None
    cula_why_not: str = ""
    fla_chunk_kda: Callable | None = None
    fla_why_not: str = ""
    fla_beta_dtype: torch.dtype | None = None
    reference: Callable | None = None
    reference_why_not: str = ""
    statements: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


def load_reference(env: Env) -> None:
    try:
        from cula.kda.reference import kda_recurrent_reference
        env.reference = kda_recurrent_reference
    except Exception as exc:
        env.reference_why_not = f"cula.kda.reference could not be imported ({type(exc).__name__}: {exc})"


def load_cula(env: Env) -> None:
    try:
        from cula.kda import kda_prefill
    except Exception as exc:
        env.cula_why_not = f"cula.kda could not be imported ({type(exc).__name__}: {exc})"
        return
    env.cula_prefill = kda_prefill


def cula_kernels_reason() -> str:
    try:
        import cula
        if cula.kernels_available():
            return ""
        return cula.kernels_unavailable_reason()
    except Exception as exc:
        return f"cula could not be imported ({type(exc).__name__}: {exc})"


def load_fla(env: Env) -> None:
    try:
        from fla.ops.kda import chunk_kda
        env.fla_chunk_kda = chunk_kda
    except Exception as exc:
        env.fla_why_not = (f"FLA (fla-core) is not installed or failed to import "
                           f"({type(exc).__name__}: {exc}); `pip install fla-core==0.6.0`")


# ------------------------------------------------------------------------------------------------
# calls
# ------------------------------------------------------------------------------------------------


def cula_call(fn: Callable, x: dict[str, Any], opt: Options, backend: str = "sm90"):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=None, initial_state=x["h0"],
              output_final_state=True, cu_seqlens=x["cu"], use_qk_l2norm_in_kernel=opt.l2norm,
              use_gate_in_kernel=opt.gate_in_kernel, A_log=x["A_log"], dt_bias=x["dt_bias"],
              safe_gate=True, lower_bound=opt.lower_bound if opt.gate_in_kernel else None,
              state_layout=opt.state_layout, backend=backend)


def fla_call(fn: Callable, x: dict[str, Any], opt: Options):
    beta = x.get("beta_fla", x["beta"])
    return fn(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=beta, scale=None,
              initial_state=x["h0"], output_final_state=True,
              use_qk_l2norm_in_kernel=opt.l2norm, use_gate_in_kernel=opt.gate_in_kernel,
              A_log=x["A_log"], dt_bias=x["dt_bias"], safe_gate=True,
              lower_bound=opt.lower_bound if opt.gate_in_kernel else None,
              state_v_first=opt.state_layout == "vk", cu_seqlens=x["cu"])


def reference_call(fn: Callable, x: dict[str, Any], opt: Options, dtype: torch.dtype):
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=None, initial_state=x["h0"],
              output_final_state=True, cu_seqlens=x["cu"], use_qk_l2norm_in_kernel=opt.l2norm,
              use_gate_in_kernel=opt.gate_in_kernel, A_log=x["A_log"], dt_bias=x["dt_bias"],
              lower_bound=opt.lower_bound if opt.gate_in_kernel else None,
              state_layout=opt.state_layout, dtype=dtype)


def rel_err(a: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if a is None or ref is None:
        return float("nan")
    d = a.float() - ref.float()
    num = torch.linalg.vector_norm(d, dtype=torch.float64).item()
    den = torch.linalg.vector_norm(ref, dtype=torch.float64).item()
    if not math.isfinite(num):
        return float("nan")
    return num / max(den, 1e-30)


def first_line(exc: BaseException, n: int = 200) -> str:
    s = f"{type(exc).__name__}: {exc}".strip().splitlines()
    s = s[0] if s else type(exc).__name__
    return s if len(s) <= n else s[: n - 3] + "..."


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------


def _n_reps(est_ms: float, min_time_s: float, min_reps: int, max_reps: int) -> int:
    if est_ms <= 0:
        return max_reps
    return int(max(min_reps, min(max_reps, math.ceil(min_time_s * 1e3 / est_ms))))


def time_calls(calls: list[Callable[[], Any]], args: argparse.Namespace) -> tuple[float, int]:
    """Median ms of single calls, each from an idle GPU, cycling over ``calls`` (input sets)."""
    for i in range(args.warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    # estimate
    t0 = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    reps = _n_reps(est, args.min_time, args.min_reps, args.max_reps)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        torch.cuda.synchronize()
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), reps


def capture_graphs(calls: list[Callable[[], Any]]) -> list[tuple[torch.cuda.CUDAGraph, Any]]:
    """One CUDA graph per input set, sharing one memory pool (replayed one at a time)."""
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for c in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = c()
        graphs.append((g, out))
    torch.cuda.synchronize()
    return graphs


def time_graphs(graphs: list[tuple[torch.cuda.CUDAGraph, Any]], args: argparse.Namespace) -> tuple[float, int]:
    return time_calls([g.replay for g, _ in graphs], args)


def measure_copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (statistics.median(times) * 1e-3)


def measure_gemm_rate(device: torch.device, n: int = 8192) -> float:
    """Flop/s of torch.matmul on n x n x n bf16 (2 n^3 flops)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        c = a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        c = a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    del a, b, c
    torch.cuda.empty_cache()
    return 2 * n ** 3 / (statistics.median(times) * 1e-3)


# ------------------------------------------------------------------------------------------------
# accuracy check: a stated slice of the problem
# ------------------------------------------------------------------------------------------------


@dataclass
class Slice:
    full: bool
    desc: str
    n_seqs: int
    tokens: int                      # tokens per sequence cut (min with each length)
    x: dict[str, Any] | None = None  # sliced inputs (None when full)

    def take_o(self, o: torch.Tensor, cfg: Config) -> torch.Tensor:
        """The slice's rows of an output of the full problem (exact by causality: o_t depends on
        tokens <= t only, and every sequence starts from its own initial state)."""
        if self.full:
            return o
        if cfg.lens is None:
            return o[: self.n_seqs, : self.tokens]
        parts, start = [], 0
        for L in cfg.lens[: self.n_seqs]:
            parts.append(o[:, start: start + min(L, self.tokens)])
            start += L
        return torch.cat(parts, dim=1)


def ref_bytes(tokens: int, cfg: Config) -> int:
    """Rough device memory of the fp32 reference: q, k (expanded to HV), g, v, o in fp32, x2."""
    return tokens * cfg.HV * (3 * cfg.D + 2 * cfg.D) * 4 * 2


def plan_slice(cfg: Config, x: dict[str, Any], args: argparse.Namespace) -> Slice:
    lens = cfg.seq_lens
    tc = args.check_tokens if args.check_tokens > 0 else max(lens)
    budget = args.check_mem_gib * GIB
    ns = len(lens)
    while ns > 1 and ref_bytes(sum(min(L, tc) for L in lens[:ns]), cfg) > budget:
        ns -= 1
    while tc > CHUNK and ref_bytes(sum(min(L, tc) for L in lens[:ns]), cfg) > budget:
        tc = max(CHUNK, tc // 2)
    full = ns == len(lens) and all(L <= tc for L in lens)
    if full:
        return Slice(True, "full problem", ns, max(lens))
    checked = sum(min(L, tc) for L in lens[:ns])
    desc = (f"first {min(tc, max(lens[:ns]))} tokens of {ns}/{len(lens)} sequences "
            f"({checked} tokens), all heads")
    if cfg.lens is None:
        t = min(tc, cfg.T)
        sx = {k: (v[:ns, :t].contiguous() if isinstance(v, torch.Tensor) and k in
                  ("q", "k", "v", "g", "beta", "beta_fla") else v) for k, v in x.items()}
        sx["h0"] = x["h0"][:ns].contiguous() if x["h0"] is not None else None
        sx["cu"] = None
    else:
        starts = [0]
        for L in cfg.lens[:-1]:
            starts.append(starts[-1] + L)
        pieces = [(s, min(L, tc)) for s, L in zip(starts[:ns], cfg.lens[:ns])]
        sx = {}
        for k, v in x.items():
            if k in ("q", "k", "v", "g", "beta", "beta_fla"):
                sx[k] = torch.cat([v[:, s: s + n] for s, n in pieces], dim=1).contiguous()
            else:
                sx[k] = v
        cu = [0]
        for _, n in pieces:
            cu.append(cu[-1] + n)
        sx["cu"] = torch.tensor(cu, device=x["q"].device, dtype=x["cu"].dtype)
        sx["h0"] = x["h0"][:ns].contiguous() if x["h0"] is not None else None
    return Slice(False, desc, ns, tc, sx)


# ------------------------------------------------------------------------------------------------
# one configuration on the GPU
# ------------------------------------------------------------------------------------------------


def estimate_bytes(cfg: Config, opt: Options, n_sets: int, args: argparse.Namespace) -> int:
    """Device memory a row needs: input sets + outputs of both kernels (eager + graph), FLA's
    intermediates (~3.5 KiB per token and value head: gate cumsum fp32, A_qk/A_kk fp32, w, u,
    k_g, v_new, per-chunk states, l2-normalised q/k), the reference slice."""
    one = input_bytes(cfg, opt) + output_bytes(cfg)
    tok_heads = cfg.B * cfg.T * cfg.HV
    fla_ws = int(3.5 * 1024 * tok_heads) if not args.no_fla else 0
    ref = args.check_mem_gib * GIB if not args.no_check else 0
    return n_sets * one + 4 * output_bytes(cfg) + fla_ws + ref


def run_config(cfg: Config, env: Env, opt: Options, args: argparse.Namespace,
               hbm_bw: float | None, gemm_rate: float | None) -> dict[str, Any]:
    t_row = time.perf_counter()
    row = _run_config(cfg, env, opt, args, hbm_bw, gemm_rate)
    row["wall_s"] = time.perf_counter() - t_row
    return row


def _run_config(cfg: Config, env: Env, opt: Options, args: argparse.Namespace,
                hbm_bw: float | None, gemm_rate: float | None) -> dict[str, Any]:
    dev = env.device
    row: dict[str, Any] = {
        "config": cfg.name, "mode": cfg.mode, "B": cfg.B, "T": cfg.T, "H": cfg.H, "HV": cfg.HV,
        "D": cfg.D, "N": cfg.N, "status": "ok", "notes": [],
    }
    if cfg.lens is not None:
        row.update(dist=cfg.dist, min_len=min(cfg.lens), max_len=max(cfg.lens))
    hbm = input_bytes(cfg, opt) + output_bytes(cfg)
    flops = chunked_flops(cfg)
    row["hbm_bytes"] = hbm
    row["flops"] = flops
    row["hbm_floor_ms"] = hbm / hbm_bw * 1e3 if hbm_bw else None
    row["tc_floor_ms"] = flops / gemm_rate * 1e3 if gemm_rate else None

    # how many input sets: rotate until the working set exceeds a few times the L2 cache
    set_bytes = input_bytes(cfg, opt) + output_bytes(cfg)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * 1024 * 1024)
    n_sets = max(1, min(args.max_sets, math.ceil(3 * l2 / max(set_bytes, 1))))
    row["sets"] = n_sets

    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(dev)
    need = estimate_bytes(cfg, opt, n_sets, args)
    row["est_mem_gib"] = round(need / GIB, 2)
    if need > 0.92 * free:
        row["status"] = "skipped"
        row["notes"].append(f"skipped: needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB free")
        return row

    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    cu = None
    if cfg.lens is not None:
        c = [0]
        for L in cfg.lens:
            c.append(c[-1] + L)
        # one cu_seqlens object shared by all input sets (FLA caches chunk indices per object)
        cu = torch.tensor(c, device=dev, dtype=torch.int64)
    sets = [make_inputs(cfg, opt, dev, torch.bfloat16, gen, cu) for _ in range(n_sets)]
    if env.fla_beta_dtype is not None and env.fla_beta_dtype != opt.beta_dtype:
        for x in sets:
            x["beta_fla"] = x["beta"].to(env.fla_beta_dtype)

    impls: list[tuple[str, Callable[[dict[str, Any]], Any]]] = []
    if env.cula_prefill is not None and not args.no_cula:
        impls.append(("cula", lambda x: cula_call(env.cula_prefill, x, opt)))
    if env.fla_chunk_kda is not None and not args.no_fla:
        impls.append(("fla", lambda x: fla_call(env.fla_chunk_kda, x, opt)))

    outs: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for name, fn in impls:
        calls = [(lambda x=x: fn(x)) for x in sets]
        try:
            t_first = time.perf_counter()
            o, st = fn(sets[0])
            torch.cuda.synchronize()
            row[f"{name}_first_call_s"] = time.perf_counter() - t_first   # compile / autotune
            outs[name] = (o, st)
            if name == "cula":
                o2, st2 = fn(sets[0])
                torch.cuda.synchronize()
                same = torch.equal(o, o2) and (st is None or torch.equal(st, st2))
                row["cula_deterministic"] = bool(same)
                if not same:
                    row["notes"].append("cula: two identical calls gave different results")
                del o2, st2
            ms, reps = time_calls(calls, args)
            row[f"{name}_ms"] = ms
            row["reps"] = reps
        except torch.cuda.OutOfMemoryError as exc:
            row[f"{name}_error"] = "out of memory"
            row["notes"].append(f"{name}: skipped, out of memory ({first_line(exc, 120)})")
            outs.pop(name, None)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        except Exception as exc:
            row[f"{name}_error"] = first_line(exc)
            row["notes"].append(f"{name}: raised {first_line(exc)}")
            if args.verbose:
                traceback.print_exc()
            outs.pop(name, None)
            continue
        if args.no_graph:
            continue
        graphs = None
        try:
            graphs = capture_graphs(calls)
            gms, _ = time_graphs(graphs, args)
            row[f"{name}_graph_ms"] = gms
            go, gst = graphs[0][1]
            if name == "cula" and not (torch.equal(go, o) and (st is None or torch.equal(gst, st))):
                row["cula_deterministic"] = False
                row["notes"].append("cula: graph replay differs from the eager call")
            go = gst = None
        except Exception as exc:
            row[f"{name}_graph"] = f"not capturable: {first_line(exc)}"
            row["notes"].append(f"{name} graph: not capturable: {first_line(exc)}")
            try:
                torch.cuda.synchronize()
            except Exception as exc2:  # a sticky error: nothing later can run
                row["notes"].append(f"CUDA context broken after capture: {first_line(exc2)}")
                raise
        finally:
            del graphs
            gc.collect()
            torch.cuda.empty_cache()

    # speedups and floors
    for mode in ("", "_graph"):
        c, f = row.get(f"cula{mode}_ms"), row.get(f"fla{mode}_ms")
        if c and f:
            row[f"speedup{mode}"] = f / c
    for name in ("cula", "fla"):
        if row.get(f"{name}_ms") and row["hbm_floor_ms"]:
            row[f"{name}_hbm_ratio"] = row[f"{name}_ms"] / row["hbm_floor_ms"]
        if row.get(f"{name}_graph_ms") and row["hbm_floor_ms"]:
            row[f"{name}_graph_hbm_ratio"] = row[f"{name}_graph_ms"] / row["hbm_floor_ms"]

    # accuracy against the fp32 recurrence
    if args.no_check or env.reference is None or not outs:
        row["check"] = ("not run: " + ("--no-check" if args.no_check else
                        env.reference_why_not if env.reference is None else "no kernel ran"))
    else:
        t0 = time.perf_counter()
        try:
            sl = plan_slice(cfg, sets[0], args)
            row["check"] = sl.desc
            rx = sets[0] if sl.full else sl.x
            ref_o, ref_s = reference_call(env.reference, rx, opt, torch.float32)
            for name, fn in impls:
                if name not in outs:
                    continue
                o, st = outs[name]
                row[f"{name}_err_o"] = rel_err(sl.take_o(o, cfg), ref_o)
                if sl.full:
                    row[f"{name}_err_state"] = rel_err(st, ref_s)
                else:
                    so, sst = fn(sl.x)
                    row[f"{name}_err_state"] = rel_err(sst, ref_s)
                    row[f"{name}_err_o_slice_run"] = rel_err(so, ref_o)
                    del so, sst
            del ref_o, ref_s, sl, rx
        except torch.cuda.OutOfMemoryError as exc:
            row["check"] = f"not run: out of memory ({first_line(exc, 100)})"
        except Exception as exc:
            row["check"] = f"failed: {first_line(exc)}"
            row["notes"].append(f"check raised {first_line(exc)}")
            if args.verbose:
                traceback.print_exc()
        row["check_s"] = time.perf_counter() - t0

    # verdict for cula
    errs = [row.get(k) for k in ("cula_err_o", "cula_err_state", "cula_err_o_slice_run")
            if k in row]
    bad = [e for e in errs if e is None or not math.isfinite(e) or e > args.tol]
    if bad:
        row["status"] = "FAIL"
        row["notes"].append(f"cula error above tol {args.tol:g} (or NaN)")
    if row.get("cula_deterministic") is False:
        row["status"] = "FAIL"
    if "cula_error" in row and row["cula_error"] != "out of memory":
        row["status"] = "FAIL"
    fla_errs = [row.get(k) for k in ("fla_err_o", "fla_err_state") if k in row]
    if any(e is None or not math.isfinite(e) or e > args.tol for e in fla_errs):
        row["notes"].append(f"FLA error above {args.tol:g} (informational)")

    del sets, outs
    gc.collect()
    torch.cuda.empty_cache()
    return row


def progress_line(i: int, n: int, row: dict[str, Any]) -> str:
    def ms(v):
        return f"{v:.3f}" if isinstance(v, (int, float)) else "-"

    def e(v):
        return f"{v:.1e}" if isinstance(v, (int, float)) and v == v else "-"

    def x(v):
        return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"

    s = (f"[{i}/{n}] {row['config']:<34} {row['status']:<7} "
         f"cula {ms(row.get('cula_ms'))} ms (graph {ms(row.get('cula_graph_ms'))}) | "
         f"FLA {ms(row.get('fla_ms'))} ms (graph {ms(row.get('fla_graph_ms'))}) | "
         f"speedup {x(row.get('speedup'))} (graph {x(row.get('speedup_graph'))}) | "
         f"err o/S cula {e(row.get('cula_err_o'))}/{e(row.get('cula_err_state'))} "
         f"FLA {e(row.get('fla_err_o'))}/{e(row.get('fla_err_state'))} | "
         f"HBM floor {ms(row.get('hbm_floor_ms'))} ms, TC floor {ms(row.get('tc_floor_ms'))} ms")
    if "wall_s" in row:
        s += (f" | {row['wall_s']:.0f} s (first call: cula {ms(row.get('cula_first_call_s'))} s, "
              f"FLA {ms(row.get('fla_first_call_s'))} s; check {ms(row.get('check_s'))} s)")
    if row.get("notes"):
        s += "\n      " + "; ".join(row["notes"])
    return s


# ------------------------------------------------------------------------------------------------
# reports
# ------------------------------------------------------------------------------------------------


def _f(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—" if v is None else "nan"
    return format(v, fmt)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], statements: list[str]) -> str:
    L = []
    L.append(f"# KDA prefill: cula vs FLA chunk_kda — {meta.get('device', '?')}")
    L.append("")
    L.append(f"- date: {meta.get('date')}, commit: `{meta.get('commit')}`")
    L.append(f"- torch {meta.get('torch')}, triton {meta.get('triton')}, FLA {meta.get('fla')}, "
             f"cula {meta.get('cula')}, CUDA {meta.get('cuda')}, Python {meta.get('python')}")
    if meta.get("copy_bandwidth_GBps"):
        L.append(f"- measured copy bandwidth (read + write): {meta['copy_bandwidth_GBps']:.0f} GB/s; "
                 f"bf16 GEMM 8192^3: {meta['gemm_TFLOPs']:.0f} TFLOP/s")
    if meta.get("options"):
        L.append(f"- options (both kernels): {meta['options']}")
    if meta.get("fla_beta_dtype"):
        L.append(f"- beta given to FLA: {meta['fla_beta_dtype']}")
    if meta.get("method"):
        L.append(f"- method: {meta['method']}")
    if meta.get("varlen_note"):
        L.append(f"- {meta['varlen_note']}")
    for s in statements:
        L.append(f"- {s}")
    L.append("")
    if rows:
        L.append("| config | cula ms | FLA ms | speedup | cula graph ms | FLA graph ms | speedup graph "
                 "| err o cula | err S cula | err o FLA | err S FLA | HBM floor ms | cula/HBM | FLA/HBM "
                 "| TC floor ms | check | status |")
        L.append("|" + "---|" * 17)
        for r in rows:
            L.append("| " + " | ".join([
                r["config"],
                _f(r.get("cula_ms"), ".3f"), _f(r.get("fla_ms"), ".3f"),
                _f(r.get("speedup"), ".2f"),
                _f(r.get("cula_graph_ms"), ".3f"), _f(r.get("fla_graph_ms"), ".3f"),
                _f(r.get("speedup_graph"), ".2f"),
                _f(r.get("cula_err_o"), ".1e"), _f(r.get("cula_err_state"), ".1e"),
                _f(r.get("fla_err_o"), ".1e"), _f(r.get("fla_err_state"), ".1e"),
                _f(r.get("hbm_floor_ms"), ".3f"),
                _f(r.get("cula_hbm_ratio"), ".2f"), _f(r.get("fla_hbm_ratio"), ".2f"),
                _f(r.get("tc_floor_ms"), ".3f"),
                str(r.get("check", "—")), r.get("status", ""),
            ]) + " |")
        notes = [(r["config"], n) for r in rows for n in r.get("notes", [])]
        if notes:
            L.append("")
            L.append("Notes:")
            L.append("")
            for c, n in notes:
                L.append(f"- {c}: {n}")
    L.append("")
    return "\n".join(L)


def plot(path: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> str | None:
    """Bar chart of speedup (FLA ms / cula ms) per configuration, eager and graph, 1.0 marked.
    Returns None on success, else why it was not written."""
    pts = [r for r in rows if r.get("speedup") or r.get("speedup_graph")]
    if not pts:
        return "no row has a speedup (cula and FLA did not both run)"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib unavailable ({first_line(exc)})"
    n = len(pts)
    fig, ax = plt.subplots(figsize=(max(9.0, 0.5 * n + 3), 5.5))
    xs = list(range(n))
    w = 0.4
    top = max([r.get("speedup") or 0.0 for r in pts] + [r.get("speedup_graph") or 0.0 for r in pts] + [1.0])
    for off, key, label, color in ((-w / 2, "speedup", "eager", "#4C72B0"),
                                   (w / 2, "speedup_graph", "CUDA graph", "#DD8452")):
        vals = [r.get(key) for r in pts]
        bars = ax.bar([x + off for x in xs], [v or 0.0 for v in vals], w, label=label, color=color)
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, (v or 0.0) + 0.01 * top,
                    f"{v:.2f}" if v else "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="1.0 (parity)")
    ax.set_ylim(0, top * 1.3)
    ax.set_xticks(xs)
    ax.set_xticklabels([r["config"] for r in pts], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("speedup (FLA ms / cula ms)")
    commit = str(meta.get("commit", ""))[:12]
    ax.set_title(f"KDA prefill: cula kda_prefill vs FLA {meta.get('fla')} chunk_kda\n"
                 f"{meta.get('device')}, {meta.get('date')}, commit {commit}", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "device"


def write_reports(args: argparse.Namespace, meta: dict[str, Any], rows: list[dict[str, Any]],
                  statements: list[str]) -> None:
    json_path, md_path, png_path = args.json, args.md, args.plot
    if args.save:
        base = os.path.join(args.results_dir, f"{slug(meta.get('device', 'device'))}-{meta['date']}")
        json_path = json_path or base + ".json"
        md_path = md_path or base + ".md"
        png_path = png_path or base + ".png"
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as fh:
            json.dump({"meta": meta, "statements": statements, "rows": rows}, fh, indent=1,
                      default=str)
        log(f"wrote {json_path}")
    if md_path:
        os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
        with open(md_path, "w") as fh:
            fh.write(markdown(meta, rows, statements))
        log(f"wrote {md_path}")
    if png_path:
        why = plot(png_path, meta, rows)
        log(f"wrote {png_path}" if why is None else f"plot not written: {why}")


# ------------------------------------------------------------------------------------------------
# main paths
# ------------------------------------------------------------------------------------------------


def base_meta(env: Env, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "device": env.device_name,
        "date": os.environ.get("BENCH_DATE") or _dt.date.today().isoformat(),
        "datetime_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": _version("triton", "triton", do_import="triton" in sys.modules),
        "fla": _version("fla", "fla-core", do_import="fla" in sys.modules),
        "cula": _version("cula"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "argv": sys.argv[1:],
    }


def cpu_path(env: Env, args: argparse.Namespace) -> int:
    """No SM90 GPU: reference backend on a small problem vs the fp64 recurrence."""
    log(f"No SM90 GPU: {env.why_not_sm90}.")
    statements = [f"No SM90 GPU ({env.why_not_sm90}): the cula sm90 kernel, FLA's Triton chunk_kda, "
                  "the CUDA-graph timings and the HBM/tensor-core floors were not run."]
    kr = cula_kernels_reason()
    statements.append(f"cula extension: {kr}" if kr else
                      "cula extension: built (cula._C loaded), but its kernel needs an SM90 GPU")
    if env.fla_why_not:
        statements.append(f"FLA: {env.fla_why_not}")
    else:
        statements.append(f"FLA {_version('fla', 'fla-core', do_import=False)} is installed; its Triton kernels need a "
                          "CUDA GPU, so it was not run.")
    for s in statements:
        log("  " + s)
    if env.cula_prefill is None or env.reference is None:
        why = env.cula_why_not or env.reference_why_not
        log(f"cannot run the reference check: {why}")
        return 2

    opt = Options(initial_state=True, beta_dtype=torch.float32)
    dev = torch.device("cpu")
    # Tiny per-token ops: one thread avoids the thread pool's spin-waits, which on a busy 2-core
    # machine made each op ~100x slower.
    torch.set_num_threads(1)
    D = 64
    cfgs = [Config("cpu", 1, 256, 2, 4, D),
            Config("cpu", 1, 256, 2, 4, D, [100, 1, 155], "given")]
    rows = []
    rc = 0
    log(f"reference backend on CPU (float32 inputs), options: {opt.describe()}")
    for i, cfg in enumerate(cfgs, 1):
        gen = torch.Generator(device=dev)
        gen.manual_seed(args.seed + i)
        cu = None
        if cfg.lens is not None:
            cu = torch.tensor([0] + [sum(cfg.lens[: j + 1]) for j in range(len(cfg.lens))],
                              dtype=torch.int64)
        x = make_inputs(cfg, opt, dev, torch.float32, gen, cu)
        row: dict[str, Any] = {"config": cfg.name + " (CPU, fp32, reference backend)",
                               "mode": "cpu", "B": cfg.B, "T": cfg.T, "H": cfg.H, "HV": cfg.HV,
                               "D": cfg.D, "N": cfg.N, "notes": [], "status": "ok",
                               "check": "full problem vs fp64 recurrence"}
        try:
            t0 = time.perf_counter()
            o, st = cula_call(env.cula_prefill, x, opt, backend="reference")
            row["reference_backend_ms"] = (time.perf_counter() - t0) * 1e3
            ro, rs = reference_call(env.reference, x, opt, torch.float64)
            row["cula_err_o"] = rel_err(o, ro)
            row["cula_err_state"] = rel_err(st, rs)
        except Exception as exc:
            row["status"] = "FAIL"
            row["notes"].append(f"raised {first_line(exc)}")
            traceback.print_exc()
        errs = [row.get("cula_err_o"), row.get("cula_err_state")]
        if row["status"] == "ok" and any(e is None or not math.isfinite(e) or e > args.tol for e in errs):
            row["status"] = "FAIL"
            row["notes"].append(f"error above tol {args.tol:g}")
        if row["status"] != "ok":
            rc = 1
        rows.append(row)
        e = row.get("cula_err_o"), row.get("cula_err_state")
        log(f"[{i}/{len(cfgs)}] {cfg.name:<34} {row['status']:<5} rel err o {_f(e[0], '.2e')}, "
            f"final state {_f(e[1], '.2e')} (tol {args.tol:g}); "
            f"{_f(row.get('reference_backend_ms'), '.0f')} ms"
            + ("; " + "; ".join(row["notes"]) if row["notes"] else ""))
    meta = base_meta(env, args)
    meta["options"] = opt.describe()
    meta["method"] = "CPU check only: kda_prefill(backend='reference') vs kda_recurrent_reference(dtype=float64)"
    write_reports(args, meta, rows, statements)
    log("PASS" if rc == 0 else "FAIL")
    return rc


def preflight(env: Env, opt: Options, args: argparse.Namespace) -> bool:
    """Tiny calls of both kernels: availability, and the beta dtype FLA accepts.
    Returns False when cula was expected to run but failed (counts as a failure)."""
    ok = True
    dev = env.device
    cfg = Config("pre", 1, 128, 2, 4, 128)
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    x = make_inputs(cfg, opt, dev, torch.bfloat16, gen, None)
    if env.cula_prefill is not None and not args.no_cula:
        kr = cula_kernels_reason()
        if kr:
            env.statements.append(f"cula not timed: the sm90 extension is not built or did not load ({kr})")
            env.cula_prefill = None
        else:
            try:
                cula_call(env.cula_prefill, x, opt)
                torch.cuda.synchronize()
            except Exception as exc:
                env.statements.append(f"cula not timed: a tiny kda_prefill(backend='sm90') call raised "
                                      f"{first_line(exc)}")
                env.cula_prefill = None
                ok = False
    elif env.cula_prefill is None:
        env.statements.append(f"cula not timed: {env.cula_why_not}")
    if args.no_cula:
        env.statements.append("cula not timed: --no-cula")

    if env.fla_chunk_kda is not None and not args.no_fla:
        env.fla_beta_dtype = opt.beta_dtype
        try:
            fla_call(env.fla_chunk_kda, x, opt)
            torch.cuda.synchronize()
        except Exception as exc:
            msg = first_line(exc)
            if opt.beta_dtype != torch.bfloat16:
                try:
                    x["beta_fla"] = x["beta"].to(torch.bfloat16)
                    fla_call(env.fla_chunk_kda, x, opt)
                    torch.cuda.synchronize()
                    env.fla_beta_dtype = torch.bfloat16
                    env.statements.append(f"FLA rejected beta {opt.beta_dtype} ({msg}); FLA is given "
                                          "the same beta rounded to bf16")
                except Exception as exc2:
                    env.statements.append(f"FLA not timed: a tiny chunk_kda call raised {first_line(exc2)}")
                    env.fla_chunk_kda = None
            else:
                env.statements.append(f"FLA not timed: a tiny chunk_kda call raised {msg}")
                env.fla_chunk_kda = None
    elif env.fla_chunk_kda is None:
        env.statements.append(f"FLA not timed: {env.fla_why_not}")
    if args.no_fla:
        env.statements.append("FLA not timed: --no-fla")
    return ok


def gpu_path(env: Env, args: argparse.Namespace) -> int:
    opt = Options(l2norm=not args.no_l2norm, gate_in_kernel=not args.precomputed_gate,
                  initial_state=args.initial_state, state_layout=args.state_layout,
                  beta_dtype=torch.float32 if args.beta_dtype == "fp32" else torch.bfloat16)
    torch.cuda.set_device(env.device)
    rc = 0
    with torch.inference_mode():
        if not preflight(env, opt, args):
            rc = 1
        if args.require_cula and env.cula_prefill is None:
            env.statements.append("--require-cula: cula could not be timed")
            rc = 1
        if env.reference is None:
            env.statements.append(f"errors not checked: {env.reference_why_not}")
        for s in env.statements:
            log("  " + s)
        if env.cula_prefill is None and env.fla_chunk_kda is None:
            log("neither cula nor FLA can run; nothing to time")
            meta = base_meta(env, args)
            write_reports(args, meta, [], env.statements)
            return rc or 2

        free, total = torch.cuda.mem_get_info(env.device)
        nbytes = int(min(2 * GIB, max(64 * 1024 * 1024, free // 8)))
        bw = measure_copy_bandwidth(env.device, nbytes)
        gemm = measure_gemm_rate(env.device)
        log(f"{env.device_name}: copy bandwidth {bw / 1e9:.0f} GB/s (read+write, {nbytes / GIB:.2f} GiB "
            f"buffers), bf16 GEMM 8192^3 {gemm / 1e12:.0f} TFLOP/s, {total / GIB:.0f} GiB")
        log(f"options: {opt.describe()}")

        cfgs = build_suite(args)
        if args.configs:
            pat = re.compile(args.configs)
            cfgs = [c for c in cfgs if pat.search(c.name)]
        rows = []
        t_start = time.perf_counter()
        for i, cfg in enumerate(cfgs, 1):
            if args.time_budget and time.perf_counter() - t_start > args.time_budget:
                left = [c.name for c in cfgs[i - 1:]]
                env.statements.append(f"--time-budget {args.time_budget:g} s spent: {len(left)} "
                                      f"configuration(s) not run: {', '.join(left)}")
                log(env.statements[-1])
                break
            try:
                row = run_config(cfg, env, opt, args, bw, gemm)
            except Exception as exc:
                row = {"config": cfg.name, "mode": cfg.mode, "status": "FAIL",
                       "notes": [f"benchmark raised {first_line(exc)}"]}
                traceback.print_exc()
                rows.append(row)
                log(progress_line(i, len(cfgs), row))
                break  # the CUDA context may be unusable
            rows.append(row)
            log(progress_line(i, len(cfgs), row))
            if row["status"] == "FAIL":
                rc = 1

    meta = base_meta(env, args)
    meta.update(
        copy_bandwidth_GBps=bw / 1e9, copy_buffer_bytes=nbytes, gemm_TFLOPs=gemm / 1e12,
        gpu_memory_GiB=round(total / GIB, 1), options=opt.describe(),
        fla_beta_dtype=str(env.fla_beta_dtype).replace("torch.", "") if env.fla_beta_dtype else None,
        tolerance=args.tol,
        method=("CUDA-event median of single calls, each started from an idle GPU (eager: host "
                "overhead counts; graph: one captured call replayed), after "
                f"{args.warmup} warm-up calls; >= {args.min_reps} reps or {args.min_time:g} s; "
                "small problems rotate over several input sets (column 'sets' in the JSON) to "
                "defeat the L2 cache. speedup = FLA ms / cula ms. Errors: relative L2 vs the fp32 "
                "recurrence; o from the timed call (restricted to the checked tokens, exact by "
                "causality), final state from the full call or, for a slice, a call on the slice. "
                "HBM floor = minimal bytes / measured copy bandwidth; TC floor = chunked-algorithm "
                "matmul flops / measured bf16 GEMM rate."),
        suite=args.mode if not args.quick else "quick",
        varlen_note=("varlen rows: one cu_seqlens tensor (int64) reused for every call; FLA caches "
                     "its chunk indices per cu_seqlens object (fla tensor_cache), so its per-call "
                     "index preparation is not in the eager time"),
    )
    write_reports(args, meta, rows, env.statements)
    n_fail = sum(1 for r in rows if r.get("status") == "FAIL")
    n_skip = sum(1 for r in rows if r.get("status") == "skipped")
    log(f"{len(rows)} configurations: {n_fail} failed, {n_skip} skipped. "
        + ("PASS" if rc == 0 else "FAIL"))
    return rc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="KDA prefill benchmark: cula kda_prefill(backend='sm90') vs FLA chunk_kda. "
                    "Without an SM90 GPU: a CPU check of the reference backend.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=["fixed", "gva", "varlen", "small", "all"], default="all",
                   help="suite: fixed B in {1,2,8} x T in {1k,4k,8k,16k}, H=HV=64; gva (H,HV) in "
                        "{(32,64),(16,64),(8,64)} at B=2,T=8192; varlen uniform/random/skewed x "
                        "{10,20,100} sequences x totals {4096,8192,16384}, H=HV=64; small: "
                        "(B=1,T=32768,H=HV=8), (B=1,T=65536,H=HV=4)")
    p.add_argument("--quick", action="store_true",
                   help="a handful of rows: B2 T8192 H64, B1 T8192 H64, GVA B2 T8192 H16/HV64, "
                        "varlen random N20 T8192 H64, B1 T32768 H8 (overrides --mode)")
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
    p.add_argument("--dim", type=int, default=128, help="head dim K = V (the sm90 kernel needs 128)")
    p.add_argument("--initial-state", action="store_true", help="pass a random fp32 initial state")
    p.add_argument("--state-layout", choices=["kv", "vk"], default="kv")
    p.add_argument("--beta-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--no-l2norm", action="store_true", help="use_qk_l2norm_in_kernel=False")
    p.add_argument("--precomputed-gate", action="store_true",
                   help="use_gate_in_kernel=False with gates lower_bound*sigmoid(N(0,1))")
    p.add_argument("--no-cula", action="store_true", help="time FLA only")
    p.add_argument("--require-cula", action="store_true",
                   help="exit 1 when cula cannot be timed on the SM90 GPU (e.g. extension not built)")
    p.add_argument("--no-fla", action="store_true", help="time cula only")
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
    return p.parse_args(argv)


def merge_path(args: argparse.Namespace) -> int:
    """Combine several JSON results of one device into one report. The meta of the first file is
    kept; differing device / commit / versions are refused (rows would not be comparable)."""
    metas, rows, statements = [], [], []
    for path in args.merge:
        with open(path) as fh:
            d = json.load(fh)
        metas.append(d["meta"])
        rows += d.get("rows", [])
        statements += [s for s in d.get("statements", []) if s not in statements]
    meta = dict(metas[0])
    for key in ("device", "commit", "torch", "triton", "fla", "cula", "options"):
        vals = sorted({str(m.get(key)) for m in metas})
        if len(vals) > 1:
            log(f"refusing to merge: {key} differs between the files: {vals}")
            return 2
    for key in ("copy_bandwidth_GBps", "gemm_TFLOPs"):
        vals = [m[key] for m in metas if m.get(key)]
        if vals:
            meta[key] = statistics.median(vals)
            meta[key + "_per_file"] = vals
    meta["merged_from"] = [os.path.basename(p) for p in args.merge]
    meta["suite"] = "+".join(str(m.get("suite")) for m in metas)
    if not (args.json or args.md or args.plot or args.save):
        log("--merge needs --json, --md, --plot or --save to write something")
        return 2
    write_reports(args, meta, rows, statements)
    n_fail = sum(1 for r in rows if r.get("status") == "FAIL")
    log(f"merged {len(rows)} rows from {len(args.merge)} files ({n_fail} failed)")
    return 1 if n_fail else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge_path(args)
    if torch.cuda.is_available():
        dev = torch.device(args.device)
        name = torch.cuda.get_device_name(dev)
        cap = torch.cuda.get_device_capability(dev)
        sm90 = cap == (9, 0)
        why = "" if sm90 else f"{name} has compute capability {cap[0]}.{cap[1]}, not 9.0"
    else:
        dev, name, sm90 = torch.device("cpu"), f"CPU ({platform.processor() or platform.machine()})", False
        why = "torch.cuda.is_available() is False"
    env = Env(device=dev if sm90 else torch.device("cpu"), device_name=name, sm90=sm90,
              why_not_sm90=why)
    load_reference(env)
    load_cula(env)
    if not sm90:
        # FLA's Triton kernels cannot run here; only say whether it is installed (importing it
        # costs several seconds).
        if importlib.util.find_spec("fla") is None:
            env.fla_why_not = "FLA (fla-core) is not installed; `pip install fla-core==0.6.0`"
        return cpu_path(env, args)
    load_fla(env)
    return gpu_path(env, args)


if __name__ == "__main__":
    sys.exit(main())
