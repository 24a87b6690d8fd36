"""cupaged: hand-written CUDA kernels for attention over a paged KV cache.

Kernels are CUDA source in ``kernels_cu/``, compiled at run time by CuPy (NVRTC) for cupy arrays,
or by g++ through the CPU simulator :mod:`cupaged.sim` for numpy arrays. The backend follows the
data arrays. See README.md for the API tour.
"""

from cupaged.cache_ops import reshape_and_cache_flash

__version__ = "0.1.0"
__all__ = ["reshape_and_cache_flash", "__version__"]
