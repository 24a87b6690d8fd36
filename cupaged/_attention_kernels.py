"""The kernels of kernels_cu/paged_attention.cu as the attention engine (cupaged/attention.py) launches them:
their name expressions (the family), the constants and dynamic shared memory of each, and the routes that send
short query runs to a decode kernel and long ones to the prefill kernel, each a :class:`Route` holding its
:class:`~cupaged._launch.Launch`. The sizes mirror the kernels' own structs, and their stage thresholds and
register budgets are the source's constants (tests/test_mirror.py checks every one)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from cupaged._cache_args import KV_KINDS
from cupaged._launch import Launch
from cupaged._mirror import constants
from cupaged._runtime import HOPPER, KernelFamily

if TYPE_CHECKING:
    from cupaged._plan import PlanKey

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


def decode_mma_kernel(t, kv, hd, vt, tree=False):
    flags = f"{'true' if vt else 'false'}, {'true' if tree else 'false'}"
    return f"cupaged::paged_decode_mma_kernel<{t}, {kv}, {hd}, {flags}>"


def tree_kernel(name: str) -> str:
    """The instantiation of a plan's kernel that takes custom (tree) masks: paged_decode_mma_kernel's TREE one (its
    loop without a mask runs as it did before masks existed), the others as they are."""
    mma = name.startswith("cupaged::paged_decode_mma_kernel<")
    return name.removesuffix(", false>") + ", true>" if mma else name


def prefill_kernel(t, kv, hd, vhd):
    return f"cupaged::paged_prefill_kernel<{t}, {kv}, {hd}, {vhd}>"


def prefill_sm90_kernel(t, kv, hd, vhd):
    return f"cupaged::paged_prefill_sm90_kernel<{t}, {kv}, {hd}, {vhd}>"


def mla_kernel(t, kv, mt):
    return f"cupaged::mla_decode_kernel<{t}, {kv}, {mt}>"


FAMILY = KernelFamily("paged_attention", [
    *(reduce_kernel(t) for t in _TYPES),
    # on CUDA cores: float32 q, and the head size the tensor-core decode kernel does not take
    *(decode_kernel(t, kv, hd, vt) for vt in (False, True) for t in _TYPES for kv in KV_KINDS for hd in HEAD_BUCKETS
      if t == "float" or hd not in MMA_BUCKETS),
    *(decode_mma_kernel(t, kv, hd, vt, tree) for t in _TYPES[1:] for kv in KV_KINDS for hd in MMA_BUCKETS
      for vt in (0, 1) for tree in (False, True)),
    *(mla_kernel(t, kv, mt) for t in _TYPES[1:] for kv in KV_KINDS for mt in MLA_TILES),
    *(prefill_kernel(t, kv, hd, vhd) for t in _TYPES[1:] for kv in KV_KINDS for hd, vhd in PREFILL_BUCKETS
      if hd == vhd or kv == KV_KINDS[0]),  # 192 / 128: varlen's dense rows (MLA prefill), never an fp8 cache
])


# kernels_cu/paged_attention_sm90.cu: built for sm_90a alone, the plan's prefill kernel on sm_90
HOPPER_FAMILY = KernelFamily("paged_attention_sm90", [
    prefill_sm90_kernel(t, kv, hd, vhd) for t in _TYPES[1:] for kv in KV_KINDS for hd, vhd in PREFILL_BUCKETS
    if hd == vhd or kv == KV_KINDS[0]], arch=HOPPER)


def family_of(kernel: str) -> KernelFamily:
    """The family a name expression of the plan's kernels is built from."""
    return HOPPER_FAMILY if kernel in HOPPER_FAMILY.name_expressions else FAMILY


