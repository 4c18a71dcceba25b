"""cula as a backend of FLA's ``chunk_kda`` (:mod:`cula.kda.fla_backend`); needs fla-core.

CPU tests: the registration (type, env var, priority ahead of FlashKDA), every accept and reject
case of the verifier (the device check is stubbed for the accept cases: the tensors are CPU
tensors), the adapter (FLA arguments onto kda_prefill without copies; beta logits through a
sigmoid), FLA's own dispatch reaching the adapter, ``FLA_CULA=0``, and the import hook that
registers cula when FLA is imported after ``cula.kda``.

GPU tests (``gpu_sm90``): ``chunk_kda`` under ``torch.inference_mode()`` runs cula (FLA's dispatch
log and :func:`cula.kda.last_backend` say so) and matches FLA's Triton path and the fp32
recurrence; with gradients on, FLA's own path runs.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch

fla_kda = pytest.importorskip("fla.ops.kda", reason="fla-core is not installed (pip install -e '.[test]')")

import cula.kda  # noqa: E402
from cula import _ext  # noqa: E402
from cula.kda import fla_backend  # noqa: E402
from cula.kda import prefill as prefill_mod  # noqa: E402
from fla.ops.kda import chunk_kda  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D = 128


def _registry():
    import fla.backends

    return fla.backends._function_registries[inspect.unwrap(chunk_kda)]


def fla_call(B: int = 1, T: int = 9, H: int = 2, HV: int = 4, K: int = D, V: int = D,
             dtype: torch.dtype = torch.bfloat16, device: str = "cpu", **over: Any) -> dict[str, Any]:
    """Keyword arguments of a chunk_kda call the fused kernel serves (gate in kernel, lower bound)."""
    f32 = dict(device=device, dtype=torch.float32)
    kw = dict(
        q=torch.randn(B, T, H, K, **f32).to(dtype), k=torch.randn(B, T, H, K, **f32).to(dtype),
        v=torch.randn(B, T, HV, V, **f32).to(dtype), g=torch.randn(B, T, HV, K, **f32).to(dtype),
        beta=torch.rand(B, T, HV, **f32), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=torch.randn(HV, **f32), dt_bias=torch.randn(HV * K, **f32),
        safe_gate=True, lower_bound=-5.0,
    )
    kw.update(over)
    return kw


def _varlen(**over: Any) -> dict[str, Any]:
    kw = fla_call(T=9, initial_state=torch.zeros(3, 4, D, D),
                  cu_seqlens=torch.tensor([0, 4, 4, 9], dtype=torch.int64))
    kw.update(over)
    return kw


def _decays(**over: Any) -> dict[str, Any]:
    """Precomputed log decays in [-5, 0) (the gate outside the kernel)."""
    kw = fla_call(use_gate_in_kernel=False)
    kw["g"] = (-5 * torch.rand(kw["g"].shape)).clamp(-5, -1e-3).to(torch.bfloat16)
    kw.update(over)
    return kw


@pytest.fixture
def hopper(monkeypatch):
    """The fused kernel's device/build check passes (CPU tensors stand in for a Hopper GPU)."""
    monkeypatch.setattr(prefill_mod, "_check_sm90_environment", lambda q, prefix: None)


# ------------------------------------------------------------------------------------------------
# registration
# ------------------------------------------------------------------------------------------------


def test_registered_ahead_of_flash_kda() -> None:
    backend = _registry()._backends.get("cula")
    assert backend is not None, "importing cula.kda did not register the FLA backend"
    assert backend is fla_backend.registered_backend()
    assert backend.backend_type == "cula" and backend.env_var == "FLA_CULA"
    assert backend.package_name == "cula" and backend.default_enable
    assert backend.priority < 3, "FlashKDA registers with priority 3: cula must be asked first"
    order = [b.backend_type for b in _registry()._get_sorted_backends()]
    if "flash_kda" in order:
        assert order.index("cula") < order.index("flash_kda")
    assert type(backend).is_available() == _ext.kernels_available()


def test_env_var_switches_it_off(monkeypatch) -> None:
    backend = fla_backend.registered_backend()
    monkeypatch.delenv("FLA_CULA", raising=False)
    assert backend.is_enabled()
    monkeypatch.setenv("FLA_CULA", "0")
    assert not backend.is_enabled()


