"""CUDA-event medians of single calls: eager (host overhead counts) and CUDA-graph replays.

Every timed call starts from an idle GPU: synchronise, record a start event, call, record an end
event. So the eager time holds everything the caller waits for (Python, validation, launches,
allocation), and calls never overlap. A CUDA graph per input set, captured once, gives the same
call without host overhead.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class TimingParams:
    """How long to measure: at least ``min_reps`` calls or ``min_time_s``, at most ``max_reps``."""

    warmup: int = 5
    min_reps: int = 10
    max_reps: int = 200
    min_time_s: float = 0.25


def n_reps(est_ms: float, p: TimingParams) -> int:
    """Repetitions for a call estimated at ``est_ms``."""
    if est_ms <= 0:
        return p.max_reps
    return int(max(p.min_reps, min(p.max_reps, math.ceil(p.min_time_s * 1e3 / est_ms))))


def idle_call_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call of ``fn`` from an idle GPU: synchronise, start event, call, end
    event, synchronise (the scripts under ``scripts/`` time their interleaved variants with it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def time_calls(calls: list[Callable[[], Any]], p: TimingParams) -> tuple[float, int]:
    """Median ms of single calls, each from an idle GPU, cycling over ``calls`` (input sets);
    returns (median ms, repetitions)."""
    for i in range(p.warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    reps = n_reps((time.perf_counter() - t0) * 1e3, p)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        torch.cuda.synchronize()
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), reps


def capture_graphs(calls: list[Callable[[], Any]]) -> list[tuple[torch.cuda.CUDAGraph, Any]]:
    """One CUDA graph per input set, sharing one memory pool (replayed one at a time); each with
    the outputs its replays write."""
    pool = torch.cuda.graph_pool_handle()
    # Warm up on a side stream, as torch.cuda.graph requires for lazily initialised state
    # (workspaces, cuBLAS handles, Triton's first launch).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for c in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = c()
        graphs.append((g, out))
    torch.cuda.synchronize()
    return graphs


def time_graphs(graphs: list[tuple[torch.cuda.CUDAGraph, Any]], p: TimingParams) -> tuple[float, int]:
    """Median ms of single graph replays (see :func:`time_calls`)."""
    return time_calls([g.replay for g, _ in graphs], p)
