"""Custom attention masks (tree masks of speculative decoding), as FlashInfer defines them: per request s a
``q_len[s] x kv_len[s]`` boolean matrix, row-major and flattened, the requests' matrices concatenated; row i is
query i (key index ``kv_len - q_len + i``, bottom-right aligned) and says which of the request's keys it sees.
``custom_mask`` is either unpacked booleans (``mask_indptr`` in elements) or uint8 bit-packed little-endian by 8
per request (each request's bits from a byte boundary, ``mask_indptr`` in bytes), FlashInfer's ``segment_packbits``.
The kernels read the packed form (kernels_cu/attention/logits.cuh, ``pa_row_sees``).

A mask where a query sees a later key index than its own is refused: a tree lists every node after its
ancestors, so the kernels keep their causal bound and skip the tiles past each row's diagonal.
"""

from __future__ import annotations

import numpy as np

from cupaged._backend import host_copy, is_host_array, module_of
from cupaged._cache_args import check_index
from cupaged._checks import address, check_dtype, check_ndim
from cupaged._interop import accepts_foreign_arrays

__all__ = ["pack_custom_mask", "check_custom_mask", "packed_custom_mask", "content_checked", "validate_custom_mask"]

MAX_MASK_BYTES = 1 << 28  # a row's bit index is a 32-bit int in the kernels


def _lengths(xp, query_start_loc, seq_lens):
    """(q_len, kv_len) of every request, int64, on the arrays' side (no read of device contents)."""
    kv = xp.asarray(seq_lens).astype(np.int64)
    q = xp.ones_like(kv) if query_start_loc is None else xp.diff(xp.asarray(query_start_loc).astype(np.int64))
    return q, kv


def _indptr(xp, lengths):
    return xp.concatenate([xp.zeros(1, np.int64), xp.cumsum(lengths)]).astype(np.int32)


