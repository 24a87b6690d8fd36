"""The one tolerance table (docs/conventions.md §4): |got - ref| <= atol + rtol * |ref|, used by the tests and
by ``python -m cupaged selftest``. fp8 caches are compared against the dequantized reference."""

import ml_dtypes
import numpy as np

TOLERANCES = {
    np.dtype(np.float32): (1e-5, 1e-5),
    np.dtype(np.float16): (1e-3, 1e-3),
    np.dtype(ml_dtypes.bfloat16): (4e-3, 4e-3),
    "fp8": (2e-2, 2e-2),
    "lse": (1e-4, 1e-4),
}


def tolerance(dtype, kv_cache_dtype="auto"):
    """(atol, rtol) of an output of ``dtype``, loosened to fp8's when read from an fp8 cache."""
    tol = TOLERANCES[np.dtype(dtype)]
    return max(tol, TOLERANCES["fp8"]) if kv_cache_dtype != "auto" else tol
