"""How the softplus gate's time depends on how fast the heads decay (issue 15's rows).

    python scripts/softplus_head_speeds.py      # needs an SM90 GPU and the built extension

The same B, T, H = HV = 64 tensors (T = 8192, B = 2 and 8; raw gates g ~ 2 N(0, 1), dt_bias ~
0.5 N(0, 1), l2norm, final state out) through `kda_prefill(safe_gate=False)` with A_log (the
per-head decay scale exp(A_log)) drawn as the benchmark draws it, N(0, 1), with the draw's tail
cut (exp(A_log) <= 2, <= 1), and with every head at the draw's fastest or median value; then the
safe gate (lower_bound -5) on the same q, k, v. CUDA-event medians of 15 eager calls. If one-wave
rows (B = 2: 128 tiles on 132 SMs) were paced by the fastest heads' tiles, the draw would time
like "every head at the fastest" and cutting the tail would help; if every head runs the whole
exact pass, all five are alike (docs/perf-notes.md, "Where it stands (0920616)")."""
import statistics
import torch
from cula.kda import kda_prefill

torch.manual_seed(0)
dev = "cuda"


def timed(fn, reps=15):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


for B in (2, 8):
    T, H, D = 8192, 64, 128
    q = torch.randn(B, T, H, D, device=dev).bfloat16()
    k = torch.randn(B, T, H, D, device=dev).bfloat16()
    v = torch.randn(B, T, H, D, device=dev).bfloat16()
    g = (2 * torch.randn(B, T, H, D, device=dev)).bfloat16()
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev))
    dt_bias = 0.5 * torch.randn(H * D, device=dev)
    A_draw = torch.randn(H, device=dev)
    cases = {
        "draw N(0,1)": A_draw,
        "draw, exp(A_log) <= 2": A_draw.clamp(max=0.693),
        "draw, exp(A_log) <= 1": A_draw.clamp(max=0.0),
        "every head at the fastest": torch.full_like(A_draw, A_draw.max().item()),
        "every head at the median": torch.full_like(A_draw, A_draw.median().item()),
    }
    print(f"B={B} T={T} H=HV={H}: draw's exp(A_log) max {A_draw.exp().max().item():.2f}, median {A_draw.median().exp().item():.2f}")
    for name, A in cases.items():
        f = lambda A=A: kda_prefill(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    A_log=A, dt_bias=dt_bias, safe_gate=False, output_final_state=True)
        print(f"  softplus {name:28s} {timed(f):.3f} ms")
    A_safe = torch.empty(H, device=dev).uniform_(1.0, 16.0).log()
    f = lambda: kda_prefill(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_safe,
                            dt_bias=dt_bias, safe_gate=True, lower_bound=-5.0, output_final_state=True)
    print(f"  safe gate (lower_bound -5)          {timed(f):.3f} ms")