def test_import_hook_registers_when_fla_is_imported_later() -> None:
    """`import cula.kda` does not import FLA; importing FLA afterwards registers cula."""
    code = (
        "import sys, inspect, warnings; warnings.simplefilter('ignore')\n"
        "import cula.kda\n"
        "assert 'fla.ops.kda.chunk' not in sys.modules, 'import cula.kda imported FLA'\n"
        "from fla.ops.kda import chunk_kda\n"
        "import fla.backends\n"
        "reg = fla.backends._function_registries[inspect.unwrap(chunk_kda)]\n"
        "assert 'cula' in reg._backends, sorted(reg._backends)\n"
        "assert reg._backends['cula'] is cula.kda.fla_backend.registered_backend()\n"
        "from cula.kda.fla_backend import _FlaImportHook\n"
        "assert not any(isinstance(f, _FlaImportHook) for f in sys.meta_path), 'hook left behind'\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# the verifier: every accept and reject case
# ------------------------------------------------------------------------------------------------

ACCEPT: dict[str, Callable[[], dict[str, Any]]] = {
    "gate-in-kernel": lambda: fla_call(),
    "gva-1x8": lambda: fla_call(H=1, HV=8, A_log=torch.zeros(8), dt_bias=torch.zeros(8 * D)),
    "mha": lambda: fla_call(H=4, HV=4),
    "lower-bound-without-A_log": lambda: fla_call(A_log=None),
    "no-dt_bias": lambda: fla_call(dt_bias=None),
    "dt_bias-2d": lambda: fla_call(dt_bias=torch.zeros(4, D)),
    "lower_bound--1": lambda: fla_call(lower_bound=-1.0),
    "precomputed-decays": lambda: _decays(),
    "precomputed-decays-ignores-gate-args": lambda: _decays(A_log=torch.zeros(4), lower_bound=-7.0),
    "beta-logits": lambda: fla_call(use_beta_sigmoid_in_kernel=True, beta=torch.randn(1, 9, 4)),
    "beta-bf16": lambda: fla_call(beta=torch.rand(1, 9, 4).to(torch.bfloat16)),
    "state_v_first": lambda: fla_call(state_v_first=True, initial_state=torch.zeros(1, 4, D, D)),
    "transpose_state_layout": lambda: fla_call(transpose_state_layout=True),
    "initial_state": lambda: fla_call(initial_state=torch.zeros(1, 4, D, D), output_final_state=False),
    "no-l2norm": lambda: fla_call(use_qk_l2norm_in_kernel=False),
    "scale": lambda: fla_call(scale=0.1),
    "fixed-B3": lambda: fla_call(B=3),
    "varlen-int64": lambda: _varlen(),
    "varlen-int32": lambda: _varlen(cu_seqlens=torch.tensor([0, 4, 4, 9], dtype=torch.int32)),
    "varlen-cu_seqlens_cpu": lambda: _varlen(cu_seqlens_cpu=torch.tensor([0, 4, 4, 9])),
    "varlen-use_graph": lambda: _varlen(use_graph=True, max_num_seqs=3),
    "disable_recompute": lambda: fla_call(disable_recompute=True),
    "chunk_size-32": lambda: fla_call(chunk_size=32),
    # FLA's default safe_gate=False: the lower bound in [-5, 0) already bounds every decay.
    "safe_gate-False-lower_bound--5": lambda: fla_call(safe_gate=False),
    # Unbounded decays (safe_gate=False): the kernel's general-gate path, exact.
    "safe_gate-False-lower_bound--6": lambda: fla_call(safe_gate=False, lower_bound=-6.0),
    "precomputed-decays-safe_gate-False": lambda: _decays(safe_gate=False),
    "softplus-gate-safe_gate-False": lambda: fla_call(lower_bound=None, safe_gate=False),
}

REJECT: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "fp32": (lambda: fla_call(dtype=torch.float32), "bfloat16"),
    "fp16": (lambda: fla_call(dtype=torch.float16), "bfloat16"),
    "K64": (lambda: fla_call(K=64, dt_bias=torch.zeros(4 * 64)), "K == 128"),
    "V64": (lambda: fla_call(V=64), "V == 128"),
    "HV-not-multiple-of-H": (lambda: fla_call(H=2, HV=3, A_log=torch.zeros(3), dt_bias=torch.zeros(3 * D)),
                             "multiple of H"),
    # safe_gate=True promises decays in [-5, 0): a bound below it, or none, contradicts that.
    "lower_bound-below--5": (lambda: fla_call(lower_bound=-6.0), "lower_bound"),
    "softplus-gate-safe_gate-True": (lambda: fla_call(lower_bound=None), "lower_bound"),
    "g-fp32": (lambda: fla_call(g=torch.randn(1, 9, 4, D)), "`g`"),
    "beta-fp16": (lambda: fla_call(beta=torch.rand(1, 9, 4).half()), "beta"),
    "A_log-bf16": (lambda: fla_call(A_log=torch.zeros(4, dtype=torch.bfloat16)), "A_log"),
    "initial_state-bf16": (lambda: fla_call(initial_state=torch.zeros(1, 4, D, D, dtype=torch.bfloat16)),
                           "initial_state"),
    "initial_state-N": (lambda: fla_call(state_v_first=True, initial_state=torch.zeros(2, 4, D, D)),
                        "initial_state"),
    "cu_seqlens-with-B2": (lambda: fla_call(B=2, cu_seqlens=torch.tensor([0, 9, 18])), "cu_seqlens"),
    "cu_seqlens-float": (lambda: _varlen(cu_seqlens=torch.tensor([0.0, 4.0, 4.0, 9.0])), "cu_seqlens"),
    "allow_neg_eigval": (lambda: fla_call(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
                         "allow_neg_eigval"),
    "return_intermediate_states": (lambda: fla_call(return_intermediate_states=True),
                                   "return_intermediate_states"),
    "cp_context": (lambda: fla_call(cp_context=object()), "cp_context"),
    "unknown-argument": (lambda: fla_call(some_new_flag=True), "some_new_flag"),
    "chunk_size-16": (lambda: fla_call(chunk_size=16), "chunk_size"),
    "use_graph-max_num_seqs": (lambda: _varlen(use_graph=True, max_num_seqs=5), "max_num_seqs"),
    "both-layout-flags": (lambda: fla_call(state_v_first=True, transpose_state_layout=True),
                          "transpose_state_layout"),
}


@pytest.mark.parametrize("build", list(ACCEPT.values()), ids=list(ACCEPT))
def test_verifier_accepts(build, hopper, seed) -> None:
    kw = build()
    with torch.inference_mode():
        assert fla_backend.verify_chunk_kda(**kw) == (True, None)
        assert fla_backend.registered_backend().verify("chunk_kda", **kw) == (True, None)
    with torch.no_grad():
        assert fla_backend.verify_chunk_kda(**kw) == (True, None)


@pytest.mark.parametrize("build, words", list(REJECT.values()), ids=list(REJECT))
def test_verifier_rejects_with_reason(build, words, hopper, seed) -> None:
    kw = build()
    with torch.inference_mode():
        ok, reason = fla_backend.verify_chunk_kda(**kw)
    assert not ok and reason, "expected a rejection with a reason"
    assert words in reason, f"the reason does not name {words!r}: {reason}"
    assert 'backend="reference"' not in reason, reason


def test_verifier_rejects_with_gradients_on(hopper) -> None:
    with torch.enable_grad():
        ok, reason = fla_backend.verify_chunk_kda(**fla_call())
    assert not ok and "inference_mode" in reason and "no_grad" in reason


def test_verifier_positional_arguments(hopper) -> None:
    """FLA's positional order (of the installed version) is honoured."""
    kw = fla_call(initial_state=torch.zeros(1, 4, D, D))
    params = list(inspect.signature(inspect.unwrap(chunk_kda)).parameters)
    n = params.index("output_final_state") + 1
    args = tuple(kw.pop(name) if name in kw else None for name in params[:n])
    with torch.inference_mode():
        assert fla_backend.verify_chunk_kda(*args, **kw) == (True, None)
        mapped = fla_backend.to_kda_prefill(args, kw)
    assert mapped["initial_state"] is args[params.index("initial_state")]


def test_verifier_rejects_cpu_tensors() -> None:
    """Without the stub: CPU tensors are refused (the kernel needs a Hopper GPU)."""
    with torch.inference_mode():
        ok, reason = fla_backend.verify_chunk_kda(**fla_call())
    assert not ok and "CUDA" in reason and "cpu" in reason


def test_unavailable_without_extension(monkeypatch) -> None:
    monkeypatch.setattr(_ext, "_C", None)
    assert not type(fla_backend.registered_backend()).is_available()


# ------------------------------------------------------------------------------------------------
# the adapter
# ------------------------------------------------------------------------------------------------


def test_adapter_passes_tensors_without_copies() -> None:
    kw = _varlen(state_v_first=True, initial_state=torch.zeros(3, 4, D, D), scale=0.2)
    mapped = fla_backend.to_kda_prefill((), kw)
    assert mapped["use_beta_sigmoid_in_kernel"] is False
    for name in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "A_log", "dt_bias"):
        assert mapped[name] is kw[name], f"{name} was not passed through as is"
    assert mapped["state_layout"] == "vk" and mapped["scale"] == 0.2
    assert mapped["lower_bound"] == -5.0 and mapped["safe_gate"] and mapped["use_gate_in_kernel"]
    assert "backend" not in mapped
    # gate outside the kernel: FLA ignores A_log, dt_bias and lower_bound, so does the mapping
    mapped = fla_backend.to_kda_prefill((), _decays(A_log=torch.zeros(4), lower_bound=-5.0))
    assert mapped["A_log"] is None and mapped["dt_bias"] is None and mapped["lower_bound"] is None


