"""BlockPool: allocation, copy-on-write, prefix caching, batch plans, errors and atomicity.

The stateful test at the bottom drives random append / plan / plan_decode / fork / free steps
against a model that stores each sequence's tokens: it writes every returned slot into a fake
cache (one token value per slot), runs the pending copies before each step's writes as an engine
would, and checks that every live sequence reads its own tokens back through its block table.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cupaged import BlockPool, OutOfBlocks


def expected_slots(pool, seq_id, positions):
    table = pool.block_table(seq_id)
    return [table[p // pool.block_size] * pool.block_size + p % pool.block_size for p in positions]


def snapshot(pool):
    """Everything observable plus the allocator's internal order (free stack, LRU, pins)."""
    a = pool._alloc
    seqs = sorted((repr(k), pool.block_table(k), pool.seq_len(k), pool.num_cached_tokens(k)) for k in pool._seqs.rows)
    return (seqs, pool.num_free_blocks, a.ref.tolist(), list(a._stack), list(a._lru), sorted(a._pinned),
            dict(a._copies), dict(a._cache), pool.usage())


# -- allocation and copy-on-write -------------------------------------------------------------

def test_append_allocates_blocks_as_the_sequence_grows():
    pool = BlockPool(8, 4)
    assert pool.append("a", 6).tolist() == [0, 1, 2, 3, 4, 5]
    assert pool.block_table("a") == [0, 1] and pool.seq_len("a") == 6 and pool.num_free_blocks == 6
    assert pool.append("a", 3).tolist() == [6, 7, 8]  # fills block 1, then one more block
    assert pool.block_table("a") == [0, 1, 2]
    assert pool.append("b", 0).tolist() == [] and pool.block_table("b") == [] and "b" in pool
    assert pool.append("b", token_ids=[7, 7, 7]).tolist() == [12, 13, 14]
    pool.check()


def test_fork_shares_blocks_and_first_appender_copies_the_partial_block():
    pool = BlockPool(8, 4)
    pool.append("parent", 6)  # blocks 0 (full) and 1 (2 of 4 slots)
    pool.fork("parent", "child")
    assert pool.block_table("child") == [0, 1]
    assert pool.num_free_blocks == 6  # nothing allocated by the fork
    assert pool.append("child", 1).tolist() == [2 * 4 + 2]  # a private copy of block 1: block 2
    assert pool.take_pending_copies().tolist() == [[1, 2]]
    assert pool.append("parent", 3).tolist() == [6, 7, 12]  # block 1 is the parent's alone now
    assert pool.take_pending_copies().shape == (0, 2)
    assert pool.block_table("parent") == [0, 1, 3] and pool.block_table("child") == [0, 2]
    pool.check()


def test_full_shared_last_block_needs_no_copy():
    pool = BlockPool(8, 4)
    pool.append("a", 8)
    pool.fork("a", "b")
    pool.append("b", 1)
    assert pool.take_pending_copies().shape == (0, 2)
    assert pool.block_table("b")[:2] == pool.block_table("a")


def test_source_of_a_pending_copy_is_not_reused_before_the_copy_is_taken():
    pool = BlockPool(4, 4)
    pool.append("a", 2)  # block 0, partial
    pool.fork("a", "b")
    pool.append("a", 1)  # a copies block 0 into block 1
    pool.free("b")  # block 0 has no owner, but the copy 0 -> 1 has not run yet
    assert pool.num_free_blocks == 2
    pool.append("c", 8)  # takes blocks 2 and 3, never block 0
    assert 0 not in pool.block_table("c")
    with pytest.raises(OutOfBlocks):
        pool.append("d", 1)
    pool.check()
    assert pool.take_pending_copies().tolist() == [[0, 1]]
    assert pool.num_free_blocks == 1 and pool.append("d", 1).tolist() == [0]
    pool.check()


def test_copy_into_a_freed_block_is_dropped():
    pool = BlockPool(8, 4)
    pool.append("a", 2)
    pool.fork("a", "b")
    pool.append("a", 1)  # 0 -> 1
    pool.free("a")
    assert pool.take_pending_copies().shape == (0, 2)  # block 1 is gone: the copy is moot
    pool.check()


def test_pending_copies_never_read_a_block_another_pair_writes():
    """copy_blocks runs its pairs in parallel: a copy out of a block that is itself still being
    copied into reads that copy's source instead."""
    pool = BlockPool(8, 4)
    pool.append("a", 2)  # block 0
    pool.fork("a", "b")
    pool.append("b", 1)  # 0 -> 1 (b's copy)
    pool.fork("b", "c")  # c shares block 1 before the copy has run
    pool.append("c", 1)  # 1 is shared: c gets 2, copied from 0, not from 1
    assert pool.take_pending_copies().tolist() == [[0, 1], [0, 2]]
    pool.check()


