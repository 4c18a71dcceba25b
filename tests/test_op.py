"""The torch custom op ``cula::kda_prefill`` and torch.compile over :func:`cula.kda.kda_prefill`.

CPU tests (no GPU needed): the op's schema (named arguments, declared mutations),
``torch.library.opcheck`` of the op on the reference path, and ``torch.compile(fullgraph=True)``
of functions that call ``kda_prefill``: zero graph breaks (``torch._dynamo.explain``), the same
results as eager, dynamic shapes, errors still raised.

GPU tests (``gpu_sm90``): opcheck on the fused kernel, ``torch.compile`` (inductor) with no graph
break and bitwise the eager result, and a CUDA graph capture of the compiled function.
"""

from __future__ import annotations

import pytest
import torch

import cula.kda
from cula.kda import kda_prefill
from cula.kda import prefill as prefill_mod

OP = torch.ops.cula.kda_prefill.default


def inputs(B: int = 1, T: int = 6, H: int = 2, HV: int = 4, K: int = 8, V: int = 8,
           dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict[str, torch.Tensor]:
    f32 = dict(device=device, dtype=torch.float32)
    return dict(
        q=torch.randn(B, T, H, K, **f32).to(dtype),
        k=torch.randn(B, T, H, K, **f32).to(dtype),
        v=torch.randn(B, T, HV, V, **f32).to(dtype),
        g=(-torch.rand(B, T, HV, K, **f32)).to(dtype),
        beta=torch.rand(B, T, HV, **f32),
    )


def op_args(x: dict, *, N: int | None = None, cu: torch.Tensor | None = None, h0: bool = True,
            final: bool = True, layout: str = "kv", gate: bool = False, backend: str = "reference",
            logits: bool = False):
    """(args, kwargs) of one op call on inputs ``x`` with fresh outputs."""
    B, T, HV, V = x["v"].shape
    K = x["q"].shape[3]
    N = B if cu is None else cu.numel() - 1
    dev = x["q"].device
    state = (N, HV, K, V) if layout == "kv" else (N, HV, V, K)
    h = 0.1 * torch.randn(state, device=dev) if h0 else None
    o = torch.empty(B, T, HV, V, dtype=x["q"].dtype, device=dev)
    fs = torch.empty(state, device=dev) if final else None
    A_log = 0.1 * torch.randn(HV, device=dev) if gate else None
    dt_bias = 0.1 * torch.randn(HV * K, device=dev) if gate else None
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], A_log, dt_bias, h, cu, None, None, o, fs,
            None)
    kwargs = dict(scale=K ** -0.5, lower_bound=-5.0 if gate else None, use_gate_in_kernel=gate,
                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=logits,
                  state_layout=layout, bounded_decays=True, backend=backend)
    return args, kwargs


# ------------------------------------------------------------------------------------------------
# the op
# ------------------------------------------------------------------------------------------------


def test_op_schema_names_and_mutations() -> None:
    schema = OP._schema
    assert schema.name == "cula::kda_prefill"
    names = [a.name for a in schema.arguments]
    assert names == ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens",
                     "state_indices", "has_initial_state", "o", "final_state", "state_pool",
                     "scale", "lower_bound", "use_gate_in_kernel", "use_qk_l2norm_in_kernel",
                     "use_beta_sigmoid_in_kernel", "state_layout", "bounded_decays", "backend"]
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["o", "final_state", "state_pool"]
    assert all(a.kwarg_only for a in schema.arguments[14:]), "options must be keyword-only"
    assert not any(a.kwarg_only for a in schema.arguments[:14]), "tensors must be positional"
    assert len(schema.returns) == 0


OPCHECK_CASES = {
    "fixed-kv": dict(),
    "varlen-vk-gate": dict(cu=[0, 0, 2, 6], layout="vk", gate=True),
    "no-h0-no-final": dict(h0=False, final=False),
    "beta-logits-padded": dict(cu=[0, 2, 4], logits=True),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES), ids=list(OPCHECK_CASES))
def test_opcheck_reference(case: str, seed: int) -> None:
    """torch.library.opcheck: schema vs. behaviour (mutations), fake tensors, autograd
    registration, AOT dispatch with dynamic shapes, on the reference path (CPU)."""
    opts = dict(OPCHECK_CASES[case])
    cu = opts.pop("cu", None)
    x = inputs()
    args, kwargs = op_args(x, cu=None if cu is None else torch.tensor(cu), **opts)
    torch.library.opcheck(OP, args, kwargs)


