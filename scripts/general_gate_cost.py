"""What the general-gate kernel costs when no 16-token block needs its exact path.

    python scripts/general_gate_cost.py          # needs an SM90 GPU and the built extension

Precomputed log decays ``-5 * sigmoid(N(0, 1))`` lie in [-5, 0), so no (block, feature) span
exceeds the factorised range and the general-gate instantiation (``safe_gate=False``) takes no
exact diagonal-block term; ``safe_gate=True`` runs the safe-gate instantiation on the same inputs.
Prints, per shape, the CUDA-event medians of single calls of both (interleaved) and their
relative difference (the two must agree to rounding). The ratio separates the general prep's own
cost from the exact path's (docs/perf-notes.md, general gates).
"""

from __future__ import annotations

import statistics
import sys

import torch

SHAPES = [(2, 8192, 64), (1, 8192, 64), (1, 1024, 64), (1, 32768, 8)]  # (B, T, H = HV)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def time_shape(B: int, T: int, H: int, reps: int = 30) -> str:
    from cula.kda import kda_prefill

    dev = "cuda"
    q, k, v = (torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    g = (-5.0 * torch.sigmoid(torch.randn(B, T, H, 128, device=dev))).to(torch.bfloat16)
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev))

    def call(safe: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return kda_prefill(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                           use_gate_in_kernel=False, safe_gate=safe, backend="sm90")

    o_s, s_s = call(True)
    o_g, s_g = call(False)
    for _ in range(5):
        call(True)
        call(False)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(reps):
        for safe in (True, False):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            call(safe)
            end.record()
            torch.cuda.synchronize()
            times[safe].append(start.elapsed_time(end))
    ms, mg = statistics.median(times[True]), statistics.median(times[False])
    return (f"B{B} T{T} H{H}: safe kernel {ms:.3f} ms, general kernel (no wide pair) {mg:.3f} ms, "
            f"ratio {mg / ms:.2f}; general vs safe o {_rel(o_g, o_s):.1e} state {_rel(s_g, s_s):.1e}")


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        print("general_gate_cost: needs an SM90 (Hopper) GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    for shape in SHAPES:
        print(time_shape(*shape), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
