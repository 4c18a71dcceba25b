"""The exact pass of the sm90 kernel's general-gate path, checked on the CPU.

``csrc/kda/sm90/intra_chunk_math.cuh`` (``wide_diagonal_terms``) computes the diagonal-block terms
``q_i k_j exp2(G_i - G_j)`` and ``k_i k_j exp2(G_i - G_j)`` (``j < i`` inside a 16-row block) of
the features whose decay over the block overflows the factorised exponentials. It halves the
block recursively (levels of 8, 4, 2, 1 rows) and factors each pair through the boundary row of
the level that splits it, with running products of the per-token decays, one 16x8 product per
level: rows 0-7 of its A operand are KX of the level's upper rows, rows 8-15 their QX, and B is
KX of the lower rows. This module ports that bookkeeping line by line (the staging rows, the
running products and their restarts, the lane -> (i, j) mapping of the accumulator) and checks
it against the elementwise sums: every pair covered once, the values exact, nothing infinite for
any decays. Keep it in step with the kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

ROWS = 16  # kSubBlock
GATE_FLOOR_LOG2 = -200.0  # kGateFloorLog2


def kernel_levels(q: np.ndarray, k: np.ndarray, G: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A_qk, A_kk terms (16 x 16, strictly lower) as the kernel forms them, and how often each
    (i, j) was written. q, k: [16, F]; G: [16, F] cumulative log2 decays (non-increasing)."""
    F = q.shape[1]
    d = np.ones((ROWS, F), dtype=np.float32)
    d[1:] = np.exp2(G[1:] - G[:-1]).astype(np.float32)  # d_t = exp2(G_t - G_{t-1}) <= 1
    aqk = np.zeros((ROWS, ROWS), dtype=np.float64)
    akk = np.zeros((ROWS, ROWS), dtype=np.float64)
    written = np.zeros((ROWS, ROWS), dtype=int)
    for level in range(4):
        lh = 3 - level
        half = 1 << lh
        stage = np.zeros((24, F), dtype=np.float32)  # rows 0-7 KX upper, 8-15 QX upper, 16-23 KX lower
        run = np.ones(F, dtype=np.float32)
        for ii in range(1, ROWS):  # upper rows: exp2(G_ii - G_m), a running product from m + 1
            first = (ii & (half - 1)) == 0
            run = (np.ones(F, dtype=np.float32) if first else run) * d[ii]
            if ii & half:
                u = ((ii >> (lh + 1)) << lh) + (ii & (half - 1))
                stage[u] = k[ii] * run
                stage[8 + u] = q[ii] * run
        for ii in range(ROWS - 1, -1, -1):  # lower rows: exp2(G_m - G_ii), a running product down from m
            last = (ii & (half - 1)) == half - 1
            if ii < ROWS - 1:
                run = np.ones(F, dtype=np.float32) if last else run * d[ii + 1]
            if not ii & half:
                u = ((ii >> (lh + 1)) << lh) + (ii & (half - 1))
                stage[16 + u] = k[ii] * run
        acc = stage[:16].astype(np.float64) @ stage[16:].astype(np.float64).T  # [16, 8]
        for g4 in range(8):  # the accumulator's rows g4 (A_kk) and g4 + 8 (A_qk) of lane (g4, t4)
            i = ((g4 >> lh) << (lh + 1)) + half + (g4 & (half - 1))
            for c in range(8):  # columns 2 t4 and 2 t4 + 1 over the lanes
                if (g4 >> lh) == (c >> lh):
                    j = ((c >> lh) << (lh + 1)) + (c & (half - 1))
                    akk[i, j] = acc[g4, c]
                    aqk[i, j] = acc[8 + g4, c]
                    written[i, j] += 1
    return aqk, akk, written


def elementwise(q: np.ndarray, k: np.ndarray, G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    aqk = np.zeros((ROWS, ROWS))
    akk = np.zeros((ROWS, ROWS))
    for i in range(ROWS):
        for j in range(i):
            e = np.exp2(G[i].astype(np.float64) - G[j].astype(np.float64))
            aqk[i, j] = float((q[i] * k[j] * e).sum())
            akk[i, j] = float((k[i] * k[j] * e).sum())
    return aqk, akk


def _decays(kind: str, rng: np.random.Generator, F: int) -> np.ndarray:
    """Per-token log2 decays [16, F] of the kinds issue 15 names."""
    if kind == "softplus":  # -exp(A_log) softplus(g) with a large head scale, in log2
        g = 2.0 * rng.standard_normal((ROWS, F))
        return -20.0 * np.log1p(np.exp(g)) / np.log(2.0)
    if kind == "down_to_-30":
        return -30.0 * rng.random((ROWS, F)) / np.log(2.0)
    if kind == "neg_inf_channels":
        x = -rng.random((ROWS, F)) / np.log(2.0)
        x[:, ::7] = GATE_FLOOR_LOG2  # -inf, floored as in the kernel
        x[::5, 3] = GATE_FLOOR_LOG2
        return x
    if kind == "mixed":  # slow and extreme features side by side
        x = -0.05 * rng.random((ROWS, F))
        x[:, F // 2:] = -60.0 * rng.random((ROWS, F - F // 2))
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["softplus", "down_to_-30", "neg_inf_channels", "mixed"])
@pytest.mark.parametrize("draw", [0, 1, 2])
def test_levels_cover_every_pair_once_and_match_the_elementwise_terms(kind: str, draw: int) -> None:
    rng = np.random.default_rng(draw)
    F = 64  # one warp's features
    q = rng.standard_normal((ROWS, F)).astype(np.float32)
    k = rng.standard_normal((ROWS, F)).astype(np.float32)
    G = np.cumsum(_decays(kind, rng, F), axis=0).astype(np.float32)
    aqk, akk, written = kernel_levels(q, k, G)
    assert np.array_equal(written, np.tril(np.ones((ROWS, ROWS), dtype=int), -1)), written
    assert np.isfinite(aqk).all() and np.isfinite(akk).all()
    ref_qk, ref_kk = elementwise(q, k, G)
    scale = max(np.abs(ref_qk).max(), np.abs(ref_kk).max(), 1e-30)
    # fp32 running products and operands (the kernel rounds the operands to bf16 as well)
    assert np.abs(aqk - ref_qk).max() <= 1e-5 * scale
    assert np.abs(akk - ref_kk).max() <= 1e-5 * scale
    # the terms of adjacent rows are the largest ones and never vanish by the factorisation
    i = np.arange(1, ROWS)
    assert np.allclose(aqk[i, i - 1], ref_qk[i, i - 1], rtol=1e-5, atol=1e-30)


def test_every_factor_stays_at_most_one() -> None:
    """Both factors of every pair are <= 1: the running products never exceed 1 for decays <= 0,
    so no operand can overflow, whatever the block's span."""
    rng = np.random.default_rng(5)
    F = 8
    G = np.cumsum(-np.abs(rng.standard_normal((ROWS, F))) * 1e3, axis=0).astype(np.float32)
    q = np.ones((ROWS, F), dtype=np.float32)
    aqk, _, _ = kernel_levels(q, q, G)
    assert np.isfinite(aqk).all() and (np.abs(aqk) <= F).all()