def make_pool(S: int, HV: int, K: int, V: int, *, layout: str = "kv", dtype=torch.float32,
              row_pad: int = 0, device: str = "cpu") -> torch.Tensor:
    """A state pool [S, HV, K, V] ("kv") or [S, HV, V, K] ("vk"); ``row_pad`` extra elements per
    row make stride(0) larger than HV*K*V (rows stay dense and 16-byte aligned)."""
    row = HV * K * V
    base = (0.1 * torch.randn(S, row + row_pad, device=device)).to(dtype)
    trailing = (HV, K, V) if layout == "kv" else (HV, V, K)
    return base[:, :row].unflatten(1, trailing)


def pooled_op_args(x: dict, *, cu: list[int], indices: list[int], S: int = 5, layout: str = "kv",
                   write: bool = True, dtype=torch.float32, has_init: list[bool] | None = None,
                   row_pad: int = 0):
    """(args, kwargs) of a pooled op call: the pool is ``state_pool`` (written) or
    ``initial_state`` (read only)."""
    B, T, HV, V = x["v"].shape
    K = x["q"].shape[3]
    pool = make_pool(S, HV, K, V, layout=layout, dtype=dtype, row_pad=row_pad)
    o = torch.empty(B, T, HV, V, dtype=x["q"].dtype)
    idx = torch.tensor(indices, dtype=torch.int32)
    hi = None if has_init is None else torch.tensor(has_init)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, None if write else pool,
            torch.tensor(cu), idx, hi, o, None, pool if write else None)
    kwargs = dict(scale=K ** -0.5, lower_bound=None, use_gate_in_kernel=False,
                  use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=False,
                  state_layout=layout, bounded_decays=True, backend="reference")
    return args, kwargs


POOLED_OPCHECK_CASES = {
    "pool-kv-write": dict(cu=[0, 2, 2, 6], indices=[3, -1, 0]),
    "pool-vk-bf16-padded-rows": dict(cu=[0, 4, 5], indices=[1, 4], layout="vk",
                                     dtype=torch.bfloat16, row_pad=8, has_init=[False, True]),
    "pool-read-only": dict(cu=[0, 3, 6], indices=[2, 0], write=False),
}


@pytest.mark.parametrize("case", list(POOLED_OPCHECK_CASES), ids=list(POOLED_OPCHECK_CASES))
def test_opcheck_reference_pooled(case: str, seed: int) -> None:
    """opcheck of the pooled call: the pool declared mutated (state_pool) is written in place."""
    args, kwargs = pooled_op_args(inputs(), **POOLED_OPCHECK_CASES[case])
    torch.library.opcheck(OP, args, kwargs)


def test_op_pooled_writes_only_real_rows(seed: int) -> None:
    args, kwargs = pooled_op_args(inputs(), cu=[0, 2, 2, 6], indices=[3, -1, 0])
    pool = args[13]
    before = pool.clone()
    torch.ops.cula.kda_prefill(*args, **kwargs)
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]]), "rows of no real slot were written"
    assert not torch.equal(pool[3], before[3]) and not torch.equal(pool[0], before[0])


def test_op_writes_only_its_outputs(seed: int) -> None:
    x = inputs()
    args, kwargs = op_args(x, cu=torch.tensor([0, 3, 6]), layout="vk", gate=True)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    o, fs = args[11], args[12]
    o.fill_(float("nan"))
    fs.fill_(float("nan"))
    torch.ops.cula.kda_prefill(*args, **kwargs)
    assert torch.isfinite(o).all() and torch.isfinite(fs).all()
    for i, (a, b) in enumerate(zip(args[:9], before[:9])):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"input {OP._schema.arguments[i].name} was modified"


