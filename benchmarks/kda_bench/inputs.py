"""Options shared by every kernel, and the random inputs of one configuration.

Beta is drawn once, as logits rounded to bf16: FlashKDA takes those logits (it applies the sigmoid
itself), cula, FLA and the reference take ``sigmoid(logits)`` computed in fp32 (then cast to the
beta dtype of the options), so every kernel sees the same beta up to its own sigmoid.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from kda_bench.suite import Config

LOWER_BOUND = -5.0  # gate lower bound: the safe_gate range [-5, 0)

# Per-token tensors (dim 1 is T): what slicing a problem by tokens or sequences cuts.
TOKEN_FIELDS = ("q", "k", "v", "g", "beta", "beta_logits")


@dataclass(frozen=True)
class Options:
    """Kernel options, the same for every kernel that supports them."""

    l2norm: bool = True
    gate_in_kernel: bool = True
    initial_state: bool = False
    state_layout: str = "kv"
    beta_dtype: torch.dtype = torch.float32
    lower_bound: float = LOWER_BOUND
    #: Kimi-Linear's unbounded gate -exp(A_log) softplus(g + dt_bias) (no lower_bound,
    #: safe_gate=False), with A_log ~ N(0, 1) and g ~ 2 N(0, 1).
    softplus_gate: bool = False

    @property
    def safe_gate(self) -> bool:
        return not self.softplus_gate

    @property
    def call_lower_bound(self) -> float | None:
        """The ``lower_bound`` argument of the calls: None without the gate in kernel or with
        the softplus gate."""
        return self.lower_bound if self.gate_in_kernel and not self.softplus_gate else None

    def describe(self) -> str:
        """One line for the reports."""
        if self.softplus_gate:
            return ("safe_gate=False, use_gate_in_kernel=True (-exp(A_log)*softplus(g+dt_bias), "
                    "A_log ~ N(0,1), g ~ 2 N(0,1)), dt_bias, "
                    f"use_qk_l2norm_in_kernel={self.l2norm}, output_final_state=True, "
                    f"initial_state={'random fp32' if self.initial_state else 'None'}, "
                    f"state_layout={self.state_layout!r}, beta {str(self.beta_dtype).replace('torch.', '')}, "
                    "scale=K**-0.5")
        gate = ("use_gate_in_kernel=True (lower_bound*sigmoid(exp(A_log)*(g+dt_bias))), A_log, dt_bias"
                if self.gate_in_kernel else "precomputed gates in [lower_bound, 0)")
        return (f"safe_gate=True, lower_bound={self.lower_bound}, {gate}, "
                f"use_qk_l2norm_in_kernel={self.l2norm}, output_final_state=True, "
                f"initial_state={'random fp32' if self.initial_state else 'None'}, "
                f"state_layout={self.state_layout!r}, beta {str(self.beta_dtype).replace('torch.', '')} "
                f"(sigmoid of bf16 logits; FlashKDA gets the logits), scale=K**-0.5")


@dataclass(frozen=True)
class Inputs:
    """One input set. ``beta`` is ``sigmoid(beta_logits)`` in the options' beta dtype."""

    q: torch.Tensor                  # [B, T, H, D]
    k: torch.Tensor                  # [B, T, H, D]
    v: torch.Tensor                  # [B, T, HV, D]
    g: torch.Tensor                  # [B, T, HV, D] raw gate (or log decay without gate in kernel)
    beta: torch.Tensor               # [B, T, HV]
    beta_logits: torch.Tensor        # [B, T, HV] bf16
    A_log: torch.Tensor | None       # [HV] fp32 (gate in kernel)
    dt_bias: torch.Tensor | None     # [HV * D] fp32 (gate in kernel)
    h0: torch.Tensor | None          # [N, HV, D, D] fp32 in the options' state layout
    cu: torch.Tensor | None          # [N + 1] int64 (varlen)

    @property
    def num_seqs(self) -> int:
        """N, known on the host (from shapes only)."""
        return self.cu.numel() - 1 if self.cu is not None else self.q.shape[0]

    def map_tokens(self, fn: Callable[[torch.Tensor], torch.Tensor], h0: torch.Tensor | None,
                   cu: torch.Tensor | None) -> "Inputs":
        """A copy with ``fn`` applied to every per-token tensor and the given h0 and cu."""
        new = {name: fn(getattr(self, name)) for name in TOKEN_FIELDS}
        return dataclasses.replace(self, h0=h0, cu=cu, **new)


def cu_seqlens(cfg: Config, device: torch.device) -> torch.Tensor | None:
    """int64 ``[N + 1]`` offsets for a varlen config, None for fixed length."""
    if cfg.lens is None:
        return None
    c = [0]
    for L in cfg.lens:
        c.append(c[-1] + L)
    return torch.tensor(c, device=device, dtype=torch.int64)


def make_inputs(cfg: Config, opt: Options, device: torch.device, dtype: torch.dtype,
                gen: torch.Generator, cu: torch.Tensor | None) -> Inputs:
    """Random inputs. q, k, v ~ N(0,1); raw g ~ N(0,1); A_log = log U(1,16); dt_bias ~ 0.5 N(0,1);
    beta logits ~ N(0,1) rounded to bf16; initial state (if asked) ~ 0.1 N(0,1). Precomputed gates
    (without the gate in kernel) are lower_bound * sigmoid(N(0,1)).

    ``cu`` is passed in rather than built here so that every input set of a row shares one
    tensor (FLA caches its chunk indices per cu_seqlens object)."""
    B, T, H, HV, D = cfg.B, cfg.T, cfg.H, cfg.HV, cfg.D

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    q = randn(B, T, H, D)
    k = randn(B, T, H, D)
    v = randn(B, T, HV, D)
    if opt.softplus_gate:
        g = (2 * randn(B, T, HV, D, dt=torch.float32)).to(dtype)
        A_log = torch.randn(HV, generator=gen, device=device)
        dt_bias = 0.5 * torch.randn(HV * D, generator=gen, device=device)
    elif opt.gate_in_kernel:
        g = randn(B, T, HV, D)
        A_log = torch.empty(HV, device=device).uniform_(1.0, 16.0, generator=gen).log()
        dt_bias = 0.5 * torch.randn(HV * D, generator=gen, device=device)
    else:
        g = (opt.lower_bound * torch.sigmoid(randn(B, T, HV, D, dt=torch.float32))).to(dtype)
        A_log = dt_bias = None
    beta_logits = randn(B, T, HV, dt=torch.bfloat16)
    beta = torch.sigmoid(beta_logits.float()).to(opt.beta_dtype)
    h0 = (0.1 * randn(cfg.N, HV, D, D, dt=torch.float32)) if opt.initial_state else None
    return Inputs(q, k, v, g, beta, beta_logits, A_log, dt_bias, h0, cu)
