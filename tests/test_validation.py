"""Host-side validation and dispatch of cula.kda.kda_prefill (CPU only, no GPU needed).

Every validation rule has a case: it must raise the right exception type, name the offending
argument in the message, and leave every input tensor unchanged.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import pytest
import torch

import cula
import cula.kda
from cula.kda import kda_prefill
from cula.kda import prefill as prefill_mod
from cula.kda.reference import kda_gate

# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def make_args(
    B: int = 1, T: int = 6, H: int = 2, HV: int = 4, K: int = 8, V: int = 8,
    dtype: torch.dtype = torch.float32, beta_dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Small valid inputs: log decays g in [-1, 0), beta in (0, 1)."""
    return dict(
        q=torch.randn(B, T, H, K, dtype=dtype, device=device),
        k=torch.randn(B, T, H, K, dtype=dtype, device=device),
        v=torch.randn(B, T, HV, V, dtype=dtype, device=device),
        g=(-torch.rand(B, T, HV, K, device=device)).to(dtype),
        beta=torch.rand(B, T, HV, device=device).to(beta_dtype or dtype),
    )


def tensors_in(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in kwargs.items() if isinstance(t, torch.Tensor)}


def snapshot(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in tensors_in(kwargs).items() if t.device.type != "meta"}


def assert_unchanged(kwargs: dict[str, Any], snap: dict[str, torch.Tensor]) -> None:
    for name, before in snap.items():
        after = kwargs[name]
        assert after.dtype == before.dtype and after.shape == before.shape, name
        assert torch.equal(after, before), f"input `{name}` was modified"