def test_adapter_passes_beta_logits_flag_through(monkeypatch) -> None:
    calls: list[dict[str, Any]] = []

    def spy(**kw):
        calls.append(kw)
        return "o", "state"

    monkeypatch.setattr(prefill_mod, "kda_prefill", spy)
    logits = torch.randn(1, 9, 4)
    kw = fla_call(beta=logits, use_beta_sigmoid_in_kernel=True)
    assert fla_backend.run_chunk_kda(**kw) == ("o", "state")
    assert calls[0]["backend"] == "sm90"
    assert calls[0]["beta"] is logits and calls[0]["use_beta_sigmoid_in_kernel"] is True
    assert calls[0]["q"] is kw["q"] and calls[0]["g"] is kw["g"]
    kw = fla_call(beta=logits)  # probabilities: passed as they are, flag off
    fla_backend.run_chunk_kda(**kw)
    assert calls[1]["beta"] is logits and calls[1]["use_beta_sigmoid_in_kernel"] is False


def test_fla_dispatch_reaches_cula(monkeypatch, hopper, caplog) -> None:
    """FLA's own dispatch (chunk_kda under inference_mode) runs the adapter, then the op, then the
    extension (a stand-in here: CPU), and logs that cula served the call."""
    calls: list[dict[str, Any]] = []

    class FakeExt:
        @staticmethod
        def kda_prefill_sm90(**kw):
            calls.append(kw)
            kw["o"].fill_(1.0)
            kw["final_state"].fill_(2.0)

    monkeypatch.setattr(_ext, "_C", FakeExt)
    monkeypatch.delenv("FLA_CULA", raising=False)
    monkeypatch.setattr(_registry(), "_logged", set())
    kw = fla_call(state_v_first=True)
    prefill_mod.LAST_BACKEND = None
    with caplog.at_level(logging.INFO, logger="fla.backends"), torch.inference_mode():
        o, state = chunk_kda(**kw)
    assert len(calls) == 1 and calls[0]["state_v_first"] is True
    assert o.shape == kw["v"].shape and bool((o == 1).all()) and bool((state == 2).all())
    assert cula.kda.last_backend() == "sm90"
    assert any("-> cula" in r.getMessage() and "rejected" not in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


# ------------------------------------------------------------------------------------------------
# GPU: FLA's chunk_kda runs cula, and matches FLA's Triton path
# ------------------------------------------------------------------------------------------------


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


GPU_CASES = {
    # varlen with an empty sequence, GVA, V-first state, beta logits, gate in the kernel
    "varlen-gva-vfirst-logits": dict(T=1000, H=4, HV=8, state_v_first=True, beta_logits=True,
                                     cu=[0, 300, 300, 1000], gate=True),
    # fixed length, MHA, K-first state, probabilities, precomputed decays
    "fixed-mha-decays": dict(B=2, T=500, H=4, HV=4, state_v_first=False, beta_logits=False, cu=None,
                             gate=False),
    # Kimi-Linear's unbounded softplus gate (safe_gate=False): the kernel's general-gate path
    "varlen-softplus-gate": dict(T=700, H=2, HV=4, state_v_first=False, beta_logits=False,
                                 cu=[0, 1, 400, 700], gate="softplus"),
}


def _gpu_call(B: int = 1, T: int = 1000, H: int = 4, HV: int = 8, state_v_first: bool = True,
              beta_logits: bool = True, cu: list[int] | None = None, gate: bool | str = True) -> dict[str, Any]:
    """gate: True the lower-bound gate in the kernel, False precomputed decays in [-5, 0),
    "softplus" Kimi-Linear's unbounded gate (A_log ~ N(0, 1), g ~ 2 N(0, 1), safe_gate=False)."""
    dev = "cuda"
    N = B if cu is None else len(cu) - 1
    kw = fla_call(B=B, T=T, H=H, HV=HV, device=dev, A_log=0.1 * torch.randn(HV, device=dev),
                  dt_bias=0.1 * torch.randn(HV * D, device=dev), state_v_first=state_v_first,
                  initial_state=0.1 * torch.randn(N, HV, D, D, device=dev))
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, device=dev, dtype=torch.int64)
    if beta_logits:
        kw.update(beta=torch.randn(B, T, HV, device=dev), use_beta_sigmoid_in_kernel=True)
    if gate == "softplus":
        kw.update(A_log=torch.randn(HV, device=dev), lower_bound=None, safe_gate=False,
                  g=(2 * torch.randn(B, T, HV, D, device=dev)).to(torch.bfloat16))
    elif not gate:
        kw.update(use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
                  g=(-5 * torch.rand(B, T, HV, D, device=dev)).clamp(-5, -1e-3).to(torch.bfloat16))
    return kw


