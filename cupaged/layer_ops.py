"""What :mod:`cupaged.layers` computes around the kernels: the projections, RMSNorm, the RoPE cos / sin cache,
a batch plan's arrays on the device and the checks of its contents, and cross attention's per-request context
keys and values."""

from __future__ import annotations

import weakref

import numpy as np

from cupaged._attention_args import check_hint, validate_offsets, validate_tables
from cupaged._backend import device_key, host_copy, is_host_array, module_of, on_sim, to_device
from cupaged._cache_args import check_slots_in_pool
from cupaged._checks import check_int
from cupaged._custom_mask import check_custom_mask, content_checked, validate_custom_mask
from cupaged.kv_cache import KVCache

__all__ = ["ContextCache", "linear", "rms_norm", "layer_norm", "qk_normalize", "rope_cache", "rope_rows",
           "rope_positions", "check_positions", "cache_arrays", "cascade_blocks", "cascade_level", "device_plan",
           "validate_plan", "whole_sequences", "check_plan_mask"]

_DEVICE_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # host BatchPlan -> {xp: its upload}
_ROPE_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # RotaryEmbedding -> {xp: cos_sin}


def linear(x, w, b=None):
    """y = x · wᵀ (+ b ``[out_features]``) for w ``[out_features, in_features]``, accumulated in float32 and
    rounded once to x's dtype: ``xp.matmul`` (cuBLAS on a GPU, which accumulates 16-bit inputs in float32, then
    the bias added in float32: a second rounding); on numpy, and for bfloat16, through float32 copies (numpy has no
    16-bit BLAS)."""
    xp = module_of(x)
    if x.dtype == np.float32 or (not on_sim(xp) and x.dtype == np.float16):
        y = xp.matmul(x, w.T)
        return y if b is None else (y.astype(np.float32) + b.astype(np.float32)).astype(x.dtype)
    y = xp.matmul(x.astype(np.float32), w.T.astype(np.float32))
    return (y if b is None else y + b.astype(np.float32)).astype(x.dtype)


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last dimension: x / sqrt(mean(x²) + eps) · weight (None: no weight), in float32, rounded
    once."""
    x32 = x.astype(np.float32)
    xp = module_of(x)
    y = x32 / xp.sqrt(xp.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
    return (y if weight is None else y * weight.astype(np.float32)).astype(x.dtype)


def layer_norm(x, weight, eps: float):
    """LayerNorm over the last dimension without a bias: (x - mean) / sqrt(var + eps) · weight (``[head_dim]``, or
    ``[heads, head_dim]`` for x ``[tokens, heads, head_dim]``), in float32, rounded once."""
    x32 = x.astype(np.float32)
    xp = module_of(x)
    d = x32 - xp.mean(x32, axis=-1, keepdims=True)
    y = d / xp.sqrt(xp.mean(d * d, axis=-1, keepdims=True) + np.float32(eps))
    return (y * weight.astype(np.float32)).astype(x.dtype)


def qk_normalize(x, kind: str | None, weight, eps: float):
    """x ``[tokens, heads, head_dim]`` normalized as the layer's ``qk_norm`` says (cupaged._layer_options): over
    head_dim, or over all heads' features ("rms_all_heads"); x itself for None."""
    if kind is None:
        return x
    if kind == "layer_head":
        return layer_norm(x, weight, eps)
    if kind == "rms_all_heads":
        t, heads, d = x.shape
        return rms_norm(x.reshape(t, heads * d), weight, eps).reshape(t, heads, d)
    return rms_norm(x, weight if kind == "rms_head" else None, eps)


def rope_positions(plan, block_size: int) -> int:
    """How many positions the layer's cos / sin cache covers for ``plan``: as many as its block tables hold. A
    sequence's positions lie below its seq_len, which its table must hold; a bound from shapes, not from the
    max_seq_len hint, so an understated hint never makes the kernel read past the cache."""
    return max(plan.block_tables.shape[1] * block_size, 1)


def check_positions(plan, block_size: int) -> None:
    """Every position of ``plan`` in what the cos / sin cache covers, ``rope_positions`` (reads a device array)."""
    num_positions, pos = rope_positions(plan, block_size), host_copy(plan.positions)
    bad = np.flatnonzero((pos < 0) | (pos >= num_positions))
    if bad.size:
        raise ValueError(f"plan.positions[{bad[0]}] = {pos[bad[0]]} is outside the layer's RoPE cos / sin cache: "
                         f"positions must be in [0, {num_positions}), the {plan.block_tables.shape[1]} blocks of "
                         f"{block_size} tokens a row of plan.block_tables holds")


