"""cula as a backend of FLA's ``chunk_kda`` (flash-linear-attention, the ``fla-core`` package).

fla-core (>= 0.5) dispatches ``fla.ops.kda.chunk_kda`` through a registry of backends. Before its
own Triton kernels run, it asks every registered backend that is available and enabled, lowest
``priority`` first, whether it accepts the call (the backend's ``chunk_kda_verifier`` returns
``(ok, reason)``); the first that accepts runs the call, and FLA logs which one did (logger
``fla.backends`` at INFO: ``[FLA Backend] ... -> cula``, or ``-> cula rejected: <reason>``).

Importing :mod:`cula.kda` registers cula there when fla-core is installed (:func:`install`):

* ``backend_type = "cula"``; environment variable ``FLA_CULA`` (on by default, ``FLA_CULA=0``
  turns it off); ``priority = 2``, ahead of FlashKDA's 3; available when the compiled
  extension is (:func:`cula.kernels_available`).
* The verifier accepts exactly the calls the fused SM90 kernel serves: gradients off
  (``torch.inference_mode()`` or ``torch.no_grad()``), q/k/v/g bfloat16 with K = V = 128 on a
  Hopper GPU, any GVA ratio (HV a multiple of H), the in-kernel gate with ``lower_bound`` in
  [-5, 0) (``safe_gate`` True or False: the bound keeps every decay in range), precomputed
  decays with ``safe_gate=True`` (the caller's promise that they lie in [-5, 0)), and unbounded
  decays with ``safe_gate=False`` (Kimi-Linear's softplus gate ``-exp(A_log) softplus(g +
  dt_bias)``, precomputed decays below -5 or ``-inf``): the kernel's general-gate path runs them
  exactly, 2.3-2.8x faster than FLA's Triton path on the softplus rows of the benchmark (H100,
  same run; ``docs/perf-notes.md``),
  beta as probabilities or as logits (``use_beta_sigmoid_in_kernel=True``), either state layout
  (``state_v_first``), ``cu_seqlens`` (int32 or int64). It runs the same validation as
  :func:`cula.kda.kda_prefill` (one rule per argument, in :mod:`cula.kda.prefill`), so its
  reasons are cula's error messages. It rejects what only FLA serves: ``allow_neg_eigval``,
  ``return_intermediate_states``, ``cp_context``, arguments it does not know.
* The adapter maps FLA's arguments onto :func:`cula.kda.kda_prefill` (``backend="sm90"``)
  without copying them: ``state_v_first`` (or FLA 0.5's ``transpose_state_layout``) is
  ``state_layout="vk"``; ``A_log``, ``dt_bias`` and ``lower_bound`` are dropped when
  ``use_gate_in_kernel=False`` (FLA ignores them there); ``cu_seqlens_cpu``,
  ``disable_recompute``, ``use_graph`` and ``max_num_seqs`` need nothing (the kernel never
  syncs with the host and handles empty sequences); ``chunk_size`` (32 or 64) does not change
  the result. ``use_beta_sigmoid_in_kernel`` (beta holds logits) is passed through as it is:
  :func:`cula.kda.kda_prefill` takes the same flag (its sm90 path applies the sigmoid in fp32
  in one elementwise pass over ``[B, T, HV]`` until the kernel does it). ``initial_state`` must
  be float32, as FLA requires (cula would also take bfloat16, and return a bfloat16 state).

Registration does not import FLA: when ``fla.ops.kda.chunk`` is not imported yet, a one-shot
import hook registers cula right after FLA imports it, so ``import cula.kda`` stays cheap.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import logging
import sys
from typing import Any

import torch

from cula import _ext
from cula.kda import prefill as _prefill

__all__ = [
    "BACKEND_TYPE", "ENV_VAR", "PRIORITY",
    "install", "register", "registered_backend", "to_kda_prefill", "verify_chunk_kda", "run_chunk_kda",
]

_log = logging.getLogger(__name__)

BACKEND_TYPE = "cula"
ENV_VAR = "FLA_CULA"
#: FLA asks backends lowest priority first; FlashKDA registers with 3.
PRIORITY = 2

#: The FLA module whose import defines ``chunk_kda`` (and its backend registry).
_FLA_CHUNK_MODULE = "fla.ops.kda.chunk"
#: ``chunk_size`` values FLA accepts; the result does not depend on it.
_FLA_CHUNK_SIZES = (32, 64)


class Unsupported(ValueError):
    """An FLA argument the cula backend does not serve (the message is the reason)."""


# ------------------------------------------------------------------------------------------------
# FLA arguments -> kda_prefill arguments
# ------------------------------------------------------------------------------------------------

_SIGNATURE: inspect.Signature | None = None


def _chunk_kda_signature() -> inspect.Signature:
    """The signature of the installed FLA's ``chunk_kda`` (positional order differs by version)."""
    global _SIGNATURE
    if _SIGNATURE is None:
        from fla.ops.kda.chunk import chunk_kda

        _SIGNATURE = inspect.signature(inspect.unwrap(chunk_kda))
    return _SIGNATURE