def test_usage_reports_the_unfilled_fraction_of_allocated_slots():
    pool = BlockPool(16, 4)
    pool.append("a", 6)  # 2 blocks, 8 slots, 6 tokens
    pool.fork("a", "b")  # shared blocks count once
    u = pool.usage()
    assert (u.num_seqs, u.blocks_in_use, u.tokens_stored, u.waste) == (2, 2, 6, 0.25)
    pool.append("b", 1)  # b's private copy of block 1 holds 3 tokens
    u = pool.usage()
    assert (u.blocks_in_use, u.tokens_stored, u.waste) == (3, 9, 0.25)
    assert BlockPool(4, 4).usage().waste == 0.0


def test_check_describes_a_broken_invariant():
    pool = BlockPool(8, 4)
    pool.append("a", 5)
    pool._alloc.ref[1] += 1
    with pytest.raises(AssertionError, match="block 1 has reference count 2 but 1 owners"):
        pool.check()
    pool._alloc.ref[1] -= 1
    pool._alloc._stack.remove(7)
    with pytest.raises(AssertionError, match="leaked"):
        pool.check()


# -- prefix caching ---------------------------------------------------------------------------

def test_prefix_hit_reuses_full_blocks_and_leaves_the_last_token_to_compute():
    pool = BlockPool(16, 4, enable_prefix_caching=True)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    pool.append("a", token_ids=prompt)
    slots = pool.append("b", token_ids=prompt)
    assert pool.num_cached_tokens("b") == 8 and pool.num_cached_tokens("a") == 0
    assert slots[:8].tolist() == [-1] * 8 and (slots[8:] >= 0).all()
    assert pool.block_table("b")[:2] == pool.block_table("a")[:2]
    assert pool.block_table("b")[2] != pool.block_table("a")[2]  # the partial block is never shared
    pool.append("c", token_ids=prompt[:8])  # exactly 2 blocks: the last one is recomputed
    assert pool.num_cached_tokens("c") == 4
    pool.append("d", token_ids=[1] + prompt[1:])  # the chain differs from the first block on
    assert pool.num_cached_tokens("d") == 0
    pool.check()


def test_cached_blocks_survive_free_and_are_evicted_least_recently_used_tail_first():
    pool = BlockPool(6, 2, enable_prefix_caching=True)
    pool.append("a", token_ids=[1, 2, 3, 4, 5])  # blocks 0, 1 full and cached, 2 partial
    pool.append("b", token_ids=[6, 7, 8, 9])  # blocks 3, 4 cached
    pool.free("a")  # a's tail first: 1 is evicted before 0
    pool.free("b")
    assert pool._alloc.cached_blocks() == [1, 0, 4, 3]
    assert pool.usage().blocks_cached == 4 and pool.num_free_blocks == 6
    pool.append("a2", token_ids=[1, 2, 3, 4, 5])  # revives 0 and 1
    assert pool.block_table("a2")[:2] == [0, 1] and pool.num_cached_tokens("a2") == 4
    pool.free("a2")  # 1 and 0 are now the most recently used
    assert pool._alloc.cached_blocks() == [4, 3, 1, 0]
    pool.append("x", 6)  # 2 never-cached free blocks first, then evicts 4
    assert sorted(pool.block_table("x")) == [2, 4, 5]
    pool.append("b2", token_ids=[6, 7, 8, 9, 0])  # block 4 was the second block: only 3 hits
    assert pool.num_cached_tokens("b2") == 2 and pool.block_table("b2")[0] == 3
    pool.check()


def test_blocks_filled_without_token_ids_are_never_cached():
    pool = BlockPool(8, 2, enable_prefix_caching=True)
    pool.append("a", token_ids=[1, 2])
    pool.append("a", 2)  # the chain breaks here, for good
    pool.append("a", token_ids=[5, 6])
    pool.free("a")
    assert pool.usage().blocks_cached == 1
    pool.append("b", token_ids=[1, 2, 0, 0, 5, 6, 7])
    assert pool.num_cached_tokens("b") == 2


def test_decode_tokens_feed_the_prefix_cache_and_forks_inherit_the_chain():
    pool = BlockPool(16, 2, enable_prefix_caching=True)
    pool.append("a", token_ids=[1, 2, 3])
    pool.fork("a", "b")
    for t in (4, 5, 6):
        pool.plan_decode(np.array(["a", "b"]), np.array([t, t + 10]))
    pool.append("c", token_ids=[1, 2, 3, 4, 5, 6, 0])
    assert pool.num_cached_tokens("c") == 6 and pool.block_table("c")[:3] == pool.block_table("a")
    pool.append("d", token_ids=[1, 2, 3, 14, 15, 16, 0])
    assert pool.num_cached_tokens("d") == 6 and pool.block_table("d")[:3] == pool.block_table("b")
    pool.check()


def test_a_failed_batch_does_not_revive_cached_blocks():
    pool = BlockPool(4, 2, enable_prefix_caching=True)
    pool.append("a", token_ids=[1, 2, 3, 4, 5])
    pool.free("a")
    before = snapshot(pool)
    with pytest.raises(OutOfBlocks):
        pool.plan([("b", [1, 2, 3, 4, 5]), ("c", 7)])
    assert snapshot(pool) == before


