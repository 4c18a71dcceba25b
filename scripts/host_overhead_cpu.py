"""Host (CPU) time of the Python layers of one eager ``kda_prefill(backend="sm90")`` call, on a
machine without a GPU.

    python scripts/host_overhead_cpu.py [--reps 2000] [--rounds 5]

The extension is replaced by a no-op stand-in (``kda_prefill_sm90`` returns at once) and the
device checks by "yes, SM90", so the whole sm90 path runs on CPU tensors of the benchmark row
B=1 T=1024 H=HV=64 D=128 (bf16 q/k/v/g, fp32 beta, gate in kernel with A_log, dt_bias and
lower_bound=-5, l2norm, output_final_state): what is left is the Python that an eager call pays
for on top of the binding. Per-call times, the best of ``--rounds`` rounds of ``--reps`` calls
each, for:

* ``kda_prefill``: the whole call (plan, two output allocations, dispatch, ``_run_sm90``);
* the same with ``A_log`` and ``dt_bias`` as ``nn.Parameter`` (a model's, not requiring grad as
  under ``no_grad``/``inference_mode``);
* ``_plan``: every validation rule and the backend choice;
* ``call_kda_prefill``: the eager dispatch decision plus ``_run_sm90`` (prepared outputs);
* ``torch.ops.cula.kda_prefill``: the custom op's dispatch plus ``_run_sm90`` (what the call
  cost before the direct path);
* ``_run_sm90``: the (stand-in) binding call alone (the layout checks are in the binding since 220fc91);
* ``two torch.empty``: the output allocations (on the CPU allocator here: a GPU's caching
  allocator costs differently; scripts/host_overhead.py measures that on the device).

The CPU and torch version decide the absolute numbers: compare runs of one machine only.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's cula, not an install

from cula import _ext  # noqa: E402
from cula.kda import op as op_mod  # noqa: E402
from cula.kda import prefill as prefill_mod  # noqa: E402


class _NoOpExt:
    """Stands in for the compiled extension: the binding returns at once."""

    def kda_prefill_sm90(self, **kw: Any) -> None:
        return None


def _per_call_us(fn: Callable[[], object], reps: int, rounds: int) -> float:
    """Least over ``rounds`` of the mean per-call time of ``reps`` back-to-back calls, in us (the
    least, not the median: on a shared machine the noise only ever adds time)."""
    for _ in range(min(reps, 200)):  # warm-up
        fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps)
    return 1e6 * min(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    # The stand-ins: every device query says SM90 and the binding does nothing.
    ext = _NoOpExt()
    _ext.get_ext = lambda: ext
    prefill_mod._is_sm90 = lambda device: True
    prefill_mod._check_sm90_environment = lambda q, prefix: None

    torch.manual_seed(0)
    B, T, H, D = 1, 1024, 64, 128
    q, k, v, g = (torch.randn(B, T, H, D, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.rand(B, T, H)
    A_log = torch.randn(H)
    dt_bias = torch.randn(H * D)
    kw: dict[str, Any] = dict(
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=A_log, dt_bias=dt_bias, safe_gate=True, lower_bound=-5.0, backend="sm90")
    plan_kw = dict(kw, scale=None, initial_state=None, cu_seqlens=None, state_layout="kv")
    o = torch.empty_like(v)
    fs = torch.empty(B, H, D, D)
    op_args = (q, k, v, g, beta, A_log, dt_bias, None, None, None, None, o, fs, None)
    op_kw: dict[str, Any] = dict(
        scale=D ** -0.5, lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=False, state_layout="kv", bounded_decays=True)

    param_kw = dict(kw, A_log=torch.nn.Parameter(A_log, requires_grad=False),
                    dt_bias=torch.nn.Parameter(dt_bias, requires_grad=False))

    cases: list[tuple[str, Callable[[], object]]] = [
        ("kda_prefill (whole call)", lambda: prefill_mod.kda_prefill(q, k, v, g, beta, **kw)),
        ("kda_prefill, nn.Parameter A_log and dt_bias",
         lambda: prefill_mod.kda_prefill(q, k, v, g, beta, **param_kw)),
        ("_plan", lambda: prefill_mod._plan(q, k, v, g, beta, **plan_kw)),
        ("call_kda_prefill (direct path)",
         lambda: op_mod.call_kda_prefill(*op_args, **op_kw, backend="sm90")),
        ("torch.ops.cula.kda_prefill (op dispatch)",
         lambda: torch.ops.cula.kda_prefill(*op_args, **op_kw, backend="sm90")),
        ("_run_sm90", lambda: op_mod._run_sm90(*op_args, *op_kw.values())),
        ("two torch.empty", lambda: (torch.empty((B, T, H, D), dtype=q.dtype, device=q.device),
                                     torch.empty((B, H, D, D), dtype=torch.float32,
                                                 device=q.device))),
    ]
    print(f"host_overhead_cpu: {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}, torch {torch.__version__}, B{B} T{T} H{H} D{D}, "
          f"stand-in extension, {args.rounds} x {args.reps} calls", flush=True)
    for name, fn in cases:
        print(f"{name:44s} {_per_call_us(fn, args.reps, args.rounds):7.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
