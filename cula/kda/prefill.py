"""KDA (Kimi Delta Attention) prefill forward: host-side validation and backend dispatch.

Public entry point: :func:`kda_prefill` (re-exported as ``cula.kda.kda_prefill``).

Every argument is validated on the host before anything runs; a bad argument raises
``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape or value) whose message names
the argument, what was expected and what came. Backend limits raise ``NotImplementedError`` (an
argument the reference backend handles but the fused kernel does not) and environment problems
(no Hopper GPU, extension not built) raise ``RuntimeError``. Caller tensors are modified only
where the call says so (``out=``, ``final_state=``, and the rows of a state pool named by
``state_indices`` with ``output_final_state=True``), never before validation has passed.

The backend that served the most recent call is observable through :func:`last_backend` (also the
module attribute ``LAST_BACKEND``) and is logged at DEBUG level on the ``cula.kda.prefill`` logger.

After validation, :func:`kda_prefill` allocates the outputs and calls the torch custom op
``cula::kda_prefill`` (:mod:`cula.kda.op`). Everything before the op is plain Python on shapes,
dtypes, devices and Python values, written so that ``torch.compile(fullgraph=True)`` traces it
without a graph break; the checks that need tensor values on the host (the values of
``cu_seqlens`` and ``state_indices``) are skipped while compiling.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from cula import _ext
from cula.kda import op as _op  # registers torch.ops.cula.kda_prefill; call_kda_prefill

__all__ = ["kda_prefill", "last_backend", "LAST_BACKEND"]

_log = logging.getLogger(__name__)

#: Name of the backend that served the most recent successful :func:`kda_prefill` call in this
#: process: ``"sm90"`` or ``"reference"`` (``None`` before the first call). Updated after the
#: backend has been chosen and has returned; a call that raises leaves it unchanged.
LAST_BACKEND: str | None = None

Backend = Literal["auto", "sm90", "reference"]
StateLayout = Literal["kv", "vk"]

_BACKENDS = ("auto", "sm90", "reference")
_STATE_LAYOUTS = ("kv", "vk")
_INT32_MAX = 2**31 - 1  # the fused kernel's sizes and grid are 32-bit
_SAFE_GATE_MIN = -5.0  # safe_gate promises every log decay lies in [-5, 0)
_SM90_HEAD_DIM = 128
_SM90_CAPABILITY = (9, 0)
_CHECK_CU_SEQLENS_ENV = "CULA_CHECK_CU_SEQLENS"
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_ALIGN = 16  # bytes
_USE_REFERENCE_HINT = 'pass backend="reference" to run the (slow) PyTorch reference instead'


def last_backend() -> str | None:
    """Backend that served the most recent successful :func:`kda_prefill` call.

    Returns ``"sm90"`` (the fused Hopper kernel), ``"reference"`` (the PyTorch recurrence) or
    ``None`` if no call has succeeded yet in this process.
    """
    return LAST_BACKEND


# ----------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------


def _desc(x: Any) -> str:
    """Short description of a value for error messages."""
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    text = repr(x)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(x).__name__} {text}"


def _err(name: str, expected: str, got: Any, *, got_is_text: bool = False) -> str:
    got_text = got if got_is_text else _desc(got)
    return f"kda_prefill: `{name}` must be {expected}, got {got_text}"


def _require_tensor(name: str, x: Any) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(_err(name, "a torch.Tensor", x))
    return x


def _require_optional_tensor(name: str, x: Any) -> Tensor | None:
    if x is None:
        return None
    return _require_tensor(name, x)


def _require_bool(name: str, x: Any) -> bool:
    if not isinstance(x, bool):
        raise TypeError(_err(name, "a bool (True or False)", x))
    return x


def _require_real(name: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(_err(name, "a real Python number (int or float)", x))
    return float(x)


def _require_rank(name: str, x: Tensor, rank: int, dims: str) -> None:
    if x.dim() != rank:
        raise ValueError(_err(name, f"a {rank}-D tensor {dims}", x))


_CAPABILITIES: dict[int, tuple[int, int]] = {}


@torch.compiler.assume_constant_result
def _device_capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (cached; a constant for torch.compile)."""
    cap = _CAPABILITIES.get(index)
    if cap is None:
        cap = _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))
    return cap