def rope_cache(rope, num_positions: int, xp):
    """``rope.cos_sin_cache`` covering positions below ``num_positions``, on xp's device: grown by doubling, shared
    by every layer holding the same :class:`cupaged.RotaryEmbedding`."""
    per_xp = _ROPE_CACHES.setdefault(rope, {})
    key = device_key(xp)
    have = per_xp.get(key)
    if have is None or have.shape[0] < num_positions:
        n = max(64, 1 << max(int(num_positions) - 1, 1).bit_length())
        have = per_xp[key] = to_device(xp, rope.cos_sin_cache(n),
                                       "the layer's RoPE cos / sin cache (run a step before capturing)")
    return have


def rope_rows(rope, plan, xp):
    """(token indices, table) for ``rope_and_cache`` under a scaling whose frequencies follow each sequence's
    current length (``rope.per_length``: dynamic NTK, LongRoPE): row t of the table holds token t's cos / sin at its
    position with its own sequence's frequencies, indexed by int32 t. Reads the plan's positions, seq_lens and
    query_start_loc on the host (a device read for a device plan), and uploads the table every step."""
    positions = host_copy(plan.positions).astype(np.int64)
    q_lens = np.diff(host_copy(plan.query_start_loc).astype(np.int64))
    lens = np.repeat(host_copy(plan.seq_lens).astype(np.int64), q_lens)
    table = rope.cos_sin_rows(positions, lens)
    what = "the layer's per-sequence RoPE rows (a dynamic / longrope scaling reads the plan every step)"
    return to_device(xp, np.arange(positions.shape[0], dtype=np.int32), what), to_device(xp, table, what)


def cache_arrays(attn, kv_cache, layer, plan, xp):
    """Layer ``layer``'s key and value caches of ``kv_cache``, checked against the layer ``attn`` and the plan."""
    if not isinstance(kv_cache, KVCache):
        raise TypeError(f"kv_cache must be a cupaged.KVCache for attn_type='self', got {type(kv_cache).__name__}")
    layer = check_int("layer", layer, 0, kv_cache.num_layers - 1)
    if kv_cache.layout not in ("NHD", "HND"):
        raise NotImplementedError(f"kv_cache.layout={kv_cache.layout!r}: the layer writes and reads flash "
                                  f"caches ('NHD' or 'HND')")
    if (kv_cache.num_kv_heads, kv_cache.head_size, kv_cache.dtype) != (attn.n_kv_heads, attn.head_dim, attn.dtype):
        raise ValueError(f"kv_cache holds {kv_cache.num_kv_heads} kv heads of {kv_cache.head_size} in "
                         f"{kv_cache.dtype}; the layer has {attn.n_kv_heads} of {attn.head_dim} in {attn.dtype}")
    if plan.block_size is not None and plan.block_size != kv_cache.block_size:
        raise ValueError(f"kv_cache has blocks of {kv_cache.block_size} tokens; plan's pool has blocks of "
                         f"{plan.block_size}")
    key, value = kv_cache.key(layer), kv_cache.value(layer)
    if module_of(key) is not xp:
        raise TypeError("kv_cache lives on another backend than x (numpy arrays: the sim; cupy: the GPU)")
    return key, value


# When the layer takes cascade attention by itself (cascade=None), as vLLM's use_cascade_attention decides: a
# shared prefix long enough, and requests enough, that reading it once pays for a second launch and the merge.
CASCADE_MIN_TOKENS = 256
CASCADE_MIN_REQUESTS = 8


def cascade_blocks(plan, block_size: int, cascade, options) -> int:
    """How many of the plan's shared prefix blocks (BatchPlan.shared_prefix_blocks) the layer reads as a cascade
    level: all of them when ``cascade`` is True, none when False, and under the rule above when None; none with a
    sliding window or ALiBi (their masks depend on each query's distance into the prefix)."""
    n = plan.shared_prefix_blocks
    if not n or cascade is False or options.sliding_window is not None or options.alibi_slopes is not None:
        return 0
    if cascade is None and (n * block_size < CASCADE_MIN_TOKENS or plan.num_seqs < CASCADE_MIN_REQUESTS):
        return 0
    return n


def cascade_level(plan, n: int, block_size: int, xp):
    """(the CascadeLevel of the batch's first ``n`` blocks, shared by every sequence; the sequences' own tables and
    lengths past them)."""
    from cupaged.cascade import CascadeLevel

    what = "the layer's cascade level (cascade attention reads it every step: not while capturing)"
    starts = to_device(xp, np.array([0, plan.num_seqs], np.int32), what)
    lens = to_device(xp, np.array([n * block_size], np.int32), what)
    level = CascadeLevel(starts, plan.block_tables[:1, :n], lens)
    return level, plan.block_tables[:, n:], plan.seq_lens - np.int32(n * block_size)


