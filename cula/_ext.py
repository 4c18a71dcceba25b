"""Access to the compiled torch extension ``cula._C``.

The extension is optional: without nvcc and a CUDA build of torch, the pure-Python package
still installs (the reference backend works), and this module records why the fused
kernels are missing so that callers get a clear message instead of a bare ImportError.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch  # noqa: F401  (loads libtorch / libc10 before the extension library)

_BUILD_HINT = (
    "Build the fused kernels with `pip install --no-build-isolation .` from the repository "
    "root, on a machine with nvcc and a CUDA build of torch (no GPU is needed to build)."
)

_C: ModuleType | None
_IMPORT_ERROR: str | None

try:
    # import_module (not `from cula import _C`): cula/__init__ imports this module while cula is
    # still initialising, and the from-form would then report a misleading circular import.
    _C = importlib.import_module("cula._C")
    _IMPORT_ERROR = None
except (ImportError, OSError) as exc:  # OSError: a shared library the extension needs is missing
    _C = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def kernels_available() -> bool:
    """True when the compiled extension ``cula._C`` imported successfully."""
    return _C is not None


def kernels_unavailable_reason() -> str:
    """Why the compiled extension is unavailable, with how to build it; "" when it is available."""
    if _C is not None:
        return ""
    return f"the compiled extension cula._C could not be imported ({_IMPORT_ERROR}). {_BUILD_HINT}"


def get_ext() -> ModuleType:
    """Return the compiled extension module, or raise RuntimeError saying why it is missing."""
    if _C is None:
        raise RuntimeError(kernels_unavailable_reason())
    return _C
