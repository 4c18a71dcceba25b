"""CPU tests of the PyTorch references (cula.kda.reference).

* the chunked form (what the fused kernel computes) equals the recurrence (the specification) in
  float64 over a grid of GVA ratios, lengths, varlen batches, gate modes, state layouts, initial /
  final state, l2norm and beta dtypes;
* structural properties: varlen == independent calls, empty sequences keep their initial state,
  the two state layouts are transposes, batch == varlen, scale is linear;
* independent checks of the recurrence: a per-head NumPy loop, hand formulas for gate / l2norm,
  and FLA's ``naive_recurrent_kda`` / naive gates when fla-core is importable.

Inputs are random with a fresh seed per test (``seed`` fixture in conftest.py, printed; replay
with ``CULA_TEST_SEED=<n>``).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cula.kda.reference import (
    DIAG_SPAN_MAX_LOG2,
    kda_chunked_reference,
    kda_gate,
    kda_recurrent_reference,
    kda_segmented_reference,
    l2norm,
)

F64 = torch.float64

GVA = [(2, 2), (1, 2), (1, 4), (1, 8)]  # (H, HV): ratios 1, 2, 4, 8
VARLEN_CU = [0, 0, 1, 65, 65, 130, 200]  # empty, length-1, 64, empty, 65, 70 tokens
SHAPES = [("T", 1), ("T", 15), ("T", 63), ("T", 64), ("T", 65), ("T", 200), ("cu", VARLEN_CU)]
GATES = ["precomputed", "lb_alog", "lb_noalog", "softplus"]
STATE_MODES = ["none", "init", "final", "both"]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """The tensors here are tiny: intra-op threads only add spin-waiting, which on a loaded
    2-core CI machine made this file ~10x slower. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rel_err(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Relative L2 error; asserts that the reference is finite and not trivially zero."""
    assert ref.shape == x.shape, (ref.shape, x.shape)
    ref, x = ref.double(), x.double()
    assert torch.isfinite(ref).all() and torch.isfinite(x).all()
    denom = ref.norm().item()
    assert denom > 0, "reference is all zeros: the comparison would be meaningless"
    return (ref - x).norm().item() / denom


def assert_rel(ref: torch.Tensor, x: torch.Tensor, tol: float, what: str = "") -> None:
    """Assert rel_err(ref, x) <= tol with a short message (no tensor reprs in the failure)."""
    err = rel_err(ref, x)
    assert err <= tol, f"{what} rel L2 err {err:.3e} > {tol:.0e}"


def make_inputs(
    *,
    B: int,
    T: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    gate: str,
    l2: bool,
    beta_dtype: torch.dtype = torch.float32,
    N: int | None = None,
    init: bool = False,
    layout: str = "kv",
    in_dtype: torch.dtype = torch.float32,
) -> tuple[tuple[torch.Tensor, ...], dict]:
    """Random inputs drawn like a real model's; returns (q, k, v, g, beta) and keyword args."""
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    if l2:
        # raw projections of varying magnitude: the in-kernel l2norm must undo it
        q = q * (0.5 + 3 * torch.rand(B, T, H, 1))
        k = k * (0.5 + 3 * torch.rand(B, T, H, 1))
    else:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V)
    beta = torch.sigmoid(torch.randn(B, T, HV)).to(beta_dtype)
    kw: dict = dict(use_qk_l2norm_in_kernel=l2)
    if gate == "precomputed":
        g = -5.0 * (1.0 - torch.rand(B, T, HV, K))  # log decays in [-5, 0)
    elif gate == "lb_alog":
        g = 2.0 * torch.randn(B, T, HV, K)
        kw.update(use_gate_in_kernel=True, lower_bound=-5.0,
                  A_log=torch.log(torch.empty(HV).uniform_(1.0, 16.0)),
                  dt_bias=torch.randn(HV * K))
    elif gate == "lb_noalog":
        g = 3.0 * torch.randn(B, T, HV, K)
        kw.update(use_gate_in_kernel=True, lower_bound=-5.0, A_log=None, dt_bias=None)
    elif gate == "softplus":
        # small raw gates so that decays stay >= -5 per token (about -3.4 at worst)
        g = torch.empty(B, T, HV, K).uniform_(-3.0, 1.0)
        kw.update(use_gate_in_kernel=True, lower_bound=None,
                  A_log=torch.log(torch.empty(HV).uniform_(0.5, 2.0)),
                  dt_bias=torch.empty(HV * K).uniform_(-1.0, 0.5))
    else:
        raise AssertionError(gate)
    if init:
        n = B if N is None else N
        shape = (n, HV, K, V) if layout == "kv" else (n, HV, V, K)
        kw["initial_state"] = torch.randn(*shape)
    kw["state_layout"] = layout
    q, k, v = (x.to(in_dtype) for x in (q, k, v))
    return (q, k, v, g, beta), kw


