"""Host (CPU) time of one eager ``kda_prefill(backend="sm90")`` call, and where it goes.

    python scripts/host_overhead.py              # needs an SM90 GPU and the built extension
    python scripts/host_overhead.py --also 1x8192x64 1x32768x8   # whole call and binding there too

On B=1 T=1024 H=HV=64 (the benchmark row where the eager time exceeds the CUDA-graph time the
most) it times, with ``time.perf_counter`` around each of 300 calls and no synchronisation in
between (the kernel takes ~0.2 ms, so the launch queue never blocks and the wall time of a call is
its host time):

* the whole call (the default: the extension's eager fast path for a remembered signature);
* the same through the Python path ("memo": the fast path off, the remembered argument rules)
  and with the rules run on every call ("rules": ``cula.kda.prefill._signature`` returning
  None), where the module has them;
* the eager time as the benchmark takes it (synchronise, event, call, event) in each of these
  modes, interleaved call by call;
* the binding alone: the extension's ``kda_prefill_sm90`` with the same, already prepared
  arguments (its argument checks, the TMA descriptors, the launch);

then prints the ten most expensive functions of a cProfile of 300 whole calls. ``--also BxTxH``
adds the whole call and the binding alone for more shapes (e.g. the cooperative launches: their
workspace, sync-area memset and second kernel are in the binding's time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch


def _median_us(fn, reps: int = 300) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def _calls(B: int, T: int, H: int):
    """For one shape (the benchmark's options, D = 128): the whole eager ``kda_prefill`` call, the
    extension's binding alone with prepared arguments and outputs, and the extension."""
    from cula import _ext
    from cula.kda import kda_prefill

    D, dev = 128, "cuda"
    q, k, v, g = (torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.rand(B, T, H, device=dev)
    A_log, dt_bias = torch.randn(H, device=dev), torch.randn(H * D, device=dev)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias, safe_gate=True, lower_bound=-5.0, backend="sm90")
    o, fs = torch.empty_like(v), torch.empty(B, H, D, D, device=dev)
    ext = _ext.get_ext()

    def whole() -> None:
        kda_prefill(q, k, v, g, beta, **kw)

    def binding() -> None:
        ext.kda_prefill_sm90(
            q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=None,
            cu_seqlens=None, state_indices=None, has_initial_state=None, o=o, final_state=fs,
            state_pool=None, scale=D ** -0.5, lower_bound=-5.0, use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=False, state_v_first=False,
            general_gates=False)

    return whole, binding, ext


def _shape_times(B: int, T: int, H: int) -> str:
    """Whole call and binding alone (prepared arguments) for one more shape."""
    whole, binding, ext = _calls(B, T, H)
    for _ in range(10):
        whole()
        binding()
    torch.cuda.synchronize()
    # Few reps: these kernels take 0.7-0.9 ms, so 300 queued calls would fill the launch queue.
    launch = ext.kda_prefill_sm90_launch_name(
        batch=B, seqlen=T, num_seqs=B, num_qk_heads=H, num_v_heads=H, varlen=False,
        general_gates=False, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    from cula.kda import prefill as prefill_mod

    fast_ext = getattr(prefill_mod, "_fast_ext", None)
    python_path = ""
    if fast_ext is not None:
        prefill_mod._fast_ext = lambda: None
        python_path = f", Python path {_median_us(whole, 60):.1f} us"
        prefill_mod._fast_ext = fast_ext
    return (f"B{B} T{T} H{H} ({launch}): whole call {_median_us(whole, 60):.1f} us{python_path}, "
            f"binding alone {_median_us(binding, 60):.1f} us")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--also", nargs="*", default=[], help="more shapes BxTxH")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) != (9, 0):
        print("host_overhead: needs an SM90 (Hopper) GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    B, T, H = 1, 1024, 64
    whole, binding, _ = _calls(B, T, H)

    for _ in range(20):
        whole()
    torch.cuda.synchronize()
    print(f"host_overhead: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"B{B} T{T} H{H}", flush=True)
    print(f"whole call: {_median_us(whole):.1f} us", flush=True)

    from cula.kda import prefill as prefill_mod

    signature = getattr(prefill_mod, "_signature", None)
    fast_ext = getattr(prefill_mod, "_fast_ext", None)

    def set_mode(mode: str) -> None:
        """"fast": the default (the extension's fast path, then the remembered rules); "memo":
        the Python path with the remembered rules; "rules": the Python path, rules every call."""
        if fast_ext is not None:
            prefill_mod._fast_ext = fast_ext if mode == "fast" else (lambda: None)
        if signature is not None:
            prefill_mod._signature = (lambda *a, **kw: None) if mode == "rules" else signature

    modes = [m for m, have in (("fast", fast_ext), ("memo", signature), ("rules", signature)) if have is not None]
    for mode in modes[1:]:
        set_mode(mode)
        print(f"whole call, {mode}: {_median_us(whole):.1f} us", flush=True)
    set_mode("fast")
    if len(modes) > 1:
        ev: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(200 * len(modes)):
            mode = modes[i % len(modes)]
            set_mode(mode)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            whole()
            end.record()
            torch.cuda.synchronize()
            ev[mode].append(start.elapsed_time(end))
        set_mode("fast")
        print("eager ms (bench method, 200 calls each, interleaved): "
              + ", ".join(f"{m} {statistics.median(ev[m]):.4f}" for m in modes), flush=True)

    try:
        binding()
        print(f"binding alone (extension call, prepared arguments): {_median_us(binding):.1f} us",
              flush=True)
    except Exception as exc:  # the binding's keyword set may differ: report, go on
        print(f"binding alone: not measured ({type(exc).__name__}: {exc})", flush=True)

    for shape in args.also:
        print(_shape_times(*(int(x) for x in shape.split("x"))), flush=True)

    D, dev = 128, "cuda"
    empty = lambda: (torch.empty((B, T, H, D), dtype=torch.bfloat16, device=dev),  # noqa: E731
                     torch.empty(B, H, D, D, device=dev))
    print(f"two torch.empty: {_median_us(empty):.1f} us", flush=True)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        whole()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    print("cProfile of 300 whole calls, by own time:")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
