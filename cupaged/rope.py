"""Rotary position embeddings (kernels_cu/rope.cu): :class:`RotaryEmbedding` (vLLM's interface: the cos/sin cache,
and a call that rotates q and k in place) and :func:`rope_and_cache`, RoPE fused with the flash-layout cache write
of k and v in one launch."""

from __future__ import annotations

import functools

import numpy as np

from cupaged._annotate import op_launch
from cupaged._backend import device_key, host_copy, is_host_array, module_of, struct_arg, to_device
from cupaged._cache_args import (KV_CODE, KV_KINDS, SLOT_DTYPES, check_no_overlap, check_slot_mapping, kv_dtype_name,
                                 op_array_module)
from cupaged._checks import (CTYPE, FLOAT_DTYPES, address, check_bool, check_dtype, check_int,
                             check_last_contiguous, check_ndim, check_writable, element_strides, validate_enabled)
from cupaged._cost import Cost
from cupaged._interop import accepts_foreign_arrays
from cupaged._mirror import constants, struct_dtype
from cupaged._rope_scaling import resolve
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


class RotaryEmbedding:
    """RoPE over the first ``rotary_dim`` dimensions (default: all) of heads of ``head_dim``: GPT-NeoX style
    (pairs i, i + rotary_dim / 2) or GPT-J style (pairs 2i, 2i + 1), base ``rope_theta`` (default: ``scaling``'s
    "rope_theta", else 10000), and Hugging Face's frequency ``scaling`` (a ``rope_scaling`` / ``rope_parameters``
    dict; rope_type "default", "linear", "dynamic", "yarn", "longrope" or "llama3", with transformers' meaning, see
    cupaged/_rope_scaling.py). ``max_position_embeddings``: the model's context length M, which "dynamic", "yarn"
    and "longrope" read as transformers does (the original length O when the dict has no
    original_max_position_embeddings; factor = M / O for "yarn" and "longrope" when it has one). A
    "partial_rotary_factor" in the dict sets rotary_dim = int(head_dim * it) when rotary_dim is None, and must agree
    with it otherwise.

    ``attention_factor``: the factor "yarn" and "longrope" multiply cos and sin by (transformers'
    attention_scaling; 1 for the others). ``per_length``: True for "dynamic" and "longrope", whose frequencies depend
    on a sequence's current length L (last position + 1): past O, dynamic NTK raises the base and longrope takes its
    long factors. ``inv_freq``: the frequencies for L <= O (or L unknown)."""

    def __init__(self, head_dim, *, rope_theta=None, is_neox_style=True, rotary_dim=None, scaling=None,
                 max_position_embeddings=None):
        self.head_dim = check_int("head_dim", head_dim, 2)
        self._rope = resolve(self.head_dim, rotary_dim, rope_theta, scaling, max_position_embeddings)
        self.rotary_dim, self.rope_theta = self._rope.rotary_dim, self._rope.rope_theta
        _check_rotary_dim(self.rotary_dim)
        self.is_neox_style = check_bool("is_neox_style", is_neox_style)
        self.scaling = None if self._rope.rope_type == "default" else dict(scaling)
        self.max_position_embeddings = max_position_embeddings
        self.attention_factor = self._rope.attention_factor
        self.per_length = self._rope.per_length
        self.inv_freq = self._rope.frequencies()  # float64 [rotary_dim / 2]
        self._device_freq: dict = {}  # (device_key(xp), length key) -> frequencies where that backend's kernels read

    def frequencies(self, seq_len=None) -> np.ndarray:
        """float64 ``[rotary_dim / 2]``: the frequencies for a sequence whose current length (last position + 1)
        is ``seq_len`` (None: the original ones, ``inv_freq``)."""
        if seq_len is not None:
            seq_len = check_int("seq_len", seq_len, 1)
        return self._rope.frequencies(self._rope.length_key(seq_len))

    def cos_sin_cache(self, max_position, *, seq_len=None) -> np.ndarray:
        """float32 ``[max_position, rotary_dim]``: the cosines of the rotary_dim / 2 frequencies (for a sequence of
        current length ``seq_len``, see :meth:`frequencies`) at each position, then their sines (vLLM's layout),
        times ``attention_factor``; computed in float64, rounded once."""
        n = check_int("max_position", max_position, 1)
        return _table(np.arange(n), self.frequencies(seq_len), self.attention_factor)

    def cos_sin_rows(self, positions, seq_lens) -> np.ndarray:
        """float32 ``[num_tokens, rotary_dim]``: row t is :meth:`cos_sin_cache`'s row ``positions[t]`` for a
        sequence of current length ``seq_lens[t]`` (host numpy int arrays ``[num_tokens]``). For the per-length
        scalings, a table for ``rope_and_cache`` at positions ``arange(num_tokens)`` that gives each sequence its own
        frequencies."""
        positions, seq_lens = _host_ints("positions", positions), _host_ints("seq_lens", seq_lens)
        if seq_lens.shape != positions.shape:
            raise ValueError(f"seq_lens must have positions' {positions.shape[0]} entries, got {seq_lens.shape[0]}")
        for name, a, low in (("positions", positions, 0), ("seq_lens", seq_lens, 1)):
            bad = np.flatnonzero(a < low)
            if bad.size:
                raise ValueError(f"{name}[{bad[0]}] = {a[bad[0]]} must be >= {low}")
        if not self.per_length:
            return _table(positions, self.inv_freq, self.attention_factor)
        out = np.empty((positions.shape[0], self.rotary_dim), np.float32)
        lengths, which = np.unique(seq_lens, return_inverse=True)
        groups: dict = {}  # length key -> indices into lengths
        for j, length in enumerate(lengths.tolist()):
            groups.setdefault(self._rope.length_key(length), []).append(j)
        for key, js in groups.items():
            rows = np.flatnonzero(np.isin(which, js))
            out[rows] = _table(positions[rows], self._rope.frequencies(key), self.attention_factor)
        return out

    @accepts_foreign_arrays
    def __call__(self, positions, q, k):
        """Rotate ``q`` ``[num_tokens, num_heads, head_dim]`` and ``k`` ``[num_tokens, num_kv_heads, head_dim]``
        in place at ``positions`` (int64 or int32 ``[num_tokens]``); returns ``(q, k)``. cos and sin are computed
        in the kernel from the float64 frequencies, times ``attention_factor`` (no cache: any position). The
        per-length scalings ("dynamic", "longrope") take the frequencies of one sequence of length
        max(positions) + 1, as transformers does: that maximum is read on the host (from a cupy array, a device
        read that synchronizes and cannot be captured in a CUDA graph); for a batch of several sequences use
        :meth:`cos_sin_rows` with :func:`rope_and_cache`."""
        xp = op_array_module(positions=positions, q=q, k=k)
        _check_qk(q, k, positions, self.head_dim, self.rotary_dim)
        check_no_overlap((("q", q), ("k", k)))
        if q.shape[0] == 0:
            return q, k
        length = self._rope.length_key(int(host_copy(positions).max()) + 1) if self.per_length else None
        key = (device_key(xp), length)
        freq = self._device_freq.get(key)
        if freq is None:
            if isinstance(length, int):  # dynamic NTK: one table per length, keep the latest only
                self._device_freq = {kk: v for kk, v in self._device_freq.items() if not isinstance(kk[1], int)}
            freq = self._device_freq[key] = to_device(xp, self._rope.frequencies(length), "RotaryEmbedding's "
                                                      "frequencies (call it once before capturing a CUDA graph)")
        p = _params(q, k, None, self.rotary_dim, self.is_neox_style, attention_factor=self.attention_factor)
        vec = _vec((q, k), (*element_strides("q", q)[:2], *element_strides("k", k)[:2]), q.itemsize,
                   self.rotary_dim // 2)
        kernel = FAMILY.function(_rope(CTYPE[q.dtype], CTYPE[positions.dtype], vec), xp)
        with op_launch(xp, "rope", lambda: f"t={q.shape[0]} h={q.shape[1]}/{k.shape[1]} d={self.head_dim} "
                       f"rot={self.rotary_dim}", lambda: _rope_cost(q, k, positions)):
            kernel((q.shape[0],), (_threads(),), (positions, q, k, None, freq, struct_arg(p, xp)))
        return q, k


def _table(positions, freqs, attention_factor) -> np.ndarray:
    """float32 [len(positions), rotary_dim]: cos then sin of position x frequency in float64, times the attention
    factor, rounded once."""
    angles = positions.astype(np.float64)[:, None] * freqs[None, :]
    return (np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * attention_factor).astype(np.float32)


def _host_ints(name, a) -> np.ndarray:
    if not is_host_array(a):
        raise TypeError(f"{name} must be a host numpy array, got {type(a).__name__}")
    check_ndim(name, a, 1, "[num_tokens]")
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got {a.dtype}")
    return a.astype(np.int64, copy=False)


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


def _params(q, k, v, rotary_dim, neox, cache_strides=(0, 0, 0), scales=(1.0, 1.0, 0), block_size=1,
            attention_factor=1.0):
    qs, ks = element_strides("q", q), element_strides("k", k)
    vs = element_strides("v", v) if v is not None else (0, 0)
    values = (*qs[:2], *ks[:2], *vs[:2], *cache_strides, attention_factor, *scales, q.shape[1], k.shape[1],
              q.shape[2], rotary_dim, int(neox), block_size)
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