def run_both(args, kw, dtype=F64, **extra):
    o_r, s_r = kda_recurrent_reference(*args, dtype=dtype, **kw, **extra)
    o_c, s_c = kda_chunked_reference(*args, dtype=dtype, **kw, **extra)
    return o_r, s_r, o_c, s_c


def check_chunked_vs_recurrent(args, kw, output_final_state: bool, tol: float = 1e-5, dtype=F64):
    o_r, s_r, o_c, s_c = run_both(args, kw, dtype=dtype, output_final_state=output_final_state)
    assert o_r.dtype == dtype and o_c.dtype == dtype
    assert_rel(o_r, o_c, tol, "o:")
    if output_final_state:
        assert s_r is not None and s_c is not None
        assert_rel(s_r, s_c, tol, "final state:")
    else:
        assert s_r is None and s_c is None
    return o_r, s_r


def gate_decays(g: torch.Tensor, kw: dict) -> torch.Tensor:
    """Natural-log decays of make_inputs' gates, computed with the plain formulas (float64)."""
    if not kw.get("use_gate_in_kernel"):
        return g.double()
    HV, K = g.shape[-2:]
    x = g.double()
    if kw.get("dt_bias") is not None:
        x = x + kw["dt_bias"].double().view(HV, K)
    A = kw.get("A_log")
    if kw.get("lower_bound") is None:
        return -A.double().exp().view(HV, 1) * torch.log1p(torch.exp(x))
    if A is not None:
        x = A.double().exp().view(HV, 1) * x
    return kw["lower_bound"] / (1.0 + torch.exp(-x))


# ------------------------------------------------------------------------------------------------
# chunked form == recurrence (float64)
# ------------------------------------------------------------------------------------------------

# The four on/off feature axes; the main grid rotates through their 32 combinations, the second
# grid takes their full product at the varlen shape.
FEATURES = list(itertools.product(["kv", "vk"], STATE_MODES, [False, True], [torch.float32, torch.bfloat16]))
MAIN_GRID = [
    (hv, shape, gate, FEATURES[(i * 5) % len(FEATURES)])
    for i, (hv, shape, gate) in enumerate(itertools.product(GVA, SHAPES, GATES))
]


def _grid_id(p) -> str:
    (H, HV), (kind, val), gate, (layout, state, l2, bdt) = p
    shape = f"T{val}" if kind == "T" else "varlen"
    return f"H{H}HV{HV}-{shape}-{gate}-{layout}-{state}-l2{int(l2)}-{str(bdt)[6:]}"


@pytest.mark.parametrize("params", MAIN_GRID, ids=[_grid_id(p) for p in MAIN_GRID])
def test_chunked_matches_recurrent_grid(seed, params):
    (H, HV), (kind, val), gate, (layout, state, l2, bdt) = params
    if kind == "T":
        B, T, cu, N = 2, val, None, 2
    else:
        B, T, cu, N = 1, val[-1], torch.tensor(val, dtype=torch.int32), len(val) - 1
    args, kw = make_inputs(B=B, T=T, H=H, HV=HV, K=16, V=16, gate=gate, l2=l2, beta_dtype=bdt,
                           N=N, init=state in ("init", "both"), layout=layout)
    kw["cu_seqlens"] = cu
    o, s = check_chunked_vs_recurrent(args, kw, output_final_state=state in ("final", "both"))
    assert o.shape == (B, T, HV, 16)
    if s is not None:
        assert s.shape == (N, HV, 16, 16)


