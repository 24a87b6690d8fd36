"""The kernels of kernels_cu/paged_attention.cu as the attention engine (cupaged/attention.py) launches them:
their name expressions (the family), the constants and dynamic shared memory of each, and the decode route
that sends short query runs to a decode kernel. The sizes mirror the kernels' own structs
(tests/test_mirror.py checks every one)."""

from __future__ import annotations

import functools

from cupaged._cache_args import KV_KINDS
from cupaged._mirror import constants
from cupaged._runtime import KernelFamily

HEAD_BUCKETS = (64, 128, 256)  # compile-time head-size capacities; the exact size is a run-time value
MLA_BUCKET = (576, 512)  # MLA: latent rows of kv_lora_rank + rope_dim, values the first kv_lora_rank
MMA_BUCKETS = (64, 128)  # head sizes of the tensor-core decode kernel (256 would not fit 99 KB GPUs' stages)
_TYPES = ("float", "__half", "__nv_bfloat16")
PREFILL_BUCKETS = ((64, 64), (128, 128), (192, 128), (256, 256))  # the tensor-core prefill kernel's (HD, VHD)
MLA_TILES = (1, 2)  # the MLA decode kernel's m16 tiles of query heads per CTA: 16 heads (128 threads) or 32 (256)
ALL_ROWS = 2**31 - 1  # decode_max_q when the decode kernel takes every sequence


def reduce_kernel(t):
    return f"cupaged::paged_attention_reduce_kernel<{t}>"


def decode_kernel(t, kv, hd, vt=False):
    return f"cupaged::paged_decode_kernel<{t}, {kv}, {hd}, {'true' if vt else 'false'}>"


def decode_mma_kernel(t, kv, hd, vt):
    return f"cupaged::paged_decode_mma_kernel<{t}, {kv}, {hd}, {'true' if vt else 'false'}>"


def prefill_kernel(t, kv, hd, vhd):
    return f"cupaged::paged_prefill_kernel<{t}, {kv}, {hd}, {vhd}>"


def mla_kernel(t, kv, mt):
    return f"cupaged::mla_decode_kernel<{t}, {kv}, {mt}>"


FAMILY = KernelFamily("paged_attention", [
    *(reduce_kernel(t) for t in _TYPES),
    *(decode_kernel(t, kv, hd) for t in _TYPES for kv in KV_KINDS for hd in HEAD_BUCKETS),
    # vLLM's values on CUDA cores: float32 q, and the head size the tensor-core decode kernel does not take
    *(decode_kernel(t, kv, hd, True) for t in _TYPES for kv in KV_KINDS for hd in HEAD_BUCKETS
      if t == "float" or hd not in MMA_BUCKETS),
    *(decode_mma_kernel(t, kv, hd, vt) for t in _TYPES[1:] for kv in KV_KINDS for hd in MMA_BUCKETS for vt in (0, 1)),
    *(mla_kernel(t, kv, mt) for t in _TYPES[1:] for kv in KV_KINDS for mt in MLA_TILES),
    *(prefill_kernel(t, kv, hd, vhd) for t in _TYPES[1:] for kv in KV_KINDS for hd, vhd in PREFILL_BUCKETS
      if hd == vhd or kv == KV_KINDS[0]),  # 192 / 128: varlen's dense rows (MLA prefill), never an fp8 cache
])


@functools.lru_cache(maxsize=None)
def kernel_constants() -> dict[str, int]:
    """PA_*, PD_* (the decode kernels'), PM_* (the tensor-core decode kernel's) and MD_* (MLA decode's) as
    kernels_cu/paged_attention.cu defines them."""
    return constants(FAMILY.source, "PA_THREADS", "PA_MERGE_COLS", "PD_THREADS", "PD_TILE",
                     "PD_MAX_Q", "PD_ROWS", "PM_TILE", "PM_ROWS", "MD_HD")


