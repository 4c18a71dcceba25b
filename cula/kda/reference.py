"""Pure-PyTorch references for the KDA (Kimi Delta Attention) prefill forward.

Two functions compute the same thing (docs/math.md sections 1 and 2):

* :func:`kda_recurrent_reference` is the **specification**: the token-by-token gated delta rule.
* :func:`kda_chunked_reference` is the **chunked form** evaluated the way the fused SM90 kernel
  evaluates it (64-token chunks, 16-token sub-blocks, log2 gates, a blocked inverse, the Horner
  state update). It is written to be read as documentation of the kernel.

Both run on any device (CPU included), in a chosen compute dtype (float32 or float64), and accept
the full feature set of the fused kernel: GVA (``HV = G * H`` value heads sharing ``H`` q/k heads),
varlen batches (``cu_seqlens``, empty and length-1 sequences included), an initial state and the
final state in either layout (``"kv"``: ``[K, V]`` per head, ``"vk"``: ``[V, K]``), the gate
activation in the kernel (softplus form and lower-bound form) and the q/k L2 norm in the kernel.

Conventions shared by every function here
-----------------------------------------
Shapes (B batch, T tokens, H q/k heads, HV value heads, K key dim, V value dim, N sequences)::

    q, k           [B, T, H, K]
    v              [B, T, HV, V]
    g              [B, T, HV, K]     natural-log decays (<= 0), or raw gates with use_gate_in_kernel
    beta           [B, T, HV]        used as given (already in post-sigmoid space)
    A_log          [HV]              (use_gate_in_kernel only)
    dt_bias        [HV * K]          (use_gate_in_kernel only, optional)
    initial_state  [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk")
    o              [B, T, HV, V]
    final_state    [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk")

Without ``cu_seqlens``, ``N == B`` and every batch row is one sequence of length T. With
``cu_seqlens`` (``[N + 1]``, int32 or int64, ``B == 1``, normally ``cu_seqlens[0] == 0``,
non-decreasing, ``cu_seqlens[-1] <= T``), sequence ``n`` is tokens
``cu_seqlens[n] : cu_seqlens[n + 1]``; tokens past ``cu_seqlens[-1]`` (a padded bucket) belong to
no sequence and get ``o = 0``. The values are not validated here (``kda_prefill`` does that):
every sequence is clamped to ``[0, T]`` exactly as the fused kernel does
(:func:`sequence_ranges`), a negative length is an empty sequence.

Every input is converted to the compute dtype (``dtype``, float32 by default) first; l2norm and
the gate activation are then evaluated in that dtype, and **o and final_state are returned in the
compute dtype** (callers cast o back to their activation dtype themselves).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "kda_gate",
    "l2norm",
    "kda_recurrent_reference",
    "kda_chunked_reference",
    "kda_segmented_reference",
    "sequence_ranges",
]

StateLayout = Literal["kv", "vk"]

#: 1 / ln(2): natural-log gates times this are log2 gates (the kernel uses exp2 everywhere).
RCP_LN2 = 1.0 / math.log(2.0)

#: Rows per sub-block of a chunk. The kernel's tensor-core tiles are 16 rows tall, and with
#: decays >= -5 per token the sub-block factors stay inside the fp32/bf16 exponent range.
SUB_BLOCK = 16


# ------------------------------------------------------------------------------------------------
# Elementwise pieces: gate activation and l2norm
# ------------------------------------------------------------------------------------------------


def kda_gate(
    g: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The in-kernel gate activation (docs/math.md section 1, ``use_gate_in_kernel=True``).

    Turns raw gates into natural-log per-key decays, per value head ``hv``::

        lower_bound is None:            -exp(A_log[hv]) * softplus(g + dt_bias[hv, :])
        lower_bound set, A_log given:   lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias[hv, :]))
        lower_bound set, A_log None:    lower_bound * sigmoid(g + dt_bias[hv, :])

    (the same three forms as FLA's ``naive_kda_gate`` / ``naive_kda_lowerbound_gate``). dt_bias
    is optional in every form (treated as 0). Only the lower-bound forms bound the decays (to
    ``[lower_bound, 0)``); softplus uses torch's ``F.softplus`` (threshold 20, as FLA's kernel).

    Args:
        g: raw gates ``[..., HV, K]`` (normally ``[B, T, HV, K]``), any float dtype.
        A_log: ``[HV]``; required when ``lower_bound`` is None.
        dt_bias: ``[HV * K]`` (any shape with ``HV * K`` elements), optional.
        lower_bound: selects the lower-bound form; FLA recommends ``-5.0``.
        dtype: compute and output dtype (float32 default, float64 for high-precision tests).

    Returns:
        natural-log decays, shape of ``g``, in ``dtype``.
    """
    if g.dim() < 2:
        raise ValueError(f"kda_gate: g must have shape [..., HV, K], got {tuple(g.shape)}")
    HV, K = g.shape[-2:]
    x = g.to(dtype)
    if dt_bias is not None:
        if dt_bias.numel() != HV * K:
            raise ValueError(
                f"kda_gate: dt_bias must have HV*K = {HV * K} elements, got shape {tuple(dt_bias.shape)}"
            )
        x = x + dt_bias.to(device=x.device, dtype=dtype).reshape(HV, K)
    a = None
    if A_log is not None:
        if A_log.numel() != HV:
            raise ValueError(f"kda_gate: A_log must have HV = {HV} elements, got shape {tuple(A_log.shape)}")
        a = A_log.to(device=x.device, dtype=dtype).reshape(HV, 1).exp()  # exp(A_log[hv]), [HV, 1]
    if lower_bound is None:
        if a is None:
            raise ValueError("kda_gate: A_log is required for the softplus form (lower_bound=None)")
        return -a * F.softplus(x)
    if a is not None:
        x = a * x
    return float(lower_bound) * torch.sigmoid(x)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """L2-normalise over the last dim exactly as FLA's ``l2norm``: ``x / sqrt(sum(x^2) + eps)``.

    Note that eps is added to the *squared* norm (inside the square root), not to the norm.
    Computed in ``x``'s dtype.

    Args:
        x: ``[..., D]``.
        eps: added to ``sum(x^2)``; FLA's default ``1e-6``.

    Returns:
        ``[..., D]`` in ``x.dtype``.
    """
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ------------------------------------------------------------------------------------------------
# Shared input handling
# ------------------------------------------------------------------------------------------------


