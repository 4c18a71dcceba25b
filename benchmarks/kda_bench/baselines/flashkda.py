"""MoonshotAI's FlashKDA (CUTLASS, two kernels, chunk 16): ``flash_kda.fwd``.

Its contract (the wheel's ``flash_kda/__init__.py`` docstring and the project's README):
bf16 q, k, v, g ``[B, T, H, K]``; beta as bf16 **logits** ``[B, T, H]`` (sigmoid in the kernel);
``out`` bf16 written in place; A_log fp32 ``[H]``; dt_bias fp32 ``[H, K]``; ``lower_bound`` in
[-5, 0]; states ``[N, H, V, K]`` (V first) in bf16 or fp32, both of one dtype; cu_seqlens int64
with B == 1; K = V = 128; no GVA (v has the q/k heads). It always L2-normalises q and k and
always applies the lower-bound gate ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` — the
same gate and l2norm as cula's and FLA's options in this benchmark. Its recurrent state is bf16
inside the kernel whatever the state dtype given; the fp32 final state asked for here is that
state converted (as FLA's FlashKDA backend asks for it).
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch

from kda_bench.baselines import Baseline, Result, cuda_missing, dist_version
from kda_bench.inputs import Inputs, Options
from kda_bench.suite import Config
from kda_bench.util import first_line

# The prebuilt wheel and the one scripts/build_flashkda.sh builds from source.
DISTS = ("tokenspeed-flashkda", "flash-kda")


class FlashKdaBaseline(Baseline):
    """FlashKDA with outputs allocated per call, as cula and FLA allocate theirs."""

    name = "flashkda"
    label = "FlashKDA"

    def __init__(self, opt: Options) -> None:
        super().__init__(opt)
        self._fwd: Callable[..., Any] | None = None

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("flash_kda") is None:
            return False, ("flash_kda is not installed (pip install --no-deps tokenspeed-flashkda, "
                           "or build it from source with scripts/build_flashkda.sh)")
        missing = cuda_missing()
        if missing:
            return False, f"FlashKDA needs a CUDA GPU ({missing})"
        try:
            import flash_kda
        except Exception as exc:
            # Typically an undefined torch symbol: the wheel was built against another torch.
            return False, f"import flash_kda failed: {first_line(exc, 160)}"
        self._fwd = flash_kda.fwd
        return True, ""

    def supports(self, cfg: Config) -> tuple[bool, str]:
        if cfg.HV != cfg.H:
            return False, f"FlashKDA has no GVA: it needs HV == H (HV={cfg.HV}, H={cfg.H})"
        if cfg.D != 128:
            return False, f"FlashKDA needs K = V = 128 (D={cfg.D})"
        if not self.opt.l2norm:
            return False, "FlashKDA always L2-normalises q and k (the run has --no-l2norm)"
        if self.opt.softplus_gate:
            return False, "FlashKDA has only its lower-bound gate (the run has --softplus-gate)"
        if not self.opt.gate_in_kernel:
            return False, ("FlashKDA always applies its lower-bound gate in the kernel (the run has "
                           "--precomputed-gate)")
        return True, ""

    def prepare(self, x: Inputs) -> Callable[[], Any]:
        if self._fwd is None:
            raise RuntimeError("FlashKdaBaseline.prepare before a successful available()")
        assert x.A_log is not None and x.dt_bias is not None  # supports() requires the gate
        fwd, opt = self._fwd, self.opt
        D, HV, N = x.q.shape[-1], x.v.shape[2], x.num_seqs
        scale = D ** -0.5
        dt_bias = x.dt_bias.view(HV, D)
        h0 = x.h0
        if h0 is not None and opt.state_layout == "kv":
            h0 = h0.transpose(-1, -2).contiguous()   # FlashKDA keeps [V, K] per head

        def call() -> Any:
            out = torch.empty_like(x.v)
            final = torch.empty(N, HV, D, D, dtype=torch.float32, device=x.q.device)
            fwd(x.q, x.k, x.v, x.g, x.beta_logits, scale, out, A_log=x.A_log, dt_bias=dt_bias,
                lower_bound=opt.lower_bound, initial_state=h0, final_state=final,
                cu_seqlens=x.cu)
            return out, final
        return call

    def outputs(self, result: Any) -> Result:
        o, final = result
        return o, final.transpose(-1, -2) if self.opt.state_layout == "kv" else final

    def version(self) -> str | None:
        return dist_version(*DISTS)

    def meta(self) -> dict[str, Any]:
        m = super().meta()
        m["call"] = ("flash_kda.fwd(q, k, v, g, beta_logits (bf16), K**-0.5, out, A_log, "
                     "dt_bias.view(H, K), lower_bound, initial_state, final_state fp32 [N,H,V,K], "
                     "cu_seqlens int64); bf16 state inside the kernel")
        return m
