"""One KDA layer of a serving engine: a mixed batch against a state pool, in CUDA-graph buckets.

Copy what you need. The pieces, each usable on its own:

* :class:`SlotPool` hands out rows of the state pool (one per live request) and takes them back.
* :func:`plan_step` turns the requests of one engine step (length-1 decode rows and prefills of
  any length, in any mix) into a padded bucket: ``T`` tokens (a bucket size >= the real token
  count), ``N`` sequences (a bucket size >= the request count), ``cu_seqlens`` (the pad sequences
  are empty and sit at the end; ``cu_seqlens[-1]`` is the real token count, tokens past it are
  padding), ``state_indices`` (the pool row of each request, -1 for a pad sequence) and
  ``has_initial_state`` (False for a request's first step: it starts from zeros).
* :func:`write_step_indices` writes those values *in place* into the (captured) index tensors.
* :func:`pack_tokens` packs per-request activations into one ``[1, T, ...]`` tensor (zero padding).
* :func:`layer_step` is the layer call: ``kda_prefill`` on the pool, rows read and written in
  place, with a backend that serves the pool (today ``"reference"``: the fused sm90 kernel has no
  pool yet and raises ``NotImplementedError``).
* :func:`layer_step_gather_scatter` is what to run on Hopper until the kernel reads the pool:
  gather the rows into a dense state, one dense ``kda_prefill`` call (the fused kernel), scatter
  the final states back. Pad sequences read zeros and write into a scratch row that no request
  owns, so there is no host sync and the step can be captured in a CUDA graph (the cost: one
  gather and one scatter of ``N`` states).
* :class:`GraphBuckets` captures one CUDA graph per ``(T, N)`` bucket and replays it with new
  real lengths and pool rows written into the captured ``cu_seqlens``/``state_indices``.

Run ``python examples/serving_step.py`` on a Hopper GPU: it runs three engine steps of a mixed
batch through CUDA graphs and checks every step against the eager reference. On a machine without
one it runs the same steps eagerly on the reference backend. ``tests/test_serving.py`` tests the
bookkeeping on CPU.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from cula.kda import kda_prefill

#: Bucket sizes: tokens per step and sequences per step (the engine's max batch is the last).
T_BUCKETS = (16, 64, 256, 1024, 4096)
N_BUCKETS = (1, 2, 4, 8, 16, 32)


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (``buckets`` ascending); ValueError when n exceeds them all."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class SlotPool:
    """Rows of the state pool, one per live request. Row ``scratch`` (the last one by default) is
    never handed out: :func:`layer_step_gather_scatter` lets pad sequences write into it."""

    def __init__(self, num_rows: int, reserve_scratch: bool = True) -> None:
        self.num_rows = num_rows
        self.scratch = num_rows - 1 if reserve_scratch else None
        usable = num_rows - 1 if reserve_scratch else num_rows
        self._free = list(range(usable - 1, -1, -1))  # pop() hands out row 0 first
        self._rows: dict[Any, int] = {}

    def acquire(self, rid: Any) -> int:
        if rid in self._rows:
            raise ValueError(f"request {rid!r} already holds row {self._rows[rid]}")
        if not self._free:
            raise RuntimeError("state pool exhausted")
        self._rows[rid] = row = self._free.pop()
        return row

    def release(self, rid: Any) -> int:
        row = self._rows.pop(rid)
        self._free.append(row)
        return row

    def row(self, rid: Any) -> int:
        return self._rows[rid]

    def __contains__(self, rid: Any) -> bool:
        return rid in self._rows


@dataclass
class Request:
    """One request's work in a step: ``tokens`` new tokens (1 for a decode step)."""

    rid: Any
    tokens: int
    first: bool = False  # first step of the request: its state starts from zeros


@dataclass
class StepPlan:
    T: int                          # token bucket
    N: int                          # sequence bucket
    cu_seqlens: list[int]           # [N + 1]; cu_seqlens[-1] = real token count <= T
    state_indices: list[int]        # [N]; -1 for pad sequences
    has_initial_state: list[bool]   # [N]
    spans: list[tuple[int, int]] = field(default_factory=list)  # (start, length) per request

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]