def _named_arguments(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of a ``chunk_kda`` call by name: bound, defaults applied, ``**kwargs`` merged."""
    sig = _chunk_kda_signature()
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise Unsupported(f"the arguments do not fit FLA's chunk_kda signature: {exc}") from None
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise Unsupported(f"unexpected extra positional arguments ({len(value)})")
        else:
            named[name] = value
    return named


def to_kda_prefill(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map the arguments of an FLA ``chunk_kda`` call onto :func:`cula.kda.kda_prefill`.

    Returns the kda_prefill keyword arguments: the caller's tensors as they are (``backend`` not
    included), ``use_beta_sigmoid_in_kernel`` passed through. Raises
    :class:`Unsupported` for an FLA feature that cula does not serve; the kda_prefill arguments
    themselves are validated by the caller (:func:`cula.kda.prefill._plan`).
    """
    a = _named_arguments(args, kwargs)

    def take(name: str, default: Any = None) -> Any:
        return a.pop(name, default)

    if take("allow_neg_eigval", False):
        raise Unsupported("allow_neg_eigval=True (beta in [0, 2)) is not supported by cula")
    if take("return_intermediate_states", False):
        raise Unsupported("return_intermediate_states=True is not supported by cula")
    if take("cp_context", None) is not None:
        raise Unsupported("context parallelism (cp_context) is not supported by cula")
    state_v_first = take("state_v_first", False)
    transpose_state_layout = take("transpose_state_layout", False)  # FLA 0.5's name; 0.6: deprecated
    if state_v_first and transpose_state_layout:
        raise Unsupported("both state_v_first and transpose_state_layout given (FLA rejects that)")
    chunk_size = take("chunk_size", 64)
    if chunk_size not in _FLA_CHUNK_SIZES:
        raise Unsupported(f"chunk_size must be one of {_FLA_CHUNK_SIZES} (as in FLA), got {chunk_size!r}")
    beta_logits = take("use_beta_sigmoid_in_kernel", False)
    use_graph = take("use_graph", False)
    max_num_seqs = take("max_num_seqs", None)
    cu_seqlens = take("cu_seqlens", None)
    if (use_graph and cu_seqlens is not None and max_num_seqs is not None
            and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1
            and cu_seqlens.shape[0] - 1 != max_num_seqs):
        raise Unsupported(f"use_graph: cu_seqlens has {cu_seqlens.shape[0] - 1} sequences, "
                          f"max_num_seqs={max_num_seqs} (FLA requires them equal)")
    take("cu_seqlens_cpu")       # values on the host: cula needs none
    take("disable_recompute")    # a training knob: the forward is the same

    use_gate_in_kernel = take("use_gate_in_kernel", False)
    A_log, dt_bias, lower_bound = take("A_log"), take("dt_bias"), take("lower_bound")
    if not use_gate_in_kernel:  # FLA ignores the gate parameters unless the gate is in the kernel
        A_log = dt_bias = lower_bound = None

    initial_state = take("initial_state")
    if isinstance(initial_state, torch.Tensor) and initial_state.dtype != torch.float32:
        raise Unsupported(f"initial_state must be float32 under FLA's chunk_kda, got {initial_state.dtype}")
    mapped = dict(
        q=take("q"), k=take("k"), v=take("v"), g=take("g"), beta=take("beta"),
        scale=take("scale"), initial_state=initial_state,
        output_final_state=take("output_final_state", False), cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=take("use_qk_l2norm_in_kernel", False),
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        safe_gate=take("safe_gate", False), lower_bound=lower_bound,
        state_layout="vk" if (state_v_first or transpose_state_layout) else "kv",
        use_beta_sigmoid_in_kernel=beta_logits,
    )
    if a:
        raise Unsupported(f"unknown argument(s) {sorted(a)}")
    return mapped


def _reason(exc: BaseException) -> str:
    """cula's message, without the hint about backend="reference" (meaningless under FLA)."""
    text = str(exc)
    for marker in ('; pass backend="reference"', ', or pass backend="reference"',
                   ' Or pass backend="reference"'):
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    return text


def verify_chunk_kda(*args: Any, **kwargs: Any) -> tuple[bool, str | None]:
    """``(True, None)`` when the fused kernel serves this ``chunk_kda`` call, else ``(False, reason)``.

    Takes the call's arguments as FLA passes them. Never raises for a bad argument: FLA then runs
    its own path, which reports the problem in its own words.
    """
    if torch.is_grad_enabled():
        return False, ("cula runs the forward pass only: call chunk_kda under torch.inference_mode() "
                       "or torch.no_grad()")
    try:
        # The same validation as kda_prefill; bounded decays or not, the fused kernel serves what
        # passes it (unbounded ones on its general-gate path).
        _prefill._plan(**to_kda_prefill(args, kwargs), backend="sm90")
    except (TypeError, ValueError, NotImplementedError, RuntimeError) as exc:
        return False, _reason(exc)
    return True, None


def run_chunk_kda(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a ``chunk_kda`` call (accepted by :func:`verify_chunk_kda`) on the fused kernel.

    Returns ``(o, final_state)`` as FLA does: o ``[B, T, HV, V]`` in q's dtype; final_state
    float32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) or None.
    """
    return _prefill.kda_prefill(**to_kda_prefill(args, kwargs), backend="sm90")


# ------------------------------------------------------------------------------------------------
# Registration with fla-core
# ------------------------------------------------------------------------------------------------

_BACKEND: Any = None


def _backend_class(base: type) -> type:
    """The backend class on top of the installed FLA's ``BaseBackend``."""

    class CulaBackend(base):  # type: ignore[misc, valid-type]
        """cula's fused SM90 KDA prefill kernel as a backend of FLA's ``chunk_kda``
        (see :mod:`cula.kda.fla_backend`)."""

        backend_type = BACKEND_TYPE
        package_name = "cula"
        env_var = ENV_VAR
        default_enable = True
        priority = PRIORITY

        @classmethod
        def is_available(cls) -> bool:
            return super().is_available() and _ext.kernels_available()

        def chunk_kda_verifier(self, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
            return verify_chunk_kda(*args, **kwargs)

        def chunk_kda(self, *args: Any, **kwargs: Any):
            return run_chunk_kda(*args, **kwargs)

    return CulaBackend


def register() -> Any:
    """Register cula with the installed fla-core's ``chunk_kda`` registry; returns the backend.

    Idempotent (FLA keeps one backend per ``backend_type``). Imports FLA's ``chunk_kda``; raises
    ImportError without fla-core, RuntimeError for an fla-core without a backend registry.
    """
    global _BACKEND
    from fla.ops.kda.chunk import chunk_kda

    try:  # fla-core >= 0.6: fla.backends.register(entry_point)(backend class)
        from fla.backends import BaseBackend, register as fla_register
    except ImportError:
        fla_register = None
        try:  # fla-core 0.5: one BackendRegistry per operation
            from fla.ops.backends import BaseBackend
        except ImportError as exc:
            raise RuntimeError(f"this fla-core has no backend registry ({exc}); cula needs fla-core >= 0.5") from exc
    cls = _backend_class(BaseBackend)
    if fla_register is not None:
        fla_register(chunk_kda)(cls)
        from fla.backends import _function_registries

        registry = _function_registries.get(inspect.unwrap(chunk_kda))
        backend = registry._backends.get(BACKEND_TYPE) if registry is not None else None
    else:
        from fla.ops.kda.backends import kda_registry

        backend = cls()
        kda_registry.register(backend)
    _BACKEND = backend
    _log.debug("registered cula as FLA chunk_kda backend %r (priority %d)", BACKEND_TYPE, PRIORITY)
    return backend


def registered_backend() -> Any:
    """The backend object registered with FLA, or None (fla-core absent or not imported yet)."""
    return _BACKEND


def _register_quietly() -> None:
    try:
        register()
    except Exception as exc:  # never break the import of FLA or cula
        _log.warning("cula: could not register as a backend of FLA's chunk_kda: %s: %s",
                     type(exc).__name__, exc)


class _RegisterAfterImport(importlib.abc.Loader):
    """Wraps the loader of ``fla.ops.kda.chunk``: runs the module, then registers cula."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):  # noqa: ANN001
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001
        self._loader.exec_module(module)
        _register_quietly()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self._loader, name)


class _FlaImportHook(importlib.abc.MetaPathFinder):
    """One-shot finder: when ``fla.ops.kda.chunk`` is imported, wrap its loader, then step aside."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):  # noqa: ANN201
        if fullname != _FLA_CHUNK_MODULE:
            return None
        _remove_hook()
        spec = importlib.util.find_spec(fullname)  # the other finders, as without the hook
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterImport(spec.loader)
        return spec


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _FlaImportHook)]


def install() -> None:
    """Register cula with FLA now if FLA's ``chunk_kda`` is imported, else as soon as it is.

    Does nothing when fla-core is not installed. Called by ``import cula.kda``.
    """
    if _FLA_CHUNK_MODULE in sys.modules:
        _register_quietly()
        return
    try:
        if importlib.util.find_spec("fla") is None:
            return
    except (ImportError, ValueError):
        return
    if not any(isinstance(f, _FlaImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _FlaImportHook())
