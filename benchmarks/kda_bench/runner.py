"""Running the benchmark: one configuration on the GPU, the GPU suite, and the CPU check.

Exit status of both paths: 0 when every check passed; 1 when a cula check failed (an error above
the tolerance or NaN, cula raising on a configuration it supports, two identical calls or an
eager call and its graph replay not bit-identical); 2 when the check could not run.
"""
from __future__ import annotations

import argparse
import gc
import math
import re
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from kda_bench.baselines import Baseline, Result, all_baselines
from kda_bench.env import Device, base_meta
from kda_bench.floors import (chunked_flops, input_bytes, measure_copy_bandwidth, measure_gemm_rate,
                              output_bytes, sm_us_per_chunk_head)
from kda_bench.inputs import Inputs, Options, cu_seqlens, make_inputs
from kda_bench.reference import GIB, load_reference, plan_slice, reference_call, rel_err
from kda_bench.report import fmt_num, progress_line, resolve_paths, write_reports
from kda_bench.suite import Config, build_suite, cpu_suite
from kda_bench.timing import TimingParams, capture_graphs, time_calls, time_graphs
from kda_bench.util import first_line, log

# Device memory per (token, value head) a kernel needs beyond its inputs and outputs: FLA's
# intermediates (gate cumsum, A_qk/A_kk in fp32, w, u, k_g, v_new, per-chunk states, normalised
# q/k) and FlashKDA's workspace (per 16-token tile and head: three 16x128 bf16 tiles, a 128-float
# gate total and two 16x16 bf16 matrices); cula needs none.
WORKSPACE_BYTES_PER_TOKEN_HEAD = {
    "fla": 3.5 * 1024,
    "flashkda": (3 * 16 * 128 * 2 + 128 * 4 + 2 * 16 * 16 * 2) / 16,
}


@dataclass(frozen=True)
class RunParams:
    """What one row does besides timing (from the command line)."""

    timing: TimingParams = TimingParams()
    graph: bool = True
    check: bool = True
    check_tokens: int = 8192
    check_mem_gib: float = 6.0
    tol: float = 5e-3
    max_sets: int = 8
    seed: int = 0
    verbose: bool = False


@dataclass(frozen=True)
class Machine:
    """Rates measured once per run, and the SM count (for SM·µs per chunk-head)."""

    copy_bw: float | None
    gemm_rate: float | None
    sm_count: int


def estimate_bytes(cfg: Config, opt: Options, n_sets: int, names: list[str], p: RunParams) -> int:
    """Peak device memory of a row. Held throughout: the input sets (with bf16 beta logits) and
    each kernel's eager outputs (kept for the error check). On top, one kernel at a time (they run
    one after the other): its graph's pool, i.e. outputs plus workspace (its eager workspace is
    cached but free, and the allocator releases it before failing). Then the reference slice."""
    tok_heads = cfg.B * cfg.T * cfg.HV
    one = input_bytes(cfg, opt) + output_bytes(cfg) + 2 * tok_heads
    transient = max((output_bytes(cfg) + WORKSPACE_BYTES_PER_TOKEN_HEAD.get(nm, 0.0) * tok_heads
                     for nm in names), default=0.0)
    need = n_sets * one + len(names) * output_bytes(cfg) + int(transient)
    if p.check:
        need += int(p.check_mem_gib * GIB)
    return need


def _same(a: Result, b: Result) -> bool:
    """Bit-identical o and final state."""
    return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


