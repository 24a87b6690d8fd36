"""Reading and moving cache blocks (kernels_cu/cache_gather.cu): gather rows of sequences into a dense
buffer (with fp8 dequantization), copy blocks inside a cache (copy-on-write), swap blocks between
caches (host <-> device, asynchronous copies through pinned memory: cupaged/_host_transfer.py)."""

from __future__ import annotations

import functools

import numpy as np

from cupaged._interop import accepts_foreign_arrays
from cupaged._annotate import op_launch
from cupaged._cache_args import KV_CODE, KV_KINDS, cache_dtype, check_block_mapping, check_index, check_no_overlap, \
    check_scale_values, op_array_module, scale_args
from cupaged._checks import CTYPE, FLOAT_DTYPES, address, check_dtype, check_int, check_last_contiguous, check_ndim, \
    check_writable, element_strides, validate_enabled
from cupaged._cost import Cost
from cupaged._host_transfer import swap_blocks_gpu
from cupaged._backend import array_kind, array_module, host_copy, is_host_array
from cupaged._mirror import constants
from cupaged._runtime import KernelFamily

__all__ = ["gather_and_maybe_dequant_cache", "cp_gather_cache", "copy_blocks", "swap_blocks"]

_WORDS = (1, 16)  # raw copies move 16-byte words when every address and stride allows, else bytes


def _gather(t, kv):
    return f"cupaged::gather_and_maybe_dequant_cache_kernel<{t}, {kv}>"


def _words(kernel, word):
    return f"cupaged::{kernel}<{word}>"


FAMILY = KernelFamily("cache_gather", [
    *(_gather(CTYPE[d], kv) for d in FLOAT_DTYPES for kv in KV_KINDS),
    *(_words(k, w) for k in ("cp_gather_cache_kernel", "copy_blocks_kernel") for w in _WORDS),
])


@functools.cache
def _threads() -> int:
    return constants(FAMILY.source, "CACHE_GATHER_THREADS")["CACHE_GATHER_THREADS"]


def _check_tables(block_table, cu_seq_lens, seq_starts, batch: int):
    check_index("block_table", block_table, 2, "[batch, max_blocks_per_seq]")
    check_index("cu_seq_lens", cu_seq_lens, 1, "[batch + 1]")
    if block_table.shape[0] < batch or cu_seq_lens.shape[0] < batch + 1:
        raise ValueError(f"block_table must have >= {batch} rows and cu_seq_lens >= {batch + 1} entries, got "
                         f"shapes {tuple(block_table.shape)} and {tuple(cu_seq_lens.shape)}")
    if seq_starts is not None:
        check_index("seq_starts", seq_starts, 1, "[batch]")
        if seq_starts.shape[0] < batch:
            raise ValueError(f"seq_starts must have >= {batch} entries, got {seq_starts.shape[0]}")