def sequence_ranges(cu_seqlens: Tensor, T: int) -> list[tuple[int, int]]:
    """Token range ``[begin, end)`` of every sequence of ``cu_seqlens``, clamped like the kernel.

    The fused kernel's ``seq_range`` (``csrc/kda/sm90/tile_scheduler.cuh``), in Python: sequence
    ``n`` is ``begin = clamp(cu[n], 0, T)``, ``end = clamp(cu[n + 1], begin, T)``. Valid
    ``cu_seqlens`` (0 = cu[0] <= cu[1] <= ... <= cu[N] <= T) are returned unchanged; any other
    values stay inside ``[0, T]`` and a negative length is an empty sequence. Tokens covered by no
    sequence (``cu[N] < T``: a padded bucket) are outputs of zero and touch no state. Ranges of
    invalid ``cu_seqlens`` may overlap; an ``o`` row written by two sequences is then undefined
    (the states are still each sequence's own).
    """
    cu = [int(c) for c in cu_seqlens.reshape(-1).tolist()]
    out = []
    for a, b in zip(cu, cu[1:]):
        begin = min(max(a, 0), T)
        out.append((begin, min(max(b, begin), T)))
    return out


class _Prepared:
    """Inputs flattened to tokens, converted to the compute dtype, with q/k expanded to HV heads.

    Attributes:
        q, k:   ``[B*T, HV, K]`` (l2-normalised if requested; q NOT scaled)
        v:      ``[B*T, HV, V]``
        g:      ``[B*T, HV, K]`` natural-log decays (gate activation applied if requested)
        beta:   ``[B*T, HV]``
        bos, lens: python lists, start token (in the flattened axis) and length of each sequence
        S0:     ``[N, HV, K, V]`` initial states in "kv" layout (zeros if none given)
    """

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        initial_state: Tensor | None,
        cu_seqlens: Tensor | None,
        use_qk_l2norm_in_kernel: bool,
        use_gate_in_kernel: bool,
        A_log: Tensor | None,
        dt_bias: Tensor | None,
        lower_bound: float | None,
        state_layout: str,
        dtype: torch.dtype,
        name: str,
    ) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"{name}: dtype must be a floating dtype, got {dtype}")
        if state_layout not in ("kv", "vk"):
            raise ValueError(f"{name}: state_layout must be 'kv' or 'vk', got {state_layout!r}")
        if q.dim() != 4 or k.shape != q.shape:
            raise ValueError(
                f"{name}: q and k must both have shape [B, T, H, K], got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        B, T, H, K = q.shape
        if v.dim() != 4 or v.shape[:2] != (B, T):
            raise ValueError(f"{name}: v must have shape [B={B}, T={T}, HV, V], got {tuple(v.shape)}")
        HV, V = v.shape[2], v.shape[3]
        if HV % H != 0:
            raise ValueError(f"{name}: HV={HV} value heads must be a multiple of H={H} q/k heads")
        if tuple(g.shape) != (B, T, HV, K):
            raise ValueError(f"{name}: g must have shape [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}")
        if tuple(beta.shape) != (B, T, HV):
            raise ValueError(f"{name}: beta must have shape [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}")

        # Sequences: (start in the flattened token axis, length).
        if cu_seqlens is None:
            bos = [b * T for b in range(B)]
            lens = [T] * B
        else:
            if B != 1:
                raise ValueError(f"{name}: with cu_seqlens the batch size must be 1, got B={B}")
            ranges = sequence_ranges(cu_seqlens, T)
            if not ranges:
                raise ValueError(f"{name}: cu_seqlens must have N + 1 >= 2 entries, got {cu_seqlens.numel()}")
            bos = [b for b, _ in ranges]
            lens = [e - b for b, e in ranges]
        N = len(lens)

        dev = q.device
        if initial_state is not None:
            want = (N, HV, K, V) if state_layout == "kv" else (N, HV, V, K)
            if tuple(initial_state.shape) != want:
                raise ValueError(
                    f"{name}: initial_state must have shape {list(want)} for state_layout="
                    f"{state_layout!r}, got {list(initial_state.shape)}"
                )
            S0 = initial_state.to(device=dev, dtype=dtype)
            if state_layout == "vk":
                S0 = S0.transpose(-1, -2)
            S0 = S0.contiguous()
        else:
            S0 = torch.zeros(N, HV, K, V, device=dev, dtype=dtype)

        q_, k_ = q.to(dtype), k.to(dtype)
        if use_qk_l2norm_in_kernel:
            q_, k_ = l2norm(q_), l2norm(k_)
        if use_gate_in_kernel:
            g_ = kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, dtype=dtype)
        else:
            g_ = g.to(dtype)

        # GVA: value head hv reads q/k head hv // (HV // H).
        group = HV // H
        q_ = q_.repeat_interleave(group, dim=2)
        k_ = k_.repeat_interleave(group, dim=2)

        self.q = q_.reshape(B * T, HV, K)
        self.k = k_.reshape(B * T, HV, K)
        self.v = v.to(dtype).reshape(B * T, HV, V)
        self.g = g_.reshape(B * T, HV, K)
        self.beta = beta.to(dtype).reshape(B * T, HV)
        self.bos, self.lens = bos, lens
        self.S0 = S0
        self.shape = (B, T, H, HV, K, V, N)
        self.dtype = dtype
        self.device = dev

    def sequence_order(self) -> list[int]:
        """Sequence indices sorted longest first: at any step, the still-running ones are a prefix."""
        return sorted(range(len(self.lens)), key=lambda n: -self.lens[n])


