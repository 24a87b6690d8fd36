"""Rotary position embeddings (kernels_cu/rope.cu): :class:`RotaryEmbedding` (vLLM's interface: the cos/sin cache,
and a call that rotates q and k in place) and :func:`rope_and_cache`, RoPE fused with the flash-layout cache write
of k and v in one launch."""

from __future__ import annotations

import functools
import math

import numpy as np

from cupaged._annotate import op_launch
from cupaged._backend import device_key, host_copy, module_of, struct_arg, to_device
from cupaged._cache_args import (KV_CODE, KV_KINDS, SLOT_DTYPES, check_no_overlap, check_slot_mapping, kv_dtype_name,
                                 op_array_module)
from cupaged._checks import (CTYPE, FLOAT_DTYPES, address, check_bool, check_dtype, check_float, check_int,
                             check_last_contiguous, check_ndim, check_writable, element_strides, validate_enabled)
from cupaged._cost import Cost
from cupaged._interop import accepts_foreign_arrays
from cupaged._mirror import constants, struct_dtype
from cupaged._runtime import KernelFamily
from cupaged.cache_ops import check_flash_write

__all__ = ["RotaryEmbedding", "rope_and_cache", "FAMILY"]

_POS = ("int", "long long")  # positions: int32 or int64
_TYPES = [CTYPE[d] for d in FLOAT_DTYPES]


def _rope(t, pos, vec):
    return f"cupaged::rope_kernel<{t}, {pos}, {'true' if vec else 'false'}>"


def _fused(t, kv, pos, slot, vec):
    return f"cupaged::rope_and_cache_kernel<{t}, {kv}, {pos}, {slot}, {'true' if vec else 'false'}>"


FAMILY = KernelFamily("rope", [
    *(_rope(t, p, v) for t in _TYPES for p in _POS for v in (False, True)),
    *(_fused(t, kv, p, s, v) for t in _TYPES for kv in KV_KINDS for p in _POS for s in _POS for v in (False, True)),
])


def _vec(arrays, strides, itemsize, *sizes) -> bool:
    """16-byte accesses: every array 16-byte aligned, every stride and size a multiple of 16 / itemsize elements."""
    n = 16 // itemsize
    return all(address(a) % 16 == 0 for a in arrays) and all(x % n == 0 for x in (*strides, *sizes))


@functools.cache
def _params_dtype() -> np.dtype:
    return struct_dtype(FAMILY.source, "RopeParams")


def _threads() -> int:
    return constants(FAMILY.source, "ROPE_THREADS")["ROPE_THREADS"]


def _check_rotary_dim(rotary_dim: int) -> None:
    """The kernels hold a token's cos / sin row in shared memory: ROPE_MAX_DIM values at most."""
    limit = constants(FAMILY.source, "ROPE_MAX_DIM")["ROPE_MAX_DIM"]
    if rotary_dim > limit:
        raise NotImplementedError(f"rotary_dim={rotary_dim}: at most {limit} rotary dimensions")


def inv_freq(rotary_dim: int, rope_theta: float, scaling: dict | None) -> np.ndarray:
    """float64 ``[rotary_dim / 2]``: rope_theta^(-2i / rotary_dim), with Llama 3's frequency scaling when
    ``scaling`` (Hugging Face's ``rope_scaling``: rope_type "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) says so."""
    freqs = 1.0 / rope_theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if scaling is None:
        return freqs
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    return np.where(wavelen < old / high, freqs,
                    np.where(wavelen > old / low, freqs / factor, (1 - smooth) * freqs / factor + smooth * freqs))


def _check_scaling(scaling) -> dict | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be None or Hugging Face's rope_scaling dict, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise NotImplementedError(f"scaling rope_type={kind!r}: only 'llama3' frequency scaling is implemented")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if k not in scaling]
    if missing:
        raise ValueError(f"scaling (rope_type 'llama3') lacks {', '.join(missing)}")
    # Hugging Face's rules (_validate_llama3_parameters): the band between the two wavelength bounds is blended
    # over high - low, so high must exceed low; a factor under 1 would raise the low frequencies
    factor = check_float("scaling['factor']", scaling["factor"])
    if factor < 1:
        raise ValueError(f"scaling['factor'] must be >= 1, got {factor}")
    low, high = (check_float(f"scaling[{k!r}]", scaling[k], positive=True) for k in ("low_freq_factor",
                                                                                      "high_freq_factor"))
    if high <= low:
        raise ValueError(f"scaling['high_freq_factor'] must be greater than scaling['low_freq_factor'], got {high} "
                         f"and {low}")
    check_int("scaling['original_max_position_embeddings']", scaling["original_max_position_embeddings"], 1)
    return dict(scaling)


