"""vLLM-compatible ``paged_attention_v1`` / ``paged_attention_v2`` (decode over the vLLM cache layout
K ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``, V ``[num_blocks, num_kv_heads,
head_size, block_size]``), on the kernels of kernels_cu/paged_attention.cu."""

from __future__ import annotations

import numpy as np

from cupaged._interop import accepts_foreign_arrays
from cupaged._attention_args import (check_head_vector, check_heads, check_out, check_q, check_tables, softmax_scales,
                                    validate_tables)
from cupaged._cache_args import check_scale_values
from cupaged._checks import check_dtype, check_int, check_ndim, check_writable, validate_enabled
from cupaged._backend import array_module
from cupaged._plan import split_count
from cupaged.attention import KvView, plan_checked, run_attention

__all__ = ["paged_attention_v1", "paged_attention_v2", "PARTITION_SIZE"]

PARTITION_SIZE = 512


def _common(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
            alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank, blocksparse, validate, extra=None):
    """Checks shared by v1 and v2; returns (xp, KvView, alibi, scale, max_seq_len)."""
    xp = array_module(out=out, query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                      seq_lens=seq_lens, **(extra or {}))
    for name, value in blocksparse.items():
        if check_int(name, value, 0):
            raise NotImplementedError(f"{name}={value}: block-sparse attention is not supported")
    check_int("tp_rank", tp_rank, 0)
    num_seqs, num_heads, head_size = check_q(query, "query")
    check_out(out, query, "out")
    kv = KvView.paged(key_cache, value_cache, query, kv_cache_dtype, "vllm")
    if check_int("num_kv_heads", num_kv_heads, 1) != kv.num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} does not match key_cache's {kv.num_kv_heads} heads")
    if check_int("block_size", block_size, 1) != kv.block_size:
        raise ValueError(f"block_size={block_size} does not match key_cache's block size {kv.block_size}")
    check_heads(num_heads, num_kv_heads, "query")
    check_tables(block_tables, seq_lens, None, num_seqs)
    scale, _ = softmax_scales(scale)
    max_seq_len = check_int("max_seq_len", max_seq_len, 0, 2**31 - 1)
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if hasattr(value, "size") and value.size != 1 and kv_cache_dtype != "auto":
            raise ValueError(f"{name} must be one value (per-tensor) for paged_attention_v1/v2, got {value.size}")
    alibi = check_head_vector("alibi_slopes", alibi_slopes, num_heads, xp)
    if validate_enabled(validate):
        validate_tables(block_tables, seq_lens, None, key_cache.shape[0], block_size, num_seqs, max_seq_len=max_seq_len)
        check_scale_values(kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    return xp, kv, alibi, scale, max_seq_len


def _blocksparse(local_blocks, vert_stride, block_size, head_sliding_step):
    check_int("blocksparse_block_size", block_size, 1)
    return dict(blocksparse_local_blocks=local_blocks, blocksparse_vert_stride=vert_stride,
                blocksparse_head_sliding_step=head_sliding_step)


@accepts_foreign_arrays
def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                       max_seq_len, alibi_slopes, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, tp_rank=0,
                       blocksparse_local_blocks=0, blocksparse_vert_stride=0, blocksparse_block_size=64,
                       blocksparse_head_sliding_step=0, *, validate=None):
    """vLLM's ``paged_attention_v1``: one query per sequence; writes ``out``. ``max_seq_len`` is the grid
    hint (checked against ``seq_lens`` with ``validate=True``): a few long contexts are split across
    more CTAs and merged, as ``paged_attention`` does; otherwise each context is one pass."""
    xp, kv, alibi, scale, max_seq_len = _common(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
        alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank,
        _blocksparse(blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
                     blocksparse_head_sliding_step), validate)
    if query.shape[0]:
        plan = plan_checked(query, kv, block_tables, seq_lens, max_seq_len=max_seq_len or None)
        run_attention(plan, query, kv, out, None, block_tables, seq_lens, scale=scale, alibi_slopes=alibi,
                      k_scale=k_scale, v_scale=v_scale)


@accepts_foreign_arrays
def paged_attention_v2(out, exp_sums, max_logits, tmp_output, query, key_cache, value_cache, num_kv_heads, scale,
                       block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype="auto",
                       k_scale=1.0, v_scale=1.0, tp_rank=0, blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                       blocksparse_block_size=64, blocksparse_head_sliding_step=0, *, validate=None):
    """vLLM's ``paged_attention_v2``: contexts split into partitions of 512 tokens; each writes its max
    logit and exp-sum (relative to that max) into ``max_logits``/``exp_sums`` float32 ``[num_seqs,
    num_heads, max_num_partitions]`` and its normalized output into ``tmp_output`` ``[..., head_size]``
    (query's dtype, as in vLLM); a second kernel merges them into ``out``. Partitions at or past
    ceil(seq_len / 512) are untouched. A sequence longer than ``max_num_partitions`` partitions of 512
    (an understated ``max_seq_len``) is split into that many larger partitions instead: its output is
    still right and nothing outside its own rows is written (``validate=True`` raises instead)."""
    xp, kv, alibi, scale, max_seq_len = _common(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
        alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank,
        _blocksparse(blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
                     blocksparse_head_sliding_step), validate,
        extra=dict(exp_sums=exp_sums, max_logits=max_logits, tmp_output=tmp_output))
    num_seqs, num_heads, head_size = query.shape
    for name, a in (("exp_sums", exp_sums), ("max_logits", max_logits)):
        check_ndim(name, a, 3, "[num_seqs, num_heads, max_num_partitions]")
        check_dtype(name, a, (np.float32,))
    partitions = exp_sums.shape[2]
    need = split_count(max_seq_len, PARTITION_SIZE)
    for name, a, shape in (("exp_sums", exp_sums, (num_seqs, num_heads, partitions)),
                           ("max_logits", max_logits, (num_seqs, num_heads, partitions)),
                           ("tmp_output", tmp_output, (num_seqs, num_heads, partitions, head_size))):
        if tuple(a.shape) != shape or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a contiguous {shape} array, got shape {tuple(a.shape)}")
        check_writable(name, a)
    if tmp_output.dtype != query.dtype:
        raise TypeError(f"tmp_output must have query's dtype {query.dtype}, got {tmp_output.dtype}")
    if partitions < max(need, 1 if num_seqs else 0):
        raise ValueError(f"max_num_partitions={partitions} (exp_sums' last dimension) < ceil(max_seq_len / "
                         f"{PARTITION_SIZE}) = {need}")
    if num_seqs:
        plan = plan_checked(query, kv, block_tables, seq_lens, kv_split_size=PARTITION_SIZE, max_splits=partitions,
                            always_partials=True)
        run_attention(plan, query, kv, out, None, block_tables, seq_lens, scale=scale, alibi_slopes=alibi,
                      k_scale=k_scale, v_scale=v_scale, partials=(max_logits, exp_sums, tmp_output))