def naive_kda(q, k, v, g, beta, scale, h0=None, cu=None, layout="kv"):
    """Independent fp64 loop of the recurrence (docs/math.md); g is the log decay."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    segs = [(b, 0, T) for b in range(B)] if cu is None else [
        (0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    finals = []
    for n, (b, s, e) in enumerate(segs):
        hs = []
        for hv in range(HV):
            h = hv // (HV // H)
            S = torch.zeros(K, V, dtype=torch.float64)
            if h0 is not None:
                S = h0[n, hv].double().clone()
                if layout == "vk":
                    S = S.T.clone()
            for t in range(s, e):
                S = torch.exp(g[b, t, hv])[:, None] * S
                err = v[b, t, hv] - S.T @ k[b, t, h]
                S = S + beta[b, t, hv] * torch.outer(k[b, t, h], err)
                o[b, t, hv] = scale * (S.T @ q[b, t, h])
            hs.append(S if layout == "kv" else S.T)
        finals.append(torch.stack(hs))
    return o, torch.stack(finals)


# ----------------------------------------------------------------------------------------------
# validation rules: (id, build kwargs, expected exception, name that the message must contain)
# ----------------------------------------------------------------------------------------------

Case = tuple[str, Callable[[], dict[str, Any]], type[BaseException], str]


def _with(base: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    kw = make_args() if base is None else base
    kw.setdefault("backend", "reference")
    kw.update(over)
    return kw


def _gate(**over: Any) -> dict[str, Any]:
    """Valid in-kernel-gate call (lower-bound form) plus overrides."""
    kw = _with(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True,
               A_log=torch.zeros(4), dt_bias=torch.zeros(4 * 8))
    kw.update(over)
    return kw


def _varlen(cu: list[int] | torch.Tensor, T: int = 6, **over: Any) -> dict[str, Any]:
    cu_t = cu if isinstance(cu, torch.Tensor) else torch.tensor(cu, dtype=torch.int32)
    return _with(make_args(B=1, T=T), cu_seqlens=cu_t, **over)


def _shape(**dims: int) -> dict[str, Any]:
    return _with(make_args(**dims))


CASES: list[Case] = [
    # ---- tensor-ness ----------------------------------------------------------------------
    ("q-not-tensor", lambda: _with(q=[[1.0]]), TypeError, "q"),
    ("k-not-tensor", lambda: _with(k=None), TypeError, "k"),
    ("v-not-tensor", lambda: _with(v=3.0), TypeError, "v"),
    ("g-not-tensor", lambda: _with(g="g"), TypeError, "g"),
    ("beta-not-tensor", lambda: _with(beta=None), TypeError, "beta"),
    ("initial_state-not-tensor", lambda: _with(initial_state=[0.0]), TypeError, "initial_state"),
    ("cu_seqlens-list", lambda: _with(cu_seqlens=[0, 6]), TypeError, "cu_seqlens"),
    ("A_log-not-tensor", lambda: _gate(A_log=0.0), TypeError, "A_log"),
    ("dt_bias-not-tensor", lambda: _gate(dt_bias=[0.0] * 32), TypeError, "dt_bias"),
    # ---- ranks and shapes -----------------------------------------------------------------
    ("q-rank3", lambda: _with(q=torch.randn(6, 2, 8)), ValueError, "q"),
    ("q-zero-heads", lambda: _shape(H=0, HV=4), ValueError, "q"),
    ("k-shape", lambda: _with(k=torch.randn(1, 6, 2, 4)), ValueError, "k"),
    ("k-rank", lambda: _with(k=torch.randn(1, 6, 16)), ValueError, "k"),
    ("v-rank", lambda: _with(v=torch.randn(1, 6, 32)), ValueError, "v"),
    ("v-T-mismatch", lambda: _with(v=torch.randn(1, 5, 4, 8)), ValueError, "v"),
    ("v-B-mismatch", lambda: _with(v=torch.randn(2, 6, 4, 8)), ValueError, "v"),
    ("HV-not-multiple-of-H", lambda: _shape(H=2, HV=3), ValueError, "v"),
    ("HV-less-than-H", lambda: _shape(H=4, HV=2), ValueError, "v"),
    ("g-shape-K", lambda: _with(g=-torch.rand(1, 6, 4, 4)), ValueError, "g"),
    ("g-shape-H-not-HV", lambda: _with(g=-torch.rand(1, 6, 2, 8)), ValueError, "g"),
    ("g-rank", lambda: _with(g=-torch.rand(1, 6, 32)), ValueError, "g"),
    ("beta-shape", lambda: _with(beta=torch.rand(1, 6, 2)), ValueError, "beta"),
    ("beta-rank", lambda: _with(beta=torch.rand(1, 6, 4, 1)), ValueError, "beta"),
    # ---- dtypes ---------------------------------------------------------------------------
    ("q-int", lambda: _with(q=torch.ones(1, 6, 2, 8, dtype=torch.int64)), TypeError, "q"),
    ("k-dtype", lambda: _with(k=torch.randn(1, 6, 2, 8, dtype=torch.float64)), TypeError, "k"),
    ("v-dtype", lambda: _with(v=torch.randn(1, 6, 4, 8, dtype=torch.float16)), TypeError, "v"),
    ("g-dtype", lambda: _with(g=-torch.rand(1, 6, 4, 8, dtype=torch.bfloat16)), TypeError, "g"),
    ("beta-fp16-with-fp32-q", lambda: _with(beta=torch.rand(1, 6, 4, dtype=torch.float16)),
     TypeError, "beta"),
    ("beta-int", lambda: _with(beta=torch.ones(1, 6, 4, dtype=torch.int32)), TypeError, "beta"),
    ("initial_state-fp64", lambda: _with(initial_state=torch.zeros(1, 4, 8, 8, dtype=torch.float64)),
     TypeError, "initial_state"),
    ("initial_state-fp16", lambda: _with(initial_state=torch.zeros(1, 4, 8, 8, dtype=torch.float16)),
     TypeError, "initial_state"),
    ("A_log-fp64", lambda: _gate(A_log=torch.zeros(4, dtype=torch.float64)), TypeError, "A_log"),
    ("dt_bias-bf16", lambda: _gate(dt_bias=torch.zeros(32, dtype=torch.bfloat16)),
     TypeError, "dt_bias"),
    ("cu_seqlens-float", lambda: _varlen(torch.tensor([0.0, 6.0])), TypeError, "cu_seqlens"),
    ("cu_seqlens-int16", lambda: _varlen(torch.tensor([0, 6], dtype=torch.int16)),
     TypeError, "cu_seqlens"),
    # ---- devices (meta tensors stand in for "another device" on a CPU-only machine) --------
    ("k-other-device", lambda: _with(k=torch.empty(1, 6, 2, 8, device="meta")), ValueError, "k"),
    ("beta-other-device", lambda: _with(beta=torch.empty(1, 6, 4, device="meta")),
     ValueError, "beta"),
    ("initial_state-other-device",
     lambda: _with(initial_state=torch.empty(1, 4, 8, 8, device="meta")),
     ValueError, "initial_state"),
    ("cu_seqlens-other-device",
     lambda: _varlen(torch.empty(2, dtype=torch.int32, device="meta")), ValueError, "cu_seqlens"),
    ("A_log-other-device", lambda: _gate(A_log=torch.empty(4, device="meta")), ValueError, "A_log"),
    # ---- cu_seqlens structure and values -------------------------------------------------
    ("cu_seqlens-2d", lambda: _varlen(torch.tensor([[0, 6]], dtype=torch.int32)),
     ValueError, "cu_seqlens"),
    ("cu_seqlens-len1", lambda: _varlen([0]), ValueError, "cu_seqlens"),
    ("cu_seqlens-empty", lambda: _varlen(torch.zeros(0, dtype=torch.int32)),
     ValueError, "cu_seqlens"),
    ("cu_seqlens-with-B2", lambda: _with(make_args(B=2), cu_seqlens=torch.tensor([0, 6, 12])),
     ValueError, "cu_seqlens"),
    ("cu_seqlens-start-not-0", lambda: _varlen([1, 3, 6]), ValueError, "cu_seqlens"),
    ("cu_seqlens-decreasing", lambda: _varlen([0, 4, 2, 6]), ValueError, "cu_seqlens"),
    ("cu_seqlens-end-past-T", lambda: _varlen(torch.tensor([0, 2, 7], dtype=torch.int64)),
     ValueError, "cu_seqlens"),
    # ---- initial_state shape ----------------------------------------------------------------
    ("initial_state-rank", lambda: _with(initial_state=torch.zeros(4, 8, 8)),
     ValueError, "initial_state"),
    ("initial_state-N-vs-B", lambda: _with(make_args(B=2), initial_state=torch.zeros(1, 4, 8, 8)),
     ValueError, "initial_state"),
    ("initial_state-N-vs-cu_seqlens",
     lambda: _varlen([0, 2, 4, 6], initial_state=torch.zeros(2, 4, 8, 8)),
     ValueError, "initial_state"),
    ("initial_state-HV", lambda: _with(initial_state=torch.zeros(1, 2, 8, 8)),
     ValueError, "initial_state"),
    ("initial_state-kv-shape-for-vk",
     lambda: _with(make_args(K=8, V=16), initial_state=torch.zeros(1, 4, 8, 16), state_layout="vk"),
     ValueError, "initial_state"),
    ("initial_state-vk-shape-for-kv",
     lambda: _with(make_args(K=8, V=16), initial_state=torch.zeros(1, 4, 16, 8)),
     ValueError, "initial_state"),
    # ---- gate parameters ------------------------------------------------------------------
    ("A_log-without-gate", lambda: _with(A_log=torch.zeros(4)), ValueError, "A_log"),
    ("dt_bias-without-gate", lambda: _with(dt_bias=torch.zeros(32)), ValueError, "dt_bias"),
    ("A_log-shape", lambda: _gate(A_log=torch.zeros(2)), ValueError, "A_log"),
    ("A_log-shape-2d", lambda: _gate(A_log=torch.zeros(4, 1)), ValueError, "A_log"),
    ("dt_bias-shape", lambda: _gate(dt_bias=torch.zeros(8)), ValueError, "dt_bias"),
    ("dt_bias-shape-2d", lambda: _gate(dt_bias=torch.zeros(8, 4)), ValueError, "dt_bias"),
    ("softplus-gate-needs-A_log",
     lambda: _with(use_gate_in_kernel=True, dt_bias=torch.zeros(32)), ValueError, "A_log"),
    # ---- lower_bound / safe_gate ------------------------------------------------------------
    ("lower_bound-without-gate", lambda: _with(lower_bound=-5.0), ValueError, "lower_bound"),
    ("lower_bound-zero", lambda: _gate(lower_bound=0.0, safe_gate=False), ValueError, "lower_bound"),
    ("lower_bound-positive", lambda: _gate(lower_bound=1.0, safe_gate=False),
     ValueError, "lower_bound"),
    ("lower_bound-nan", lambda: _gate(lower_bound=math.nan, safe_gate=False),
     ValueError, "lower_bound"),
    ("lower_bound--inf", lambda: _gate(lower_bound=-math.inf, safe_gate=False),
     ValueError, "lower_bound"),
    ("lower_bound-below-safe", lambda: _gate(lower_bound=-5.5, safe_gate=True),
     ValueError, "lower_bound"),
    ("lower_bound-str", lambda: _gate(lower_bound="-5"), TypeError, "lower_bound"),
    ("lower_bound-bool", lambda: _gate(lower_bound=True), TypeError, "lower_bound"),
    ("lower_bound-tensor", lambda: _gate(lower_bound=torch.tensor(-5.0)), TypeError, "lower_bound"),
    ("safe_gate-gate-needs-lower_bound",
     lambda: _gate(lower_bound=None, safe_gate=True), ValueError, "lower_bound"),
    # ---- scale ----------------------------------------------------------------------------
    ("scale-zero", lambda: _with(scale=0.0), ValueError, "scale"),
    ("scale-negative", lambda: _with(scale=-1), ValueError, "scale"),
    ("scale-inf", lambda: _with(scale=math.inf), ValueError, "scale"),
    ("scale-nan", lambda: _with(scale=math.nan), ValueError, "scale"),
    ("scale-str", lambda: _with(scale="0.1"), TypeError, "scale"),
    ("scale-bool", lambda: _with(scale=True), TypeError, "scale"),
    ("scale-tensor", lambda: _with(scale=torch.tensor(0.1)), TypeError, "scale"),
    # ---- enums and flags --------------------------------------------------------------------
    ("state_layout", lambda: _with(state_layout="kvk"), ValueError, "state_layout"),
    ("state_layout-upper", lambda: _with(state_layout="KV"), ValueError, "state_layout"),
    ("state_layout-not-str", lambda: _with(state_layout=None), ValueError, "state_layout"),
    ("backend", lambda: _with(backend="cuda"), ValueError, "backend"),
    ("backend-triton", lambda: _with(backend="triton"), ValueError, "backend"),
    ("output_final_state-int", lambda: _with(output_final_state=1), TypeError, "output_final_state"),
    ("output_final_state-str", lambda: _with(output_final_state="yes"),
     TypeError, "output_final_state"),
    ("use_qk_l2norm_in_kernel-None", lambda: _with(use_qk_l2norm_in_kernel=None),
     TypeError, "use_qk_l2norm_in_kernel"),
    ("use_gate_in_kernel-int", lambda: _with(use_gate_in_kernel=1), TypeError, "use_gate_in_kernel"),
    ("safe_gate-str", lambda: _with(safe_gate="True"), TypeError, "safe_gate"),
    # ---- sm90 backend limits (argument-level: raised before any device check) --------------
    ("sm90-fp32", lambda: _with(make_args(K=128, V=128), backend="sm90", safe_gate=True),
     TypeError, "q"),
    ("sm90-fp16", lambda: _with(make_args(K=128, V=128, dtype=torch.float16),
                                backend="sm90", safe_gate=True), TypeError, "q"),
    ("sm90-K64", lambda: _with(make_args(K=64, V=128, dtype=torch.bfloat16),
                               backend="sm90", safe_gate=True), ValueError, "q"),
    ("sm90-V64", lambda: _with(make_args(K=128, V=64, dtype=torch.bfloat16),
                               backend="sm90", safe_gate=True), ValueError, "v"),
]


@pytest.mark.parametrize("build, exc, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_validation_rule(build, exc, name) -> None:
    kwargs = build()
    snap = snapshot(kwargs)
    before = prefill_mod.last_backend()
    with pytest.raises(exc) as info:
        kda_prefill(**kwargs)
    assert type(info.value) is exc, f"expected exactly {exc.__name__}, got {type(info.value)}"
    msg = str(info.value)
    assert name in msg, f"message does not name `{name}`: {msg}"
    assert_unchanged(kwargs, snap)
    assert prefill_mod.last_backend() == before, "a failed call must not update last_backend()"


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("cu", [[0, 6], [0, 2, 6], [0, 0, 6, 6], [0, 1, 2, 3, 4, 5, 6],
                                [0, 2, 5], [0, 0, 0], [0, 3, 3, 3]])  # last < T: padded bucket
def test_valid_cu_seqlens_accepted(cu, cu_dtype) -> None:
    kw = _varlen(torch.tensor(cu, dtype=cu_dtype), output_final_state=True)
    o, ht = kda_prefill(**kw)
    assert o.shape == (1, 6, 4, 8) and ht.shape == (len(cu) - 1, 4, 8, 8)


def test_lower_bound_below_minus_5_allowed_without_safe_gate(seed) -> None:
    kw = _gate(lower_bound=-8.0, safe_gate=False, A_log=0.1 * torch.randn(4),
               dt_bias=0.1 * torch.randn(32), g=2 + torch.rand(1, 6, 4, 8))  # raw gate
    o, _ = kda_prefill(**kw)
    gate_args = {n: kw.pop(n) for n in ("A_log", "dt_bias", "lower_bound")}
    g = kda_gate(kw.pop("g"), **gate_args)          # decays in [-8, 0), below the safe range
    assert float(g.min()) < -5.0
    o_ref, _ = naive_kda(kw["q"], kw["k"], kw["v"], g, kw["beta"], 8 ** -0.5)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)


def test_dt_bias_2d_accepted_and_same_as_flat(seed) -> None:
    kw = _gate(dt_bias=torch.randn(32))
    o_flat, _ = kda_prefill(**kw)
    kw["dt_bias"] = kw["dt_bias"].view(4, 8)
    o_2d, _ = kda_prefill(**kw)
    assert torch.equal(o_flat, o_2d)


# ----------------------------------------------------------------------------------------------
# the sm90 backend on a CPU-only machine
# ----------------------------------------------------------------------------------------------


def test_sm90_on_cpu_raises_clear_error() -> None:
    kw = _with(make_args(K=128, V=128, dtype=torch.bfloat16), backend="sm90", safe_gate=True)
    snap = snapshot(kw)
    with pytest.raises(ValueError) as info:
        kda_prefill(**kw)
    msg = str(info.value)
    assert "`q`" in msg and "CUDA" in msg and "cpu" in msg and 'backend="reference"' in msg
    assert_unchanged(kw, snap)


def test_sm90_argument_errors_come_before_device_errors() -> None:
    """On CPU, an unsupported dtype is reported as such, not as a device problem."""
    kw = _with(make_args(K=128, V=128, dtype=torch.float32), backend="sm90", safe_gate=True)
    with pytest.raises(TypeError) as info:
        kda_prefill(**kw)
    assert "bfloat16" in str(info.value) and 'backend="reference"' in str(info.value)


def test_ext_reports_why_unavailable() -> None:
    from cula import _ext

    if _ext.kernels_available():
        assert _ext.kernels_unavailable_reason() == ""
        assert hasattr(_ext.get_ext(), "kda_prefill_sm90")
    else:
        reason = _ext.kernels_unavailable_reason()
        assert "cula._C" in reason and "pip install --no-build-isolation ." in reason
        with pytest.raises(RuntimeError, match="no-build-isolation"):
            _ext.get_ext()
    assert cula.kernels_available() == _ext.kernels_available()


# ----------------------------------------------------------------------------------------------
# the reference backend end to end (CPU)
# ----------------------------------------------------------------------------------------------


def test_package_surface() -> None:
    assert cula.__version__ == "0.1.0"
    assert cula.kda.kda_prefill is prefill_mod.kda_prefill
    import importlib

    assert importlib.import_module("cula.kda.prefill") is prefill_mod
    assert cula.kda.prefill is prefill_mod


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("output_final_state", [False, True])
def test_reference_shapes_and_dtypes(dtype, output_final_state, seed) -> None:
    kw = _with(make_args(B=2, T=5, H=2, HV=4, K=8, V=16, dtype=dtype),
               output_final_state=output_final_state)
    snap = snapshot(kw)
    o, ht = kda_prefill(**kw)
    assert o.shape == (2, 5, 4, 16) and o.dtype == dtype
    if output_final_state:
        assert ht is not None and ht.shape == (2, 4, 8, 16) and ht.dtype == torch.float32
    else:
        assert ht is None
    assert torch.isfinite(o.float()).all()
    assert prefill_mod.last_backend() == "reference"
    assert_unchanged(kw, snap)


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_reference_matches_naive_loop(layout, seed) -> None:
    """GVA, varlen, initial state, both layouts, explicit scale: checks argument forwarding."""
    H, HV, K, V, T = 2, 4, 8, 16, 9
    kw = _with(make_args(B=1, T=T, H=H, HV=HV, K=K, V=V))
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int64)
    h0_shape = (3, HV, K, V) if layout == "kv" else (3, HV, V, K)
    h0 = torch.randn(h0_shape) * 0.1
    o, ht = kda_prefill(**kw, cu_seqlens=cu, initial_state=h0, output_final_state=True,
                        scale=0.3, state_layout=layout)
    o_ref, ht_ref = naive_kda(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], 0.3, h0, cu, layout)
    assert ht.shape == h0_shape
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-4, atol=1e-5)


def test_reference_default_scale(seed) -> None:
    kw = _with(make_args(K=8, V=8))
    o, _ = kda_prefill(**kw)
    o_ref, _ = naive_kda(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], 8 ** -0.5)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", ["lower_bound", "lower_bound_no_A_log", "softplus"])
def test_reference_gate_in_kernel_matches_precomputed_gate(form, seed) -> None:
    kw = _with(make_args(HV=4, K=8))
    A_log = torch.randn(4) * 0.5
    dt_bias = torch.randn(32)
    x = kw["g"] + dt_bias.view(4, 8)
    if form == "lower_bound":
        gate = dict(lower_bound=-3.0, A_log=A_log, safe_gate=True)
        decay = -3.0 * torch.sigmoid(A_log.exp().view(4, 1) * x)
    elif form == "lower_bound_no_A_log":
        gate = dict(lower_bound=-3.0, safe_gate=True)
        decay = -3.0 * torch.sigmoid(x)
    else:
        gate = dict(A_log=A_log)
        decay = -A_log.exp().view(4, 1) * torch.nn.functional.softplus(x)
    o_gate, ht_gate = kda_prefill(**kw, use_gate_in_kernel=True, dt_bias=dt_bias,
                                  output_final_state=True, **gate)
    o_pre, ht_pre = kda_prefill(**{**kw, "g": decay}, output_final_state=True)
    torch.testing.assert_close(o_gate, o_pre, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ht_gate, ht_pre, rtol=1e-4, atol=1e-5)


def test_reference_l2norm_in_kernel(seed) -> None:
    kw = _with(make_args())
    o_in, _ = kda_prefill(**kw, use_qk_l2norm_in_kernel=True)
    qn = torch.nn.functional.normalize(kw["q"], dim=-1)
    kn = torch.nn.functional.normalize(kw["k"], dim=-1)
    o_pre, _ = kda_prefill(**{**kw, "q": qn, "k": kn})
    torch.testing.assert_close(o_in, o_pre, rtol=1e-3, atol=1e-4)


def test_auto_on_cpu_picks_reference(caplog, seed) -> None:
    prefill_mod.LAST_BACKEND = None
    assert prefill_mod.last_backend() is None
    kw = make_args()  # backend defaults to "auto"
    with caplog.at_level(logging.DEBUG, logger="cula.kda.prefill"):
        kda_prefill(**kw)
    assert prefill_mod.last_backend() == "reference"
    assert prefill_mod.LAST_BACKEND == "reference"
    assert cula.kda.last_backend() == "reference"
    assert any("backend=reference" in r.getMessage() and "requested auto" in r.getMessage()
               for r in caplog.records)


def test_non_contiguous_inputs_match_contiguous(seed) -> None:
    B, T, H, HV, K, V = 2, 7, 2, 4, 8, 16
    # Same values, non-contiguous storage: head-major buffers transposed, a strided beta,
    # a transposed initial state, a sliced cu-free batch.
    q = torch.randn(B, H, T, K).transpose(1, 2)
    k = torch.randn(B, H, T, K).transpose(1, 2)
    v = torch.randn(B, HV, T, V).transpose(1, 2)
    g = -torch.rand(B, HV, T, K).transpose(1, 2)
    beta = torch.rand(B, T, 2 * HV)[..., ::2]
    h0 = torch.randn(B, HV, V, K).transpose(-1, -2)  # "kv" layout values, vk storage
    A_log = torch.randn(2 * HV)[::2]
    dt_bias = torch.randn(HV, 2 * K)[:, :K]  # [HV, K] non-contiguous
    nc = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, A_log=A_log, dt_bias=dt_bias)
    for name, t in nc.items():
        assert not t.is_contiguous(), name
    opts = dict(output_final_state=True, use_gate_in_kernel=True, lower_bound=-5.0,
                safe_gate=True, use_qk_l2norm_in_kernel=True, backend="reference")
    snap = snapshot(nc)
    o_nc, ht_nc = kda_prefill(**nc, **opts)
    assert_unchanged(nc, snap)
    c = {n: t.contiguous() for n, t in nc.items()}
    o_c, ht_c = kda_prefill(**c, **opts)
    assert torch.equal(o_nc, o_c)
    assert torch.equal(ht_nc, ht_c)


def test_reference_on_zero_length_sequences(seed) -> None:
    """Empty sequences in a varlen batch keep their initial state."""
    kw = _with(make_args(T=4))
    h0 = torch.randn(3, 4, 8, 8)
    o, ht = kda_prefill(**kw, cu_seqlens=torch.tensor([0, 0, 4, 4]), initial_state=h0,
                        output_final_state=True)
    assert torch.equal(ht[0], h0[0]) and torch.equal(ht[2], h0[2])


# ----------------------------------------------------------------------------------------------
# dispatch on a (simulated) Hopper GPU: no silent fallback, the extension's calling convention
# ----------------------------------------------------------------------------------------------


def _sm90_kwargs(**over: Any) -> dict[str, Any]:
    kw = make_args(B=1, T=5, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16,
                   beta_dtype=torch.float32)
    kw.update(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    kw.update(over)
    return kw


def test_auto_on_hopper_does_not_fall_back_silently(monkeypatch) -> None:
    monkeypatch.setattr(prefill_mod, "_is_sm90", lambda device: True)
    prefill_mod.LAST_BACKEND = None
    with pytest.raises(TypeError, match='backend="auto".*`q`.*bfloat16'):
        kda_prefill(**{**_sm90_kwargs(), **{n: t.float() for n, t in
                                             make_args(T=5, K=128, V=128).items()}})
    assert prefill_mod.last_backend() is None


def test_hopper_without_extension_raises(monkeypatch) -> None:
    """On an SM90 GPU without the compiled extension, the sm90 path says how to build it."""
    from types import SimpleNamespace

    from cula import _ext

    monkeypatch.setattr(prefill_mod, "_is_sm90", lambda device: True)
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", "ModuleNotFoundError: simulated")
    fake_q = SimpleNamespace(device=torch.device("cuda", 0))  # only .device is consulted
    with pytest.raises(RuntimeError) as info:
        prefill_mod._check_sm90_environment(fake_q, prefix='backend="auto" chose sm90: ')
    msg = str(info.value)
    assert "simulated" in msg and "no-build-isolation" in msg and 'backend="reference"' in msg


#: The extension's calling convention: keyword-only arguments with these names (the names of the
#: op's schema; ``state_v_first`` is ``state_layout == "vk"``).
EXT_ARGUMENTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens",
                 "state_indices", "has_initial_state", "o", "final_state", "state_pool", "scale",
                 "lower_bound", "use_gate_in_kernel", "use_qk_l2norm_in_kernel",
                 "use_beta_sigmoid_in_kernel", "state_v_first", "general_gates")


def test_sm90_dispatch_calls_extension_with_documented_arguments(monkeypatch) -> None:
    """The fused backend gets inputs it can read (views with TMA-compatible strides as they
    are), caller-owned outputs and named arguments only."""
    from cula import _ext

    calls: list[dict[str, Any]] = []

    class FakeExt:
        @staticmethod
        def kda_prefill_sm90(*args, **kwargs):
            assert not args, "the extension takes keyword arguments only"
            calls.append(kwargs)
            kwargs["o"].fill_(1.0)
            if kwargs["final_state"] is not None:
                kwargs["final_state"].fill_(2.0)

    monkeypatch.setattr(prefill_mod, "_check_sm90_environment", lambda q, prefix: None)
    monkeypatch.setattr(_ext, "get_ext", lambda: FakeExt)
    kw = _sm90_kwargs(A_log=torch.zeros(4), dt_bias=torch.zeros(4, 128),
                      cu_seqlens=torch.tensor([0, 5]), initial_state=torch.zeros(1, 4, 128, 128),
                      state_layout="vk", output_final_state=True, use_qk_l2norm_in_kernel=True,
                      backend="sm90", scale=0.25)
    kw["q"] = kw["q"].transpose(1, 2).contiguous().transpose(1, 2)  # a strided view TMA reads as is
    snap = snapshot(kw)
    o, ht = kda_prefill(**kw)
    assert_unchanged(kw, snap)
    assert prefill_mod.last_backend() == "sm90"
    assert o.shape == (1, 5, 4, 128) and o.dtype == torch.bfloat16 and bool((o == 1).all())
    assert ht.shape == (1, 4, 128, 128) and ht.dtype == torch.float32 and bool((ht == 2).all())
    (args,) = calls
    assert tuple(args) == EXT_ARGUMENTS
    assert args["q"] is kw["q"] and not args["q"].is_contiguous()
    for name in ("k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens"):
        assert args[name].is_contiguous() and args[name].data_ptr() % 16 == 0, name
        if name == "dt_bias":
            assert args[name].shape == (4 * 128,)
        else:
            assert torch.equal(args[name], kw[name]), name
    assert args["o"].data_ptr() == o.data_ptr() and args["final_state"].data_ptr() == ht.data_ptr()
    assert args["state_indices"] is None and args["has_initial_state"] is None and args["state_pool"] is None
    options = {n: args[n] for n in EXT_ARGUMENTS[14:]}
    assert options == dict(scale=0.25, lower_bound=-5.0, use_gate_in_kernel=True,
                           use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=False,
                           state_v_first=True, general_gates=False)
    # auto on a Hopper GPU with supported arguments picks the kernel too
    kw.update(backend="auto", output_final_state=False, state_layout="kv")
    monkeypatch.setattr(prefill_mod, "_is_sm90", lambda device: True)
    prefill_mod.LAST_BACKEND = None
    o, ht = kda_prefill(**kw)
    assert ht is None and prefill_mod.last_backend() == "sm90"
    assert calls[-1]["final_state"] is None and calls[-1]["state_v_first"] is False


@pytest.mark.parametrize("case", ["T", "B", "tiles"])
def test_sm90_refuses_sizes_past_32_bits(case) -> None:
    """The fused kernel's sizes and grid are 32-bit: larger calls raise instead of truncating
    (meta tensors: the shapes without the memory)."""
    big = 2**31
    shape_q = {"T": (1, big, 1, 128), "B": (big, 1, 1, 128), "tiles": (1, 8, 1, 128)}[case]
    q = torch.empty(shape_q, device="meta", dtype=torch.bfloat16)
    v = torch.empty(shape_q[:2] + ((64,) if case == "tiles" else (1,)) + (128,), device="meta",
                    dtype=torch.bfloat16)
    num_seqs = 2**26 if case == "tiles" else shape_q[0]
    with pytest.raises(ValueError, match="sm90") as info:
        prefill_mod._check_sm90_arguments(q, v, num_seqs, True, prefix="")
    assert ("`q`" in str(info.value)) == (case != "tiles")
    prefill_mod._check_sm90_arguments(q[:, :8] if case == "T" else q[:8] if case == "B" else q,
                                      v[:, :8] if case == "T" else v[:8] if case == "B" else v,
                                      8 if case == "B" else 1 if case == "T" else 2**20, True,
                                      prefix="")


# ----------------------------------------------------------------------------------------------
# remembered validation (prefill._VALIDATED): a signature that passed skips the argument rules,
# and every call that differs in something a rule reads still gets the rules
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_memo():
    prefill_mod._VALIDATED.clear()
    yield prefill_mod._VALIDATED
    prefill_mod._VALIDATED.clear()



def test_validation_remembered_per_signature(fresh_memo, monkeypatch, seed, count_calls) -> None:
    runs = count_calls(prefill_mod, "_validate_tensors")
    kw = _gate(output_final_state=True)
    o1, s1 = kda_prefill(**kw)
    assert len(runs) == 1 and len(fresh_memo) == 1
    kw2 = _gate(output_final_state=True)  # new tensors, same signature: no rule runs
    o2, s2 = kda_prefill(**kw2)
    assert len(runs) == 1
    ref, ref_s = kda_prefill(**{**kw2, "backend": "auto"})  # a new option value: a miss
    assert len(runs) == 2
    assert torch.equal(o2, ref) and torch.equal(s2, ref_s)
    for change in (dict(scale=0.5), dict(output_final_state=False), dict(lower_bound=-4.0),
                   dict(state_layout="vk"), dict(use_qk_l2norm_in_kernel=True)):
        kda_prefill(**{**kw2, **change})
    assert len(runs) == 7 and len(fresh_memo) == 7
    # the remembered scale is the caller's (None -> K ** -0.5), not a stale one
    half, _ = kda_prefill(**{**kw2, "scale": 0.5})
    assert len(runs) == 7 and not torch.equal(half, o2)


#: Valid-call changes that break exactly one rule without changing anything else the signature
#: holds besides the broken property: each must still raise after the valid call was remembered.
REMEMBERED_THEN_BROKEN: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], type[BaseException], str]] = [
    ("bool-as-int", lambda kw: {**kw, "output_final_state": 1}, TypeError, "output_final_state"),
    ("bool-as-int-l2norm", lambda kw: {**kw, "use_qk_l2norm_in_kernel": 0}, TypeError,
     "use_qk_l2norm_in_kernel"),
    ("lower-bound-out-of-range", lambda kw: {**kw, "lower_bound": -6.0}, ValueError, "lower_bound"),
    ("lower-bound-as-int", lambda kw: {**kw, "lower_bound": -5}, None, ""),  # valid, a new entry
    ("scale-zero", lambda kw: {**kw, "scale": 0.0}, ValueError, "scale"),
    ("scale-nan", lambda kw: {**kw, "scale": float("nan")}, ValueError, "scale"),
    ("k-on-meta", lambda kw: {**kw, "k": kw["k"].to("meta")}, ValueError, "k"),
    ("beta-float64", lambda kw: {**kw, "beta": kw["beta"].double()}, TypeError, "beta"),
    ("A_log-shape", lambda kw: {**kw, "A_log": torch.zeros(5)}, ValueError, "A_log"),
    ("backend-unknown", lambda kw: {**kw, "backend": "sm80"}, ValueError, "backend"),
    ("option-list", lambda kw: {**kw, "scale": [0.5]}, TypeError, "scale"),
]


@pytest.mark.parametrize("change, exc, name", [c[1:] for c in REMEMBERED_THEN_BROKEN],
                         ids=[c[0] for c in REMEMBERED_THEN_BROKEN])
def test_remembered_signature_still_checks_the_rules(fresh_memo, change, exc, name) -> None:
    kw = _gate(output_final_state=True, use_qk_l2norm_in_kernel=True, scale=0.25)
    kda_prefill(**kw)
    kda_prefill(**kw)
    assert len(fresh_memo) == 1
    changed = change(kw)
    if exc is None:
        kda_prefill(**changed)
        assert len(fresh_memo) == 2
        return
    for _ in range(2):  # and a failing call is never remembered
        with pytest.raises(exc) as info:
            kda_prefill(**changed)
        assert type(info.value) is exc and name in str(info.value)
    assert len(fresh_memo) == 1


def test_index_values_are_checked_on_every_call(fresh_memo) -> None:
    """CPU cu_seqlens / state_indices are value-checked by default: such calls are never
    remembered, so bad values of a shape that passed still raise."""
    kda_prefill(**_varlen([0, 2, 6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_prefill(**_varlen([0, 4, 2]))
    assert len(fresh_memo) == 0
    kda_prefill(**_varlen([0, 2, 6], check_inputs=False))  # values trusted: remembered
    assert len(fresh_memo) == 1


def test_state_pool_alignment_checked_after_a_remembered_call(fresh_memo) -> None:
    """The pool's rule reads its strides and data-pointer alignment: both are in the signature."""
    base = torch.zeros(2 * 4 * 8 * 8 + 4)
    pool = base[: 2 * 4 * 8 * 8].view(2, 4, 8, 8)
    shifted = base[1: 1 + 2 * 4 * 8 * 8].view(2, 4, 8, 8)  # same shape and strides, 4-byte offset
    assert pool.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 != 0
    kw = _with(make_args(B=2), state_indices=torch.tensor([1, 0]), check_inputs=False,
               output_final_state=True)
    kda_prefill(**{**kw, "initial_state": pool})
    assert len(fresh_memo) == 1
    with pytest.raises(ValueError, match="initial_state"):
        kda_prefill(**{**kw, "initial_state": shifted})