def _check_reads(src_cache, block_table, cu_seq_lens, seq_starts, seqs_of_tokens, skip_past_row=False):
    """validate=True: every (sequence, token) read stays inside its block-table row and the pool
    (``skip_past_row``: positions past the row are not read, so they pass)."""
    bt, cu = host_copy(block_table), host_copy(cu_seq_lens).astype(np.int64)
    if np.any(np.diff(cu) < 0) or cu[0] != 0:
        raise ValueError("cu_seq_lens must start at 0 and be non-decreasing")
    starts = host_copy(seq_starts).astype(np.int64) if seq_starts is not None else np.zeros(len(cu), np.int64)
    block_size, num_blocks = src_cache.shape[1], src_cache.shape[0]
    for b, tokens in seqs_of_tokens(cu):
        pos = tokens - cu[b] + starts[b]
        if skip_past_row:
            pos = pos[pos // block_size < bt.shape[1]]
        if pos.size == 0:
            continue
        idx = pos // block_size
        if idx.max() >= bt.shape[1] or pos.min() < 0:
            too_large = "cu_seq_lens" if seq_starts is None else "seq_starts / cu_seq_lens"
            raise ValueError(f"sequence {b} reads position {pos.max()}, past its block_table row of "
                             f"{bt.shape[1]} blocks x {block_size} ({too_large} too large)")
        ids = bt[b, idx]
        if ids.min() < 0 or ids.max() >= num_blocks:
            raise ValueError(f"block_table row {b} holds block id {ids.max() if ids.max() >= num_blocks else ids.min()}, "
                             f"outside the pool of {num_blocks} blocks")


@accepts_foreign_arrays
def gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                                   kv_cache_dtype="auto", scale=1.0, seq_starts=None, *, validate=None):
    """vLLM's ``gather_and_maybe_dequant_cache``: token ``t < num_tokens`` of sequence
    ``b = token_to_seq[t]`` reads logical position ``t - cu_seq_lens[b] (+ seq_starts[b])`` through
    ``block_table[b]`` from ``src_cache`` ``[num_blocks, block_size, entry_size]`` into ``dst[t]``
    (dequantized into dst's dtype for fp8). Tokens at or past ``cu_seq_lens[b + 1]``, and tokens whose
    position runs past the end of ``block_table[b]`` (a chunk's ``seq_starts`` past the row: vLLM's
    guard), are skipped: their dst rows are left as they were. Without ``seq_starts`` a sequence longer
    than its row is no such chunk: ``validate=True`` rejects it."""
    xp = op_array_module(("seq_starts",), src_cache=src_cache, dst=dst, block_table=block_table,
                         cu_seq_lens=cu_seq_lens, token_to_seq=token_to_seq, seq_starts=seq_starts)
    check_ndim("src_cache", src_cache, 3, "[num_blocks, block_size, entry_size]")
    check_ndim("dst", dst, 2, "[num_tokens, entry_size]")
    check_dtype("dst", dst, FLOAT_DTYPES)
    want = cache_dtype(kv_cache_dtype, dst.dtype)
    if src_cache.dtype != want:
        raise TypeError(f"src_cache must have dtype {want} for kv_cache_dtype={kv_cache_dtype!r} and dst "
                        f"{dst.dtype}, got {src_cache.dtype}")
    if dst.shape[1] != src_cache.shape[2]:
        raise ValueError(f"dst must be [num_tokens, {src_cache.shape[2]}] like src_cache's rows, got {tuple(dst.shape)}")
    check_last_contiguous("src_cache", src_cache)
    check_last_contiguous("dst", dst)
    check_writable("dst", dst)
    check_no_overlap((("dst", dst),), (("src_cache", src_cache),))
    num_tokens = check_int("num_tokens", num_tokens, 0)
    check_index("token_to_seq", token_to_seq, 1, "[num_tokens]")
    if not 0 <= num_tokens <= min(dst.shape[0], token_to_seq.shape[0]):
        raise ValueError(f"num_tokens={num_tokens} must be in [0, min(dst rows {dst.shape[0]}, "
                         f"token_to_seq entries {token_to_seq.shape[0]})]")
    batch = cu_seq_lens.shape[0] - 1 if cu_seq_lens.ndim == 1 else 0
    _check_tables(block_table, cu_seq_lens, seq_starts, batch)
    ptr, value, _ = scale_args("scale", scale, xp, kv_cache_dtype, None)
    if validate_enabled(validate):
        t2s = host_copy(token_to_seq)[:num_tokens].astype(np.int64)
        if t2s.size and (t2s.min() < 0 or t2s.max() >= batch):
            raise ValueError(f"token_to_seq holds a sequence index outside [0, {batch})")
        tokens = np.arange(num_tokens)
        _check_reads(src_cache, block_table, cu_seq_lens, seq_starts,
                     lambda cu: ((b, tokens[(t2s == b) & (tokens < cu[b + 1])]) for b in range(batch)),
                     skip_past_row=seq_starts is not None)
        check_scale_values(kv_cache_dtype, scale=scale)
    if num_tokens == 0:
        return
    strides = (*element_strides("src_cache", src_cache)[:2], element_strides("dst", dst)[0],
               element_strides("block_table", block_table)[0])
    kernel = FAMILY.function(_gather(CTYPE[dst.dtype], KV_CODE[kv_cache_dtype]), xp)
    with op_launch(xp, "gather_and_maybe_dequant_cache", lambda: f"t={num_tokens} row={dst.shape[1]} {dst.dtype}",
                   lambda: Cost(num_tokens * dst.shape[1] * (src_cache.itemsize + dst.itemsize), 0)):
        kernel((num_tokens,), (_threads(),),
               (src_cache, dst, block_table, cu_seq_lens, token_to_seq, seq_starts, ptr, value,
                *(np.int64(s) for s in strides), np.int32(dst.shape[1]), np.int32(src_cache.shape[1]),
                np.int32(batch), np.int32(block_table.shape[1])))


def _word_size(arrays, byte_strides, nbytes) -> int:
    ok = nbytes % 16 == 0 and all(address(a) % 16 == 0 for a in arrays) and all(s % 16 == 0 for s in byte_strides)
    return 16 if ok else 1