def _finish_state(S: Tensor, state_layout: str) -> Tensor:
    """``[N, HV, K, V]`` ("kv") state to the requested layout."""
    return S if state_layout == "kv" else S.transpose(-1, -2).contiguous()


def _resolve_scale(scale: float | None, K: int) -> float:
    return K ** -0.5 if scale is None else float(scale)


# ------------------------------------------------------------------------------------------------
# The specification: token-by-token recurrence (docs/math.md section 1)
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def kda_recurrent_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    state_layout: StateLayout = "kv",
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor | None]:
    """KDA forward by the token-by-token recurrence: the specification (docs/math.md section 1).

    Per sequence and value head, with state ``S`` ``[K, V]`` starting at ``initial_state[n]``
    (zeros if None), for each token ``t``::

        S   <- diag(exp(g_t)) S                         # per-key-row decay
        S   <- S + beta_t * k_t (v_t - S^T k_t)^T       # delta rule
        o_t  = scale * S^T q_t                          # read

    with q/k of value head ``hv`` taken from q/k head ``hv // (HV // H)`` (GVA).

    Shapes: see the module docstring (q, k ``[B,T,H,K]``; v ``[B,T,HV,V]``; g ``[B,T,HV,K]``;
    beta ``[B,T,HV]``; initial/final state ``[N,HV,K,V]`` ("kv") or ``[N,HV,V,K]`` ("vk")).

    Args:
        q, k, v, g, beta: the inputs (g: natural-log decays, or raw gates with use_gate_in_kernel).
        scale: output scale, default ``K ** -0.5``.
        initial_state: optional initial states in ``state_layout``.
        output_final_state: return the final states (else None).
        cu_seqlens: ``[N+1]`` varlen boundaries (B must be 1).
        use_qk_l2norm_in_kernel: L2-normalise q and k over K (:func:`l2norm`, eps 1e-6).
        use_gate_in_kernel: g is raw; decays come from :func:`kda_gate` with A_log, dt_bias, lower_bound.
        A_log, dt_bias, lower_bound: gate parameters (see :func:`kda_gate`).
        state_layout: ``"kv"`` or ``"vk"`` for both initial_state and final_state.
        dtype: compute dtype (float32 or float64).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` and final_state ``[N, HV, K|V, V|K]`` (or None),
        both in ``dtype``. Empty sequences give ``final_state[n] == initial_state[n]``.

    Cost: one step of batched small ops per token position; all sequences (and heads) advance
    together, longest first, so varlen batches take ``max(lens)`` steps.
    """
    P = _Prepared(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                  use_gate_in_kernel, A_log, dt_bias, lower_bound, state_layout, dtype,
                  "kda_recurrent_reference")
    B, T, H, HV, K, V, N = P.shape
    scale = _resolve_scale(scale, K)

    order = P.sequence_order()
    lens = [P.lens[n] for n in order]
    bos = torch.tensor([P.bos[n] for n in order], device=P.device, dtype=torch.long)
    S = P.S0[torch.tensor(order, device=P.device, dtype=torch.long)].clone()  # sorted, "kv"
    o = torch.zeros(B * T, HV, V, device=P.device, dtype=dtype)

    n_active = len(lens)
    for t in range(lens[0] if lens else 0):
        while n_active > 0 and lens[n_active - 1] <= t:
            n_active -= 1
        idx = bos[:n_active] + t                       # token t of every still-running sequence
        q_t, k_t, v_t = P.q[idx], P.k[idx], P.v[idx]   # [n, HV, K], [n, HV, K], [n, HV, V]
        g_t, b_t = P.g[idx], P.beta[idx]               # [n, HV, K], [n, HV]

        S_t = S[:n_active] * g_t.exp().unsqueeze(-1)                     # decay rows
        pred = torch.einsum("nhk,nhkv->nhv", k_t, S_t)                   # S^T k
        S_t = S_t + (b_t.unsqueeze(-1) * k_t).unsqueeze(-1) * (v_t - pred).unsqueeze(-2)
        o[idx] = scale * torch.einsum("nhk,nhkv->nhv", q_t, S_t)
        if n_active == S.shape[0]:
            S = S_t
        else:
            S[:n_active] = S_t

    final_state = None
    if output_final_state:
        final_state = torch.empty_like(S)
        final_state[torch.tensor(order, device=P.device, dtype=torch.long)] = S  # unsort
        final_state = _finish_state(final_state, state_layout)
    return o.reshape(B, T, HV, V), final_state