def test_truncate_gives_back_the_dropped_tokens_blocks():
    pool = BlockPool(8, 4)
    pool.append("a", 6)
    pool.append("a", 5)  # 11 tokens in blocks 0, 1, 2
    pool.truncate("a", 5)
    assert pool.seq_len("a") == 5 and pool.block_table("a") == [0, 1] and pool.num_free_blocks == 6
    assert pool.append("a", 4).tolist() == [5, 6, 7, 8]  # the slots after the kept tokens, block 2 again
    pool.truncate("a", 9)  # nothing dropped
    pool.truncate("a", 0)
    assert pool.seq_len("a") == 0 and pool.block_table("a") == [] and pool.num_free_blocks == 8
    pool.check()


def test_truncate_drops_what_the_dropped_tokens_filled_from_the_prefix_cache():
    """Rejected draft tokens were never the sequence's: a block they filled is not a prefix hit later, and a block
    cut back to partly filled leaves the cache (a later append rewrites its tail)."""
    pool = BlockPool(8, 4, enable_prefix_caching=True)
    pool.append("a", token_ids=[1, 2, 3, 4, 5, 6])
    pool.append("a", token_ids=[7, 8, 9, 10])  # fills blocks 1 and 2's first two slots
    pool.truncate("a", 6)  # within block 1: it was full and cached
    assert not pool._alloc.is_hashed(pool.block_table("a")[1]) and pool._seqs.tracked[pool._seqs.row("a")] == 0
    pool.append("b", token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert pool.num_cached_tokens("b") == 4  # block 0 only
    pool.check()
    pool.append("c", token_ids=[1, 2, 3, 4, 5])
    pool.append("c", token_ids=[6, 7])
    pool.truncate("c", 6)  # inside the partly filled block: the chain goes on
    pool.append("c", token_ids=[7, 8, 9])
    pool.free("c")
    pool.append("d", token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert pool.num_cached_tokens("d") == 8
    pool.check()


def test_truncate_refuses_to_cut_a_shared_block_or_grow():
    pool = BlockPool(8, 4)
    pool.append("a", 6)
    pool.fork("a", "b")
    before = snapshot(pool)
    with pytest.raises(ValueError, match="inside block 1, which another sequence shares"):
        pool.truncate("a", 5)
    with pytest.raises(ValueError, match="num_tokens must be <= 6"):
        pool.truncate("a", 7)
    with pytest.raises(KeyError, match="is not a sequence"):
        pool.truncate("x", 0)
    assert snapshot(pool) == before
    pool.truncate("a", 4)  # at a block boundary: the shared block is released by a only
    assert pool.block_table("a") == [0] and pool.block_table("b") == [0, 1]
    pool.check()


# -- plans --------------------------------------------------------------------------------------

def test_plan_arrays():
    pool = BlockPool(32, 4)
    pool.append("a", 5)
    plan = pool.plan([("a", 2), ("b", 9), ("c", 0)])
    assert plan.query_start_loc.dtype == np.int32 and plan.query_start_loc.tolist() == [0, 2, 11, 11]
    assert plan.seq_lens.dtype == np.int32 and plan.seq_lens.tolist() == [7, 9, 0]
    assert plan.positions.dtype == np.int64 and plan.positions.tolist() == [5, 6] + list(range(9))
    assert plan.slot_mapping.dtype == np.int64
    assert plan.slot_mapping.tolist() == expected_slots(pool, "a", [5, 6]) + expected_slots(pool, "b", range(9))
    assert plan.block_tables.dtype == np.int32 and plan.block_tables.shape == (3, 3)
    assert plan.block_tables.tolist() == [pool.block_table("a") + [0], pool.block_table("b"), [0, 0, 0]]
    assert (plan.max_seq_len, plan.max_query_len, plan.num_seqs, plan.num_tokens) == (9, 9, 3, 11)
    empty = pool.plan([])
    assert empty.query_start_loc.tolist() == [0] and empty.block_tables.shape == (0, 0)


def test_plan_with_max_blocks_per_seq_has_fixed_width_and_rejects_longer_sequences():
    pool = BlockPool(32, 4, max_blocks_per_seq=5)
    assert pool.plan([("a", 3)]).block_tables.shape == (1, 5)
    assert pool.plan_decode(["a"]).block_tables.shape == (1, 5)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="max_blocks_per_seq=5"):
        pool.plan([("b", 4), ("a", 17)])
    assert snapshot(pool) == before
    pool.append("a", 16)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="max_blocks_per_seq=5"):
        pool.plan_decode(["a"])
    assert snapshot(pool) == before


def test_plan_arrays_belong_to_the_caller():
    pool = BlockPool(64, 4)
    ids = np.array([0, 1, 2])
    first = pool.plan([(i, 3) for i in ids.tolist()])
    kept = [a.copy() for a in (first.block_tables, first.slot_mapping, first.seq_lens, first.positions)]
    decode = [pool.plan_decode(ids) for _ in range(6)]
    saved = [p.block_tables.copy() for p in decode]
    for p in decode:
        p.block_tables[:] = -7  # scribbling on a returned plan must not reach the pool
        p.seq_lens[:] = -7
    later = pool.plan_decode(ids)
    assert (later.block_tables >= 0).all() and later.seq_lens.tolist() == [10, 10, 10]
    assert all(np.array_equal(a, b) for a, b in zip(kept, (first.block_tables, first.slot_mapping, first.seq_lens,
                                                           first.positions)))
    assert not np.array_equal(saved[0], later.block_tables)  # the tables grew since the first step


