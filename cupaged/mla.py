"""MLA (DeepSeek multi-head latent attention): decode over the latent paged cache, and the
chunked-context prefill driver composing gather, up-projection, varlen attention and LSE merges."""

from __future__ import annotations

import math

import numpy as np

from cupaged._interop import accepts_foreign_arrays, as_native
from cupaged._attention_args import (check_heads, check_out, check_q, check_tables, softmax_scales, validate_offsets,
                                    validate_tables)
from cupaged._cache_args import cache_dtype, check_index, check_scale_values, scale_args
from cupaged._checks import check_bool, check_int, check_last_contiguous, check_ndim, check_optional_int, \
    check_writable, validate_enabled
from cupaged._backend import array_kind, array_module, empty, host_copy, module_of, upload
from cupaged._plan import check_workspace
from cupaged.attention import MLA_BUCKET, KvView, carve_workspace, plan_checked, run_attention
from cupaged.cache_gather import gather_and_maybe_dequant_cache
from cupaged.merge_attn_states import merge_attn_states

__all__ = ["mla_decode", "mla_chunked_prefill"]


@accepts_foreign_arrays
def mla_decode(q, kv_cache, block_tables, seq_lens, *, kv_lora_rank=512, scale=None, kv_cache_dtype="auto",
               k_scale=1.0, kv_split_size=None, max_seq_len=None, workspace=None, out=None, return_lse=False,
               validate=None):
    """Decode attention of absorbed queries ``q`` ``[num_seqs, num_heads, kv_lora_rank + rope_dim]``
    over the latent cache ``kv_cache`` ``[num_blocks, block_size, kv_lora_rank + rope_dim]``: the key
    is the whole latent row, the value its first ``kv_lora_rank`` entries (FlashMLA / vLLM MLA
    decode). ``scale`` is required: the softmax scale of the model's un-absorbed heads,
    1/sqrt(qk_nope_head_dim + qk_rope_head_dim), not of the latent row. All query heads share the
    one latent head; 16 heads per CTA, the CTAs of one split adjacent so they share the cache bytes
    in L2. Split-KV with an LSE merge for long contexts (a fixed ``kv_split_size`` is
    batch-invariant; ``workspace``, a uint8 array of ``plan.workspace_bytes``, holds the split
    partials, as for paged_attention); fp8 caches (uint8) with one ``k_scale``.
    Returns out ``[num_seqs, num_heads, kv_lora_rank]`` (and LSE ``[num_heads, num_seqs]``)."""
    xp = array_module(q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens, out=out,
                      workspace=workspace)
    if scale is None:
        raise TypeError("mla_decode needs scale=: the softmax scale of the model's un-absorbed heads, "
                        "1/sqrt(qk_nope_head_dim + qk_rope_head_dim) (e.g. 1/sqrt(192) for DeepSeek-V3), "
                        "not 1/sqrt of the latent row's size")
    scale, _ = softmax_scales(scale)
    check_ndim("q", q, 3, "[num_seqs, num_heads, kv_lora_rank + rope_dim]")
    num_seqs, num_heads, head_size = q.shape
    kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank, 1)
    if kv_lora_rank > head_size:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} exceeds q's head size {head_size} (= kv_lora_rank + rope_dim): "
                         f"pass your model's latent rank, e.g. kv_lora_rank={max(head_size - 64, 1)} for rope_dim 64")
    if head_size > MLA_BUCKET[0] or kv_lora_rank > MLA_BUCKET[1]:
        raise NotImplementedError(f"kv_lora_rank={kv_lora_rank} with q's head size {head_size}: MLA decode supports "
                                  f"latent rows up to {MLA_BUCKET[0]} and kv_lora_rank up to {MLA_BUCKET[1]}")
    check_q(q, max_head_size=MLA_BUCKET[0])
    check_ndim("kv_cache", kv_cache, 3, "[num_blocks, block_size, kv_lora_rank + rope_dim]")
    want = cache_dtype(kv_cache_dtype, q.dtype)
    if kv_cache.dtype != want:
        raise TypeError(f"kv_cache must have dtype {want} for q {q.dtype} and kv_cache_dtype={kv_cache_dtype!r}, "
                        f"got {kv_cache.dtype}")
    if kv_cache.shape[2] != head_size:
        raise ValueError(f"kv_cache rows must have q's head size {head_size}, got shape {tuple(kv_cache.shape)}")
    if kv_cache.shape[0] == 0 or kv_cache.shape[1] == 0:
        raise ValueError(f"kv_cache must have num_blocks >= 1 and block_size >= 1, got {tuple(kv_cache.shape)}")
    check_last_contiguous("kv_cache", kv_cache)
    if hasattr(k_scale, "size") and k_scale.size != 1:
        raise ValueError(f"k_scale must be one value (the latent cache has one head), got {k_scale.size}")
    check_tables(block_tables, seq_lens, None, num_seqs)
    kv_split_size = check_optional_int("kv_split_size", kv_split_size, 1)
    max_seq_len = check_optional_int("max_seq_len", max_seq_len, 0)
    return_lse = check_bool("return_lse", return_lse)
    check_workspace(workspace)
    out = check_out(out, q, "out", shape=(num_seqs, num_heads, kv_lora_rank))
    lse = empty(xp, (num_heads, num_seqs), np.float32) if return_lse else None
    if validate_enabled(validate):
        validate_tables(block_tables, seq_lens, None, kv_cache.shape[0], kv_cache.shape[1], num_seqs,
                        max_seq_len=max_seq_len)
        check_scale_values(kv_cache_dtype, k_scale=k_scale)
    if num_seqs == 0:
        return (out, lse) if return_lse else out
    kv = KvView.mla(kv_cache, kv_lora_rank, kv_cache_dtype)
    plan = plan_checked(q, kv, block_tables, seq_lens, max_seq_len=max_seq_len, kv_split_size=kv_split_size)
    run_attention(plan, q, kv, out, lse, block_tables, seq_lens, scale=scale, k_scale=k_scale, v_scale=k_scale,
                  partials=carve_workspace(workspace, plan))
    return (out, lse) if return_lse else out


