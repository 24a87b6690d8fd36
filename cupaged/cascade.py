"""Shared-prefix (cascade) attention: requests whose contexts begin with the same blocks (a system prompt, few-shot
examples, parallel samples of one prompt) read those blocks once for the whole group, FlashInfer's cascade.

A batch's context is given in levels. Each shared level groups consecutive requests and gives each group one block
table and length: every request of the group sees those keys first. The last level is each request's own blocks
(``block_tables`` / ``seq_lens``, as :func:`cupaged.paged_attention` takes them), which hold its new tokens. A
request's context is its groups' shared keys, level by level, then its own: request s has
sum(kv_lens of its groups) + seq_lens[s] keys, and its queries sit at the end of them.

Per shared level, the queries of each group attend, as one query run, to the group's keys: every key there comes
before every query, so the run is non-causal and its K/V are read once for all its requests (by the prefill kernel
past PD_MAX_Q = 16 queries, a decode kernel below). The own level runs causal paged attention with the sinks; the states are
then merged by their LSE (:func:`cupaged.merge_attn_states`), so the result equals plain paged attention over each
request's whole context. Sliding windows and ALiBi, whose masks depend on each query's distance into the shared
keys, are not taken yet (``NotImplementedError``).
"""

from __future__ import annotations

import typing

import numpy as np

from cupaged._attention_args import (check_head_vector, check_heads, check_out, check_q, check_tables, softmax_scales,
                                     validate_tables)
from cupaged._backend import array_module, host_copy
from cupaged._cache_args import check_index, check_scale_values, kv_scale_args
from cupaged._checks import check_bool, check_choice, validate_enabled
from cupaged._interop import accepts_foreign_arrays
from cupaged.attention import KvView
from cupaged.merge_attn_states import merge_attn_states
from cupaged.paged_attention import paged_attention

__all__ = ["CascadeLevel", "cascade_attention"]


class CascadeLevel(typing.NamedTuple):
    """One shared level: requests ``group_start_loc[g] .. group_start_loc[g + 1] - 1`` form group g (int32
    ``[num_groups + 1]``, from 0 to num_seqs, non-decreasing), whose shared keys are the first ``kv_lens[g]`` (int32
    ``[num_groups]``) tokens of ``block_tables[g]`` (int32 ``[num_groups, max_blocks]``)."""

    group_start_loc: typing.Any
    block_tables: typing.Any
    kv_lens: typing.Any


def _levels(shared_levels, num_seqs: int) -> list[CascadeLevel]:
    if isinstance(shared_levels, CascadeLevel) or not isinstance(shared_levels, (list, tuple)):
        raise TypeError(f"shared_levels must be a list of CascadeLevel (group_start_loc, block_tables, kv_lens), got "
                        f"{type(shared_levels).__name__}")
    levels = []
    for i, level in enumerate(shared_levels):
        if not isinstance(level, tuple) or len(level) != 3:
            raise TypeError(f"shared_levels[{i}] must be a CascadeLevel (group_start_loc, block_tables, kv_lens), got "
                            f"{type(level).__name__}")
        level = CascadeLevel(*level)
        name = f"shared_levels[{i}]"
        check_index(f"{name}.group_start_loc", level.group_start_loc, 1, "[num_groups + 1]")
        num_groups = level.group_start_loc.shape[0] - 1
        if num_groups < 1:
            raise ValueError(f"{name}.group_start_loc must have num_groups + 1 >= 2 entries, got "
                             f"{level.group_start_loc.shape[0]}")
        check_index(f"{name}.block_tables", level.block_tables, 2, "[num_groups, max_blocks]")
        check_index(f"{name}.kv_lens", level.kv_lens, 1, "[num_groups]")
        for what, a in (("block_tables", level.block_tables), ("kv_lens", level.kv_lens)):
            if a.shape[0] != num_groups:
                raise ValueError(f"{name}.{what} must have num_groups={num_groups} rows (group_start_loc's length "
                                 f"- 1), got {a.shape[0]}")
        if num_groups > num_seqs and num_seqs > 0:
            raise ValueError(f"{name}.group_start_loc has {num_groups} groups for {num_seqs} requests")
        levels.append(level)
    return levels


