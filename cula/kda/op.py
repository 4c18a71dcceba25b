"""The torch custom op ``cula::kda_prefill`` that :func:`cula.kda.kda_prefill` calls.

:func:`cula.kda.kda_prefill` validates every argument on the host (one rule per argument, in
:mod:`cula.kda.prefill`), picks the backend, allocates the outputs and then calls this op. The op
is what ``torch.compile`` sees: an opaque node with a named schema, declared mutations and a fake
(meta) implementation, so a compiled function that calls ``kda_prefill`` traces into a single
graph (no graph break) and a CUDA graph can capture it::

    cula::kda_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log,
                      Tensor? dt_bias, Tensor? initial_state, Tensor? cu_seqlens,
                      Tensor? state_indices, Tensor? has_initial_state, Tensor(a!) o,
                      Tensor(b!)? final_state, Tensor(c!)? state_pool, *, float scale,
                      float? lower_bound, bool use_gate_in_kernel, bool use_qk_l2norm_in_kernel,
                      bool use_beta_sigmoid_in_kernel, str state_layout, bool bounded_decays,
                      str backend) -> ()

(tensors are positional, as torch.library requires; every option is keyword-only).

The outputs are caller-owned: ``o`` (``[B, T, HV, V]``, q's dtype), ``final_state`` (float32
or bfloat16 ``[N, HV, K, V]`` for ``state_layout="kv"``, ``[N, HV, V, K]`` for ``"vk"``, or
None) and ``state_pool`` (a state pool ``[S, HV, K, V]`` / ``[S, HV, V, K]`` whose rows
``state_indices[n] >= 0`` receive the final states in place, or None) are written in place, and
nothing else is. A pool that is only read (no final states) is passed as ``initial_state``.
``backend`` is ``"sm90"`` (the fused Hopper kernel) or ``"reference"`` (the fp32 PyTorch
recurrence, any device; CPU included, which is how the op is exercised without a GPU).

The op trusts its arguments: it is the layer below the validation. Calling it directly with
arguments that :func:`cula.kda.kda_prefill` would reject is unsupported; the compiled extension
still refuses anything that would make the kernel touch memory outside its tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cula import _ext

__all__ = ["OP_NAME", "kda_prefill_op", "call_kda_prefill"]

#: Qualified name of the op (``torch.ops.cula.kda_prefill``).
OP_NAME = "cula::kda_prefill"


def _run_sm90(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, state_indices: Tensor | None, has_initial_state: Tensor | None,
    o: Tensor, final_state: Tensor | None, state_pool: Tensor | None,
    scale: float, lower_bound: float | None, use_gate_in_kernel: bool,
    use_qk_l2norm_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, state_layout: str,
    bounded_decays: bool,
) -> None:
    """The fused kernel on the current stream of q's device (``bounded_decays`` False: its
    general-gate path, for log decays anywhere in [-inf, 0]).

    Every tensor goes to the binding as it is: the binding (``csrc/api/kda_prefill_binding.cpp``)
    reads the inputs in place where their layout allows it (column slices of a fused projection:
    features contiguous, 16-byte multiples for the other strides), copies once what it cannot
    read, and gives an output it cannot write in place (a non-dense ``o`` or ``final_state``) a
    dense buffer that it copies into the caller's after the launch. Those layout decisions cost
    nanoseconds there and microseconds of attribute reads here. The kernel applies the beta
    sigmoid itself, reads and writes fp32 or bf16 states, pool rows by index in place, and writes
    zeros into the rows of ``o`` past ``cu_seqlens[-1]``. The pool itself is validated by
    ``kda_prefill`` to have dense rows.
    """
    _ext.get_ext().kda_prefill_sm90(
        q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
        initial_state=initial_state, cu_seqlens=cu_seqlens, state_indices=state_indices,
        has_initial_state=has_initial_state, o=o, final_state=final_state, state_pool=state_pool,
        scale=scale, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, state_v_first=state_layout == "vk",
        general_gates=not bounded_decays,
    )


def _run_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, state_indices: Tensor | None, has_initial_state: Tensor | None,
    o: Tensor, final_state: Tensor | None, state_pool: Tensor | None,
    scale: float, lower_bound: float | None, use_gate_in_kernel: bool,
    use_qk_l2norm_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, state_layout: str,
    bounded_decays: bool,
) -> None:
    """The fp32 token-by-token recurrence (any device), written into the outputs.

    Inputs are made contiguous first, so strided inputs give bitwise the same result. With a
    state pool, the rows of the real slots are gathered (zeros for pad slots, indices outside
    ``[0, S)`` and ``has_initial_state`` False), the recurrence runs on the gathered states, and
    the final states are written back into the same pool rows in place (real slots only). The
    indices and cu_seqlens are read on the host, so this path syncs and cannot be captured in a
    CUDA graph: it is the specification, not a serving path.
    """
    from cula.kda.reference import kda_recurrent_reference

    def c(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.contiguous()

    pool = state_pool if state_pool is not None else (
        initial_state if state_indices is not None else None)
    h0 = initial_state
    real: list[int] = []
    rows: list[int] = []
    if pool is not None:
        assert state_indices is not None
        idx = [int(i) for i in state_indices.tolist()]
        S = pool.shape[0]
        real = [n for n, i in enumerate(idx) if 0 <= i < S]   # pad slots: i < 0 (or >= S)
        rows = [idx[n] for n in real]
        starts = [True] * len(idx) if has_initial_state is None else [
            bool(b) for b in has_initial_state.tolist()]
        read = [n for n in real if starts[n]]
        h0 = torch.zeros((len(idx),) + tuple(pool.shape[1:]), dtype=torch.float32, device=pool.device)
        if read:
            h0[read] = pool[[idx[n] for n in read]].to(torch.float32)
    if use_beta_sigmoid_in_kernel:
        # On the dense copy: torch's CPU sigmoid rounds differently on strided and contiguous
        # tensors (scalar vs vectorised exp), and the docstring's bitwise promise covers beta too.
        beta = torch.sigmoid(beta.contiguous().to(torch.float32))

    want_state = final_state is not None or state_pool is not None
    o_ref, s_ref = kda_recurrent_reference(
        c(q), c(k), c(v), c(g), c(beta),
        scale=scale, initial_state=c(h0), output_final_state=want_state,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=c(A_log), dt_bias=c(dt_bias),
        lower_bound=lower_bound, state_layout=state_layout, dtype=torch.float32,
    )
    o.copy_(o_ref)
    if final_state is not None:
        final_state.copy_(s_ref)
    if state_pool is not None and real:
        state_pool[rows] = s_ref[real].to(state_pool.dtype)   # in place, real slots only


_BACKENDS = {"sm90": _run_sm90, "reference": _run_reference}


@torch.library.custom_op(OP_NAME, mutates_args=("o", "final_state", "state_pool"))
def kda_prefill_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    state_indices: Tensor | None,
    has_initial_state: Tensor | None,
    o: Tensor,
    final_state: Tensor | None,
    state_pool: Tensor | None,
    *,
    scale: float,
    lower_bound: float | None,
    use_gate_in_kernel: bool,
    use_qk_l2norm_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    state_layout: str,
    bounded_decays: bool,
    backend: str,
) -> None:
    """KDA prefill forward into caller-owned outputs (validated arguments only).

    Shapes (B batch, T tokens, H q/k heads, HV value heads, K = V head dims, N sequences, S pool
    rows): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``;
    A_log ``[HV]`` and dt_bias ``[HV * K]`` (float32, gate in kernel only); cu_seqlens
    int32/int64 ``[N + 1]`` (B == 1); o ``[B, T, HV, V]`` in q's dtype. States (float32 or
    bfloat16) are ``[., HV, K, V]`` (``state_layout="kv"``) or ``[., HV, V, K]`` (``"vk"``):

    * without ``state_indices``: initial_state and final_state ``[N, ...]`` (either may be None);
    * with ``state_indices`` (int32/int64 ``[N]``, ``< 0`` = pad slot) the pool ``[S, ...]`` is
      ``state_pool`` when the final states are written back into it (mutated in place), else
      ``initial_state`` (read only); final_state is None. ``has_initial_state`` (bool ``[N]``,
      optional) marks the sequences that start from zeros (False) instead of their pool row.

    Writes o, final_state and the real rows of state_pool; returns nothing. ``scale`` is the
    resolved scale (no default here); ``lower_bound`` None selects the softplus gate;
    ``bounded_decays``: every log decay is known to lie in [-5, 0) (the sm90 kernel's safe-gate
    path; False selects its general-gate path); ``use_beta_sigmoid_in_kernel``: beta holds logits.
    """
    _BACKENDS[backend](
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, state_indices,
        has_initial_state, o, final_state, state_pool,
        scale, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel, state_layout, bounded_decays,
    )


_STATE_DTYPES = (torch.float32, torch.bfloat16)


@kda_prefill_op.register_fake
def _kda_prefill_fake(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, state_indices: Tensor | None, has_initial_state: Tensor | None,
    o: Tensor, final_state: Tensor | None, state_pool: Tensor | None, *,
    scale: float, lower_bound: float | None, use_gate_in_kernel: bool,
    use_qk_l2norm_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, state_layout: str,
    bounded_decays: bool, backend: str,
) -> None:
    """Shapes and dtypes only: the outputs are the caller's, so nothing is allocated. Checks that
    they are exactly what the op writes (``o``: v's shape in q's dtype; ``final_state``: float32
    or bfloat16 ``[N, HV, K, V]`` / ``[N, HV, V, K]``; ``state_pool``: ``[S, HV, K, V]`` /
    ``[S, HV, V, K]`` with ``state_indices``)."""
    torch._check(o.shape == v.shape and o.dtype == q.dtype,
                 lambda: f"{OP_NAME}: o must have v's shape {tuple(v.shape)} and q's dtype {q.dtype}")
    N = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    K, V, HV = q.shape[3], v.shape[3], v.shape[2]
    trailing = (HV, K, V) if state_layout == "kv" else (HV, V, K)
    if final_state is not None:
        want = (N,) + trailing
        torch._check(tuple(final_state.shape) == want and final_state.dtype in _STATE_DTYPES,
                     lambda: f"{OP_NAME}: final_state must be float32 or bfloat16 of shape {want}")
    if state_pool is not None:
        torch._check(state_indices is not None and final_state is None,
                     lambda: f"{OP_NAME}: state_pool needs state_indices and no final_state")
        torch._check(tuple(state_pool.shape[1:]) == trailing and state_pool.dtype in _STATE_DTYPES,
                     lambda: f"{OP_NAME}: state_pool must be float32 or bfloat16 [S, *{trailing}]")
    if state_indices is not None:
        torch._check(tuple(state_indices.shape) == (N,),
                     lambda: f"{OP_NAME}: state_indices must have shape ({N},)")
    return None


#: Tensor types the direct path takes as they are: plain tensors, and parameters (a model's
#: ``A_log`` and ``dt_bias``), which disable ``__torch_function__`` and so dispatch as plain
#: tensors do. Any other subclass may override the op's dispatch: it goes through the op.
_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def _only_device_contexts() -> bool:
    """True when every active torch-function mode is a ``DeviceContext``
    (``torch.set_default_device`` or ``with torch.device(...)``). Such a mode only fills in the device of factory calls that
    name none; the implementations name one in every call, so it changes nothing in them."""
    from torch.utils._device import DeviceContext

    return all(type(torch._C._get_function_stack_at(i)) is DeviceContext
               for i in range(torch._C._len_torch_function_stack()))


# The checks below run on every eager call, before its launch: bound once here, since each
# attribute lookup through ``torch._C`` costs about as much as the call itself (the five checks
# 0.46 -> 0.30 us per call on the CI machine's CPU). ``torch.compiler.is_compiling`` is the same
# function object, which the compiler recognises and folds while tracing.
_is_compiling = torch.compiler.is_compiling
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_is_jit_tracing = torch._C._is_tracing
_functorch_active = torch._C._are_functorch_transforms_active
_function_mode_enabled = torch._C._is_torch_function_mode_enabled


def _outside_tracers_and_modes(*, allow_device_contexts: bool) -> bool:
    """No compiler tracing, no dispatch mode (fake tensors, functionalisation, export), no
    ``torch.jit.trace``, no functorch transform (vmap, grad: their wrapped tensors look plain from
    Python) and no torch-function mode (but, with ``allow_device_contexts``, the default-device
    one). What :func:`_plain_eager` and the eager fast path (:func:`cula.kda.kda_prefill`) ask
    beyond the tensors."""
    return not (_is_compiling() or _dispatch_stack_len() > 0 or _is_jit_tracing() or _functorch_active()
                or (_function_mode_enabled() and not (allow_device_contexts and _only_device_contexts())))


def _plain_eager(tensors: tuple[Tensor | None, ...]) -> bool:
    """True when nothing observes the call but the caller: no compiler tracing, no dispatch mode
    (fake tensors, functionalisation, export), no ``torch.jit.trace``, no functorch transform
    (vmap, grad: their wrapped tensors look plain from Python), no torch-function mode but the
    default-device one, only plain tensors (or parameters), and no input that autograd would
    want to see. Then calling the implementation directly is what the op's dispatch would end
    up doing, without its ~20 us of Python dispatch layers (autograd, ADInplaceOrView, the
    backend wrapper) per call. Anything else takes the op, which every tracer records as one
    node."""
    if not _outside_tracers_and_modes(allow_device_contexts=True):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TYPES or (grad and t.requires_grad)):
            return False
    return True


def call_kda_prefill(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, state_indices: Tensor | None, has_initial_state: Tensor | None,
    o: Tensor, final_state: Tensor | None, state_pool: Tensor | None, *,
    scale: float, lower_bound: float | None, use_gate_in_kernel: bool,
    use_qk_l2norm_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, state_layout: str,
    bounded_decays: bool, backend: str,
    seen_outputs: tuple[Tensor | None, ...] | None = None,
) -> None:
    """``torch.ops.cula.kda_prefill`` with the same arguments, or, in plain eager mode
    (:func:`_plain_eager`), its implementation called directly. Either way the same function runs
    on the same tensors, and the mutated outputs get their version counters bumped as the op's
    dispatch does; under ``torch.compile``, export, fake tensors, dispatch or torch-function
    modes, ``torch.jit.trace``, functorch transforms or autograd the op is always the path.

    ``seen_outputs``: on the direct path, the outputs whose version counters are bumped (default
    ``(o, final_state, state_pool)``). :func:`cula.kda.kda_prefill` passes only the caller's
    buffers: a tensor it has just allocated has no other reference, so no one can observe its
    counter (and each bump costs ~1 us of Python)."""
    args = (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, state_indices,
            has_initial_state, o, final_state, state_pool)
    if not _plain_eager(args):
        torch.ops.cula.kda_prefill(
            *args, scale=scale, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, state_layout=state_layout,
            bounded_decays=bounded_decays, backend=backend)
        return
    _BACKENDS[backend](*args, scale, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel,
                       use_beta_sigmoid_in_kernel, state_layout, bounded_decays)
    for t in (o, final_state, state_pool) if seen_outputs is None else seen_outputs:
        if t is not None and not t.is_inference():
            torch.autograd.graph.increment_version(t)
