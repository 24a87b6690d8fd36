"""Argument checks shared by the attention ops (docs/conventions.md §4-5): every message names the argument."""

from __future__ import annotations

import functools
import math

import numpy as np

from cupaged._backend import array_kind, empty, host_copy, is_device_array, module_of, on_sim, upload
from cupaged._cache_args import cache_dtype, check_index
from cupaged._checks import FLOAT_DTYPES, address, check_array, check_choice, check_dtype, check_float, \
    check_last_contiguous, check_ndim, check_optional_int, check_writable, element_strides, float32_value

__all__ = ["check_q", "check_heads", "check_caches", "check_tables", "check_head_vector", "check_out", "check_written",
           "softmax_scales", "check_window", "validate_tables", "validate_offsets", "check_hint", "MAX_HEAD_SIZE"]

MAX_HEAD_SIZE = 256
INT32_MAX = 2**31 - 1


def check_q(q, name="q", max_head_size=MAX_HEAD_SIZE):
    check_ndim(name, q, 3, "[num_tokens, num_heads, head_size]")
    check_dtype(name, q, FLOAT_DTYPES)
    check_last_contiguous(name, q)
    num_tokens, num_heads, head_size = q.shape
    if head_size > max_head_size:
        raise NotImplementedError(f"head_size={head_size} ({name}'s last dimension): at most {max_head_size} is "
                                  f"supported")
    if num_heads == 0 or head_size == 0:
        raise ValueError(f"{name} must have at least one head and head_size >= 1, got shape {tuple(q.shape)}")
    return num_tokens, num_heads, head_size


def check_heads(num_heads: int, num_kv_heads: int, q_name: str = "q", kv_name: str = "key_cache") -> None:
    """GQA: every K/V head serves the same number of query heads."""
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} ({q_name}'s dimension 1) must be a multiple of "
                         f"num_kv_heads={num_kv_heads} ({kv_name})")


def _aligned(a, strides, x) -> bool:
    return address(a) % 16 == 0 and all(s % x == 0 for s in strides)


def check_caches(key_cache, value_cache, q, kv_cache_dtype, layout, layouts=("NHD", "HND")):
    """Cache shapes/dtypes for ``layout`` and the kernel's address strides (see paged_attention.cu)."""
    check_choice("layout", layout, layouts)
    check_q(q)
    check_array("key_cache", key_cache)
    check_array("value_cache", value_cache)
    want = cache_dtype(kv_cache_dtype, q.dtype)
    head_size = q.shape[2]
    x = 16 // want.itemsize
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype != want:
            raise TypeError(f"{name} must have dtype {want} for q {q.dtype} and kv_cache_dtype={kv_cache_dtype!r}, "
                            f"got {cache.dtype}")
        check_last_contiguous(name, cache)
    if layout == "vllm":
        check_ndim("key_cache", key_cache, 5, "[num_blocks, num_kv_heads, head_size // x, block_size, x]")
        check_ndim("value_cache", value_cache, 4, "[num_blocks, num_kv_heads, head_size, block_size]")
        nb, kv_heads, chunks, block_size, kx = key_cache.shape
        if kx != x or chunks * x != head_size:
            raise ValueError(f"key_cache must be [num_blocks, num_kv_heads, {head_size // x}, block_size, {x}] for "
                             f"head_size={head_size} and a {want} cache, got {tuple(key_cache.shape)}")
        if value_cache.shape != (nb, kv_heads, head_size, block_size):
            raise ValueError(f"value_cache must be [{nb}, {kv_heads}, {head_size}, {block_size}], got "
                             f"{tuple(value_cache.shape)}")
        ks, vs = element_strides("key_cache", key_cache), element_strides("value_cache", value_cache)
        k = dict(k_block_stride=ks[0], k_head_stride=ks[1], k_chunk_stride=ks[2], k_page_stride=ks[3])
        v = dict(v_block_stride=vs[0], v_head_stride=vs[1], v_page_stride=vs[3], v_dim_stride=vs[2])
    else:
        dims = "[num_blocks, block_size, num_kv_heads, head_size]" if layout == "NHD" else \
            "[num_blocks, num_kv_heads, block_size, head_size]"
        check_ndim("key_cache", key_cache, 4, dims)
        check_ndim("value_cache", value_cache, 4, dims)
        heads_axis, page_axis = (2, 1) if layout == "NHD" else (1, 2)
        if key_cache.shape[3] != head_size:
            raise ValueError(f"key_cache's head_size {key_cache.shape[3]} must equal q's {head_size}")
        if value_cache.shape != key_cache.shape:
            raise ValueError(f"value_cache must have key_cache's shape {tuple(key_cache.shape)}, "
                             f"got {tuple(value_cache.shape)}")
        kv_heads, block_size = key_cache.shape[heads_axis], key_cache.shape[page_axis]
        ks, vs = element_strides("key_cache", key_cache), element_strides("value_cache", value_cache)
        k = dict(k_block_stride=ks[0], k_head_stride=ks[heads_axis], k_chunk_stride=x, k_page_stride=ks[page_axis])
        v = dict(v_block_stride=vs[0], v_head_stride=vs[heads_axis], v_page_stride=vs[page_axis], v_dim_stride=1)
    if kv_heads == 0 or block_size == 0:
        raise ValueError(f"key_cache must have num_kv_heads >= 1 and block_size >= 1, got {tuple(key_cache.shape)}")
    vec_k = _aligned(key_cache, [s for n, s in k.items() if n != "k_chunk_stride"], x) and k["k_chunk_stride"] % x == 0
    if v["v_dim_stride"] == 1:  # V rows, as K's
        vec_v = _aligned(value_cache, list(v.values())[:3], x)
    else:  # vLLM's V^T: runs of x keys of one dimension, 16-byte aligned and never across a block
        vec_v = block_size % x == 0 and _aligned(value_cache, [v["v_block_stride"], v["v_head_stride"],
                                                               v["v_dim_stride"]], x)
    return dict(kv_heads=kv_heads, block_size=block_size, vec_k=int(vec_k), vec_v=int(vec_v), **k, **v)