def decode_smem_bytes(cache_itemsize: int, hd: int, vt: bool = False) -> int:
    """Dynamic shared memory of paged_decode_kernel: PdSmem<CacheT, HD, VT>::BYTES (its pipeline stages of TILE
    keys: K rows, then V rows or vLLM's V^T rows padded by 16 bytes; or the warps' merge area when larger)."""
    c = kernel_constants()
    tile = decode_tile(cache_itemsize, hd)
    rows = tile * hd * cache_itemsize
    stage = rows + (hd * (tile * cache_itemsize + 16) if vt else rows)
    stages = 4 if 4 * stage <= 65536 else 3 if 3 * stage <= 98304 else 2
    return max(stages * stage, 4 * c["PD_ROWS"] * (hd + 2) * 4)


def decode_tile(cache_itemsize: int, hd: int) -> int:
    """PdSmem::TILE: keys a stage of paged_decode_kernel (16 for float32 head 256: 3 stages within 99 KB)."""
    return 16 if cache_itemsize == 4 and hd == 256 else kernel_constants()["PD_TILE"]


def decode_mma_smem_bytes(cache_itemsize: int, hd: int, vt: bool = False) -> int:
    """Dynamic shared memory of paged_decode_mma_kernel: PmSmem<CacheT, HD, VT>::BYTES (stages of K rows padded by
    16 bytes, then V rows alike or, for vLLM's values (vt), V^T rows of the tile's keys; or the merge area)."""
    c = kernel_constants()
    tile = c["PM_TILE"]
    rows = tile * (hd * cache_itemsize + 16)
    stage = rows + (hd * (tile if cache_itemsize == 1 else 2 * tile + 16) if vt else rows)
    return max((3 if 3 * stage <= 65536 else 2) * stage, 4 * c["PM_ROWS"] * (hd + 2) * 4)


def prefill_shape(hd: int, vhd: int) -> tuple[int, int]:
    """PfSmem<CacheT, HD, VHD>'s (ROWS, TILE): query rows a CTA (2 m16 tiles a warp up to VHD 128, else 1) and keys
    a stage."""
    return (128 if vhd <= 128 else 64), (32 if hd > 64 else 64)


def prefill_smem_bytes(cache_itemsize: int, hd: int, vhd: int) -> int:
    """Dynamic shared memory of paged_prefill_kernel: PfSmem<CacheT, HD, VHD>::BYTES (3 stages of K and V rows of
    TILE keys, 2 where 3 would pass 99 KB, the q tile of ROWS rows, and fp8's converted K and V tiles)."""
    rows, tile = prefill_shape(hd, vhd)
    stage = tile * (hd + vhd) * cache_itemsize
    fixed = rows * hd * 2 + (tile * (hd + vhd) * 2 if cache_itemsize == 1 else 0)
    return (3 if 3 * stage + fixed <= 99 * 1024 else 2) * stage + fixed


def prefill_route(kind, q_dtype, t, kv, head_size, v_head_size, rows):
    """(kernel, shared bytes, rows a CTA) of the tensor-core prefill kernel for the long query runs, or None (float32
    and vLLM's layout, which a decode kernel takes whole): 16-bit q over K/V rows (``rows``: flash NHD / HND caches,
    dense varlen rows), head sizes up to 256 in the smallest bucket that holds them."""
    if kind == "mla" or q_dtype.itemsize != 2 or not rows:
        return None
    hd, vhd = next(b for b in PREFILL_BUCKETS if b[0] >= head_size and b[1] >= v_head_size
                   and (b[0] == b[1] or kv == KV_KINDS[0]))
    itemsize = q_dtype.itemsize if kv == KV_KINDS[0] else 1
    return (prefill_kernel(t, kv, hd, vhd), prefill_smem_bytes(itemsize, hd, vhd),
            prefill_shape(hd, vhd)[0])


