"""CPU tests of the benchmark package ``benchmarks/kda_bench`` (no GPU needed).

* the suites: well-formed rows, the issue targets present, varlen lengths;
* inputs (beta drawn once as logits), floors, SM·µs per chunk-head, the error slice;
* the baselines: availability reasons here, what FlashKDA covers, cula's launch names, and the
  FlashKDA glue (logits, dt_bias view, [V, K] states) against a stand-in ``flash_kda`` module
  that follows FlashKDA's documented contract using cula's reference;
* the GPU runner's row bookkeeping (timings, speedups, n/a reasons, errors, verdict) on the CPU,
  with the CUDA calls stubbed and stand-in kernels;
* the reports (Markdown, JSON, merge) on fake rows, and the entry point's CPU path.
"""

from __future__ import annotations

import importlib.machinery
import json
import math
import os
import subprocess
import sys
import time
import types
from typing import Any, Callable

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kda_bench import report, runner  # noqa: E402
from kda_bench.baselines import Baseline, all_baselines  # noqa: E402
from kda_bench.baselines.cula import cula_schedule  # noqa: E402
from kda_bench.baselines.flashkda import FlashKdaBaseline  # noqa: E402
from kda_bench.cli import parse_args  # noqa: E402
from kda_bench.floors import chunked_flops, sm_us_per_chunk_head  # noqa: E402
from kda_bench.inputs import Inputs, Options, cu_seqlens, make_inputs  # noqa: E402
from kda_bench.reference import plan_slice, reference_call, rel_err  # noqa: E402
from kda_bench.suite import Config, build_suite, varlen_lengths  # noqa: E402
from kda_bench.timing import TimingParams  # noqa: E402

from cula.kda.reference import kda_recurrent_reference  # noqa: E402

CPU = torch.device("cpu")

TARGET_ROWS = [
    "B2 T8192 H64", "B8 T8192 H64", "B1 T8192 H64", "B1 T1024 H64", "B2 T8192 H16/HV64",
    "varlen random N10 T8192 H64", "varlen uniform N100 T12800 H64", "B1 T32768 H8",
    "B1 T65536 H4",
]


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Tiny tensors: intra-op threads only add spin-waiting on a 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def inputs(cfg: Config, opt: Options, seed: int = 0, dtype: torch.dtype = torch.float32) -> Inputs:
    gen = torch.Generator(device=CPU)
    gen.manual_seed(seed)
    return make_inputs(cfg, opt, CPU, dtype, gen, cu_seqlens(cfg, CPU))


# ------------------------------------------------------------------------------------------------
# suites
# ------------------------------------------------------------------------------------------------


def test_default_suite_well_formed():
    cfgs = build_suite()
    names = [c.name for c in cfgs]
    assert len(names) == len(set(names)) == 47
    for c in cfgs:
        assert sum(c.seq_lens) == c.B * c.T and min(c.seq_lens) >= 1
        assert c.HV % c.H == 0 and c.D == 128
    # every row of the previous suite is kept, and the small-N*HV rows (B1 T131072 H2, one long prompt with three short ones) are added
    for name in ("B8 T16384 H64", "B2 T8192 H8/HV64", "varlen skewed N100 T16384 H64",
                 "B1 T32768 H8", "B1 T65536 H4", "B1 T131072 H2", "varlen given N4 T30138 H8"):
        assert name in names
    assert set(TARGET_ROWS) <= set(names)
    long = next(c for c in cfgs if c.dist == "given")
    assert long.lens == (30000, 100, 37, 1) and long.H == long.HV == 8


def test_issue_suite_is_exactly_the_targets():
    cfgs = build_suite("targets")
    assert [c.name for c in cfgs] == TARGET_ROWS
    uniform = next(c for c in cfgs if c.dist == "uniform")
    assert uniform.lens == (128,) * 100
    random_row = next(c for c in cfgs if c.dist == "random")
    assert len(random_row.lens) == 10 and sum(random_row.lens) == 8192
    # the issue suite is fixed: head overrides do not move it
    assert [c.name for c in build_suite("targets", H=4, HV=8)] == TARGET_ROWS


