"""What the general-gate kernel costs, with and without the exact path of wide blocks.

    python scripts/general_gate_cost.py              # needs an SM90 GPU and the built extension
    python scripts/general_gate_cost.py --softplus   # the gate-in-kernel table only

Precomputed log decays ``-5 * sigmoid(N(0, 1))`` lie in [-5, 0), so no (block, feature) span
exceeds the factorised range and the general-gate instantiation (``safe_gate=False``) takes no
exact diagonal-block term; ``safe_gate=True`` runs the safe-gate instantiation on the same inputs.
Prints, per shape, the CUDA-event medians of single calls of both (interleaved) and their
relative difference (the two must agree to rounding). The ratio separates the general prep's own
cost from the exact path's (docs/perf-notes.md, general gates).

``--softplus`` (also run by default, after the first table): the in-kernel gate, the safe
lower-bound form (``lower_bound=-5``, ``A_log = log U(1, 16)``) against Kimi-Linear's softplus form
``-exp(A_log) softplus(g + dt_bias)`` with ``g ~ 2 N(0, 1)``, ``dt_bias ~ 0.5 N(0, 1)`` and these
decay scales: ``exp(A_log) = 0.05`` for every head (no block is wide: the softplus prep's own cost),
``A_log ~ N(0, 1)`` per head (the benchmark's draw), the same draw cut at ``exp(A_log) <= 1``, every
head at the draw's median and at its fastest value, and ``exp(A_log) = 20`` for every head (every
block of every head is wide: the exact path's full cost). If the one-wave rows (B=2: 128 tiles on
132 SMs) were paced by the fastest heads' tiles alone, the draw would time like "every head at the
fastest" and the cut draw faster; where every head runs the whole exact pass, the draw's variants
time alike. The softplus table adds B=8 (a multi-wave launch) to the shapes.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from kda_bench.timing import idle_call_ms  # noqa: E402  (needs the path above)

SHAPES = [(2, 8192, 64), (1, 8192, 64), (1, 1024, 64), (1, 32768, 8)]  # (B, T, H = HV)
SOFTPLUS_SHAPES = [(2, 8192, 64), (8, 8192, 64), (1, 8192, 64), (1, 1024, 64), (1, 32768, 8)]


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
            times[safe].append(idle_call_ms(lambda: call(safe)))
    ms, mg = statistics.median(times[True]), statistics.median(times[False])
    return (f"B{B} T{T} H{H}: safe kernel {ms:.3f} ms, general kernel (no wide pair) {mg:.3f} ms, "
            f"ratio {mg / ms:.2f}; general vs safe o {_rel(o_g, o_s):.1e} state {_rel(s_g, s_s):.1e}")


def _median_ms(fn, reps: int) -> float:
    return statistics.median(idle_call_ms(fn) for _ in range(reps))


def time_softplus_shape(B: int, T: int, H: int, reps: int = 20) -> str:
    """Safe lower-bound gate vs the softplus gate at three decay scales, interleaved calls."""
    from cula.kda import kda_prefill

    dev = "cuda"
    q, k, v = (torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev))
    dt_bias = 0.5 * torch.randn(H * 128, device=dev)
    g_safe = torch.randn(B, T, H, 128, device=dev).to(torch.bfloat16)
    g_soft = (2 * torch.randn(B, T, H, 128, device=dev)).to(torch.bfloat16)
    a_safe = torch.empty(H, device=dev).uniform_(1.0, 16.0).log()
    a_draw = torch.randn(H, device=dev)

    def every_head(a_log: float) -> torch.Tensor:
        return torch.full((H,), a_log, device=dev)

    runs = {
        "safe lower_bound=-5": dict(g=g_safe, A_log=a_safe, lower_bound=-5.0, safe_gate=True),
        "softplus exp(A_log)=0.05 (no wide block)": dict(
            g=g_soft, A_log=every_head(float(torch.tensor(0.05).log())), safe_gate=False),
        "softplus A_log~N(0,1) (bench draw)": dict(g=g_soft, A_log=a_draw, safe_gate=False),
        "softplus the draw cut at exp(A_log)<=1": dict(g=g_soft, A_log=a_draw.clamp(max=0.0), safe_gate=False),
        f"softplus every head at the draw's median, exp(A_log)={a_draw.median().exp().item():.2f}": dict(
            g=g_soft, A_log=every_head(a_draw.median().item()), safe_gate=False),
        f"softplus every head at the draw's fastest, exp(A_log)={a_draw.max().exp().item():.2f}": dict(
            g=g_soft, A_log=every_head(a_draw.max().item()), safe_gate=False),
        "softplus exp(A_log)=20 (every block wide)": dict(
            g=g_soft, A_log=every_head(float(torch.tensor(20.0).log())), safe_gate=False),
    }

    def call(opts: dict) -> None:
        kda_prefill(q, k, v, opts["g"], beta, A_log=opts["A_log"], dt_bias=dt_bias,
                    lower_bound=opts.get("lower_bound"), output_final_state=True,
                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=opts["safe_gate"],
                    backend="sm90")

    for opts in runs.values():
        for _ in range(3):
            call(opts)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):  # interleaved rounds: clock drift spreads over all runs alike
        for name, opts in runs.items():
            times[name].append(_median_ms(lambda: call(opts), max(1, reps // 3)))
    base = statistics.median(times["safe lower_bound=-5"])
    parts = [f"{name} {statistics.median(t):.3f} ms ({statistics.median(t) / base:.2f}x)" for name, t in times.items()]
    return f"B{B} T{T} H{H}: " + "; ".join(parts)


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        print("general_gate_cost: needs an SM90 (Hopper) GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    if "--softplus" not in sys.argv[1:]:
        for shape in SHAPES:
            print(time_shape(*shape), flush=True)
    for shape in SOFTPLUS_SHAPES:
        print(time_softplus_shape(*shape), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