def _validate_level(i: int, level: CascadeLevel, num_seqs: int, num_blocks: int, block_size: int, num_tokens: int):
    """validate=True: the level's groups cover the requests in order, its lengths and block ids fit the cache."""
    name = f"shared_levels[{i}]"
    starts = host_copy(level.group_start_loc).astype(np.int64)
    if starts[0] != 0 or starts[-1] != num_seqs or np.any(np.diff(starts) < 0):
        raise ValueError(f"{name}.group_start_loc must start at 0, be non-decreasing and end at num_seqs={num_seqs}, "
                         f"got {starts.tolist() if starts.size <= 8 else starts}")
    try:
        validate_tables(level.block_tables, level.kv_lens, None, num_blocks, block_size, num_tokens)
    except ValueError as e:  # its messages name seq_lens / block_tables: say which level's
        message = str(e).replace("seq_lens", f"{name}.kv_lens").replace("block_tables", f"{name}.block_tables")
        raise ValueError(message) from None


@accepts_foreign_arrays
def cascade_attention(q, key_cache, value_cache, shared_levels, block_tables, seq_lens, query_start_loc=None, *,
                      scale=None, causal=True, sinks=None, softcap=None, kv_cache_dtype="auto", k_scale=1.0,
                      v_scale=1.0, layout="NHD", out=None, return_lse=False, validate=None):
    """Attention of ``q`` ``[num_tokens, num_heads, head_size]`` over shared levels then each request's own blocks
    (see the module): equal to :func:`cupaged.paged_attention` over each request's whole context. ``shared_levels``:
    a list of :class:`CascadeLevel`, outermost first; ``block_tables`` / ``seq_lens`` / ``query_start_loc``: the
    requests' own blocks, own lengths and queries (None: decode, one query each), the queries within the own
    tokens. ``causal`` masks within the own level (the shared keys precede every query). Returns ``out`` (and the
    LSE float32 ``[num_heads, num_tokens]`` with ``return_lse``). ``validate=True`` also checks the levels'
    contents: groups covering the requests in order, lengths and block ids inside the cache."""
    xp = array_module(q=q, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                      seq_lens=seq_lens, query_start_loc=query_start_loc, out=out)
    num_tokens, num_heads, head_size = check_q(q)
    check_choice("layout", layout, ("NHD", "HND"))
    kv = KvView.paged(key_cache, value_cache, q, kv_cache_dtype, layout)
    check_heads(num_heads, kv.num_kv_heads)
    num_seqs = check_tables(block_tables, seq_lens, query_start_loc, num_tokens)
    levels = _levels(shared_levels, num_seqs)
    for i, level in enumerate(levels):
        array_module(q=q, **{f"shared_levels[{i}].{k}": getattr(level, k) for k in CascadeLevel._fields})
    causal, return_lse = check_bool("causal", causal, strict=True), check_bool("return_lse", return_lse)
    softmax_scales(scale, softcap, head_size)
    check_head_vector("sinks", sinks, num_heads, xp)
    kv_scale_args(xp, kv_cache_dtype, k_scale, v_scale, kv.num_kv_heads)
    out = check_out(out, q, "out")
    if validate_enabled(validate):
        validate_tables(block_tables, seq_lens, query_start_loc, key_cache.shape[0], kv.block_size, num_tokens)
        for i, level in enumerate(levels):
            _validate_level(i, level, num_seqs, key_cache.shape[0], kv.block_size, num_tokens)
        check_scale_values(kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
    common = dict(scale=scale, softcap=softcap, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
                  layout=layout, return_lse=True, validate=False)
    qsl = xp.arange(num_seqs + 1, dtype=np.int32) if query_start_loc is None else query_start_loc
    # each group's queries as one run over the group's keys: tokens query_start_loc[group_start_loc[g]] ..
    states = [paged_attention(q, key_cache, value_cache, level.block_tables, level.kv_lens,
                              xp.ascontiguousarray(qsl[level.group_start_loc]), causal=False, **common)
              for level in levels]
    out, lse = paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal=causal,
                               sinks=sinks, out=out, **common)
    for o, level_lse in states:  # merged into out and lse in place
        merge_attn_states(out, o, level_lse, out, lse, lse)
    return (out, lse) if return_lse else out
