"""The serving contract of cula.kda.kda_prefill on CPU with the reference backend.

State pool by index (both layouts, fp32/bf16, padded row stride, pad slots, has_initial_state),
caller-owned ``out=``/``final_state=`` buffers, padded buckets, cu_seqlens clamped like the
kernel (and ``check_inputs``), strided inputs from one fused projection, raw beta logits, bf16
states, the sm90 backend's explicit refusals, and the bookkeeping of ``examples/serving_step.py``.
Every result is compared with the plain recurrence (``kda_recurrent_reference``) run on the
gathered inputs. GPU tests (``gpu_sm90``): CUDA-graph buckets replayed with new lengths/indices.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from typing import Any

import pytest
import torch

from cula.kda import kda_prefill
from cula.kda import prefill as prefill_mod
from cula.kda.reference import kda_recurrent_reference, sequence_ranges

_EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "serving_step.py"
_spec = importlib.util.spec_from_file_location("serving_step", _EXAMPLE)
serving_step = importlib.util.module_from_spec(_spec)
sys.modules["serving_step"] = serving_step  # dataclasses look their module up
_spec.loader.exec_module(serving_step)

H, HV, K, V = 2, 4, 8, 8


def inputs(T: int, dtype=torch.float32, device="cpu") -> dict[str, torch.Tensor]:
    return dict(q=torch.randn(1, T, H, K, device=device).to(dtype),
                k=torch.randn(1, T, H, K, device=device).to(dtype),
                v=torch.randn(1, T, HV, V, device=device).to(dtype),
                g=(-torch.rand(1, T, HV, K, device=device)).to(dtype),
                beta=torch.rand(1, T, HV, device=device))


def make_pool(S: int, layout: str = "kv", dtype=torch.float32, row_pad: int = 0) -> torch.Tensor:
    row = HV * K * V
    base = (0.3 * torch.randn(S, row + row_pad)).to(dtype)
    return base[:, :row].unflatten(1, (HV, K, V) if layout == "kv" else (HV, V, K))


def gathered_reference(x, pool, cu, idx, has_init=None, layout="kv", **opts):
    """The plain recurrence on the gathered states; returns (o, expected pool after the call)."""
    N = len(idx)
    h0 = torch.zeros((N,) + tuple(pool.shape[1:]))
    for n, i in enumerate(idx):
        if 0 <= i < pool.shape[0] and (has_init is None or has_init[n]):
            h0[n] = pool[i].float()
    o, s = kda_recurrent_reference(**x, initial_state=h0, output_final_state=True,
                                   cu_seqlens=torch.tensor(cu), state_layout=layout, **opts)
    want = pool.clone()
    for n, i in enumerate(idx):
        if 0 <= i < pool.shape[0]:
            want[i] = s[n].to(pool.dtype)
    return o, want


# ------------------------------------------------------------------------------------------------
# 1. state pool by index
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row_pad", [0, 8], ids=["dense", "padded-stride"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_pool_read_and_written_in_place(layout, dtype, row_pad, idx_dtype, seed) -> None:
    T, S = 11, 6
    cu = [0, 4, 4, 5, 11, 11]                # an empty sequence, a length-1 (decode) row
    idx = [3, -1, 0, 5, -7]                 # pad slots (-1, any negative)
    has = [True, True, False, True, True]   # sequence 2 starts from zeros, still writes row 0
    x = inputs(T)
    pool = make_pool(S, layout, dtype, row_pad)
    assert pool.stride(0) == HV * K * V + row_pad
    o_ref, want = gathered_reference(x, pool, cu, idx, has, layout, use_qk_l2norm_in_kernel=True)
    data_ptr = pool.data_ptr()
    o, state = kda_prefill(**x, initial_state=pool, state_indices=torch.tensor(idx, dtype=idx_dtype),
                           has_initial_state=torch.tensor(has), output_final_state=True,
                           cu_seqlens=torch.tensor(cu), use_qk_l2norm_in_kernel=True,
                           state_layout=layout, backend="reference")
    assert state is pool and pool.data_ptr() == data_ptr, "the returned state must be the pool"
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[[1, 2, 4]], want[[1, 2, 4]]), "rows of no real slot changed"
    torch.testing.assert_close(pool.float(), want.float(), rtol=1e-5, atol=1e-5)
    if dtype == torch.bfloat16:
        assert pool.dtype == torch.bfloat16


def test_pool_read_only_without_output_final_state(seed) -> None:
    x = inputs(7)
    pool = make_pool(4)
    before = pool.clone()
    o_ref, _ = gathered_reference(x, pool, [0, 3, 7], [2, 0])
    o, state = kda_prefill(**x, initial_state=pool, state_indices=torch.tensor([2, 0]),
                           cu_seqlens=torch.tensor([0, 3, 7]), backend="reference")
    assert state is None and torch.equal(pool, before)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)


def test_pool_fixed_length_batch(seed) -> None:
    """state_indices without cu_seqlens: N = B."""
    x = {n: torch.cat([t, t.flip(1)]) for n, t in inputs(5).items()}  # B = 2
    pool = make_pool(3)
    want = pool.clone()
    o, _ = kda_prefill(**x, initial_state=pool, state_indices=torch.tensor([2, -1]),
                       output_final_state=True, backend="reference")
    o_ref, s_ref = kda_recurrent_reference(**x, initial_state=torch.stack([want[2], torch.zeros_like(want[0])]),
                                           output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[2], s_ref[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[:2], want[:2])


# ------------------------------------------------------------------------------------------------
# 2. caller-owned buffers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_out_and_final_state_buffers(state_dtype, seed) -> None:
    x = inputs(6)
    h0 = 0.3 * torch.randn(2, HV, V, K)
    out = torch.full((1, 6, HV, V), float("nan"))
    fs = torch.full((2, HV, V, K), float("nan"), dtype=state_dtype)
    o, s = kda_prefill(**x, initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor([0, 2, 6]),
                       state_layout="vk", out=out, final_state=fs, backend="reference")
    assert o is out and s is fs
    o_ref, s_ref = kda_recurrent_reference(**x, initial_state=h0, output_final_state=True,
                                           cu_seqlens=torch.tensor([0, 2, 6]), state_layout="vk")
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(fs, s_ref.to(state_dtype))


BAD_BUFFERS = {
    "out-shape": (dict(out=torch.zeros(1, 6, HV, V + 1)), ValueError, "out"),
    "out-dtype": (dict(out=torch.zeros(1, 6, HV, V, dtype=torch.bfloat16)), TypeError, "out"),
    "out-device": (dict(out=torch.empty(1, 6, HV, V, device="meta")), ValueError, "out"),
    "out-list": (dict(out=[0.0]), TypeError, "out"),
    "final_state-shape": (dict(final_state=torch.zeros(3, HV, K, V), output_final_state=True),
                          ValueError, "final_state"),
    "final_state-layout": (dict(final_state=torch.zeros(2, HV, V, K + 1), output_final_state=True),
                           ValueError, "final_state"),
    "final_state-dtype": (dict(final_state=torch.zeros(2, HV, K, V, dtype=torch.float16),
                               output_final_state=True), TypeError, "final_state"),
    "final_state-without-output": (dict(final_state=torch.zeros(2, HV, K, V)), ValueError,
                                   "final_state"),
}


@pytest.mark.parametrize("case", list(BAD_BUFFERS), ids=list(BAD_BUFFERS))
def test_bad_buffers_rejected_nothing_written(case) -> None:
    over, exc, name = BAD_BUFFERS[case]
    x = inputs(6)
    kw = dict(x, cu_seqlens=torch.tensor([0, 2, 6]), backend="reference", **over)
    snap = {n: t.clone() for n, t in kw.items() if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    with pytest.raises(exc) as info:
        kda_prefill(**kw)
    assert type(info.value) is exc and f"`{name}`" in str(info.value)
    for n, t in snap.items():
        assert torch.equal(kw[n], t), f"{n} was written"


def pool_call(**over: Any) -> dict[str, Any]:
    kw = dict(inputs(6), initial_state=make_pool(4), state_indices=torch.tensor([1, -1, 3]),
              cu_seqlens=torch.tensor([0, 2, 2, 6]), output_final_state=True, backend="reference")
    kw.update(over)
    return kw


BAD_POOL = {
    "indices-float": (lambda: pool_call(state_indices=torch.tensor([1.0, -1.0, 3.0])), TypeError,
                      "state_indices"),
    "indices-int16": (lambda: pool_call(state_indices=torch.tensor([1, -1, 3], dtype=torch.int16)),
                      TypeError, "state_indices"),
    "indices-shape": (lambda: pool_call(state_indices=torch.tensor([1, 3])), ValueError, "state_indices"),
    "indices-2d": (lambda: pool_call(state_indices=torch.tensor([[1, -1, 3]])), ValueError,
                   "state_indices"),
    "indices-list": (lambda: pool_call(state_indices=[1, -1, 3]), TypeError, "state_indices"),
    "indices-out-of-range": (lambda: pool_call(state_indices=torch.tensor([1, -1, 4])), ValueError,
                             "state_indices"),
    "indices-duplicated": (lambda: pool_call(state_indices=torch.tensor([3, -1, 3])), ValueError,
                           "state_indices"),
    "indices-without-pool": (lambda: pool_call(initial_state=None), ValueError, "initial_state"),
    "pool-shape": (lambda: pool_call(initial_state=torch.zeros(4, HV, K, V + 1)), ValueError,
                   "initial_state"),
    "pool-layout": (lambda: pool_call(initial_state=torch.zeros(4, HV, K, V * 2),
                                      state_layout="vk"), ValueError, "initial_state"),
    "pool-rank": (lambda: pool_call(initial_state=torch.zeros(HV, K, V)), ValueError, "initial_state"),
    "pool-dtype": (lambda: pool_call(initial_state=torch.zeros(4, HV, K, V, dtype=torch.float16)),
                   TypeError, "initial_state"),
    "pool-rows-not-dense": (lambda: pool_call(initial_state=torch.zeros(4, HV, V, K).transpose(2, 3)),
                            ValueError, "initial_state"),
    "pool-row-stride-misaligned": (lambda: pool_call(initial_state=make_pool(4, row_pad=1)),
                                   ValueError, "initial_state"),
    "pool-with-final_state": (lambda: pool_call(final_state=torch.zeros(3, HV, K, V)), ValueError,
                              "final_state"),
    "has_initial_state-int": (lambda: pool_call(has_initial_state=torch.ones(3, dtype=torch.int32)),
                              TypeError, "has_initial_state"),
    "has_initial_state-shape": (lambda: pool_call(has_initial_state=torch.ones(2, dtype=torch.bool)),
                                ValueError, "has_initial_state"),
    "has_initial_state-without-indices": (
        lambda: pool_call(state_indices=None, initial_state=torch.zeros(3, HV, K, V),
                          has_initial_state=torch.ones(3, dtype=torch.bool)),
        ValueError, "has_initial_state"),
    "check_inputs-int": (lambda: pool_call(check_inputs=1), TypeError, "check_inputs"),
    "beta-sigmoid-flag-str": (lambda: pool_call(use_beta_sigmoid_in_kernel="yes"), TypeError,
                              "use_beta_sigmoid_in_kernel"),
}


@pytest.mark.parametrize("case", list(BAD_POOL), ids=list(BAD_POOL))
def test_bad_pool_arguments_rejected_nothing_written(case) -> None:
    build, exc, name = BAD_POOL[case]
    kw = build()
    snap = {n: t.clone() for n, t in kw.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(exc) as info:
        kda_prefill(**kw)
    assert type(info.value) is exc and f"`{name}`" in str(info.value), str(info.value)
    for n, t in snap.items():
        assert torch.equal(kw[n], t), f"{n} was written"


# ------------------------------------------------------------------------------------------------
# 3. padded buckets, 4. cu_seqlens of any value
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cu", [[0, 3, 7], [0, 0, 5, 5], [0, 1, 2], [0, 0]], ids=str)
def test_padded_bucket(cu, seed) -> None:
    T = 10
    x = inputs(T)
    h0 = 0.3 * torch.randn(len(cu) - 1, HV, K, V)
    out = torch.full((1, T, HV, V), float("nan"))
    o, s = kda_prefill(**x, initial_state=h0, output_final_state=True,
                       cu_seqlens=torch.tensor(cu), out=out, backend="reference")
    real = cu[-1]
    assert torch.equal(o[:, real:], torch.zeros_like(o[:, real:])), "padding rows must be 0"
    # the same call on the real tokens only, and with garbage in the padding: the same results
    o_r, s_r = kda_recurrent_reference(**{n: t[:, :real] for n, t in x.items()}, initial_state=h0,
                                       output_final_state=True, cu_seqlens=torch.tensor(cu))
    torch.testing.assert_close(o[:, :real], o_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_r, rtol=1e-5, atol=1e-5)
    junk = {n: t.clone() for n, t in x.items()}
    for t in junk.values():
        t[:, real:] = 1e4
    o_j, s_j = kda_prefill(**junk, initial_state=h0, output_final_state=True,
                           cu_seqlens=torch.tensor(cu), backend="reference")
    assert torch.equal(o_j, o) and torch.equal(s_j, s), "padding tokens changed a result"


GARBAGE_CU = {
    "negative-start": [-5, 3, 7],
    "decreasing": [0, 6, 2, 9],
    "past-T": [0, 4, 25, 40],
    "negative-length": [0, 5, 3, 3],
    "all-negative": [-9, -4, -1],
    "huge": [0, 2**31 - 1, 3],
}


@pytest.mark.parametrize("case", list(GARBAGE_CU), ids=list(GARBAGE_CU))
def test_garbage_cu_seqlens_clamped_like_the_kernel(case, seed) -> None:
    T = 9
    cu = GARBAGE_CU[case]
    x = inputs(T)
    N = len(cu) - 1
    h0 = 0.3 * torch.randn(N, HV, K, V)
    kw = dict(x, initial_state=h0, output_final_state=True, backend="reference")
    cu_t = torch.tensor(cu, dtype=torch.int64)
    with pytest.raises(ValueError, match="`cu_seqlens`"):
        kda_prefill(**kw, cu_seqlens=cu_t)                      # CPU: checked by default
    with pytest.raises(ValueError, match="`cu_seqlens`"):
        kda_prefill(**kw, cu_seqlens=cu_t, check_inputs=True)
    o, s = kda_prefill(**kw, cu_seqlens=cu_t, check_inputs=False)  # trusted: clamped
    # the kernel's seq_range: begin = clamp(cu[n], 0, T), end = clamp(cu[n+1], begin, T)
    ranges = []
    for n in range(N):
        b = min(max(cu[n], 0), T)
        ranges.append((b, min(max(cu[n + 1], b), T)))
    assert sequence_ranges(cu_t, T) == ranges
    covered = torch.zeros(T, dtype=torch.int64)
    for b, e in ranges:
        covered[b:e] += 1
    for n, (b, e) in enumerate(ranges):
        seq = {name: t[:, b:e] for name, t in x.items()}
        o_n, s_n = kda_recurrent_reference(**seq, initial_state=h0[n:n + 1], output_final_state=True)
        torch.testing.assert_close(s[n], s_n[0], rtol=1e-5, atol=1e-5)  # empty: h0 unchanged
        once = covered[b:e] == 1                                    # rows of one sequence only
        torch.testing.assert_close(o[0, b:e][once], o_n[0][once], rtol=1e-5, atol=1e-5)
    assert torch.equal(o[0, covered == 0], torch.zeros_like(o[0, covered == 0]))


def test_trusted_out_of_range_indices_are_pad_slots(seed) -> None:
    """check_inputs=False with an index >= S: read as zeros, nothing written (memory safety)."""
    x = inputs(6)
    pool = make_pool(3)
    before = pool.clone()
    o, _ = kda_prefill(**x, initial_state=pool, state_indices=torch.tensor([7, 1]),
                       cu_seqlens=torch.tensor([0, 2, 6]), output_final_state=True,
                       backend="reference", check_inputs=False)
    o_ref, want = gathered_reference(x, before, [0, 2, 6], [-1, 1])
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[[0, 2]], before[[0, 2]])


def test_check_inputs_env_and_gpu_default(monkeypatch) -> None:
    """Index values of a device tensor are trusted by default; check_inputs=True or
    CULA_CHECK_CU_SEQLENS=1 checks them (one host copy of cu_seqlens and state_indices)."""
    calls = []
    real = prefill_mod._validate_index_values
    monkeypatch.setattr(prefill_mod, "_validate_index_values",
                        lambda *a: calls.append(a) or real(*a))
    kw = pool_call()
    kda_prefill(**kw)
    assert len(calls) == 1  # CPU: default
    kda_prefill(**pool_call(check_inputs=False))
    assert len(calls) == 1
    with pytest.raises(ValueError, match=r"pool row 1 for sequences \[0, 2\]"):
        kda_prefill(**pool_call(state_indices=torch.tensor([1, -1, 1]), check_inputs=True))
    # the rule for device tensors (no GPU needed: it looks at the device type only)
    decide = prefill_mod._check_index_values
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv("CULA_CHECK_CU_SEQLENS", raising=False)
    assert decide(None, cpu) and not decide(None, cuda), "GPU values are trusted by default"
    assert decide(True, cuda) and not decide(False, cpu)
    monkeypatch.setenv("CULA_CHECK_CU_SEQLENS", "1")
    assert decide(None, cuda) and not decide(False, cuda)


# ------------------------------------------------------------------------------------------------
# 5. strided inputs, 6. raw beta, 7. bf16 states
# ------------------------------------------------------------------------------------------------


def test_strided_views_of_one_fused_projection(seed) -> None:
    T = 7
    widths = [H * K, H * K, HV * V, HV * K, HV]
    proj = torch.randn(1, T, sum(widths) + 3)  # + 3: row stride not a multiple of anything
    q, k, v, g, beta = torch.split(proj[..., :sum(widths)], widths, dim=-1)
    views = dict(q=q.unflatten(-1, (H, K)), k=k.unflatten(-1, (H, K)), v=v.unflatten(-1, (HV, V)),
                 g=g.unflatten(-1, (HV, K)))  # g: the raw gate (gate in kernel)
    for name in ("q", "k", "v", "g"):
        assert not views[name].is_contiguous() and views[name].stride(-1) == 1, name
    beta_logits = proj[..., sum(widths) - HV:sum(widths)]
    assert beta_logits.stride(1) == proj.shape[-1]
    kw = dict(cu_seqlens=torch.tensor([0, 3, 7]), output_final_state=True, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True, backend="reference")
    args = dict(views, beta=beta_logits)
    o, s = kda_prefill(**args, use_beta_sigmoid_in_kernel=True, **kw)
    dense = {n: t.contiguous() for n, t in args.items()}
    o_d, s_d = kda_prefill(**dense, use_beta_sigmoid_in_kernel=True, **kw)
    assert torch.equal(o, o_d) and torch.equal(s, s_d)


@pytest.mark.parametrize("beta_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_raw_beta_logits(beta_dtype, seed) -> None:
    x = inputs(6)
    logits = (3 * torch.randn(1, 6, HV)).to(beta_dtype)
    x["beta"] = logits
    o, s = kda_prefill(**x, use_beta_sigmoid_in_kernel=True, output_final_state=True,
                       backend="reference")
    o_ref, s_ref = kda_recurrent_reference(**dict(x, beta=torch.sigmoid(logits.float())),
                                           output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_bf16_state_in_and_out(layout, seed) -> None:
    x = inputs(6)
    shape = (2, HV, K, V) if layout == "kv" else (2, HV, V, K)
    h0 = (0.3 * torch.randn(shape)).to(torch.bfloat16)
    o, s = kda_prefill(**x, initial_state=h0, output_final_state=True, state_layout=layout,
                       cu_seqlens=torch.tensor([0, 1, 6]), backend="reference")
    assert s.dtype == torch.bfloat16 and s.shape == shape
    o_ref, s_ref = kda_recurrent_reference(**x, initial_state=h0.float(), output_final_state=True,
                                           cu_seqlens=torch.tensor([0, 1, 6]), state_layout=layout)
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(s, s_ref.to(torch.bfloat16))
    # an fp32 buffer for a bf16 initial state: fp32 out
    fs = torch.empty(shape)
    _, s32 = kda_prefill(**x, initial_state=h0, output_final_state=True, state_layout=layout,
                         cu_seqlens=torch.tensor([0, 1, 6]), final_state=fs, backend="reference")
    assert s32 is fs and torch.equal(fs, s_ref)


# ------------------------------------------------------------------------------------------------
# sm90: what reaches the kernel (a recording stand-in for the extension)
# ------------------------------------------------------------------------------------------------


def sm90_call(device: str = "cpu", **over: Any) -> dict[str, Any]:
    kw = dict(q=torch.randn(1, 6, 2, 128, dtype=torch.bfloat16, device=device),
              k=torch.randn(1, 6, 2, 128, dtype=torch.bfloat16, device=device),
              v=torch.randn(1, 6, 4, 128, dtype=torch.bfloat16, device=device),
              g=-torch.rand(1, 6, 4, 128, device=device).to(torch.bfloat16),
              beta=torch.rand(1, 6, 4, device=device),
              cu_seqlens=torch.tensor([0, 2, 6], device=device), safe_gate=True, backend="sm90")
    kw.update(over)
    return kw


class _RecordingExt:
    """Stands in for the compiled extension: records the keyword arguments of each launch."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def kda_prefill_sm90(self, **kw: Any) -> None:
        self.calls.append(kw)


