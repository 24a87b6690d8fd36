"""Paged attention (kernels_cu/paged_attention.cu): varlen prefill chunks and decode tokens in one
call, GQA/MQA, causal / sliding window / sinks / ALiBi / soft-capping, fp8 caches, LSE, split-KV."""

from __future__ import annotations

import functools
import math

import numpy as np

from cupaged._annotate import declare_launch, op_range
from cupaged._attention_args import check_caches, check_head_vector, check_out, check_q, check_softcap, \
    check_tables, validate_tables
from cupaged._cache_args import KV_CODE, check_scale_values, kv_dtype_name, kv_scale_args
from cupaged._checks import CTYPE, address, check_bool, check_float, check_optional_int, check_writable, \
    element_strides, validate_enabled
from cupaged._cost import attention_cost
from cupaged._runtime import KernelFamily, array_module, struct_arg

__all__ = ["paged_attention", "HEAD_BUCKETS"]

HEAD_BUCKETS = (64, 128, 256)  # compile-time head-size capacities; the exact size is a run-time value
ROWS, TILE, THREADS = 16, 32, 128  # PA_ROWS, PA_TILE, PA_THREADS in the kernel
NOMINAL_SMS = 132  # H100/H200, for sizing splits on the sim

PARAMS = np.dtype([(n, np.int64) for n in (
    "q_token_stride", "q_head_stride", "out_token_stride", "out_head_stride", "k_block_stride", "k_head_stride",
    "k_chunk_stride", "k_page_stride", "v_block_stride", "v_head_stride", "v_page_stride", "v_dim_stride",
    "table_stride")] + [(n, np.float32) for n in ("scale", "softcap", "k_scale_value", "v_scale_value")] + [
    (n, np.int32) for n in ("scale_per_head", "causal", "window", "always_partials", "partials_in_out_type",
                            "num_tokens", "num_heads", "num_kv_heads", "head_size", "v_head_size", "block_size",
                            "kv_split_size", "max_splits", "tiles", "vec_k", "vec_v")], align=True)  # struct PaParams
MLA_BUCKET = (576, 512)  # MLA: latent rows of kv_lora_rank + rope_dim, values the first kv_lora_rank


def _main(t, kv, hd, vhd, shared):
    return f"cupaged::paged_attention_kernel<{t}, {kv}, {hd}, {vhd}, {'true' if shared else 'false'}>"


def _reduce(t):
    return f"cupaged::paged_attention_reduce_kernel<{t}>"


_TYPES = ("float", "__half", "__nv_bfloat16")
FAMILY = KernelFamily("paged_attention", [
    *(_main(t, kv, hd, hd, False) for t in _TYPES for kv in (0, 1, 2) for hd in HEAD_BUCKETS),
    *(_main(t, kv, *MLA_BUCKET, True) for t in _TYPES for kv in (0, 1, 2)),
    *(_reduce(t) for t in _TYPES),
])


def smem_bytes(hd: int, vhd: int, shared: bool) -> int:
    """Dynamic shared memory of the main kernel (PaSmem<HD, VHD, SHARED_KV>::FLOATS floats)."""
    kv = TILE * (hd + 1) + (0 if shared else TILE * vhd)
    return 4 * (ROWS * hd + kv + ROWS * TILE + 3 * ROWS)


@functools.lru_cache(maxsize=None)
def _sm_count(xp) -> int:
    if xp is np:
        return NOMINAL_SMS
    return xp.cuda.Device().attributes["MultiProcessorCount"]


