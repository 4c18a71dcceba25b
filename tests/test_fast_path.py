"""The eager fast path of :func:`cula.kda.kda_prefill` (``kda_prefill_fast`` in the extension).

A call whose signature passed the Python rules and chose the sm90 kernel is remembered by the
extension (``kda_prefill_fast_register``); the next call with the same signature, in plain eager
mode, runs from there: the same allocations and launch without the Python layers. These tests
check

* on the CPU, with stand-in extensions: when the Python layer offers a call to the fast path
  (plain eager mode only, never to a stand-in without it), that a hit is returned as it is and
  sets ``last_backend()``, what a successful sm90 call registers (the 23 arguments as the caller
  passed them, then the resolved scale, lower bound, N, state dtype and decay bound), and that
  clearing the Python memo clears the extension's; with the compiled extension, its misses and
  that a failing launch raises RuntimeError;
* on an SM90 GPU, with the real extension: that the fast path is taken (no rule runs), gives
  bitwise the Python path's results on the same inputs for fixed-length and varlen calls, state
  pools (read and written, read only), caller buffers, bf16 and vk states, beta logits and the
  softplus gate with a 2-D dt_bias; that it bumps the caller buffers' version counters; and that
  every call the Python memo would not let through still runs the rules (index values checked,
  a misaligned pool, tensors that require grad, a cleared memo).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import pytest
import torch
from torch.overrides import TorchFunctionMode

from cula import _ext
from cula.kda import kda_prefill
from cula.kda import prefill as prefill_mod

# ------------------------------------------------------------------------------------------------
# CPU: the Python side of the fast path, with stand-in extensions
# ------------------------------------------------------------------------------------------------

T, H, HV, D = 6, 2, 4, 128


def _sm90_inputs(**over: Any) -> dict[str, Any]:
    bf16 = dict(dtype=torch.bfloat16)
    kw: dict[str, Any] = dict(
        q=torch.randn(1, T, H, D, **bf16), k=torch.randn(1, T, H, D, **bf16),
        v=torch.randn(1, T, HV, D, **bf16), g=torch.randn(1, T, HV, D, **bf16),
        beta=torch.rand(1, T, HV), A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * D),
        use_gate_in_kernel=True, lower_bound=-4.0, safe_gate=True, output_final_state=True,
        backend="sm90")
    kw.update(over)
    return kw


class _FastExt:
    """A stand-in extension with the fast path: ``kda_prefill_fast`` returns ``answer`` (None: a
    miss) and records its arguments; the launch and the register calls are recorded too."""

    def __init__(self, answer: Any = None) -> None:
        self.answer = answer
        self.fast: list[tuple] = []
        self.registered: list[tuple] = []
        self.launches = 0

    def kda_prefill_fast(self, *args: Any) -> Any:
        self.fast.append(args)
        return self.answer

    def kda_prefill_fast_register(self, *args: Any) -> bool:
        self.registered.append(args)
        return True

    def kda_prefill_sm90(self, **kw: Any) -> None:
        self.launches += 1


@pytest.fixture
def stand_in(monkeypatch) -> Callable[[Any], _FastExt]:
    monkeypatch.setattr(prefill_mod, "_is_sm90", lambda device: True)
    monkeypatch.setattr(prefill_mod, "_check_sm90_environment", lambda q, prefix: None)

    def install(answer: Any = None) -> _FastExt:
        ext = _FastExt(answer)
        monkeypatch.setattr(_ext, "get_ext", lambda: ext)
        return ext

    return install


def test_a_hit_is_returned_as_it_is(stand_in) -> None:
    sentinel = (torch.zeros(1), None)
    ext = stand_in(sentinel)
    prefill_mod.LAST_BACKEND = None
    kw = _sm90_inputs(scale=0.5)
    assert kda_prefill(**kw) is sentinel
    assert ext.launches == 0 and ext.registered == []
    assert prefill_mod.last_backend() == "sm90"
    (args,) = ext.fast
    # the public signature's 23 arguments, positional, in its order, as passed
    assert len(args) == 23
    assert args[0] is kw["q"] and args[4] is kw["beta"] and args[5] == 0.5 and args[11] is kw["A_log"]
    assert args[14] == -4.0 and args[15] == "kv" and args[16] == "sm90" and args[22] is None


def test_a_miss_runs_the_rules_and_registers(stand_in) -> None:
    ext = stand_in(None)
    prefill_mod._VALIDATED.clear()
    kw = _sm90_inputs(dt_bias=torch.zeros(HV, D))  # 2-D: reshaped for the launch, registered as given
    o, s = kda_prefill(**kw)
    assert ext.launches == 1 and len(ext.fast) == 1
    assert o.shape == (1, T, HV, D) and s.shape == (1, HV, D, D) and s.dtype == torch.float32
    (reg,) = ext.registered
    assert len(reg) == 28
    assert reg[12] is kw["dt_bias"] and reg[6] is None and reg[20] is None
    scale, lower_bound, num_seqs, state_is_bf16, bounded = reg[23:]
    assert scale == pytest.approx(D ** -0.5) and lower_bound == -4.0 and num_seqs == 1
    assert state_is_bf16 is False and bounded is True


def test_a_pooled_call_registers_the_pool_as_initial_state(stand_in) -> None:
    """The slow path moves the pool from initial_state to state_pool before the launch; the
    register call gets the caller's arguments."""
    ext = stand_in(None)
    pool = torch.zeros(3, HV, D, D, dtype=torch.bfloat16)
    kw = _sm90_inputs(q=torch.randn(2, T, H, D, dtype=torch.bfloat16), k=torch.randn(2, T, H, D, dtype=torch.bfloat16),
                      v=torch.randn(2, T, HV, D, dtype=torch.bfloat16), g=torch.randn(2, T, HV, D, dtype=torch.bfloat16),
                      beta=torch.rand(2, T, HV), initial_state=pool, state_indices=torch.tensor([2, 0]),
                      check_inputs=False)
    _, s = kda_prefill(**kw)
    assert s is pool
    (reg,) = ext.registered
    assert reg[6] is pool and reg[17] is kw["state_indices"] and reg[25] == 2  # N