def test_eager_path_calls_the_implementation_directly(seed: int, monkeypatch) -> None:
    """Plain eager calls skip the op's Python dispatch (its implementation runs directly, same
    result as the op) and still bump the version counters of what they write; anything that
    traces or observes dispatch goes through the op."""
    from cula.kda import op as op_mod

    x = inputs()
    args, kwargs = op_args(x, cu=torch.tensor([0, 3, 6]), gate=True)
    o, fs = args[11], args[12]
    v0, f0 = o._version, fs._version
    calls = []
    real_op = torch.ops.cula.kda_prefill
    monkeypatch.setattr(torch.ops.cula, "kda_prefill", lambda *a, **k: (calls.append(1), real_op(*a, **k)))
    op_mod.call_kda_prefill(*args, **kwargs)
    assert calls == [], "plain eager went through the op"
    assert o._version > v0 and fs._version > f0
    o_direct, fs_direct = o.clone(), fs.clone()
    real_op(*args, **kwargs)
    assert torch.equal(o, o_direct) and torch.equal(fs, fs_direct)

    assert op_mod._plain_eager(args)
    grad_args = (args[0].clone().requires_grad_(),) + args[1:]
    assert not op_mod._plain_eager(grad_args)
    with torch.no_grad():
        assert op_mod._plain_eager(grad_args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not op_mod._plain_eager(args)
    op_mod.call_kda_prefill(*grad_args, **kwargs)
    assert calls == [1], "a call autograd should see did not go through the op"


def test_eager_path_under_inference_mode(seed: int) -> None:
    """FLA's backends run under torch.inference_mode(): the direct eager path writes a caller's
    (normal) out= buffer there too, and results equal the op's."""
    x = inputs(K=8, V=8)
    out = torch.empty(1, 6, 4, 8)
    with torch.inference_mode():
        o, s = kda_prefill(**x, out=out, output_final_state=True, use_qk_l2norm_in_kernel=True,
                           safe_gate=True, backend="reference")
    assert o is out and not s.requires_grad
    args, kwargs = op_args(x, h0=False)
    torch.ops.cula.kda_prefill(*args, **kwargs)
    assert torch.equal(out, args[11]) and torch.equal(s, args[12])


def test_op_fake_rejects_wrong_output_shape() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = inputs()
        args, kwargs = op_args(x)
        bad = list(args)
        bad[11] = torch.empty(1, 6, 4, 7)  # o with V=7
        with pytest.raises(RuntimeError, match="o must have"):
            torch.ops.cula.kda_prefill(*bad, **kwargs)


# ------------------------------------------------------------------------------------------------
# torch.compile over kda_prefill (CPU: the reference path through the same op)
# ------------------------------------------------------------------------------------------------


def model_step(q, k, v, g, beta, h0, cu, A_log, dt_bias):
    """What a model layer does around the prefill: some math, kda_prefill, some math."""
    o, state = kda_prefill(q * 1.0, k, v, g, beta, initial_state=h0, output_final_state=True,
                           cu_seqlens=cu, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           A_log=A_log, dt_bias=dt_bias, safe_gate=True, lower_bound=-5.0,
                           state_layout="vk")
    return o.float().relu(), state * 2


def model_inputs(T: int = 6, cu: list[int] = (0, 2, 6), device: str = "cpu", dtype=torch.float32,
                 K: int = 8) -> tuple:
    HV = 4
    x = inputs(T=T, K=K, V=K, dtype=dtype, device=device)
    x["g"] = torch.randn_like(x["g"])  # raw gate
    N = len(cu) - 1
    h0 = 0.1 * torch.randn(N, HV, K, K, device=device)
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], h0,
            torch.tensor(cu, device=device, dtype=torch.int32),
            0.1 * torch.randn(HV, device=device), 0.1 * torch.randn(HV * K, device=device))


