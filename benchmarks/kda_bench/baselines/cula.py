"""cula's fused SM90 kernel: ``cula.kda.kda_prefill(..., backend="sm90")``."""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from kda_bench.baselines import Baseline
from kda_bench.inputs import Inputs
from kda_bench.suite import Config
from kda_bench.util import first_line

# The dispatch rule of csrc/kda/sm90/kda_prefill_dispatch.cu (constants from kernel_params.cuh),
# restated so that each row records which tile schedule its time belongs to; the extension does
# not report the schedule it launched. Keep in step with the C++ when the rule changes.
SORT_MAX_SEQS = 4096
LONGEST_FIRST_MAX_MEAN_TOKENS = 320
SCHEDULE_ENV = "CULA_KDA_SCHEDULE"
COOPERATIVE_ENV = "CULA_KDA_COOPERATIVE"
VALUE_SPLIT_ENV = "CULA_KDA_VALUE_SPLIT"
SEGMENTS_ENV = "CULA_KDA_SEGMENTS"
CHUNK = 64
WORKSPACE_STAGE_BYTES = 75264          # kWorkspaceStageBytes (shared_storage.cuh)
MAX_COOPERATIVE_WORKSPACE_BYTES = 4 << 30  # kMaxCooperativeWorkspaceBytes (kda_prefill_dispatch.cu)


def cula_segments(tiles: int, chunks_per_tile: int, all_chunks: int, sm_count: int,
                  forced: str | None = None) -> int:
    """Segments per tile of a cooperative launch with two owners per tile (``choose_segments``
    in the dispatch: the G with the least modelled time, 1 for none; ``CULA_KDA_SEGMENTS``)."""
    def fits(g: int) -> bool:
        return tiles * 4 * g < sm_count

    best, best_us = 1, max(1.4 * chunks_per_tile, 12.0 * all_chunks / (sm_count - 2 * tiles))
    g = 3
    while fits(g):
        seg = 1.4 * (-(-chunks_per_tile // g))
        us = max(seg, 12.0 * all_chunks / (sm_count - tiles * (4 * g - 4))) + 20.0 * (g - 2) + seg + 60.0
        if us < best_us:
            best, best_us = g, us
        g += 1
    if forced:
        try:
            f = int(forced)
        except ValueError:
            f = 0
        if f == 1 or (f >= 3 and fits(f)):
            best = f
    return best


def cula_schedule(cfg: Config, sm_count: int, forced: str | None = None,
                  cooperative: str | None = None, value_split: str | None = None,
                  segments_env: str | None = None) -> str:
    """The launch cula's dispatch picks: "cooperative" (one CTA per SM, the CTAs without a tile
    compute chunks for the tile owners) when the (sequence, value head) tiles number at most
    0.4 x the SMs and there are at least four chunks of tokens (or ``CULA_KDA_COOPERATIVE=1``,
    with fewer tiles than SMs; ``=0`` never); else "longest-first" (persistent CTAs) when there are
    more tiles than SMs and the mean sequence is short (or ``CULA_KDA_SCHEDULE=longest_first``);
    else "index" (one CTA per tile). A cooperative launch whose kernel gives each tile one or two
    owners (each on half of the value columns) by its model of the sequence lengths is
    "cooperative-split-on-device" (the default while two CTAs per tile leave a helper); with
    ``CULA_KDA_VALUE_SPLIT=2`` every tile has two owners ("cooperative-split"), with ``=1`` one
    ("cooperative"). With two owners per tile and very few tiles, each tile's chunks may run in G
    segments at once ("cooperative-G-segments", ``cula_segments``). ``forced`` / ``cooperative`` /
    ``value_split`` / ``segments_env``: the values of those variables (read from the environment
    when None)."""
    if forced is None:
        forced = os.environ.get(SCHEDULE_ENV)
    if cooperative is None:
        cooperative = os.environ.get(COOPERATIVE_ENV)
    if value_split is None:
        value_split = os.environ.get(VALUE_SPLIT_ENV)
    tiles = cfg.N * cfg.HV
    tokens = cfg.B * cfg.T
    coop = 5 * tiles <= 2 * sm_count and tokens >= 4 * CHUNK
    workspace = (-(-tokens // CHUNK) + cfg.N) * cfg.HV * WORKSPACE_STAGE_BYTES
    if cooperative == "0":
        coop = False
    elif cooperative == "1":
        coop = True
    if coop and tokens > 0 and tiles < sm_count and workspace <= MAX_COOPERATIVE_WORKSPACE_BYTES:
        if value_split == "1" or 2 * tiles >= sm_count:
            return "cooperative"
        segments = cula_segments(tiles, -(-(tokens // cfg.N) // CHUNK), -(-tokens // CHUNK) * cfg.HV,
                                 sm_count, os.environ.get(SEGMENTS_ENV) if segments_env is None else segments_env)
        if segments > 1:
            return f"cooperative-{segments}-segments"
        return "cooperative-split" if value_split == "2" else "cooperative-split-on-device"
    short = cfg.B * cfg.T < LONGEST_FIRST_MAX_MEAN_TOKENS * cfg.N
    longest_first = (forced != "index" and tiles > sm_count and cfg.N <= SORT_MAX_SEQS
                     and (short or forced == "longest_first"))
    return "longest-first" if longest_first else "index"


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

    def prepare(self, x: Inputs) -> Callable[[], Any]:
        from cula.kda import kda_prefill

        opt = self.opt

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
        return {"cula_schedule": cula_schedule(cfg, sm_count)}

    def version(self) -> str | None:
        try:
            import cula
        except Exception:
            return None
        return str(cula.__version__)

    def meta(self) -> dict[str, Any]:
        m = super().meta()
        m["schedule_env"] = os.environ.get(SCHEDULE_ENV)
        return m
