"""The kernels a row times, one file each, behind one small interface (:class:`Baseline`).

A baseline says whether it can run here (:meth:`Baseline.available`), whether it covers a
configuration under the run's options (:meth:`Baseline.supports`), and turns one input set into a
zero-argument call (:meth:`Baseline.prepare`) whose conversions (layouts, dtypes) happen once,
outside the timed call. Reasons are short sentences: they land in the report as "n/a: <reason>".

Column names in the reports are ``<name>_ms``, ``<name>_graph_ms``, ``<name>_o_err``,
``<name>_state_err``, ``<name>_na``, and ``cula_vs_<name>`` for the speedups.
"""
from __future__ import annotations

import abc
import importlib.metadata
from typing import Any, Callable, ClassVar

import torch

from kda_bench.inputs import Inputs, Options
from kda_bench.suite import Config

Result = tuple[torch.Tensor, torch.Tensor | None]


def dist_version(*dists: str) -> str | None:
    """Installed version of the first of ``dists`` found (no import of the module)."""
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cuda_missing() -> str:
    """Why no CUDA GPU can be used here, or "" when one can."""
    return "" if torch.cuda.is_available() else "torch.cuda.is_available() is False"


class Baseline(abc.ABC):
    """One kernel under test, configured with the run's options."""

    name: ClassVar[str]    # column prefix
    label: ClassVar[str]   # name in the reports
    # Whether its failures fail the run (errors above tolerance, raising on a supported
    # configuration, non-deterministic results): true for cula, the product; the others are
    # informational.
    gating: ClassVar[bool] = False
    # Whether its outputs are compared with the fp32 recurrence of the run's options (False for
    # a kernel timed on the same tensors under other options, e.g. cula's safe gate beside the
    # softplus rows: baselines/cula_safe.py).
    checked: ClassVar[bool] = True

    def __init__(self, opt: Options) -> None:
        self.opt = opt

    @abc.abstractmethod
    def available(self) -> tuple[bool, str]:
        """(True, "") when it can run here, else (False, why not). Cheap where it cannot run:
        no import of a package that is not installed or that needs a GPU that is not there."""

    @abc.abstractmethod
    def supports(self, cfg: Config) -> tuple[bool, str]:
        """(True, "") when it covers ``cfg`` under the options, else (False, why not)."""

    @abc.abstractmethod
    def prepare(self, x: Inputs) -> Callable[[], Any]:
        """A call on ``x`` that returns this kernel's raw result (see :meth:`outputs`)."""

    def outputs(self, result: Any) -> Result:
        """o and the final state in the options' state layout, from a raw result."""
        return result

    def preflight(self, x: Inputs) -> str:
        """One tiny call before the suite (first-use setup); returns a statement for the report
        ("" when there is nothing to say). Raises when the kernel cannot run."""
        self.prepare(x)()
        torch.cuda.synchronize()
        return ""

    def row_info(self, cfg: Config, sm_count: int) -> dict[str, Any]:
        """Extra per-row fields (e.g. cula's tile schedule)."""
        return {}

    def version(self) -> str | None:
        """Installed version, None when unknown."""
        return None

    def meta(self) -> dict[str, Any]:
        """What the report header records about this kernel."""
        return {"name": self.name, "label": self.label, "version": self.version()}


def all_baselines(opt: Options, skip: frozenset[str] = frozenset()) -> list[Baseline]:
    """cula first (speedups are relative to it), with the softplus gate cula's safe gate on the same
    tensors next, then FLA, then FlashKDA; minus ``skip`` names."""
    from kda_bench.baselines.cula import CulaBaseline
    from kda_bench.baselines.cula_safe import CulaSafeGateBaseline
    from kda_bench.baselines.fla import FlaBaseline
    from kda_bench.baselines.flashkda import FlashKdaBaseline

    classes = [CulaBaseline] + ([CulaSafeGateBaseline] if opt.softplus_gate else []) + [FlaBaseline, FlashKdaBaseline]
    return [cls(opt) for cls in classes if cls.name not in skip]