@pytest.mark.parametrize(
    "layout,state,l2,bdt",
    FEATURES,
    ids=[f"{a}-{b}-l2{int(c)}-{str(d)[6:]}" for a, b, c, d in FEATURES],
)
@pytest.mark.parametrize("gate", GATES)
def test_chunked_matches_recurrent_features_varlen(seed, gate, layout, state, l2, bdt):
    H, HV = GVA[seed % len(GVA)]
    cu = torch.tensor(VARLEN_CU, dtype=torch.int64)
    args, kw = make_inputs(B=1, T=VARLEN_CU[-1], H=H, HV=HV, K=16, V=32, gate=gate, l2=l2,
                           beta_dtype=bdt, N=len(VARLEN_CU) - 1, init=state in ("init", "both"),
                           layout=layout)
    check_chunked_vs_recurrent(args, dict(kw, cu_seqlens=cu), output_final_state=state in ("final", "both"))


@pytest.mark.parametrize("gate", ["lb_alog", "precomputed"])
def test_chunked_matches_recurrent_head_dim_128(seed, gate):
    args, kw = make_inputs(B=1, T=150, H=2, HV=4, K=128, V=128, gate=gate, l2=True, init=True,
                           layout="vk", beta_dtype=torch.bfloat16, in_dtype=torch.bfloat16)
    check_chunked_vs_recurrent(args, kw, output_final_state=True)


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunked_other_chunk_sizes(seed, chunk_size):
    args, kw = make_inputs(B=1, T=200, H=1, HV=2, K=16, V=16, gate="lb_alog", l2=True,
                           N=len(VARLEN_CU) - 1, init=True)
    kw["cu_seqlens"] = torch.tensor(VARLEN_CU)
    o_r, s_r = kda_recurrent_reference(*args, dtype=F64, output_final_state=True, **kw)
    o_c, s_c = kda_chunked_reference(*args, dtype=F64, output_final_state=True, chunk_size=chunk_size, **kw)
    assert_rel(o_r, o_c, 1e-5)
    assert_rel(s_r, s_c, 1e-5)


def test_chunked_float32_worst_case_safe_gates(seed):
    """fp32 chunked form with every decay at the bound (-5 per token): the sub-block factors reach
    e^75 but stay finite, and the result matches the fp64 recurrence (the kernel's numerics)."""
    args, kw = make_inputs(B=1, T=200, H=1, HV=2, K=128, V=64, gate="lb_noalog", l2=True, init=True)
    q, k, v, g, beta = args
    g = torch.full_like(g, 40.0)  # sigmoid(40) == 1 in fp32 and fp64: every decay is exactly -5
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, dtype=F64, output_final_state=True, **kw)
    o32, s32 = kda_chunked_reference(q, k, v, g, beta, dtype=torch.float32, output_final_state=True, **kw)
    assert o32.dtype == torch.float32
    assert_rel(o_ref, o32, 1e-4)
    assert_rel(s_ref, s32, 1e-4)