@accepts_foreign_arrays
def mla_chunked_prefill(q, k_new, v_new, kv_cache, block_tables, cu_seqlens_q, context_lens, up_proj, *,
                        workspace_tokens=8192, scale=None, kv_cache_dtype="auto", k_scale=1.0, workspace=None,
                        out=None, return_lse=False, validate=None):
    """MLA prefill of new tokens over an already cached latent context, in bounded memory.

    q ``[total_q, num_heads, qk_head_size]``; k_new / v_new ``[total_q, num_kv_heads, qk /
    v_head_size]`` (the new tokens, already up-projected); kv_cache ``[num_blocks, block_size,
    latent]`` holds each sequence's ``context_lens[b]`` cached tokens (host int array; the chunk plan
    is made on the host) through ``block_tables``. The batch's context tokens, sequence after
    sequence, are cut into chunks of ``workspace_tokens`` (a chunk may hold the end of one sequence's
    context and the start of the next's); per chunk: ``gather_and_maybe_dequant_cache`` into the
    workspace ``[workspace_tokens, latent]`` (q's dtype; allocated when not given), ``up_proj(latent_rows)
    -> (k, v)`` (caller-supplied: no weights live in cupaged; it must return k ``[n, num_kv_heads,
    qk_head_size]`` and v ``[n, num_kv_heads, v_head_size]`` in q's dtype), non-causal
    dense varlen attention with LSE (as ``varlen_attention``), merged into the running state with ``merge_attn_states``; finally
    causal attention over the new tokens, merged last. The running state is ``out`` itself, merged in
    place, and the scratch (LSEs, a partial output, split partials) is allocated once per call; with
    one chunk the new tokens' partial output reuses the workspace, whose contents are scratch on
    return. Every input is checked before the first launch (an ``up_proj`` result failing its check
    may leave ``out`` partly written). Returns out ``[total_q, num_heads, v_head_size]`` (and LSE)."""
    xp = array_module(q=q, k_new=k_new, v_new=v_new, kv_cache=kv_cache, block_tables=block_tables,
                      cu_seqlens_q=cu_seqlens_q, out=out, workspace=workspace)
    plan = _check_chunked_prefill(xp, q, k_new, v_new, kv_cache, block_tables, cu_seqlens_q, context_lens, up_proj,
                                  workspace_tokens, scale, kv_cache_dtype, k_scale, workspace, out, validate)
    return_lse = check_bool("return_lse", return_lse)
    total_q, num_heads = q.shape[:2]
    chunks, batch = plan["chunks"], plan["batch"]
    if out is None:
        out = empty(xp, (total_q, num_heads, v_new.shape[2]), q.dtype)
    # [num_heads, total_q] each: the running state's LSE, and the part merged into it (one allocation)
    lses = empty(xp, (1 + bool(chunks), num_heads, total_q), np.float32) if chunks or return_lse else None
    lse = None if lses is None else lses[0]
    if chunks:
        workspace, part = _buffers(xp, workspace, plan["workspace_rows"], kv_cache.shape[2],
                                   (total_q, num_heads, v_new.shape[2]), q.dtype, len(chunks) == 1)
        index = upload(xp, plan["index"], "mla_chunked_prefill's chunk plan")
        partials = None
        for i, (n, max_len, at) in enumerate(chunks):
            cu_k, seq_starts = index[at:at + batch + 1], index[at + batch + 1:at + 2 * batch + 1]
            rows = workspace[:n]
            gather_and_maybe_dequant_cache(kv_cache, rows, block_tables, cu_k, index[at + 2 * batch + 1:][:n], n,
                                           kv_cache_dtype, k_scale, seq_starts, validate=False)
            k_c, v_c = _up_projected(up_proj, rows, n, plan["kv_shapes"], q.dtype)
            # the first chunk's state is the running state; each later one merges into it in place
            into = (out, lse) if i == 0 else (part, lses[1])
            partials = _attend(q, k_c, v_c, cu_seqlens_q, cu_k, False, max_len, scale, *into, partials)
            if i:
                merge_attn_states(out, out, lse, part, lses[1], lse)
        _attend(q, k_new, v_new, cu_seqlens_q, cu_seqlens_q, True, None, scale, part, lses[1])
        merge_attn_states(out, out, lse, part, lses[1], lse if return_lse else None)
    else:
        _attend(q, k_new, v_new, cu_seqlens_q, cu_seqlens_q, True, None, scale, out, lse)
    return (out, lse) if return_lse else out