def device_plan(plan, xp):
    """``plan`` with its arrays where the kernels read them (guarded sim memory, or the GPU), uploaded once per
    plan however many layers run it."""
    if not is_host_array(plan.seq_lens):
        return plan
    per_xp = _DEVICE_PLANS.setdefault(plan, {})
    key = device_key(xp)
    if key not in per_xp:
        per_xp[key] = plan.to_device(xp)  # numpy: the sim's guarded memory
    return per_xp[key]


def validate_plan(plan, num_tokens: int, num_blocks: int | None = None, block_size: int | None = None) -> None:
    """validate=True: ``plan``'s contents (reads device arrays). query_start_loc starts at 0, never decreases and
    ends at ``num_tokens``, every q_len <= seq_len, and the max_query_len / max_seq_len hints hold them; for a
    paged layer (``num_blocks`` given) also the block tables and slot_mapping against the cache's ``num_blocks``
    blocks of ``block_size``."""
    if num_blocks is not None:
        validate_tables(plan.block_tables, plan.seq_lens, plan.query_start_loc, num_blocks, block_size, num_tokens,
                        max_query_len=plan.max_query_len, max_seq_len=plan.max_seq_len)
        check_slots_in_pool(plan.slot_mapping, num_blocks * block_size, f"the cache's {num_blocks} blocks x "
                                                                         f"{block_size} slots")
        return
    q_lens = validate_offsets("query_start_loc", plan.query_start_loc, num_tokens)
    lens = host_copy(plan.seq_lens)
    over = np.flatnonzero(q_lens > lens)
    if over.size:
        s = over[0]
        raise ValueError(f"every sequence needs q_len <= seq_len (query_start_loc against seq_lens): sequence {s} "
                         f"has {q_lens[s]} queries and seq_lens[{s}] = {lens[s]}")
    if q_lens.size:
        check_hint("max_query_len", plan.max_query_len, int(q_lens.max()),
                   f"the longest query, sequence {int(q_lens.argmax())}'s")


def whole_sequences(plan, validate: bool) -> None:
    """"full" attention runs once over whole sequences: every sequence's new tokens are all its tokens (checked on
    a host plan, and on a device plan under validate)."""
    if not (validate or is_host_array(plan.seq_lens)):
        return
    if not np.array_equal(np.diff(host_copy(plan.query_start_loc)), host_copy(plan.seq_lens)):
        raise ValueError("attn_type='full' attends over whole sequences in one pass: every sequence of plan must "
                         "have q_len == seq_len (no cached prefix, no decode)")


def check_plan_mask(plan, options, attn_type: str, validate: bool) -> None:
    """A plan's tree mask (``BatchPlan.custom_mask``), before anything is written. "cross" attention reads a
    context, not the sequence's keys: the mask does not concern it. "full" attention and a sliding window or ALiBi
    do not take one: a window and ALiBi measure distances by key index, and a tree node's index is not its token
    position. Shapes always; contents under validate or when on the host (an unpack per layer: pack once with
    ``cupaged.pack_custom_mask``)."""
    if plan.custom_mask is None and plan.mask_indptr is None or attn_type == "cross":
        return
    if attn_type == "full":
        raise NotImplementedError("custom_mask with attn_type='full': a tree mask is for causal 'self' attention")
    if options.sliding_window is not None or options.alibi_slopes is not None:
        raise NotImplementedError("custom_mask with a sliding window or ALiBi: both measure distances by key index, "
                                  "and a tree node's index is not its token position")
    check_custom_mask(plan.custom_mask, plan.mask_indptr, plan.num_seqs)
    if content_checked(validate, plan.custom_mask, plan.mask_indptr, plan.query_start_loc, plan.seq_lens):
        validate_custom_mask(plan.custom_mask, plan.mask_indptr, plan.query_start_loc, plan.seq_lens)


class ContextCache:
    """Cross attention's keys and values, dense and per request: ``[context_len, num_kv_heads, head_dim]`` per
    (sequence id, layer), computed once by the layer on the step that brings the sequence's context. ``free``
    drops a finished request's entries."""

    def __init__(self):
        self._kv: dict = {}

    def __contains__(self, key) -> bool:
        """``(seq_id, layer) in cache``."""
        return key in self._kv

    def put(self, seq_id, layer: int, k, v) -> None:
        self._kv[(seq_id, layer)] = (k, v)

    def get(self, seq_id, layer: int):
        return self._kv[(seq_id, layer)]

    def context_len(self, seq_id) -> int:
        lens = [k.shape[0] for (s, _), (k, _v) in self._kv.items() if s == seq_id]
        if not lens:
            raise KeyError(f"no context kept for sequence {seq_id!r}")
        return lens[0]

    def free(self, seq_id) -> None:
        for key in [key for key in self._kv if key[0] == seq_id]:
            del self._kv[key]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._kv.values())