def plan_step(requests: Sequence[Request], slots: SlotPool, t_buckets: Sequence[int] = T_BUCKETS,
              n_buckets: Sequence[int] = N_BUCKETS) -> StepPlan:
    """Bucket, offsets and pool rows of one step (acquires a row for each first-step request)."""
    if any(r.tokens < 0 for r in requests):
        raise ValueError("token counts must be >= 0")
    total = sum(r.tokens for r in requests)
    T = pick_bucket(max(total, 1), t_buckets)
    N = pick_bucket(max(len(requests), 1), n_buckets)
    cu, idx, has, spans = [0], [], [], []
    for r in requests:
        if r.first:
            slots.acquire(r.rid)
        spans.append((cu[-1], r.tokens))
        cu.append(cu[-1] + r.tokens)
        idx.append(slots.row(r.rid))
        has.append(not r.first)
    pad = N - len(requests)
    cu += [cu[-1]] * pad      # empty pad sequences at the end
    idx += [-1] * pad         # pad slot: reads zeros, writes nothing
    has += [False] * pad
    return StepPlan(T, N, cu, idx, has, spans)


def write_step_indices(plan: StepPlan, cu_seqlens: Tensor, state_indices: Tensor,
                       has_initial_state: Tensor | None = None) -> None:
    """Write a plan's values into existing tensors, in place (e.g. those a CUDA graph captured)."""
    if cu_seqlens.shape != (plan.N + 1,) or state_indices.shape != (plan.N,):
        raise ValueError(f"tensors of bucket N={cu_seqlens.shape[0] - 1} for a plan of N={plan.N}")
    cu_seqlens.copy_(torch.tensor(plan.cu_seqlens, dtype=cu_seqlens.dtype), non_blocking=True)
    state_indices.copy_(torch.tensor(plan.state_indices, dtype=state_indices.dtype), non_blocking=True)
    if has_initial_state is not None:
        has_initial_state.copy_(torch.tensor(plan.has_initial_state), non_blocking=True)


def pack_tokens(plan: StepPlan, per_request: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
    """Pack per-request ``[tokens, ...]`` tensors into ``[1, T, ...]`` (rows past the real tokens
    are zero). ``out``: an existing ``[1, T, ...]`` tensor to fill in place."""
    if len(per_request) != len(plan.spans):
        raise ValueError(f"{len(per_request)} tensors for {len(plan.spans)} requests")
    x0 = per_request[0]
    if out is None:
        out = x0.new_zeros((1, plan.T) + tuple(x0.shape[1:]))
    else:
        out.zero_()
    for (start, n), x in zip(plan.spans, per_request):
        if x.shape[0] != n:
            raise ValueError(f"a request of {n} tokens got a tensor of {x.shape[0]} rows")
        out[0, start:start + n] = x
    return out


def unpack_tokens(plan: StepPlan, packed: Tensor) -> list[Tensor]:
    """The inverse of :func:`pack_tokens`: per-request ``[tokens, ...]`` views."""
    return [packed[0, s:s + n] for s, n in plan.spans]


#: The layer's fixed options (those of a Kimi-Linear style model).
LAYER_OPTIONS: dict[str, Any] = dict(
    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
    use_beta_sigmoid_in_kernel=True, state_layout="vk",
)


def layer_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta_logits: Tensor, pool: Tensor,
               cu_seqlens: Tensor, state_indices: Tensor, has_initial_state: Tensor,
               A_log: Tensor, dt_bias: Tensor, *, out: Tensor | None = None,
               backend: str = "reference") -> Tensor:
    """One layer on the pool: rows ``state_indices[n]`` read and written in place; returns o."""
    o, _ = kda_prefill(q, k, v, g, beta_logits, initial_state=pool, state_indices=state_indices,
                       has_initial_state=has_initial_state, output_final_state=True,
                       cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, out=out,
                       backend=backend, check_inputs=False, **LAYER_OPTIONS)
    return o