def test_quick_suite_and_mode_filters():
    assert [c.name for c in build_suite("quick")] == [
        "B2 T8192 H64", "B1 T8192 H64", "B2 T8192 H16/HV64", "varlen random N20 T8192 H64",
        "B1 T32768 H8"]
    assert len(build_suite(mode="fixed")) == 12
    assert len(build_suite(mode="small")) == 4
    args = parse_args(["--mode", "varlen", "--configs", "skewed N10 "])
    assert [c.name for c in runner.selected_configs(args)] == [
        "varlen skewed N10 T4096 H64", "varlen skewed N10 T8192 H64", "varlen skewed N10 T16384 H64"]
    assert parse_args(["--quick"]).suite == "quick"


def test_varlen_lengths_and_config_checks():
    for dist in ("uniform", "random", "skewed"):
        lens = varlen_lengths(dist, 20, 4096, seed=3)
        assert len(lens) == 20 and sum(lens) == 4096 and min(lens) >= 1
        assert lens == varlen_lengths(dist, 20, 4096, seed=3)
    assert Config("small", 1, 30138, 8, 8, lens=(30000, 100, 37, 1), dist="given").chunks == 469 + 2 + 1 + 1
    with pytest.raises(ValueError):
        Config("varlen", 2, 10, 1, 1, lens=(5, 5))
    with pytest.raises(ValueError):
        Config("gva", 1, 10, 3, 4)


# ------------------------------------------------------------------------------------------------
# inputs, floors, slices
# ------------------------------------------------------------------------------------------------


def test_beta_drawn_once_as_logits():
    cfg = Config("cpu", 2, 32, 1, 2, 16)
    x = inputs(cfg, Options(beta_dtype=torch.bfloat16))
    assert x.beta_logits.dtype == torch.bfloat16 and x.beta.dtype == torch.bfloat16
    assert torch.equal(x.beta, torch.sigmoid(x.beta_logits.float()).to(torch.bfloat16))
    y = inputs(cfg, Options(gate_in_kernel=False))
    assert y.A_log is None and y.dt_bias is None and float(y.g.max()) < 0


def test_flops_and_sm_us_per_chunk_head():
    cfg = Config("fixed", 1, 100, 1, 2, 128)            # one chunk of 64 and one of 36
    per = lambda c: 2 * c * c * 5 * 128 + 6 * c * 128 * 128   # noqa: E731
    assert chunked_flops(cfg) == 2 * (per(64) + per(36))
    # time x SMs / (chunks x HV) (benchmarks/README.md): B2 T8192 H64 at 2.136 ms on 132 SMs, ~16.5
    b2 = Config("fixed", 2, 8192, 64, 64)
    assert b2.chunks == 256
    assert sm_us_per_chunk_head(2.136, 132, b2) == pytest.approx(2136 * 132 / (256 * 64))


@pytest.mark.parametrize("lens", [None, (70, 1, 30)])
def test_error_slice_matches_a_run_on_the_slice(lens: tuple[int, ...] | None):
    """o of the full problem restricted to the slice equals o of the slice (causality)."""
    cfg = (Config("fixed", 2, 80, 1, 2, 16) if lens is None
           else Config("varlen", 1, sum(lens), 1, 2, 16, lens, "given"))
    opt = Options(initial_state=True)
    x = inputs(cfg, opt)
    sl = plan_slice(cfg, x, check_tokens=40, check_mem_gib=1.0)
    assert not sl.full and sl.x is not None
    o_full, _ = reference_call(kda_recurrent_reference, x, opt, torch.float64)
    o_slice, _ = reference_call(kda_recurrent_reference, sl.x, opt, torch.float64)
    assert rel_err(sl.take_o(o_full, cfg), o_slice) < 1e-12
    assert plan_slice(cfg, x, check_tokens=0, check_mem_gib=1.0).full


# ------------------------------------------------------------------------------------------------
# baselines
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reasons given without a GPU")
def test_availability_reasons_without_gpu():
    for b in all_baselines(Options()):
        ok, why = b.available()
        assert not ok and why, b.name
    reasons = {b.name: b.available()[1] for b in all_baselines(Options())}
    assert "flash_kda" in reasons["flashkda"] or "CUDA" in reasons["flashkda"]
    assert "FLA" in reasons["fla"]


