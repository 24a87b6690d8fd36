"""Test helpers, like ``numpy.testing``: what every cupaged test, the selftest and the benchmarks share.

    TOLERANCES, tolerance()  the one tolerance table (docs/conventions.md §4)
    compare(), assert_close()  the elementwise rule |got - ref| <= atol + rtol · |ref|; NaN never passes
    poison(), poisoned()     NaN in float arrays, 0xFF bytes in uint8 (fp8) caches: a read of an unused slot shows
    paged_kv()               random K/V per sequence in a paged cache as an engine leaves one: shuffled block
                             ids, garbage past each table row's live blocks, every unused slot poisoned

Arrays may be numpy, guarded sim memory or CuPy (``device="numpy" | "sim" | "cuda"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from cupaged import _backend
from cupaged.reference import quantize_fp8

__all__ = ["TOLERANCES", "tolerance", "Comparison", "compare", "assert_close", "poison", "poisoned", "PagedKV",
           "paged_kv"]

TOLERANCES = {  # (atol, rtol); an fp8 cache is compared against the dequantized reference
    np.dtype(np.float32): (1e-5, 1e-5),
    np.dtype(np.float16): (1e-3, 1e-3),
    np.dtype(ml_dtypes.bfloat16): (4e-3, 4e-3),
    "fp8": (2e-2, 2e-2),
    "lse": (1e-4, 1e-4),
}
_FLOATS = {np.dtype(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)}


def tolerance(dtype, kv_cache_dtype="auto"):
    """(atol, rtol) of an output of ``dtype``, loosened to fp8's when read from an fp8 cache."""
    tol = TOLERANCES[np.dtype(dtype)]
    return max(tol, TOLERANCES["fp8"]) if kv_cache_dtype != "auto" else tol


def _atol_rtol(dtype, atol, rtol, actual):
    if atol is not None or rtol is not None:
        return atol or 0.0, rtol or 0.0
    if isinstance(dtype, tuple):
        return dtype
    key = dtype if isinstance(dtype, str) else np.dtype(actual.dtype if dtype is None else dtype)
    if key not in TOLERANCES:
        raise ValueError(f"no tolerance for {key!r}: pass a dtype of TOLERANCES, 'lse', 'fp8' or atol=/rtol=")
    return TOLERANCES[key]


class Comparison(NamedTuple):
    """The elementwise rule over two arrays, summarised by the element nearest (or furthest past) its bound."""
    error: float  # |actual - desired| there (inf where either is NaN)
    bound: float  # atol + rtol · |desired| there
    index: tuple  # where: the largest error / bound
    actual: float
    desired: float
    failures: int  # elements with error > bound
    size: int

    @property
    def ratio(self) -> float:
        """error / bound at the worst element: above 1 fails (inf for any error under a zero bound)."""
        return self.error / self.bound if self.bound > 0 else (np.inf if self.error > 0 else 0.0)


