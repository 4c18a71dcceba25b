"""Which path an eager :func:`cula.kda.kda_prefill` call takes to its backend, and that both give
the same results and errors (CPU, reference backend and a stand-in sm90 extension).

``cula.kda.op.call_kda_prefill`` calls the op's implementation directly when nothing but the
caller observes the call (``_plain_eager``), and ``torch.ops.cula.kda_prefill`` otherwise. The
tests spy on the backend function and who called it, and assert which path ran: the direct
path for plain calls (also with ``nn.Parameter`` gate parameters and under a default-device
context), the op under ``torch.compile``, ``FakeTensorMode``, a ``TorchDispatchMode``, a
``TorchFunctionMode``, ``torch.jit.trace``, ``vmap`` and autograd.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Callable, Iterator

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from cula import _ext
from cula.kda import kda_prefill
from cula.kda import op as op_mod
from cula.kda import prefill as prefill_mod

HV, H, K, T = 4, 2, 8, 6


def small_inputs(*, gate_params: bool = True) -> dict[str, Any]:
    """kda_prefill's arguments for a small call with the gate in the kernel (reference backend)."""
    return dict(
        q=torch.randn(1, T, H, K), k=torch.randn(1, T, H, K), v=torch.randn(1, T, HV, K),
        g=torch.randn(1, T, HV, K), beta=torch.rand(1, T, HV),
        A_log=0.1 * torch.randn(HV) if gate_params else None,
        dt_bias=0.1 * torch.randn(HV * K) if gate_params else None,
        use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True,
        use_qk_l2norm_in_kernel=True, output_final_state=True, backend="reference",
    )