def _time_kernel(b: Baseline, sets: list[Inputs], row: dict[str, Any], p: RunParams) -> Result | None:
    """First call, determinism (gating kernels), eager and graph medians of one kernel on a row;
    returns its outputs on the first input set (None when it failed)."""
    nm = b.name
    try:
        calls = [b.prepare(x) for x in sets]
        t_first = time.perf_counter()
        out = b.outputs(calls[0]())
        torch.cuda.synchronize()
        row[f"{nm}_first_call_s"] = time.perf_counter() - t_first   # compile / autotune
        if b.gating:
            same = _same(out, b.outputs(calls[0]()))
            row[f"{nm}_deterministic"] = same
            if not same:
                row["notes"].append(f"{b.label}: two identical calls gave different results")
        row[f"{nm}_ms"], row[f"{nm}_reps"] = time_calls(calls, p.timing)
    except torch.cuda.OutOfMemoryError as exc:
        row[f"{nm}_error"] = "out of memory"
        row["notes"].append(f"{b.label}: skipped, out of memory ({first_line(exc, 120)})")
        gc.collect()
        torch.cuda.empty_cache()
        return None
    except Exception as exc:
        row[f"{nm}_error"] = first_line(exc)
        row["notes"].append(f"{b.label}: raised {first_line(exc)}")
        if p.verbose:
            traceback.print_exc()
        return None
    if not p.graph:
        return out
    graphs = None
    try:
        graphs = capture_graphs(calls)
        row[f"{nm}_graph_ms"], _ = time_graphs(graphs, p.timing)
        if b.gating and not _same(b.outputs(graphs[0][1]), out):
            row[f"{nm}_deterministic"] = False
            row["notes"].append(f"{b.label}: graph replay differs from the eager call")
    except Exception as exc:
        row[f"{nm}_graph"] = f"not capturable: {first_line(exc)}"
        row["notes"].append(f"{b.label} graph: not capturable: {first_line(exc)}")
        try:
            torch.cuda.synchronize()
        except Exception as exc2:  # a sticky error: nothing later can run
            row["notes"].append(f"CUDA context broken after capture: {first_line(exc2)}")
            raise
    finally:
        del graphs
        gc.collect()
        torch.cuda.empty_cache()
    return out


def _check_errors(cfg: Config, sets: list[Inputs], kernels: list[Baseline], outs: dict[str, Result],
                  opt: Options, p: RunParams, row: dict[str, Any]) -> None:
    """Relative errors of every kernel that ran, against the fp32 recurrence on a slice."""
    reference, why = load_reference()
    if not p.check or reference is None or not outs:
        row["check"] = "not run: " + ("--no-check" if not p.check else why or "no kernel ran")
        return
    t0 = time.perf_counter()
    try:
        sl = plan_slice(cfg, sets[0], p.check_tokens, p.check_mem_gib)
        row["check"] = sl.desc
        ref_o, ref_s = reference_call(reference, sets[0] if sl.full else sl.x, opt, torch.float32)
        for b in kernels:
            if b.name not in outs or not b.checked:
                continue
            o, st = outs[b.name]
            row[f"{b.name}_o_err"] = rel_err(sl.take_o(o, cfg), ref_o)
            if sl.full:
                row[f"{b.name}_state_err"] = rel_err(st, ref_s)
            else:
                so, sst = b.outputs(b.prepare(sl.x)())
                row[f"{b.name}_state_err"] = rel_err(sst, ref_s)
                row[f"{b.name}_o_err_slice_run"] = rel_err(so, ref_o)
                del so, sst
        del ref_o, ref_s, sl
    except torch.cuda.OutOfMemoryError as exc:
        row["check"] = f"not run: out of memory ({first_line(exc, 100)})"
    except Exception as exc:
        row["check"] = f"failed: {first_line(exc)}"
        row["notes"].append(f"check raised {first_line(exc)}")
        if p.verbose:
            traceback.print_exc()
    row["check_s"] = time.perf_counter() - t0


def _derived(row: dict[str, Any], cfg: Config, names: list[str], m: Machine) -> None:
    """Speedups (other ms / cula ms), time / HBM floor, SM·µs per chunk-head, and with cula's
    safe gate beside the softplus rows ``softplus_vs_safe`` (cula ms / cula safe gate ms)."""
    for mode in ("", "_graph"):
        c = row.get(f"cula{mode}_ms")
        for nm in names:
            t = row.get(f"{nm}{mode}_ms")
            if not t:
                continue
            if nm != "cula" and c:
                row[f"cula_vs_{nm}{mode}"] = t / c
            if row.get("hbm_floor_ms"):
                row[f"{nm}{mode}_hbm_ratio"] = t / row["hbm_floor_ms"]
            row[f"{nm}{mode}_sm_us_per_chunk_head"] = sm_us_per_chunk_head(t, m.sm_count, cfg)
        # The softplus rows: cula's general-gate time over its safe-gate time on the same tensors.
        if c and row.get(f"cula_safe{mode}_ms"):
            row[f"softplus_vs_safe{mode}"] = c / row[f"cula_safe{mode}_ms"]