def _fake_sm90(monkeypatch) -> _RecordingExt:
    from cula import _ext

    ext = _RecordingExt()
    monkeypatch.setattr(prefill_mod, "_is_sm90", lambda device: True)
    monkeypatch.setattr(prefill_mod, "_check_sm90_environment", lambda q, prefix: None)
    monkeypatch.setattr(_ext, "get_ext", lambda: ext)
    return ext


@pytest.mark.parametrize("backend", ["sm90", "auto"])
@pytest.mark.parametrize("what", ["state_indices", "has_initial_state", "bf16-pool"])
def test_sm90_pool_reaches_the_kernel(backend, what, monkeypatch) -> None:
    """The pool, its indices and has_initial_state go to the kernel as they are: no gather, no
    scatter, no dtype conversion (the kernel reads and writes the rows by index)."""
    ext = _fake_sm90(monkeypatch)
    pool = torch.zeros(3, 4, 128, 128, dtype=torch.bfloat16 if what == "bf16-pool" else torch.float32)
    idx = torch.tensor([2, -1])
    over = dict(initial_state=pool, state_indices=idx, output_final_state=True, backend=backend)
    if what == "has_initial_state":
        over["has_initial_state"] = torch.tensor([True, False])
    o, s = kda_prefill(**sm90_call(**over))
    (kw,) = ext.calls
    assert s is pool and kw["state_pool"] is pool and kw["initial_state"] is None
    assert kw["final_state"] is None and kw["state_indices"] is idx
    assert (kw["has_initial_state"] is over["has_initial_state"]) if what == "has_initial_state" \
        else kw["has_initial_state"] is None
    assert prefill_mod.last_backend() == "sm90"


