"""numpy references: the oracle of every test (DESIGN.md §3).

Written as a different algorithm from the kernels (whole-array fancy indexing, float64 where
arithmetic happens) and never calling a kernel. Inputs are numpy arrays; results are new arrays.
"""

from __future__ import annotations

import numpy as np

__all__ = ["reshape_and_cache_flash"]


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                            k_scale=1.0, v_scale=1.0, *, layout="NHD"):
    """Return (key_cache, value_cache) copies with every token of a non-negative slot written."""
    if kv_cache_dtype != "auto":
        raise NotImplementedError("fp8 caches: not yet")
    key_cache, value_cache = np.array(key_cache, copy=True), np.array(value_cache, copy=True)
    slots = np.asarray(slot_mapping).astype(np.int64)
    keep = slots >= 0
    block_size = key_cache.shape[1] if layout == "NHD" else key_cache.shape[2]
    blocks, offsets = np.divmod(slots[keep], block_size)
    for cache, new in ((key_cache, key), (value_cache, value)):
        rows = np.asarray(new)[keep]
        if layout == "NHD":
            cache[blocks, offsets] = rows
        else:
            cache[blocks, :, offsets] = rows
    return key_cache, value_cache
