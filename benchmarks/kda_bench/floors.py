"""The two floors every row is compared with, and the cost per chunk-head.

* HBM floor = bytes that must move (read q, k, v, g, beta, A_log, dt_bias, cu_seqlens and the
  initial state once; write o and the final state once) / device-to-device copy bandwidth
  (bytes read + written), measured in the same run.
* Tensor-core floor = matmul flops of the chunked algorithm (chunk C = 64, per chunk of length c
  per value head: A_qk 2c^2K, A_kk 2c^2K, w 2c^2K, u 2c^2V, w.S 2cKV, q.S 2cKV, A_qk.v_new
  2c^2V, state update 2cKV; the triangular inverse, gates and norms are not counted) / the bf16
  rate of a torch.matmul 8192^3, measured in the same run.
* SM·µs per chunk-head = time x SM count / (64-token chunks x value heads): what one
  (chunk, value head) costs the whole GPU, comparable across shapes and kernels.
"""
from __future__ import annotations

import functools
import statistics
from typing import Callable

import torch

from kda_bench.inputs import Options
from kda_bench.suite import CHUNK, Config


def input_bytes(cfg: Config, opt: Options, act_bytes: int = 2) -> int:
    """Minimal HBM traffic of the inputs: each read once."""
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
    """Minimal HBM traffic of the outputs: o (bf16) and the fp32 final state, each written once."""
    return cfg.B * cfg.T * cfg.HV * cfg.D * act_bytes + cfg.N * cfg.HV * cfg.D * cfg.D * 4


def chunked_flops(cfg: Config) -> int:
    """Matmul flops of the chunked algorithm (see the module docstring), summed over sequences,
    their chunks (the last one of length c = L mod 64) and value heads."""
    K = V = cfg.D
    total = 0
    for L in cfg.seq_lens:
        full, rem = divmod(L, CHUNK)
        for c, cnt in ((CHUNK, full), (rem, 1 if rem else 0)):
            total += cnt * (2 * c * c * (3 * K + 2 * V) + 6 * c * K * V)
    return total * cfg.HV


def sm_us_per_chunk_head(ms: float, sm_count: int, cfg: Config) -> float | None:
    """Time x SMs / (chunks x HV) in SM·µs; None for a problem without tokens."""
    units = cfg.chunks * cfg.HV
    return ms * 1e3 * sm_count / units if units else None


def _event_median_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """Median CUDA-event time of ``fn`` after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def measure_copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = _event_median_ms(functools.partial(dst.copy_, src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def measure_gemm_rate(device: torch.device, n: int = 8192) -> float:
    """Flop/s of torch.matmul on n x n x n bf16 (2 n^3 flops)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = _event_median_ms(functools.partial(torch.matmul, a, b))
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / (ms * 1e-3)
