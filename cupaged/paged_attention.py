"""Paged attention (kernels_cu/paged_attention.cu): varlen prefill chunks and decode tokens in one
call, GQA/MQA, causal / sliding window / sinks / ALiBi / soft-capping, fp8 caches, LSE, split-KV.
Validate, plan, run: the engine is cupaged/attention.py."""

from __future__ import annotations

import numpy as np

from cupaged._interop import accepts_foreign_arrays
from cupaged._attention_args import (check_head_vector, check_heads, check_out, check_q, check_tables, check_window,
                                    softmax_scales, validate_tables)
from cupaged._cache_args import check_scale_values, kv_scale_args
from cupaged._custom_mask import check_custom_mask, content_checked, packed_custom_mask, validate_custom_mask
from cupaged._checks import check_bool, check_choice, check_optional_int, validate_enabled
from cupaged._backend import array_module, empty
from cupaged._plan import check_workspace
from cupaged.attention import FAMILY, HEAD_BUCKETS, KvView, carve_workspace, plan_checked, run_attention, workspace_bytes

__all__ = ["paged_attention", "workspace_bytes", "HEAD_BUCKETS", "FAMILY"]


@accepts_foreign_arrays
def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc=None, *, scale=None,
                    causal=True, sliding_window=None, window_size=None, sinks=None, alibi_slopes=None, softcap=None,
                    kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, layout="NHD", kv_split_size=None,
                    max_query_len=None, max_seq_len=None, workspace=None, out=None, return_lse=False, validate=None,
                    custom_mask=None, mask_indptr=None, min_query_len=None):
    """Attention of ``q`` ``[num_tokens, num_heads, head_size]`` over a paged KV cache.

    ``query_start_loc`` (int32 ``[num_seqs + 1]``) splits the tokens into sequences; ``None`` means
    decode (one query per sequence). Query i of sequence s sits at position
    ``seq_lens[s] - q_len + i`` (bottom-right aligned), so one call serves prefill chunks over a
    cached prefix and decode tokens alike. ``window_size=(left, right)``: FlashAttention's local window (a query at
    position p sees keys p - left .. p + right, -1 unbounded; causal caps right at 0); not with
    ``sliding_window``. ``custom_mask`` / ``mask_indptr``: a tree mask per request (FlashInfer's: q_len x seq_len
    booleans, row-major, concatenated; or bit-packed little-endian by 8 per request; cupaged/_custom_mask.py), AND-ed
    with the other masks; a query may not see a later key index than its own. ``min_query_len``: a hint that every
    query run is at least that long (past 16: no decode-kernel launch; the prefill kernel takes every run, so a hint
    that overstates costs speed, not results). Returns ``out`` (and LSE float32
    ``[num_heads,
    num_tokens]``, natural log, with ``return_lse=True``). See README.md for every argument.
    """
    xp = array_module(q=q, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                      seq_lens=seq_lens, query_start_loc=query_start_loc, out=out, workspace=workspace)
    num_tokens, num_heads, head_size = check_q(q)
    check_choice("layout", layout, ("NHD", "HND"))  # vLLM's layout is paged_attention_v1/v2's
    kv = KvView.paged(key_cache, value_cache, q, kv_cache_dtype, layout)
    check_heads(num_heads, kv.num_kv_heads)
    check_tables(block_tables, seq_lens, query_start_loc, num_tokens)
    causal, return_lse = check_bool("causal", causal, strict=True), check_bool("return_lse", return_lse)
    window, window_size = check_window(sliding_window, window_size, causal)
    scale, softcap = softmax_scales(scale, softcap, head_size)
    sinks = check_head_vector("sinks", sinks, num_heads, xp)
    alibi = check_head_vector("alibi_slopes", alibi_slopes, num_heads, xp)
    kv_split_size = check_optional_int("kv_split_size", kv_split_size, 1)
    max_query_len = check_optional_int("max_query_len", max_query_len, 0)
    max_seq_len = check_optional_int("max_seq_len", max_seq_len, 0)
    min_query_len = check_optional_int("min_query_len", min_query_len, 0)
    kv_scale_args(xp, kv_cache_dtype, k_scale, v_scale, kv.num_kv_heads)  # checked even when nothing is launched
    check_workspace(workspace)
    check_custom_mask(custom_mask, mask_indptr, block_tables.shape[0])
    out = check_out(out, q, "out")
    lse = empty(xp, (num_heads, num_tokens), np.float32) if return_lse else None
    if validate_enabled(validate):
        validate_tables(block_tables, seq_lens, query_start_loc, key_cache.shape[0], kv.block_size, num_tokens,
                        max_query_len=max_query_len, max_seq_len=max_seq_len)
        check_scale_values(kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    if custom_mask is not None and content_checked(validate_enabled(validate), custom_mask, mask_indptr,
                                                   query_start_loc, seq_lens):
        validate_custom_mask(custom_mask, mask_indptr, query_start_loc, seq_lens)
    custom_mask, mask_indptr = packed_custom_mask(custom_mask, mask_indptr, query_start_loc, seq_lens)
    if num_tokens == 0:
        return (out, lse) if return_lse else out
    plan = plan_checked(q, kv, block_tables, seq_lens, query_start_loc, max_query_len=max_query_len,
                        max_seq_len=max_seq_len, kv_split_size=kv_split_size, min_query_len=min_query_len)
    partials = carve_workspace(workspace, plan)
    run_attention(plan, q, kv, out, lse, block_tables, seq_lens, query_start_loc, scale=scale, causal=causal,
                  sliding_window=window, window_size=window_size, sinks=sinks, alibi_slopes=alibi, softcap=softcap,
                  k_scale=k_scale, v_scale=v_scale, partials=partials, custom_mask=custom_mask,
                  mask_indptr=mask_indptr)
    return (out, lse) if return_lse else out
