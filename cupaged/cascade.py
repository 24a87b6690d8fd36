"""Shared-prefix (cascade) attention: requests whose contexts begin with the same blocks (a system prompt, few-shot
examples, parallel samples of one prompt) read those blocks once for the whole group, FlashInfer's cascade.

A batch's context is given in levels. Each shared level groups consecutive requests and gives each group one block
table and length: every request of the group sees those keys first. The last level is each request's own blocks
(``block_tables`` / ``seq_lens``, as :func:`cupaged.paged_attention` takes them), which hold its new tokens. A
request's context is its groups' shared keys, level by level, then its own: request s has
sum(kv_lens of its groups) + seq_lens[s] keys, and its queries sit at the end of them.

Per shared level, the queries of each group attend, as one query run, to the group's keys: every key there comes
before every query, so the run is non-causal and its K/V are read once for all its requests (by the prefill kernel
past PD_MAX_Q = 16 queries, a decode kernel below), its keys split so each SM gets about one CTA, every split writing
float32 partials only. Two schedules finish it (cupaged/attention.py's run_attention, kernels_cu/attention/):
- a decode step with one shared level whose own level does not split: two launches. The shared level's kernel, then
  the own level's decode kernel, which folds the shared partials into each row as it finishes (``prior_partials``;
  pd_prior weights them once a row), adding the sink once;
- otherwise (mixed steps, more levels, an own level that splits): the own level first, causal, its output in
  ``out`` and its LSE kept; then per shared level its kernel and its split merge, which folds in the state so far
  as one more split (``prior_lse``), adding the sink at the last level.
The result equals plain paged attention over each request's whole context. Sliding windows and ALiBi, whose masks
depend on each query's distance into the shared keys, are not taken (the layer never cascades with them).
"""

from __future__ import annotations

import math
import typing

import numpy as np

from cupaged._attention_args import (check_head_vector, check_heads, check_out, check_q, check_tables, softmax_scales,
                                     validate_tables)
from cupaged._backend import array_module, empty, host_copy, is_host_array, sm_count
from cupaged._cache_args import check_index, check_scale_values, kv_scale_args
from cupaged._checks import check_bool, check_choice, validate_enabled
from cupaged._interop import accepts_foreign_arrays
from cupaged._attention_kernels import kernel_constants
from cupaged._plan import MIN_SPLIT
from cupaged.attention import KvView, plan_checked, run_attention
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
    softmax = dict(scale=scale, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    qsl = xp.arange(num_seqs + 1, dtype=np.int32) if query_start_loc is None else query_start_loc
    own = plan_checked(q, kv, block_tables, seq_lens, query_start_loc)
    if len(levels) == 1 and query_start_loc is None and own.merge is None and len(own.launches) == 1:
        # decode: the shared level's partials, then the own level's kernel folds them into each row as it finishes
        level = levels[0]
        runs = xp.ascontiguousarray(qsl[level.group_start_loc])
        plan = _level_plan(q, kv, level, runs, xp)
        partials = tuple(empty(xp, s, np.float32) for s in plan.partial_shapes)
        run_attention(plan, q, kv, out, None, level.block_tables, level.kv_lens, runs, causal=False, merge=False,
                      partials=partials, **softmax)
        lse = empty(xp, (num_heads, num_tokens), np.float32) if return_lse else None
        run_attention(own, q, kv, out, lse, block_tables, seq_lens, None, causal=causal, sinks=sinks,
                      prior_partials=partials, **softmax)
        return (out, lse) if return_lse else out
    out, lse = paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, causal=causal,
                               sinks=None if levels else sinks, out=out, scale=scale, softcap=softcap,
                               kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, layout=layout,
                               return_lse=True, validate=False)
    spare = empty(xp, lse.shape, np.float32) if levels else None
    for i, level in enumerate(levels):  # each merge reads the state so far from out and lse, writes the next
        # each group's queries as one run over the group's keys: tokens query_start_loc[group_start_loc[g]] ..
        runs = xp.ascontiguousarray(qsl[level.group_start_loc])
        plan = _level_plan(q, kv, level, runs, xp)
        prior, lse = lse, spare
        run_attention(plan, q, kv, out, lse, level.block_tables, level.kv_lens, runs, causal=False,
                      sinks=sinks if i == len(levels) - 1 else None, prior_lse=prior, **softmax)
        spare = prior
    return (out, lse) if return_lse else out


def _level_plan(q, kv, level: CascadeLevel, runs, xp):
    """A shared level's plan: its keys split so that the grid gives each SM about one CTA (at most PA_PRIOR_SPLITS,
    what a decode kernel folds in). Every split writes one more float32 partial row per (token, head) and the level's
    query runs are long (a group's every query), so the partials weigh as much as the keys: the fewest splits that
    occupy every SM (64 requests x 4096 shared keys, 32 / 8 heads, d128: 8 splits of 512, H200 model: the shared
    kernel 12.9 us, and the merge 4.3; 30 splits, split_for's wave-filling rule: 15.5 and 6.3)."""
    hints = dict(min_query_len=_shortest_run(runs), prior_state=True)
    whole = plan_checked(q, kv, level.block_tables, level.kv_lens, runs, kv_split_size=0, **hints)
    ctas = math.prod(whole.launches[0].grid)
    max_kv = level.block_tables.shape[1] * kv.block_size
    splits = min(max(1, sm_count(xp) // max(ctas, 1)), kernel_constants()["PA_PRIOR_SPLITS"])
    size = max(MIN_SPLIT, -(-max_kv // splits))
    return plan_checked(q, kv, level.block_tables, level.kv_lens, runs, kv_split_size=0 if size >= max_kv else size,
                        **hints)


def _shortest_run(runs):
    """The fewest queries of a group (a planning hint; None when the runs are on the device: never read back)."""
    if not is_host_array(runs) or runs.shape[0] < 2:
        return None
    return int(np.diff(runs.astype(np.int64)).min())