def test_sm90_read_only_pool_goes_as_initial_state(monkeypatch) -> None:
    ext = _fake_sm90(monkeypatch)
    pool = torch.zeros(3, 4, 128, 128)
    o, s = kda_prefill(**sm90_call(initial_state=pool, state_indices=torch.tensor([0, 2]),
                                   output_final_state=False))
    (kw,) = ext.calls
    assert s is None and kw["initial_state"] is pool and kw["state_pool"] is None


def test_sm90_python_layer_passes_logits_bf16_states_and_views_through(monkeypatch) -> None:
    """beta logits, bf16 states and column slices of one fused projection reach the kernel
    unchanged (the kernel applies the sigmoid, converts the states and reads the strided rows);
    o is not zero-filled in Python (the kernel writes zeros past cu_seqlens[-1])."""
    ext = _fake_sm90(monkeypatch)
    H, HV, K = 2, 4, 128
    proj = torch.randn(1, 6, 2 * H * K + 2 * HV * K).to(torch.bfloat16)  # token stride 1536
    q = proj[..., :H * K].view(1, 6, H, K)
    k = proj[..., H * K:2 * H * K].view(1, 6, H, K)
    v = proj[..., 2 * H * K:2 * H * K + HV * K].view(1, 6, HV, K)
    g = proj[..., 2 * H * K + HV * K:2 * H * K + 2 * HV * K].view(1, 6, HV, K)
    logits = torch.randn(1, 6, HV + 3).to(torch.bfloat16)[..., 1:HV + 1]  # a column slice, stride 7
    h0 = torch.randn(2, HV, K, K).to(torch.bfloat16)
    out = torch.full((1, 6, HV, K), float("nan"), dtype=torch.bfloat16)
    fs = torch.empty(2, HV, K, K, dtype=torch.bfloat16)
    call = sm90_call(q=q, k=k, v=v, g=-torch.rand(1, 6, HV, K).to(torch.bfloat16), beta=logits,
                     cu_seqlens=torch.tensor([0, 2, 5]))
    call.pop("g")
    o, s = kda_prefill(**call, g=g, use_beta_sigmoid_in_kernel=True, initial_state=h0,
                       output_final_state=True, out=out, final_state=fs)
    (kw,) = ext.calls
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", logits)):
        assert kw[name] is t, f"{name} was copied"
    assert kw["use_beta_sigmoid_in_kernel"] is True
    assert kw["initial_state"] is h0 and kw["final_state"] is fs and kw["o"] is out
    assert o is out and s is fs and bool(torch.isnan(out.float()).all())  # nothing written in Python