def test_remembered_validation_is_bounded(fresh_memo, monkeypatch) -> None:
    monkeypatch.setattr(prefill_mod, "_VALIDATED_MAX", 3)
    kw = _with()
    for i in range(7):
        kda_prefill(**{**kw, "scale": 0.1 * (i + 1)})
        assert 1 <= len(fresh_memo) <= 3


def test_sm90_argument_limits_remembered_with_the_signature(fresh_memo, monkeypatch) -> None:
    """The fused kernel's argument limits (head dims, dtypes, 32-bit sizes) read only what the
    signature holds: checked on the first sm90 call of a signature, remembered with it; the
    device and build checks still run on every call, and a signature that fails the limits keeps
    failing."""
    from cula import _ext

    class FakeExt:
        @staticmethod
        def kda_prefill_sm90(**kwargs):
            return None

    limits: list[int] = []
    environment: list[int] = []
    real_limits = prefill_mod._check_sm90_arguments

    def counting_limits(*args: Any, **kwargs: Any) -> None:
        limits.append(1)
        real_limits(*args, **kwargs)

    monkeypatch.setattr(prefill_mod, "_check_sm90_arguments", counting_limits)
    monkeypatch.setattr(prefill_mod, "_check_sm90_environment", lambda q, prefix: environment.append(1))
    monkeypatch.setattr(_ext, "get_ext", lambda: FakeExt)
    kw = _sm90_kwargs(backend="sm90")
    for _ in range(3):
        kda_prefill(**kw)
    assert len(limits) == 1 and len(environment) == 3 and len(fresh_memo) == 1
    assert prefill_mod.last_backend() == "sm90"
    # the reference backend never checks them, and does not mark the entry for sm90
    fresh_memo.clear()
    kda_prefill(**{**kw, "backend": "reference"})
    kda_prefill(**{**kw, "backend": "reference"})
    assert len(limits) == 1
    # a signature the kernel does not take (q float32) raises on every call, remembered or not
    bad = {**kw, **{n: kw[n].float() for n in ("q", "k", "v", "g")}}
    for _ in range(2):
        with pytest.raises(TypeError, match="q"):
            kda_prefill(**bad)
    assert len(limits) == 3