class PathSpy:
    """Records, for each call of the reference backend, which path called it: ``"direct"``
    (``call_kda_prefill`` itself) or ``"op"`` (the op's implementation, ``kda_prefill_op``,
    reached through the dispatcher). Under fake tensors the op runs its fake implementation and
    the backend is never called."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        real = op_mod._BACKENDS["reference"]

        def reference(*args: Any) -> None:
            caller = sys._getframe(1).f_code.co_name
            assert caller in ("call_kda_prefill", "kda_prefill_op"), caller
            self.calls.append("direct" if caller == "call_kda_prefill" else "op")
            return real(*args)

        monkeypatch.setitem(op_mod._BACKENDS, "reference", reference)

    @property
    def path(self) -> str:
        assert len(self.calls) == 1, self.calls
        return self.calls[0]


# ------------------------------------------------------------------------------------------------
# the path taken
# ------------------------------------------------------------------------------------------------


class _PassThroughFunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _PassThroughDispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _default_device() -> Iterator[None]:
    torch.set_default_device("cpu")
    try:
        yield
    finally:
        torch.set_default_device(None)


EAGER_CONTEXTS: dict[str, tuple[Callable[[], Any], str]] = {
    "plain": (contextlib.nullcontext, "direct"),
    "no_grad": (torch.no_grad, "direct"),
    "inference_mode": (torch.inference_mode, "direct"),
    "with-torch.device": (lambda: torch.device("cpu"), "direct"),
    "set_default_device": (_default_device, "direct"),
    "torch-function-mode": (_PassThroughFunctionMode, "op"),
    "torch-dispatch-mode": (_PassThroughDispatchMode, "op"),
}


@pytest.mark.parametrize("ctx", list(EAGER_CONTEXTS), ids=list(EAGER_CONTEXTS))
def test_path_in_eager_contexts(ctx: str, seed: int, monkeypatch) -> None:
    make_ctx, want = EAGER_CONTEXTS[ctx]
    x = small_inputs()
    cu = torch.tensor([0, 2, 6])
    expected = kda_prefill(**x, cu_seqlens=cu)
    spy = PathSpy(monkeypatch)
    with make_ctx():
        o, s = kda_prefill(**x, cu_seqlens=cu)
    assert spy.path == want
    assert torch.equal(o, expected[0]) and torch.equal(s, expected[1])


def test_parameters_take_the_direct_path_without_grad(seed: int, monkeypatch) -> None:
    """A model's A_log and dt_bias are nn.Parameters: plain for dispatch, so the direct path
    serves them under no_grad; with grad enabled they require grad and the op (autograd) runs."""
    x = small_inputs()
    x["A_log"] = torch.nn.Parameter(x["A_log"])
    x["dt_bias"] = torch.nn.Parameter(x["dt_bias"])
    spy = PathSpy(monkeypatch)
    with torch.no_grad():
        kda_prefill(**x)
    assert spy.path == "direct"
    spy.calls.clear()
    kda_prefill(**x)
    assert spy.path == "op"


def test_grad_inputs_take_the_op(seed: int, monkeypatch) -> None:
    """Inputs that require grad go through the op (autograd sees the call) with the op's
    behaviour: the call itself succeeds (the op has no backward to register)."""
    x = small_inputs()
    x["q"] = x["q"].requires_grad_()
    spy = PathSpy(monkeypatch)
    o, s = kda_prefill(**x)
    assert spy.path == "op"
    assert not o.requires_grad and not s.requires_grad


def test_fake_tensor_mode_takes_the_op(monkeypatch) -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    spy = PathSpy(monkeypatch)
    with FakeTensorMode():
        o, s = kda_prefill(**small_inputs())
    # The op's fake implementation ran: fake outputs, and no backend call (the direct path would
    # have called the backend with fake tensors).
    assert spy.calls == []
    assert isinstance(o, FakeTensor) and isinstance(s, FakeTensor)
    assert o.shape == (1, T, HV, K) and s.shape == (1, HV, K, K)


def test_compile_sees_the_op(seed: int, monkeypatch) -> None:
    """torch.compile records the custom op as one node (the direct path is never traced), and
    the compiled function runs it."""
    targets: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        targets.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    def step(q, k, v, g, beta, A_log, dt_bias):
        return kda_prefill(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                           lower_bound=-5.0, safe_gate=True, output_final_state=True)

    x = small_inputs()
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    spy = PathSpy(monkeypatch)
    o_c, s_c = torch.compile(step, backend=backend, fullgraph=True)(*args)
    assert any("cula.kda_prefill" in str(t) for t in targets), targets
    assert spy.path == "op"
    o_e, s_e = step(*args)
    assert torch.equal(o_c, o_e) and torch.equal(s_c, s_e)


def test_jit_trace_records_the_op(seed: int) -> None:
    """torch.jit.trace records the op, not the implementation's internals (on sm90 those would
    leave the kernel launch out of the trace)."""
    x = small_inputs(gate_params=False)
    for name in ("use_gate_in_kernel", "lower_bound", "A_log", "dt_bias"):
        x.pop(name)
    x["g"] = -torch.rand(1, T, HV, K)
    tensors = tuple(x.pop(n) for n in ("q", "k", "v", "g", "beta"))

    def step(q, k, v, g, beta):
        return kda_prefill(q, k, v, g, beta, **x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.trace's deprecation and tracer warnings
        traced = torch.jit.trace(step, tensors, check_trace=False)
    assert "cula::kda_prefill" in str(traced.graph)
    for a, b in zip(traced(*tensors), step(*tensors)):
        assert torch.equal(a, b)


def test_vmap_takes_the_op(monkeypatch) -> None:
    """functorch wraps tensors in types that look plain from Python: vmap goes through the op,
    which has no batching rule (as before the direct path existed)."""
    x = small_inputs()
    batched = {n: x.pop(n).unsqueeze(0).expand(2, *x_shape)
               for n, x_shape in (("q", (1, T, H, K)), ("k", (1, T, H, K)), ("v", (1, T, HV, K)),
                                  ("g", (1, T, HV, K)), ("beta", (1, T, HV)))}
    spy = PathSpy(monkeypatch)
    with pytest.raises(RuntimeError, match="Batching rule not implemented for cula::kda_prefill"):
        torch.vmap(lambda q, k, v, g, beta: kda_prefill(q, k, v, g, beta, **x))(*batched.values())
    assert spy.calls == []


def test_plain_eager_decision() -> None:
    """The decision alone: tensor subclasses other than nn.Parameter take the op."""

    class Sub(torch.Tensor):
        pass

    t = torch.zeros(2)
    assert op_mod._plain_eager((t, None))
    assert op_mod._plain_eager((torch.nn.Parameter(t, requires_grad=False), None))
    assert not op_mod._plain_eager((t.as_subclass(Sub), None))
    assert not op_mod._plain_eager((torch.nn.Parameter(t), None))  # requires grad, grad enabled


# ------------------------------------------------------------------------------------------------
# both paths give the same results and errors
# ------------------------------------------------------------------------------------------------


def _force_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(op_mod, "_plain_eager", lambda tensors: False)


CASES: dict[str, dict[str, Any]] = {
    "fixed-h0": dict(initial_state="h0"),
    "varlen-vk-out": dict(cu_seqlens=[0, 1, 1, 6], state_layout="vk", out=True, final_state=True),
    "pool-write": dict(cu_seqlens=[0, 2, 6], pool=True, state_indices=[3, -1],
                       has_initial_state=[False, True]),
    "pool-read-only": dict(cu_seqlens=[0, 2, 6], pool=True, state_indices=[0, 2],
                           output_final_state=False),
    "logits-no-state": dict(use_beta_sigmoid_in_kernel=True, output_final_state=False),
}


def _case_call(case: str) -> dict[str, Any]:
    """kda_prefill's keyword arguments for one case, with fresh caller-owned buffers."""
    opts = dict(CASES[case])
    x = small_inputs()
    n = 1  # sequences
    if "cu_seqlens" in opts:
        opts["cu_seqlens"] = torch.tensor(opts["cu_seqlens"])
        n = len(opts["cu_seqlens"]) - 1
    if opts.pop("initial_state", None) == "h0":
        opts["initial_state"] = 0.1 * torch.randn(n, HV, K, K)
    if opts.pop("pool", False):
        opts["initial_state"] = 0.1 * torch.randn(5, HV, K, K)
        opts["state_indices"] = torch.tensor(opts["state_indices"], dtype=torch.int32)
        if "has_initial_state" in opts:
            opts["has_initial_state"] = torch.tensor(opts["has_initial_state"])
    if opts.pop("out", False):
        opts["out"] = torch.full((1, T, HV, K), float("nan"))
    if opts.pop("final_state", False):
        opts["final_state"] = torch.full((n, HV, K, K), float("nan"))  # K == V: either layout
    x.update(opts)
    return x