def _edge_layouts(device: str = "cpu") -> dict[str, dict[str, Any]]:
    """Valid calls whose layouts are edge cases for the kernel's in-place reads and writes (the
    binding, csrc/api/kda_prefill_binding.cpp, reads what it can in place and copies the rest)."""
    bf16 = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device)

    e = {}
    # B > 1 with no token: dense [B, 0, H, 128] tensors have stride(0) != T * stride(1) = 0.
    e["B2-T0"] = dict(q=randn(2, 0, 2, 128).to(bf16), k=randn(2, 0, 2, 128).to(bf16),
                      v=randn(2, 0, 4, 128).to(bf16), g=-randn(2, 0, 4, 128).abs().to(bf16),
                      beta=randn(2, 0, 4).abs(), cu_seqlens=None, initial_state=randn(2, 4, 128, 128),
                      output_final_state=True)
    # T == 1 from a transpose: contiguous by torch's rule, token stride 128 != stride(0) / T.
    def t1(h: int, decay: bool = False) -> torch.Tensor:
        x = randn(2, h, 1, 128)
        return (-0.5 * x.abs() if decay else x).to(bf16).transpose(1, 2)

    e["B2-T1-transposed"] = dict(q=t1(2), k=t1(2), v=t1(4), g=t1(4, decay=True),
                                 beta=randn(2, 4, 1).abs().transpose(1, 2), cu_seqlens=None)
    # N == 1 initial state with stride(0) == 0 (contiguous by torch's rule: a dimension of size 1).
    h = randn(4, 128, 128).as_strided((1, 4, 128, 128), (0, 128 * 128, 128, 1))
    e["N1-state-stride-0"] = dict(cu_seqlens=None, initial_state=h, output_final_state=True)
    # A dense initial state and a final-state buffer with padded rows (both valid on their own).
    fs = torch.empty(2, 4 * 128 * 128 + 64, device=device)[:, :4 * 128 * 128].unflatten(1, (4, 128, 128))
    e["padded-final-state"] = dict(initial_state=randn(2, 4, 128, 128), final_state=fs,
                                   output_final_state=True)
    padded = randn(2, 4 * 128 * 128 + 64)[:, :4 * 128 * 128].unflatten(1, (4, 128, 128))
    e["padded-initial-state"] = dict(initial_state=padded, output_final_state=True)
    # Strides TMA cannot take (head stride 129 elements, features not contiguous), beta with
    # its heads apart, a transposed ([V, K] in memory) initial state.
    e["odd-strides"] = dict(q=randn(1, 6, 2, 129).to(bf16)[..., :128],
                            k=randn(1, 6, 128, 2).to(bf16).transpose(2, 3),
                            beta=randn(1, 6, 8).abs()[..., ::2],
                            initial_state=randn(2, 4, 128, 128).transpose(2, 3), output_final_state=True)
    # Small tensors that start off a 16-byte boundary (A_log, dt_bias, cu_seqlens).
    e["misaligned-small"] = dict(use_gate_in_kernel=True, lower_bound=-5.0, g=randn(1, 6, 4, 128).to(bf16),
                                 A_log=randn(5)[1:], dt_bias=randn(4 * 128 + 1)[1:],
                                 cu_seqlens=torch.tensor([7, 0, 2, 6], device=device)[1:])
    # Caller-owned outputs the kernel cannot write in place: a strided o and a final state
    # with its last two dimensions swapped.
    e["strided-outputs"] = dict(out=torch.empty(1, 6, 4, 256, dtype=bf16, device=device)[..., :128],
                                final_state=torch.empty(2, 4, 128, 128, device=device).transpose(2, 3),
                                output_final_state=True)
    return e


