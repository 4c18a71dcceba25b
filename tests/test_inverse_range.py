"""The chunk inverse M = (I + A_kk)^-1 of the fused kernels with l2norm takes fp16 operands
(csrc/kda/sm90/unit_lower_inverse.cuh, ``invert_unit_lower_half``): D = (I + A_d)^-1 by blocks,
N = A_o D, N^2, Y = D - D N and M = Y + Y N^2, each product with fp16-rounded operands and fp32
accumulation. fp16 holds at most 65504, so the kernel relies on every one of those matrices
staying small. The claim (docs/kernel.md): with unit keys and beta in [0, 2] each step of the
delta rule is a contraction, so |M[i][j]| <= beta_i, and the intermediates stay within a few
units. This test emulates the blocked algorithm on the CPU on key families chosen to stress it
(random, nearly parallel, alternating signs, random signs, low rank), with and without per-feature
decays, and checks the bound on the exact inverse, the magnitudes of the fp16 intermediates and
that fp16 rounding keeps M as accurate as tf32's would (the same 10-bit mantissa)."""

from __future__ import annotations

import pytest
import torch

C, K, B = 64, 128, 16  # chunk, key dim, diagonal block


def _keys(family: str, gen: torch.Generator) -> torch.Tensor:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if family == "random":
        keys = randn(C, K)
    elif family == "nearly-parallel":
        keys = randn(K) + 0.05 * randn(C, K)
    elif family == "alternating":
        keys = torch.outer((-1.0) ** torch.arange(C, dtype=torch.float64), randn(K)) + 0.05 * randn(C, K)
    elif family == "random-signs":
        signs = torch.randint(0, 2, (C,), generator=gen).to(torch.float64) * 2 - 1
        keys = torch.outer(signs, randn(K)) + 0.01 * randn(C, K)
    else:  # low rank
        keys = randn(C, 3) @ randn(3, K)
    return keys / keys.norm(dim=1, keepdim=True)


def _a_kk(keys: torch.Tensor, beta: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """A[i, j] = beta_i sum_k k_ik k_jk exp(G_ik - G_jk) for j < i (G: cumulative log decays)."""
    G = log_decay.cumsum(0)
    span = (G[:, None, :] - G[None, :, :]).clamp(max=0.0).exp()  # [i, j, k], <= 1 below the diagonal
    A = beta[:, None] * torch.einsum("ik,jk,ijk->ij", keys, keys, span)
    return torch.tril(A, -1)


def _blocked_inverse(A: torch.Tensor, rnd) -> dict[str, torch.Tensor]:
    """The kernel's three rounds, each product on operands rounded by ``rnd`` and accumulated in
    fp32; D by fp32 forward substitution."""
    f32 = torch.float32
    I = torch.eye(C, dtype=f32)
    Ad = torch.zeros(C, C, dtype=f32)
    for b in range(C // B):
        s = slice(B * b, B * b + B)
        Ad[s, s] = A[s, s].to(f32)
    Ao = A.to(f32) - Ad
    D = torch.linalg.solve_triangular(I + Ad, I, upper=False, unitriangular=True)
    N = rnd(Ao) @ rnd(D)
    N2 = rnd(N) @ rnd(N)
    Y = D - rnd(D) @ rnd(N)
    M = Y + rnd(Y) @ rnd(N2)
    return {"D": D, "N": N, "N2": N2, "Y": Y, "M": M}


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest with 10 explicit mantissa bits (cvt.rna.tf32: ties away from zero)."""
    bits = x.contiguous().view(torch.int32)
    rounded = (bits + 0x1000) & ~0x1FFF
    return rounded.view(torch.float32)


FAMILIES = ["random", "nearly-parallel", "alternating", "random-signs", "low-rank"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("beta_max", [1.0, 2.0])
@pytest.mark.parametrize("decay", ["none", "per-feature"])
def test_fp16_inverse_stays_in_range_and_as_accurate_as_tf32(family: str, beta_max: float, decay: str,
                                                             seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    worst_mag, worst_err16, worst_err32 = 0.0, 0.0, 0.0
    for draw in range(6):
        keys = _keys(family, gen)
        beta = torch.full((C,), beta_max, dtype=torch.float64) if draw % 2 == 0 else \
            beta_max * torch.rand(C, generator=gen, dtype=torch.float64)
        log_decay = torch.zeros(C, K, dtype=torch.float64) if decay == "none" else \
            -0.2 * torch.rand(C, K, generator=gen, dtype=torch.float64)
        A = _a_kk(keys, beta, log_decay)
        eye = torch.eye(C, dtype=torch.float64)
        exact = torch.linalg.inv(eye + A)
        # the contraction bound on the exact inverse: |M[i][j]| <= beta_i off the diagonal
        assert bool(((exact - eye).abs() <= beta[:, None] * (1 + 1e-9) + 1e-12).all()), "|M[i][j]| above beta_i"
        half = _blocked_inverse(A, _fp16)
        for name, x in half.items():
            assert torch.isfinite(x).all(), f"{name} not finite"
            worst_mag = max(worst_mag, float(x.abs().max()))
        scale = float(exact.norm())
        worst_err16 = max(worst_err16, float((half["M"].double() - exact).norm()) / scale)
        worst_err32 = max(worst_err32, float((_blocked_inverse(A, _tf32)["M"].double() - exact).norm()) / scale)
    # every intermediate within a few units (measured up to ~7 with beta = 2 on low-rank keys):
    # fp16's 65504 is never approached
    assert worst_mag <= 16.0, worst_mag
    # the same mantissa as tf32: the same accuracy. Only the rounding mode differs (fp16 ties to
    # even, tf32 ties away), so the two errors differ by rounding noise: over 60 seeds per case
    # the ratio stayed within 1.03 at beta <= 1 and reached 1.10 at beta = 2 (one CI seed: 1.11),
    # where the chunk's I + A is nearly singular on these keys and amplifies whichever rounding
    # happened to land worse. The median ratio is 1.000 in every case.
    tolerance = 1.1 if beta_max <= 1.0 else 1.25
    assert worst_err16 <= tolerance * worst_err32 + 1e-5, (worst_err16, worst_err32)
    if beta_max <= 1.0:
        assert worst_err16 <= 2e-3, worst_err16