@pytest.mark.gpu_sm90
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
def test_chunk_kda_runs_cula_and_matches_triton(case: str, monkeypatch, caplog, seed) -> None:
    from cula.kda.reference import kda_recurrent_reference

    kw = _gpu_call(**GPU_CASES[case])
    monkeypatch.delenv("FLA_CULA", raising=False)
    monkeypatch.setattr(_registry(), "_logged", set())
    prefill_mod.LAST_BACKEND = None
    with caplog.at_level(logging.INFO, logger="fla.backends"), torch.inference_mode():
        o_cula, s_cula = chunk_kda(**kw)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.endswith("-> cula") for m in messages), messages
    assert cula.kda.last_backend() == "sm90"

    monkeypatch.setenv("FLA_CULA", "0")        # FLA's own Triton kernels
    monkeypatch.setenv("FLA_FLASH_KDA", "0")
    prefill_mod.LAST_BACKEND = None
    with torch.inference_mode():
        o_fla, s_fla = chunk_kda(**kw)
    assert prefill_mod.LAST_BACKEND is None, "FLA_CULA=0 still ran cula"

    beta = torch.sigmoid(kw["beta"]) if kw.get("use_beta_sigmoid_in_kernel") else kw["beta"]
    ref_o, ref_s = kda_recurrent_reference(
        kw["q"], kw["k"], kw["v"], kw["g"], beta, initial_state=kw["initial_state"],
        output_final_state=True, cu_seqlens=kw.get("cu_seqlens"), use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=kw["use_gate_in_kernel"], A_log=kw["A_log"], dt_bias=kw["dt_bias"],
        lower_bound=kw["lower_bound"], state_layout="vk" if kw["state_v_first"] else "kv")
    errors = dict(cula_vs_ref=(_rel(o_cula, ref_o), _rel(s_cula, ref_s)),
                  fla_vs_ref=(_rel(o_fla, ref_o), _rel(s_fla, ref_s)),
                  cula_vs_fla=(_rel(o_cula, o_fla), _rel(s_cula, s_fla)))
    assert all(math.isfinite(e) for pair in errors.values() for e in pair), errors
    assert max(errors["cula_vs_ref"]) <= 5e-3, errors
    assert max(errors["cula_vs_fla"]) <= 1.5e-2, errors
    assert o_cula.shape == o_fla.shape and o_cula.dtype == o_fla.dtype
    assert s_cula.shape == s_fla.shape and s_cula.dtype == s_fla.dtype


@pytest.mark.gpu_sm90
def test_chunk_kda_with_gradients_runs_fla(monkeypatch, caplog, seed) -> None:
    kw = _gpu_call()
    monkeypatch.delenv("FLA_CULA", raising=False)
    monkeypatch.setattr(_registry(), "_logged", set())
    prefill_mod.LAST_BACKEND = None
    with caplog.at_level(logging.INFO, logger="fla.backends"), torch.enable_grad():
        chunk_kda(**kw)
    assert prefill_mod.LAST_BACKEND is None
    assert any("cula rejected" in r.getMessage() and "inference_mode" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