def _verdict(row: dict[str, Any], kernels: list[Baseline], tol: float) -> None:
    """FAIL for a gating kernel's bad error, non-determinism or exception; notes for others."""
    for b in kernels:
        nm = b.name
        errs = [row[k] for k in (f"{nm}_o_err", f"{nm}_state_err", f"{nm}_o_err_slice_run") if k in row]
        bad = any(e is None or not math.isfinite(e) or e > tol for e in errs)
        if not b.gating:
            if bad:
                row["notes"].append(f"{b.label} error above {tol:g} (informational)")
            continue
        if bad:
            row["status"] = "FAIL"
            row["notes"].append(f"{b.label} error above tol {tol:g} (or NaN)")
        if row.get(f"{nm}_deterministic") is False:
            row["status"] = "FAIL"
        if f"{nm}_error" in row and row[f"{nm}_error"] != "out of memory":
            row["status"] = "FAIL"


def run_config(cfg: Config, dev: torch.device, opt: Options, kernels: list[Baseline],
               unavailable: dict[str, str], p: RunParams, m: Machine) -> dict[str, Any]:
    """One row: every kernel on the same input sets, floors, errors, verdict."""
    t_row = time.perf_counter()
    row: dict[str, Any] = {
        "config": cfg.name, "mode": cfg.mode, "B": cfg.B, "T": cfg.T, "H": cfg.H, "HV": cfg.HV,
        "D": cfg.D, "N": cfg.N, "chunks": cfg.chunks, "sm_count": m.sm_count, "status": "ok",
        "notes": [],
    }
    if cfg.lens is not None:
        row.update(dist=cfg.dist, min_len=min(cfg.lens), max_len=max(cfg.lens))
    row.update({f"{nm}_na": why for nm, why in unavailable.items()})
    active = []
    for b in kernels:
        ok, why = b.supports(cfg)
        if ok:
            active.append(b)
            row.update(b.row_info(cfg, m.sm_count))
        else:
            row[f"{b.name}_na"] = why
    hbm = input_bytes(cfg, opt) + output_bytes(cfg)
    row["hbm_bytes"] = hbm
    row["flops"] = chunked_flops(cfg)
    row["hbm_floor_ms"] = hbm / m.copy_bw * 1e3 if m.copy_bw else None
    row["tc_floor_ms"] = row["flops"] / m.gemm_rate * 1e3 if m.gemm_rate else None

    # Rotate input sets until the working set exceeds a few times the L2 cache.
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * 1024 * 1024)
    n_sets = max(1, min(p.max_sets, math.ceil(3 * l2 / max(hbm, 1))))
    row["sets"] = n_sets
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(dev)
    need = estimate_bytes(cfg, opt, n_sets, [b.name for b in active], p)
    row["est_mem_gib"] = round(need / GIB, 2)
    if need > 0.92 * free:
        row["status"] = "skipped"
        row["notes"].append(f"skipped: needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB free")
        row["wall_s"] = time.perf_counter() - t_row
        return row

    gen = torch.Generator(device=dev)
    gen.manual_seed(p.seed)
    cu = cu_seqlens(cfg, dev)   # one object for every set: FLA caches chunk indices per object
    sets = [make_inputs(cfg, opt, dev, torch.bfloat16, gen, cu) for _ in range(n_sets)]
    outs: dict[str, Result] = {}
    for b in active:
        out = _time_kernel(b, sets, row, p)
        if out is not None:
            outs[b.name] = out
    _derived(row, cfg, [b.name for b in active], m)
    _check_errors(cfg, sets, active, outs, opt, p, row)
    _verdict(row, active, p.tol)
    del sets, outs
    gc.collect()
    torch.cuda.empty_cache()
    row["wall_s"] = time.perf_counter() - t_row
    return row


