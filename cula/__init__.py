"""cula: fused CUDA kernels for linear-attention prefill on Hopper (SM90).

The first product is the KDA (Kimi Delta Attention) prefill forward::

    from cula.kda import kda_prefill

Whether the compiled kernels are present is reported by
:func:`cula.kernels_available` and :func:`cula.kernels_unavailable_reason`.
"""

from cula._ext import kernels_available, kernels_unavailable_reason

__version__ = "0.1.0"

__all__ = ["__version__", "kernels_available", "kernels_unavailable_reason"]