# ------------------------------------------------------------------------------------------------
# The kernel's form: chunked evaluation (docs/math.md section 2)
# ------------------------------------------------------------------------------------------------


def _unit_lower_inverse(A: Tensor) -> Tensor:
    """``(I + A)^-1`` for strictly lower triangular ``A`` ``[..., n, n]`` by forward substitution.

    Row ``i`` of ``X = (I + A)^-1`` is ``e_i - sum_{j<i} A[i, j] X[j]`` (X is unit lower
    triangular too). This is what the kernel does for each 16x16 diagonal block.
    """
    n = A.shape[-1]
    X = torch.zeros_like(A)
    eye = torch.eye(n, dtype=A.dtype, device=A.device)
    for i in range(n):
        X[..., i, :] = eye[i] - torch.einsum("...j,...jc->...c", A[..., i, :i], X[..., :i, :])
    return X


def _blocked_unit_lower_inverse(A: Tensor, nb: int) -> Tensor:
    """``(I + A)^-1`` for strictly lower ``A`` ``[..., C, C]``, C = nb * 16, the kernel's way.

    1. invert the nb diagonal 16x16 blocks (``_unit_lower_inverse``);
    2. for block row bi = 1..nb-1, with ``M[:bi, :bi]`` (the top-left inverse) already known::

           M[bi, <bi] = -M[bi, bi] @ (A[bi, <bi] @ M[<bi, <bi])

       (from block row bi of ``(I + A) M = I``).
    """
    s = SUB_BLOCK
    M = torch.zeros_like(A)
    for b in range(nb):
        blk = slice(b * s, (b + 1) * s)
        M[..., blk, blk] = _unit_lower_inverse(A[..., blk, blk])
    for bi in range(1, nb):
        row = slice(bi * s, (bi + 1) * s)
        left = slice(0, bi * s)
        M[..., row, left] = -M[..., row, row] @ (A[..., row, left] @ M[..., left, left])
    return M


#: general_gates: log2 decays are floored here: exp2(-200) underflows to 0 in float32, so a -inf
#: channel still resets completely, while cumulative sums and their differences stay finite.
GATE_FLOOR_LOG2 = 200.0
#: general_gates: a diagonal sub-block factors through its end for the features whose span over the
#: sub-block is at most this (e <= 2^100 keeps q*e*k*f and the sums far inside float32 / bf16).
DIAG_SPAN_MAX_LOG2 = 100.0