def layer_step_gather_scatter(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta_logits: Tensor,
                              pool: Tensor, cu_seqlens: Tensor, state_indices: Tensor,
                              has_initial_state: Tensor, A_log: Tensor, dt_bias: Tensor, *,
                              scratch_row: int, out: Tensor | None = None,
                              backend: str = "auto") -> Tensor:
    """:func:`layer_step` for a backend without a pool (the fused sm90 kernel today): gather,
    dense call, scatter. No host sync: pad sequences (index < 0) read zeros and write their
    (meaningless) final state into ``scratch_row``, a pool row no request owns."""
    idx = torch.where(state_indices < 0, scratch_row, state_indices).long()
    start = (has_initial_state & (state_indices >= 0)).view(-1, 1, 1, 1)
    h0 = torch.where(start, pool.index_select(0, idx).float(), 0.0)
    o, ht = kda_prefill(q, k, v, g, beta_logits, initial_state=h0, output_final_state=True,
                        cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, out=out,
                        backend=backend, check_inputs=False, **LAYER_OPTIONS)
    pool.index_copy_(0, idx, ht.to(pool.dtype))
    return o


class GraphBuckets:
    """One captured CUDA graph per ``(T, N)`` bucket of ``step_fn`` (CUDA only).

    ``step_fn(q, k, v, g, beta, pool, cu_seqlens, state_indices, has_initial_state, A_log,
    dt_bias, out=o)`` must not sync with the host. Each bucket owns static input tensors; a step
    copies its packed inputs and its plan into them (in place) and replays the graph. The pool and
    the layer parameters are captured by address: keep them alive and in place.
    """

    def __init__(self, step_fn: Callable[..., Tensor], pool: Tensor, A_log: Tensor,
                 dt_bias: Tensor, *, H: int, K: int, dtype: torch.dtype = torch.bfloat16) -> None:
        self.step_fn, self.pool, self.A_log, self.dt_bias = step_fn, pool, A_log, dt_bias
        self.H, self.K, self.dtype = H, K, dtype
        self.HV = pool.shape[1]
        self.V = pool.shape[2] if LAYER_OPTIONS["state_layout"] == "vk" else pool.shape[3]
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]] = {}

    def _static(self, T: int, N: int) -> dict[str, Tensor]:
        dev, H, HV, K, V = self.pool.device, self.H, self.HV, self.K, self.V
        return dict(
            q=torch.zeros(1, T, H, K, device=dev, dtype=self.dtype),
            k=torch.zeros(1, T, H, K, device=dev, dtype=self.dtype),
            v=torch.zeros(1, T, HV, V, device=dev, dtype=self.dtype),
            g=torch.zeros(1, T, HV, K, device=dev, dtype=self.dtype),
            beta=torch.zeros(1, T, HV, device=dev, dtype=torch.float32),
            cu_seqlens=torch.zeros(N + 1, device=dev, dtype=torch.int32),
            state_indices=torch.full((N,), -1, device=dev, dtype=torch.int32),
            has_initial_state=torch.zeros(N, device=dev, dtype=torch.bool),
            o=torch.zeros(1, T, HV, V, device=dev, dtype=self.dtype),
        )

    def _call(self, s: dict[str, Tensor]) -> None:
        self.step_fn(s["q"], s["k"], s["v"], s["g"], s["beta"], self.pool, s["cu_seqlens"],
                     s["state_indices"], s["has_initial_state"], self.A_log, self.dt_bias,
                     out=s["o"])

    def _graph(self, T: int, N: int):
        key = (T, N)
        if key not in self._graphs:
            s = self._static(T, N)  # all pad sequences: the warm-up and capture write no real row
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._call(s)       # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._call(s)
            self._graphs[key] = (graph, s)
        return self._graphs[key]

    def run(self, plan: StepPlan, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
            beta: Tensor) -> Tensor:
        """Replay the bucket of ``plan`` on packed ``[1, plan.T, ...]`` inputs; returns its o
        (the bucket's static buffer: copy what you keep before the next step of that bucket)."""
        graph, s = self._graph(plan.T, plan.N)
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            s[name].copy_(x)
        write_step_indices(plan, s["cu_seqlens"], s["state_indices"], s["has_initial_state"])
        graph.replay()
        return s["o"]


