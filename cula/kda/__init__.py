"""KDA (Kimi Delta Attention) prefill.

``cula.kda.kda_prefill`` is the public entry point; ``cula.kda.prefill`` is the module that
holds it (validation, dispatch, and :func:`cula.kda.prefill.last_backend`). The work runs in the
torch custom op ``torch.ops.cula.kda_prefill`` (:mod:`cula.kda.op`), so ``torch.compile`` traces
through ``kda_prefill`` without a graph break.

With fla-core installed, importing this package also registers cula as a backend of FLA's
``chunk_kda`` (:mod:`cula.kda.fla_backend`; ``FLA_CULA=0`` turns it off).
"""

from cula.kda import fla_backend, op, prefill
from cula.kda.prefill import kda_prefill, last_backend

__all__ = ["kda_prefill", "last_backend", "prefill", "op", "fla_backend"]

fla_backend.install()
