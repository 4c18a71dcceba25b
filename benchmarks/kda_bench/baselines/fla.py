"""FLA's Triton ``fla.ops.kda.chunk_kda`` (fla-core), with the same options as cula."""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

import torch

from kda_bench.baselines import Baseline, cuda_missing, dist_version
from kda_bench.inputs import Inputs, Options
from kda_bench.suite import Config
from kda_bench.util import first_line

# fla-core dispatches chunk_kda to registered backends: FlashKDA when flash_kda is installed, and
# cula itself (cula.kda registers one, cula/kda/fla_backend.py). This column is FLA's own Triton
# path (both have their own columns), so both dispatches are switched off before fla is imported.
FLA_FLASH_KDA_ENV = "FLA_FLASH_KDA"
FLA_CULA_ENV = "FLA_CULA"


class FlaBaseline(Baseline):
    """FLA's chunk_kda. beta goes in the options' dtype unless FLA refuses it (see preflight)."""

    name = "fla"
    label = "FLA"

    def __init__(self, opt: Options) -> None:
        super().__init__(opt)
        self.beta_dtype: torch.dtype = opt.beta_dtype
        self._chunk_kda: Callable[..., Any] | None = None

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("fla") is None:
            return False, "FLA (fla-core) is not installed; `pip install fla-core==0.6.0 einops`"
        missing = cuda_missing()
        if missing:
            return False, f"FLA's Triton kernels need a CUDA GPU ({missing})"
        os.environ[FLA_FLASH_KDA_ENV] = "0"
        os.environ[FLA_CULA_ENV] = "0"
        try:
            from fla.ops.kda import chunk_kda
        except Exception as exc:
            return False, f"FLA (fla-core) failed to import ({first_line(exc)})"
        self._chunk_kda = chunk_kda
        return True, ""

    def supports(self, cfg: Config) -> tuple[bool, str]:
        return True, ""

    def prepare(self, x: Inputs) -> Callable[[], Any]:
        if self._chunk_kda is None:
            raise RuntimeError("FlaBaseline.prepare before a successful available()")
        fn, opt = self._chunk_kda, self.opt
        beta = x.beta if x.beta.dtype == self.beta_dtype else x.beta.to(self.beta_dtype)

        def call() -> Any:
            return fn(q=x.q, k=x.k, v=x.v, g=x.g, beta=beta, scale=None, initial_state=x.h0,
                      output_final_state=True, use_qk_l2norm_in_kernel=opt.l2norm,
                      use_gate_in_kernel=opt.gate_in_kernel, A_log=x.A_log, dt_bias=x.dt_bias,
                      safe_gate=opt.safe_gate, lower_bound=opt.call_lower_bound,
                      state_v_first=opt.state_layout == "vk", cu_seqlens=x.cu)
        return call

    def preflight(self, x: Inputs) -> str:
        """A tiny call; if FLA refuses fp32 beta, it gets the same beta rounded to bf16. When
        bf16 fails too, the first error is raised (and the beta dtype stays the options')."""
        try:
            return super().preflight(x)
        except Exception as exc:
            if self.beta_dtype == torch.bfloat16:
                raise
            self.beta_dtype = torch.bfloat16
            try:
                super().preflight(x)
            except Exception:
                self.beta_dtype = self.opt.beta_dtype
                raise exc
            return (f"FLA rejected beta {self.opt.beta_dtype} ({first_line(exc)}); FLA is given the "
                    "same beta rounded to bf16")

    def version(self) -> str | None:
        return dist_version("fla-core", "flash-linear-attention")

    def meta(self) -> dict[str, Any]:
        m = super().meta()
        m["beta_dtype"] = str(self.beta_dtype).replace("torch.", "")
        m["env"] = (f"{FLA_FLASH_KDA_ENV}={os.environ.get(FLA_FLASH_KDA_ENV)} "
                    f"{FLA_CULA_ENV}={os.environ.get(FLA_CULA_ENV)}")
        return m
