"""The attention engine over kernels_cu/paged_attention.cu: describe the K/V (:class:`KvView`), plan
once per batch (:func:`plan_attention`, pure host: tiles, splits, partial buffers, grid), run every
layer with that plan (:func:`run_attention`, launches only). Every attention op (paged_attention,
paged_attention_v1/v2, varlen_attention, mla_decode, mla_chunked_prefill) validates its arguments,
then plans and runs.

The kernel's constants and its parameter struct are read from the ``.cu`` source (cupaged/_mirror.py),
the one owner of both.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np

from cupaged._interop import accepts_foreign_arrays
from cupaged._annotate import _OFF, declare_launch, op_range
from cupaged._backend import capturing, device_shared_limit, empty, module_of, sm_count, struct_arg
from cupaged._cache_args import KV_CODE, KV_KINDS, kv_dtype_name, kv_scale_args
from cupaged._checks import CTYPE, element_strides
from cupaged._cost import attention_cost
from cupaged._kv_view import KvView, kv_key
from cupaged._plan import AttentionPlan, carve_workspace, workspace_bytes
from cupaged._mirror import constants, struct_dtype
from cupaged._runtime import KernelFamily

__all__ = ["KvView", "AttentionPlan", "plan_attention", "run_attention", "workspace_bytes", "carve_workspace", "FAMILY",
           "HEAD_BUCKETS", "MLA_BUCKET"]

HEAD_BUCKETS = (64, 128, 256)  # compile-time head-size capacities; the exact size is a run-time value
MLA_BUCKET = (576, 512)  # MLA: latent rows of kv_lora_rank + rope_dim, values the first kv_lora_rank
_TYPES = ("float", "__half", "__nv_bfloat16")
DECODE_ROWS = (4, 8)  # the decode kernel's query rows per CTA: a GQA group of up to 4, or up to 8 (registers)
MLA_TILES = (1, 4)  # the MLA decode kernel's m16 tiles of query heads per CTA: 16 heads (128 threads) or 64 (512)


def _main(t, kv, hd, vhd, shared):
    return f"cupaged::paged_attention_kernel<{t}, {kv}, {hd}, {vhd}, {'true' if shared else 'false'}>"


def _reduce(t):
    return f"cupaged::paged_attention_reduce_kernel<{t}>"


def _decode(t, kv, hd, rows):
    return f"cupaged::paged_decode_kernel<{t}, {kv}, {hd}, {rows}>"


def _mla(t, kv, mt):
    return f"cupaged::mla_decode_kernel<{t}, {kv}, {mt}>"


FAMILY = KernelFamily("paged_attention", [
    *(_main(t, kv, hd, hd, False) for t in _TYPES for kv in KV_KINDS for hd in HEAD_BUCKETS),
    *(_main(t, kv, *MLA_BUCKET, True) for t in _TYPES for kv in KV_KINDS),
    *(_reduce(t) for t in _TYPES),
    *(_decode(t, kv, hd, rows) for t in _TYPES for kv in KV_KINDS for hd in HEAD_BUCKETS for rows in DECODE_ROWS),
    *(_mla(t, kv, mt) for t in _TYPES[1:] for kv in KV_KINDS for mt in MLA_TILES),
])
ALL_ROWS = 2**31 - 1  # decode_max_q when the decode kernel takes every sequence


@functools.lru_cache(maxsize=None)
def kernel_constants() -> dict[str, int]:
    """PA_*, PD_* (the decode kernel's) and MD_* (MLA decode's) as kernels_cu/paged_attention.cu defines them."""
    return constants(FAMILY.source, "PA_THREADS", "PA_ROWS", "PA_TILE", "PD_THREADS", "PD_TILE", "PD_MAX_Q", "MD_HD")


@functools.lru_cache(maxsize=None)
def params_dtype() -> np.dtype:
    """struct PaParams of kernels_cu/paged_attention.cu."""
    return struct_dtype(FAMILY.source, "PaParams")


@functools.lru_cache(maxsize=None)
def _params_packer():
    """(PaParams' dtype, a getter of its fields' values in declaration order from a dict)."""
    dtype = params_dtype()
    return dtype, operator.itemgetter(*dtype.names)


@functools.lru_cache(maxsize=1024)
def _packed_params(values: tuple) -> np.ndarray:
    """struct PaParams of these field values, packed in one step and memoized: a layer loop launches
    the same few parameter sets again and again (the array is never written after packing)."""
    return np.array(values, _params_packer()[0])


def smem_bytes(hd: int, vhd: int, shared: bool) -> int:
    """Dynamic shared memory of the main kernel: PaSmem<HD, VHD, SHARED_KV>::FLOATS floats
    (tests/test_mirror.py checks it against the kernel's own figure)."""
    c = kernel_constants()
    rows, tile = c["PA_ROWS"], c["PA_TILE"]
    kv = tile * (hd + 1) + (0 if shared else tile * vhd)
    return 4 * (rows * hd + kv + rows * tile + 3 * rows)


def decode_smem_bytes(cache_itemsize: int, hd: int, rows: int) -> int:
    """Dynamic shared memory of the decode kernel: PdSmem<CacheT, HD, ROWS>::BYTES (its pipeline stages,
    or the warps' merge area when larger)."""
    stage = 2 * kernel_constants()["PD_TILE"] * hd * cache_itemsize
    stages = 4 if 4 * stage <= 65536 else 3 if 3 * stage <= 98304 else 2
    return max(stages * stage, 4 * rows * (hd + 2) * 4)


def mla_smem_bytes(cache_itemsize: int, mt: int) -> int:
    """Dynamic shared memory of the MLA decode kernel: MdSmem<CacheT, MT>::BYTES (its stages of padded latent
    rows, fp8's converted tile, the score partials, P and the rows' state)."""
    c = kernel_constants()
    tile, width, rows = c["PD_TILE"], c["MD_HD"], 16 * mt
    stages = 2 if mt == 1 else 3
    converted = tile * (2 * width + 16) if cache_itemsize == 1 else 0
    return stages * tile * (width * cache_itemsize + 16) + converted + 5 * rows * tile * 4 + 4 * rows * 4


def _decode_route(kind, q_dtype, t, kv, num_heads, group, max_q, hd, cache_itemsize, dense, decodable):
    """(kernel, decode_max_q, tiles, threads, shared bytes) of the decode kernel the plan routes short query runs
    to, or None: paged_decode_kernel (flash / dense rows, q_len <= PD_MAX_Q), mla_decode_kernel (16-bit q over a
    paged latent cache, q_len 1), or none of them (every row stays on paged_attention_kernel)."""
    if not decodable:
        return None
    if kind == "mla":
        if q_dtype.itemsize != 2 or dense:
            return None
        mt = MLA_TILES[0] if num_heads <= 16 * MLA_TILES[0] else MLA_TILES[-1]
        return (_mla(t, kv, mt), ALL_ROWS if max_q <= 1 else 1, -(-num_heads // (16 * mt)), 128 * mt,
                mla_smem_bytes(cache_itemsize, mt))
    c = kernel_constants()
    short = min(max_q, c["PD_MAX_Q"])
    rows = DECODE_ROWS[0] if short * group <= DECODE_ROWS[0] else DECODE_ROWS[1]
    return (_decode(t, kv, hd, rows), ALL_ROWS if max_q <= c["PD_MAX_Q"] else c["PD_MAX_Q"], -(-short * group // rows),
            c["PD_THREADS"], decode_smem_bytes(cache_itemsize, hd, rows))


def choose_split(xp, ctas: int, max_kv: int) -> int:
    """kv_split_size=None: split long contexts until ~2 CTAs per SM have work (0 = no split).
    Chosen from the batch's shape, so only a fixed kv_split_size is batch-invariant."""
    return _split_for(sm_count(xp), ctas, max_kv)


def _split_for(sms: int, ctas: int, max_kv: int) -> int:
    target = 2 * sms
    if ctas >= target or max_kv <= 256:
        return 0
    splits = math.ceil(target / max(ctas, 1))
    size = max(256, -(-math.ceil(max_kv / splits) // 256) * 256)
    return 0 if size >= max_kv else size


@accepts_foreign_arrays
def plan_attention(q, kv: KvView, block_tables, seq_lens, query_start_loc=None, *, max_query_len=None,
                   max_seq_len=None, kv_split_size=None, max_splits=None, always_partials=False) -> AttentionPlan:
    """Plan attention of ``q`` over ``kv``; only the shapes of the index arrays are used (dense K/V:
    ``block_tables`` None and ``seq_lens`` = cu_seqlens_k). ``kv_split_size``: None chooses from the
    shape, 0 never splits, n splits every n keys; ``max_splits`` fixes the partial depth (vLLM v2).
    Memoized on what it reads, so planning a batch shape seen before costs a dictionary lookup."""
    return _plan(tuple(q.shape), np.dtype(q.dtype), kv.kind, kv.kv_cache_dtype, kv.num_kv_heads, kv.v_head_size,
                 kv.block_size, None if block_tables is None else block_tables.shape[1], seq_lens.shape[0],
                 query_start_loc is None, max_query_len, max_seq_len, kv_split_size, max_splits, always_partials,
                 sm_count(module_of(q)), kv.decodable)


@functools.lru_cache(maxsize=1024)
def _plan(q_shape, q_dtype, kind, kv_cache_dtype, num_kv_heads, v_head_size, block_size, table_width, index_len,
          decode, max_query_len, max_seq_len, kv_split_size, max_splits, always_partials, sms,
          decodable) -> AttentionPlan:
    num_tokens, num_heads, head_size = q_shape
    dense = table_width is None
    num_seqs = index_len - (1 if dense else 0)
    consts = kernel_constants()
    group = num_heads // num_kv_heads
    max_q = 1 if decode else min(max_query_len or num_tokens, num_tokens)
    t, kv = CTYPE[q_dtype], KV_CODE[kv_cache_dtype]
    shared = kind == "mla"
    hd, vhd = MLA_BUCKET if shared else (next(b for b in HEAD_BUCKETS if b >= max(head_size, v_head_size)),) * 2
    cache_itemsize = q_dtype.itemsize if kv_cache_dtype == "auto" else 1
    # Sequences whose query run is short take a decode kernel; with a hint saying every run is short it
    # takes them all (an understated hint stays correct), else the longer ones take paged_attention_kernel.
    route = _decode_route(kind, q_dtype, t, kv, num_heads, group, max_q, hd, cache_itemsize, dense, decodable)
    decode_kernel, decode_max_q, decode_tiles, decode_threads, decode_smem = route or (None, 0, 0, 0, 0)
    tiles = -(-max_q * group // consts["PA_ROWS"]) if kind != "mla" else -(-num_heads // consts["PA_ROWS"])
    max_kv = max_seq_len or (table_width * block_size if not dense else 0)
    ctas = num_seqs * num_kv_heads * (decode_tiles if decode_max_q == ALL_ROWS else tiles)
    split = _split_for(sms, ctas, max_kv) if kv_split_size is None else kv_split_size
    if max_splits is None:
        max_splits = max(1, -(-max_kv // split)) if split else 1
    split = split if max_splits > 1 else 0
    return AttentionPlan(
        op="mla_decode" if shared else "decode" if decode else "prefill", num_tokens=num_tokens, num_heads=num_heads,
        num_seqs=num_seqs, num_kv_heads=num_kv_heads, head_size=head_size, v_head_size=v_head_size, dtype=t,
        kv=kv_key(kind, kv_cache_dtype, block_size), tiles=tiles, kv_split_size=split, max_splits=max_splits,
        always_partials=always_partials, grid=(tiles * max_splits, num_kv_heads, num_seqs),
        threads=consts["PA_THREADS"], shared_mem=smem_bytes(hd, vhd, shared),
        kernel=None if decode_max_q == ALL_ROWS else _main(t, kv, hd, vhd, shared),
        reduce_kernel=_reduce(t) if max_splits > 1 and split > 0 else None,
        decode_kernel=decode_kernel, decode_threads=decode_threads, decode_shared_mem=decode_smem,
        decode_grid=(decode_tiles * max_splits, num_kv_heads, num_seqs) if decode_kernel else (),
        decode_tiles=decode_tiles, decode_max_q=decode_max_q)


def check_fits(plan: AttentionPlan, limit: int, device: str = "this GPU") -> None:
    """The plan's dynamic shared memory against the device's opt-in limit per block: a clear error
    before the launch (MLA's 576/512 tiles need ~113 KB; sm_86 / sm_89 allow 99 KB)."""
    for name, _, _, need in plan.main_launches:
        if need > limit:
            raise NotImplementedError(
                f"{name} needs {need} bytes of shared memory per block; {device} allows {limit} "
                f"(sm_80: 163 KB, sm_86/sm_89: 99 KB, sm_90: 227 KB): use a GPU with more shared memory per block")


_OPTED_IN: dict = {}  # id(kernel) -> (kernel, bytes): the dynamic shared memory it was opted in for


def _kernel(plan: AttentionPlan, name: str, shared_mem: int, xp):
    """One of the plan's main kernels, opted in for its shared memory once (the attribute is a driver
    call on a GPU), after checking that the device can give it."""
    kernel = FAMILY.function(name, xp)
    opted = _OPTED_IN.get(id(kernel))
    if opted is None or opted[1] < shared_mem:
        if xp is not np:
            check_fits(plan, *device_shared_limit(xp))
        kernel.max_dynamic_shared_size_bytes = shared_mem
        _OPTED_IN[id(kernel)] = (kernel, shared_mem)
    return kernel


def _block_shift(block_size: int) -> int:
    """log2(block_size) for a power of two (the decode kernel shifts), else -1 (it divides)."""
    n = int(block_size)
    return n.bit_length() - 1 if n & (n - 1) == 0 else -1


def _check_plan(plan: AttentionPlan, q, kv: KvView) -> None:
    want = (plan.num_tokens, plan.num_heads, plan.head_size, plan.dtype, plan.num_kv_heads, plan.v_head_size, plan.kv)
    got = (*q.shape, CTYPE.get(q.dtype), kv.num_kv_heads, kv.v_head_size, kv.key_id)
    if want != got:
        raise ValueError(f"run_attention: q / kv do not match the plan (plan: {want}, got: {got})")
    if plan.decode_kernel is not None and not kv.decodable:
        raise ValueError("run_attention: the plan routes rows to the decode kernel, which needs K/V rows that are "
                         "contiguous and 16-byte aligned; this kv's are not: plan with this kv")


@accepts_foreign_arrays
def run_attention(plan: AttentionPlan, q, kv: KvView, out, lse, block_tables, seq_lens, query_start_loc=None, *,
                  scale=None, causal=True, sliding_window=None, sinks=None, alibi_slopes=None, softcap=None,
                  k_scale=1.0, v_scale=1.0, partials=None):
    """Launch ``plan`` (the main kernel, then the split merge when it splits); returns ``out``. Arguments
    are not validated beyond matching the plan: the ops do that before planning. ``lse``: float32
    ``[num_heads, num_tokens]`` or None; ``partials``: (max_logits, exp_sums, tmp_output) of
    ``plan.partial_shapes`` (allocated when None)."""
    _check_plan(plan, q, kv)
    xp = module_of(q)
    scale = 1.0 / math.sqrt(plan.head_size) if scale is None else scale
    if kv.kv_cache_dtype == "auto":  # a cache of the data's own type ignores the scales
        k_ptr = v_ptr = None
        ksv = vsv = 1.0
        per_head = 0
    else:
        k_ptr, v_ptr, ksv, vsv, per_head = kv_scale_args(xp, kv.kv_cache_dtype, k_scale, v_scale, kv.num_kv_heads)
    if partials is None and plan.partial_shapes is not None:
        if capturing(xp):  # a buffer freed on return would be reused while the graph still writes it
            raise ValueError(f"workspace (or partials) is required while capturing a CUDA graph: this plan splits "
                             f"the keys into up to {plan.max_splits} parts; pass a uint8 workspace of "
                             f"plan.workspace_bytes = {plan.workspace_bytes} bytes")
        partials = tuple(empty(xp, s, np.float32) for s in plan.partial_shapes)
    max_logits, exp_sums, tmp_output = partials or (None, None, None)
    qs, os_ = element_strides("q", q), element_strides("out", out)
    fields = dict(
        q_token_stride=qs[0], q_head_stride=qs[1], out_token_stride=os_[0], out_head_stride=os_[1],
        table_stride=0 if block_tables is None else element_strides("block_tables", block_tables)[0],
        scale=scale, softcap=softcap or 0.0, k_scale_value=ksv, v_scale_value=vsv, scale_per_head=per_head,
        causal=int(causal), window=sliding_window or 0, always_partials=int(plan.always_partials),
        partials_in_out_type=int(tmp_output is not None and tmp_output.dtype != np.float32),
        num_tokens=plan.num_tokens, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
        head_size=plan.head_size, v_head_size=plan.v_head_size, block_size=kv.block_size,
        kv_split_size=plan.kv_split_size, max_splits=plan.max_splits, tiles=plan.tiles, vec_k=int(kv.vec_k),
        vec_v=int(kv.vec_v), decode_tiles=plan.decode_tiles, decode_max_q=plan.decode_max_q,
        block_shift=_block_shift(kv.block_size), **kv.strides)
    p = _packed_params(_params_packer()[1](fields))  # struct PaParams

    def label():
        return (f"b={plan.num_seqs} t={plan.num_tokens} h={plan.num_heads}/{plan.num_kv_heads} d={plan.head_size} "
                f"{kv_dtype_name(kv.kv_cache_dtype, kv.key.dtype)}{' causal' if causal else ''} "
                f"splits={plan.max_splits}")

    def cost():
        dense = block_tables is None
        lens = np.diff(seq_lens) if dense else seq_lens
        q_lens = np.ones(plan.num_seqs, np.int64) if query_start_loc is None else np.diff(query_start_loc)
        return attention_cost(lens, q_lens, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
                              head_size=plan.head_size, v_head_size=plan.v_head_size, kv_itemsize=kv.key.itemsize,
                              q_itemsize=q.itemsize, out_itemsize=out.itemsize,
                              block_size=None if dense else kv.block_size, causal=causal, window=sliding_window or 0,
                              lse=lse is not None, shared_kv=kv.kind == "mla",
                              query_start_loc=query_start_loc is not None)

    args = (q, kv.key, kv.value, block_tables, seq_lens, query_start_loc, sinks, alibi_slopes, k_ptr, v_ptr, out, lse,
            max_logits, exp_sums, tmp_output, struct_arg(p, xp))
    with op_range(plan.op, label):
        for i, (name, grid, threads, shared_mem) in enumerate(plan.main_launches):
            with declare_launch(xp, plan.op, label, cost) if i == 0 else _OFF:  # the op's cost, declared once
                _kernel(plan, name, shared_mem, xp)(grid, (threads,), args, shared_mem=shared_mem)
        if plan.reduce_kernel is not None:  # sequences with one split were finished above
            reduce = FAMILY.function(plan.reduce_kernel, xp)
            reduce((plan.num_tokens, plan.num_heads), (plan.threads,),
                   (out, lse, max_logits, exp_sums, tmp_output, seq_lens, np.int32(block_tables is None),
                    query_start_loc, sinks, struct_arg(p, xp), np.int32(plan.num_seqs)))
    return out
