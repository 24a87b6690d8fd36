"""Independent numpy models of the Hopper (sm_90a) PTX layouts, used as oracles for the sim's emulation.

Written from the documentation only (PTX ISA, CUDA driver API), never from the sim's code, so that a test
comparing the sim with these models compares two independent readings of the same text. Sections followed:

* PTX ISA 9.7.15.5.1.1 "Register Fragments" (wgmma.mma_async .m64nNk16 / .m64nNk32): the A-in-registers and
  accumulator D fragments. Each warp w of the warpgroup owns rows 16w..16w+15 and, within them, holds the
  same fragment as the warp-level mma.m16n8k16 / .m16n8k32 A and C/D tables (9.7.14.5.x), repeated every
  8 columns of D.
* PTX ISA 9.7.15.5.1.2 "Shared Memory Matrix Layout" and 9.7.15.5.1.2.2 "Matrix Descriptor Format":
  operands are built of 8-row x 16-byte core matrices (K-major, no swizzle) or of swizzle atoms of
  8 rows x 32/64/128 bytes; the descriptor's LBO/SBO fields step between core matrices / atoms (the stride
  definitions are those of 9.7.16.3, "Major-ness supported by Strides", which the tcgen05 chapter states
  for the same descriptor fields). The swizzle is an XOR of byte-address bits [7, 7+B) into bits [4, 4+B)
  (B = 1/2/3 for 32/64/128 bytes): the pattern repeats every 256/512/1024 bytes, matching the ISA's table
  of repeating-pattern boundaries and its base-offset formula ``(addr >> 7) & 7``.
* PTX ISA 5.5 "Tensors" and the driver API's cuTensorMapEncodeTiled: a tile-mode
  cp.async.bulk.tensor moves a dense box (innermost dimension contiguous in shared memory); elementStrides
  are traversal strides (ceil(box / stride) elements per dimension, the innermost stride ignored);
  out-of-bound elements are zero-filled on loads and skipped on stores; with swizzle, the box's inner
  dimension in bytes must be a multiple of 16 and at most the swizzle span, and 16-byte chunks are
  permuted within each 32/64/128-byte span by the same address-bit XOR as the wgmma operands use.

Coordinates are numpy order throughout (outermost first); the driver API lists dimensions innermost first.
"""

from __future__ import annotations

import math

import numpy as np

SWIZZLES = ("none", "32B", "64B", "128B")
SWIZZLE_BITS = {"none": 0, "32B": 1, "64B": 2, "128B": 3}
SWIZZLE_SPAN = {"none": 16, "32B": 32, "64B": 64, "128B": 128}
# PTX ISA 9.7.15.5.1.2.2, bits 63-62 of the wgmma matrix descriptor.
DESCRIPTOR_SWIZZLE_CODE = {"none": 0, "128B": 1, "64B": 2, "32B": 3}


def _check_swizzle(swizzle: str) -> None:
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle must be one of {SWIZZLES}, got {swizzle!r}")


