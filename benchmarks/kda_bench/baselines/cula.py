"""cula's fused SM90 kernel: ``cula.kda.kda_prefill(..., backend="sm90")``."""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from kda_bench.baselines import Baseline
from kda_bench.inputs import Inputs, Options
from kda_bench.suite import Config
from kda_bench.util import first_line

SCHEDULE_ENV = "CULA_KDA_SCHEDULE"
#: The launch knobs cula reads per call (docs/install.md); the run's values go into its metadata.
LAUNCH_ENVS = ("CULA_KDA_SCHEDULE", "CULA_KDA_COOPERATIVE", "CULA_KDA_VALUE_SPLIT", "CULA_KDA_SEGMENTS",
               "CULA_KDA_TILES_PER_OWNER", "CULA_KDA_HELPER_KERNEL", "CULA_KDA_HELPER_INTRA",
               "CULA_KDA_OVERLAP_OWNERS", "CULA_KDA_EARLY_RELEASE", "CULA_KDA_SYNC_AREA")


def cula_schedule(cfg: Config, sm_count: int, *, general_gates: bool = False) -> str | None:
    """The launch cula's dispatch makes for ``cfg`` on a GPU of ``sm_count`` SMs, as the extension
    names it (``kda_prefill_sm90_launch_name``: the dispatch's own rule, with the ``CULA_KDA_*``
    variables of the environment): "index" or "longest-first" (the fused kernel's tile
    schedules), or "cooperative-{one-kernel,two-kernels}" with how the tiles are owned ("",
    "-split", "-split-on-device", "-<k>-tiles-per-owner", "-<G>-segments"). None where the
    extension is not built."""
    try:
        from cula import _ext
    except Exception:
        return None
    if not _ext.kernels_available():
        return None
    return _ext.get_ext().kda_prefill_sm90_launch_name(
        batch=cfg.B, seqlen=cfg.T, num_seqs=cfg.N, num_qk_heads=cfg.H, num_v_heads=cfg.HV,
        varlen=cfg.lens is not None, general_gates=general_gates, sm_count=sm_count)


class CulaBaseline(Baseline):
    """The product under test: its failures fail the run."""

    name = "cula"
    label = "cula"
    gating = True

    def available(self) -> tuple[bool, str]:
        try:
            import cula
            import cula.kda  # noqa: F401  (the API module: its import errors belong here)
        except Exception as exc:
            return False, f"cula could not be imported ({first_line(exc)})"
        if not cula.kernels_available():
            return False, (f"the sm90 extension is not built or did not load "
                           f"({cula.kernels_unavailable_reason()})")
        if not torch.cuda.is_available():
            return False, "the sm90 kernel needs an SM90 GPU (torch.cuda.is_available() is False)"
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return False, (f"the sm90 kernel needs an SM90 GPU; {torch.cuda.get_device_name()} has "
                           f"compute capability {cap[0]}.{cap[1]}")
        return True, ""

    def supports(self, cfg: Config) -> tuple[bool, str]:
        if cfg.D != 128:
            return False, f"the sm90 kernel needs K = V = 128 (D={cfg.D})"
        return True, ""

    def call_options(self) -> Options:
        """The options of the timed call (the run's; cula's safe gate beside the softplus rows
        overrides this)."""
        return self.opt

    def prepare(self, x: Inputs) -> Callable[[], Any]:
        from cula.kda import kda_prefill

        opt = self.call_options()

        def call() -> Any:
            return kda_prefill(x.q, x.k, x.v, x.g, x.beta, scale=None, initial_state=x.h0,
                               output_final_state=True, cu_seqlens=x.cu,
                               use_qk_l2norm_in_kernel=opt.l2norm,
                               use_gate_in_kernel=opt.gate_in_kernel, A_log=x.A_log,
                               dt_bias=x.dt_bias, safe_gate=opt.safe_gate,
                               lower_bound=opt.call_lower_bound,
                               state_layout=opt.state_layout, backend="sm90")
        return call

    def row_info(self, cfg: Config, sm_count: int) -> dict[str, Any]:
        return {"cula_schedule": cula_schedule(cfg, sm_count, general_gates=not self.opt.safe_gate)}

    def version(self) -> str | None:
        try:
            import cula
        except Exception:
            return None
        return str(cula.__version__)

    def meta(self) -> dict[str, Any]:
        m = super().meta()
        m["schedule_env"] = os.environ.get(SCHEDULE_ENV)
        m["launch_env"] = {name: os.environ[name] for name in LAUNCH_ENVS if name in os.environ}
        return m