def test_plan_decode_matches_the_general_plan():
    rng = np.random.default_rng(5)
    fast, slow = BlockPool(400, 4), BlockPool(400, 4)
    lens = rng.integers(0, 30, 13)
    for pool in (fast, slow):
        for i, n in enumerate(lens.tolist()):
            pool.append(i, n)
    ids = rng.permutation(13)
    for step in range(11):
        if step == 6:
            ids = ids[3:]  # a new batch: the mirror is rebuilt
        a, b = fast.plan_decode(ids), slow.plan([(i, 1) for i in ids.tolist()])
        for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "positions"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
        assert (a.max_seq_len, a.max_query_len) == (b.max_seq_len, b.max_query_len)
    fast.check()


def test_to_device_on_the_sim_returns_guarded_copies():
    from cupaged import sim
    from cupaged.sim._memory import guarded_buffer

    pool = BlockPool(16, 4)
    plan = pool.plan([("a", 5), ("b", 2)])
    dev = plan.to_device(sim)
    for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "positions"):
        got, want = getattr(dev, field), getattr(plan, field)
        assert guarded_buffer(got) is not None and got.dtype == want.dtype and np.array_equal(got, want)
    assert (dev.max_seq_len, dev.max_query_len) == (plan.max_seq_len, plan.max_query_len)
    assert dev.custom_mask is None and dev.mask_indptr is None


def test_to_device_moves_a_tree_mask_too():
    import dataclasses

    from cupaged import pack_custom_mask, sim
    from cupaged.sim._memory import guarded_buffer

    pool = BlockPool(16, 4)
    plan = pool.plan([("a", 5), ("b", 2)])
    mask = np.concatenate([np.tril(np.ones((5, 5), bool)).ravel(), [True, False, False, True]])  # b: two roots
    packed, indptr = pack_custom_mask(mask, query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens)
    dev = dataclasses.replace(plan, custom_mask=packed, mask_indptr=indptr).to_device(sim)
    for got, want in ((dev.custom_mask, packed), (dev.mask_indptr, indptr)):
        assert guarded_buffer(got) is not None and got.dtype == want.dtype and np.array_equal(got, want)


# -- errors and atomicity ---------------------------------------------------------------------

def test_out_of_blocks_changes_nothing():
    pool = BlockPool(6, 4)
    pool.append("a", 6)
    pool.fork("a", "b")
    before = snapshot(pool)
    with pytest.raises(OutOfBlocks) as err:
        pool.append("c", 17)
    assert isinstance(err.value, RuntimeError) and (err.value.needed, err.value.available) == (5, 4)
    with pytest.raises(OutOfBlocks):  # the first items fit, the batch does not
        pool.plan([("a", 1), ("b", 1), ("d", 8), ("c", 5)])
    assert snapshot(pool) == before and "c" not in pool and "d" not in pool
    pool.plan([("a", 1), ("b", 1), ("d", 8), ("c", 4)])  # a copies, b writes in place: exactly 4
    assert pool.num_free_blocks == 0
    pool.check()


def test_decode_out_of_blocks_changes_nothing():
    pool = BlockPool(4, 2)
    pool.append(0, 2)
    pool.append(1, 1)
    pool.fork(1, 2)
    pool.plan_decode([0, 1, 2])  # 0 needs a block, 1 copies its shared block, 2 writes in place
    assert pool.num_free_blocks == 0 and pool.take_pending_copies().tolist() == [[1, 3]]
    before = snapshot(pool)
    with pytest.raises(OutOfBlocks):
        pool.plan_decode([0, 1, 2])
    assert snapshot(pool) == before


