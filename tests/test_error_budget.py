"""The CPU emulation of the kernel's bf16 rounding points (scripts/error_budget.py): without
rounding it is the exact chunked form; with every point it lands where the GPU kernel measures
(3.5e-3 / 2.9e-3 relative L2 for o / state, docs/perf-notes.md), and the beta-v variant of U
removes the largest share; fp16 A_qk and v_new in their product lower o's error further, and
folding M into the state chain (the fused kernels since 03500f6: U never rounded) further still."""

from __future__ import annotations

import importlib.util
import pathlib

import torch
import torch.nn.functional as F

from cula.kda.reference import kda_gate, kda_recurrent_reference

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "error_budget.py"
_spec = importlib.util.spec_from_file_location("error_budget", _PATH)
error_budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(error_budget)


def test_emulation_matches_the_recurrence_and_the_kernels_error(seed: int) -> None:
    T, HV, D = 512, 2, 128
    bf16 = torch.bfloat16
    q, k, v, g = (torch.randn(1, T, HV, D).to(bf16) for _ in range(4))
    A_log = torch.empty(HV).uniform_(1.0, 16.0).log()
    dt_bias = 0.5 * torch.randn(HV * D)
    beta = torch.sigmoid(torch.randn(1, T, HV).to(bf16).float())
    ref_o, ref_s = kda_recurrent_reference(q, k, v, g, beta, scale=D ** -0.5, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                           A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                                           dtype=torch.float64)
    qn = F.normalize(q[0].float(), dim=-1, eps=1e-6)
    kn = F.normalize(k[0].float(), dim=-1, eps=1e-6)
    g_ln = kda_gate(g[0], A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, dtype=torch.float32)

    def errors(on, beta_in_m=False, fold=False):
        o, s = error_budget.chunked(qn, kn, v[0].float(), g_ln, beta[0], D ** -0.5, frozenset(on), beta_in_m,
                                    fold=fold)
        return error_budget.rel(o, ref_o[0]), error_budget.rel(s, ref_s[0])

    exact = errors(())
    assert exact[0] < 1e-5 and exact[1] < 1e-5, exact
    full = errors(error_budget.POINTS)
    assert 2.5e-3 < full[0] < 4.5e-3 and 2.0e-3 < full[1] < 4.0e-3, full
    beta_u = errors(error_budget.POINTS, beta_in_m=True)
    assert beta_u[0] < full[0] and beta_u[1] < full[1], (beta_u, full)
    # A_qk and v_new in fp16 for their product (the fused kernels with l2norm): o's error drops,
    # the state's is untouched (that product does not feed it). o x0.90-0.97 over 31 seeds (one at
    # 0.974 failed the bound of 0.97 that this assertion had): a margin under 1 that holds.
    error_budget.FP16.update({"aqk", "vnew_o"})
    try:
        half = errors(error_budget.POINTS, beta_in_m=True)
    finally:
        error_budget.FP16.clear()
    assert half[0] < 0.99 * beta_u[0] and half[1] == beta_u[1], (half, beta_u)
    # M folded into the state chain, v_new = Y + (M - I) Y with Y = beta v - KG S in fp32: U's
    # rounding is gone, so with the fp16 product o's error drops again (emulated T = 2048:
    # 2.87-2.89e-3 -> 2.35-2.39e-3; measured on H100 2.85-2.89e-3 -> 2.3-2.4e-3; T = 512, 40 seeds:
    # o x0.77-0.84) and the state's gets no worse (x0.94-1.01 seen).
    fold_points = set(error_budget.POINTS) - {"w", "u", "bv"}
    error_budget.FP16.update({"aqk", "vnew_o"})
    try:
        folded = errors(fold_points, fold=True)
    finally:
        error_budget.FP16.clear()
    assert folded[0] < 0.92 * half[0] and folded[1] < 1.1 * half[1], (folded, half)


def test_softplus_draw_error_follows_the_slowest_head() -> None:
    """Issue 15's draw (softplus gate): o's error is set by heads with slow decays, where the
    off-diagonal A_qk terms (bf16 operands QE, KT) carry the output, not the fp32 diagonal; it is
    the A products' operand precision, not the general-gate path: fp16 operands there (the general
    kernels' since 765706d) take the slow head's o error from ~3.1e-3 to ~2.0e-3, and an fp16 state update the state's from
    ~2.4e-3 to under 1e-3 (emulated with mantissa rounding; docs/perf-notes.md)."""
    d = error_budget.softplus_draw(T=256, HV=2, A_log=torch.tensor([-3.0, 1.5]), seed=0)
    o_head, s_head, o_all, s_all = error_budget.softplus_errors(d)
    slow, fast = o_head
    assert 2.8e-3 < slow < 3.6e-3 and fast < 2.3e-3 and slow > 1.4 * fast, o_head
    assert 2.0e-3 < s_all < 3.0e-3, s_all
    operands = error_budget.GENERAL_FP16  # the general kernels with l2norm since 765706d
    assert operands == error_budget.FUSED_FP16 | {"qe", "ke", "kt_a", "frag"}
    o16, _, o16_all, s16_all = error_budget.softplus_errors(d, fp16=operands)
    assert o16[0] < 0.75 * slow and o16_all < 0.75 * o_all and abs(s16_all - s_all) < 0.05 * s_all, (o16, o16_all)
    _, _, _, s16_state = error_budget.softplus_errors(d, fp16=operands | {"kt_s", "vnew_s"})
    assert s16_state < 1e-3, s16_state
    # the emulation is exact without rounding points
    _, _, o0, s0 = error_budget.softplus_errors(d, on=frozenset())
    assert o0 < 1e-6 and s0 < 1e-6, (o0, s0)