def test_flashkda_coverage():
    fk = FlashKdaBaseline(Options())
    assert fk.supports(Config("fixed", 2, 64, 4, 4))[0]
    ok, why = fk.supports(Config("gva", 2, 64, 16, 64))
    assert not ok and "HV == H" in why
    assert not fk.supports(Config("fixed", 2, 64, 4, 4, 64))[0]
    assert "l2" in FlashKdaBaseline(Options(l2norm=False)).supports(Config("fixed", 1, 64, 4, 4))[1].lower()
    assert not FlashKdaBaseline(Options(gate_in_kernel=False)).supports(Config("fixed", 1, 64, 4, 4))[0]


def test_cula_schedule_names_the_extensions_launch(monkeypatch):
    """Each row records the launch its cula time belongs to, as the extension names it (the
    dispatch's own rule: ``tests/test_launch_plan.py``), or None without the extension."""
    import cula
    for name in [n for n in os.environ if n.startswith("CULA_KDA_")]:
        monkeypatch.delenv(name)
    got = cula_schedule(Config("fixed", 8, 1024, 64, 64), 132)
    if not cula.kernels_available():
        assert got is None
        return
    assert got == "longest-first"  # 512 tiles on 132 SMs
    assert cula_schedule(Config("fixed", 2, 1024, 64, 64), 132) == "index"  # 128 tiles: one wave
    assert cula_schedule(Config("small", 1, 65536, 4, 4), 132) == "cooperative-two-kernels-4-segments"
    monkeypatch.setenv("CULA_KDA_COOPERATIVE", "0")
    assert cula_schedule(Config("small", 1, 65536, 4, 4), 132) == "pair"  # the fused kernel on 2 CTAs per tile


def _fake_flash_kda_fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                        initial_state=None, final_state=None, cu_seqlens=None):
    """FlashKDA's documented contract, computed by cula's reference: beta are logits, q/k are
    L2-normalised and the lower-bound gate applied in the kernel, states are [N, H, V, K]."""
    assert beta.dtype == torch.bfloat16 and dt_bias.shape == (v.shape[2], q.shape[-1])
    assert cu_seqlens is None or cu_seqlens.dtype == torch.int64
    o, st = kda_recurrent_reference(
        q, k, v, g, torch.sigmoid(beta.float()), scale=scale, initial_state=initial_state,
        output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias.reshape(-1),
        lower_bound=lower_bound, state_layout="vk")
    out.copy_(o)
    if final_state is not None:
        final_state.copy_(st)