def test_only_signatures_the_python_memo_holds_are_registered(stand_in, monkeypatch) -> None:
    """A call whose rules read index values (CPU cu_seqlens, checked on every call) is never
    remembered by the Python memo, so it is not registered either; nor is a call whose signature
    the memo does not hold when the launch is done (here: a memo whose inserts are dropped)."""
    ext = stand_in(None)
    prefill_mod._VALIDATED.clear()
    kda_prefill(**_sm90_inputs(cu_seqlens=torch.tensor([0, 2, T])))
    assert ext.launches == 1 and ext.registered == [] and len(prefill_mod._VALIDATED) == 0

    class Forgetful(prefill_mod._Memo):
        def __setitem__(self, key, value) -> None:
            pass

    memo = prefill_mod._VALIDATED
    monkeypatch.setattr(prefill_mod, "_VALIDATED", Forgetful())
    kda_prefill(**_sm90_inputs())
    assert ext.launches == 2 and ext.registered == []
    monkeypatch.setattr(prefill_mod, "_VALIDATED", memo)
    memo.clear()
    kda_prefill(**_sm90_inputs())
    assert ext.launches == 3 and len(ext.registered) == 1


def test_the_fast_path_is_offered_in_plain_eager_mode_only(stand_in) -> None:
    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    ext = stand_in((torch.zeros(1), None))
    with PassThrough():
        kda_prefill(**_sm90_inputs())
    assert ext.fast == [] and ext.launches == 1
    assert ext.registered == []  # nor registered from there


def test_stand_ins_without_the_fast_path_take_the_python_path(monkeypatch) -> None:
    class Plain:
        def kda_prefill_sm90(self, **kw: Any) -> None:
            pass

    monkeypatch.setattr(_ext, "get_ext", lambda: Plain())
    assert prefill_mod._fast_ext() is None


def test_clearing_the_python_memo_clears_the_extension_memo(monkeypatch) -> None:
    cleared: list[int] = []

    class Owner:
        @staticmethod
        def kda_prefill_fast_clear() -> None:
            cleared.append(1)

    monkeypatch.setattr(prefill_mod, "_FAST_MEMO_OWNER", Owner)
    prefill_mod._VALIDATED.clear()
    assert cleared == [1]
    # and so does the bound's eviction (a full memo is cleared before the next entry)
    monkeypatch.setattr(prefill_mod, "_VALIDATED_MAX", 1)
    kw = dict(q=torch.randn(1, 4, 1, 8), k=torch.randn(1, 4, 1, 8), v=torch.randn(1, 4, 1, 8),
              g=-torch.rand(1, 4, 1, 8), beta=torch.rand(1, 4, 1), backend="reference")
    kda_prefill(**kw)
    kda_prefill(**{**kw, "scale": 0.5})
    assert len(cleared) == 2 and len(prefill_mod._VALIDATED) == 1
    prefill_mod._VALIDATED.clear()