def _unbounded_gate_inputs(kind: str, T: int = 200, K: int = 64, V: int = 32, HV: int = 2):
    """Inputs whose decays the safe-gate factorisation cannot take (issue: safe_gate=False):
    Kimi-Linear's softplus gate with A_log ~ N(0, 1) and g ~ 2 N(0, 1); precomputed decays down
    to -30 per token; and precomputed decays with whole channels reset (-inf) at some tokens."""
    args, kw = make_inputs(B=1, T=T, H=1, HV=HV, K=K, V=V, gate="precomputed", l2=True, init=True)
    q, k, v, g, beta = args
    if kind == "softplus":
        g = 2.0 * torch.randn(1, T, HV, K)
        kw.update(use_gate_in_kernel=True, A_log=torch.randn(HV), dt_bias=torch.randn(HV * K))
    elif kind == "to_-30":
        g = -30.0 * torch.rand(1, T, HV, K)
        g[..., : K // 4] = -30.0                     # a quarter of the channels at the extreme
    elif kind == "-inf":
        g = -5.0 * torch.rand(1, T, HV, K)
        reset = torch.rand(1, T, HV, K) < 0.02       # ~2% of (token, channel) pairs reset to zero
        g = torch.where(reset, torch.tensor(float("-inf")), g)
    return (q, k, v, g, beta), kw


@pytest.mark.parametrize("kind", ["softplus", "to_-30", "-inf"])
def test_chunked_general_gates_float32_matches_recurrence(seed, kind):
    """The general-gate chunked form (the design for the kernel's safe_gate=False path) in fp32
    equals the fp64 recurrence for unbounded decays, with varlen boundaries inside chunks; the
    safe-gate form overflows on the extreme decays (why the general form exists)."""
    (q, k, v, g, beta), kw = _unbounded_gate_inputs(kind)
    if kind != "softplus":  # the element-by-element path of the diagonal sub-blocks is exercised
        span = -(g.clamp(min=-200 * math.log(2)).unfold(1, 16, 16).sum(-1)) / math.log(2)
        assert bool((span > DIAG_SPAN_MAX_LOG2).any())
    kw["cu_seqlens"] = torch.tensor([0, 37, 37, 130, 200])
    kw["initial_state"] = 0.1 * torch.randn(4, 2, 64, 32)
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, dtype=F64, output_final_state=True, **kw)
    o32, s32 = kda_chunked_reference(q, k, v, g, beta, dtype=torch.float32, output_final_state=True,
                                     general_gates=True, **kw)
    assert_rel(o_ref, o32, 1e-4, "o")
    assert_rel(s_ref, s32, 1e-4, "state")
    if kind == "to_-30":
        o_safe, _ = kda_chunked_reference(q, k, v, g, beta, dtype=torch.float32, output_final_state=True, **kw)
        assert not bool(torch.isfinite(o_safe).all()), "the safe-gate form should overflow here"


@pytest.mark.parametrize("gate", ["lb_alog", "precomputed"])
def test_chunked_general_gates_equal_safe_form_on_safe_gates(seed, gate):
    """On bounded decays both chunked forms are exact: they agree to fp64 rounding."""
    args, kw = make_inputs(B=2, T=130, H=1, HV=2, K=32, V=16, gate=gate, l2=True, init=True)
    o_s, s_s = kda_chunked_reference(*args, dtype=F64, output_final_state=True, **kw)
    o_g, s_g = kda_chunked_reference(*args, dtype=F64, output_final_state=True, general_gates=True, **kw)
    assert_rel(o_s, o_g, 1e-10)
    assert_rel(s_s, s_g, 1e-10)


def test_float32_recurrent_close_to_float64(seed):
    args, kw = make_inputs(B=2, T=100, H=1, HV=2, K=32, V=32, gate="lb_alog", l2=True, init=True)
    o64, s64 = kda_recurrent_reference(*args, dtype=F64, output_final_state=True, **kw)
    o32, s32 = kda_recurrent_reference(*args, output_final_state=True, **kw)
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    assert_rel(o64, o32, 1e-5)
    assert_rel(s64, s32, 1e-5)