@pytest.mark.parametrize("case", list(_edge_layouts()))
def test_sm90_python_layer_passes_every_layout_through(case, monkeypatch) -> None:
    """The Python layer hands every tensor to the extension as the caller gave it, whatever its
    layout (the binding decides what it reads in place and what it copies, once, in C++): no
    copy, no allocation but the outputs kda_prefill owns."""
    ext = _fake_sm90(monkeypatch)
    over = _edge_layouts()[case]
    o, s = kda_prefill(**sm90_call(**over))
    (kw,) = ext.calls
    for name in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias", "cu_seqlens", "final_state"):
        if over.get(name) is not None:
            assert kw[name] is over[name], f"{name} was copied or replaced in Python"
    if over.get("out") is not None:
        assert kw["o"] is over["out"] and o is over["out"]
    if over.get("final_state") is not None:
        assert s is over["final_state"]


def _fresh_dense(x: Any) -> Any:
    """A tensor's values in a new dense allocation with canonical strides (other values as is)."""
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


@pytest.mark.gpu_sm90
@pytest.mark.parametrize("case", list(_edge_layouts()))
def test_sm90_edge_layouts_match_dense(case, seed) -> None:
    """The binding's layout decisions on the GPU: every edge-case layout gives bitwise the result
    of the same values as dense tensors (read in place or copied once), caller-owned outputs the
    kernel cannot write in place receive the result, the caller's inputs stay intact, and the
    result is within the kernel's tolerance of the reference backend."""
    # l2-normalised q and k keep the delta rule contractive, so the reference comparison is the
    # kernel's usual one (un-normalised N(0, 1) rows of norm ~11 make o grow by orders of magnitude)
    call = sm90_call(device="cuda", use_qk_l2norm_in_kernel=True, **_edge_layouts("cuda")[case])
    dense = {name: _fresh_dense(x) for name, x in call.items() if name not in ("out", "final_state")}
    before = {name: x.clone() for name, x in call.items()
              if isinstance(x, torch.Tensor) and name not in ("out", "final_state")}
    o, s = kda_prefill(**call)
    o_d, s_d = kda_prefill(**dense)
    torch.cuda.synchronize()
    for name, x in before.items():
        assert torch.equal(call[name], x), f"kda_prefill modified the caller's {name}"
    if call.get("out") is not None:
        assert o is call["out"]
    if call.get("final_state") is not None:
        assert s is call["final_state"]
    assert torch.equal(o, o_d), "o differs from the dense call's"
    assert (s is None) == (s_d is None) and (s is None or torch.equal(s, s_d)), "final state differs"
    o_ref, s_ref = kda_prefill(**dict(dense, backend="reference"))
    assert _rel(o, o_ref) <= _SM90_TOL
    if s is not None:
        assert _rel(s, s_ref) <= _SM90_TOL


# ------------------------------------------------------------------------------------------------
# 8. the example's bookkeeping
# ------------------------------------------------------------------------------------------------


def test_pick_bucket_and_slot_pool() -> None:
    assert serving_step.pick_bucket(1, (16, 64)) == 16
    assert serving_step.pick_bucket(16, (16, 64)) == 16
    assert serving_step.pick_bucket(17, (16, 64)) == 64
    with pytest.raises(ValueError):
        serving_step.pick_bucket(65, (16, 64))
    slots = serving_step.SlotPool(4)
    assert slots.scratch == 3
    assert [slots.acquire(r) for r in "abc"] == [0, 1, 2]
    with pytest.raises(RuntimeError):
        slots.acquire("d")
    assert slots.release("b") == 1 and slots.acquire("d") == 1


def test_plan_step_layout() -> None:
    R = serving_step.Request
    slots = serving_step.SlotPool(8)
    plan = serving_step.plan_step([R("a", 20, first=True), R("b", 3, first=True)], slots,
                                  t_buckets=(16, 32), n_buckets=(1, 4))
    assert (plan.T, plan.N) == (32, 4)
    assert plan.cu_seqlens == [0, 20, 23, 23, 23] and plan.num_tokens == 23
    assert plan.state_indices == [0, 1, -1, -1] and plan.has_initial_state == [False, False, False, False]
    plan = serving_step.plan_step([R("a", 1), R("b", 1), R("c", 5, first=True)], slots,
                                  t_buckets=(16, 32), n_buckets=(1, 4))
    assert (plan.T, plan.N) == (16, 4) and plan.cu_seqlens == [0, 1, 2, 7, 7]
    assert plan.state_indices == [0, 1, 2, -1] and plan.has_initial_state == [True, True, False, False]
    assert plan.spans == [(0, 1), (1, 1), (2, 5)]
    cu, idx, has = torch.zeros(5, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.bool)
    serving_step.write_step_indices(plan, cu, idx, has)
    assert cu.tolist() == plan.cu_seqlens and idx.tolist() == plan.state_indices
    assert has.tolist() == plan.has_initial_state
    xs = [torch.randn(n, 3) for _, n in plan.spans]
    packed = serving_step.pack_tokens(plan, xs)
    assert packed.shape == (1, 16, 3) and bool((packed[0, 7:] == 0).all())
    assert all(torch.equal(a, b) for a, b in zip(serving_step.unpack_tokens(plan, packed), xs))