def _public_args(kw: dict[str, Any]) -> tuple:
    """The 23 arguments of ``kda_prefill`` for keyword arguments ``kw``, positional, in its order
    (defaults filled in): what the Python layer passes to ``kda_prefill_fast``."""
    bound = inspect.signature(kda_prefill).bind(**kw)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


@pytest.mark.skipif(not _ext.kernels_available(), reason="needs the compiled extension")
def test_the_compiled_fast_path_misses_and_raises_as_torch_does() -> None:
    """The compiled ``kda_prefill_fast`` (a vectorcall function of the 23 arguments, not a pybind
    one): None for an empty memo, a wrong argument count and a signature not registered; a
    registered call whose launch fails (here: CPU tensors, which the binding's device guard
    refuses) raises RuntimeError, as torch's own functions translate C++ errors, and the next call
    works as before."""
    ext = _ext.get_ext()
    prefill_mod._VALIDATED.clear()  # clears the extension's memo too
    args = _public_args(_sm90_inputs())
    assert len(args) == 23
    assert ext.kda_prefill_fast(*args) is None  # nothing registered
    assert ext.kda_prefill_fast() is None
    assert ext.kda_prefill_fast_register(*args, D ** -0.5, -4.0, 1, False, True) is True
    assert ext.kda_prefill_fast(*args[:-1]) is None  # 22 arguments
    other = _public_args(_sm90_inputs(scale=0.25))
    assert ext.kda_prefill_fast(*other) is None  # another signature (an option's value)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            ext.kda_prefill_fast(*args)
    prefill_mod._VALIDATED.clear()
    assert ext.kda_prefill_fast(*args) is None


# ------------------------------------------------------------------------------------------------
# GPU: the real extension
# ------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu_sm90


def _gpu_case(case: str) -> dict[str, Any]:
    """kda_prefill's arguments for one case, fresh random tensors on the GPU."""
    dev, bf16 = "cuda", torch.bfloat16
    B, TT, h, hv = 2, 300, 2, 4
    if case in ("varlen_pool", "read_only_pool"):
        B, TT = 1, 700
    kw: dict[str, Any] = dict(
        q=torch.randn(B, TT, h, D, device=dev, dtype=bf16), k=torch.randn(B, TT, h, D, device=dev, dtype=bf16),
        v=torch.randn(B, TT, hv, D, device=dev, dtype=bf16), g=torch.randn(B, TT, hv, D, device=dev, dtype=bf16),
        beta=torch.rand(B, TT, hv, device=dev), A_log=0.1 * torch.randn(hv, device=dev),
        dt_bias=0.1 * torch.randn(hv * D, device=dev), use_gate_in_kernel=True, lower_bound=-5.0,
        safe_gate=True, use_qk_l2norm_in_kernel=True, output_final_state=True, backend="sm90")
    if case == "fixed":
        kw["initial_state"] = torch.randn(B, hv, D, D, device=dev)
    elif case == "varlen_pool":  # a long sequence, a tiny one, an empty one; pool written in place
        kw.update(cu_seqlens=torch.tensor([0, 650, 651, 651, 700], device=dev, dtype=torch.int32),
                  initial_state=torch.randn(6, hv, D, D, device=dev),
                  state_indices=torch.tensor([4, 0, -1, 2], device=dev))
    elif case == "read_only_pool":
        kw.update(cu_seqlens=torch.tensor([0, 300, 700], device=dev),
                  initial_state=torch.randn(3, hv, D, D, device=dev, dtype=bf16),
                  state_indices=torch.tensor([2, 0], device=dev), output_final_state=False)
    elif case == "buffers_vk_bf16":
        kw.update(state_layout="vk", initial_state=torch.randn(B, hv, D, D, device=dev, dtype=bf16),
                  out=torch.empty(B, TT, hv, D, device=dev, dtype=bf16),
                  final_state=torch.empty(B, hv, D, D, device=dev, dtype=bf16))
    elif case == "beta_logits":
        kw.update(beta=torch.randn(B, TT, hv, device=dev, dtype=bf16), use_beta_sigmoid_in_kernel=True)
    elif case == "softplus":
        kw.update(safe_gate=False, lower_bound=None, dt_bias=0.1 * torch.randn(hv, D, device=dev))
    else:
        raise AssertionError(case)
    return kw


def _clone(kw: dict[str, Any]) -> dict[str, Any]:
    return {n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}



GPU_CASES = ["fixed", "varlen_pool", "read_only_pool", "buffers_vk_bf16", "beta_logits", "softplus"]


@gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_fast_path_is_taken_and_matches_the_python_path(case: str, seed: int, monkeypatch, count_calls) -> None:
    runs = count_calls(prefill_mod, "_plan")
    prefill_mod._VALIDATED.clear()
    kda_prefill(**_gpu_case(case))  # the rules run; the signature is registered
    assert len(runs) == 1
    kw = _gpu_case(case)  # new tensors, same signature
    slow_kw, fast_kw = _clone(kw), _clone(kw)
    prefill_mod._VALIDATED.clear()  # forgets both memos: the Python path
    slow = kda_prefill(**slow_kw)
    assert len(runs) == 2
    fast = kda_prefill(**fast_kw)
    assert len(runs) == 2, "the second call of a registered signature ran the rules"
    assert prefill_mod.last_backend() == "sm90"
    torch.cuda.synchronize()
    assert torch.equal(fast[0], slow[0]), "o differs between the fast and the Python path"
    assert (fast[1] is None) == (slow[1] is None)
    if slow[1] is not None:
        assert torch.equal(fast[1], slow[1]), "the final state differs"
        assert fast[1].dtype == slow[1].dtype and fast[1].shape == slow[1].shape
    assert float(fast[0].float().abs().sum()) > 0
    if "out" in fast_kw:  # the caller's buffers are what is returned
        assert fast[0] is fast_kw["out"] and fast[1] is fast_kw["final_state"]
    if "state_indices" in fast_kw:
        assert torch.equal(fast_kw["initial_state"], slow_kw["initial_state"])  # the pools after the call
        if fast_kw["output_final_state"]:
            assert fast[1] is fast_kw["initial_state"]


@gpu
def test_fast_path_bumps_only_the_caller_buffers(seed, monkeypatch, count_calls) -> None:
    runs = count_calls(prefill_mod, "_plan")
    prefill_mod._VALIDATED.clear()
    kda_prefill(**_gpu_case("buffers_vk_bf16"))
    kw = _gpu_case("buffers_vk_bf16")
    before = (kw["out"]._version, kw["final_state"]._version)
    o, s = kda_prefill(**kw)
    assert len(runs) == 1  # the second call took the fast path
    assert (kw["out"]._version, kw["final_state"]._version) == (before[0] + 1, before[1] + 1)
    kda_prefill(**_gpu_case("fixed"))
    o2, s2 = kda_prefill(**_gpu_case("fixed"))
    assert len(runs) == 2
    assert o2._version == 0 and s2._version == 0  # fresh outputs: nothing observed them


@gpu
def test_calls_the_python_memo_would_check_still_run_the_rules(seed, monkeypatch, count_calls) -> None:
    runs = count_calls(prefill_mod, "_plan")
    kw = _gpu_case("varlen_pool")
    kda_prefill(**_clone(kw))
    kda_prefill(**_clone(kw))
    n = len(runs)
    # index values checked on the host (CULA_CHECK_CU_SEQLENS=1): bad values raise every time
    monkeypatch.setenv("CULA_CHECK_CU_SEQLENS", "1")
    bad = _clone(kw)
    bad["cu_seqlens"] = torch.tensor([0, 651, 650, 651, 700], device="cuda", dtype=torch.int32)
    for _ in range(2):
        with pytest.raises(ValueError, match="cu_seqlens"):
            kda_prefill(**bad)
    monkeypatch.delenv("CULA_CHECK_CU_SEQLENS")
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_prefill(**{**bad, "check_inputs": True})
    assert len(runs) == n + 3
    # a pool 4 bytes off its 16-byte alignment (same shape and strides): the rule raises
    base = torch.zeros(6 * 4 * D * D + 4, device="cuda")
    shifted = base[1: 1 + 6 * 4 * D * D].view(6, 4, D, D)
    with pytest.raises(ValueError, match="initial_state"):
        kda_prefill(**{**_clone(kw), "initial_state": shifted})
    # tensors that require grad, with grad enabled: the Python path (the op, for autograd)
    fixed = _gpu_case("fixed")
    kda_prefill(**_clone(fixed))
    n = len(runs)
    graded = _clone(fixed)
    graded["A_log"].requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the op has no autograd formula and may say so
        kda_prefill(**graded)
    assert len(runs) == n + 1
    with torch.no_grad():
        kda_prefill(**graded)
    assert len(runs) == n + 1  # without grad the same call is plain: the fast path
    # a cleared memo: the rules again
    prefill_mod._VALIDATED.clear()
    kda_prefill(**_clone(fixed))
    assert len(runs) == n + 2