def choose_split(xp, ctas: int, max_kv: int) -> int:
    """kv_split_size=None: split long contexts until ~2 CTAs per SM have work (0 = no split).
    Chosen from the batch's shape, so only a fixed kv_split_size is batch-invariant."""
    target = 2 * _sm_count(xp)
    if ctas >= target or max_kv <= 256:
        return 0
    splits = math.ceil(target / max(ctas, 1))
    size = max(256, -(-math.ceil(max_kv / splits) // 256) * 256)
    return 0 if size >= max_kv else size


def launch(xp, q, key_cache, value_cache, caches, block_tables, seq_lens, query_start_loc, out, lse, *, scale,
           causal, window, sinks, alibi, softcap, kv_cache_dtype, k_scale, v_scale, kv_split_size, max_splits,
           tiles, partials=None, always_partials=False, mla=False):
    """Launch the main kernel (and the split reduction). ``caches``: the key/value address strides
    (check_caches); ``block_tables=None`` is dense varlen mode with ``seq_lens`` = cu_seqlens_k;
    ``mla``: values are the first out-width entries of the key rows."""
    num_tokens, num_heads, head_size = q.shape
    v_head_size = out.shape[2]
    num_seqs = seq_lens.shape[0] - (1 if block_tables is None else 0)
    if mla:
        hd, vhd = MLA_BUCKET
    else:
        hd = vhd = next(b for b in HEAD_BUCKETS if b >= max(head_size, v_head_size))
    k_ptr, v_ptr, ksv, vsv, per_head = kv_scale_args(xp, kv_cache_dtype, k_scale, v_scale, caches["kv_heads"])
    p = np.zeros((), PARAMS)
    qs, os_ = element_strides("q", q), element_strides("out", out)
    table_stride = 0 if block_tables is None else element_strides("block_tables", block_tables)[0]
    for name, value in dict(
            q_token_stride=qs[0], q_head_stride=qs[1], out_token_stride=os_[0], out_head_stride=os_[1],
            table_stride=table_stride, scale=scale, softcap=softcap or 0.0, k_scale_value=ksv, v_scale_value=vsv,
            scale_per_head=per_head, causal=int(causal), window=window, always_partials=int(always_partials),
            num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=caches["kv_heads"], head_size=head_size,
            v_head_size=v_head_size, block_size=caches["block_size"], kv_split_size=kv_split_size,
            max_splits=max_splits, tiles=tiles, vec_k=caches["vec_k"], vec_v=caches["vec_v"],
            **{k: v for k, v in caches.items() if k.startswith(("k_", "v_"))}).items():
        p[name] = value
    if partials is None and (max_splits > 1 or always_partials):
        partials = (xp.empty((num_tokens, num_heads, max_splits), np.float32),
                    xp.empty((num_tokens, num_heads, max_splits), np.float32),
                    xp.empty((num_tokens, num_heads, max_splits, v_head_size), np.float32))
    max_logits, exp_sums, tmp_output = partials or (None, None, None)
    p["partials_in_out_type"] = int(tmp_output is not None and tmp_output.dtype != np.float32)  # vLLM v2 only
    t = CTYPE[q.dtype]
    kernel = FAMILY.function(_main(t, KV_CODE[kv_cache_dtype], hd, vhd, mla), xp)
    kernel.max_dynamic_shared_size_bytes = smem_bytes(hd, vhd, mla)
    grid = (tiles * max_splits, caches["kv_heads"], num_seqs)
    op = "mla_decode" if mla else "decode" if query_start_loc is None else "prefill"

    def label():
        return (f"b={num_seqs} t={num_tokens} h={num_heads}/{caches['kv_heads']} d={head_size} "
                f"{kv_dtype_name(kv_cache_dtype, key_cache.dtype)}{' causal' if causal else ''} splits={max_splits}")

    def cost():
        lens = seq_lens if block_tables is not None else np.diff(seq_lens)
        q_lens = np.ones(num_seqs, np.int64) if query_start_loc is None else np.diff(query_start_loc)
        return attention_cost(lens, q_lens, num_heads=num_heads, num_kv_heads=caches["kv_heads"], head_size=head_size,
                              v_head_size=v_head_size, kv_itemsize=key_cache.itemsize, q_itemsize=q.itemsize,
                              out_itemsize=out.itemsize, block_size=caches["block_size"] if block_tables is not None
                              else None, causal=causal, window=window, lse=lse is not None, shared_kv=mla,
                              query_start_loc=query_start_loc is not None)

    with op_range(op, label):
        with declare_launch(xp, op, label, cost):
            kernel(grid, (THREADS,), (q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, sinks, alibi,
                                      k_ptr, v_ptr, out, lse, max_logits, exp_sums, tmp_output, struct_arg(p, xp)),
                   shared_mem=smem_bytes(hd, vhd, mla))
        if max_splits > 1 and kv_split_size > 0:  # sequences with one split were finished above
            reduce = FAMILY.function(_reduce(t), xp)
            reduce((num_tokens, num_heads), (THREADS,), (out, lse, max_logits, exp_sums, tmp_output, seq_lens,
                                                          np.int32(block_tables is None), query_start_loc, sinks,
                                                          struct_arg(p, xp), np.int32(num_seqs)))


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *, scale=None,
                    causal=True, sliding_window=None, sinks=None, alibi_slopes=None, softcap=None,
                    kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, layout="NHD", kv_split_size=None,
                    max_query_len=None, max_seq_len=None, workspace=None, out=None, return_lse=False, validate=None):
    """Attention of ``q`` ``[num_tokens, num_heads, head_size]`` over a paged KV cache.

    ``query_start_loc`` (int32 ``[num_seqs + 1]``) splits the tokens into sequences; ``None`` means
    decode (one query per sequence). Query i of sequence s sits at position
    ``seq_lens[s] - q_len + i`` (bottom-right aligned), so one call serves prefill chunks over a
    cached prefix and decode tokens alike. Returns ``out`` (and LSE float32 ``[num_heads,
    num_tokens]``, natural log, with ``return_lse=True``). See README.md for every argument.
    """
    xp = array_module(q=q, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                      seq_lens=seq_lens, query_start_loc=query_start_loc, out=out, workspace=workspace)
    num_tokens, num_heads, head_size = check_q(q)
    caches = check_caches(key_cache, value_cache, q, kv_cache_dtype, layout)
    num_kv_heads = caches["kv_heads"]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} (q's dimension 1) must be a multiple of num_kv_heads={num_kv_heads}")
    num_seqs = check_tables(block_tables, seq_lens, query_start_loc, num_tokens)
    causal, return_lse = check_bool("causal", causal), check_bool("return_lse", return_lse)
    window = check_optional_int("sliding_window", sliding_window, 0) or 0
    if window and not causal:
        raise ValueError("sliding_window requires causal=True")
    softcap = check_softcap(softcap)
    sinks = check_head_vector("sinks", sinks, num_heads, xp)
    alibi = check_head_vector("alibi_slopes", alibi_slopes, num_heads, xp)
    scale = 1.0 / math.sqrt(head_size) if scale is None else check_float("scale", scale)
    kv_split_size = check_optional_int("kv_split_size", kv_split_size, 1)
    max_query_len = check_optional_int("max_query_len", max_query_len, 0)
    max_seq_len = check_optional_int("max_seq_len", max_seq_len, 0)
    kv_scale_args(xp, kv_cache_dtype, k_scale, v_scale, num_kv_heads)  # checked even when nothing is launched
    check_writable("out", out)
    check_writable("workspace", workspace)
    out = check_out(out, q, "out")
    lse = xp.empty((num_heads, num_tokens), np.float32) if return_lse else None
    if validate_enabled(validate):
        validate_tables(block_tables, seq_lens, query_start_loc, key_cache.shape[0], caches["block_size"], num_tokens,
                        max_query_len=max_query_len, max_seq_len=max_seq_len)
        check_scale_values(kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    if num_tokens == 0:
        return (out, lse) if return_lse else out
    decode = query_start_loc is None
    group = num_heads // num_kv_heads
    max_q = 1 if decode else min(max_query_len or num_tokens, num_tokens)
    tiles = -(-max_q * group // ROWS)
    max_kv = max_seq_len or block_tables.shape[1] * caches["block_size"]
    split = kv_split_size if kv_split_size is not None else \
        choose_split(xp, num_seqs * num_kv_heads * tiles, max_kv)
    max_splits = max(1, -(-max_kv // split)) if split else 1
    partials = _carve(workspace, xp, num_tokens, num_heads, max_splits, head_size) if max_splits > 1 else None
    launch(xp, q, key_cache, value_cache, caches, block_tables, seq_lens, query_start_loc, out, lse, scale=scale,
           causal=causal, window=window, sinks=sinks, alibi=alibi, softcap=softcap, kv_cache_dtype=kv_cache_dtype,
           k_scale=k_scale, v_scale=v_scale, kv_split_size=split if max_splits > 1 else 0, max_splits=max_splits,
           tiles=tiles, partials=partials)
    return (out, lse) if return_lse else out


def workspace_bytes(num_tokens, num_heads, max_splits, head_size) -> int:
    """Bytes of split partials, all float32: max_logits, exp_sums and tmp_output (never rounded to the
    output's dtype before the merge)."""
    n = num_tokens * num_heads * max_splits
    return 8 * n + 4 * n * head_size + 256


def _carve(workspace, xp, num_tokens, num_heads, max_splits, head_size):
    if workspace is None:
        return None
    need = workspace_bytes(num_tokens, num_heads, max_splits, head_size)
    if workspace.dtype != np.uint8 or workspace.ndim != 1 or workspace.size < need:
        raise ValueError(f"workspace must be a 1-D uint8 array of >= {need} bytes for {max_splits} splits, got "
                         f"{workspace.dtype} shape {tuple(workspace.shape)}")
    n = num_tokens * num_heads * max_splits
    off = (-address(workspace)) % 256
    ml = workspace[off:off + 4 * n].view(np.float32).reshape(num_tokens, num_heads, max_splits)
    es = workspace[off + 4 * n:off + 8 * n].view(np.float32).reshape(num_tokens, num_heads, max_splits)
    tmp = workspace[off + 8 * n:off + 8 * n + 4 * n * head_size].view(np.float32)
    return ml, es, tmp.reshape(num_tokens, num_heads, max_splits, head_size)