def _is_sm90(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_capability(index) == _SM90_CAPABILITY


def _validate_cu_seqlens_values(cu_seqlens: Tensor, total: int) -> None:
    """Check that cu_seqlens starts at 0, never decreases and ends at most at ``total`` (tokens
    past its last value are the padding of a bucket). ``cu_seqlens``: int64 on the host."""
    values = cu_seqlens
    if int(values[0]) != 0:
        raise ValueError(
            _err("cu_seqlens", "a tensor whose first value is 0", f"first value {int(values[0])}",
                 got_is_text=True)
        )
    steps = values[1:] - values[:-1]
    bad = torch.nonzero(steps < 0)
    if bad.numel() > 0:
        i = int(bad[0, 0])
        raise ValueError(
            _err("cu_seqlens", "non-decreasing (sequence lengths >= 0)",
                 f"cu_seqlens[{i}]={int(values[i])} > cu_seqlens[{i + 1}]={int(values[i + 1])}",
                 got_is_text=True)
        )
    if int(values[-1]) > total:
        raise ValueError(
            _err("cu_seqlens", f"a tensor whose last value is at most the token count T={total} "
                 "(tokens past it are padding)", f"last value {int(values[-1])}", got_is_text=True)
        )


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------


def _validate_options(
    *,
    scale: Any,
    output_final_state: Any,
    use_qk_l2norm_in_kernel: Any,
    use_gate_in_kernel: Any,
    safe_gate: Any,
    lower_bound: Any,
    state_layout: Any,
    backend: Any,
    use_beta_sigmoid_in_kernel: Any,
    check_inputs: Any,
) -> tuple[float | None, float | None]:
    """Non-tensor arguments. Returns (scale or None, lower_bound or None) as floats."""
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(_err("backend", f"one of {_BACKENDS}", backend))
    if not isinstance(state_layout, str) or state_layout not in _STATE_LAYOUTS:
        raise ValueError(_err("state_layout", f"one of {_STATE_LAYOUTS}", state_layout))
    _require_bool("output_final_state", output_final_state)
    _require_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    _require_bool("use_gate_in_kernel", use_gate_in_kernel)
    _require_bool("safe_gate", safe_gate)
    _require_bool("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
    if check_inputs is not None:
        _require_bool("check_inputs", check_inputs)

    scale_f: float | None = None
    if scale is not None:
        scale_f = _require_real("scale", scale)
        if not (math.isfinite(scale_f) and scale_f > 0.0):
            raise ValueError(_err("scale", "a finite number > 0 (or None for K**-0.5)", scale))

    lb: float | None = None
    if lower_bound is not None:
        lb = _require_real("lower_bound", lower_bound)
        if not use_gate_in_kernel:
            raise ValueError(
                _err("lower_bound", "None unless use_gate_in_kernel=True (it parametrises the "
                     "in-kernel gate)", lower_bound)
            )
        if not (math.isfinite(lb) and lb < 0.0):
            raise ValueError(_err("lower_bound", "a finite number < 0", lower_bound))
        if safe_gate and lb < _SAFE_GATE_MIN:
            raise ValueError(
                _err("lower_bound", f"in [{_SAFE_GATE_MIN}, 0) when safe_gate=True (decays must "
                     f"stay in [{_SAFE_GATE_MIN}, 0))", lower_bound)
            )
    elif safe_gate and use_gate_in_kernel:
        raise ValueError(
            _err("lower_bound", "set (e.g. -5.0) when safe_gate=True and use_gate_in_kernel=True: "
                 "the softplus gate used without lower_bound is unbounded, so decays cannot be "
                 f"promised to lie in [{_SAFE_GATE_MIN}, 0)", lower_bound)
        )
    return scale_f, lb


def _validate_tensors(
    q: Any, k: Any, v: Any, g: Any, beta: Any,
    initial_state: Any, cu_seqlens: Any, A_log: Any, dt_bias: Any,
    state_indices: Any, has_initial_state: Any, out: Any, final_state: Any,
    *,
    use_gate_in_kernel: bool,
    lower_bound: float | None,
    state_layout: str,
    output_final_state: bool,
    check_inputs: bool | None,
) -> int:
    """Tensor arguments: kinds, ranks, shapes, dtypes, devices, and (where the host can see them
    without a sync, or ``check_inputs=True``) the values of cu_seqlens and state_indices.
    Returns N (number of sequences)."""
    q = _require_tensor("q", q)
    k = _require_tensor("k", k)
    v = _require_tensor("v", v)
    g = _require_tensor("g", g)
    beta = _require_tensor("beta", beta)
    initial_state = _require_optional_tensor("initial_state", initial_state)
    cu_seqlens = _require_optional_tensor("cu_seqlens", cu_seqlens)
    A_log = _require_optional_tensor("A_log", A_log)
    dt_bias = _require_optional_tensor("dt_bias", dt_bias)
    state_indices = _require_optional_tensor("state_indices", state_indices)
    has_initial_state = _require_optional_tensor("has_initial_state", has_initial_state)
    out = _require_optional_tensor("out", out)
    final_state = _require_optional_tensor("final_state", final_state)

    # ---- ranks and shapes ----------------------------------------------------------------
    # Each shape, dtype and device is read once (every read builds a new Python object).
    _require_rank("q", q, 4, "[B, T, H, K]")
    q_shape = q.shape
    B, T, H, K = q_shape
    if B < 1 or H < 1 or K < 1:
        raise ValueError(_err("q", "of shape [B, T, H, K] with B >= 1, H >= 1, K >= 1", q))
    _require_rank("k", k, 4, "[B, T, H, K]")
    if k.shape != q_shape:
        raise ValueError(_err("k", f"of the same shape as q {tuple(q_shape)} = [B, T, H, K]", k))
    _require_rank("v", v, 4, "[B, T, HV, V]")
    v_shape = v.shape
    if v_shape[0] != B or v_shape[1] != T:
        raise ValueError(_err("v", f"of shape [B, T, HV, V] with B={B}, T={T} (as q)", v))
    HV, V = v_shape[2], v_shape[3]
    if HV < H or HV % H != 0:
        raise ValueError(
            _err("v", f"of shape [B, T, HV, V] with HV a positive multiple of H={H} "
                 f"(value head hv reads q/k head hv // (HV // H))", v)
        )
    if V < 1:
        raise ValueError(_err("v", "of shape [B, T, HV, V] with V >= 1", v))
    _require_rank("g", g, 4, "[B, T, HV, K]")
    if g.shape != (B, T, HV, K):
        raise ValueError(_err("g", f"of shape [B, T, HV, K] = {(B, T, HV, K)}", g))
    _require_rank("beta", beta, 3, "[B, T, HV]")
    if beta.shape != (B, T, HV):
        raise ValueError(_err("beta", f"of shape [B, T, HV] = {(B, T, HV)}", beta))

    # ---- dtypes ----------------------------------------------------------------------------
    dtype = q.dtype
    if not dtype.is_floating_point:
        raise TypeError(_err("q", "a floating-point tensor (bfloat16 for the sm90 kernel)", q))
    for name, t in (("k", k), ("v", v), ("g", g)):
        if t.dtype != dtype:
            raise TypeError(_err(name, f"of the same dtype as q ({dtype})", t))
    if beta.dtype not in (torch.float32, torch.bfloat16, dtype):
        raise TypeError(_err("beta", "float32, bfloat16 or q's dtype", beta))

    # ---- gate parameters -------------------------------------------------------------------
    if A_log is not None:
        if not use_gate_in_kernel:
            raise ValueError(_err("A_log", "None unless use_gate_in_kernel=True", A_log))
        if A_log.shape != (HV,):
            raise ValueError(_err("A_log", f"of shape [HV] = ({HV},)", A_log))
        if A_log.dtype != torch.float32:
            raise TypeError(_err("A_log", "float32", A_log))
    elif use_gate_in_kernel and lower_bound is None:
        raise ValueError(
            _err("A_log", "given (shape [HV], float32) when use_gate_in_kernel=True without "
                 "lower_bound (softplus gate -exp(A_log) * softplus(g + dt_bias))", A_log)
        )
    if dt_bias is not None:
        if not use_gate_in_kernel:
            raise ValueError(_err("dt_bias", "None unless use_gate_in_kernel=True", dt_bias))
        if dt_bias.shape not in ((HV * K,), (HV, K)):
            raise ValueError(_err("dt_bias", f"of shape [HV*K] = ({HV * K},) (or [HV, K])",
                                  dt_bias))
        if dt_bias.dtype != torch.float32:
            raise TypeError(_err("dt_bias", "float32", dt_bias))

    # ---- devices ---------------------------------------------------------------------------
    device = q.device
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("cu_seqlens", cu_seqlens), ("A_log", A_log), ("dt_bias", dt_bias),
                    ("state_indices", state_indices), ("has_initial_state", has_initial_state),
                    ("out", out), ("final_state", final_state)):
        if t is not None and t.device != device:
            raise ValueError(_err(name, f"on the same device as q ({device})", t))

    # ---- cu_seqlens ------------------------------------------------------------------------
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(_err("cu_seqlens", "an int32 or int64 tensor", cu_seqlens))
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(_err("cu_seqlens", "a 1-D tensor [N + 1] with N >= 1", cu_seqlens))
        if B != 1:
            raise ValueError(
                _err("cu_seqlens", "used with B == 1 (sequences packed along T)",
                     f"q of shape {tuple(q.shape)} (B={B})", got_is_text=True)
            )
        N = cu_seqlens.shape[0] - 1

    # ---- out ---------------------------------------------------------------------------------
    if out is not None:
        if out.shape != (B, T, HV, V):
            raise ValueError(_err("out", f"of shape [B, T, HV, V] = {(B, T, HV, V)} (the shape of o)",
                                  out))
        if out.dtype != dtype:
            raise TypeError(_err("out", f"of q's dtype ({dtype}), the dtype of o", out))

    # ---- states: a pool indexed by state_indices, or one state per sequence -----------------
    trailing = (HV, K, V) if state_layout == "kv" else (HV, V, K)
    dims = "HV, K, V" if state_layout == "kv" else "HV, V, K"
    if state_indices is not None:
        if state_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(_err("state_indices", "an int32 or int64 tensor", state_indices))
        if state_indices.shape != (N,):
            raise ValueError(_err("state_indices", f"a 1-D tensor [N] = ({N},) (one pool row per "
                                  "sequence, < 0 for a pad slot)", state_indices))
        if initial_state is None:
            raise ValueError(_err("initial_state", "the state pool [S, " + dims + "] when "
                                  "state_indices is given", initial_state))
        if final_state is not None:
            raise ValueError(_err("final_state", "None when state_indices is given (the final "
                                  "states are written into the pool, initial_state, in place)",
                                  final_state))
        if initial_state.dim() != 4 or initial_state.shape[0] < 1 or initial_state.shape[1:] != trailing:
            raise ValueError(_err("initial_state", f"a state pool of shape [S, {dims}] = "
                                  f"[S, {', '.join(map(str, trailing))}] with S >= 1 for "
                                  f'state_layout="{state_layout}"', initial_state))
        if initial_state.dtype not in _STATE_DTYPES:
            raise TypeError(_err("initial_state", "a float32 or bfloat16 state pool", initial_state))
        row = trailing[0] * trailing[1] * trailing[2]
        inner = (trailing[1] * trailing[2], trailing[2], 1)
        item = initial_state.element_size()
        # No data pointer while compiling (fake tensors have none): strides only.
        ptr_misaligned = (None if torch.compiler.is_compiling()
                          else initial_state.data_ptr() % _ALIGN)
        if (tuple(initial_state.stride()[1:]) != inner or initial_state.stride(0) < row
                or (initial_state.stride(0) * item) % _ALIGN != 0 or ptr_misaligned):
            got = f"strides {tuple(initial_state.stride())}"
            if ptr_misaligned is not None:
                got += f", data pointer % 16 = {ptr_misaligned}"
            raise ValueError(_err(
                "initial_state", f"a state pool whose rows are dense (strides (s0, {inner[0]}, "
                f"{inner[1]}, 1) with s0 >= {row}) and 16-byte aligned (data pointer and "
                f"s0 * {item} bytes multiples of 16)", got, got_is_text=True))
        if has_initial_state is not None:
            if has_initial_state.dtype != torch.bool:
                raise TypeError(_err("has_initial_state", "a bool tensor", has_initial_state))
            if has_initial_state.shape != (N,):
                raise ValueError(_err("has_initial_state", f"a 1-D tensor [N] = ({N},)",
                                      has_initial_state))
    else:
        if has_initial_state is not None:
            raise ValueError(_err("has_initial_state", "None unless state_indices is given (it "
                                  "selects, per pool slot, zeros instead of the pool row)",
                                  has_initial_state))
        if final_state is not None and not output_final_state:
            raise ValueError(_err("final_state", "None unless output_final_state=True (it is "
                                  "the buffer the final states are written to)", final_state))
        expected_shape = (N,) + trailing
        for name, state in (("initial_state", initial_state), ("final_state", final_state)):
            if state is None:
                continue
            if state.shape != expected_shape:
                raise ValueError(
                    _err(name, f"of shape [N, {dims}] = {expected_shape} for "
                         f'state_layout="{state_layout}" (N = number of sequences)', state)
                )
            if state.dtype not in _STATE_DTYPES:
                raise TypeError(_err(name, "float32 or bfloat16", state))

    # ---- values of cu_seqlens and state_indices (a host copy: one sync for GPU tensors) ------
    # CPU tensors are checked by default; GPU tensors with check_inputs=True (or the environment
    # variable CULA_CHECK_CU_SEQLENS=1); nothing with check_inputs=False; nothing inside a
    # compiled graph (the values are trusted there; the kernel clamps every sequence to [0, T]).
    if (not torch.compiler.is_compiling() and (cu_seqlens is not None or state_indices is not None)
            and _check_index_values(check_inputs, q.device)):
        _validate_index_values(cu_seqlens, state_indices, T,
                               initial_state.shape[0] if state_indices is not None else 0)
    return N


def _check_index_values(check_inputs: bool | None, device: torch.device) -> bool:
    """Whether the values of cu_seqlens / state_indices on ``device`` are checked on the host:
    ``check_inputs`` when given, else for CPU tensors (free) and, with CULA_CHECK_CU_SEQLENS=1,
    for device tensors too (one sync)."""
    if check_inputs is not None:
        return check_inputs
    return device.type == "cpu" or os.environ.get(_CHECK_CU_SEQLENS_ENV) == "1"


def _validate_index_values(cu_seqlens: Tensor | None, state_indices: Tensor | None, T: int,
                           pool_rows: int) -> None:
    """Values of cu_seqlens (0 first, non-decreasing, last <= T) and state_indices (< pool_rows,
    no real index twice), from one host copy of both."""
    parts = [t.detach().reshape(-1).to(torch.int64) for t in (cu_seqlens, state_indices)
             if t is not None]
    host = torch.cat(parts).cpu() if len(parts) > 1 else parts[0].cpu()
    n_cu = 0 if cu_seqlens is None else cu_seqlens.shape[0]
    if cu_seqlens is not None:
        _validate_cu_seqlens_values(host[:n_cu], T)
    if state_indices is not None:
        idx = host[n_cu:]
        over = torch.nonzero(idx >= pool_rows)
        if over.numel() > 0:
            n = int(over[0, 0])
            raise ValueError(_err(
                "state_indices", f"pool row indices < S = {pool_rows} (the pool's first dim), or "
                "< 0 for a pad slot", f"state_indices[{n}] = {int(idx[n])}", got_is_text=True))
        real = idx[idx >= 0]
        uniq, counts = torch.unique(real, return_counts=True)
        if bool((counts > 1).any()):
            row = int(uniq[counts > 1][0])
            seqs = torch.nonzero(idx == row).reshape(-1).tolist()
            raise ValueError(_err(
                "state_indices", "free of duplicated real indices (each pool row is read and "
                "written by at most one sequence)",
                f"pool row {row} for sequences {seqs}", got_is_text=True))


def _check_sm90_arguments(q: Tensor, v: Tensor, num_seqs: int, decays_bounded: bool,
                          prefix: str) -> None:
    """Argument-level limits of the fused kernel (no device queries). Runs after
    :func:`_validate_tensors`, so beta is already float32 or bfloat16 when q is bfloat16."""
    if q.dtype != torch.bfloat16:
        raise TypeError(
            prefix + _err("q", "bfloat16 (with k, v, g) for the sm90 kernel", q)
            + f"; {_USE_REFERENCE_HINT}"
        )
    if q.shape[3] != _SM90_HEAD_DIM:
        raise ValueError(
            prefix + _err("q", f"of head dim K == {_SM90_HEAD_DIM} for the sm90 kernel", q)
            + f"; {_USE_REFERENCE_HINT}"
        )
    if v.shape[3] != _SM90_HEAD_DIM:
        raise ValueError(
            prefix + _err("v", f"of head dim V == {_SM90_HEAD_DIM} for the sm90 kernel", v)
            + f"; {_USE_REFERENCE_HINT}"
        )
    # The kernel's sizes and its grid are 32-bit: T per batch row, B, and the (sequence, value
    # head) tiles N * HV. Larger calls would be truncated, so they are refused here.
    if q.shape[1] > _INT32_MAX or q.shape[0] > _INT32_MAX:
        raise ValueError(prefix + _err("q", f"a tensor whose B and T are at most {_INT32_MAX} for the sm90 kernel", q))
    if num_seqs * v.shape[2] > _INT32_MAX:
        raise ValueError(
            f"{prefix}kda_prefill: sequences x value heads must be at most {_INT32_MAX} for the sm90 "
            f"kernel (one tile each), got {num_seqs} x {v.shape[2]}; split the batch")


def _check_sm90_environment(q: Tensor, prefix: str) -> None:
    """Device and build requirements of the fused kernel."""
    if q.device.type != "cuda":
        raise ValueError(
            prefix + _err("q", "a CUDA tensor on an SM90 (Hopper) GPU for backend=\"sm90\"", q)
            + f"; {_USE_REFERENCE_HINT}"
        )
    if not _is_sm90(q.device):
        cap = _device_capability(q.device.index if q.device.index is not None
                                 else torch.cuda.current_device())
        raise RuntimeError(
            f"{prefix}kda_prefill: backend=\"sm90\" needs a GPU of compute capability 9.0 "
            f"(Hopper), but q is on {q.device} with capability {cap[0]}.{cap[1]}; "
            f"{_USE_REFERENCE_HINT}"
        )
    if not _ext.kernels_available():
        raise RuntimeError(
            f"{prefix}kda_prefill: backend=\"sm90\" is unavailable: {_ext.kernels_unavailable_reason()} "
            f"Or {_USE_REFERENCE_HINT}."
        )


class _Plan(NamedTuple):
    """What validation resolved: the backend to run and the option values the op takes."""

    backend: str              # "sm90" or "reference"
    scale: float              # resolved (K ** -0.5 when the caller passed None)
    lower_bound: float | None
    num_seqs: int             # N: B, or len(cu_seqlens) - 1
    pooled: bool              # state_indices given: initial_state is a pool written in place
    state_dtype: torch.dtype  # dtype of a final state kda_prefill allocates (non-pooled)
    bounded_decays: bool      # every log decay known to lie in [-5, 0): the kernel's safe-gate path
    remembered: bool = False  # the call's signature is in _VALIDATED (the fast path may remember it)


def _choose_backend(q: Tensor, v: Tensor, num_seqs: int, decays_bounded: bool,
                    backend: str, sm90_arguments_passed: bool = False) -> str:
    """"sm90" or "reference" for a validated call; raises where the request cannot be served.
    ``decays_bounded``: every log decay is known to lie in [-5, 0) (``safe_gate``, or a gate in
    the kernel whose ``lower_bound`` is in that range). ``sm90_arguments_passed``: the call's
    signature passed :func:`_check_sm90_arguments` before (remembered in ``_VALIDATED``), so
    only the device and build checks run."""
    if backend == "sm90":
        if not sm90_arguments_passed:
            _check_sm90_arguments(q, v, num_seqs, decays_bounded, prefix="")
        _check_sm90_environment(q, prefix="")
        return "sm90"
    if backend == "reference":
        return "reference"
    if _is_sm90(q.device):  # auto on Hopper: the fused kernel or an explicit error
        prefix = 'backend="auto" chose the sm90 kernel on this Hopper GPU, but: '
        if not sm90_arguments_passed:
            _check_sm90_arguments(q, v, num_seqs, decays_bounded, prefix=prefix)
        _check_sm90_environment(q, prefix=prefix)
        return "sm90"
    return "reference"  # auto on CPU or a non-Hopper device


#: Results of the argument-level rules (:func:`_plan`) for call signatures that passed, so that a server's
#: repeated calls of one shape skip the argument-level rules (~5 us of Python per call on a CPU
#: where the whole call costs ~22 us). A signature holds everything those rules read: each
#: tensor argument's type, shape, dtype and device (and, for a state pool, its strides and
#: data-pointer alignment), and each option's type and value. Not remembered: calls whose rules
#: read tensor *values* (cu_seqlens / state_indices checked on the host), calls under
#: torch.compile (the rules are traced there), and arguments of other types (tensor subclasses,
#: other option types): those always run the rules. A failing call is never stored, so an
#: invalid call raises every time. Bounded: cleared when full. Each entry is
#: ``[scale, lower_bound, N, sm90_arguments_passed]``: the last is set once the signature has
#: also passed the fused kernel's argument limits (:func:`_check_sm90_arguments`, which read
#: only what the signature holds). The backend choice and its device and build checks are not
#: remembered (they run on every call of the Python path; a call the eager fast path serves has
#: a signature that passed them, and its device is part of the signature).


class _Memo(dict):
    """``_VALIDATED``'s type: a dict whose ``clear()`` also forgets the extension's copy of the
    remembered signatures (the eager fast path, ``kda_prefill_fast`` in the extension), so that
    the fast path never lets through a call the Python memo would run the rules for."""

    def clear(self) -> None:
        super().clear()
        if _FAST_MEMO_OWNER is not None:
            _FAST_MEMO_OWNER.kda_prefill_fast_clear()


#: The compiled extension as imported (not whatever ``_ext.get_ext`` returns at the time: tests
#: put stand-ins there), whose fast-path memo ``_VALIDATED.clear()`` clears.
_FAST_MEMO_OWNER = _ext._C if hasattr(_ext._C, "kda_prefill_fast_clear") else None


_VALIDATED: dict[tuple, list] = _Memo()
_VALIDATED_MAX = 256
_MEMO_TENSOR_TYPES = frozenset((Tensor, torch.nn.Parameter, type(None)))
_MEMO_OPTION_TYPES = frozenset((bool, int, float, str, type(None)))


def _signature(tensors: tuple[Any, ...], options: tuple[Any, ...], pool: Any,
               check_inputs: Any) -> tuple | None:
    """The key of a call in ``_VALIDATED``, or None when the call must run the rules.
    ``tensors``: every tensor argument (None where absent); ``pool``: the state pool (the
    initial_state when state_indices is given), whose strides and alignment its rule reads."""
    if torch.compiler.is_compiling() or not _MEMO_TENSOR_TYPES.issuperset(map(type, tensors)):
        return None  # traced (the rules are traced on every call), or a tensor subclass
    shapes = tuple([None if t is None else (t.shape, t.dtype, t.device) for t in tensors])
    if None in shapes[:5]:
        return None  # q, k, v, g or beta missing: the rules raise
    cu_seqlens, state_indices = tensors[5], tensors[8]
    pool_layout = None
    if cu_seqlens is not None or state_indices is not None:
        if _check_index_values(check_inputs, tensors[0].device):
            return None  # the rules read the index values: never remembered
        if pool is not None:
            pool_layout = (pool.stride(), pool.data_ptr() % _ALIGN)
    option_types = tuple(map(type, options))
    if not _MEMO_OPTION_TYPES.issuperset(option_types):
        return None  # e.g. a list or a numpy scalar: the rules decide
    # The types too: True == 1 and 1.0 == 1 hash alike, and the rules tell them apart.
    return (shapes, pool_layout, options, option_types)


def _plan(
    q: Any, k: Any, v: Any, g: Any, beta: Any,
    *,
    scale: Any,
    initial_state: Any,
    output_final_state: Any,
    cu_seqlens: Any,
    use_qk_l2norm_in_kernel: Any,
    use_gate_in_kernel: Any,
    A_log: Any,
    dt_bias: Any,
    safe_gate: Any,
    lower_bound: Any,
    state_layout: Any,
    backend: Any,
    state_indices: Any = None,
    has_initial_state: Any = None,
    out: Any = None,
    final_state: Any = None,
    use_beta_sigmoid_in_kernel: Any = False,
    check_inputs: Any = None,
) -> _Plan:
    """Every rule of :func:`kda_prefill`, in one place; raises the documented exceptions.

    The argument-level rules (:func:`_validate_options`, :func:`_validate_tensors`; their result
    remembered per signature in ``_VALIDATED``), then the backend's limits, then its device and
    build requirements (run on every call). Also the verifier of the FLA backend (:mod:`cula.kda.fla_backend`), so both
    accept exactly the same calls.
    """
    key = _signature(
        (q, k, v, g, beta, cu_seqlens, initial_state, A_log, state_indices, dt_bias,
         has_initial_state, out, final_state),
        (scale, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, safe_gate,
         lower_bound, state_layout, backend, use_beta_sigmoid_in_kernel, check_inputs),
        initial_state if state_indices is not None else None, check_inputs)
    validated = None if key is None else _VALIDATED.get(key)
    if validated is None:
        # The argument-level rules (they never touch the device or allocate).
        scale_f, lb = _validate_options(
            scale=scale, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            safe_gate=safe_gate, lower_bound=lower_bound, state_layout=state_layout, backend=backend,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, check_inputs=check_inputs,
        )
        N = _validate_tensors(
            q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias,
            state_indices, has_initial_state, out, final_state,
            use_gate_in_kernel=use_gate_in_kernel, lower_bound=lb, state_layout=state_layout,
            output_final_state=output_final_state, check_inputs=check_inputs,
        )
        validated = [scale_f, lb, N, False]
        if key is not None:
            if len(_VALIDATED) >= _VALIDATED_MAX:
                _VALIDATED.clear()
            _VALIDATED[key] = validated
    scale_f, lb, N, sm90_arguments_passed = validated
    if scale_f is None:
        scale_f = q.shape[3] ** -0.5
    pooled = state_indices is not None
    # The lower-bound gate lb * sigmoid(...) lies in (lb, 0): with lb in [-5, 0) the decays are
    # bounded whatever safe_gate says (FLA's chunk_kda passes safe_gate=False by default).
    decays_bounded = safe_gate or (use_gate_in_kernel and lb is not None and _SAFE_GATE_MIN <= lb < 0)
    chosen = _choose_backend(q, v, N, decays_bounded, backend, sm90_arguments_passed)
    if chosen == "sm90":
        validated[3] = True  # (an entry of _VALIDATED, or a list of this call only)
    if final_state is not None:
        state_dtype = final_state.dtype
    elif initial_state is not None and not pooled:
        state_dtype = initial_state.dtype
    else:
        state_dtype = torch.float32
    remembered = key is not None and _VALIDATED.get(key) is validated
    return _Plan(chosen, scale_f, lb, N, pooled, state_dtype, decays_bounded, remembered)


def _fast_ext() -> Any:
    """The compiled extension when it has the eager fast path (``kda_prefill_fast``), else None
    (no extension, or a stand-in without it)."""
    try:
        ext = _ext.get_ext()
    except RuntimeError:
        return None
    return ext if hasattr(ext, "kda_prefill_fast") else None


def _plain_eager_mode() -> bool:
    """The fast path's mode rule: :func:`cula.kda.op._plain_eager`'s, without its default-device
    exception (the tensors' types and ``requires_grad`` the fast path checks itself)."""
    return _op._outside_tracers_and_modes(allow_device_contexts=False)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def kda_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_layout: StateLayout = "kv",
    backend: Backend = "auto",
    *,
    state_indices: Tensor | None = None,
    has_initial_state: Tensor | None = None,
    out: Tensor | None = None,
    final_state: Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    check_inputs: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """KDA (Kimi Delta Attention) prefill forward.

    Per value head, with an fp32 state ``S`` of shape ``[K, V]``, for each token ``t``::

        S   <- diag(exp(g_t)) @ S                      # per-key-row decay, g_t <= 0
        S   <- S + beta_t * k_t (x) (v_t - S^T k_t)    # delta rule
        o_t  = scale * S^T q_t

    Shapes (B batch, T tokens, H query/key heads, HV value heads, K key dim, V value dim):

    * ``q``, ``k``: ``[B, T, H, K]``.
    * ``v``: ``[B, T, HV, V]``. ``HV >= H`` and ``HV % H == 0`` (grouped value attention): value
      head ``hv`` reads q/k head ``hv // (HV // H)``.
    * ``g``: ``[B, T, HV, K]``: the per-key log decay (natural log, <= 0), or, with
      ``use_gate_in_kernel=True``, the raw gate input.
    * ``beta``: ``[B, T, HV]``, float32 or bfloat16 (the reference backend also takes q's dtype).
      With ``use_qk_l2norm_in_kernel=True`` the sm90 kernel (fused mode and the cooperative
      mode's helpers' kernel) inverts the chunk's ``I + A_kk`` with fp16 operands, whose range
      holds for beta in ``[0, 2]`` (where each step of the delta rule is a contraction); larger
      values are not checked and may overflow there.
    * ``initial_state``: float32 or bfloat16 ``[N, HV, K, V]`` (``state_layout="kv"``) or
      ``[N, HV, V, K]`` (``"vk"``); ``N`` is ``B``, or ``len(cu_seqlens) - 1`` with
      ``cu_seqlens``. Zeros if None. With ``state_indices`` it is a state pool instead (below).
    * ``cu_seqlens``: int32 or int64 ``[N + 1]`` cumulative sequence offsets of ``N`` sequences
      packed along T; requires ``B == 1``. Values start at 0, are non-decreasing and end at most
      at ``T``: tokens past ``cu_seqlens[-1]`` (a padded CUDA-graph bucket) get ``o = 0`` and
      change no state; empty sequences may sit anywhere. Memory safety holds for *any* values:
      every sequence is clamped to ``[0, T]`` (``begin = clamp(cu[n], 0, T)``,
      ``end = clamp(cu[n+1], begin, T)``; a negative length is an empty sequence), by the
      kernel and identically by the reference. Values are checked (``ValueError``) on the host
      for CPU tensors, and for GPU tensors with ``check_inputs=True`` (one sync).
    * ``A_log``: float32 ``[HV]``; ``dt_bias``: float32 ``[HV * K]`` (``[HV, K]`` is accepted too).
      Only with ``use_gate_in_kernel=True``.

    Serving arguments (keyword-only):

    * ``state_indices``: int32/int64 ``[N]`` on q's device. ``initial_state`` is then a state
      **pool** ``[S, HV, K, V]`` / ``[S, HV, V, K]`` (float32 or bfloat16; rows dense and 16-byte
      aligned, ``stride(0) >= HV*K*V``, e.g. one layer of a larger cache). Sequence ``n`` starts
      from ``pool[state_indices[n]]`` and, with ``output_final_state=True``, its final state is
      written back into that row **in place** (rounded to the pool's dtype); the second return
      value is then the pool itself. An index < 0 is a pad slot: zero initial state, nothing
      written. Real indices must be < S and distinct (checked like ``cu_seqlens``; trusted
      out-of-range indices are treated as pad slots by the reference; duplicates are undefined).
      Both backends (the sm90 kernel reads and writes the rows by index: no gather or scatter
      copies).
    * ``has_initial_state``: bool ``[N]`` (only with ``state_indices``): False starts sequence
      ``n`` from zeros instead of its pool row (the row is still written).
    * ``out``: caller-owned ``o`` (``[B, T, HV, V]``, q's dtype, q's device); returned as is.
    * ``final_state``: caller-owned final-state buffer (non-pooled only, needs
      ``output_final_state=True``; float32 or bfloat16 ``[N, HV, K, V]`` / ``[N, HV, V, K]``).
      Any workspace comes from torch's caching allocator. Buffers must not overlap the inputs.
    * ``use_beta_sigmoid_in_kernel``: ``beta`` holds logits (its dtype as for ``beta`` above); the
      op uses ``sigmoid(float32(beta))`` (FLA's name): float64 logits are rounded to float32 first.
      The sm90 kernel applies it as it loads beta.
    * ``check_inputs``: ``None`` (default) checks the values of CPU ``cu_seqlens`` /
      ``state_indices`` and trusts GPU ones (or checks them when ``CULA_CHECK_CU_SEQLENS=1``);
      ``True`` checks GPU ones too (one host sync: not inside a CUDA graph capture); ``False``
      trusts all (the kernel's clamping keeps any values memory-safe).

    Returns ``(o, final_state)``: ``o`` is ``[B, T, HV, V]`` in q's dtype (``out`` when given);
    ``final_state`` is the state after the last token of each sequence, in ``state_layout``
    (``[N, HV, K, V]`` or ``[N, HV, V, K]``): the ``final_state`` buffer when given, else a new
    tensor in ``initial_state``'s dtype (float32 without one); the pool itself with
    ``state_indices``; ``None`` unless ``output_final_state=True``. States are float32 inside
    the computation; a bfloat16 state is widened as it is read and rounded as it is written
    (by the kernel itself on sm90).

    Args:
        scale: output scale, finite and > 0; default ``K ** -0.5``.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K before use.
        use_gate_in_kernel: treat ``g`` as raw gate input; the log decay is
            ``-exp(A_log[hv]) * softplus(g + dt_bias[hv])`` (needs ``A_log``), or with
            ``lower_bound``: ``lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias[hv]))``
            (``A_log`` optional: ``lower_bound * sigmoid(g + dt_bias[hv])``).
        safe_gate: the caller promises every log decay lies in ``[-5, 0)``. The sm90 kernel needs
            that promise, or ``use_gate_in_kernel=True`` with ``lower_bound`` in ``[-5, 0)``
            (which keeps every decay in range by construction, so ``safe_gate`` may then be
            False). With ``use_gate_in_kernel=True`` it requires ``lower_bound`` in ``[-5, 0)``;
            with ``use_gate_in_kernel=False`` the promise about ``g`` is not checked (that would
            cost a pass over g and a sync): values outside it give inaccurate results.
        lower_bound: finite and < 0; only with ``use_gate_in_kernel=True``.
        state_layout: ``"kv"`` (FLA's default) or ``"vk"`` (FLA's ``state_v_first=True``).
        backend: ``"sm90"`` (the fused Hopper kernel: bf16 q/k/v/g, K == V == 128,
            ``safe_gate=True``, compute capability 9.0, compiled extension), ``"reference"``
            (the fp32 PyTorch recurrence, any device, slow), or ``"auto"``: ``"sm90"`` on an SM90
            GPU, ``"reference"`` on CPU and other GPUs. On an SM90 GPU ``"auto"`` never falls back
            silently: arguments the kernel does not support raise an error that names them.
            :func:`last_backend` tells which backend served the last call.

    Strided inputs (e.g. q, k, v, g, beta as views of one fused projection) are accepted on both
    backends; the reference computes on dense copies. The sm90 kernel reads q, k, v, g in place
    when their features are contiguous, their token and head strides are multiples of 8
    elements (16 bytes), their start is 16-byte aligned and batch rows are ``T`` token strides
    apart, and beta when its heads are contiguous; other layouts are copied once to dense
    tensors. With ``cu_seqlens`` the rows of ``o`` past ``cu_seqlens[-1]`` are written with
    zeros (by the kernel on sm90). Inputs are never modified.
    Validation happens before anything runs or is allocated: bad arguments
    raise ``TypeError``/``ValueError`` naming the argument; arguments outside the sm90 kernel's
    coverage raise ``NotImplementedError``/``TypeError``/``ValueError`` pointing to
    ``backend="reference"``; a missing GPU or extension raises ``RuntimeError``.

    ``torch.compile``: the validation traces, and the work is one call of the custom op
    ``cula::kda_prefill`` (:mod:`cula.kda.op`), so ``torch.compile(fn, fullgraph=True)`` of a
    function that calls ``kda_prefill`` compiles to one graph, and CUDA graphs capture it. The
    values of a CPU ``cu_seqlens`` are not checked inside a compiled function.

    Eager fast path: in plain eager mode, a call whose signature (each tensor argument's type,
    shape, dtype and device, a state pool's layout, each option's type and value) already passed
    these rules and chose the sm90 kernel runs from the extension without the Python layers
    (same allocations, launch and results; ``docs/kernel.md``).

    Example::

        import torch
        from cula.kda import kda_prefill

        B, T, H, HV, D = 1, 4096, 16, 32, 128
        dev, bf16 = "cuda", torch.bfloat16
        q = torch.randn(B, T, H, D, device=dev, dtype=bf16)
        k = torch.randn(B, T, H, D, device=dev, dtype=bf16)
        v = torch.randn(B, T, HV, D, device=dev, dtype=bf16)
        g = torch.randn(B, T, HV, D, device=dev, dtype=bf16)          # raw gate
        beta = torch.rand(B, T, HV, device=dev, dtype=torch.float32)
        A_log = torch.zeros(HV, device=dev)
        dt_bias = torch.zeros(HV * D, device=dev)
        cu = torch.tensor([0, 1000, 4096], device=dev, dtype=torch.int32)   # N = 2 sequences
        h0 = torch.zeros(2, HV, D, D, device=dev)                            # [N, HV, K, V]
        o, ht = kda_prefill(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                            cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                            use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                            safe_gate=True, lower_bound=-5.0)
        # o: [1, 4096, 32, 128] bf16; ht: [2, 32, 128, 128] fp32
    """
    global LAST_BACKEND

    # 0. The eager fast path: a signature that passed the rules below and chose the sm90 kernel
    # before runs from the extension (kda_prefill_fast: the same allocations and launch, without
    # the ~20-50 us of Python layers per call on a server's CPU); None for any other call.
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound,
            state_layout, backend, state_indices, has_initial_state, out, final_state,
            use_beta_sigmoid_in_kernel, check_inputs)
    ext = _fast_ext() if _plain_eager_mode() else None
    if ext is not None:
        done = ext.kda_prefill_fast(*args)
        if done is not None:
            LAST_BACKEND = "sm90"
            if _log.isEnabledFor(logging.DEBUG):
                _log.debug("kda_prefill: backend=sm90 (fast path) q=%s HV=%d device=%s varlen=%s",
                           tuple(q.shape), v.shape[2], q.device, cu_seqlens is not None)
            return done

    # 1. every rule, before anything is allocated or launched.
    plan = _plan(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate, lower_bound=lower_bound,
        state_layout=state_layout, backend=backend, state_indices=state_indices,
        has_initial_state=has_initial_state, out=out, final_state=final_state,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, check_inputs=check_inputs,
    )

    # 2. the outputs (caller-owned from the op's point of view), then the op.
    B, T, HV, V = v.shape
    K = q.shape[3]
    device = q.device
    if out is not None:
        o = out
    elif v.dtype == q.dtype:  # (always on sm90) empty_like is the cheaper call
        o = torch.empty_like(v, memory_format=torch.contiguous_format)
    else:
        o = torch.empty((B, T, HV, V), dtype=q.dtype, device=device)
    caller_final_state = final_state
    state_pool = None
    if plan.pooled:
        # The pool is read by index; with output_final_state it is also written (in place).
        if output_final_state:
            state_pool, initial_state = initial_state, None
        result_state = state_pool
    else:
        if output_final_state and final_state is None:
            state_shape = (plan.num_seqs, HV, K, V) if state_layout == "kv" else (plan.num_seqs, HV, V, K)
            final_state = torch.empty(state_shape, dtype=plan.state_dtype, device=device)
        result_state = final_state
    if dt_bias is not None and dt_bias.dim() != 1:
        dt_bias = dt_bias.reshape(-1)  # [HV, K] -> [HV * K], the op's shape (a 1-D one as it is)
    _op.call_kda_prefill(
        q, k, v, g, beta, A_log, dt_bias,
        initial_state, cu_seqlens, state_indices, has_initial_state, o, final_state, state_pool,
        scale=plan.scale, lower_bound=plan.lower_bound, use_gate_in_kernel=use_gate_in_kernel,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, state_layout=state_layout,
        bounded_decays=plan.bounded_decays, backend=plan.backend,
        seen_outputs=(out, caller_final_state, state_pool),
    )

    if plan.backend == "sm90" and plan.remembered and ext is not None:
        # Remembered for the fast path: plain eager calls whose signature the Python memo holds
        # (the extension also refuses one its key rules would not remember: the same as _signature).
        ext.kda_prefill_fast_register(*args, plan.scale, plan.lower_bound, plan.num_seqs,
                                      plan.state_dtype == torch.bfloat16, plan.bounded_decays)
    LAST_BACKEND = plan.backend
    # Logging is a graph break for the compiler; the level test first spares the arguments.
    if not torch.compiler.is_compiling() and _log.isEnabledFor(logging.DEBUG):
        _log.debug("kda_prefill: backend=%s (requested %s) q=%s HV=%d device=%s varlen=%s",
                   plan.backend, backend, tuple(q.shape), HV, q.device, cu_seqlens is not None)
    return o, result_state
