"""The torch custom op ``cula::kda_prefill`` that :func:`cula.kda.kda_prefill` calls.

:func:`cula.kda.kda_prefill` validates every argument on the host (one rule per argument, in
:mod:`cula.kda.prefill`), picks the backend, allocates the outputs and then calls this op. The op
is what ``torch.compile`` sees: an opaque node with a named schema, declared mutations and a fake
(meta) implementation, so a compiled function that calls ``kda_prefill`` traces into a single
graph (no graph break) and a CUDA graph can capture it::

    cula::kda_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log,
                      Tensor? dt_bias, Tensor? initial_state, Tensor? cu_seqlens, Tensor(a!) o,
                      Tensor(b!)? final_state, *, float scale, float? lower_bound,
                      bool use_gate_in_kernel, bool use_qk_l2norm_in_kernel, str state_layout,
                      str backend) -> ()

(tensors are positional, as torch.library requires; every option is keyword-only).

The outputs are caller-owned: ``o`` (``[B, T, HV, V]``, q's dtype) and ``final_state``
(float32 ``[N, HV, K, V]`` for ``state_layout="kv"``, ``[N, HV, V, K]`` for ``"vk"``, or None)
are written in place, and nothing else is. ``backend`` is ``"sm90"`` (the fused Hopper kernel)
or ``"reference"`` (the fp32 PyTorch recurrence, any device; CPU included, which is how the op is
exercised without a GPU).

The op trusts its arguments: it is the layer below the validation. Calling it directly with
arguments that :func:`cula.kda.kda_prefill` would reject is unsupported; the compiled extension
still refuses anything that would make the kernel touch memory outside its tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cula import _ext

__all__ = ["OP_NAME", "kda_prefill_op"]

#: Qualified name of the op (``torch.ops.cula.kda_prefill``).
OP_NAME = "cula::kda_prefill"

_ALIGN = 16  # bytes: TMA and the kernel's vector loads/stores need 16-byte aligned addresses


def _is_dense(t: Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % _ALIGN == 0


def _dense(t: Tensor) -> Tensor:
    """``t`` as a contiguous tensor whose data starts on a 16-byte boundary.

    The fused kernel reads with TMA and vector loads, which need aligned addresses; a contiguous
    view with an element offset (e.g. ``x[1:]``) is copied rather than read misaligned. Ordinary
    tensors (contiguous, from the caching allocator) are returned as they are.
    """
    t = t.contiguous()
    if t.data_ptr() % _ALIGN != 0:
        t = t.clone()
    return t


def _dense_opt(t: Tensor | None) -> Tensor | None:
    return None if t is None else _dense(t)


def _run_sm90(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, o: Tensor, final_state: Tensor | None,
    scale: float, lower_bound: float | None, use_gate_in_kernel: bool,
    use_qk_l2norm_in_kernel: bool, state_layout: str,
) -> None:
    """The fused kernel on the current stream of q's device; inputs made dense first."""
    # Outputs the kernel cannot write directly (strided or misaligned: possible only when the op
    # is called with such buffers) are produced in a dense buffer and copied in.
    o_k = o if _is_dense(o) else torch.empty(o.shape, dtype=o.dtype, device=o.device)
    fs_k = final_state
    if final_state is not None and not _is_dense(final_state):
        fs_k = torch.empty(final_state.shape, dtype=final_state.dtype, device=final_state.device)
    _ext.get_ext().kda_prefill_sm90(
        q=_dense(q), k=_dense(k), v=_dense(v), g=_dense(g), beta=_dense(beta),
        A_log=_dense_opt(A_log), dt_bias=_dense_opt(dt_bias),
        initial_state=_dense_opt(initial_state), cu_seqlens=_dense_opt(cu_seqlens),
        o=o_k, final_state=fs_k,
        scale=scale, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_layout == "vk",
    )
    if o_k is not o:
        o.copy_(o_k)
    if fs_k is not final_state:
        final_state.copy_(fs_k)


def _run_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, o: Tensor, final_state: Tensor | None,
    scale: float, lower_bound: float | None, use_gate_in_kernel: bool,
    use_qk_l2norm_in_kernel: bool, state_layout: str,
) -> None:
    """The fp32 token-by-token recurrence (any device), written into the outputs.

    Inputs are made contiguous first, so strided inputs give bitwise the same result.
    """
    from cula.kda.reference import kda_recurrent_reference

    def c(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.contiguous()

    o_ref, s_ref = kda_recurrent_reference(
        c(q), c(k), c(v), c(g), c(beta),
        scale=scale, initial_state=c(initial_state), output_final_state=final_state is not None,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=c(A_log), dt_bias=c(dt_bias),
        lower_bound=lower_bound, state_layout=state_layout, dtype=torch.float32,
    )
    o.copy_(o_ref)
    if final_state is not None:
        final_state.copy_(s_ref)


_BACKENDS = {"sm90": _run_sm90, "reference": _run_reference}


@torch.library.custom_op(OP_NAME, mutates_args=("o", "final_state"))
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
    o: Tensor,
    final_state: Tensor | None,
    *,
    scale: float,
    lower_bound: float | None,
    use_gate_in_kernel: bool,
    use_qk_l2norm_in_kernel: bool,
    state_layout: str,
    backend: str,
) -> None:
    """KDA prefill forward into caller-owned outputs (validated arguments only).

    Shapes (B batch, T tokens, H q/k heads, HV value heads, K = V head dims, N sequences):
    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``;
    A_log ``[HV]`` and dt_bias ``[HV * K]`` (float32, gate in kernel only); initial_state and
    final_state float32 ``[N, HV, K, V]`` (``state_layout="kv"``) or ``[N, HV, V, K]`` (``"vk"``);
    cu_seqlens int32/int64 ``[N + 1]`` (B == 1); o ``[B, T, HV, V]`` in q's dtype.

    Writes o and (when given) final_state; returns nothing. ``scale`` is the resolved scale (no
    default here); ``lower_bound`` None selects the softplus gate (reference backend only).
    """
    _BACKENDS[backend](
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, o, final_state,
        scale, lower_bound, use_gate_in_kernel, use_qk_l2norm_in_kernel, state_layout,
    )


@kda_prefill_op.register_fake
def _kda_prefill_fake(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, o: Tensor, final_state: Tensor | None, *,
    scale: float, lower_bound: float | None, use_gate_in_kernel: bool,
    use_qk_l2norm_in_kernel: bool, state_layout: str, backend: str,
) -> None:
    """Shapes and dtypes only: the outputs are the caller's, so nothing is allocated. Checks that
    they are exactly what the op writes (``o``: v's shape in q's dtype; ``final_state``: float32
    ``[N, HV, K, V]`` or ``[N, HV, V, K]``)."""
    torch._check(o.shape == v.shape and o.dtype == q.dtype,
                 lambda: f"{OP_NAME}: o must have v's shape {tuple(v.shape)} and q's dtype {q.dtype}")
    if final_state is not None:
        N = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        K, V = q.shape[3], v.shape[3]
        want = (N, v.shape[2], K, V) if state_layout == "kv" else (N, v.shape[2], V, K)
        torch._check(tuple(final_state.shape) == want and final_state.dtype == torch.float32,
                     lambda: f"{OP_NAME}: final_state must be float32 of shape {want}")
    return None