def _clone_call(call: dict[str, Any]) -> dict[str, Any]:
    return {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in call.items()}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_paths_agree_on_results_and_mutations(case: str, seed: int, monkeypatch) -> None:
    """Bitwise the same outputs, the same caller buffers written (out=, final_state=, pool rows),
    the same identities returned and the written caller buffers' version counters bumped, by the
    direct path and the op."""
    call = _case_call(case)
    direct_call, op_call = _clone_call(call), _clone_call(call)
    # The caller's buffers that the call writes: out=, final_state=, a pool with final states.
    written = [n for n in ("out", "final_state") if call.get(n) is not None]
    if call.get("state_indices") is not None and call.get("output_final_state"):
        written.append("initial_state")
    spy = PathSpy(monkeypatch)
    before = {n: direct_call[n]._version for n in written}
    o_d, s_d = kda_prefill(**direct_call)
    assert spy.path == "direct"
    assert all(direct_call[n]._version > before[n] for n in written), (written, before)
    _force_op(monkeypatch)
    spy.calls.clear()
    before = {n: op_call[n]._version for n in written}
    o_o, s_o = kda_prefill(**op_call)
    assert spy.path == "op"
    assert all(op_call[n]._version > before[n] for n in written), (written, before)
    assert torch.equal(o_d, o_o)
    assert (s_d is None) == (s_o is None) and (s_d is None or torch.equal(s_d, s_o))
    for name, value in call.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(direct_call[name], op_call[name]), f"{name} differs"
    for result_d, result_o in ((o_d, o_o), (s_d, s_o)):
        for name in ("out", "final_state", "initial_state"):
            if direct_call.get(name) is not None and result_d is direct_call[name]:
                assert result_o is op_call[name], f"{name} returned by one path only"