def _check_chunked_prefill(xp, q, k_new, v_new, kv_cache, block_tables, cu_seqlens_q, context_lens, up_proj,
                           workspace_tokens, scale, kv_cache_dtype, k_scale, workspace, out, validate):
    """Every argument of mla_chunked_prefill, before the first launch; returns the chunk plan."""
    total_q, num_heads, qk_head_size = check_q(q)
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        check_ndim(name, a, 3, f"[total_q, num_kv_heads, {'qk' if name == 'k_new' else 'v'}_head_size]")
        if a.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {a.dtype}")
    if k_new.shape != (total_q, k_new.shape[1], qk_head_size) or v_new.shape[:2] != k_new.shape[:2]:
        raise ValueError(f"k_new must be [{total_q}, num_kv_heads, {qk_head_size}] and v_new [{total_q}, num_kv_heads, "
                         f"v_head_size], got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
    num_kv_heads, v_head_size = k_new.shape[1], v_new.shape[2]
    check_heads(num_heads, num_kv_heads, "q", "k_new")
    check_ndim("kv_cache", kv_cache, 3, "[num_blocks, block_size, latent]")
    want = cache_dtype(kv_cache_dtype, q.dtype)
    if kv_cache.dtype != want:
        raise TypeError(f"kv_cache must have dtype {want} for q {q.dtype} and kv_cache_dtype={kv_cache_dtype!r}, "
                        f"got {kv_cache.dtype}")
    check_last_contiguous("kv_cache", kv_cache)
    num_blocks, block_size, latent = kv_cache.shape
    if block_size == 0 or latent == 0:
        raise ValueError(f"kv_cache must have block_size >= 1 and latent >= 1, got {tuple(kv_cache.shape)}")
    check_index("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    check_index("cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1]")
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 0 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have one row per sequence (batch = len(cu_seqlens_q) - 1 = {batch}), "
                         f"got {block_tables.shape[0]}")
    if array_kind(context_lens) is None and not isinstance(context_lens, (list, tuple)):
        raise TypeError(f"context_lens must be a host int array or list, got {type(context_lens).__name__}")
    contexts = np.asarray(host_copy(context_lens))
    if contexts.dtype.kind not in "iu" and contexts.size:
        raise TypeError(f"context_lens must hold ints, got dtype {contexts.dtype}")
    contexts = contexts.astype(np.int64).reshape(-1)
    if contexts.shape[0] != batch or (contexts.size and contexts.min() < 0):
        raise ValueError(f"context_lens must hold batch={batch} values >= 0, got {contexts.tolist()}")
    if contexts.size and -(-contexts.max() // block_size) > block_tables.shape[1]:
        raise ValueError(f"context_lens[{int(contexts.argmax())}] = {contexts.max()} needs more blocks than "
                         f"block_tables' {block_tables.shape[1]} columns")
    if not callable(up_proj):
        raise TypeError(f"up_proj must be a callable latent_rows -> (k, v), got {type(up_proj).__name__}")
    check_int("workspace_tokens", workspace_tokens, 1)
    softmax_scales(scale, None, qk_head_size)  # now: the first chunk's gather launches before run_attention sees it
    scale_args("k_scale", k_scale, xp, kv_cache_dtype, None)
    if workspace is not None:
        check_writable("workspace", workspace)
        if workspace.ndim != 2 or workspace.shape[0] < 1 or workspace.shape[1] != latent or workspace.dtype != q.dtype:
            raise ValueError(f"workspace must be [workspace_tokens >= 1, {latent}] of q's dtype {q.dtype}, got "
                             f"{workspace.dtype} {tuple(workspace.shape)}")
        check_last_contiguous("workspace", workspace)
    if out is not None:
        check_out(out, q, "out", shape=(total_q, num_heads, v_head_size))
    if validate_enabled(validate):
        validate_offsets("cu_seqlens_q", cu_seqlens_q, total_q)
        validate_tables(block_tables, contexts.astype(np.int32), None, num_blocks, block_size, batch)
        check_scale_values(kv_cache_dtype, k_scale=k_scale)
    tokens = int(workspace_tokens) if workspace is None else workspace.shape[0]
    chunks, index = _chunks(contexts, tokens)
    return dict(batch=batch, kv_shapes=((num_kv_heads, qk_head_size), (num_kv_heads, v_head_size)), chunks=chunks,
                index=index, workspace_rows=min(tokens, int(contexts.sum())))


def _chunks(contexts, tokens):
    """The batch's context tokens taken sequence after sequence, ``tokens`` at a time: (n, max_len,
    offset) per chunk (its tokens, its longest sequence's) and one int32 host array holding at each
    offset the chunk's cu_seqlens_k [batch + 1], seq_starts [batch] and token_to_seq [n], uploaded once."""
    ends = np.cumsum(contexts)
    starts = ends - contexts
    total, batch = (int(ends[-1]) if ends.size else 0), contexts.shape[0]
    los = range(0, total, tokens)
    index = np.empty(len(los) * (2 * batch + 1) + total, np.int32)
    seqs = np.arange(batch, dtype=np.int32)
    plan, at = [], 0
    for lo in los:
        hi = lo + tokens
        first, last = np.minimum(np.maximum(starts, lo), hi), np.minimum(np.maximum(ends, lo), hi)
        lens, n = last - first, min(tokens, total - lo)
        index[at] = 0
        np.cumsum(lens, out=index[at + 1:at + batch + 1])
        index[at + batch + 1:at + 2 * batch + 1] = first - starts
        index[at + 2 * batch + 1:at + 2 * batch + 1 + n] = np.repeat(seqs, lens)
        plan.append((n, int(lens.max()), at))
        at += 2 * batch + 1 + n
    return plan, index


def _buffers(xp, workspace, rows, latent, part_shape, dtype, one_chunk):
    """(latent workspace [rows, latent], part [total_q, num_heads, v_head_size]) with one allocation at
    most. With one chunk the part is needed only once the latent rows are dead (the new tokens'
    attention), so it shares their memory: the caller's workspace where it is contiguous and large
    enough, else one buffer sized for the larger of the two."""
    part_size = math.prod(part_shape)
    if workspace is not None and one_chunk and workspace.flags.c_contiguous and workspace.size >= part_size:
        return workspace, workspace.reshape(-1)[:part_size].reshape(part_shape)
    own = 0 if workspace is not None else rows * latent
    flat = empty(xp, (max(own, part_size) if one_chunk else own + part_size,), dtype)
    if workspace is None:
        workspace = flat[:own].reshape(rows, latent)
    return workspace, flat[0 if one_chunk else own:][:part_size].reshape(part_shape)


def _up_projected(up_proj, rows, n, kv_shapes, dtype):
    """up_proj(rows) checked: (k [n, num_kv_heads, qk_head_size], v [n, num_kv_heads, v_head_size]) in q's dtype."""
    result = up_proj(rows)
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(f"up_proj must return a (k, v) pair, got {type(result).__name__}")
    result = tuple(as_native(f"up_proj's {name}", a) for name, a in zip("kv", result))  # e.g. torch tensors
    for name, a, (heads, size) in zip(("k", "v"), result, kv_shapes):
        if not hasattr(a, "shape") or tuple(a.shape) != (n, heads, size) or a.dtype != dtype:
            got = f"{a.dtype} {tuple(a.shape)}" if hasattr(a, "shape") else type(a).__name__
            raise ValueError(f"up_proj's {name} must be [{n}, {heads}, {size}] (num_kv_heads of k_new / v_new) of "
                             f"q's dtype {dtype}, got {got}")
    return result


def _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, max_seqlen_k, scale, out, lse, partials=None):
    """Dense varlen attention of checked arguments into out (and lse), planned and run. ``partials``:
    a uint8 buffer for split partials, reused across chunks; returns it, grown if this plan needs more."""
    for name, a in (("k", k), ("v", v)):
        check_last_contiguous(f"up_proj's {name}" if max_seqlen_k else f"{name}_new", a)
    if q.shape[0] == 0 or cu_seqlens_q.shape[0] == 1:
        if lse is not None:
            lse[...] = -np.inf
        return partials
    kv = KvView.dense(k, v)
    plan = plan_checked(q, kv, None, cu_seqlens_k, cu_seqlens_q, max_seq_len=max_seqlen_k)
    if plan.partial_shapes is not None and (partials is None or partials.size < plan.workspace_bytes):
        partials = empty(module_of(q), (plan.workspace_bytes,), np.uint8)
    run_attention(plan, q, kv, out, lse, None, cu_seqlens_k, cu_seqlens_q, scale=scale, causal=causal,
                  partials=carve_workspace(partials, plan))
    return partials