# ------------------------------------------------------------------------------------------------
# structural properties
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [kda_recurrent_reference, kda_chunked_reference], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_varlen_equals_independent_calls(seed, fn, layout):
    cu = VARLEN_CU
    N = len(cu) - 1
    args, kw = make_inputs(B=1, T=cu[-1], H=1, HV=4, K=16, V=16, gate="lb_alog", l2=True, N=N,
                           init=True, layout=layout)
    h0 = kw.pop("initial_state")
    o, s = fn(*args, dtype=F64, initial_state=h0, output_final_state=True,
              cu_seqlens=torch.tensor(cu), **kw)
    q, k, v, g, beta = args
    outs, states = [], []
    for n in range(N):
        sl = slice(cu[n], cu[n + 1])
        o_n, s_n = fn(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], dtype=F64,
                      initial_state=h0[n:n + 1], output_final_state=True, **kw)
        outs.append(o_n)
        states.append(s_n)
    assert_rel(torch.cat(outs, dim=1), o, 1e-12)
    assert_rel(torch.cat(states, dim=0), s, 1e-12)


@pytest.mark.parametrize("fn", [kda_recurrent_reference, kda_chunked_reference], ids=["recurrent", "chunked"])
def test_batch_equals_varlen(seed, fn):
    B, T = 3, 70
    args, kw = make_inputs(B=B, T=T, H=2, HV=4, K=16, V=16, gate="precomputed", l2=False, init=True)
    o_b, s_b = fn(*args, dtype=F64, output_final_state=True, **kw)
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in args]
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    o_v, s_v = fn(*flat, dtype=F64, output_final_state=True, cu_seqlens=cu, **kw)
    assert_rel(o_b.reshape(1, B * T, 4, 16), o_v, 1e-12)
    assert_rel(s_b, s_v, 1e-12)