class _RaisingExt:
    """Stands in for the compiled extension: the binding refuses every call."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def kda_prefill_sm90(self, **kw: Any) -> None:
        raise self.exc


@pytest.mark.parametrize("exc", [RuntimeError("kda_prefill_sm90: boom"),
                                 ValueError("kda_prefill_sm90: bad stride")],
                         ids=["RuntimeError", "ValueError"])
@pytest.mark.parametrize("path", ["direct", "op"])
def test_paths_agree_on_backend_errors(exc: Exception, path: str, monkeypatch) -> None:
    """An error raised below validation (the binding's checks) reaches the caller with the same
    type and message on both paths."""
    monkeypatch.setattr(prefill_mod, "_is_sm90", lambda device: True)
    monkeypatch.setattr(prefill_mod, "_check_sm90_environment", lambda q, prefix: None)
    monkeypatch.setattr(_ext, "get_ext", lambda: _RaisingExt(exc))
    if path == "op":
        _force_op(monkeypatch)
    bf16 = dict(dtype=torch.bfloat16)
    with pytest.raises(type(exc)) as info:
        kda_prefill(torch.randn(1, T, H, 128, **bf16), torch.randn(1, T, H, 128, **bf16),
                    torch.randn(1, T, HV, 128, **bf16), -torch.rand(1, T, HV, 128).to(**bf16),
                    torch.rand(1, T, HV), safe_gate=True, backend="sm90")
    assert str(info.value) == str(exc)


def test_paths_agree_on_validation_errors(monkeypatch) -> None:
    """Validation runs before the path is chosen: the same error either way."""
    x = small_inputs()
    x["beta"] = torch.rand(1, T, HV + 1)
    with pytest.raises(ValueError) as direct:
        kda_prefill(**x)
    _force_op(monkeypatch)
    with pytest.raises(ValueError) as via_op:
        kda_prefill(**x)
    assert str(direct.value) == str(via_op.value) and "`beta`" in str(direct.value)


class _SilentExt:
    """Stands in for the compiled extension: writes nothing and, like the kernel, bumps no
    version counter (so only the eager path's own bumps show)."""

    def kda_prefill_sm90(self, **kw: Any) -> None:
        return None


@pytest.mark.parametrize("given", ["out+final_state", "none"])
def test_direct_path_bumps_the_caller_buffers_it_writes(given: str, monkeypatch) -> None:
    """The direct path bumps the version counters of the caller's buffers it writes (``out``,
    ``final_state``), as the op's dispatch does, and returns fresh outputs where none were given
    (their counters are not observable before they are returned, so they are not bumped)."""
    monkeypatch.setattr(prefill_mod, "_is_sm90", lambda device: True)
    monkeypatch.setattr(prefill_mod, "_check_sm90_environment", lambda q, prefix: None)
    monkeypatch.setattr(_ext, "get_ext", lambda: _SilentExt())
    spy_calls = []
    real = op_mod._BACKENDS["sm90"]

    def sm90(*args: Any) -> None:
        spy_calls.append(sys._getframe(1).f_code.co_name)
        real(*args)

    monkeypatch.setitem(op_mod._BACKENDS, "sm90", sm90)
    bf16 = dict(dtype=torch.bfloat16)
    kw: dict[str, Any] = {}
    if given != "none":
        kw = dict(out=torch.empty(1, T, HV, 128, **bf16), final_state=torch.empty(1, HV, 128, 128))
    before = {n: t._version for n, t in kw.items()}
    o, s = kda_prefill(torch.randn(1, T, H, 128, **bf16), torch.randn(1, T, H, 128, **bf16),
                       torch.randn(1, T, HV, 128, **bf16), -torch.rand(1, T, HV, 128).to(**bf16),
                       torch.rand(1, T, HV), safe_gate=True, output_final_state=True,
                       backend="sm90", **kw)
    assert spy_calls == ["call_kda_prefill"]
    assert o.shape == (1, T, HV, 128) and o.dtype == torch.bfloat16 and o.is_contiguous()
    assert s.shape == (1, HV, 128, 128) and s.dtype == torch.float32
    for n, t in kw.items():
        assert t._version == before[n] + 1, f"{n}: version {t._version}, was {before[n]}"
    if given != "none":
        assert o is kw["out"] and s is kw["final_state"]