def _general_gate_scores(qc: Tensor, kc: Tensor, G: Tensor, r: Tensor, KT: Tensor,
                         s: int) -> tuple[Tensor, Tensor]:
    """Unmasked A_qk and A_kk of one chunk ``[n, HV, C, C]`` for any decays, every factor <= 1
    or bounded by 2^DIAG_SPAN_MAX_LOG2 (see :func:`kda_chunked_reference`, ``general_gates``).

    qc, kc, G: ``[n, HV, C, K]`` (G the cumulative log2 decay from the chunk start, floored);
    r: ``[n, HV, nb, K]`` (G at each sub-block's last row); KT = k * exp2(r_b(j) - G_j).
    """
    n, HV, C, K = qc.shape
    nb = C // s
    A_qk = qc.new_zeros(n, HV, C, C)
    A_kk = qc.new_zeros(n, HV, C, C)
    tri = torch.tril(torch.ones(s, s, dtype=torch.bool, device=qc.device))        # j <= i in a block
    for bi in range(nb):
        ri = slice(bi * s, (bi + 1) * s)
        r_start = r[:, :, bi - 1] if bi > 0 else torch.zeros_like(r[:, :, 0])    # [n, HV, K]
        # row side against the start of the row's sub-block: G_i <= r_start, so <= 1
        lead = torch.exp2(G[:, :, ri] - r_start.unsqueeze(-2))                     # [n, HV, 16, K]
        Qs, Ks = qc[:, :, ri] * lead, kc[:, :, ri] * lead
        for bj in range(bi):
            rj = slice(bj * s, (bj + 1) * s)
            between = torch.exp2(r_start - r[:, :, bj]).unsqueeze(-2)             # <= 1 (bj <= bi - 1)
            KT_j = (KT[:, :, rj] * between).transpose(-1, -2)
            A_qk[:, :, ri, rj] = Qs @ KT_j
            A_kk[:, :, ri, rj] = Ks @ KT_j
        # diagonal sub-block: factor through the block end where the span allows, exact elsewhere
        span = r_start - r[:, :, bi]                                               # [n, HV, K], >= 0
        narrow = (span <= DIAG_SPAN_MAX_LOG2).unsqueeze(-2)                        # [n, HV, 1, K]
        e = torch.exp2(torch.where(narrow, G[:, :, ri] - r[:, :, bi].unsqueeze(-2), 0.0))   # <= 2^span
        zero = torch.zeros((), dtype=qc.dtype, device=qc.device)
        KT_d = torch.where(narrow, KT[:, :, ri], zero).transpose(-1, -2)
        A_qk[:, :, ri, ri] = torch.where(narrow, qc[:, :, ri] * e, zero) @ KT_d
        A_kk[:, :, ri, ri] = torch.where(narrow, kc[:, :, ri] * e, zero) @ KT_d
        wide = ~narrow
        if bool(wide.any()):
            Gb = G[:, :, ri]                                                       # [n, HV, 16, K]
            diff = Gb.unsqueeze(-2) - Gb.unsqueeze(-3)                             # [.., i, j, K]: G_i - G_j
            m = tri.unsqueeze(-1) & wide.unsqueeze(-2)                             # j <= i, wide features
            d = torch.where(m, torch.exp2(torch.where(m, diff, 0.0)), zero)        # exponent <= 0 where kept
            kj = kc[:, :, ri].unsqueeze(-3)                                        # [.., 1, j, K]
            A_qk[:, :, ri, ri] += (qc[:, :, ri].unsqueeze(-2) * kj * d).sum(-1)
            A_kk[:, :, ri, ri] += (kc[:, :, ri].unsqueeze(-2) * kj * d).sum(-1)
    return A_qk, A_kk