@pytest.fixture
def fake_flash_kda(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("flash_kda")
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_kda", None)
    mod.fwd = _fake_flash_kda_fwd
    monkeypatch.setitem(sys.modules, "flash_kda", mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("lens", [None, (40, 1, 23)])
def test_flashkda_glue_against_its_contract(fake_flash_kda: None, layout: str,
                                            lens: tuple[int, ...] | None):
    opt = Options(initial_state=True, state_layout=layout)
    cfg = (Config("fixed", 2, 48, 2, 2, 16) if lens is None
           else Config("varlen", 1, sum(lens), 2, 2, 16, lens, "given"))
    x = inputs(cfg, opt, dtype=torch.bfloat16)
    fk = FlashKdaBaseline(opt)
    assert fk.available() == (True, "")
    o, st = fk.outputs(fk.prepare(x)())
    ref_o, ref_s = reference_call(kda_recurrent_reference, x, opt, torch.float32)
    assert o.dtype == torch.bfloat16 and st.shape == ref_s.shape
    assert rel_err(o, ref_o) < 1e-2 and rel_err(st, ref_s) < 1e-5


# ------------------------------------------------------------------------------------------------
# the GPU runner's bookkeeping, on the CPU
# ------------------------------------------------------------------------------------------------


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_Event") -> float:
        return (end.t - self.t) * 1e3


class _Graph:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.replay = fn


class _RefKernel(Baseline):
    """A stand-in kernel: cula's reference (deterministic)."""

    def available(self) -> tuple[bool, str]:
        return True, ""

    def supports(self, cfg: Config) -> tuple[bool, str]:
        return True, ""

    def prepare(self, x: Inputs) -> Callable[[], Any]:
        return lambda: reference_call(kda_recurrent_reference, x, self.opt, torch.float32)


class _FakeCula(_RefKernel):
    name, label, gating = "cula", "cula", True


class _FakeOther(_RefKernel):
    name, label = "other", "Other"

    def supports(self, cfg: Config) -> tuple[bool, str]:
        return (cfg.H == cfg.HV, "no GVA")


@pytest.fixture
def stub_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    props = types.SimpleNamespace(L2_cache_size=1 << 20, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 << 30, 80 << 30))
    monkeypatch.setattr(runner, "capture_graphs", lambda calls: [(_Graph(c), c()) for c in calls])


@pytest.mark.parametrize("cfg", [Config("fixed", 1, 96, 2, 2, 16),
                                 Config("gva", 1, 96, 1, 2, 16),
                                 Config("varlen", 1, 100, 2, 2, 16, (60, 1, 39), "given")],
                         ids=lambda c: c.name)
def test_runner_row_bookkeeping(stub_cuda: None, cfg: Config):
    opt = Options(initial_state=True)
    p = runner.RunParams(timing=TimingParams(warmup=1, min_reps=3, max_reps=3, min_time_s=0.0),
                         check_tokens=32, check_mem_gib=0.01, max_sets=2)
    m = runner.Machine(copy_bw=1e12, gemm_rate=1e15, sm_count=132)
    kernels = [_FakeCula(opt), _FakeOther(opt)]
    row = runner.run_config(cfg, CPU, opt, kernels, {"absent": "not installed here"}, p, m)
    assert row["status"] == "ok", row["notes"]
    assert row["N"] == cfg.N and row["chunks"] == cfg.chunks and row["absent_na"] == "not installed here"
    assert row["cula_ms"] > 0 and row["cula_graph_ms"] > 0 and row["cula_deterministic"]
    assert row["cula_sm_us_per_chunk_head"] == pytest.approx(
        row["cula_ms"] * 1e3 * 132 / (cfg.chunks * cfg.HV))
    assert row["cula_o_err"] < 1e-2 and row["cula_state_err"] < 1e-5
    assert row["check"].startswith("first 32 tokens")
    if cfg.H == cfg.HV:
        assert row["cula_vs_other"] == pytest.approx(row["other_ms"] / row["cula_ms"])
        assert row["cula_vs_other_graph"] == pytest.approx(row["other_graph_ms"] / row["cula_graph_ms"])
        assert row["other_o_err"] < 1e-2
    else:
        assert row["other_na"] == "no GVA" and "cula_vs_other" not in row
    meta = {"baselines": [{"name": "cula", "label": "cula"}, {"name": "other", "label": "Other"}]}
    md = report.markdown(meta, [row], [])
    assert cfg.name in md and ("Other n/a: no GVA" in md) == (cfg.H != cfg.HV)


def test_runner_fails_a_gating_error(stub_cuda: None):
    class Wrong(_FakeCula):
        def prepare(self, x: Inputs) -> Callable[[], Any]:
            call = super().prepare(x)
            return lambda: tuple(t * 1.1 for t in call())

    opt = Options()
    p = runner.RunParams(timing=TimingParams(1, 2, 2, 0.0), graph=False)
    row = runner.run_config(Config("fixed", 1, 64, 1, 1, 16), CPU, opt, [Wrong(opt)], {}, p,
                            runner.Machine(None, None, 132))
    assert row["status"] == "FAIL" and row["cula_o_err"] > 0.05 and row["hbm_floor_ms"] is None


class _FakeSafe(_RefKernel):
    """Stands in for cula's safe gate beside the softplus rows: other outputs, not checked."""

    name, label, checked = "cula_safe", "cula safe gate", False

    def prepare(self, x: Inputs) -> Callable[[], Any]:
        call = super().prepare(x)
        return lambda: tuple(t * 3.0 for t in call())


def test_runner_softplus_vs_safe(stub_cuda: None):
    """The safe-gate column of the softplus rows: timed, never error-checked (its gate is not the
    reference's, so its outputs differ and must not fail or flag the row), and the ratio
    softplus / safe = cula ms / cula safe gate ms, eager and graph, in the row, the progress line
    and the Markdown (instead of a "cula vs" speedup)."""
    opt = Options(softplus_gate=True)
    p = runner.RunParams(timing=TimingParams(warmup=1, min_reps=3, max_reps=3, min_time_s=0.0),
                         check_tokens=32, check_mem_gib=0.01, max_sets=1)
    cfg = Config("fixed", 1, 64, 2, 2, 16)
    row = runner.run_config(cfg, CPU, opt, [_FakeCula(opt), _FakeSafe(opt)], {}, p,
                            runner.Machine(1e12, 1e15, 132))
    assert row["status"] == "ok" and not row["notes"], row["notes"]
    assert "cula_safe_o_err" not in row and "cula_safe_state_err" not in row and row["cula_o_err"] < 1e-2
    assert row["cula_safe_ms"] > 0
    assert row["softplus_vs_safe"] == pytest.approx(row["cula_ms"] / row["cula_safe_ms"])
    assert row["softplus_vs_safe_graph"] == pytest.approx(row["cula_graph_ms"] / row["cula_safe_graph_ms"])
    names = [("cula", "cula"), ("cula_safe", "cula safe gate")]
    assert f"softplus / safe {row['softplus_vs_safe']:.2f}x" in report.progress_line(1, 1, row, names)
    meta = {"baselines": [{"name": nm, "label": lb} for nm, lb in names]}
    lines = report.markdown(meta, [row], []).splitlines()
    head = next(l for l in lines if l.startswith("| config"))
    assert "| softplus / safe |" in head and "| softplus / safe graph |" in head
    assert "cula vs cula safe gate" not in head
    body = next(l for l in lines if l.startswith(f"| {row['config']} |"))
    assert body.count("|") == head.count("|") and f"| {row['softplus_vs_safe']:.2f} |" in body


def test_cula_safe_baseline_only_beside_softplus_rows(monkeypatch: pytest.MonkeyPatch):
    """cula's safe gate joins the kernels with --softplus-gate only (and leaves with --no-cula or
    --no-cula-safe); its call is the safe gate (lower_bound -5) on the row's own tensors."""
    from kda_bench.baselines.cula_safe import CulaSafeGateBaseline
    import cula.kda

    assert [b.name for b in all_baselines(Options())] == ["cula", "fla", "flashkda"]
    assert [b.name for b in all_baselines(Options(softplus_gate=True))] == ["cula", "cula_safe", "fla", "flashkda"]
    for flag in ("--no-cula", "--no-cula-safe"):
        skip = runner.skipped_names(parse_args(["--softplus-gate", flag]))
        assert "cula_safe" in skip and ("cula" in skip) == (flag == "--no-cula")
    cfg = Config("fixed", 1, 64, 2, 2)
    ok, why = CulaSafeGateBaseline(Options()).supports(cfg)
    assert not ok and "--softplus-gate" in why
    opt = Options(softplus_gate=True)
    b = CulaSafeGateBaseline(opt)
    assert b.supports(cfg) == (True, "") and not b.supports(Config("fixed", 1, 64, 2, 2, 64))[0]
    assert not b.checked and not b.gating and "safe_gate=True" in b.meta()["gate"]
    seen: dict[str, Any] = {}

    def fake_prefill(*args: Any, **kw: Any) -> str:
        seen.update(args=args, kw=kw)
        return "out"

    monkeypatch.setattr(cula.kda, "kda_prefill", fake_prefill)
    x = inputs(cfg, opt)
    assert b.prepare(x)() == "out"
    assert seen["args"][0] is x.q and seen["args"][3] is x.g and seen["kw"]["A_log"] is x.A_log
    assert seen["kw"]["safe_gate"] is True and seen["kw"]["lower_bound"] == -5.0
    assert seen["kw"]["use_gate_in_kernel"] is True and seen["kw"]["backend"] == "sm90"


# ------------------------------------------------------------------------------------------------
# reports and the entry point
# ------------------------------------------------------------------------------------------------

META = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-24", "commit": "abc", "torch": "2.11",
        "options": "o", "copy_bandwidth_GBps": 3000.0, "gemm_TFLOPs": 700.0, "sm_count": 132,
        "baselines": [{"name": "cula", "label": "cula", "version": "0.1.0"},
                      {"name": "fla", "label": "FLA", "version": "0.6.0", "beta_dtype": "float32"},
                      {"name": "flashkda", "label": "FlashKDA", "version": "0.0.1"}]}
