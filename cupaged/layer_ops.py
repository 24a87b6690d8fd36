"""What :mod:`cupaged.layers` computes around the kernels: the projections, RMSNorm, the RoPE cos / sin cache,
a batch plan's arrays on the device, and cross attention's per-request context keys and values."""

from __future__ import annotations

import weakref

import numpy as np

from cupaged._backend import module_of, upload

__all__ = ["ContextCache", "linear", "rms_norm", "rope_cache", "device_plan"]

_DEVICE_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # host BatchPlan -> {xp: its upload}
_ROPE_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # RotaryEmbedding -> {xp: cos_sin}


def linear(x, w):
    """y = x · wᵀ for w ``[out_features, in_features]``, accumulated in float32 and rounded once to x's dtype:
    ``xp.matmul`` (cuBLAS on a GPU, which accumulates 16-bit inputs in float32); on numpy, and for bfloat16,
    through float32 copies (numpy has no 16-bit BLAS)."""
    xp = module_of(x)
    if x.dtype == np.float32 or (xp is not np and x.dtype == np.float16):
        return xp.matmul(x, w.T)
    return xp.matmul(x.astype(np.float32), w.T.astype(np.float32)).astype(x.dtype)


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last dimension: x / sqrt(mean(x²) + eps) · weight, in float32, rounded once."""
    x32 = x.astype(np.float32)
    xp = module_of(x)
    inv = 1.0 / xp.sqrt(xp.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
    return (x32 * inv * weight.astype(np.float32)).astype(x.dtype)


def _xp_key(xp):
    return "numpy" if xp is np else ("cupy", xp.cuda.Device().id)


def rope_cache(rope, max_seq_len: int, xp):
    """``rope.cos_sin_cache`` covering positions below ``max_seq_len``, on xp's device: grown by doubling, shared
    by every layer holding the same :class:`cupaged.RotaryEmbedding`."""
    per_xp = _ROPE_CACHES.setdefault(rope, {})
    key = _xp_key(xp)
    have = per_xp.get(key)
    if have is None or have.shape[0] < max_seq_len:
        n = max(64, 1 << max(int(max_seq_len) - 1, 1).bit_length())
        table = rope.cos_sin_cache(n)
        if xp is np:
            from cupaged import sim

            have = per_xp[key] = sim.asarray(table)
        else:
            have = per_xp[key] = upload(xp, table, "the layer's RoPE cos / sin cache (run a step before capturing)")
    return have


def device_plan(plan, xp):
    """``plan`` with its arrays where the kernels read them (guarded sim memory, or the GPU), uploaded once per
    plan however many layers run it."""
    if not isinstance(plan.seq_lens, np.ndarray):
        return plan
    per_xp = _DEVICE_PLANS.setdefault(plan, {})
    key = _xp_key(xp)
    if key not in per_xp:
        from cupaged import sim

        per_xp[key] = plan.to_device(sim if xp is np else xp)
    return per_xp[key]


class ContextCache:
    """Cross attention's keys and values, dense and per request: ``[context_len, num_kv_heads, head_dim]`` per
    (sequence id, layer), computed once by the layer on the step that brings the sequence's context. ``free``
    drops a finished request's entries."""

    def __init__(self):
        self._kv: dict = {}

    def __contains__(self, key) -> bool:
        """``(seq_id, layer) in cache``."""
        return key in self._kv

    def put(self, seq_id, layer: int, k, v) -> None:
        self._kv[(seq_id, layer)] = (k, v)

    def get(self, seq_id, layer: int):
        return self._kv[(seq_id, layer)]

    def context_len(self, seq_id) -> int:
        lens = [k.shape[0] for (s, _), (k, _v) in self._kv.items() if s == seq_id]
        if not lens:
            raise KeyError(f"no context kept for sequence {seq_id!r}")
        return lens[0]

    def free(self, seq_id) -> None:
        for key in [key for key in self._kv if key[0] == seq_id]:
            del self._kv[key]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._kv.values())