def mla_smem_bytes(cache_itemsize: int, mt: int) -> int:
    """Dynamic shared memory of the MLA decode kernel: MdSmem<CacheT, MT>::BYTES (its stages of padded latent
    rows, fp8's converted tile, the score partials, P and the rows' state)."""
    c = kernel_constants()
    tile, width, rows = c["PD_TILE"], c["MD_HD"], 16 * mt
    stages = 2 if mt == 1 else 3
    converted = tile * (2 * width + 16) if cache_itemsize == 1 else 0
    return stages * tile * (width * cache_itemsize + 16) + converted + 5 * rows * tile * 4 + 4 * rows * 4


def resident_ctas(threads: int, shared_bytes: int, sm_shared: int, registers: int = 128) -> int:
    """CTAs of a kernel resident on one SM (0: not even one fits): each thread held to ``registers`` by the kernel's
    __launch_bounds__ (the compile gate checks: 128 for the GQA decode kernels, 255 for the prefill and MLA decode
    kernels), and the driver reserves 1 KB of shared memory per CTA."""
    return min(65536 // (registers * threads), 2048 // threads, sm_shared // (shared_bytes + 1024))


def decode_route(kind, q_dtype, t, kv, num_heads, group, max_q, hd, cache_itemsize, layout, sm_shared):
    """(kernel, decode_max_q, tiles, threads, shared bytes) of the decode kernel the plan routes short query runs
    to, or None (float32 MLA: none). ``layout``: KvView.decode_layout; ``sm_shared``: the device's shared memory
    an SM.
    mla_decode_kernel: 16-bit q over a paged latent cache, every query run (one query at a time per CTA).
    paged_decode_mma_kernel (tiles of 8 query rows): 16-bit q, head size <= 128, GQA groups over 4, or any group
    over vLLM's values (its V^T tiles feed the tensor cores as they are). paged_decode_kernel (tiles of 4 rows):
    the rest, float32 q included (the CUDA-core path: the prefill kernel is 16-bit)."""
    c = kernel_constants()
    if kind == "mla":
        if q_dtype.itemsize != 2:
            return None
        wide = MLA_TILES[-1]  # 32 heads a CTA where its 130 KB fit the SM (sm_80 / sm_90; not sm_86 / sm_89)
        fits = resident_ctas(128 * wide, mla_smem_bytes(cache_itemsize, wide), sm_shared, 255) > 0
        mt = wide if num_heads > 16 * MLA_TILES[0] and fits else MLA_TILES[0]
        # every run: a CTA takes one query of the run at a time (tiles: head tiles x min(max_q, PD_MAX_Q) queries)
        return (mla_kernel(t, kv, mt), ALL_ROWS, -(-num_heads // (16 * mt)) * min(max_q, c["PD_MAX_Q"]), 128 * mt,
                mla_smem_bytes(cache_itemsize, mt))
    vt = layout == "vllm"
    # A short run (<= PD_MAX_Q) takes a decode kernel; one that knows every run is short, float32 q (the CUDA-core
    # path: the prefill kernel is 16-bit) and vLLM's values (decode's layout) take every run, an understated hint
    # still right: a CTA takes its sequence's later row tiles in turn. Longer runs: paged_prefill_kernel.
    every = q_dtype.itemsize == 4 or vt or max_q <= c["PD_MAX_Q"]
    short = max_q if every else c["PD_MAX_Q"]
    max_q_taken = ALL_ROWS if every else c["PD_MAX_Q"]
    # Chosen from the model's shape and cache alone (never from the batch's query lengths), so a sequence takes
    # the same kernel in every batch: a fixed kv_split_size keeps its results bitwise the same.
    if (group > c["PD_ROWS"] or vt) and q_dtype.itemsize == 2 and hd in MMA_BUCKETS:
        return (decode_mma_kernel(t, kv, hd, vt), max_q_taken, -(-short * group // c["PM_ROWS"]), c["PD_THREADS"],
                decode_mma_smem_bytes(cache_itemsize, hd, vt))
    return (decode_kernel(t, kv, hd, vt), max_q_taken, -(-short * group // c["PD_ROWS"]), c["PD_THREADS"],
            decode_smem_bytes(cache_itemsize, hd, vt))