ROWS = [
    {"config": "B2 T8192 H64", "B": 2, "N": 2, "H": 64, "HV": 64, "status": "ok", "notes": [],
     "cula_ms": 2.0, "fla_ms": 4.0, "flashkda_ms": 3.0, "cula_vs_fla": 2.0, "cula_vs_flashkda": 1.5,
     "cula_graph_ms": 1.9, "cula_o_err": 3.5e-3, "cula_state_err": 2.9e-3, "flashkda_o_err": 6e-3,
     "flashkda_state_err": float("nan"), "cula_sm_us_per_chunk_head": 16.1, "hbm_floor_ms": 0.46,
     "cula_schedule": "index", "check": "full problem"},
    {"config": "B2 T8192 H16/HV64", "B": 2, "N": 2, "H": 16, "HV": 64, "status": "ok",
     "notes": ["FLA graph: not capturable: x"], "cula_ms": 1.9, "fla_ms": 4.1, "cula_vs_fla": 2.16,
     "flashkda_na": "FlashKDA has no GVA"},
    {"config": "B1 T1024 H64", "B": 1, "N": 1, "H": 64, "HV": 64, "status": "ok", "notes": [],
     "cula_ms": 0.3, "flashkda_na": "FlashKDA has no GVA"},
]


def test_markdown_columns_and_grouped_notes():
    md = report.markdown(META, ROWS, ["a statement"])
    lines = md.splitlines()
    head = next(l for l in lines if l.startswith("| config"))
    for col in ("| B |", "| N |", "| H |", "| HV |", "FlashKDA ms", "cula vs FlashKDA graph",
                "err o / S FlashKDA", "SM·µs/chunk·head cula", "HBM floor ms", "TC floor ms",
                "cula schedule"):
        assert col in head, col
    width = head.count("|")
    rows = [l for l in lines if l.startswith("| B")]
    assert len(rows) == 3 and all(r.count("|") == width for r in rows)
    assert "| 2.0e-03 /" not in md and "6.0e-03 / nan" in md and "n/a" in rows[1]
    assert "B2 T8192 H16/HV64, B1 T1024 H64: FlashKDA n/a: FlashKDA has no GVA" in md
    assert "FLA: beta_dtype float32" in md and "- a statement" in md