def _row_contiguous(name, a, first_row_dim: int) -> int:
    """Bytes of one row a[i, ..., :] (dims from first_row_dim on), which must be C-contiguous."""
    expect = a.itemsize
    for n, s in zip(reversed(a.shape[first_row_dim:]), reversed(a.strides[first_row_dim:])):
        if n > 1 and s != expect:
            raise ValueError(f"{name} must be C-contiguous from dimension {first_row_dim} on, got strides {tuple(a.strides)}")
        expect *= n
    return expect


@accepts_foreign_arrays
def cp_gather_cache(src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts=None, *, validate=None):
    """vLLM's ``cp_gather_cache``: a plain copy of every token of each of the first ``batch_size``
    sequences, ``dst[cu_seq_lens[b] + i] = src_cache[block_table[b, p // bs], p % bs]`` with
    ``p = i (+ seq_starts[b])``; src_cache ``[num_blocks, block_size, ...]``, dst ``[total, ...]``."""
    xp = op_array_module(("seq_starts",), src_cache=src_cache, dst=dst, block_table=block_table,
                         cu_seq_lens=cu_seq_lens, seq_starts=seq_starts)
    if src_cache.ndim < 3:
        raise ValueError(f"src_cache must be [num_blocks, block_size, ...], got shape {tuple(src_cache.shape)}")
    if dst.ndim != src_cache.ndim - 1 or dst.shape[1:] != src_cache.shape[2:]:
        entry = ", ".join(map(str, src_cache.shape[2:]))
        raise ValueError(f"dst must be [total_tokens, {entry}] (src_cache's entries), got {tuple(dst.shape)}")
    if dst.dtype != src_cache.dtype:
        raise TypeError(f"dst must have src_cache's dtype {src_cache.dtype}, got {dst.dtype}")
    check_writable("dst", dst)
    check_no_overlap((("dst", dst),), (("src_cache", src_cache),))
    batch_size = check_int("batch_size", batch_size, 0)
    _check_tables(block_table, cu_seq_lens, seq_starts, batch_size)
    row_bytes = _row_contiguous("src_cache", src_cache, 2)
    _row_contiguous("dst", dst, 1)
    if validate_enabled(validate):
        cu = host_copy(cu_seq_lens)[:batch_size + 1].astype(np.int64)
        if batch_size and cu[-1] > dst.shape[0]:
            raise ValueError(f"cu_seq_lens[{batch_size}] = {cu[-1]} exceeds dst's {dst.shape[0]} rows")
        _check_reads(src_cache, block_table, cu_seq_lens, seq_starts,
                     lambda c: ((b, np.arange(c[b], c[b + 1])) for b in range(batch_size)))
    if batch_size == 0 or row_bytes == 0:
        return
    byte_strides = (src_cache.strides[0], src_cache.strides[1], dst.strides[0])
    word = _word_size((src_cache, dst), byte_strides, row_bytes)
    splits = 2 if batch_size > 128 else 4 if batch_size > 64 else 16
    kernel = FAMILY.function(_words("cp_gather_cache_kernel", word), xp)
    with op_launch(xp, "cp_gather_cache", lambda: f"b={batch_size} row={row_bytes}B",
                   lambda: Cost(2 * row_bytes * int(cu_seq_lens[batch_size] - cu_seq_lens[0]), 0)):
        kernel((batch_size, splits), (_threads(),),
               (src_cache, dst, block_table, cu_seq_lens, seq_starts, *(np.int64(s // word) for s in byte_strides),
                np.int64(element_strides("block_table", block_table)[0]), np.int32(row_bytes // word),
                np.int32(src_cache.shape[1])))


@accepts_foreign_arrays
def copy_blocks(key_caches, value_caches, block_mapping, *, validate=None):
    """Copy whole blocks inside each cache: for every (src, dst) row of ``block_mapping`` (int64
    ``[n, 2]`` of any strides, may be numpy beside cupy caches) and every layer,
    ``cache[dst] = cache[src]``. Caches of any layout; ``value_caches`` may be None (MLA). One launch
    per cache, its pairs in parallel: a block both a source and a destination, or a destination named
    twice, races (vLLM's contract, which ``BlockPool.take_pending_copies`` keeps); ``validate=True``
    rejects such a mapping."""
    for name, group in (("key_caches", key_caches), ("value_caches", value_caches)):
        if not isinstance(group, (list, tuple)) and not (name == "value_caches" and group is None):
            raise TypeError(f"{name} must be a list of per-layer caches{' or None' if name == 'value_caches' else ''}"
                            f", got {type(group).__name__}")
    caches = list(key_caches) + ([] if value_caches is None else list(value_caches))
    names = [f"key_caches[{i}]" for i in range(len(key_caches))]
    if value_caches is not None:
        if len(value_caches) != len(key_caches):
            raise ValueError(f"value_caches must have one cache per layer like key_caches ({len(key_caches)}), "
                             f"got {len(value_caches)}")
        names += [f"value_caches[{i}]" for i in range(len(value_caches))]
    xp = array_module(**dict(zip(names, caches)))
    block_bytes = []
    for name, cache in zip(names, caches):
        check_writable(name, cache)
        if cache.ndim < 2:
            raise ValueError(f"{name} must be [num_blocks, ...], got shape {tuple(cache.shape)}")
        block_bytes.append(_row_contiguous(name, cache, 1))
    bounds = [(n, c.shape[0], c.shape[0]) for n, c in zip(names, caches)]
    mapping = check_block_mapping(block_mapping, xp, bounds, validate, parallel=True)
    pairs = mapping.shape[0]
    if pairs == 0:
        return
    words = [_word_size((c,), (c.strides[0],), n) for c, n in zip(caches, block_bytes)]
    kernels = {w: FAMILY.function(_words("copy_blocks_kernel", w), xp) for w in set(words)}  # not one per layer
    threads = _threads()
    for cache, nbytes, word in zip(caches, block_bytes, words):
        with op_launch(xp, "copy_blocks", lambda: f"pairs={pairs} block={nbytes}B",
                       lambda: Cost(2 * pairs * nbytes + mapping.nbytes, 0)):
            kernels[word]((pairs,), (threads,), (cache, mapping, np.int64(cache.strides[0] // word),
                                                 np.int64(nbytes // word)))


@accepts_foreign_arrays
def swap_blocks(src, dst, block_mapping):
    """Copy whole blocks ``dst[d] = src[s]`` for every (s, d) row of ``block_mapping`` (int64
    ``[n, 2]`` of any strides, numpy or cupy, read on the host) between two caches ``[num_blocks, ...]``
    of the same block shape and dtype. numpy <-> numpy runs on the host (the sim). With a cupy array on
    either side every move is a cudaMemcpyAsync on CuPy's current stream, in the mapping's order,
    one per run of pairs adjacent on both sides (source and destination ids both advance by 1;
    blocks packed into staging are adjacent throughout):

    - host -> device: straight from ``src`` when it is pinned memory (``cupyx.empty_pinned``),
      asynchronously: ``src`` must stay alive and unchanged until the stream has passed the
      copies. Any other ``src`` is first gathered into pinned staging memory, and may be changed
      on return. No synchronize.
    - device -> host: into ``dst`` when it is pinned, else into staging then ``dst``; the stream is
      synchronized, so ``dst`` is ready on return.
    - device -> device: no synchronize; where src and dst share memory, every block is read
      before any is written.

    Blocks need not be contiguous: a cupy cache whose blocks are not is gathered or scattered by a
    kernel through a packed buffer, a numpy one through staging; blocks not adjacent in memory
    (a cache strided along dimension 0) are copied one by one. The staging (two pinned buffers
    for the process, used in turn) grows to the largest staged swap and is kept. A destination
    block named twice receives one of its sources."""
    for name, a in (("src", src), ("dst", dst)):
        if array_kind(a) is None:
            raise TypeError(f"{name} must be a numpy or cupy array, got {type(a).__name__}")
        if a.ndim < 2:
            raise ValueError(f"{name} must be [num_blocks, ...], got shape {tuple(a.shape)}")
    if src.dtype != dst.dtype:
        raise TypeError(f"dst must have src's dtype {src.dtype}, got {dst.dtype}")
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src and dst blocks differ: {tuple(src.shape[1:])} vs {tuple(dst.shape[1:])}")
    check_writable("dst", dst)
    op_array_module(block_mapping=block_mapping)  # a TypeError naming it unless a numpy or cupy array
    pairs = host_copy(block_mapping)
    check_block_mapping(pairs, np, [("src/dst", src.shape[0], dst.shape[0])], None)
    if pairs.shape[0] == 0:
        return
    if is_host_array(src) and is_host_array(dst):
        dst[pairs[:, 1]] = src[pairs[:, 0]]
    else:
        swap_blocks_gpu(src, dst, pairs[:, 0], pairs[:, 1])