@pytest.mark.parametrize("fn", [kda_recurrent_reference, kda_chunked_reference], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_empty_sequence_keeps_initial_state(seed, fn, layout):
    cu = torch.tensor([0, 0, 5, 5, 9])  # sequences 0 and 2 are empty
    args, kw = make_inputs(B=1, T=9, H=1, HV=2, K=16, V=8, gate="lb_alog", l2=True, N=4,
                           init=True, layout=layout)
    h0 = kw["initial_state"]
    _, s = fn(*args, dtype=F64, output_final_state=True, cu_seqlens=cu, **kw)
    assert torch.equal(s[0], h0[0].double()) and torch.equal(s[2], h0[2].double())
    assert not torch.allclose(s[1], h0[1].double())  # non-empty sequences did move
    kw.pop("initial_state")
    _, s0 = fn(*args, dtype=F64, output_final_state=True, cu_seqlens=cu, **kw)
    assert torch.count_nonzero(s0[0]) == 0 and torch.count_nonzero(s0[2]) == 0
    assert torch.count_nonzero(s0[1]) > 0


@pytest.mark.parametrize("fn", [kda_recurrent_reference, kda_chunked_reference], ids=["recurrent", "chunked"])
def test_state_layouts_are_transposes(seed, fn):
    args, kw = make_inputs(B=2, T=70, H=1, HV=2, K=16, V=32, gate="softplus", l2=True, init=True)
    h0 = kw.pop("initial_state")
    kw.pop("state_layout")
    o_kv, s_kv = fn(*args, dtype=F64, initial_state=h0, output_final_state=True, state_layout="kv", **kw)
    o_vk, s_vk = fn(*args, dtype=F64, initial_state=h0.transpose(-1, -2).contiguous(),
                    output_final_state=True, state_layout="vk", **kw)
    assert s_kv.shape == (2, 2, 16, 32) and s_vk.shape == (2, 2, 32, 16)
    assert_rel(o_kv, o_vk, 1e-14)
    assert_rel(s_kv.transpose(-1, -2), s_vk, 1e-14)


def test_scale_default_and_linearity(seed):
    args, kw = make_inputs(B=1, T=40, H=1, HV=2, K=32, V=16, gate="precomputed", l2=False)
    o_def, _ = kda_recurrent_reference(*args, dtype=F64, **kw)
    o_exp, _ = kda_recurrent_reference(*args, dtype=F64, scale=32 ** -0.5, **kw)
    o_one, _ = kda_recurrent_reference(*args, dtype=F64, scale=1.0, **kw)
    assert torch.equal(o_def, o_exp)
    assert_rel(o_one * 32 ** -0.5, o_def, 1e-14)
    c_def, _ = kda_chunked_reference(*args, dtype=F64, **kw)
    c_one, _ = kda_chunked_reference(*args, dtype=F64, scale=1.0, **kw)
    assert_rel(o_def, c_def, 1e-10)
    assert_rel(o_one, c_one, 1e-10)


# ------------------------------------------------------------------------------------------------
# independent checks of the recurrence
# ------------------------------------------------------------------------------------------------


def numpy_recurrence(q, k, v, decay, beta, scale, h0):
    """Per-(batch, value head, token) scalar loops in NumPy float64; q/k head of hv is hv // G."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    o = np.zeros((B, T, HV, V))
    S_out = np.zeros((B, HV, K, V))
    for b in range(B):
        for hv in range(HV):
            h = hv // G
            S = h0[b, hv].copy()
            for t in range(T):
                S = np.exp(decay[b, t, hv])[:, None] * S
                err = v[b, t, hv] - S.T @ k[b, t, h]
                S = S + beta[b, t, hv] * np.outer(k[b, t, h], err)
                o[b, t, hv] = scale * (S.T @ q[b, t, h])
            S_out[b, hv] = S
    return o, S_out


@pytest.mark.parametrize("gate", GATES)
def test_recurrent_matches_numpy_loops(seed, gate):
    # H=2, HV=4: hv // 2 and hv % 2 pick different q/k heads, so a wrong GVA mapping fails
    args, kw = make_inputs(B=2, T=20, H=2, HV=4, K=8, V=4, gate=gate, l2=True, init=True,
                           beta_dtype=torch.bfloat16)
    q, k, v, g, beta = args
    o, s = kda_recurrent_reference(*args, dtype=F64, scale=0.3, output_final_state=True, **kw)
    qn = (q.double() / torch.sqrt((q.double() ** 2).sum(-1, keepdim=True) + 1e-6)).numpy()
    kn = (k.double() / torch.sqrt((k.double() ** 2).sum(-1, keepdim=True) + 1e-6)).numpy()
    o_np, s_np = numpy_recurrence(qn, kn, v.double().numpy(), gate_decays(g, kw).numpy(),
                                  beta.double().numpy(), 0.3, kw["initial_state"].double().numpy())
    assert_rel(torch.from_numpy(o_np), o, 1e-12)
    assert_rel(torch.from_numpy(s_np), s, 1e-12)


def test_recurrent_single_token_by_hand(seed):
    """T=1 from a zero state: S = beta k v^T and o = scale * beta (q.k) v."""
    q, k = torch.randn(1, 1, 1, 8, dtype=F64), torch.randn(1, 1, 1, 8, dtype=F64)
    v = torch.randn(1, 1, 2, 4, dtype=F64)
    g = -torch.rand(1, 1, 2, 8, dtype=F64)
    beta = torch.rand(1, 1, 2, dtype=F64)
    for fn in (kda_recurrent_reference, kda_chunked_reference):
        o, s = fn(q, k, v, g, beta, scale=0.5, output_final_state=True, dtype=F64)
        for hv in range(2):
            S = beta[0, 0, hv] * torch.outer(k[0, 0, 0], v[0, 0, hv])
            assert torch.allclose(s[0, hv], S, rtol=1e-13, atol=1e-14)
            expect = 0.5 * beta[0, 0, hv] * (q[0, 0, 0] @ k[0, 0, 0]) * v[0, 0, hv]
            assert torch.allclose(o[0, 0, hv], expect, rtol=1e-13, atol=1e-14)


def test_gate_formulas(seed):
    HV, K = 3, 8
    g = 3 * torch.randn(2, 5, HV, K)
    A_log = torch.randn(HV)
    dt = torch.randn(HV * K)
    x = g.double() + dt.double().view(HV, K)
    a = A_log.double().exp().view(HV, 1)
    sig = lambda z: 1 / (1 + torch.exp(-z))  # noqa: E731
    cases = [
        (kda_gate(g, A_log, dt, dtype=F64), -a * torch.log1p(torch.exp(x))),
        (kda_gate(g, A_log, None, dtype=F64), -a * torch.log1p(torch.exp(g.double()))),
        (kda_gate(g, A_log, dt, lower_bound=-5.0, dtype=F64), -5.0 * sig(a * x)),
        (kda_gate(g, None, dt, lower_bound=-3.0, dtype=F64), -3.0 * sig(x)),
        (kda_gate(g, None, None, lower_bound=-5.0, dtype=F64), -5.0 * sig(g.double())),
    ]
    for got, want in cases:
        assert got.dtype == F64 and got.shape == g.shape
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
        assert (got < 0).all()
    lb = kda_gate(g, A_log, dt, lower_bound=-5.0)
    assert lb.dtype == torch.float32 and (lb >= -5.0).all()
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(g)  # softplus form without A_log


def test_l2norm_formula_and_eps():
    x = torch.tensor([[3.0, 4.0], [1e-3, 1e-3]], dtype=F64)
    y = l2norm(x)
    assert torch.allclose(y[0], torch.tensor([3.0, 4.0], dtype=F64) / math.sqrt(25.0 + 1e-6), rtol=1e-15)
    # eps is added to the squared norm: sum = 2e-6, so the result is x / sqrt(3e-6), not x / |x|
    assert torch.allclose(y[1], torch.full((2,), 1e-3 / math.sqrt(3e-6), dtype=F64), rtol=1e-14)
    assert torch.allclose(l2norm(x, eps=0.0)[1], torch.full((2,), 2 ** -0.5, dtype=F64), rtol=1e-14)


def test_input_validation():
    args, kw = make_inputs(B=2, T=10, H=1, HV=2, K=8, V=8, gate="precomputed", l2=False)
    q, k, v, g, beta = args
    for fn in (kda_recurrent_reference, kda_chunked_reference):
        with pytest.raises(ValueError, match="beta"):
            fn(q, k, v, g, beta[..., :1])
        with pytest.raises(ValueError, match="g must"):
            fn(q, k, v, g[..., :4], beta)
        with pytest.raises(ValueError, match="multiple"):
            fn(q.expand(2, 10, 3, 8), k.expand(2, 10, 3, 8), v, g, beta)
        with pytest.raises(ValueError, match="batch size must be 1"):
            fn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10]))
        with pytest.raises(ValueError, match="initial_state"):
            fn(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 8, 4))
        with pytest.raises(ValueError, match="state_layout"):
            fn(q, k, v, g, beta, state_layout="kk")
        with pytest.raises(ValueError, match="cu_seqlens"):
            fn(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0]))


# ------------------------------------------------------------------------------------------------
# against FLA's naive references (fla-core, when importable)
# ------------------------------------------------------------------------------------------------


def _fla_naive():
    return pytest.importorskip("fla.ops.kda.naive", reason="fla-core (fla.ops.kda.naive) is not installed")


@pytest.mark.parametrize("H,HV", GVA)
def test_recurrent_matches_fla_naive(seed, H, HV):
    """FLA's naive_recurrent_kda takes precomputed natural-log gates and post-sigmoid beta,
    applies scale (default K^-0.5) itself, computes in fp32 and has no l2norm / varlen."""
    naive = _fla_naive()
    args, kw = make_inputs(B=2, T=100, H=H, HV=HV, K=32, V=16, gate="precomputed", l2=False, init=True)
    q, k, v, g, beta = args
    h0 = kw.pop("initial_state")
    o_fla, s_fla = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = kda_recurrent_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   dtype=F64, **kw)
    assert_rel(o, o_fla, 1e-5)
    assert_rel(s, s_fla, 1e-5)


@pytest.mark.parametrize("gate", ["lb_alog", "lb_noalog", "softplus"])
def test_recurrent_gate_and_l2norm_in_kernel_match_fla(seed, gate):
    """In-kernel gate + l2norm + varlen, against FLA's naive gate functions feeding its naive
    recurrence sequence by sequence (q, k normalised with FLA's formula, eps 1e-6)."""
    naive = _fla_naive()
    fla_gate = pytest.importorskip("fla.ops.kda.gate", reason="fla.ops.kda.gate needs triton")
    cu = VARLEN_CU
    args, kw = make_inputs(B=1, T=cu[-1], H=1, HV=4, K=16, V=16, gate=gate, l2=True, N=len(cu) - 1, init=True)
    q, k, v, g, beta = args
    if kw["lower_bound"] is None:
        decay = fla_gate.naive_kda_gate(g, kw["A_log"], kw["dt_bias"])
    else:
        decay = fla_gate.naive_kda_lowerbound_gate(g, kw["A_log"], kw["dt_bias"], lower_bound=kw["lower_bound"])
    assert_rel(decay, kda_gate(g, kw["A_log"], kw["dt_bias"], kw["lower_bound"], dtype=F64), 1e-6)
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    h0 = kw["initial_state"]
    o, s = kda_recurrent_reference(*args, dtype=F64, output_final_state=True, cu_seqlens=torch.tensor(cu), **kw)
    outs, states = [], []
    for n in range(len(cu) - 1):
        sl = slice(cu[n], cu[n + 1])
        if cu[n + 1] == cu[n]:  # FLA's naive needs T >= 1; an empty sequence keeps its state
            outs.append(torch.zeros(1, 0, 4, 16))
            states.append(h0[n:n + 1])
            continue
        o_n, s_n = naive.naive_recurrent_kda(qn[:, sl], kn[:, sl], v[:, sl], decay[:, sl], beta[:, sl],
                                             initial_state=h0[n:n + 1], output_final_state=True)
        outs.append(o_n)
        states.append(s_n)
    assert_rel(o, torch.cat(outs, dim=1), 1e-5)
    assert_rel(s, torch.cat(states, dim=0), 1e-5)


# ------------------------------------------------------------------------------------------------
# Segments of T (the affine form: S_out = P S_in + Q per segment, a fix-up, a second pass)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("cu", [None, [0, 70, 70, 71, 330, 400]], ids=["fixed", "varlen"])
def test_segmented_form_matches_the_recurrence(layout: str, cu, seed: int) -> None:
    """Slow decays (so that a segment's P, its map of the entering state, matters: the initial
    state is still ~half present after 400 tokens), GVA, an initial state, segments of 64 and 128
    tokens crossing varlen sequences of 0, 1, 70 and 259 tokens: equal to the fp64 recurrence at
    fp32 precision."""
    B, T, H, HV, K, V = (1, 400, 1, 2, 16, 8) if cu is not None else (2, 200, 1, 2, 16, 8)
    N = B if cu is None else len(cu) - 1
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    g = -0.003 * torch.rand(B, T, HV, K)
    beta = 0.3 * torch.rand(B, T, HV)
    shape = (N, HV, K, V) if layout == "kv" else (N, HV, V, K)
    h0 = torch.randn(shape)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              state_layout=layout, cu_seqlens=None if cu is None else torch.tensor(cu))
    o_ref, s_ref = kda_recurrent_reference(q, k, v, g, beta, dtype=F64, **kw)
    o0, s0 = kda_recurrent_reference(q, k, v, g, beta, dtype=F64, **{**kw, "initial_state": None})
    assert rel_err(s_ref, s0) > 0.1, "the initial state must still matter for the test to mean anything"
    for segment_len in (64, 128):
        o, s = kda_segmented_reference(q, k, v, g, beta, segment_len=segment_len, **kw)
        assert rel_err(o_ref, o) < 1e-5 and rel_err(s_ref, s) < 1e-5, segment_len


def test_segmented_form_rejects_bad_segment_length() -> None:
    x = [torch.randn(1, 8, 1, 16)] * 2 + [torch.randn(1, 8, 1, 16), -torch.rand(1, 8, 1, 16), torch.rand(1, 8, 1)]
    with pytest.raises(ValueError, match="segment_len"):
        kda_segmented_reference(*x, segment_len=100)