def test_progress_line_on_a_failed_row():
    line = report.progress_line(1, 1, {"config": "x", "status": "FAIL", "notes": ["raised"]},
                                report.kernels(META))
    assert "FAIL" in line and "raised" in line


def test_json_merge(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    report.write_reports((str(a), None, None), {**META, "suite": "fixed"}, ROWS[:1], ["s1"])
    report.write_reports((str(b), None, None), {**META, "suite": "gva", "gemm_TFLOPs": 720.0},
                         ROWS[1:], ["s1", "s2"])
    meta, rows, statements = report.merge([str(a), str(b)])
    assert [r["config"] for r in rows] == [r["config"] for r in ROWS]
    assert statements == ["s1", "s2"] and meta["suite"] == "fixed+gva"
    assert meta["gemm_TFLOPs"] == pytest.approx(710.0)
    c = tmp_path / "c.json"
    report.write_reports((str(c), None, None), {**META, "commit": "def"}, ROWS[:1], [])
    with pytest.raises(ValueError, match="commit"):
        report.merge([str(a), str(c)])


def test_plot(tmp_path):
    from kda_bench.plot import plot

    path = tmp_path / "p.png"
    why = plot(str(path), META, ROWS)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert why and "matplotlib" in why
    else:
        assert why is None and path.stat().st_size > 0
    assert "no row" in plot(str(path), META, [{"config": "x"}])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the entry point runs the GPU suite")
def test_entry_point_cpu_path(tmp_path):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_kda_prefill.py"),
                        "--json", str(out_json), "--md", str(out_md)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "FlashKDA" in r.stdout
    d = json.loads(out_json.read_text())
    assert len(d["rows"]) == 2 and all(row["status"] == "ok" for row in d["rows"])
    assert all(math.isfinite(row["cula_o_err"]) and row["cula_o_err"] < 5e-3 for row in d["rows"])
    assert "reference backend" in out_md.read_text()


def test_gpu_path_writes_partial_reports(tmp_path, monkeypatch) -> None:
    """The GPU path rewrites its JSON/Markdown after every configuration: a run stopped after two
    rows (a device time limit) leaves those two rows, marked partial; a full run leaves all rows
    and no partial mark. The device, rates and kernels are faked (no GPU needed)."""
    import json
    import types

    args = parse_args(["--suite", "targets", "--no-fla", "--no-graph",
                       "--json", str(tmp_path / "b.json"), "--md", str(tmp_path / "b.md")])
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (80 * 2**30, 80 * 2**30))
    monkeypatch.setattr(runner, "measure_copy_bandwidth", lambda dev, n: 3e12)
    monkeypatch.setattr(runner, "measure_gemm_rate", lambda dev: 7.5e14)

    class Fake:
        name = label = "cula"

        def meta(self):
            return {"name": "cula", "label": "cula", "version": "0"}

    monkeypatch.setattr(runner, "all_baselines", lambda opt, skip=(): [Fake()])
    monkeypatch.setattr(runner, "preflight", lambda kernels, dev, opt, dim: (kernels, {}, [], True))
    monkeypatch.setattr(runner, "load_reference", lambda: (None, "not in this test"))
    calls: list[str] = []

    class Stop(BaseException):  # like the kill of a time limit: not caught as a failed row
        pass

    def run_config(cfg, *rest):
        calls.append(cfg.name)
        if len(calls) == 3:
            raise Stop
        return {"config": cfg.name, "mode": cfg.mode, "status": "ok", "notes": []}

    monkeypatch.setattr(runner, "run_config", run_config)
    device = types.SimpleNamespace(device="cpu", name="fake")
    with pytest.raises(Stop):
        runner.gpu_path(device, args)
    saved = json.loads((tmp_path / "b.json").read_text())
    assert [r["config"] for r in saved["rows"]] == calls[:2]
    assert saved["statements"][-1].startswith("partial report: 2 of 9")
    assert "partial report" in (tmp_path / "b.md").read_text()

    monkeypatch.setattr(runner, "run_config",
                        lambda cfg, *rest: {"config": cfg.name, "mode": cfg.mode, "status": "ok", "notes": []})
    assert runner.gpu_path(device, args) == 0
    saved = json.loads((tmp_path / "b.json").read_text())
    assert len(saved["rows"]) == 9 and not any("partial" in s for s in saved["statements"])