@functools.lru_cache(maxsize=None)
def hopper_constants() -> dict[str, int]:
    """HP_*: paged_prefill_sm90_kernel's threads and query rows a CTA, shared-memory limit and fixed allowance, and
    its warpgroups' registers (setmaxnreg)."""
    return constants(HOPPER_FAMILY.source, "HP_THREADS", "HP_ROWS", "HP_SMEM_LIMIT", "HP_FIXED",
                     "HP_PRODUCER_REGISTERS", "HP_CONSUMER_REGISTERS")


def hopper_prefill_pipeline(hd: int, vhd: int) -> tuple[int, int, int]:
    """HpSmem<CacheT, HD, VHD>'s (STAGES, STAGE, Q): stages of 64 keys' K and V panels (64 columns of 128 bytes) in
    q's type (fp8 converted on the way), up to 4 where they, the consumers' q panels (Q bytes) and HP_FIXED fit
    HP_SMEM_LIMIT."""
    c = hopper_constants()
    panel = 64 * 128
    stage, q = (hd + vhd) // 64 * panel, c["HP_ROWS"] * hd * 2
    return min(4, (c["HP_SMEM_LIMIT"] - c["HP_FIXED"] - q) // stage), stage, q


def hopper_prefill_smem_bytes(hd: int, vhd: int) -> int:
    """Dynamic shared memory of paged_prefill_sm90_kernel: HpSmem::BYTES (HP_FIXED: the alignment slack, mbarriers
    and rows; then q and the ring)."""
    stages, stage, q = hopper_prefill_pipeline(hd, vhd)
    return hopper_constants()["HP_FIXED"] + q + stages * stage


@functools.lru_cache(maxsize=None)
def kernel_constants() -> dict[str, int]:
    """PA_*, PD_* (the decode kernels'), PM_* (the tensor-core decode kernel's), PF_* (prefill's) and MD_* (MLA
    decode's) as the family's source defines them: shapes, the shared bytes each kernel's pipeline stages may
    take, and the registers a thread its __launch_bounds__ allow (of SM_REGISTERS an SM)."""
    return constants(FAMILY.source, "PA_THREADS", "PA_MERGE_COLS", "PD_THREADS", "PD_TILE", "PD_MAX_Q", "PD_ROWS",
                     "PM_TILE", "PM_ROWS", "MD_HD", "SM_REGISTERS", "PD_REGISTERS", "PM_REGISTERS", "PF_REGISTERS",
                     "MD_REGISTERS", "PD_SMEM_FOR_4", "PD_SMEM_FOR_3", "PM_SMEM_FOR_3", "PF_SMEM_FOR_3", "MD_STAGES_16",
                     "MD_STAGES_32", "PA_PRIOR_SPLITS")


def decode_pipeline(cache_itemsize: int, hd: int, vt: bool = False) -> tuple[int, int]:
    """PdSmem<CacheT, HD, VT>'s (STAGES, STAGE): paged_decode_kernel's pipeline stages of TILE keys and a stage's
    bytes (K rows, then V rows or vLLM's V^T rows padded by 16 bytes): 4 stages within PD_SMEM_FOR_4, else 3 within
    PD_SMEM_FOR_3, else 2."""
    c = kernel_constants()
    tile = decode_tile(cache_itemsize, hd)
    rows = tile * hd * cache_itemsize
    stage = rows + (hd * (tile * cache_itemsize + 16) if vt else rows)
    return (4 if 4 * stage <= c["PD_SMEM_FOR_4"] else 3 if 3 * stage <= c["PD_SMEM_FOR_3"] else 2), stage


def decode_smem_bytes(cache_itemsize: int, hd: int, vt: bool = False) -> int:
    """Dynamic shared memory of paged_decode_kernel: PdSmem<CacheT, HD, VT>::BYTES (its pipeline stages, or the
    warps' merge area when larger)."""
    stages, stage = decode_pipeline(cache_itemsize, hd, vt)
    return max(stages * stage, _merge_bytes(kernel_constants()["PD_ROWS"], hd))


def decode_tile(cache_itemsize: int, hd: int) -> int:
    """PdSmem::TILE: keys a stage of paged_decode_kernel (16 for float32 head 256: 3 stages within 99 KB)."""
    return 16 if cache_itemsize == 4 and hd == 256 else kernel_constants()["PD_TILE"]


def decode_mma_pipeline(cache_itemsize: int, hd: int, vt: bool = False) -> tuple[int, int]:
    """PmSmem<CacheT, HD, VT>'s (STAGES, STAGE): paged_decode_mma_kernel's stages of K rows padded by 16 bytes, then
    V rows alike or, for vLLM's values (vt), V^T rows of the tile's keys: 3 within PM_SMEM_FOR_3, else 2."""
    c = kernel_constants()
    tile = c["PM_TILE"]
    rows = tile * (hd * cache_itemsize + 16)
    stage = rows + (hd * (tile if cache_itemsize == 1 else 2 * tile + 16) if vt else rows)
    return (3 if 3 * stage <= c["PM_SMEM_FOR_3"] else 2), stage


def decode_mma_smem_bytes(cache_itemsize: int, hd: int, vt: bool = False) -> int:
    """Dynamic shared memory of paged_decode_mma_kernel: PmSmem<CacheT, HD, VT>::BYTES (its stages, or the merge
    area when larger)."""
    stages, stage = decode_mma_pipeline(cache_itemsize, hd, vt)
    return max(stages * stage, _merge_bytes(kernel_constants()["PM_ROWS"], hd))


def prefill_shape(hd: int, vhd: int) -> tuple[int, int]:
    """PfSmem<CacheT, HD, VHD>'s (ROWS, TILE): query rows a CTA (2 m16 tiles a warp up to VHD 128, else 1) and keys
    a stage."""
    return (128 if vhd <= 128 else 64), (32 if hd > 64 else 64)


def _prefill_fixed(cache_itemsize: int, hd: int, vhd: int) -> int:
    """PfSmem::FIXED: the q tile of ROWS rows and fp8's K and V tiles converted to 16 bits."""
    rows, tile = prefill_shape(hd, vhd)
    return rows * hd * 2 + (tile * (hd + vhd) * 2 if cache_itemsize == 1 else 0)


def prefill_pipeline(cache_itemsize: int, hd: int, vhd: int) -> tuple[int, int]:
    """PfSmem<CacheT, HD, VHD>'s (STAGES, STAGE): paged_prefill_kernel's stages of K and V rows of TILE keys: 3 where
    they and the fixed tiles fit PF_SMEM_FOR_3 (99 KB), else 2."""
    stage = prefill_shape(hd, vhd)[1] * (hd + vhd) * cache_itemsize
    fits = 3 * stage + _prefill_fixed(cache_itemsize, hd, vhd) <= kernel_constants()["PF_SMEM_FOR_3"]
    return (3 if fits else 2), stage


def prefill_smem_bytes(cache_itemsize: int, hd: int, vhd: int) -> int:
    """Dynamic shared memory of paged_prefill_kernel: PfSmem<CacheT, HD, VHD>::BYTES (its stages, the q tile and
    fp8's converted tiles)."""
    stages, stage = prefill_pipeline(cache_itemsize, hd, vhd)
    return stages * stage + _prefill_fixed(cache_itemsize, hd, vhd)


def mla_pipeline(cache_itemsize: int, mt: int) -> tuple[int, int]:
    """MdSmem<CacheT, MT>'s (STAGES, STAGE): mla_decode_kernel's stages of PD_TILE padded latent rows, MD_STAGES_16
    with 16 heads a CTA (MT 1), MD_STAGES_32 with 32."""
    c = kernel_constants()
    return c["MD_STAGES_16"] if mt == 1 else c["MD_STAGES_32"], c["PD_TILE"] * (c["MD_HD"] * cache_itemsize + 16)


def mla_smem_bytes(cache_itemsize: int, mt: int) -> int:
    """Dynamic shared memory of the MLA decode kernel: MdSmem<CacheT, MT>::BYTES (its stages, fp8's converted tile,
    the score partials, P and the rows' state)."""
    c = kernel_constants()
    tile, width, rows = c["PD_TILE"], c["MD_HD"], 16 * mt
    stages, stage = mla_pipeline(cache_itemsize, mt)
    converted = tile * (2 * width + 16) if cache_itemsize == 1 else 0
    return stages * stage + converted + 5 * rows * tile * 4 + 4 * rows * 4


def _merge_bytes(rows: int, hd: int) -> int:
    """pd_store's shared memory: each warp's m, l, o of each row, then cascade's per-row prior (pd_prior)."""
    return (4 * rows * (hd + 2) + rows * (hd + 3)) * 4


def resident_ctas(threads: int, shared_bytes: int, sm_shared: int, registers: int) -> int:
    """CTAs of a kernel resident on one SM (0: not even one fits): each thread held to ``registers`` of the SM's
    SM_REGISTERS by the kernel's __launch_bounds__ (the compile gate checks them), at most 2048 threads an SM (sm_80,
    sm_90), and the driver reserves 1 KB of shared memory per CTA."""
    return min(kernel_constants()["SM_REGISTERS"] // (registers * threads), 2048 // threads,
               sm_shared // (shared_bytes + 1024))


@dataclasses.dataclass(frozen=True)
class Route:
    """A kernel the plan sends query runs to: its launch over one KV split (grid: row tiles, kv heads, sequences;
    the plan repeats x for each split), the longest run it takes (ALL_ROWS: every run the other kernel leaves) and
    its CTAs resident on an SM (the occupancy the split choice fills)."""

    launch: Launch
    max_q: int
    per_sm: int


def _route(key: PlanKey, kernel: str, tiles: int, threads: int, shared_mem: int, registers: int,
           max_q: int = ALL_ROWS) -> Route:
    launch = Launch(kernel, (tiles, key.num_kv_heads, key.num_seqs), (threads, 1, 1), shared_mem)
    return Route(launch, max_q, resident_ctas(threads, shared_mem, key.sm_shared, registers))


def decode_route(key: PlanKey) -> Route:
    """The decode kernel the plan routes short query runs to.
    mla_decode_kernel: 16-bit q over a paged latent cache, every query run (one query at a time per CTA; float32 q
    is a NotImplementedError). paged_decode_mma_kernel (tiles of 8 query rows): 16-bit q, head size <= 128, every
    group (one query head a KV head too: by the H200 model 64 x 4096 32/32 fp16 decode takes 1027 us on tensor
    cores, 1706 us on CUDA cores, whose lanes of a row repeat its softmax). paged_decode_kernel (tiles of 4 rows):
    head size 256 and float32 q (the CUDA-core path; the prefill kernel is 16-bit)."""
    c = kernel_constants()
    t, kv, itemsize = key.ctype, key.kv_code, key.cache_itemsize
    if key.kind == "mla":
        if key.q_dtype.itemsize != 2:
            raise NotImplementedError(f"q dtype {key.q_dtype}: attention over an MLA latent cache takes float16 or "
                                      f"bfloat16 q (mla_decode_kernel runs on tensor cores)")
        wide = MLA_TILES[-1]  # 32 heads a CTA where its 130 KB fit the SM (sm_80 / sm_90; not sm_86 / sm_89)
        fits = resident_ctas(128 * wide, mla_smem_bytes(itemsize, wide), key.sm_shared, c["MD_REGISTERS"]) > 0
        mt = wide if key.num_heads > 16 * MLA_TILES[0] and fits else MLA_TILES[0]
        # every run: a CTA takes one query of the run at a time (tiles: head tiles x min(max_q, PD_MAX_Q) queries)
        return _route(key, mla_kernel(t, kv, mt), -(-key.num_heads // (16 * mt)) * min(key.max_q, c["PD_MAX_Q"]),
                      128 * mt, mla_smem_bytes(itemsize, mt), c["MD_REGISTERS"])
    hd = next((b for b in HEAD_BUCKETS if b >= max(key.head_size, key.v_head_size)), None)
    if hd is None:
        raise NotImplementedError(f"head_size={max(key.head_size, key.v_head_size)}: at most {HEAD_BUCKETS[-1]} is "
                                  f"supported")
    vt = key.decode_layout == "vllm"
    # A short run (<= PD_MAX_Q) takes a decode kernel; one that knows every run is short, float32 q (the CUDA-core
    # path: the prefill kernel is 16-bit) and vLLM's values (decode's layout) take every run, an understated hint
    # still right: a CTA takes its sequence's later row tiles in turn. Longer runs: paged_prefill_kernel.
    every = key.q_dtype.itemsize == 4 or vt or key.max_q <= c["PD_MAX_Q"]
    short = key.max_q if every else c["PD_MAX_Q"]
    max_q = ALL_ROWS if every else c["PD_MAX_Q"]
    # Chosen from the model's shape and cache alone (never from the batch's query lengths), so a sequence takes
    # the same kernel in every batch: a fixed kv_split_size keeps its results bitwise the same.
    if key.q_dtype.itemsize == 2 and hd in MMA_BUCKETS:
        return _route(key, decode_mma_kernel(t, kv, hd, vt), -(-short * key.group // c["PM_ROWS"]), c["PD_THREADS"],
                      decode_mma_smem_bytes(itemsize, hd, vt), c["PM_REGISTERS"], max_q)
    return _route(key, decode_kernel(t, kv, hd, vt), -(-short * key.group // c["PD_ROWS"]), c["PD_THREADS"],
                  decode_smem_bytes(itemsize, hd, vt), c["PD_REGISTERS"], max_q)


def prefill_route(key: PlanKey) -> Route | None:
    """The tensor-core prefill kernel for the runs the decode kernel leaves, or None (float32 and vLLM's layout,
    which a decode kernel takes whole): 16-bit q over K/V rows (KvView.prefill_rows: flash NHD / HND caches, dense
    varlen rows), head sizes up to 256 in the smallest bucket that holds them, 128 (token, head) rows a CTA (64 above
    V's 128 on mma.sync). sm_90: paged_prefill_sm90_kernel (wgmma, warp-specialised: one CTA an SM); others:
    paged_prefill_kernel (mma.sync)."""
    if key.kind == "mla" or key.q_dtype.itemsize != 2 or not key.prefill_rows:
        return None
    hd, vhd = next(b for b in PREFILL_BUCKETS if b[0] >= key.head_size and b[1] >= key.v_head_size
                   and (b[0] == b[1] or key.kv_code == KV_KINDS[0]))
    c = kernel_constants()
    if key.arch == "sm_90":
        h = hopper_constants()
        return _route(key, prefill_sm90_kernel(key.ctype, key.kv_code, hd, vhd),
                      -(-key.max_q * key.group // h["HP_ROWS"]), h["HP_THREADS"], hopper_prefill_smem_bytes(hd, vhd), c["SM_REGISTERS"] // h["HP_THREADS"])
    return _route(key, prefill_kernel(key.ctype, key.kv_code, hd, vhd),
                  -(-key.max_q * key.group // prefill_shape(hd, vhd)[0]), c["PD_THREADS"],
                  prefill_smem_bytes(key.cache_itemsize, hd, vhd), c["PF_REGISTERS"])


def merge_launch(key: PlanKey) -> Launch:
    """The split merge: a warp per (token, head, PA_MERGE_COLS output columns), a CTA of PA_THREADS per token and
    PA_THREADS / 32 of those (head, columns) pairs."""
    c = kernel_constants()
    pairs = key.num_heads * -(-key.v_head_size // c["PA_MERGE_COLS"])
    return Launch(reduce_kernel(key.ctype), (key.num_tokens, -(-pairs // (c["PA_THREADS"] // 32)), 1),
                  (c["PA_THREADS"], 1, 1))
