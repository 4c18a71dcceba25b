"""Errors against cula's fp32 token-by-token recurrence, on a stated slice of the problem.

The reference (``cula.kda.reference.kda_recurrent_reference``) takes one step of small batched
ops per token, so long problems are cut: at most ``check_tokens`` tokens per sequence, and fewer
sequences (then fewer tokens) until its memory fits ``check_mem_gib``. o is compared on the
slice's rows of the timed call's output (exact by causality: o_t depends on tokens <= t only,
and every sequence starts from its own initial state); the final state of a cut problem comes
from a call of each kernel on the slice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from kda_bench.inputs import Inputs, Options
from kda_bench.suite import CHUNK, Config
from kda_bench.util import first_line

GIB = 1024 ** 3

ReferenceFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def load_reference() -> tuple[ReferenceFn | None, str]:
    """(kda_recurrent_reference, "") or (None, why it could not be imported)."""
    try:
        from cula.kda.reference import kda_recurrent_reference
    except Exception as exc:
        return None, f"cula.kda.reference could not be imported ({first_line(exc)})"
    return kda_recurrent_reference, ""


def reference_call(fn: ReferenceFn, x: Inputs, opt: Options,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence on ``x`` with the options, computing in ``dtype``; state in the options'
    layout."""
    return fn(x.q, x.k, x.v, x.g, x.beta, scale=None, initial_state=x.h0,
              output_final_state=True, cu_seqlens=x.cu, use_qk_l2norm_in_kernel=opt.l2norm,
              use_gate_in_kernel=opt.gate_in_kernel, A_log=x.A_log, dt_bias=x.dt_bias,
              lower_bound=opt.call_lower_bound,
              state_layout=opt.state_layout, dtype=dtype)


def rel_err(a: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """||a - ref|| / ||ref|| in fp64; NaN when either is missing or a holds NaN/Inf."""
    if a is None or ref is None:
        return float("nan")
    d = a.float() - ref.float()
    num = torch.linalg.vector_norm(d, dtype=torch.float64).item()
    den = torch.linalg.vector_norm(ref, dtype=torch.float64).item()
    if not math.isfinite(num):
        return float("nan")
    return num / max(den, 1e-30)


@dataclass
class Slice:
    """The part of a problem whose errors are checked."""

    full: bool
    desc: str
    n_seqs: int
    tokens: int                  # tokens per sequence cut (min with each length)
    x: Inputs | None = None      # sliced inputs (None when full)

    def take_o(self, o: torch.Tensor, cfg: Config) -> torch.Tensor:
        """The slice's rows of an output of the full problem."""
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


def plan_slice(cfg: Config, x: Inputs, check_tokens: int, check_mem_gib: float) -> Slice:
    """The largest prefix slice (sequences, then tokens per sequence) within the limits."""
    lens = cfg.seq_lens
    tc = check_tokens if check_tokens > 0 else max(lens)
    budget = check_mem_gib * GIB
    ns = len(lens)
    while ns > 1 and ref_bytes(sum(min(L, tc) for L in lens[:ns]), cfg) > budget:
        ns -= 1
    while tc > CHUNK and ref_bytes(sum(min(L, tc) for L in lens[:ns]), cfg) > budget:
        tc = max(CHUNK, tc // 2)
    if ns == len(lens) and all(L <= tc for L in lens):
        return Slice(True, "full problem", ns, max(lens))
    checked = sum(min(L, tc) for L in lens[:ns])
    desc = (f"first {min(tc, max(lens[:ns]))} tokens of {ns}/{len(lens)} sequences "
            f"({checked} tokens), all heads")
    h0 = x.h0[:ns].contiguous() if x.h0 is not None else None
    if cfg.lens is None:
        t = min(tc, cfg.T)
        sx = x.map_tokens(lambda a: a[:ns, :t].contiguous(), h0, None)
    else:
        starts = [0]
        for L in cfg.lens[:-1]:
            starts.append(starts[-1] + L)
        pieces = [(s, min(L, tc)) for s, L in zip(starts[:ns], cfg.lens[:ns])]
        cu = [0]
        for _, n in pieces:
            cu.append(cu[-1] + n)
        assert x.cu is not None  # a varlen config always has cu_seqlens
        sx = x.map_tokens(lambda a: torch.cat([a[:, s: s + n] for s, n in pieces], dim=1).contiguous(),
                          h0, torch.tensor(cu, device=x.q.device, dtype=x.cu.dtype))
    return Slice(False, desc, ns, tc, sx)