BAD_CALLS = [
    (lambda p: p.append("nope", -1), ValueError, "num_tokens must be >= 0"),
    (lambda p: p.append("a", 1.5), TypeError, "num_tokens must be an int"),
    (lambda p: p.append("a"), TypeError, "num_tokens or token_ids"),
    (lambda p: p.append("a", 2, token_ids=[1, 2, 3]), ValueError, "disagrees"),
    (lambda p: p.append("a", token_ids=[[1, 2]]), ValueError, "1-D"),
    (lambda p: p.append("a", token_ids=[1.0]), TypeError, "integers"),
    (lambda p: p.free("nope"), KeyError, "'nope' is not a sequence"),
    (lambda p: p.block_table("nope"), KeyError, "is not a sequence"),
    (lambda p: p.seq_len("nope"), KeyError, "is not a sequence"),
    (lambda p: p.num_cached_tokens("nope"), KeyError, "is not a sequence"),
    (lambda p: p.fork("nope", "x"), KeyError, "is not a sequence"),
    (lambda p: p.fork("a", "b"), ValueError, "child_id 'b' is already"),
    (lambda p: p.fork("a", "a"), ValueError, "already"),
    (lambda p: p.plan([("a", 1), ("a", 1)]), ValueError, "twice"),
    (lambda p: p.plan([("a", 1), ("x", -2)]), ValueError, r"batch\[1\] num_tokens must be >= 0"),
    (lambda p: p.plan([("a", 1, 2)]), TypeError, r"batch\[0\] must be a \(seq_id, num_new_tokens\) pair"),
    (lambda p: p.plan_decode(["a", "nope"]), KeyError, "is not a sequence"),
    (lambda p: p.plan_decode(["a", "a"]), ValueError, "more than once"),
    (lambda p: p.plan_decode([["a"]]), ValueError, "1-D"),
    (lambda p: p.plan_decode(["a", "b"], [1]), ValueError, "one id per sequence"),
    # an unhashable id names its argument (before: a bare "unhashable type: 'list'")
    (lambda p: p.append(["x"], 1), TypeError, r"^append seq_id must be hashable, got list \['x'\]"),
    (lambda p: p.plan([("a", 1), (["x"], 1)]), TypeError, r"^batch\[1\] seq_id must be hashable"),
    (lambda p: p.fork("a", ["c"]), TypeError, "^child_id must be hashable"),
    (lambda p: p.fork(["a"], "c"), TypeError, "^parent_id must be hashable"),
    (lambda p: p.free(["a"]), TypeError, "^seq_id must be hashable"),
    (lambda p: p.seq_len({"a"}), TypeError, "^seq_id must be hashable, got set"),
    (lambda p: p.block_table(["a"]), TypeError, "^seq_id must be hashable"),
    (lambda p: p.num_cached_tokens(["a"]), TypeError, "^seq_id must be hashable"),
    (lambda p: ["a"] in p, TypeError, "^seq_id must be hashable"),
    (lambda p: p.plan_decode(np.array([["a"], "b"], dtype=object)), TypeError,
     "^each of seq_ids must be hashable, got list"),
]


@pytest.mark.parametrize("call,exc,message", BAD_CALLS, ids=[m for _, _, m in BAD_CALLS])
def test_bad_input_raises_and_changes_nothing(call, exc, message):
    pool = BlockPool(8, 4)
    pool.append("a", 5)
    pool.fork("a", "b")
    before = snapshot(pool)
    with pytest.raises(exc, match=message):
        call(pool)
    assert snapshot(pool) == before


def test_freeing_twice_raises():
    pool = BlockPool(8, 4)
    pool.append("a", 5)
    pool.free("a")
    with pytest.raises(KeyError, match="'a' is not a sequence"):
        pool.free("a")
    assert pool.num_free_blocks == 8


@pytest.mark.parametrize("args,kwargs,exc", [
    ((0, 4), {}, ValueError), ((4, 0), {}, ValueError), ((4.0, 4), {}, TypeError),
    ((4, 4), {"max_blocks_per_seq": 0}, ValueError),
])
def test_bad_pool_arguments(args, kwargs, exc):
    with pytest.raises(exc):
        BlockPool(*args, **kwargs)


def test_num_blocks_past_int32_block_ids_names_it():
    """Block tables hold int32 block ids (before: BlockPool(2**40, 4) tried to allocate 4 TiB and failed in
    numpy without naming num_blocks)."""
    with pytest.raises(ValueError, match=r"^num_blocks must be <= 2147483647 \(block tables hold int32 block ids\), "
                                         r"got 1099511627776"):
        BlockPool(2**40, 4)


# -- stateful: random steps against a model of every sequence's tokens --------------------------

SEQ_IDS = st.integers(0, 5)
FIELDS = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "positions")