def compare(actual, desired, dtype=None, *, atol=None, rtol=None) -> Comparison:
    """Apply |actual - desired| <= atol + rtol · |desired| elementwise. ``dtype``: a dtype or key of
    TOLERANCES ("lse", "fp8") or an (atol, rtol) pair; None: ``atol``/``rtol`` if given (0 if one is
    missing), else actual's dtype. An infinite ``desired`` needs the same infinity; NaN on either
    side always fails. Arrays may be numpy or CuPy; uint8 fp8 caches compare as codes."""
    got, ref = _backend.host_copy(actual), _backend.host_copy(desired)
    atol, rtol = _atol_rtol(dtype, atol, rtol, got)
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    if got.shape != ref.shape:
        raise AssertionError(f"shape {got.shape} != {ref.shape}")
    with np.errstate(invalid="ignore"):
        err = np.where(np.isinf(ref) & (got == ref), 0.0, np.abs(got - ref))
    err = np.where(np.isnan(err), np.inf, err)
    bound = atol + rtol * np.where(np.isfinite(ref), np.abs(ref), 0.0)
    if err.size == 0:
        return Comparison(0.0, float(atol), (), np.nan, np.nan, 0, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(bound > 0, err / bound, np.where(err > 0, np.inf, 0.0))
    i = np.unravel_index(int(np.argmax(ratio)), err.shape)
    return Comparison(float(err[i]), float(bound[i]), tuple(int(j) for j in i), float(got[i]), float(ref[i]),
                      int(np.count_nonzero(err > bound)), err.size)


def assert_close(actual, desired, dtype=None, what="output", *, atol=None, rtol=None):
    """Raise AssertionError unless |actual - desired| <= atol + rtol · |desired| holds for every element
    (see compare for ``dtype``, ``atol`` and ``rtol``); the message names the worst element."""
    try:
        c = compare(actual, desired, dtype, atol=atol, rtol=rtol)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None
    if c.failures:
        atol, rtol = _atol_rtol(dtype, atol, rtol, _backend.host_copy(actual))
        raise AssertionError(f"{what}: {c.failures} of {c.size} elements out of tolerance (atol={atol}, rtol={rtol}); "
                             f"worst at {c.index}: got {c.actual}, ref {c.desired}, |got - ref| = {c.error:.4g} "
                             f"> {c.bound:.4g}")


def _poison_value(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or dtype in _FLOATS:
        return np.array(np.nan).astype(dtype)
    return np.frombuffer(b"\xff" * dtype.itemsize, dtype)[0]


def poison(a, where=Ellipsis):
    """Fill ``a[where]`` with NaN (float dtypes) or 0xFF bytes (uint8 fp8 codes: NaN in e4m3 and e5m2;
    other integer dtypes too); returns ``a``. numpy, sim or CuPy arrays."""
    a[where] = _poison_value(a.dtype)
    return a


DEVICES = ("numpy", "sim", "cuda")


def _check_device(device):
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda" and _backend.gpu_module() is None:
        raise RuntimeError("device='cuda' needs cupy and a GPU")


def _to_device(a, device):
    """Host array ``a`` where ``device`` keeps its arrays: itself, copied into guarded sim memory, or uploaded."""
    if device == "numpy":
        return a
    if device == "sim":
        out = _backend.empty(np, a.shape, a.dtype)
        out[...] = a
        return out
    return _backend.upload(_backend.gpu_module(), a)


def poisoned(shape, dtype, device="numpy"):
    """A new poisoned array (see poison): numpy, guarded sim memory (``cupaged.sim.empty``) or CuPy."""
    _check_device(device)
    if device == "sim":
        return poison(_backend.empty(np, shape, dtype))
    return _to_device(poison(np.empty(shape, dtype)), device)


LAYOUTS = ("NHD", "HND", "vllm", "mla")


@dataclasses.dataclass
class PagedKV:
    """What paged_kv built; the arrays live on its ``device``, ``keys``/``values`` on the host."""
    key_cache: Any  # NHD [num_blocks, block_size, num_kv_heads, head_size]; HND [num_blocks, num_kv_heads,
    #                 block_size, head_size]; vllm [num_blocks, num_kv_heads, head_size // x, block_size, x];
    #                 mla [num_blocks, block_size, head_size] (the latent row: K, and V its first entries)
    value_cache: Any  # the same but vllm [num_blocks, num_kv_heads, head_size, block_size]; None for mla
    block_tables: Any  # int32 [num_seqs, max_blocks_per_seq]: live block ids, then garbage
    seq_lens: Any  # int32 [num_seqs]
    k_scale: Any  # fp8: a float, or float32 [num_kv_heads] with per_head_scales; 1.0 for "auto"
    v_scale: Any
    keys: list  # per sequence, its rows as the cache holds them: [seq_len, num_kv_heads, head_size] ([seq_len,
    #             head_size] for mla); rows before poison_before stay poisoned
    values: list | None


def _cache_shape(layout, which, num_blocks, block_size, num_kv_heads, head_size, itemsize):
    if layout == "mla":
        return num_blocks, block_size, head_size
    if layout == "NHD":
        return num_blocks, block_size, num_kv_heads, head_size
    if layout == "HND":
        return num_blocks, num_kv_heads, block_size, head_size
    x = 16 // itemsize
    if which == "v":
        return num_blocks, num_kv_heads, head_size, block_size
    return num_blocks, num_kv_heads, head_size // x, block_size, x


def _token_view(cache, layout, which):
    """``cache`` viewed as [num_blocks, block_size, ...]: view[block, offset] is one token's row."""
    if layout == "HND":
        return cache.transpose(0, 2, 1, 3)
    if layout == "vllm":
        return cache.transpose(0, 3, 1, 2, 4) if which == "k" else cache.transpose(0, 3, 1, 2)
    return cache


def _table(rng, need, num_blocks, width, table_tail):
    """Shuffled live block ids (each used once) followed by garbage: ids far past the pool (a read faults on
    the sim) or blocks that are not the row's own (another sequence's or a spare one)."""
    ids = rng.permutation(num_blocks)
    if table_tail == "out_of_range":
        table = rng.integers(num_blocks + 1000, 2**30, (len(need), width)).astype(np.int32)
    elif table_tail == "other_blocks":
        table = np.zeros((len(need), width), np.int32)
    else:
        raise ValueError(f"table_tail must be 'out_of_range' or 'other_blocks', got {table_tail!r}")
    starts = np.concatenate([[0], np.cumsum(need)]).astype(np.int64)
    for s, n in enumerate(need):
        table[s, :n] = ids[starts[s]:starts[s] + n]
        if table_tail == "other_blocks" and width > n:
            others = np.setdiff1d(np.arange(num_blocks), table[s, :n])
            if others.size == 0:
                raise ValueError("table_tail='other_blocks' needs another sequence's blocks or spare_blocks")
            table[s, n:] = rng.choice(others, width - n)
    return table


def paged_kv(seq_lens, *, block_size, head_size, num_kv_heads=1, dtype=np.float16, layout="NHD",
             kv_cache_dtype="auto", kv_scale=None, per_head_scales=False, spare_blocks=0, spare_columns=0,
             table_tail="out_of_range", poison_before=None, rng=None, device="numpy") -> PagedKV:
    """Random K/V (standard normal) for sequences of ``seq_lens`` tokens in a poisoned paged cache.

    Each sequence gets ceil(seq_len / block_size) blocks at shuffled ids, never shared; ``spare_blocks``
    more stay unused; a table row is max_blocks + ``spare_columns`` wide and garbage past its live blocks
    (``table_tail``: "out_of_range" or "other_blocks"). Every slot no token holds is poisoned (NaN, or
    0xFF in fp8 caches), and so are the positions before ``poison_before[s]`` (keys a sliding window
    never reads). fp8 (``kv_cache_dtype`` "fp8", "fp8_e4m3", "fp8_e5m2"): uint8 codes with scale
    ``kv_scale`` (K and V), or if None max|x| / 64 over the live values, per KV head with
    ``per_head_scales``. Draws from ``rng`` in a fixed order: the block ids, the table, then per
    sequence its keys and values."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _check_device(device)
    rng = np.random.default_rng(0) if rng is None else rng
    seq_lens = [int(s) for s in np.asarray(seq_lens).reshape(-1)]
    fp8 = kv_cache_dtype != "auto"
    cache_dtype = np.dtype(np.uint8 if fp8 else dtype)
    heads = 1 if layout == "mla" else num_kv_heads
    if layout == "vllm" and head_size % (16 // cache_dtype.itemsize):
        raise ValueError(f"the vllm layout needs head_size a multiple of {16 // cache_dtype.itemsize}")
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    table = _table(rng, need, num_blocks, max(need + [1]) + spare_columns, table_tail)
    which = ("k",) if layout == "mla" else ("k", "v")
    host = "sim" if device == "sim" else "numpy"
    caches = [poisoned(_cache_shape(layout, w, num_blocks, block_size, heads, head_size, cache_dtype.itemsize),
                       cache_dtype, host) for w in which]
    row_shape = (head_size,) if layout == "mla" else (heads, head_size)
    first = [0] * len(seq_lens) if poison_before is None else [max(0, int(p)) for p in poison_before]

    def draws():  # per sequence: (its live positions, one float32 [n, *row_shape] array per cache)
        for s, seq_len in enumerate(seq_lens):
            pos = np.arange(min(first[s], seq_len), seq_len)
            yield pos, [rng.standard_normal((len(pos), *row_shape)).astype(np.float32) for _ in which]

    rows = draws()
    scales = [1.0] * len(which)
    if fp8:
        if kv_scale is None:
            rows = list(rows)
            per_head = heads if per_head_scales and layout != "mla" else None
            scales = [_amax_scale([r[1][i] for r in rows], per_head) for i in range(len(which))]
        else:
            scales = [kv_scale if np.ndim(kv_scale) == 0 else np.asarray(kv_scale, np.float32)] * len(which)
    stored = [[] for _ in which]
    for s, (pos, values) in enumerate(rows):
        blocks, offsets = table[s, pos // block_size], pos % block_size
        for i, w in enumerate(which):
            x = values[i].astype(cache_dtype) if not fp8 else quantize_fp8(
                values[i], np.asarray(scales[i], np.float32).reshape(-1)[:, None], kv_cache_dtype)
            view = _token_view(caches[i], layout, w)
            view[blocks, offsets] = x.reshape((len(pos), *view.shape[2:]))
            full = poisoned((seq_lens[s], *row_shape), cache_dtype)
            full[pos] = x
            stored[i].append(full)
    caches = [_to_device(c, device) if device == "cuda" else c for c in caches]  # sim: built in place
    return PagedKV(caches[0], caches[1] if len(caches) > 1 else None, _to_device(table, device),
                   _to_device(np.array(seq_lens, np.int32), device), scales[0], scales[-1], stored[0],
                   stored[1] if len(stored) > 1 else None)


def _amax_scale(rows, per_head):
    """max|x| / 64 over the live values: a float, or float32 [per_head] per KV head; 1.0 where there are none."""
    amax = np.zeros(per_head or (), np.float32)
    for r in rows:
        if r.size:
            amax = np.maximum(amax, np.abs(r).max(axis=(0, 2) if per_head else None))
    scale = np.where(amax > 0, amax / np.float32(64), np.float32(1)).astype(np.float32)
    return scale if per_head else float(scale)