def test_example_steps_match_per_request_reference(seed) -> None:
    """Three engine steps (prefills, then decode rows mixed with a new prefill) through the pool:
    every request's outputs equal one uninterrupted recurrence over its tokens, and the
    gather/scatter variant (what runs on Hopper today) gives the same outputs and pool rows."""
    R = serving_step.Request
    steps = [[R("a", 9, first=True), R("b", 4, first=True)],
             [R("a", 1), R("b", 1), R("c", 6, first=True)],
             [R("a", 1), R("c", 1), R("b", 2)]]
    Kx = 8
    slots = serving_step.SlotPool(6)
    pool = torch.full((6, HV, Kx, Kx), float("nan"))  # never-written rows hold garbage
    pool_gs = pool.clone()
    A_log, dt_bias = 0.1 * torch.randn(HV), 0.1 * torch.randn(HV * Kx)
    history: dict[str, list[dict[str, torch.Tensor]]] = {}
    outputs: dict[str, list[torch.Tensor]] = {}
    for requests in steps:
        plan = serving_step.plan_step(requests, slots, t_buckets=(8, 16, 32), n_buckets=(2, 4))
        per = [serving_step._random_request_inputs(r.tokens, H, HV, Kx, Kx, "cpu", torch.float32)
               for r in requests]
        packed = {n: serving_step.pack_tokens(plan, [p[n] for p in per])
                  for n in ("q", "k", "v", "g", "beta")}
        idx = torch.tensor(plan.state_indices, dtype=torch.int32)
        args = (packed["q"], packed["k"], packed["v"], packed["g"], packed["beta"])
        cu = torch.tensor(plan.cu_seqlens, dtype=torch.int32)
        has = torch.tensor(plan.has_initial_state)
        o = serving_step.layer_step(*args, pool, cu, idx, has, A_log, dt_bias)
        o_gs = serving_step.layer_step_gather_scatter(*args, pool_gs, cu, idx, has, A_log, dt_bias,
                                                      scratch_row=slots.scratch, backend="reference")
        torch.testing.assert_close(o_gs, o, rtol=1e-6, atol=1e-6)
        assert bool((o[0, plan.num_tokens:] == 0).all())
        for r, p, o_r in zip(requests, per, serving_step.unpack_tokens(plan, o)):
            history.setdefault(r.rid, []).append(p)
            outputs.setdefault(r.rid, []).append(o_r)
    opts = {k: v for k, v in serving_step.LAYER_OPTIONS.items()
            if k not in ("safe_gate", "use_beta_sigmoid_in_kernel")}
    for rid, parts in history.items():
        full = {n: torch.cat([p[n] for p in parts])[None] for n in parts[0]}
        full["beta"] = torch.sigmoid(full["beta"])
        o_ref, s_ref = kda_recurrent_reference(**full, output_final_state=True, A_log=A_log,
                                               dt_bias=dt_bias, **opts)
        torch.testing.assert_close(torch.cat(outputs[rid])[None], o_ref, rtol=1e-5, atol=1e-5)
        row = slots.row(rid)
        torch.testing.assert_close(pool[row], s_ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool_gs[row], s_ref[0], rtol=1e-5, atol=1e-5)
    free = [r for r in range(5) if r not in {slots.row(x) for x in history}]
    assert all(bool(pool[r].isnan().all()) for r in free), "a free row was written"


# ------------------------------------------------------------------------------------------------
# GPU: CUDA-graph buckets (the reference backend reads lengths on the host: not capturable)
# ------------------------------------------------------------------------------------------------


def _gpu_bucket(T: int = 256, N: int = 4):
    dev, bf16 = "cuda", torch.bfloat16
    x = dict(q=torch.randn(1, T, 2, 128, device=dev, dtype=bf16),
             k=torch.randn(1, T, 2, 128, device=dev, dtype=bf16),
             v=torch.randn(1, T, 4, 128, device=dev, dtype=bf16),
             g=torch.randn(1, T, 4, 128, device=dev, dtype=bf16),
             beta=torch.randn(1, T, 4, device=dev))
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=torch.zeros(4, device=dev),
                dt_bias=torch.zeros(4 * 128, device=dev), safe_gate=True, lower_bound=-5.0,
                use_beta_sigmoid_in_kernel=True, state_layout="vk", backend="sm90")
    return x, opts


_REPLAYS = ([0, 1, 2, 130, 130], [0, 0, 200, 201, 256], [0, 64, 64, 64, 64], [0, 0, 0, 0, 0])


@pytest.mark.gpu_sm90
def test_cuda_graph_bucket_replay_dense_state_sm90(seed) -> None:
    """One (T, N) bucket captured once, replayed with new real lengths written in place into the
    captured cu_seqlens: every replay equals the eager call (o past cu_seqlens[-1] is 0)."""
    x, opts = _gpu_bucket()
    cu = torch.tensor(_REPLAYS[0], device="cuda", dtype=torch.int32)
    h0 = 0.1 * torch.randn(4, 4, 128, 128, device="cuda")
    o = torch.empty(1, 256, 4, 128, device="cuda", dtype=torch.bfloat16)
    fs = torch.empty(4, 4, 128, 128, device="cuda")
    call = lambda: kda_prefill(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu,  # noqa: E731
                               out=o, final_state=fs, **opts)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for values in _REPLAYS:
        cu.copy_(torch.tensor(values, dtype=torch.int32))
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_e, s_e = kda_prefill(**x, initial_state=h0, output_final_state=True,
                               cu_seqlens=cu.clone(), **opts)
        assert torch.equal(o, o_e) and torch.equal(fs, s_e), f"replay with cu={values}"
        assert bool((o[:, values[-1]:] == 0).all())


@pytest.mark.gpu_sm90
def test_cuda_graph_bucket_replay_pooled_sm90(seed) -> None:
    """The serving contract proper: the pool read/written in place by index inside a captured
    bucket, replayed with new lengths and indices; each replay equals the eager call."""
    x, opts = _gpu_bucket()
    pool = 0.1 * torch.randn(8, 4, 128, 128, device="cuda")
    cu = torch.tensor(_REPLAYS[0], device="cuda", dtype=torch.int32)
    idx = torch.tensor([3, 1, -1, 6], device="cuda", dtype=torch.int32)
    o = torch.empty(1, 256, 4, 128, device="cuda", dtype=torch.bfloat16)
    call = lambda p: kda_prefill(**x, initial_state=p, state_indices=idx, output_final_state=True,  # noqa: E731
                                 cu_seqlens=cu, out=o, **opts)
    call(pool.clone())  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(pool)
    for values, rows in zip(_REPLAYS, ([3, 1, -1, 6], [0, -1, 5, 2], [7, 4, 1, -1], [-1, -1, -1, -1])):
        cu.copy_(torch.tensor(values, dtype=torch.int32))
        idx.copy_(torch.tensor(rows, dtype=torch.int32))
        expected = pool.clone()
        o_e, _ = kda_prefill(**x, initial_state=expected, state_indices=idx.clone(),
                             output_final_state=True, cu_seqlens=cu.clone(), **opts)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o, o_e) and torch.equal(pool, expected)