def check_tables(block_tables, seq_lens, query_start_loc, num_tokens, dense=False):
    """Index arrays of a paged-attention call (``dense`` K/V rows: no block_tables, seq_lens is cu_seqlens_k);
    returns num_seqs."""
    if dense:
        if block_tables is not None:
            raise ValueError(f"block_tables must be None for dense K/V (KvView.dense), got "
                             f"{type(block_tables).__name__}")
        check_index("seq_lens", seq_lens, 1, "[num_seqs + 1] (cu_seqlens_k of dense K/V)")
        num_seqs = seq_lens.shape[0] - 1
        if num_seqs < 0:
            raise ValueError("seq_lens (cu_seqlens_k of dense K/V) must have num_seqs + 1 >= 1 entries, got 0")
    else:
        check_index("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
        check_index("seq_lens", seq_lens, 1, "[num_seqs]")
        num_seqs = seq_lens.shape[0]
        if block_tables.shape[0] != num_seqs:
            raise ValueError(f"block_tables must have num_seqs={num_seqs} rows (seq_lens' length), got "
                             f"{block_tables.shape[0]}")
    if query_start_loc is None:
        if num_tokens != num_seqs:
            raise ValueError(f"without query_start_loc (decode) q must have one token per sequence: "
                             f"num_tokens={num_tokens}, num_seqs={num_seqs}")
    else:
        check_index("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
        if query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, got "
                             f"{query_start_loc.shape[0]}")
    if num_seqs > 65535:
        raise NotImplementedError(f"seq_lens: at most 65535 sequences per call, got {num_seqs}")
    return num_seqs


def check_head_vector(name, a, num_heads, xp):
    """None, or float32 [num_heads] (a numpy array beside cupy data is uploaded)."""
    if a is None:
        return None
    if array_kind(a) is None:
        raise TypeError(f"{name} must be a float32 array [num_heads], got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    if a.shape != (num_heads,):
        raise ValueError(f"{name} must be [num_heads] = [{num_heads}], got shape {tuple(a.shape)}")
    if is_device_array(a) and on_sim(xp):
        raise TypeError(f"{name} is a cupy array but the data arrays are numpy (sim backend)")
    return xp.ascontiguousarray(a) if module_of(a) is xp else upload(xp, a, name)


def check_out(out, like, name, shape=None):
    """``out`` given: written as :func:`check_written` says, of ``like``'s dtype; else a new array."""
    shape = tuple(like.shape) if shape is None else tuple(shape)
    if out is None:
        return empty(module_of(like), shape, like.dtype)
    check_written(name, out, shape, like.dtype)
    return out


def check_written(name, a, shape, dtype, contiguous=False) -> None:
    """An array an op writes: ``shape``, ``dtype``, writable, contiguous in its last dimension (in every one with
    ``contiguous``: the kernels index it as dense)."""
    try:
        got = a.shape
    except AttributeError:
        raise TypeError(f"{name} must be a numpy or cupy array of shape {shape}, got {type(a).__name__}") from None
    if got != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(got)}")
    if a.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {a.dtype}")
    if not contiguous:
        check_last_contiguous(name, a)
    elif not a.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous (C order), got strides {tuple(a.strides)}")
    check_writable(name, a)


LOG2E = float32_value(math.log2(math.e))
_FOLDED_MAX = float(np.finfo(np.float32).max) / LOG2E
_SCALAR_TYPES = frozenset({float, int, type(None), np.float64, np.float32, np.float16})


def softmax_scales(scale, softcap=None, head_size=None) -> tuple[float, float | None]:
    """(scale, softcap or None: off) as the attention kernels take them. ``scale`` None: 1/sqrt(head_size) (required
    when head_size is None). Each must be a finite positive float32 that stays finite with log2(e) folded in (the
    kernels' exp2), and scale / softcap too (softcap divides the logits); softcap None or 0 is off (FlashAttention's
    and vLLM's). Memoized per value: the hot path (run_attention) pays a dictionary lookup."""
    if type(scale) in _SCALAR_TYPES and type(softcap) in _SCALAR_TYPES:
        return _softmax_scales(scale, softcap, head_size)
    return _softmax_scales.__wrapped__(scale, softcap, head_size)


@functools.lru_cache(maxsize=1024, typed=True)  # typed: 1 and True (rejected) are different keys
def _softmax_scales(scale, softcap, head_size):
    scale = 1.0 / math.sqrt(head_size) if scale is None and head_size is not None else _folded("scale", scale)
    if softcap is None or check_float("softcap", softcap) == 0:
        return scale, None
    softcap = _folded("softcap", softcap)
    if not math.isfinite(float32_value(float32_value(scale) / float32_value(softcap))):
        raise ValueError(f"scale / softcap must be finite as a float32 (the kernels divide the scaled logits by "
                         f"softcap), got scale={scale} / softcap={softcap}")
    return scale, softcap


def _folded(name: str, value) -> float:
    """A positive float whose float32 is neither 0 nor, times log2(e), infinite."""
    value = check_float(name, value)
    rounded = float32_value(value)
    if value <= 0 or rounded == 0 or not math.isfinite(float32_value(rounded * LOG2E)):
        off = "; None or 0 turns it off" if name == "softcap" else ""
        raise ValueError(f"{name} must be a positive float32 in [1.4e-45, {_FOLDED_MAX:.4g}] (the kernels fold log2(e) "
                         f"into it{off}), got {value}")
    return value


def check_window(sliding_window, window_size, causal) -> tuple[int, tuple[int, int] | None]:
    """(sliding_window as an int, 0 = none; window_size as (left, right) or None): FlashAttention's window_size,
    two ints >= -1 (-1: unbounded; (-1, -1) is no window), never given together with sliding_window."""
    window = check_optional_int("sliding_window", sliding_window, 0) or 0
    if window and not causal:
        raise ValueError("sliding_window requires causal=True (window_size=(left, right) takes non-causal windows)")
    if window_size is None:
        return window, None
    try:
        left, right = window_size
        ok = all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and -1 <= x <= INT32_MAX
                 for x in (left, right))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"window_size must be (left, right), two ints in [-1, {INT32_MAX}] (-1: unbounded), got "
                         f"{window_size!r}")
    if window:
        raise ValueError(f"give sliding_window={sliding_window} or window_size={tuple(window_size)}, not both")
    return 0, (int(left), int(right))


