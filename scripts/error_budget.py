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

``--draw softplus``: Kimi-Linear's softplus gate as the tests and the benchmark draw it (A_log ~
N(0, 1) per head, or the heads' values from ``--alog``; g ~ 2 N(0, 1); dt_bias ~ 0.1 N(0, 1)), on
the general kernels' configuration (M folded, fp16 A_qk v_new, fp16 A-product operands) and on
the same with bf16 A-product operands (the safe-gate kernels' types; the rounding points left out
one at a time are measured from that one). Its decays overflow the safe
factorisation's exponent range, which the kernel handles with the general-gate path (wide pairs,
exact diagonal-block terms; ``docs/kernel.md``); this emulation models the rounding points'
*precision* only: it computes in fp64 and rounds mantissas to 8 (bf16) or 11 (fp16) bits with an
unbounded exponent, with the per-token decays clamped at -60 (log2) for the reference and the
emulation alike (so every block's factors fit fp64). It prints the error per head, and per
rounding point left out, e.g.

    python scripts/error_budget.py --draw softplus --T 566 --alog=-3,-2.3,-1.6,-0.7 \
        --fp16 qe,ke,kt_a,frag qe,ke,kt_a,frag,kt_s,vnew_s
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import NamedTuple

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


UNBOUNDED = False  # --draw softplus: round mantissas only (8 / 11 bits), any exponent


def bf(x: torch.Tensor, name: str, on: frozenset[str]) -> torch.Tensor:
    if name not in on:
        return x
    if UNBOUNDED:
        bits = 11 if name in FP16 else 8
        m, e = torch.frexp(x)
        return torch.ldexp(torch.round(m * 2.0**bits) / 2.0**bits, e.to(x.dtype))
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
    f32 = q.dtype  # float32; float64 for --draw softplus
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


class SoftplusDraw(NamedTuple):
    """One --draw softplus problem: the emulation's fp64 inputs and the fp64 recurrence's outputs."""
    A_log: torch.Tensor
    g_ln: torch.Tensor  # natural-log decays [T, HV, K], clamped at -60 log2 per token
    qn: torch.Tensor
    kn: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    scale: float
    ref_o: torch.Tensor
    ref_s: torch.Tensor


def softplus_draw(T: int, HV: int, A_log: torch.Tensor | None = None, seed: int = 0) -> SoftplusDraw:
    """The tests' and the benchmark's softplus draw (A_log ~ N(0, 1) unless given, g ~ 2 N(0, 1),
    dt_bias ~ 0.1 N(0, 1)), one sequence, D = 128."""
    torch.manual_seed(seed)
    D = 128
    bf16, f64 = torch.bfloat16, torch.float64
    q = torch.randn(1, T, HV, D).to(bf16)
    k = torch.randn(1, T, HV, D).to(bf16)
    v = torch.randn(1, T, HV, D).to(bf16)
    beta = torch.sigmoid(torch.randn(1, T, HV).to(bf16).double())
    g = (2 * torch.randn(1, T, HV, D)).to(bf16)
    A_log = torch.randn(HV) if A_log is None else A_log
    dt_bias = 0.1 * torch.randn(HV * D)
    scale = D ** -0.5
    g_ln = kda_gate(g[0], A_log=A_log, dt_bias=dt_bias, lower_bound=None, dtype=f64).clamp(min=-60 * LN2)
    ref_o, ref_s = kda_recurrent_reference(
        q, k, v, g_ln[None], beta.float(), scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=False, dtype=f64)
    return SoftplusDraw(A_log, g_ln, F.normalize(q[0].double(), dim=-1, eps=1e-6),
                        F.normalize(k[0].double(), dim=-1, eps=1e-6), v[0].double(), beta[0], scale,
                        ref_o[0], ref_s[0])


#: The fused kernels' rounding points (M folded: W, U and beta v are never formed) and the points
#: they round to fp16 (l2norm kernels: A_qk and v_new for their product).
FUSED_POINTS = frozenset(POINTS) - {"w", "u", "bv"}
FUSED_FP16 = frozenset({"aqk", "vnew_o"})
#: The general-gate kernels with l2norm (safe_gate=False, e.g. the softplus gate) also take the A
#: products' operands in fp16 (docs/kernel.md, "Numerics"). Their wide blocks' diagonal terms go
#: through bf16 staging instead, which this mantissa-only emulation does not separate.
GENERAL_FP16 = FUSED_FP16 | {"qe", "ke", "kt_a", "frag"}


def softplus_errors(d: SoftplusDraw, on: frozenset[str] = FUSED_POINTS,
                    fp16: frozenset[str] = FUSED_FP16) -> tuple[list[float], list[float], float, float]:
    """Mantissa-only rounding (any exponent) at the points ``on``, fp16 at ``fp16``: per-head
    relative L2 errors of o and of the final state, then the errors over all heads."""
    global UNBOUNDED
    UNBOUNDED = True
    FP16.clear()
    FP16.update(fp16)
    try:
        o, st = chunked(d.qn, d.kn, d.v, d.g_ln, d.beta, d.scale, on, fold=True)
    finally:
        FP16.clear()
        UNBOUNDED = False
    HV = o.shape[1]
    return ([rel(o[:, h], d.ref_o[:, h]) for h in range(HV)], [rel(st[h], d.ref_s[h]) for h in range(HV)],
            rel(o, d.ref_o), rel(st, d.ref_s))


def softplus_report(args: argparse.Namespace) -> int:
    """--draw softplus: the fused kernels' configuration per head, and per rounding point left out."""
    A_log = None if args.alog is None else torch.tensor([float(a) for a in args.alog.split(",")])
    if A_log is not None and A_log.numel() != args.heads:
        raise SystemExit(f"--alog needs {args.heads} values (--heads), got {A_log.numel()}")
    d = softplus_draw(args.T, args.heads, A_log, args.seed)
    print(f"error_budget --draw softplus: T={args.T}, HV={args.heads}, D=128, seed={args.seed}; relative L2 vs "
          "the fp64 recurrence (o / state), mantissa rounding, decays clamped at -60 log2")
    print("  exp(A_log) per head:  " + "  ".join(f"{float(a):.3f}" for a in d.A_log.exp()))
    print("  mean log decay/token: " + "  ".join(f"{float(x):.3f}" for x in d.g_ln.mean(dim=(0, 2))))

    def show(label: str, res: tuple[list[float], list[float], float, float], per_head: bool) -> None:
        if per_head:
            print("  per head o:      " + "  ".join(f"{x:.2e}" for x in res[0]))
            print("  per head state:  " + "  ".join(f"{x:.2e}" for x in res[1]))
        print(f"  {label:44s} {res[2]:.2e} / {res[3]:.2e}")

    show("general kernels (fp16 A products, A_qk v_new)", softplus_errors(d, fp16=GENERAL_FP16), True)
    show("bf16 A products (the safe-gate kernels' types)", softplus_errors(d), True)
    for p in sorted(FUSED_POINTS):
        show(f"all but {p}", softplus_errors(d, on=FUSED_POINTS - {p}), False)
    for group in args.fp16:
        show(f"fp16 also at {group}", softplus_errors(d, fp16=FUSED_FP16 | frozenset(group.split(","))), True)
    return 0


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
    ap.add_argument("--draw", choices=("safe", "softplus"), default="safe",
                    help="the gate draw: lower_bound = -5 (default) or the softplus gate (see above)")
    ap.add_argument("--alog", default=None,
                    help="--draw softplus: A_log per head, comma-separated (default: N(0, 1) draws)")
    args = ap.parse_args()
    if args.draw == "softplus":
        return softplus_report(args)
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
        fold_on = FUSED_POINTS
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