def test_softplus_gate_option() -> None:
    """--softplus-gate: safe_gate=False and no lower_bound in every call; FlashKDA says why it is n/a;
    the inputs draw A_log ~ N(0, 1) and g ~ 2 N(0, 1)."""
    from kda_bench.inputs import Options, make_inputs

    opt = Options(softplus_gate=True)
    assert not opt.safe_gate and opt.call_lower_bound is None and "softplus" in opt.describe()
    assert Options().safe_gate and Options().call_lower_bound == -5.0
    assert Options(gate_in_kernel=False).call_lower_bound is None
    ok, why = FlashKdaBaseline(opt).supports(Config("fixed", 1, 64, 4, 4))
    assert not ok and "softplus" in why
    gen = torch.Generator().manual_seed(0)
    x = make_inputs(Config("fixed", 1, 4096, 4, 4), opt, torch.device("cpu"), torch.bfloat16, gen, None)
    assert 1.7 < float(x.g.float().std()) < 2.3 and x.A_log.shape == (4,) and x.A_log.dtype == torch.float32


def test_env_sweep_shapes():
    """scripts/env_sweep.py's shapes: BxTxH is a fixed-length row, DIST:NxTOTALxH the suite's
    varlen row of that distribution (the same lengths as the benchmark's row of that name)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("env_sweep", os.path.join(ROOT, "scripts", "env_sweep.py"))
    env_sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(env_sweep)
    fixed = env_sweep.parse_shape("2x8192x64")
    assert (fixed.B, fixed.T, fixed.H, fixed.HV, fixed.lens) == (2, 8192, 64, 64, None)
    row = env_sweep.parse_shape("random:10x8192x64")
    suite_row = next(c for c in build_suite("targets") if c.name.startswith("varlen random"))
    assert row.name == suite_row.name == "varlen random N10 T8192 H64"
    assert row.lens == suite_row.lens and sum(row.lens) == 8192 and len(row.lens) == 10
    assert env_sweep.parse_shape("Uniform:4x32768x8").lens == (8192,) * 4
    for bad in ("2x8192", "random:10x8192", "2x8192x64x1", "random:ax8192x64"):
        with pytest.raises(ValueError, match="expected BxTxH or DIST:NxTOTALxH"):
            env_sweep.parse_shape(bad)
    with pytest.raises(ValueError, match="unknown varlen distribution"):
        env_sweep.parse_shape("zipf:10x8192x64")


def test_env_sweep_orders(monkeypatch):
    """scripts/env_sweep.py's call orders: every value gets --reps timed calls; interleaved
    alternates call by call, blocks give each value two untimed calls and then up to --block timed
    ones in a row; the swept variable is restored afterwards (set or unset)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("env_sweep", os.path.join(ROOT, "scripts", "env_sweep.py"))
    env_sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(env_sweep)
    assert env_sweep.timing_order(["0", "1"], 2, "interleaved", 10) == [("0", True), ("1", True)] * 2
    calls = env_sweep.timing_order(["0", "1"], 25, "blocks", 10)
    for x in ("0", "1"):
        assert sum(1 for v, timed in calls if v == x and timed) == 25
    runs = []  # (value, timed) runs in order
    for v, timed in calls:
        if runs and tuple(runs[-1][:2]) == (v, timed):
            runs[-1][2] += 1
        else:
            runs.append([v, timed, 1])
    assert [tuple(r) for r in runs] == [
        ("0", False, 2), ("0", True, 10), ("1", False, 2), ("1", True, 10),
        ("0", False, 2), ("0", True, 10), ("1", False, 2), ("1", True, 10),
        ("0", False, 2), ("0", True, 5), ("1", False, 2), ("1", True, 5)]
    monkeypatch.setenv("CULA_KDA_TEST_KNOB", "keep")
    with env_sweep.env_restored("CULA_KDA_TEST_KNOB"):
        os.environ["CULA_KDA_TEST_KNOB"] = "1"
    assert os.environ["CULA_KDA_TEST_KNOB"] == "keep"
    monkeypatch.delenv("CULA_KDA_TEST_KNOB")
    with pytest.raises(RuntimeError):
        with env_sweep.env_restored("CULA_KDA_TEST_KNOB"):
            os.environ["CULA_KDA_TEST_KNOB"] = "2"
            raise RuntimeError("a failed call")
    assert "CULA_KDA_TEST_KNOB" not in os.environ


def test_eager_timeline_rows_are_the_benchmarks():
    """scripts/eager_timeline.py (the rows scripts/ab_extension.sh A/Bs): every row is the
    benchmark's target row of the same shape, varlen lengths included, so an A/B there speaks for
    the bench's numbers."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("eager_timeline", os.path.join(ROOT, "scripts", "eager_timeline.py"))
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    suite = {(c.mode, c.B, c.T, c.H, c.HV, c.lens) for c in build_suite("targets")}
    rows = timeline.ROWS
    for name in ("B2 T8192 H64", "B8 T8192 H64", "B1 T1024 H64", "B1 T8192 H64", "B1 T32768 H8",
                 "B1 T65536 H4", "B2 T8192 H16/HV64", "varlen 10 random H64", "varlen 100x128 H64"):
        c = rows[name]
        assert (c.mode, c.B, c.T, c.H, c.HV, c.lens) in suite, name
    assert len(rows["varlen 10 random H64"].lens) == 10 and sum(rows["varlen 10 random H64"].lens) == 8192
    assert rows["varlen 100x128 H64"].lens == (128,) * 100