def preflight(kernels: list[Baseline], dev: torch.device, opt: Options, D: int
              ) -> tuple[list[Baseline], dict[str, str], list[str], bool]:
    """Availability and one tiny call of each kernel (first-use setup, FLA's beta dtype).
    Returns (usable kernels, {name: why not} for the others, statements, ok); ok is False when a
    gating kernel that is available raised."""
    usable: list[Baseline] = []
    unavailable: dict[str, str] = {}
    statements: list[str] = []
    ok = True
    tiny = [Config("pre", 1, 128, 2, 4, D), Config("pre", 1, 128, 2, 2, D)]   # GVA, then MHA
    for b in kernels:
        avail, why = b.available()
        if not avail:
            unavailable[b.name] = why
            statements.append(f"{b.label} not timed: {why}")
            continue
        cfg = next((c for c in tiny if b.supports(c)[0]), None)
        if cfg is None:   # covers no row either: every row says why
            usable.append(b)
            continue
        gen = torch.Generator(device=dev)
        gen.manual_seed(1)
        try:
            said = b.preflight(make_inputs(cfg, opt, dev, torch.bfloat16, gen, None))
        except Exception as exc:
            why = f"a tiny call raised {first_line(exc)}"
            unavailable[b.name] = why
            statements.append(f"{b.label} not timed: {why}")
            ok = ok and not b.gating
            continue
        if said:
            statements.append(said)
        usable.append(b)
    return usable, unavailable, statements, ok


def run_params(args: argparse.Namespace) -> RunParams:
    """RunParams from the command line."""
    return RunParams(
        timing=TimingParams(args.warmup, args.min_reps, args.max_reps, args.min_time),
        graph=not args.no_graph, check=not args.no_check, check_tokens=args.check_tokens,
        check_mem_gib=args.check_mem_gib, tol=args.tol, max_sets=args.max_sets, seed=args.seed,
        verbose=args.verbose)


def _int_list(text: str | None) -> list[int] | None:
    """"1,2,8" -> [1, 2, 8]; None stays None."""
    if text is None:
        return None
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def selected_configs(args: argparse.Namespace) -> list[Config]:
    """The suite of the command line, filtered by --configs."""
    cfgs = build_suite(args.suite, args.mode, D=args.dim, batch=_int_list(args.batch),
                       seqlen=_int_list(args.seqlen), H=args.heads, HV=args.hv, seed=args.seed)
    if args.configs:
        pat = re.compile(args.configs)
        cfgs = [c for c in cfgs if pat.search(c.name)]
    return cfgs


def skipped_names(args: argparse.Namespace) -> frozenset[str]:
    """Kernels left out by --no-cula / --no-cula-safe / --no-fla / --no-flashkda."""
    return frozenset(nm for nm, flag in (("cula", args.no_cula), ("cula_safe", args.no_cula or args.no_cula_safe),
                                         ("fla", args.no_fla), ("flashkda", args.no_flashkda)) if flag)