class PoolMachine(RuleBasedStateMachine):
    """The model: ``tokens[seq]`` lists what each position holds; ``memory[slot]`` is the fake
    cache. Steps append tokens (writes queued, as a kernel launch would be), and a step boundary
    (``flush``; also before fork and free) runs the pending copies, then the writes, then checks
    that every sequence reads back its tokens through its block table."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4]),
                prefix_caching=st.booleans(), max_blocks=st.sampled_from([None, 3, 6]))
    def setup(self, num_blocks, block_size, prefix_caching, max_blocks):
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                              max_blocks_per_seq=max_blocks)
        self.bs, self.max_blocks = block_size, max_blocks
        self.memory = np.full(num_blocks * block_size, -1, np.int64)
        self.tokens: dict[int, list[int]] = {}
        self.writes: list[tuple[np.ndarray, np.ndarray]] = []
        self.fresh = 1000  # token values of appends without ids: never equal to an id (0..2)
        self.kept = None  # an earlier plan and a copy of it: later calls must not change it
        self.last_decode = None

    # -- the model's expectations --
    def blocks_needed(self, batch):
        """Fresh blocks a batch needs ignoring prefix hits (an upper bound with prefix caching:
        a hit saves a block, or takes one out of the evictable ones), or None past the cap."""
        owners: dict[int, int] = {}
        for seq in self.tokens:
            for b in self.pool.block_table(seq):
                owners[b] = owners.get(b, 0) + 1
        claims, needed = {}, 0
        for seq, n in batch:
            length = len(self.tokens.get(seq, []))
            table = self.pool.block_table(seq) if seq in self.tokens else []
            blocks = -(-(length + n) // self.bs)
            if self.max_blocks is not None and blocks > self.max_blocks:
                return None
            cow = n > 0 and length % self.bs and owners[table[-1]] - claims.get(table[-1], 0) > 1
            if cow:
                claims[table[-1]] = claims.get(table[-1], 0) + 1
            needed += blocks - len(table) + bool(cow)
        return needed

    def values(self, n, ids):
        if ids is not None:
            return list(ids)
        self.fresh += n
        return list(range(self.fresh - n, self.fresh))

    def attempt(self, batch, call):
        """Run ``call``; on an expected refusal check that nothing changed. Returns its result or None."""
        needed, free, before = self.blocks_needed(batch), self.pool.num_free_blocks, snapshot(self.pool)
        try:
            result = call()
        except (OutOfBlocks, ValueError) as err:
            assert snapshot(self.pool) == before
            if needed is None:
                assert isinstance(err, ValueError) and "max_blocks_per_seq" in str(err)
            else:
                assert isinstance(err, OutOfBlocks) and needed > free
                assert needed - free == err.needed - err.available or self.pool.enable_prefix_caching
            return None
        assert needed is not None
        if not self.pool.enable_prefix_caching:
            assert needed <= free and self.pool.num_free_blocks == free - needed
        return result

    def record(self, seq, first_append, values, slots):
        """Check one sequence's new slots and queue their writes."""
        start = len(self.tokens.get(seq, []))
        cached = self.pool.num_cached_tokens(seq) if first_append else 0
        want = expected_slots(self.pool, seq, range(start, start + len(values)))
        assert list(slots[:cached]) == [-1] * cached and list(slots[cached:]) == want[cached:]
        assert cached == 0 or (self.pool.enable_prefix_caching and cached % self.bs == 0 and cached < len(values))
        self.tokens.setdefault(seq, []).extend(values)
        self.writes.append((np.asarray(slots[cached:], np.int64), np.asarray(values[cached:], np.int64)))

    def check_plan(self, plan, batch):
        seqs = [seq for seq, _ in batch]
        q_lens = [n for _, n in batch]
        assert plan.query_start_loc.tolist() == np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).tolist()
        assert plan.seq_lens.tolist() == [len(self.tokens[s]) for s in seqs]
        tables = [self.pool.block_table(s) for s in seqs]
        width = self.max_blocks if self.max_blocks is not None else max(map(len, tables), default=0)
        assert plan.block_tables.shape == (len(seqs), width)
        assert plan.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
        starts = [len(self.tokens[s]) - n for s, n in batch]
        assert plan.positions.tolist() == [p for s, n in zip(starts, q_lens) for p in range(s, s + n)]
        assert plan.max_seq_len == max(plan.seq_lens.tolist(), default=0)
        assert plan.max_query_len == max(q_lens, default=0)
        self.kept = (plan, [getattr(plan, f).copy() for f in FIELDS])

    # -- rules --
    @rule(seq=SEQ_IDS, n=st.integers(0, 9), with_ids=st.booleans(), data=st.data())
    def append(self, seq, n, with_ids, data):
        ids = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)) if with_ids else None
        first = seq not in self.tokens or not self.tokens[seq]
        slots = self.attempt([(seq, n)], lambda: self.pool.append(seq, n, token_ids=ids))
        if slots is not None:
            assert slots.dtype == np.int64 and slots.shape == (n,)
            self.record(seq, first, self.values(n, ids), slots)

    @rule(data=st.data())
    def plan(self, data):
        entries = data.draw(st.lists(st.tuples(SEQ_IDS, st.integers(0, 6), st.booleans()), max_size=4,
                                     unique_by=lambda e: e[0]))
        ids = {seq: data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)) if w else None
               for seq, n, w in entries}
        batch = [(seq, n) for seq, n, _ in entries]
        firsts = {seq: not self.tokens.get(seq) for seq, _ in batch}
        plan = self.attempt(batch, lambda: self.pool.plan([(s, n if ids[s] is None else ids[s]) for s, n in batch]))
        if plan is not None:
            for (seq, n), lo, hi in zip(batch, plan.query_start_loc[:-1], plan.query_start_loc[1:]):
                self.record(seq, firsts[seq], self.values(n, ids[seq]), plan.slot_mapping[lo:hi])
            self.check_plan(plan, batch)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), steps=st.integers(1, 4), with_ids=st.booleans())
    def decode(self, data, steps, with_ids):
        again = self.last_decode is not None and all(s in self.tokens for s in self.last_decode)
        if again and data.draw(st.booleans()):
            seqs = self.last_decode  # the same batch again: the incremental path
        else:
            seqs = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), unique=True))
        self.last_decode = seqs
        for _ in range(steps):
            ids = data.draw(st.lists(st.integers(0, 2), min_size=len(seqs), max_size=len(seqs))) if with_ids else None
            plan = self.attempt([(s, 1) for s in seqs], lambda: self.pool.plan_decode(np.array(seqs, np.int64), ids))
            if plan is None:
                return
            for i, seq in enumerate(seqs):
                self.record(seq, False, self.values(1, None if ids is None else [ids[i]]), plan.slot_mapping[i:i + 1])
            self.check_plan(plan, [(s, 1) for s in seqs])

    @rule()
    def flush(self):
        pairs = self.pool.take_pending_copies()
        assert pairs.dtype == np.int64 and pairs.ndim == 2 and pairs.shape[1] == 2
        assert not set(pairs[:, 0].tolist()) & set(pairs[:, 1].tolist()), "a copy reads a block another writes"
        assert len(set(pairs[:, 1].tolist())) == len(pairs), "two copies write one block"
        blocks = self.memory.reshape(-1, self.bs)
        blocks[pairs[:, 1]] = blocks[pairs[:, 0]].copy()  # parallel copies: every read before any write
        for slots, values in self.writes:
            self.memory[slots] = values
        self.writes = []
        for seq, tokens in self.tokens.items():
            got = self.memory[expected_slots(self.pool, seq, range(len(tokens)))]
            assert got.tolist() == tokens, f"sequence {seq} reads {got.tolist()}, wrote {tokens}"

    @rule(parent=SEQ_IDS, child=SEQ_IDS)
    def fork(self, parent, child):
        self.flush()
        before = snapshot(self.pool)
        if parent not in self.tokens or child in self.tokens:
            with pytest.raises(KeyError if parent not in self.tokens else ValueError):
                self.pool.fork(parent, child)
            assert snapshot(self.pool) == before
            return
        self.pool.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @rule(seq=SEQ_IDS)
    def free(self, seq):
        self.flush()
        if seq not in self.tokens:
            before = snapshot(self.pool)
            with pytest.raises(KeyError):
                self.pool.free(seq)
            assert snapshot(self.pool) == before
            return
        self.pool.free(seq)
        del self.tokens[seq]

    @rule(seq=SEQ_IDS, data=st.data())
    def truncate(self, seq, data):
        self.flush()
        before = snapshot(self.pool)
        if seq not in self.tokens:
            with pytest.raises(KeyError):
                self.pool.truncate(seq, 0)
            assert snapshot(self.pool) == before
            return
        length = len(self.tokens[seq])
        keep = data.draw(st.integers(0, length + 1))
        owners = [b for s in self.tokens for b in self.pool.block_table(s)]
        table = self.pool.block_table(seq)
        if keep > length or (keep % self.bs and keep < length and owners.count(table[keep // self.bs]) > 1):
            with pytest.raises(ValueError):
                self.pool.truncate(seq, keep)
            assert snapshot(self.pool) == before
            return
        self.pool.truncate(seq, keep)
        del self.tokens[seq][keep:]

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check()
        assert sorted(self.pool._seqs.rows) == sorted(self.tokens)
        for seq, tokens in self.tokens.items():
            assert self.pool.seq_len(seq) == len(tokens)
            assert len(self.pool.block_table(seq)) == -(-len(tokens) // self.bs)
        if self.kept is not None:
            plan, copies = self.kept
            assert all(np.array_equal(getattr(plan, f), c) for f, c in zip(FIELDS, copies))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
def test_pool_machine_long_run():
    run = PoolMachine.TestCase("runTest")
    run.settings = settings(max_examples=2000, stateful_step_count=60, deadline=None,
                            suppress_health_check=list(HealthCheck))
    run.runTest()


# -- cached_prefix_len and seq_ids ----------------------------------------------------------------

def test_cached_prefix_len_predicts_num_cached_tokens_and_changes_nothing():
    """Two pools driven alike, one asked cached_prefix_len before each append: the answer is the append's
    num_cached_tokens, and the pools stay identical (the lookup touches no LRU order, pin or hash)."""
    asked, twin = (BlockPool(16, 4, enable_prefix_caching=True) for _ in range(2))
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    for pool in (asked, twin):
        pool.append("a", token_ids=prompt)
    steps = [("b", prompt, 8), ("c", prompt[:8], 4),  # exactly 2 blocks: the last token is computed
             ("d", prompt + [1, 2, 3], 8), ("e", [1] + prompt[1:], 0), ("f", prompt[:3], 0), ("g", [], 0),
             ("free", "a", None), ("h", prompt, 8),  # cached blocks outlive their sequence
             ("free", "h", None), ("free", "b", None), ("free", "c", None), ("free", "d", None),
             ("i", prompt[:4] + [7] * 6, 4)]
    for seq_id, token_ids, want in steps:
        if seq_id == "free":
            for pool in (asked, twin):
                pool.free(token_ids)
            continue
        before = snapshot(asked)
        assert asked.cached_prefix_len(token_ids) == want
        assert asked.cached_prefix_len(np.array(token_ids, np.int32)) == want
        assert snapshot(asked) == before
        asked.check()
        for pool in (asked, twin):
            pool.append(seq_id, token_ids=token_ids)
        assert asked.num_cached_tokens(seq_id) == want
        assert snapshot(asked) == snapshot(twin)


def test_cached_prefix_len_follows_eviction():
    pool = BlockPool(6, 2, enable_prefix_caching=True)
    pool.append("a", token_ids=[1, 2, 3, 4, 5])  # blocks of [1, 2] and [3, 4] cached
    pool.free("a")
    assert pool.cached_prefix_len([1, 2, 3, 4, 5]) == 4
    pool.append("x", 9)  # takes the 3 never-cached free blocks, then evicts a's tail block first
    assert pool.usage().blocks_cached == 1
    assert pool.cached_prefix_len([1, 2, 3, 4, 5]) == 2
    assert pool.cached_prefix_len([3, 4, 5]) == 0  # a block is found by the whole chain before it


def test_cached_prefix_len_without_prefix_caching_is_zero():
    pool = BlockPool(8, 4)
    pool.append("a", token_ids=list(range(10)))
    before = snapshot(pool)
    assert pool.cached_prefix_len(list(range(10))) == 0 and pool.cached_prefix_len([]) == 0
    assert snapshot(pool) == before
    pool.append("b", token_ids=list(range(10)))
    assert pool.num_cached_tokens("b") == 0


@pytest.mark.parametrize("caching", [False, True])
def test_cached_prefix_len_checks_token_ids(caching):
    pool = BlockPool(8, 4, enable_prefix_caching=caching)
    with pytest.raises(ValueError, match="token_ids must be a 1-D sequence"):
        pool.cached_prefix_len([[1, 2]])
    with pytest.raises(TypeError, match="token_ids must hold integers"):
        pool.cached_prefix_len([1.0, 2.0])


def test_plan_seq_ids_are_the_batch_order():
    from cupaged import sim
    from cupaged.pool import BatchPlan

    pool = BlockPool(16, 4)
    plan = pool.plan([("b", 2), ("a", 3), (7, 0), ("c", [5, 6])])
    assert plan.seq_ids == ("b", "a", 7, "c") and isinstance(plan.seq_ids, tuple)
    assert pool.plan([]).seq_ids == ()
    device = plan.to_device(sim)
    assert device is not plan and device.seq_ids == ("b", "a", 7, "c")
    hand_made = BatchPlan(*(getattr(plan, f) for f in ("query_start_loc", "seq_lens", "block_tables",
                                                       "slot_mapping", "positions")), 5, 3)
    assert hand_made.seq_ids is None and hand_made.to_device(sim).seq_ids is None
    assert plan.block_size == device.block_size == 4 and hand_made.block_size is None
    assert pool.plan_decode(["b", "a"]).block_size == 4


def test_plan_decode_seq_ids_are_a_copy_of_the_ids():
    from cupaged import sim

    pool = BlockPool(32, 4)
    for i in (3, 9, 4):
        pool.append(i, 2)
    ids = np.array([9, 3, 4])
    first = pool.plan_decode(ids)
    assert isinstance(first.seq_ids, np.ndarray) and first.seq_ids.tolist() == [9, 3, 4]
    ids[:] = [4, 9, 3]  # the caller reuses its array: the plan keeps what it was made of
    assert first.seq_ids.tolist() == [9, 3, 4]
    second = pool.plan_decode(ids)
    assert second.seq_ids.tolist() == [4, 9, 3] and first.seq_ids.tolist() == [9, 3, 4]
    second.seq_ids[:] = -1  # scribbling on a plan's ids reaches neither the pool nor the next plan
    third = pool.plan_decode(ids)
    assert third.seq_ids.tolist() == [4, 9, 3] and third.seq_lens.tolist() == [5, 5, 5]
    device = third.to_device(sim)
    assert np.array_equal(device.seq_ids, [4, 9, 3])
    pool.append("s", 1)
    assert pool.plan_decode(["s"]).seq_ids.tolist() == ["s"]


def test_shared_prefix_blocks_are_the_leading_blocks_every_sequence_holds_before_its_new_tokens():
    """A prompt's prefix-cache hits and forks share their leading blocks: plans report how many, only whole blocks
    of context before every sequence's first new token, 0 for a batch of one or without sharing."""
    pool = BlockPool(40, 4, enable_prefix_caching=True)
    prompt = list(range(13))  # 3 full blocks and one token
    assert pool.plan([("a", prompt)]).shared_prefix_blocks == 0  # one sequence
    hit = pool.plan([("b", prompt[:10] + [90, 91]), ("z", [7, 8, 9])])
    assert (hit.slot_mapping[:8] == -1).all() and hit.shared_prefix_blocks == 0  # z shares nothing
    pool.free("z")
    assert pool.plan_decode(["a", "b"]).shared_prefix_blocks == 2  # b hit a's first 2 blocks
    pool.fork("a", "c")
    step = pool.plan_decode(["c", "a", "b"])
    assert step.shared_prefix_blocks == 2 and (step.block_tables[:, :2] == step.block_tables[0, :2]).all()
    assert pool.plan_decode(["c", "a"]).shared_prefix_blocks == 3  # the fork shares a's 3 full blocks (not its tail)
    chunk = pool.plan([("d", prompt[:4] + [50] * 6)])  # d hits 1 block; with a decode step below its queries start
    assert chunk.shared_prefix_blocks == 0
    both = pool.plan([("a", 1), ("d", 2)])  # d's new tokens start at 10: blocks 0-1 before every new token
    assert both.shared_prefix_blocks == 1  # but only block 0 is d's and a's alike
    assert BlockPool(8, 4).plan([("x", 5), ("y", 5)]).shared_prefix_blocks == 0