@pytest.mark.gpu_sm90
def test_example_graph_buckets_gather_scatter_sm90(seed) -> None:
    """examples/serving_step.py on Hopper: GraphBuckets around the gather/scatter layer (the fused
    kernel) against the pooled reference, over the demo's mixed steps."""
    R = serving_step.Request
    slots = serving_step.SlotPool(8)
    pool = torch.zeros(8, 4, 128, 128, device="cuda")
    pool_ref = pool.clone()
    A_log, dt_bias = torch.zeros(4, device="cuda"), torch.zeros(4 * 128, device="cuda")
    step = lambda *a, out=None: serving_step.layer_step_gather_scatter(  # noqa: E731
        *a, scratch_row=slots.scratch, out=out, backend="sm90")
    graphs = serving_step.GraphBuckets(step, pool, A_log, dt_bias, H=2, K=128)
    for requests in ([R("a", 300, first=True), R("b", 37, first=True)],
                     [R("a", 1), R("b", 1), R("c", 200, first=True)],
                     [R("a", 1), R("b", 1), R("c", 1)]):
        plan = serving_step.plan_step(requests, slots)
        per = [serving_step._random_request_inputs(r.tokens, 2, 4, 128, 128, "cuda", torch.bfloat16)
               for r in requests]
        packed = [serving_step.pack_tokens(plan, [p[n] for p in per]) for n in ("q", "k", "v", "g", "beta")]
        cu = torch.tensor(plan.cu_seqlens, dtype=torch.int32, device="cuda")
        idx = torch.tensor(plan.state_indices, dtype=torch.int32, device="cuda")
        has = torch.tensor(plan.has_initial_state, device="cuda")
        o_ref = serving_step.layer_step(*packed, pool_ref, cu, idx, has, A_log, dt_bias)
        o = graphs.run(plan, *packed)
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
        assert rel(o, o_ref) < 5e-3
        rows = [slots.row(r.rid) for r in requests]
        assert rel(pool[rows], pool_ref[rows]) < 5e-3


# ------------------------------------------------------------------------------------------------
# The fused kernel's side of the contract (gpu_sm90): each against the reference backend on the
# same inputs (the reference is the fp32 recurrence; the kernel's bf16 operands give ~3e-3).
# ------------------------------------------------------------------------------------------------

_SM90_TOL = 5e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _sm90_inputs(T: int, H_: int = 2, HV_: int = 4, logits: bool = False) -> tuple[dict, dict]:
    dev, bf16 = "cuda", torch.bfloat16
    x = dict(q=torch.randn(1, T, H_, 128, device=dev, dtype=bf16),
             k=torch.randn(1, T, H_, 128, device=dev, dtype=bf16),
             v=torch.randn(1, T, HV_, 128, device=dev, dtype=bf16),
             g=torch.randn(1, T, HV_, 128, device=dev, dtype=bf16),
             beta=torch.randn(1, T, HV_, device=dev) if logits else torch.rand(1, T, HV_, device=dev))
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                A_log=0.1 * torch.randn(HV_, device=dev), dt_bias=0.1 * torch.randn(HV_ * 128, device=dev),
                safe_gate=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=logits)
    return x, opts


@pytest.mark.gpu_sm90
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row_pad", [0, 64], ids=["dense", "padded-stride"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_sm90_pool_matches_reference(layout, dtype, row_pad, idx_dtype, seed) -> None:
    """Pool rows read and written in place by the kernel: pad slots (negative, and past S when
    trusted), has_initial_state False, an empty sequence; untouched rows stay bitwise."""
    cu = [0, 100, 100, 101, 230, 300]
    idx = [3, -1, 0, 5, 9]                    # 9 >= S: a pad slot (check_inputs=False)
    has = [True, True, False, True, True]
    x, opts = _sm90_inputs(300)
    row = 4 * 128 * 128
    base = (0.1 * torch.randn(6, row + row_pad, device="cuda")).to(dtype)
    pool = base[:, :row].unflatten(1, (4, 128, 128))
    ref_pool = pool.clone()
    padding = base[:, row:].clone()
    kw = dict(state_indices=torch.tensor(idx, dtype=idx_dtype, device="cuda"),
              has_initial_state=torch.tensor(has, device="cuda"), output_final_state=True,
              cu_seqlens=torch.tensor(cu, dtype=torch.int32, device="cuda"), state_layout=layout,
              check_inputs=False, **opts)
    o_ref, _ = kda_prefill(**x, initial_state=ref_pool, backend="reference", **kw)
    before = pool.clone()
    o, state = kda_prefill(**x, initial_state=pool, backend="sm90", **kw)
    torch.cuda.synchronize()
    assert state is pool
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]]), "rows of no real slot changed"
    assert _rel(o, o_ref) <= _SM90_TOL
    assert _rel(pool[[0, 3, 5]], ref_pool[[0, 3, 5]]) <= _SM90_TOL
    assert torch.equal(base[:, row:], padding), "the row padding of the pool is not the kernel's"