def check_hint(name: str, hint, actual: int, what: str) -> None:
    """validate=True: a host-side hint must not understate the contents (it sizes the grid)."""
    if hint is not None and hint < actual:
        raise ValueError(f"{name}={hint} understates {what} = {actual}")


def validate_offsets(name: str, offsets, end: int, exact: bool = True) -> np.ndarray:
    """validate=True: cumulative offsets (query_start_loc, cu_seqlens) start at 0, never decrease and end
    at ``end`` (at most ``end`` unless ``exact``); returns the per-sequence lengths (reads device arrays)."""
    c = host_copy(offsets).astype(np.int64)
    if c[0] != 0 or np.any(np.diff(c) < 0) or (c[-1] != end if exact else c[-1] > end):
        raise ValueError(f"{name} must start at 0, be non-decreasing and end at {'' if exact else 'most at '}{end}, "
                         f"got {c.tolist() if c.size <= 8 else c}")
    return np.diff(c)


def validate_tables(block_tables, seq_lens, query_start_loc, num_blocks, block_size, num_tokens, *,
                    max_query_len=None, max_seq_len=None):
    """validate=True: the contents of a paged call's index arrays and its hints (reads device arrays)."""
    lens = host_copy(seq_lens).astype(np.int64)
    if lens.size and lens.min() < 0:
        raise ValueError(f"seq_lens must be >= 0, got seq_lens[{lens.argmin()}] = {lens.min()}")
    if query_start_loc is not None:
        q_lens = validate_offsets("query_start_loc", query_start_loc, num_tokens)
        if np.any(q_lens > lens):
            s = int(np.argmax(q_lens > lens))
            raise ValueError(f"every sequence needs q_len <= seq_len (query_start_loc against seq_lens): sequence "
                             f"{s} has {q_lens[s]} queries and seq_lens[{s}] = {lens[s]}")
        if q_lens.size:
            check_hint("max_query_len", max_query_len, int(q_lens.max()),
                       f"the longest query, sequence {int(q_lens.argmax())}'s")
    if lens.size:
        check_hint("max_seq_len", max_seq_len, int(lens.max()), f"seq_lens[{int(lens.argmax())}]")
    need = -(-lens // block_size)
    table = host_copy(block_tables)
    if need.size and need.max() > table.shape[1]:
        s = int(need.argmax())
        raise ValueError(f"seq_lens[{s}] = {lens[s]} needs {need[s]} blocks, but block_tables has {table.shape[1]} "
                         "columns")
    for s, n in enumerate(need):
        ids = table[s, :n]
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(f"block_tables[{s}] holds block id {bad}, outside the pool of {num_blocks} blocks")