@accepts_foreign_arrays
def pack_custom_mask(custom_mask, mask_indptr=None, *, query_start_loc=None, seq_lens=None):
    """``(packed uint8, packed_indptr int32 [num_seqs + 1])`` of an unpacked boolean ``custom_mask``: each request's
    bits packed little-endian by 8 from a byte boundary (FlashInfer's ``segment_packbits(..., bitorder="little")``).
    ``mask_indptr``: the requests' element offsets, or None to take them from ``query_start_loc`` (None: one query
    a request) and ``seq_lens``. Runs on the mask's side (numpy or cupy), reading no device array back, so a CUDA
    graph's step can pack outside the capture and pass the packed mask. A device array may hold spare zero bytes
    past ``packed_indptr[-1]``."""
    check_ndim("custom_mask", custom_mask, 1, "[sum of q_len * kv_len] booleans")
    check_dtype("custom_mask", custom_mask, (np.bool_,))
    xp = module_of(custom_mask)
    if mask_indptr is None:
        if seq_lens is None:
            raise ValueError("pack_custom_mask needs mask_indptr, or seq_lens (and query_start_loc) to compute it")
        q, kv = _lengths(xp, query_start_loc, seq_lens)
        mask_indptr = _indptr(xp, q * kv)
    check_index("mask_indptr", mask_indptr, 1, "[num_seqs + 1]")
    starts = xp.asarray(mask_indptr).astype(np.int64)
    num_seqs = starts.shape[0] - 1
    packed_indptr = _indptr(xp, (xp.diff(starts) + 7) // 8)
    capacity = custom_mask.shape[0] // 8 + max(num_seqs, 0)  # >= the packed size: no read of packed_indptr[-1]
    if num_seqs < 1 or custom_mask.shape[0] == 0:
        return xp.zeros(max(capacity, 1), np.uint8), packed_indptr
    element = xp.arange(custom_mask.shape[0], dtype=np.int64)
    seq = xp.minimum(xp.searchsorted(starts[1:], element, side="right"), num_seqs - 1)
    bit = packed_indptr.astype(np.int64)[seq] * 8 + element - starts[seq]
    keep = (bit >= 0) & (bit < capacity * 8)  # bounded even for a malformed indptr (validate reports it)
    bits = xp.zeros(capacity * 8, np.bool_)
    bits[bit[keep]] = custom_mask[keep]
    packed = xp.packbits(bits, bitorder="little")
    if is_host_array(packed):  # exactly the requests' bytes; on a device the spare tail stays (never read back)
        packed = packed[:int(packed_indptr[-1])]
    return packed, packed_indptr


def check_custom_mask(custom_mask, mask_indptr, num_seqs: int) -> None:
    """The shapes and dtypes of a custom mask and its offsets (no contents read)."""
    if custom_mask is None:
        if mask_indptr is not None:
            raise ValueError("mask_indptr gives custom_mask's offsets: it needs custom_mask")
        return
    check_ndim("custom_mask", custom_mask, 1, "[sum of q_len * kv_len] booleans, or those bit-packed (uint8)")
    check_dtype("custom_mask", custom_mask, (np.bool_, np.uint8))
    if mask_indptr is not None:
        check_index("mask_indptr", mask_indptr, 1, "[num_seqs + 1]")
        if mask_indptr.shape[0] != num_seqs + 1:
            raise ValueError(f"mask_indptr must have num_seqs + 1 = {num_seqs + 1} entries, got {mask_indptr.shape[0]}")


def packed_custom_mask(custom_mask, mask_indptr, query_start_loc, seq_lens):
    """``(packed, packed_indptr)`` the kernels read (``(None, None)`` without a mask): booleans packed, a packed
    mask's offsets computed when not given. Reads no device contents."""
    if custom_mask is None:
        return None, None
    if custom_mask.dtype == np.bool_:
        custom_mask, mask_indptr = pack_custom_mask(custom_mask, mask_indptr, query_start_loc=query_start_loc,
                                                    seq_lens=seq_lens)
    elif mask_indptr is None:
        xp = module_of(custom_mask)
        q, kv = _lengths(xp, query_start_loc, seq_lens)
        mask_indptr = _indptr(xp, (q * kv + 7) // 8)
    if custom_mask.shape[0] > MAX_MASK_BYTES:
        raise ValueError(f"custom_mask packs to {custom_mask.shape[0]} bytes; at most {MAX_MASK_BYTES} (2^28) are "
                         f"taken")
    if custom_mask.strides[0] != 1 or address(custom_mask) % 4:  # the kernels read whole 32-bit words of it
        custom_mask = custom_mask.copy()
    return custom_mask, mask_indptr


def content_checked(validate, *arrays) -> bool:
    """Whether a mask's contents are checked: under validate, or always when they are on the host already."""
    return validate or all(a is None or is_host_array(a) for a in arrays)


def validate_custom_mask(custom_mask, mask_indptr, query_start_loc, seq_lens) -> None:
    """A mask's contents, as given (booleans with element offsets, or packed with byte offsets): each request's
    segment holds its q_len x kv_len entries, inside the mask (exactly the mask when the offsets are computed), and
    no query sees a later key index than its own."""
    packed = custom_mask.dtype == np.uint8
    what, unit = ("custom_mask (bit-packed)", "bytes") if packed else ("custom_mask (as booleans)", "entries")
    q, kv = _lengths(np, None if query_start_loc is None else host_copy(query_start_loc), host_copy(seq_lens))
    want = (q * kv + 7) // 8 if packed else q * kv
    indptr = np.concatenate([[0], np.cumsum(want)]) if mask_indptr is None else host_copy(mask_indptr).astype(np.int64)
    if indptr[0] != 0:
        raise ValueError(f"mask_indptr must start at 0, got {indptr[0]}")
    got = np.diff(indptr)
    bad = np.flatnonzero(got != want)
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"{what}: request {s}'s mask must hold q_len x kv_len = {q[s]} x {kv[s]} = {q[s] * kv[s]} "
                         f"bits ({want[s]} {unit}); mask_indptr gives it {got[s]}")
    size = custom_mask.shape[0]
    if indptr[-1] > size or (mask_indptr is None and indptr[-1] != size):
        raise ValueError(f"{what} has {size} {unit}; the requests' q_len x kv_len masks take {indptr[-1]}")
    values = host_copy(custom_mask)
    for s in range(q.shape[0]):
        n_q, n_kv = int(q[s]), int(kv[s])
        seg = values[indptr[s]:indptr[s + 1]]
        m = (np.unpackbits(seg, bitorder="little")[:n_q * n_kv] if packed else seg).reshape(n_q, n_kv).astype(bool)
        later = m & (np.arange(n_kv)[None, :] > (n_kv - n_q + np.arange(n_q))[:, None])
        if later.any():
            i, j = (int(x) for x in np.argwhere(later)[0])
            raise ValueError(f"custom_mask: request {s}'s query {i} (key index {n_kv - n_q + i}) sees key {j}, a later "
                             f"one: a query sees only keys up to its own index (a tree lists parents first)")
