"""Dense varlen attention (FlashAttention's ``flash_attn_varlen_func`` semantics) on the paged
attention kernel's dense mode: keys and values are token rows addressed through cu_seqlens_k."""

from __future__ import annotations

import numpy as np

from cupaged._interop import accepts_foreign_arrays
from cupaged._attention_args import (check_head_vector, check_heads, check_hint, check_out, check_q, check_window,
                                    softmax_scales, validate_offsets)
from cupaged._cache_args import check_index
from cupaged._checks import check_bool, check_optional_int, validate_enabled
from cupaged._backend import array_module, empty, host_copy
from cupaged.attention import KvView, plan_checked, run_attention

__all__ = ["varlen_attention"]


@accepts_foreign_arrays
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=True, max_seqlen_q=None,
                     max_seqlen_k=None, window_size=(-1, -1), softcap=None, alibi_slopes=None, sinks=None,
                     seqused_k=None, out=None, return_lse=False, validate=None):
    """Attention of varlen sequences packed along the token axis: q ``[total_q, num_heads,
    qk_head_size]``, k ``[total_k, num_kv_heads, qk_head_size]``, v ``[total_k, num_kv_heads,
    v_head_size]`` (v_head_size may differ, e.g. MLA prefill 192/128); sequence b owns q rows
    cu_seqlens_q[b]..[b+1] and k/v rows cu_seqlens_k[b]..[b+1]. Causal masking is bottom-right
    aligned: query i sees keys j <= i + len_k - len_q. Returns out ``[total_q, num_heads,
    v_head_size]`` (and LSE float32 ``[num_heads, total_q]``, -inf for rows that see no key).
    ``max_seqlen_q`` / ``max_seqlen_k`` are optional host-side hints for the grid: the query tiles, and
    whether a few long key ranges are split across more CTAs (without ``max_seqlen_k``, one pass).
    FlashAttention's ``flash_attn_varlen_func`` options: ``window_size=(left, right)`` (a query at position p sees
    keys p - left .. p + right, -1 unbounded, causal caps right at 0; non-causal windows too), ``softcap``,
    ``alibi_slopes`` (float32 ``[num_heads]``, bias -slope |key - query|), and ``seqused_k`` (int32 ``[batch]``:
    sequence b uses only its first seqused_k[b] key rows, which also set its queries' bottom-right positions);
    ``sinks`` (float32 ``[num_heads]``): a logit per head joining each row's softmax denominator (gpt-oss)."""
    xp = array_module(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                      out=out)
    total_q, num_heads, head_size = check_q(q)
    kv = KvView.dense(k, v)  # k and v alike: rank, dtype, rows, heads
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if kv.head_size != head_size:
        raise ValueError(f"k's head size {kv.head_size} must equal q's {head_size}")
    v_head_size = kv.v_head_size
    check_heads(num_heads, kv.num_kv_heads, "q", "k")
    check_index("cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1]")
    check_index("cu_seqlens_k", cu_seqlens_k, 1, "[batch + 1]")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0] or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both be [batch + 1], got {cu_seqlens_q.shape[0]} "
                         f"and {cu_seqlens_k.shape[0]} entries")
    batch = cu_seqlens_q.shape[0] - 1
    if seqused_k is not None:
        check_index("seqused_k", seqused_k, 1, "[batch]")
        if seqused_k.shape[0] != batch:
            raise ValueError(f"seqused_k must be [batch] = [{batch}] (one count a sequence), got {seqused_k.shape[0]}")
    if batch > 65535:
        raise NotImplementedError(f"cu_seqlens_q: at most 65535 sequences per call, got {batch}")
    causal, return_lse = check_bool("causal", causal, strict=True), check_bool("return_lse", return_lse)
    _, window_size = check_window(None, window_size, causal)
    scale, softcap = softmax_scales(scale, softcap, head_size)
    sinks = check_head_vector("sinks", sinks, num_heads, xp)
    alibi = check_head_vector("alibi_slopes", alibi_slopes, num_heads, xp)
    max_seqlen_q = check_optional_int("max_seqlen_q", max_seqlen_q, 0)
    max_seqlen_k = check_optional_int("max_seqlen_k", max_seqlen_k, 0)
    out = check_out(out, q, "out", shape=(total_q, num_heads, v_head_size))
    lse = empty(xp, (num_heads, total_q), np.float32) if return_lse else None
    if validate_enabled(validate):
        for name, cu, total, hint in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                      ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
            lens = validate_offsets(name, cu, total, exact=False)
            if name == "cu_seqlens_k" and seqused_k is not None:
                used = host_copy(seqused_k).astype(np.int64)
                bad = np.flatnonzero((used < 0) | (used > lens))
                if bad.size:
                    raise ValueError(f"seqused_k[{bad[0]}] = {used[bad[0]]} must be within 0..{lens[bad[0]]} (the "
                                     f"sequence's key rows in cu_seqlens_k)")
                lens = used
            if batch:
                check_hint(f"max_seqlen_{name[-1]}", hint, int(lens.max()), f"the longest sequence's length in {name}")
    if total_q == 0 or batch == 0:
        if return_lse:
            lse[...] = -np.inf
        return (out, lse) if return_lse else out
    plan = plan_checked(q, kv, None, cu_seqlens_k, cu_seqlens_q, max_query_len=max_seqlen_q, max_seq_len=max_seqlen_k)
    run_attention(plan, q, kv, out, lse, None, cu_seqlens_k, cu_seqlens_q, scale=scale, causal=causal,
                  window_size=window_size, softcap=softcap, sinks=sinks, alibi_slopes=alibi, seqused_k=seqused_k)
    return (out, lse) if return_lse else out