def test_compile_has_no_graph_break(seed: int) -> None:
    args = model_inputs()
    explanation = torch._dynamo.explain(model_step)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_matches_eager(dynamic: bool, seed: int) -> None:
    compiled = torch.compile(model_step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for T, cu in ((6, [0, 2, 6]), (9, [0, 0, 4, 9]), (13, [0, 13])):
        args = model_inputs(T=T, cu=cu)
        prefill_mod.LAST_BACKEND = None
        o_c, s_c = compiled(*args)
        assert cula.kda.last_backend() == "reference", "the compiled call did not update last_backend()"
        o_e, s_e = model_step(*args)
        assert torch.equal(o_c, o_e) and torch.equal(s_c, s_e), f"T={T} cu={cu}"


def test_compile_still_raises_validation_errors(seed: int) -> None:
    args = list(model_inputs())
    args[4] = torch.rand(1, 6, 3)  # beta with HV=3
    with pytest.raises(ValueError, match="`beta`"):
        torch.compile(model_step, backend="aot_eager")(*args)
    # fullgraph: Dynamo reports the same ValueError, wrapped (it cannot raise inside a graph)
    with pytest.raises(Exception, match="`beta` must be of shape"):
        torch.compile(model_step, fullgraph=True, backend="aot_eager")(*args)


def serving_step(q, k, v, g, beta, pool, cu, idx, A_log, dt_bias):
    """A model layer's prefill against a state pool: read and write rows of ``pool`` in place."""
    o, state = kda_prefill(q, k, v, g, beta, initial_state=pool, state_indices=idx,
                           output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                           use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, safe_gate=True,
                           lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, check_inputs=False)
    return o.float() * 2, state


def test_compile_pooled_no_graph_break_and_matches_eager(seed: int) -> None:
    q, k, v, g, beta, _, cu, A_log, dt_bias = model_inputs(T=6, cu=[0, 2, 6])
    idx = torch.tensor([4, 1], dtype=torch.int32)
    pool = make_pool(6, 4, 8, 8)
    explanation = torch._dynamo.explain(serving_step)(q, k, v, g, beta, pool.clone(), cu, idx,
                                                      A_log, dt_bias)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(serving_step, fullgraph=True, backend="aot_eager")
    pool_c, pool_e = pool.clone(), pool.clone()
    o_c, s_c = compiled(q, k, v, g, beta, pool_c, cu, idx, A_log, dt_bias)
    o_e, s_e = serving_step(q, k, v, g, beta, pool_e, cu, idx, A_log, dt_bias)
    assert s_e is pool_e
    assert torch.equal(o_c, o_e) and torch.equal(pool_c, pool_e)
    assert not torch.equal(pool_e[4], pool[4]) and torch.equal(pool_e[0], pool[0])


def test_compile_pool_layout_error_names_initial_state(seed: int) -> None:
    """A pool with non-dense rows is refused while compiling too, with the same message (the
    data pointer, which fake tensors lack, is not read there)."""
    q, k, v, g, beta, _, cu, A_log, dt_bias = model_inputs(T=6, cu=[0, 2, 6])
    idx = torch.tensor([4, 1], dtype=torch.int32)
    bad_pool = torch.zeros(6, 4, 8, 8).transpose(2, 3)
    compiled = torch.compile(serving_step, fullgraph=True, backend="aot_eager")
    # Eager raises the ValueError itself; Dynamo (torch 2.11, after other compiled tests in the same
    # process) may re-raise it as "Observed exception" listing the message's pieces in order.
    with pytest.raises(Exception, match=r"(?s)initial_state.*must be .*a state pool whose rows are dense"):
        compiled(q, k, v, g, beta, bad_pool, cu, idx, A_log, dt_bias)


# ------------------------------------------------------------------------------------------------
# GPU: the fused kernel through the op
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu_sm90
@pytest.mark.parametrize("case", list(OPCHECK_CASES), ids=list(OPCHECK_CASES))
def test_opcheck_sm90(case: str, seed: int) -> None:
    opts = dict(OPCHECK_CASES[case])
    cu = opts.pop("cu", None)
    x = inputs(T=70, K=128, V=128, dtype=torch.bfloat16, device="cuda")
    cu_t = None if cu is None else torch.tensor([0, 0, 2, 70], device="cuda")
    args, kwargs = op_args(x, cu=cu_t, backend="sm90", **opts)
    torch.library.opcheck(OP, args, kwargs)


def _gpu_model_inputs() -> tuple:
    return model_inputs(T=300, cu=[0, 0, 1, 65, 300], device="cuda", dtype=torch.bfloat16, K=128)


@pytest.mark.gpu_sm90
def test_compile_inductor_matches_eager_sm90(seed: int) -> None:
    """torch.compile (inductor, fullgraph) of a function calling kda_prefill on the fused kernel:
    no graph break, and bitwise the eager result (the kernel is deterministic)."""
    args = _gpu_model_inputs()
    explanation = torch._dynamo.explain(model_step)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model_step, fullgraph=True)
    prefill_mod.LAST_BACKEND = None
    o_c, s_c = compiled(*args)
    assert cula.kda.last_backend() == "sm90"
    o_e, s_e = model_step(*args)
    assert torch.equal(o_c, o_e) and torch.equal(s_c, s_e)


@pytest.mark.gpu_sm90
def test_compiled_function_in_cuda_graph(seed: int) -> None:
    """The compiled function captured in a CUDA graph replays to the eager result."""
    args = _gpu_model_inputs()
    compiled = torch.compile(model_step, fullgraph=True)
    o_e, s_e = model_step(*args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up (compilation) outside the capture
            compiled(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, s_g = compiled(*args)
    for _ in range(2):
        o_g.fill_(float("nan"))
        s_g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_g, o_e) and torch.equal(s_g, s_e), "graph replay differs from eager"