class RotaryEmbedding:
    """RoPE over the first ``rotary_dim`` dimensions (default: all) of heads of ``head_dim``: GPT-NeoX style
    (pairs i, i + rotary_dim / 2) or GPT-J style (pairs 2i, 2i + 1), base ``rope_theta``, optional Llama 3
    frequency ``scaling`` (Hugging Face's ``rope_scaling`` dict)."""

    def __init__(self, head_dim, *, rope_theta=10000.0, is_neox_style=True, rotary_dim=None, scaling=None):
        self.head_dim = check_int("head_dim", head_dim, 2)
        self.rotary_dim = head_dim if rotary_dim is None else check_int("rotary_dim", rotary_dim, 2, head_dim)
        if self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {self.rotary_dim}")
        _check_rotary_dim(self.rotary_dim)
        self.rope_theta = check_float("rope_theta", rope_theta, positive=True)
        self.is_neox_style = check_bool("is_neox_style", is_neox_style)
        self.scaling = _check_scaling(scaling)
        self.inv_freq = inv_freq(self.rotary_dim, self.rope_theta, self.scaling)  # float64 [rotary_dim / 2]
        self._device_freq: dict = {}  # device_key(xp) -> inv_freq where that backend's kernels read it

    def cos_sin_cache(self, max_position) -> np.ndarray:
        """float32 ``[max_position, rotary_dim]``: the cosines of the rotary_dim / 2 frequencies at each position,
        then their sines (vLLM's layout; computed in float64, rounded once)."""
        n = check_int("max_position", max_position, 1)
        angles = np.arange(n, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)

    @accepts_foreign_arrays
    def __call__(self, positions, q, k):
        """Rotate ``q`` ``[num_tokens, num_heads, head_dim]`` and ``k`` ``[num_tokens, num_kv_heads, head_dim]``
        in place at ``positions`` (int64 or int32 ``[num_tokens]``); returns ``(q, k)``. cos and sin are computed
        in the kernel from the float64 frequencies (no cache: any position)."""
        xp = op_array_module(positions=positions, q=q, k=k)
        _check_qk(q, k, positions, self.head_dim, self.rotary_dim)
        check_no_overlap((("q", q), ("k", k)))
        if q.shape[0] == 0:
            return q, k
        key = device_key(xp)
        freq = self._device_freq.get(key)
        if freq is None:
            freq = self._device_freq[key] = to_device(xp, self.inv_freq, "RotaryEmbedding's frequencies (call it "
                                                      "once before capturing a CUDA graph)")
        p = _params(q, k, None, self.rotary_dim, self.is_neox_style)
        vec = _vec((q, k), (*element_strides("q", q)[:2], *element_strides("k", k)[:2]), q.itemsize,
                   self.rotary_dim // 2)
        kernel = FAMILY.function(_rope(CTYPE[q.dtype], CTYPE[positions.dtype], vec), xp)
        with op_launch(xp, "rope", lambda: f"t={q.shape[0]} h={q.shape[1]}/{k.shape[1]} d={self.head_dim} "
                       f"rot={self.rotary_dim}", lambda: _rope_cost(q, k, positions)):
            kernel((q.shape[0],), (_threads(),), (positions, q, k, None, freq, struct_arg(p, xp)))
        return q, k


def _check_qk(q, k, positions, head_size, rotary_dim=None):
    check_ndim("q", q, 3, "[num_tokens, num_heads, head_size]")
    check_ndim("k", k, 3, "[num_tokens, num_kv_heads, head_size]")
    check_dtype("q", q, FLOAT_DTYPES)
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if q.shape[2] != head_size or k.shape[2] != head_size:
        raise ValueError(f"q and k must have head size {head_size}, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have q's {q.shape[0]} tokens, got {k.shape[0]}")
    for name, a in (("q", q), ("k", k)):
        check_last_contiguous(name, a)
        check_writable(name, a)
    check_ndim("positions", positions, 1, "[num_tokens]")
    check_dtype("positions", positions, SLOT_DTYPES)
    if positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions must have num_tokens={q.shape[0]} entries, got {positions.shape[0]}")
    if q.shape[0] > 1 and positions.strides[0] != positions.itemsize:
        raise ValueError(f"positions must be contiguous, got stride {positions.strides[0]} bytes")


def _params(q, k, v, rotary_dim, neox, cache_strides=(0, 0, 0), scales=(1.0, 1.0, 0), block_size=1):
    qs, ks = element_strides("q", q), element_strides("k", k)
    vs = element_strides("v", v) if v is not None else (0, 0)
    values = (*qs[:2], *ks[:2], *vs[:2], *cache_strides, *scales, q.shape[1], k.shape[1], q.shape[2], rotary_dim,
              int(neox), block_size)
    return np.array(tuple(values), _params_dtype())


def _rope_cost(q, k, positions) -> Cost:
    """Every q and k element read and written once, and the positions."""
    return Cost(2 * (q.size + k.size) * q.itemsize + positions.nbytes, 0)


@accepts_foreign_arrays
def rope_and_cache(q, k, v, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, kv_cache_dtype="auto",
                   k_scale=1.0, v_scale=1.0, *, is_neox_style=True, layout="NHD", validate=None):
    """Rotate ``q`` and ``k`` in place at ``positions`` with ``cos_sin_cache`` (float32 ``[max_position,
    rotary_dim]``, :meth:`RotaryEmbedding.cos_sin_cache`; the first rotary_dim dimensions of each head), then write
    the rotated k and ``v`` into the flash-layout caches at ``slot_mapping`` as :func:`reshape_and_cache_flash`
    does (NHD / HND, fp8 with scales, negative slots skipped): one launch. Returns ``(q, k)``."""
    xp = op_array_module(q=q, k=k, v=v, positions=positions, cos_sin_cache=cos_sin_cache, key_cache=key_cache,
                         value_cache=value_cache, slot_mapping=slot_mapping)
    neox = check_bool("is_neox_style", is_neox_style)
    ctype, cache_strides, scales, block_size = check_flash_write(k, v, key_cache, value_cache, slot_mapping,
                                                                kv_cache_dtype, k_scale, v_scale, layout, validate, xp,
                                                                names=("k", "v"))
    _check_qk(q, k, positions, k.shape[2])
    check_no_overlap((("q", q), ("k", k), ("key_cache", key_cache), ("value_cache", value_cache)), (("v", v),))
    check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim]")
    check_dtype("cos_sin_cache", cos_sin_cache, (np.float32,))
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or not 2 <= rotary_dim <= k.shape[2] or cos_sin_cache.shape[0] == 0:
        raise ValueError(f"cos_sin_cache must be [max_position >= 1, rotary_dim] with rotary_dim even and at most "
                         f"head_size={k.shape[2]}, got shape {tuple(cos_sin_cache.shape)}")
    _check_rotary_dim(rotary_dim)
    if cos_sin_cache.size > 1 and cos_sin_cache.strides != (rotary_dim * 4, 4):
        raise ValueError(f"cos_sin_cache must be C-contiguous, got strides {tuple(cos_sin_cache.strides)}")
    if validate_enabled(validate):  # check_flash_write checked the slots and scales
        pos = host_copy(positions)
        bad = np.flatnonzero((pos < 0) | (pos >= cos_sin_cache.shape[0]))
        if bad.size:
            raise ValueError(f"positions[{bad[0]}] = {pos[bad[0]]} is outside cos_sin_cache's "
                             f"{cos_sin_cache.shape[0]} positions")
    if q.shape[0] == 0:
        return q, k
    k_ptr, v_ptr, ksv, vsv, per_head = scales
    p = _params(q, k, v, rotary_dim, neox, cache_strides, (float(ksv), float(vsv), int(per_head)), block_size)
    vec = _vec((q, k, v, key_cache, value_cache), (*element_strides("q", q)[:2], *element_strides("k", k)[:2],
                                                   *element_strides("v", v)[:2], *cache_strides),
               q.itemsize, rotary_dim // 2, k.shape[2])
    kernel = FAMILY.function(_fused(ctype, KV_CODE[kv_cache_dtype], CTYPE[positions.dtype],
                                    CTYPE[slot_mapping.dtype], vec), module_of(q))
    with op_launch(xp, "rope_and_cache", lambda: f"t={q.shape[0]} h={q.shape[1]}/{k.shape[1]} d={k.shape[2]} "
                   f"rot={rotary_dim} {layout} {kv_dtype_name(kv_cache_dtype, k.dtype)}",
                   lambda: _fused_cost(q, k, positions, slot_mapping, key_cache.itemsize)):
        kernel((q.shape[0],), (_threads(),), (positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping,
                                             k_ptr, v_ptr, struct_arg(p, xp)))
    return q, k


def _fused_cost(q, k, positions, slot_mapping, cache_itemsize) -> Cost:
    """q and k read and written once, the cos / sin rows, and each written token's k and v into the cache."""
    written = int(np.count_nonzero(slot_mapping >= 0)) * k.shape[1] * k.shape[2]
    return Cost(2 * (q.size + k.size) * q.itemsize + written * (k.itemsize + 2 * cache_itemsize) +
                positions.nbytes + slot_mapping.nbytes, 0)