def gpu_path(device: Device, args: argparse.Namespace) -> int:
    """The suite on an SM90 GPU; writes the reports; returns the exit status."""
    if args.softplus_gate and args.precomputed_gate:
        raise SystemExit("--softplus-gate and --precomputed-gate exclude each other")
    opt = Options(l2norm=not args.no_l2norm, gate_in_kernel=not args.precomputed_gate,
                  initial_state=args.initial_state, state_layout=args.state_layout,
                  beta_dtype=torch.float32 if args.beta_dtype == "fp32" else torch.bfloat16,
                  softplus_gate=args.softplus_gate)
    p = run_params(args)
    dev = device.device
    torch.cuda.set_device(dev)
    skip = skipped_names(args)
    kernels = all_baselines(opt, skip)
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        usable, unavailable, statements, ok = preflight(kernels, dev, opt, args.dim)
        rc = 0 if ok else 1
        statements += [f"{b.label} not timed: --no-{b.name.replace('_', '-')}" for b in all_baselines(opt)
                       if b.name in skip]
        if args.require_cula and not any(b.name == "cula" for b in usable):
            statements.append("--require-cula: cula could not be timed")
            rc = 1
        ref, why = load_reference()
        if ref is None:
            statements.append(f"errors not checked: {why}")
        for s in statements:
            log("  " + s)
        meta = base_meta(device.name, [b.meta() for b in kernels])
        if not usable:
            log("no kernel can run; nothing to time")
            write_reports(resolve_paths(args.json, args.md, args.plot, args.save, args.results_dir, meta),
                          meta, [], statements)
            return rc or 2

        props = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        nbytes = int(min(2 * GIB, max(64 * 1024 * 1024, free // 8)))
        m = Machine(measure_copy_bandwidth(dev, nbytes), measure_gemm_rate(dev), props.multi_processor_count)
        log(f"{device.name}: copy bandwidth {m.copy_bw / 1e9:.0f} GB/s (read+write, {nbytes / GIB:.2f} GiB "
            f"buffers), bf16 GEMM 8192^3 {m.gemm_rate / 1e12:.0f} TFLOP/s, {m.sm_count} SMs, "
            f"{total / GIB:.0f} GiB")
        log(f"options: {opt.describe()}")

        meta.update(
            copy_bandwidth_GBps=m.copy_bw / 1e9, copy_buffer_bytes=nbytes, gemm_TFLOPs=m.gemm_rate / 1e12,
            sm_count=m.sm_count, gpu_memory_GiB=round(total / GIB, 1), options=opt.describe(),
            tolerance=p.tol, suite=args.suite if args.suite != "default" else args.mode,
            method=("CUDA-event median of single calls, each started from an idle GPU (eager: host "
                    "overhead counts; graph: one captured call replayed), after "
                    f"{p.timing.warmup} warm-up calls; >= {p.timing.min_reps} reps or "
                    f"{p.timing.min_time_s:g} s; small problems rotate over several input sets "
                    "(column 'sets' in the JSON) to defeat the L2 cache. cula vs X = X ms / cula ms. "
                    "Errors: relative L2 vs the fp32 recurrence; o from the timed call (restricted to "
                    "the checked tokens, exact by causality), final state from the full call or, for "
                    "a slice, a call on the slice (FlashKDA's [V,K] state transposed first). HBM floor "
                    "= minimal bytes / measured copy bandwidth; TC floor = chunked-algorithm matmul "
                    "flops / measured bf16 GEMM rate; SM·µs/chunk·head = eager ms x SMs / (64-token "
                    "chunks x HV)."),
            varlen_note=("varlen rows: one cu_seqlens tensor (int64) reused for every call; FLA caches "
                         "its chunk indices per cu_seqlens object (fla tensor_cache), so its per-call "
                         "index preparation is not in the eager time"),
        )
        # The JSON and Markdown are rewritten after every configuration (the plot only at the
        # end), so a run cut short by a time limit keeps what it measured.
        paths = resolve_paths(args.json, args.md, args.plot, args.save, args.results_dir, meta)
        partial_paths = (paths[0], paths[1], None)

        cfgs = selected_configs(args)
        names = [(b.name, b.label) for b in kernels]
        t_start = time.perf_counter()
        for i, cfg in enumerate(cfgs, 1):
            if args.time_budget and time.perf_counter() - t_start > args.time_budget:
                left = [c.name for c in cfgs[i - 1:]]
                statements.append(f"--time-budget {args.time_budget:g} s spent: {len(left)} "
                                  f"configuration(s) not run: {', '.join(left)}")
                log(statements[-1])
                break
            try:
                row = run_config(cfg, dev, opt, usable, unavailable, p, m)
            except Exception as exc:
                row = {"config": cfg.name, "mode": cfg.mode, "status": "FAIL",
                       "notes": [f"benchmark raised {first_line(exc)}"]}
                traceback.print_exc()
                rows.append(row)
                log(progress_line(i, len(cfgs), row, names))
                rc = 1
                break  # the CUDA context may be unusable
            rows.append(row)
            log(progress_line(i, len(cfgs), row, names))
            if row["status"] == "FAIL":
                rc = 1
            if i < len(cfgs):
                write_reports(partial_paths, meta, rows, statements + [
                    f"partial report: {i} of {len(cfgs)} configurations so far"])

    write_reports(paths, meta, rows, statements)
    n_fail = sum(1 for r in rows if r.get("status") == "FAIL")
    n_skip = sum(1 for r in rows if r.get("status") == "skipped")
    log(f"{len(rows)} configurations: {n_fail} failed, {n_skip} skipped. "
        + ("PASS" if rc == 0 else "FAIL"))
    return rc


def cpu_path(device: Device, args: argparse.Namespace) -> int:
    """No SM90 GPU: the reference backend of kda_prefill on small problems vs the fp64
    recurrence; says what was not run and why. Returns the exit status."""
    log(f"No SM90 GPU: {device.why_not_sm90}.")
    opt = Options(initial_state=True, beta_dtype=torch.float32)
    kernels = all_baselines(opt)
    statements = [f"No SM90 GPU ({device.why_not_sm90}): the GPU kernels (cula sm90, FLA, "
                  "FlashKDA), the CUDA-graph timings and the HBM/tensor-core floors were not run."]
    for b in kernels:
        avail, why = b.available()
        statements.append(f"{b.label}: {why}" if not avail else
                          f"{b.label} {b.version()}: available, not run (this check runs the "
                          "reference backend only)")
    for s in statements:
        log("  " + s)
    reference, why_ref = load_reference()
    try:
        from cula.kda import kda_prefill
    except Exception as exc:
        log(f"cannot run the reference check: cula.kda could not be imported ({first_line(exc)})")
        return 2
    if reference is None:
        log(f"cannot run the reference check: {why_ref}")
        return 2

    dev = torch.device("cpu")
    # Tiny per-token ops: one thread avoids the thread pool's spin-waits, which on a busy 2-core
    # machine made each op ~100x slower.
    torch.set_num_threads(1)
    cfgs = cpu_suite()
    rows = []
    rc = 0
    log(f"reference backend on CPU (float32 inputs), options: {opt.describe()}")
    for i, cfg in enumerate(cfgs, 1):
        gen = torch.Generator(device=dev)
        gen.manual_seed(args.seed + i)
        x = make_inputs(cfg, opt, dev, torch.float32, gen, cu_seqlens(cfg, dev))
        row: dict[str, Any] = {"config": cfg.name + " (CPU, fp32, reference backend)",
                               "mode": "cpu", "B": cfg.B, "T": cfg.T, "H": cfg.H, "HV": cfg.HV,
                               "D": cfg.D, "N": cfg.N, "chunks": cfg.chunks, "notes": [],
                               "status": "ok", "check": "full problem vs fp64 recurrence"}
        try:
            t0 = time.perf_counter()
            o, st = kda_prefill(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0,
                                output_final_state=True, cu_seqlens=x.cu,
                                use_qk_l2norm_in_kernel=opt.l2norm,
                                use_gate_in_kernel=opt.gate_in_kernel, A_log=x.A_log,
                                dt_bias=x.dt_bias, safe_gate=True, lower_bound=opt.lower_bound,
                                state_layout=opt.state_layout, backend="reference")
            row["reference_backend_ms"] = (time.perf_counter() - t0) * 1e3
            ro, rs = reference_call(reference, x, opt, torch.float64)
            row["cula_o_err"] = rel_err(o, ro)
            row["cula_state_err"] = rel_err(st, rs)
        except Exception as exc:
            row["status"] = "FAIL"
            row["notes"].append(f"raised {first_line(exc)}")
            traceback.print_exc()
        errs = [row.get("cula_o_err"), row.get("cula_state_err")]
        if row["status"] == "ok" and any(e is None or not math.isfinite(e) or e > args.tol for e in errs):
            row["status"] = "FAIL"
            row["notes"].append(f"error above tol {args.tol:g}")
        if row["status"] != "ok":
            rc = 1
        rows.append(row)
        log(f"[{i}/{len(cfgs)}] {cfg.name:<34} {row['status']:<5} rel err o {fmt_num(errs[0], '.2e')}, "
            f"final state {fmt_num(errs[1], '.2e')} (tol {args.tol:g}); "
            f"{fmt_num(row.get('reference_backend_ms'), '.0f')} ms"
            + ("; " + "; ".join(row["notes"]) if row["notes"] else ""))
    meta = base_meta(device.name, [b.meta() for b in kernels if b.name == "cula"])
    meta["options"] = opt.describe()
    meta["method"] = ("CPU check only: kda_prefill(backend='reference') vs "
                      "kda_recurrent_reference(dtype=float64)")
    meta["suite"] = "cpu"
    write_reports(resolve_paths(args.json, args.md, args.plot, args.save, args.results_dir, meta),
                  meta, rows, statements)
    log("PASS" if rc == 0 else "FAIL")
    return rc