@pytest.mark.gpu_sm90
@pytest.mark.parametrize("beta_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sm90_beta_logits_match_reference(beta_dtype, seed) -> None:
    x, opts = _sm90_inputs(200, logits=True)
    x["beta"] = x["beta"].to(beta_dtype)
    cu = torch.tensor([0, 70, 200], dtype=torch.int32, device="cuda")
    o_ref, s_ref = kda_prefill(**x, **opts, cu_seqlens=cu, output_final_state=True, backend="reference")
    o, s = kda_prefill(**x, **opts, cu_seqlens=cu, output_final_state=True, backend="sm90")
    assert _rel(o, o_ref) <= _SM90_TOL and _rel(s, s_ref) <= _SM90_TOL


@pytest.mark.gpu_sm90
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_sm90_bf16_states_match_reference(layout, seed, summary_lines) -> None:
    """bf16 states in and out: against the reference backend with the same bf16 states, and (the
    number the docs quote) against the fp32 recurrence run with an fp32 state from the same
    initial values, which adds the rounding of the final state to bf16 (~2^-9 relative)."""
    x, opts = _sm90_inputs(150)
    h0 = (0.1 * torch.randn(2, 4, 128, 128, device="cuda")).to(torch.bfloat16)
    cu = torch.tensor([0, 64, 150], dtype=torch.int32, device="cuda")
    o_ref, s_ref = kda_prefill(**x, **opts, initial_state=h0, cu_seqlens=cu, output_final_state=True,
                               state_layout=layout, backend="reference")
    o, s = kda_prefill(**x, **opts, initial_state=h0, cu_seqlens=cu, output_final_state=True,
                       state_layout=layout, backend="sm90")
    assert s.dtype == torch.bfloat16 and s_ref.dtype == torch.bfloat16
    assert _rel(o, o_ref) <= _SM90_TOL and _rel(s.float(), s_ref.float()) <= _SM90_TOL
    o32, s32 = kda_prefill(**x, **opts, initial_state=h0.float(), cu_seqlens=cu, output_final_state=True,
                           state_layout=layout, backend="reference")
    err_o, err_s = _rel(o, o32), _rel(s.float(), s32)
    summary_lines.append(f"sm90 bf16 state ({layout}) vs the fp32 recurrence with an fp32 state: "
                         f"o {err_o:.2e}, final state {err_s:.2e}")
    assert err_o <= _SM90_TOL and err_s <= _SM90_TOL


@pytest.mark.gpu_sm90
def test_sm90_strided_views_read_in_place(seed) -> None:
    """Column slices of one fused projection: the kernel reads them through the TMA strides and
    gives bitwise the result of the same values made dense."""
    T, H_, HV_ = 300, 2, 4
    proj = torch.randn(1, T, 2 * H_ * 128 + 2 * HV_ * 128, device="cuda").to(torch.bfloat16)
    widths = [H_ * 128, H_ * 128, HV_ * 128, HV_ * 128]
    q, k, v, g = (t.unflatten(2, (-1, 128)) for t in proj.split(widths, dim=2))
    beta = torch.rand(1, T, HV_ + 4, device="cuda")[..., 2:HV_ + 2]
    _, opts = _sm90_inputs(1)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    o1, s1 = kda_prefill(q, k, v, g, beta, **opts, cu_seqlens=cu, output_final_state=True, backend="sm90")
    o2, s2 = kda_prefill(*(t.contiguous() for t in (q, k, v, g, beta)), **opts, cu_seqlens=cu,
                         output_final_state=True, backend="sm90")
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


@pytest.mark.gpu_sm90
def test_sm90_rows_past_cu_seqlens_are_zero(seed) -> None:
    """A padded bucket: the kernel writes zeros into the rows past cu_seqlens[-1] (o holds NaN
    before the call); the real rows match the reference."""
    x, opts = _sm90_inputs(256)
    cu = torch.tensor([0, 30, 130], dtype=torch.int32, device="cuda")
    out = torch.full((1, 256, 4, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    o, _ = kda_prefill(**x, **opts, cu_seqlens=cu, out=out, backend="sm90")
    o_ref, _ = kda_prefill(**x, **opts, cu_seqlens=cu, backend="reference")
    torch.cuda.synchronize()
    assert bool((o[:, 130:] == 0).all())
    assert _rel(o[:, :130], o_ref[:, :130]) <= _SM90_TOL


@pytest.mark.gpu_sm90
def test_sm90_no_tokens_moves_pool_rows_only(seed) -> None:
    """T = 0 (every sequence empty): the final state of each real slot is its initial state."""
    x, opts = _sm90_inputs(0)
    pool = 0.1 * torch.randn(4, 4, 128, 128, device="cuda")
    before = pool.clone()
    kda_prefill(**x, **opts, initial_state=pool, state_indices=torch.tensor([2, -1, 0], device="cuda"),
                has_initial_state=torch.tensor([False, True, True], device="cuda"),
                cu_seqlens=torch.zeros(4, dtype=torch.int32, device="cuda"), output_final_state=True,
                backend="sm90")
    torch.cuda.synchronize()
    assert bool((pool[2] == 0).all()), "has_initial_state False: zeros, written back"
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])


def _gpu_activity(fn) -> list[str]:
    """Names of the GPU activities (kernels, memcpys, memsets) that ``fn`` launches, in order,
    from the profiler (after one warm-up call, so one-time setup does not count)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu_sm90
@pytest.mark.parametrize("T,HV_", [(4096, 64), (4096, 4)], ids=["fused", "cooperative"])
def test_sm90_pooled_call_launches_the_plain_calls_kernels(T, HV_, seed) -> None:
    """Serving contract item 1: a call on a state pool by index launches exactly what the same
    call on a dense initial/final state does (no gather, no scatter, no conversion), in the
    fused kernel and in the cooperative mode."""
    x, opts = _sm90_inputs(T, H_=HV_, HV_=HV_)
    cu = torch.tensor([0, 1000, 1001, T], dtype=torch.int32, device="cuda")
    h0 = 0.1 * torch.randn(3, HV_, 128, 128, device="cuda")
    pool = torch.zeros(8, HV_, 128, 128, device="cuda")
    idx = torch.tensor([5, 0, 2], dtype=torch.int32, device="cuda")
    plain = _gpu_activity(lambda: kda_prefill(**x, **opts, initial_state=h0, cu_seqlens=cu,
                                              output_final_state=True, backend="sm90"))
    pooled = _gpu_activity(lambda: kda_prefill(**x, **opts, initial_state=pool, state_indices=idx,
                                               cu_seqlens=cu, output_final_state=True, backend="sm90"))
    assert any("kda_prefill_sm90_kernel" in name for name in plain), plain
    assert pooled == plain, f"pooled {pooled} vs plain {plain}"


@pytest.mark.gpu_sm90
def test_sm90_fused_projection_slices_launch_no_copy(seed) -> None:
    """Serving contract item 5: q, k, v, g, beta as column slices of one projection output launch
    exactly the kernels of dense inputs: nothing is copied."""
    T, H_, HV_ = 2048, 2, 4
    # beta's HV_ logits and 4 columns of padding keep the token stride a multiple of 16 bytes (TMA)
    proj = torch.randn(1, T, 2 * H_ * 128 + 2 * HV_ * 128 + HV_ + 4, device="cuda").to(torch.bfloat16)
    widths = [H_ * 128, H_ * 128, HV_ * 128, HV_ * 128, HV_, 4]
    q, k, v, g, beta, _ = proj.split(widths, dim=2)
    q, k, v, g = (t.unflatten(2, (-1, 128)) for t in (q, k, v, g))
    _, opts = _sm90_inputs(1, logits=True)
    cu = torch.tensor([0, 700, T], dtype=torch.int32, device="cuda")
    dense = [t.contiguous() for t in (q, k, v, g, beta)]
    sliced = _gpu_activity(lambda: kda_prefill(q, k, v, g, beta, **opts, cu_seqlens=cu, backend="sm90"))
    plain = _gpu_activity(lambda: kda_prefill(*dense, **opts, cu_seqlens=cu, backend="sm90"))
    assert sliced == plain, f"slices {sliced} vs dense {plain}"
    assert not any("copy" in name.lower() or "elementwise" in name.lower() for name in sliced), sliced
