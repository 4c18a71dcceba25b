"""KDA (Kimi Delta Attention) prefill.

``cula.kda.kda_prefill`` is the public entry point; ``cula.kda.prefill`` is the module that
holds it (validation, dispatch, and :func:`cula.kda.prefill.last_backend`).
"""

from cula.kda import prefill
from cula.kda.prefill import kda_prefill, last_backend

__all__ = ["kda_prefill", "last_backend", "prefill"]