@torch.no_grad()
def kda_chunked_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    state_layout: StateLayout = "kv",
    dtype: torch.dtype = torch.float32,
    chunk_size: int = 64,
    general_gates: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """KDA forward in the chunked form the fused SM90 kernel evaluates (docs/math.md section 2).

    Same arguments, shapes and return values as :func:`kda_recurrent_reference` (o and
    final_state in the compute ``dtype``), plus ``chunk_size`` (a multiple of 16; the kernel
    uses 64). In exact arithmetic it equals the recurrence.

    What one chunk does, per (sequence, value head); C = chunk_size, nb = C / 16 sub-blocks, S
    the ``[K, V]`` state entering the chunk:

    1. **Mask.** Rows past the sequence's end (the last chunk of a sequence, or a chunk loaded
       across a varlen boundary) get ``g = k = q = beta = v = 0``: they neither decay nor write.
    2. **Gates in log2 units.** ``G = cumsum(g / ln 2)`` over the chunk's rows ``[C, K]``;
       ``r_b = G`` at the last row of sub-block b (``r_{nb-1} = G_last``, the chunk's total decay).
       Per element, with ``b(i)`` the sub-block of row i::

           f_i = exp2(r_{b(i)} - G_i)   (<= 1)       e_i = exp2(G_i - r_{b(i)})   (>= 1)
           QE = q * e,   KE = k * e,   KT = k * f

    3. **Intra-chunk scores** (tensor-core products, no state involved), for sub-block pairs
       ``bj <= bi``::

           A_qk[bi, bj] = QE_bi diag(exp2(r_bi - r_bj)) KT_bj^T        masked to j <= i
           A_kk[bi, bj] = beta * (KE_bi diag(exp2(r_bi - r_bj)) KT_bj^T)  masked to j < i

       Element-wise that is ``sum_k q_i k_j exp2(G_i - G_j)``: the factor ``exp2(G_i - G_j)``
       is split through the sub-block boundaries so every factor stays in range when decays are
       >= -5 per token (``e <= exp(75)``, ``f >= exp(-75)``: inside fp32/bf16).
    4. **WY form.** ``M = (I + A_kk)^-1`` (blocked inverse, :func:`_blocked_unit_lower_inverse`),
       ``w = M (beta * k * exp2(G))``, ``u = M (beta * v)``.
    5. **State part** (the serial chain)::

           v_new = u - w S
           o     = scale * ((q * exp2(G)) S + A_qk v_new)
           S     = diag(exp2(G_last)) S + (k * exp2(G_last - G))^T v_new

       where the state update is evaluated sub-block by sub-block in Horner form, using the
       ``KT`` tiles already computed::

           X = diag(exp2(r_0)) S;             X += KT_0^T v_new_0
           X = diag(exp2(r_1 - r_0)) X;       X += KT_1^T v_new_1
           ...                                (ends with r_{nb-1} = G_last)

    Numerics: the sub-block factor ``e`` is unbounded for unbounded decays (softplus gates), so
    like the SM90 kernel this form assumes **safe gates** (decays >= -5 per token, e.g.
    ``lower_bound=-5``) when run in float32; float64 tolerates much larger decays.

    ``general_gates=True`` is the form for any decays <= 0 (``-inf`` included), the design the
    kernel's ``safe_gate=False`` path is to follow (docs/perf-notes.md): log2 decays are floored
    at ``-GATE_FLOOR_LOG2`` (``exp2`` of it is 0 in float32, so a ``-inf`` channel still resets,
    and differences of cumulative sums stay finite); blocks below the diagonal take the row side
    against the *start* of its sub-block, ``q * exp2(G_i - r_{bi-1})`` (<= 1), the middle factor
    ``exp2(r_{bi-1} - r_bj)`` (<= 1) and ``KT`` (<= 1); diagonal sub-blocks factor through the
    sub-block end only for the features whose span over the sub-block is at most
    ``DIAG_SPAN_MAX_LOG2`` (``e <= 2^span``) and evaluate the others element by element,
    ``sum_k q_ik k_jk exp2(G_ik - G_jk)`` for ``j <= i`` (exponent <= 0). Nothing overflows.

    All sequences advance together chunk by chunk (longest first), vectorised over sequences
    and value heads.
    """
    if chunk_size <= 0 or chunk_size % SUB_BLOCK != 0:
        raise ValueError(f"kda_chunked_reference: chunk_size must be a positive multiple of 16, got {chunk_size}")
    P = _Prepared(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                  use_gate_in_kernel, A_log, dt_bias, lower_bound, state_layout, dtype,
                  "kda_chunked_reference")
    B, T, H, HV, K, V, N = P.shape
    scale = _resolve_scale(scale, K)
    C, s = chunk_size, SUB_BLOCK
    nb = C // s
    dev = P.device

    order = P.sequence_order()
    lens = [P.lens[n] for n in order]
    order_t = torch.tensor(order, device=dev, dtype=torch.long)
    bos = torch.tensor([P.bos[n] for n in order], device=dev, dtype=torch.long)
    lens_t = torch.tensor(lens, device=dev, dtype=torch.long)
    S = P.S0[order_t].clone()                                  # [N, HV, K, V], sorted, "kv"
    o = torch.zeros(B * T, HV, V, device=dev, dtype=dtype)

    rows = torch.arange(C, device=dev)
    causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev))          # j <= i
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev), -1)      # j <  i
    n_chunks = [(L + C - 1) // C for L in lens]

    n_active = len(lens)
    for c in range(n_chunks[0] if lens else 0):
        while n_active > 0 and n_chunks[n_active - 1] <= c:
            n_active -= 1
        n = n_active

        # ---- 1. load the chunk (rows c*C .. c*C+C-1 of every running sequence), mask the tail ----
        offs = c * C + rows                                            # [C]
        valid = offs.unsqueeze(0) < lens_t[:n].unsqueeze(1)            # [n, C]
        pos = (bos[:n].unsqueeze(1) + offs).clamp(max=B * T - 1)       # [n, C] token indices

        def load(x: Tensor) -> Tensor:
            # [B*T, HV, ...] -> [n, HV, C, ...], rows past the sequence end set to 0
            y = x[pos]                                                 # [n, C, HV, ...]
            m = valid.reshape(n, C, *([1] * (y.dim() - 2)))
            y = torch.where(m, y, torch.zeros((), dtype=y.dtype, device=dev))
            return y.transpose(1, 2)

        qc, kc, vc, gc = load(P.q), load(P.k), load(P.v), load(P.g)   # [n, HV, C, K|V]
        bc = load(P.beta)                                              # [n, HV, C]

        # ---- 2. log2 gates, cumsum, sub-block references, the e/f factors ----
        g2 = gc * RCP_LN2
        if general_gates:
            g2 = g2.clamp(min=-GATE_FLOOR_LOG2)                        # -inf -> a finite floor
        G = torch.cumsum(g2, dim=2)                                    # [n, HV, C, K], <= 0
        r = G[:, :, s - 1::s, :]                                       # [n, HV, nb, K]: r_b
        r_rows = r.repeat_interleave(s, dim=2)                         # r_{b(i)} per row
        f = torch.exp2(r_rows - G)                                     # <= 1
        KT = kc * f

        # ---- 3. A_qk, A_kk by sub-block pairs bj <= bi ----
        if general_gates:
            A_qk, A_kk = _general_gate_scores(qc, kc, G, r, KT, s)
        else:
            e = torch.exp2(G - r_rows)                                 # >= 1
            QE, KE = qc * e, kc * e
            A_qk = torch.zeros(n, HV, C, C, device=dev, dtype=dtype)
            A_kk = torch.zeros(n, HV, C, C, device=dev, dtype=dtype)
            for bi in range(nb):
                ri = slice(bi * s, (bi + 1) * s)
                for bj in range(bi + 1):
                    rj = slice(bj * s, (bj + 1) * s)
                    # decay across the boundary between the sub-blocks: exp2(r_bi - r_bj) <= 1 (1 if bi == bj)
                    between = torch.exp2(r[:, :, bi] - r[:, :, bj]).unsqueeze(-2)    # [n, HV, 1, K]
                    KT_j = (KT[:, :, rj] * between).transpose(-1, -2)                # [n, HV, K, 16]
                    A_qk[:, :, ri, rj] = QE[:, :, ri] @ KT_j
                    A_kk[:, :, ri, rj] = KE[:, :, ri] @ KT_j
        # causal masks (where, not multiply: the unused upper part of a diagonal block may be large)
        A_qk = torch.where(causal, A_qk, torch.zeros((), dtype=dtype, device=dev))
        A_kk = torch.where(strict, A_kk, torch.zeros((), dtype=dtype, device=dev)) * bc.unsqueeze(-1)

        # ---- 4. WY form: M = (I + A_kk)^-1, w, u ----
        M = _blocked_unit_lower_inverse(A_kk, nb)                      # [n, HV, C, C]
        w = M @ (bc.unsqueeze(-1) * kc * torch.exp2(G))                # [n, HV, C, K]
        u = M @ (bc.unsqueeze(-1) * vc)                                # [n, HV, C, V]

        # ---- 5. state part: v_new, o, Horner state update ----
        S_c = S[:n]                                                    # [n, HV, K, V]
        v_new = u - w @ S_c                                            # [n, HV, C, V]
        o_c = scale * ((qc * torch.exp2(G)) @ S_c + A_qk @ v_new)      # [n, HV, C, V]

        X = torch.exp2(r[:, :, 0]).unsqueeze(-1) * S_c
        X = X + KT[:, :, 0:s].transpose(-1, -2) @ v_new[:, :, 0:s]
        for b in range(1, nb):
            rb = slice(b * s, (b + 1) * s)
            X = torch.exp2(r[:, :, b] - r[:, :, b - 1]).unsqueeze(-1) * X
            X = X + KT[:, :, rb].transpose(-1, -2) @ v_new[:, :, rb]
        if n == S.shape[0]:
            S = X
        else:
            S[:n] = X

        # ---- store the valid rows of o ----
        o_rows = o_c.transpose(1, 2)                                   # [n, C, HV, V]
        o[pos[valid]] = o_rows[valid]

    final_state = None
    if output_final_state:
        final_state = torch.empty_like(S)
        final_state[order_t] = S
        final_state = _finish_state(final_state, state_layout)
    return o.reshape(B, T, HV, V), final_state


# ------------------------------------------------------------------------------------------------
# Segments of T: the affine form of the recurrence (the design for few, very long sequences)
# ------------------------------------------------------------------------------------------------


def kda_segmented_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    state_layout: StateLayout = "kv",
    dtype: torch.dtype = torch.float32,
    segment_len: int = 4096,
) -> tuple[Tensor, Tensor | None]:
    """KDA forward with every sequence cut into segments of ``segment_len`` tokens (a multiple of
    the 64-token chunk) that are processed independently, then stitched: the form a kernel would
    use to run one long sequence on many SMs at once (``docs/perf-notes.md``, few tiles).

    Same arguments and results as :func:`kda_recurrent_reference`. The idea, per (sequence, value
    head), with the state ``S`` as ``[K, V]``: a chunk maps its entering state to its leaving state
    affinely, ``S' = (D - KT'^T W) S + KT'^T U`` (``D`` the chunk's decay, ``KT' = k exp2(G_last -
    G)``, ``W``/``U`` the chunk's WY factors: ``docs/math.md``), so a segment of chunks does too::

        S_out = P S_in + Q,   P = [K, K],   Q = [K, V]

    1. every segment in parallel: ``Q`` = the segment's final state from ``S_in = 0`` (the true
       ``v``), and ``P`` = its final state from ``S_in = I_K`` with ``v = 0`` (the same
       recurrence with K value columns: twice the state work, no new kernel);
    2. a short sequential fix-up over segments: ``S_in(s + 1) = P_s S_in(s) + Q_s`` (one K x K by
       K x V product per segment), from the sequence's initial state;
    3. every segment in parallel again from its true ``S_in``: the outputs (the last segment's
       final state is the sequence's).

    Each segment is evaluated here by :func:`kda_chunked_reference` (the kernel's chunked form).
    Sequences shorter than one segment are one segment. The fix-up runs in ``dtype``.
    """
    if segment_len <= 0 or segment_len % 64 != 0:
        raise ValueError(f"kda_segmented_reference: segment_len must be a positive multiple of 64, got {segment_len}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    ranges = ([(b * T, (b + 1) * T) for b in range(B)] if cu_seqlens is None
              else sequence_ranges(cu_seqlens, T))
    N = len(ranges)
    flat = {name: x.reshape(B * T, *x.shape[2:]).unsqueeze(0) for name, x in
            dict(q=q, k=k, v=v, g=g, beta=beta).items()}
    common = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                  A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, state_layout="kv", dtype=dtype)
    scale = _resolve_scale(scale, K)

    def to_kv(s: Tensor) -> Tensor:  # [.., HV, K, V] from the caller's layout
        return s if state_layout == "kv" else s.transpose(-1, -2)

    o = torch.zeros(B * T, HV, V, dtype=dtype, device=dev)
    finals = []
    eye = torch.eye(K, dtype=dtype, device=dev).expand(1, HV, K, K).contiguous()
    for n, (begin, end) in enumerate(ranges):
        S = (to_kv(initial_state[n]).to(dtype) if initial_state is not None
             else torch.zeros(HV, K, V, dtype=dtype, device=dev))
        bounds = list(range(begin, end, segment_len)) + [end]
        segs = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        # 1. per segment: Q (from zero, true v) and P (from the identity, v = 0)
        PQ = []
        for a, b in segs:
            x = {name: t[:, a:b] for name, t in flat.items()}
            _, Q = kda_chunked_reference(**x, scale=scale, output_final_state=True, **common)
            _, P = kda_chunked_reference(x["q"], x["k"], torch.zeros_like(x["v"][..., :1]).expand(
                *x["v"].shape[:-1], K), x["g"], x["beta"], scale=scale, initial_state=eye,
                output_final_state=True, **common)
            PQ.append((P[0], Q[0]))
        # 2. fix-up over segments (P acts on the K rows of S)
        starts = []
        for P, Q in PQ:
            starts.append(S)
            S = P @ S + Q                                              # [HV, K, K] @ [HV, K, V]
        # 3. per segment again, from its true initial state: the outputs
        for (a, b), S0 in zip(segs, starts):
            x = {name: t[:, a:b] for name, t in flat.items()}
            o_seg, _ = kda_chunked_reference(**x, scale=scale, initial_state=S0.unsqueeze(0), **common)
            o[a:b] = o_seg[0]
        finals.append(S)
    final_state = None
    if output_final_state:
        final_state = torch.stack(finals) if finals else torch.zeros(0, HV, K, V, dtype=dtype, device=dev)
        final_state = _finish_state(final_state, state_layout)
    return o.reshape(B, T, HV, V), final_state