def swizzle_address(addr, swizzle: str):
    """Byte address -> swizzled byte address: bits [4, 4+B) ^= bits [7, 7+B) (B = 0/1/2/3)."""
    _check_swizzle(swizzle)
    addr = np.asarray(addr, dtype=np.int64)
    mask = (1 << SWIZZLE_BITS[swizzle]) - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def operand_addresses(rows: int, elem_bytes: int, major: str, swizzle: str, lbo: int, sbo: int,
                      start: int = 0) -> np.ndarray:
    """Shared-memory byte address of element (row, kk) of one wgmma operand, int64 [rows, K].

    PTX ISA 9.7.15.5.1.2 (layout) and 9.7.15.5.1.2.2 (descriptor), base offset 0. ``row`` is M for A and N
    for B; K = 32 // elem_bytes (one instruction's K). With T = 16 // elem_bytes elements per 16 bytes and
    W = span / 16 (swizzled modes):

    * K-major, no swizzle: core matrix = 8 rows x 16 contiguous bytes (row r at +16 r); LBO steps to the
      next core matrix along K, SBO to the next 8 rows.
    * K-major, swizzled: rows of W*16 bytes, 8 rows per atom (row r at +16 W r, K contiguous); SBO steps
      to the next 8 rows; LBO is unused.
    * MN-major, no swizzle: core matrix = 8 K-rows x 16 bytes (T contiguous MN elements); SBO steps to the
      next T elements along MN, LBO to the next 8 along K.
    * MN-major, swizzled: K-rows of W*16 bytes (W*T contiguous MN elements), 8 per atom; LBO steps to the
      next W*T elements along MN, SBO to the next 8 along K.

    The swizzle XOR is applied to the whole address ``start + offset``, so moving ``start`` inside an atom
    (e.g. +32 bytes for the next K slice of a 128B K-major atom) reads the atom's later columns.
    """
    if elem_bytes not in (1, 2):
        raise ValueError("wgmma shared-memory operands here are 8-bit or 16-bit")
    if major not in ("K", "MN"):
        raise ValueError(f"major must be 'K' or 'MN', got {major!r}")
    if major == "MN" and elem_bytes != 2:
        raise ValueError("the ISA allows the transposed (MN-major) layout only for .f16/.bf16")
    if rows % 8 or rows <= 0:
        raise ValueError("rows must be a positive multiple of 8")
    _check_swizzle(swizzle)
    k = 32 // elem_bytes
    t = 16 // elem_bytes
    w = SWIZZLE_SPAN[swizzle] // 16
    r = np.arange(rows, dtype=np.int64)[:, None]
    kk = np.arange(k, dtype=np.int64)[None, :]
    if major == "K" and swizzle == "none":
        off = (r % 8) * 16 + (r // 8) * sbo + (kk // t) * lbo + (kk % t) * elem_bytes
    elif major == "K":
        off = (r % 8) * (16 * w) + (r // 8) * sbo + kk * elem_bytes
    elif swizzle == "none":
        off = (r % t) * elem_bytes + (r // t) * sbo + (kk % 8) * 16 + (kk // 8) * lbo
    else:
        off = (r % (w * t)) * elem_bytes + (r // (w * t)) * lbo + (kk % 8) * (16 * w) + (kk // 8) * sbo
    return swizzle_address(start + off, swizzle)


def descriptor(start: int, lbo: int, sbo: int, swizzle: str, base_offset: int = 0) -> int:
    """The 64-bit wgmma matrix descriptor (PTX ISA 9.7.15.5.1.2.2).

    Bits 13-0: encode(start); 29-16: encode(LBO); 45-32: encode(SBO); 51-49: base offset; 63-62: swizzle
    (0 none, 1 128B, 2 64B, 3 32B), with encode(x) = (x & 0x3FFFF) >> 4. The three byte quantities must be
    16-byte aligned.
    """
    _check_swizzle(swizzle)
    for name, value in (("start", start), ("lbo", lbo), ("sbo", sbo)):
        if value < 0 or value % 16:
            raise ValueError(f"{name}={value} must be a non-negative multiple of 16")
    if not 0 <= base_offset < 8:
        raise ValueError("base_offset is a 3-bit field")

    def enc(x: int) -> int:
        return (x & 0x3FFFF) >> 4

    return (enc(start) | enc(lbo) << 16 | enc(sbo) << 32 | base_offset << 49
            | DESCRIPTOR_SWIZZLE_CODE[swizzle] << 62)


def _warpgroup_ids():
    tid = np.arange(128, dtype=np.int64)[:, None]
    lane = tid % 32
    return tid // 32, lane >> 2, lane % 4  # warp, groupID, threadID_in_group


def accumulator_coords(n: int) -> np.ndarray:
    """(row, col) of D (64 x n) held by thread t, f32 register i: int64 [128, n // 2, 2].

    PTX ISA 9.7.15.5.1.1.1, accumulator D figure: row = 16 warp + groupID + 8 ((i >> 1) & 1),
    col = 8 (i >> 2) + 2 threadID_in_group + (i & 1). Thread 0 holds D(0,0), D(0,1), D(8,0), D(8,1), D(0,8)...
    """
    if n % 8 or not 8 <= n <= 256:
        raise ValueError("n must be a multiple of 8 in [8, 256]")
    warp, g, tig = _warpgroup_ids()
    i = np.arange(n // 2, dtype=np.int64)[None, :]
    row = 16 * warp + g + 8 * ((i >> 1) & 1)
    col = 8 * (i >> 2) + 2 * tig + (i & 1)
    return np.stack(np.broadcast_arrays(row, col), axis=-1)


def accumulator_coords_f16(n: int) -> np.ndarray:
    """f16 accumulators: n/4 .f16x2 registers, elements d0, d1, ... low half first: [128, n // 4, 2, 2].

    PTX ISA 9.7.15.5.1.1.1: the .f16 D fragment lists the same elements d0..d(n/2 - 1) as .f32, packed two
    per register, so register j holds d(2j) in its low 16 bits and d(2j+1) in its high 16 bits.
    """
    if n % 8 or not 8 <= n <= 256:
        raise ValueError("n must be a multiple of 8 in [8, 256]")
    return accumulator_coords(n).reshape(128, n // 4, 2, 2)


def a_register_coords(elem_bytes: int) -> np.ndarray:
    """(row, k) of A (64 x K) in thread t, register j (of 4), element e (lowest bits first): [128, 4, per, 2].

    PTX ISA 9.7.15.5.1.1 (A in registers). 16-bit types (.m64nNk16): element a_i, i = 2j + e, at
    row = 16 warp + groupID + 8 ((i >> 1) & 1), k = 2 threadID_in_group + (i & 1) + 8 (i >> 2).
    8-bit types (.m64nNk32): a_i, i = 4j + e, at row = 16 warp + groupID + 8 ((i >> 2) & 1),
    k = 4 threadID_in_group + (i & 3) + 16 (i >> 3).
    """
    if elem_bytes not in (1, 2):
        raise ValueError("elem_bytes must be 1 or 2")
    per = 4 // elem_bytes
    warp, g, tig = _warpgroup_ids()
    i = np.arange(4 * per, dtype=np.int64)[None, :]
    if elem_bytes == 2:
        row = 16 * warp + g + 8 * ((i >> 1) & 1)
        k = 2 * tig + (i & 1) + 8 * (i >> 2)
    else:
        row = 16 * warp + g + 8 * ((i >> 2) & 1)
        k = 4 * tig + (i & 3) + 16 * (i >> 3)
    return np.stack(np.broadcast_arrays(row, k), axis=-1).reshape(128, 4, per, 2)


def store_operand(matrix: np.ndarray, addresses: np.ndarray, smem: np.ndarray) -> np.ndarray:
    """Scatter ``matrix`` (1- or 2-byte dtype, same shape as ``addresses``) into ``smem`` (uint8) in place."""
    matrix = np.ascontiguousarray(matrix)
    size = matrix.dtype.itemsize
    if size not in (1, 2) or matrix.shape != addresses.shape:
        raise ValueError("matrix must be 1- or 2-byte elements shaped like addresses")
    raw = matrix.view(np.uint8).reshape(*matrix.shape, size)
    smem[np.asarray(addresses)[..., None] + np.arange(size)] = raw
    return smem


def load_operand(smem: np.ndarray, addresses: np.ndarray, dtype) -> np.ndarray:
    """Gather the elements at ``addresses`` from ``smem`` (uint8) as ``dtype``; the inverse of store_operand."""
    dtype = np.dtype(dtype)
    raw = smem[np.asarray(addresses)[..., None] + np.arange(dtype.itemsize)]
    return np.ascontiguousarray(raw).view(dtype)[..., 0]


def _box_geometry(global_array, box, coords, element_strides, swizzle):
    """Validate a tile-mode box; return (open-mesh clipped global indices, in-bounds mask, box shape)."""
    _check_swizzle(swizzle)
    rank = global_array.ndim
    if not 1 <= rank <= 5 or len(box) != rank or len(coords) != rank:
        raise ValueError("box and coords need one entry per dimension (rank 1..5)")
    strides = [1] * rank if element_strides is None else [int(s) for s in element_strides]
    if len(strides) != rank or any(not 1 <= s <= 8 for s in strides):
        raise ValueError("element_strides need one entry in [1, 8] per dimension")
    if any(not 1 <= int(b) <= 256 for b in box):
        raise ValueError("box sizes must be in [1, 256]")
    if global_array.strides[-1] != global_array.itemsize:
        raise ValueError("the innermost global dimension must be contiguous")
    strides[-1] = 1  # driver API: the innermost traversal stride is ignored
    inner_bytes = int(box[-1]) * global_array.itemsize
    if inner_bytes % 16:
        raise ValueError("box inner dimension must be a multiple of 16 bytes")
    if swizzle != "none" and inner_bytes > SWIZZLE_SPAN[swizzle]:
        raise ValueError(f"box inner dimension ({inner_bytes} B) exceeds the {swizzle} swizzle span")
    counts = [math.ceil(int(b) / s) for b, s in zip(box, strides)]
    idx = [int(c) + np.arange(n, dtype=np.int64) * s for c, n, s in zip(coords, counts, strides)]
    inside = np.ones(counts, dtype=bool)
    for d, (i, dim) in enumerate(zip(idx, global_array.shape)):
        shape = [1] * rank
        shape[d] = -1
        inside &= ((i >= 0) & (i < dim)).reshape(shape)
    clipped = np.ix_(*[np.clip(i, 0, dim - 1) for i, dim in zip(idx, global_array.shape)])
    return clipped, inside, counts


def _smem_offsets(nbytes: int, swizzle: str) -> np.ndarray:
    """Swizzled shared-memory byte offset of each dense box byte (destination 1024-byte aligned)."""
    return swizzle_address(np.arange(nbytes, dtype=np.int64), swizzle)


def tensor_tile(global_array: np.ndarray, box, coords, element_strides=None, swizzle: str = "none") -> np.ndarray:
    """Bytes a cp.async.bulk.tensor.Nd.shared::cluster.global.tile load writes at a 1024-aligned destination.

    PTX ISA 5.5 (tile mode) and cuTensorMapEncodeTiled: along dimension d it reads ceil(box[d] / stride[d])
    elements at coords[d] + j * stride[d] (innermost stride ignored), zero for out-of-bound coordinates,
    packed densely in C order (innermost contiguous); byte o of that dense box lands at
    ``swizzle_address(o)``. The result has that many bytes (rounded up to the swizzle span).
    """
    g = np.asarray(global_array)
    clipped, inside, _ = _box_geometry(g, box, coords, element_strides, swizzle)
    dense = g[clipped].copy()
    dense[~inside] = 0
    raw = np.ascontiguousarray(dense).view(np.uint8).reshape(-1)
    span = SWIZZLE_SPAN[swizzle]
    out = np.zeros(-(-raw.size // span) * span, dtype=np.uint8)
    out[_smem_offsets(raw.size, swizzle)] = raw
    return out


def tensor_store(global_array: np.ndarray, box, coords, smem_bytes: np.ndarray, swizzle: str = "none",
                 element_strides=None) -> np.ndarray:
    """A cp.async.bulk.tensor tile store (shared -> global) from a 1024-aligned source, into global_array.

    The inverse of tensor_tile: dense box byte o is read at ``swizzle_address(o)``; out-of-bound elements
    are not written. Modifies and returns ``global_array``.
    """
    clipped, inside, counts = _box_geometry(global_array, box, coords, element_strides, swizzle)
    nbytes = int(np.prod(counts)) * global_array.itemsize
    raw = np.asarray(smem_bytes, dtype=np.uint8)[_smem_offsets(nbytes, swizzle)]
    dense = raw.view(global_array.dtype).reshape(counts)
    where = tuple(np.broadcast_to(c, counts)[inside] for c in clipped)
    global_array[where] = dense[inside]
    return global_array