# ------------------------------------------------------------------------------------------------
# demo
# ------------------------------------------------------------------------------------------------


def _random_request_inputs(n: int, H: int, HV: int, K: int, V: int, device, dtype):
    return dict(q=torch.randn(n, H, K, device=device, dtype=dtype),
                k=torch.randn(n, H, K, device=device, dtype=dtype),
                v=torch.randn(n, HV, V, device=device, dtype=dtype),
                g=torch.randn(n, HV, K, device=device, dtype=dtype),
                beta=torch.randn(n, HV, device=device, dtype=torch.float32))


#: The fused kernel's numerics contract (docs/math.md): relative L2 error vs the fp32 recurrence.
_TOLERANCE = 5e-3


def _rel_err(x: Tensor, ref: Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def demo_steps() -> list[list[Request]]:
    """Three engine steps: prefills arrive, then decode (1 token) rows mix with a new prefill."""
    return [
        [Request("a", 300, first=True), Request("b", 37, first=True)],
        [Request("a", 1), Request("b", 1), Request("c", 700, first=True)],
        [Request("a", 1), Request("b", 1), Request("c", 1), Request("d", 5, first=True)],
    ]


def main() -> None:
    from cula.kda.prefill import _is_sm90

    on_hopper = torch.cuda.is_available() and _is_sm90(torch.device("cuda"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if on_hopper else torch.float32
    H, HV, K = 2, 4, (128 if on_hopper else 16)
    V = K
    slots = SlotPool(8)
    pool = torch.zeros(8, HV, V, K, device=dev)  # "vk" layout, fp32
    pool_ref = pool.clone()
    A_log = torch.zeros(HV, device=dev)
    dt_bias = torch.zeros(HV * K, device=dev)
    graphs = None
    if on_hopper:
        step = lambda *a, out=None: layer_step_gather_scatter(  # noqa: E731
            *a, scratch_row=slots.scratch, out=out, backend="sm90")
        graphs = GraphBuckets(step, pool, A_log, dt_bias, H=H, K=K, dtype=dtype)
    for i, requests in enumerate(demo_steps()):
        plan = plan_step(requests, slots)
        per = [_random_request_inputs(r.tokens, H, HV, K, V, dev, dtype) for r in requests]
        packed = {n: pack_tokens(plan, [p[n] for p in per]) for n in ("q", "k", "v", "g", "beta")}
        cu = torch.tensor(plan.cu_seqlens, dtype=torch.int32, device=dev)
        idx = torch.tensor(plan.state_indices, dtype=torch.int32, device=dev)
        has = torch.tensor(plan.has_initial_state, device=dev)
        args = (packed["q"], packed["k"], packed["v"], packed["g"], packed["beta"])
        o_ref = layer_step(*args, pool_ref, cu, idx, has, A_log, dt_bias, backend="reference")
        if graphs is not None:
            o = graphs.run(plan, *args)
            rows = [slots.row(r.rid) for r in requests]   # the scratch row is no request's
            err, serr = _rel_err(o, o_ref), _rel_err(pool[rows], pool_ref[rows])
            print(f"step {i}: T={plan.T} N={plan.N} tokens={plan.num_tokens} "
                  f"(CUDA graph, sm90) rel. error o {err:.2e}, pool rows {serr:.2e}")
            if not max(err, serr) <= _TOLERANCE:
                raise SystemExit(f"step {i}: the CUDA-graph step differs from the reference "
                                 f"(rel. error above {_TOLERANCE:g})")
        else:
            print(f"step {i}: T={plan.T} N={plan.N} tokens={plan.num_tokens} (reference, eager) "
                  f"|o| = {o_ref.float().norm().item():.3f}")
    for rid in ("a", "b", "c", "d"):
        slots.release(rid)


if __name__ == "__main__":
    main()
