#!/usr/bin/env python3
"""Where the fused kernel's error comes from: its bf16 rounding points, emulated on the CPU.

The SM90 kernel computes the chunked form (``docs/math.md``) with fp32 accumulation and bf16
operands. This script runs the same chunked algorithm in fp32 PyTorch and rounds to bf16 exactly
where the kernel does (``csrc/kda/sm90/intra_chunk_math.cuh``, ``state_math.cuh``), each rounding
point behind a name, and measures the relative L2 error of o and of the final state against the
fp64 recurrence (``cula.kda.reference.kda_recurrent_reference``):

* ``all``: every rounding point on (the kernel's numerics, up to the tf32 inverse and the order
  of fp32 sums, which are not emulated);
* ``all but X``: every point except X, for each X: how much of the error X is responsible for;
* ``only X``: X alone.

Rounding points (bf16 unless said):

  qe, ke       the prep's rescaled operands QE = q e, KE = k e
  kt_a, kt_s   KT = k f as the B operand of the A products / of the state update
  bv           beta v, rounded in place in the v slot (the B operand of U)
  frag         the A products' rescaled register fragments (a second rounding of QE / KE)
  aqk          A_qk stored for the state warpgroups (its diagonal stays fp32)
  m            the inverse M = (I + A)^-1 as the A operand of W and U
  qg, kg       QG = QE exp2(r_b), KG = beta KE exp2(r_b) (rounded again from QE / KE)
  w, u         W = M KG and U = M (beta v), stored as bf16
  y            (--fold) Y = beta v - KG S as the bf16 B operand of (M - I) Y
  s            the state S as the bf16 B operand of W S and QG S
  vnew_o       v_new = U - W S as the bf16 operand of A_qk v_new (and of the fp32 diagonal term)
  vnew_s       v_new as the bf16 operand of the state update
  o            the output

Inputs: the benchmark's draws (q, k, v ~ N(0, 1) rounded to bf16, l2norm in the kernel, raw gate
~ N(0, 1) with lower_bound = -5, A_log = log U(1, 16), dt_bias ~ 0.5 N(0, 1), beta = sigmoid of
bf16 logits ~ N(0, 1)), B = 1, several heads, no initial state. Usage:

    python scripts/error_budget.py [--T 2048] [--heads 4] [--seed 0] [--without bv,vnew_o ...]
                                   [--fp16 aqk,vnew_o ...]

``--fold``: the fused kernels since 03500f6 fold M into the state chain, v_new = Y + (M - I) Y with
Y = beta v - KG S in fp32 (so no w, u, bv rounding; y and m instead): an extra run of that
configuration (with ``--fp16`` groups: also with them).

``--fp16 X,Y``: an extra run of the kernel's configuration with the points X, Y rounded to fp16
instead of bf16 (3 more mantissa bits; e.g. ``aqk,vnew_o``: A_qk and v_new in fp16 for the product
A_qk v_new, where l2-normalised q, k bound |A_qk| by 1).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

try:
    import cula  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cula.kda.reference import kda_gate, kda_recurrent_reference  # noqa: E402

POINTS = ("qe", "ke", "kt_a", "kt_s", "bv", "frag", "aqk", "m", "qg", "kg", "w", "u", "y", "s", "vnew_o", "vnew_s", "o")
C, SB = 64, 16  # chunk, sub-block
LN2 = math.log(2.0)


FP16: set[str] = set()  # points rounded to fp16 instead of bf16 (--fp16)


def bf(x: torch.Tensor, name: str, on: frozenset[str]) -> torch.Tensor:
    if name not in on:
        return x
    return x.to(torch.float16 if name in FP16 else torch.bfloat16).to(x.dtype)


def chunked(q, k, v, g_ln, beta, scale: float, on: frozenset[str],
            beta_in_m: bool = False, packed_rescale: bool = False,
            fold: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, all heads: q, k [T, HV, K] (l2-normalised, fp32 values of the bf16 inputs),
    v [T, HV, V], g_ln natural-log decays [T, HV, K] (fp32), beta [T, HV]. Returns o [T, HV, V]
    and the final state [HV, K, V], rounded at the points in ``on``. ``beta_in_m``: the variant
    U = (M diag(beta)) v, beta folded into the columns of the A operand (rounded with M) instead
    of into v (no "bv" rounding). ``fold``: M folded into the state chain (state_math.cuh (c)),
    v_new = Y + (M - I) Y, Y = beta v - KG S in fp32 (the "y" point its bf16 operand copy)."""
    T, HV, K = q.shape
    V = v.shape[2]
    f32 = torch.float32
    S = torch.zeros(HV, K, V, dtype=f32)
    o = torch.zeros(T, HV, V, dtype=f32)
    idx = torch.arange(C)
    strict = idx[:, None] > idx[None, :]
    for c0 in range(0, T, C):
        n = min(C, T - c0)
        pad = C - n

        def take(x):
            x = x[c0:c0 + n].transpose(0, 1)  # [HV, n, ...]
            return F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))

        qc, kc, vc, gc, bc = take(q), take(k), take(v), take(g_ln), take(beta)
        G = torch.cumsum(gc / LN2, dim=1)                            # [HV, C, K] log2
        r = G[:, SB - 1::SB, :]                                      # [HV, 4, K] block ends
        r_rows = r.repeat_interleave(SB, dim=1)
        e, f = torch.exp2(G - r_rows), torch.exp2(r_rows - G)
        QE, KE = bf(qc * e, "qe", on), bf(kc * e, "ke", on)
        KT = bf(kc * f, "kt_a", on)
        KT_s = bf(kc * f, "kt_s", on)
        bv = bf(bc[..., None] * vc, "bv", on)                       # beta v, rounded in place (bf16)
        # A products: fragments of row block w, rescaled by exp2(r_w - r_bj) for bj < w
        A_qk = torch.zeros(HV, C, C, dtype=f32)
        A_kk = torch.zeros(HV, C, C, dtype=f32)
        for w in range(4):
            rows = slice(SB * w, SB * w + SB)
            for bj in range(w + 1):
                cols = slice(SB * bj, SB * bj + SB)
                s_fac = torch.exp2(r[:, w] - r[:, bj])[:, None, :]  # [HV, 1, K]
                if packed_rescale:
                    s_fac = s_fac.to(torch.bfloat16).to(f32)
                qa = bf(QE[:, rows] * s_fac, "frag", on) if bj < w else QE[:, rows]
                ka = bf(KE[:, rows] * s_fac, "frag", on) if bj < w else KE[:, rows]
                A_qk[:, rows, cols] = qa @ KT[:, cols].transpose(1, 2)
                A_kk[:, rows, cols] = ka @ KT[:, cols].transpose(1, 2)
        diag = (qc * kc).sum(-1)                                    # A_qk[i, i] exactly, fp32
        A_qk = bf(A_qk * strict, "aqk", on)
        A = A_kk * strict * bc[..., None]
        Mf = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.double()).to(f32)
        M = bf(Mf, "m", on)
        QG = bf(QE * torch.exp2(r_rows), "qg", on)
        KG = bf(bc[..., None] * KE * torch.exp2(r_rows), "kg", on)
        if beta_in_m:
            # the unit diagonal stays out of the bf16 operand: U = ((M - I) diag(beta)) v + beta v,
            # the second term in fp32 (v is exact in bf16)
            eye = torch.eye(C, dtype=f32)
            U = bf(bf((Mf - eye) * bc[:, None, :], "m", on) @ vc + bc[..., None] * vc, "u", on)
        else:
            U = bf(M @ bv, "u", on)
        W = bf(M @ KG, "w", on)
        Sb = bf(S, "s", on)
        if fold:
            Y = bc[..., None] * vc - KG @ Sb
            eye = torch.eye(C, dtype=f32)
            v_new_f = Y + bf(Mf - eye, "m", on) @ bf(Y, "y", on)
        else:
            v_new_f = U - W @ Sb
        v_new = bf(v_new_f, "vnew_o", on)
        O = QG @ Sb + A_qk @ v_new + diag[..., None] * v_new
        v_new = bf(v_new_f, "vnew_s", on)
        o[c0:c0 + n] = bf(scale * O, "o", on)[:, :n].transpose(0, 1)
        # state update in Horner form over the four blocks (fp32 S, bf16 operands)
        X = S * torch.exp2(r[:, 0])[..., None]
        for b in range(4):
            rows = slice(SB * b, SB * b + SB)
            if b > 0:
                X = X * torch.exp2(r[:, b] - r[:, b - 1])[..., None]
            X = X + KT_s[:, rows].transpose(1, 2) @ v_new[:, rows]
        S = X
    return o, S


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--without", nargs="*", default=[],
                    help="extra runs without a group of points each, e.g. bv,vnew_o")
    ap.add_argument("--fold", action="store_true",
                    help="also the fused kernels' configuration with M folded into the state chain")
    ap.add_argument("--fp16", nargs="*", default=[],
                    help="extra runs of the kernel's configuration with a group of points in fp16 each, e.g. aqk,vnew_o")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    T, HV, D = args.T, args.heads, 128
    bf16 = torch.bfloat16
    q = torch.randn(1, T, HV, D).to(bf16)
    k = torch.randn(1, T, HV, D).to(bf16)
    v = torch.randn(1, T, HV, D).to(bf16)
    g = torch.randn(1, T, HV, D).to(bf16)
    A_log = torch.empty(HV).uniform_(1.0, 16.0).log()
    dt_bias = 0.5 * torch.randn(HV * D)
    beta = torch.sigmoid(torch.randn(1, T, HV).to(bf16).float())
    scale = D ** -0.5

    ref_o, ref_s = kda_recurrent_reference(
        q, k, v, g, beta, scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, dtype=torch.float64)
    # the kernel's inputs: l2-normalised q, k (fp32, from the bf16 values), fp32 gates
    qn = F.normalize(q[0].float(), dim=-1, eps=1e-6)
    kn = F.normalize(k[0].float(), dim=-1, eps=1e-6)
    g_ln = kda_gate(g[0], A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, dtype=torch.float32)

    def run(on: frozenset[str], beta_in_m: bool = False, packed: bool = False,
            fold: bool = False) -> tuple[float, float]:
        o, s = chunked(qn, kn, v[0].float(), g_ln, beta[0], scale, on, beta_in_m, packed, fold)
        return rel(o, ref_o[0]), rel(s, ref_s[0])

    print(f"error_budget: T={T}, HV={HV}, D={D}, seed={args.seed}; relative L2 vs the fp64 recurrence (o / state)")
    none = run(frozenset())
    allp = run(frozenset(POINTS))
    print(f"  {'no rounding (fp32 chunked form)':34s} {none[0]:.2e} / {none[1]:.2e}")
    print(f"  {'all rounding points':34s} {allp[0]:.2e} / {allp[1]:.2e}")
    for p in POINTS:
        wo = run(frozenset(POINTS) - {p})
        only = run(frozenset({p}))
        print(f"  all but {p:8s} {wo[0]:.2e} / {wo[1]:.2e}      only {p:8s} {only[0]:.2e} / {only[1]:.2e}")
    alt = run(frozenset(POINTS), beta_in_m=True)
    print(f"  {'all, U = bf16((M-I) beta) v + beta v':34s} {alt[0]:.2e} / {alt[1]:.2e}")
    pk = run(frozenset(POINTS), packed=True)
    print(f"  {'all, A rescale as packed bf16x2':34s} {pk[0]:.2e} / {pk[1]:.2e}")
    for group in args.without:
        drop = frozenset(group.split(","))
        res = run(frozenset(POINTS) - drop)
        print(f"  all but {group:24s} {res[0]:.2e} / {res[1]:.2e}")
    if args.fp16:  # the kernel's configuration: U's diagonal in fp32, packed rescale
        kern = run(frozenset(POINTS), beta_in_m=True, packed=True)
        print(f"  {'kernel (both of the above)':34s} {kern[0]:.2e} / {kern[1]:.2e}")
    for group in args.fp16:
        FP16.clear()
        FP16.update(group.split(","))
        res = run(frozenset(POINTS), beta_in_m=True, packed=True)
        FP16.clear()
        print(f"  kernel, fp16 at {group:17s} {res[0]:.2e} / {res[1]:.2e}")
    if args.fold:  # the fused kernels: M folded, packed rescale (w, u, bv are not formed)
        fold_on = frozenset(POINTS) - {"w", "u", "bv"}
        res = run(fold_on, packed=True, fold=True)
        print(f"  {'fused, M folded':34s} {res[0]:.2e} / {res[1]:.2e}")
        for group in args.fp16:
            FP16.clear()
            FP16.update(group.split(","))
            res = run(fold_on, packed=True, fold=True)
            FP16.clear()
            print(f"  fused, M folded, fp16 at {group:8s} {res[0]:.2e} / {res[1]:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
