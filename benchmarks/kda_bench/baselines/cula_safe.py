"""cula's safe-gate kernel on the softplus rows' inputs: the time issue 15 compares against.

With ``--softplus-gate`` the product under test runs Kimi-Linear's unbounded gate on the general-gate
path (``safe_gate=False``). This baseline times the *safe-gate* path on the very same tensors (q, k,
v, beta, the raw gate g, A_log, dt_bias): ``safe_gate=True, lower_bound=-5``, i.e. the decays
``lower_bound * sigmoid(exp(A_log) (g + dt_bias))``. The shapes, launch and memory traffic are the
softplus row's; only the gate's formula differs, so its outputs are not the reference's (which
follows the softplus gate) and are not checked (:attr:`Baseline.checked`). The report's
``softplus_vs_safe`` is cula's time over this one's: the general-gate path's cost in one run.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kda_bench.baselines import Baseline
from kda_bench.baselines.cula import CulaBaseline, cula_schedule
from kda_bench.inputs import LOWER_BOUND, Options
from kda_bench.suite import Config


class CulaSafeGateBaseline(CulaBaseline):
    """cula, safe gate, same inputs (only beside ``--softplus-gate`` runs: ``all_baselines``)."""

    name = "cula_safe"
    label = "cula safe gate"
    gating = False   # its failures are reported, the product's verdict is cula's own
    checked = False  # a different gate than the reference's: no error check

    def supports(self, cfg: Config) -> tuple[bool, str]:
        if not self.opt.softplus_gate:
            return False, "only beside --softplus-gate (the safe-gate time of the softplus rows)"
        return super().supports(cfg)

    def call_options(self) -> Options:
        """The run's options with the safe gate: ``safe_gate=True``, ``lower_bound=-5``, gate in kernel."""
        return dataclasses.replace(self.opt, softplus_gate=False, gate_in_kernel=True, lower_bound=LOWER_BOUND)

    def row_info(self, cfg: Config, sm_count: int) -> dict[str, Any]:
        return {"cula_safe_schedule": cula_schedule(cfg, sm_count, general_gates=False)}

    def meta(self) -> dict[str, Any]:
        return Baseline.meta(self) | {
            "gate": (f"safe_gate=True, lower_bound={LOWER_BOUND} on the softplus rows' tensors (errors not "
                     "checked: another gate than the reference's); softplus / safe = cula ms / cula safe gate ms")}
