"""Model rows of the serving patterns beyond plain decode, for bench_paged_attention.py --model (issue 34):
``cascade_decode`` (64 requests behind one 4096-token prompt, each with 256 tokens of its own, decoding: cupaged's
cascade_attention, beside plain decode's HBM floor over the same contexts) and ``tree_verify`` (64 requests each
verifying a 64-token draft tree over a 4096-token context in one step with a tree mask, beside 64 single-token
decode steps of the same batch). Shapes 32 / 8 heads, head 128, fp16, as the issue gives them."""

from __future__ import annotations

import numpy as np

import _model

import cupaged
from cupaged._cost import Cost, attention_cost
from cupaged.demo.speculative import DraftTree, tree_mask
from cupaged.sim.model import H200
from cupaged.testing import paged_kv

HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
SHARED, OWN, REQUESTS = 4096, 256, 64
TREE_NODES, TREE_FANOUT, TREE_SUBSET = 64, 4, 2


def _shape(op, batch, context, q_len, **extra):
    return dict(op=op, batch=batch, context=context, q_len=q_len, num_heads=HEADS, num_kv_heads=KV_HEADS,
                head_size=HEAD, kv_dtype="fp16", causal=True, **extra)


def cascade_decode() -> dict:
    """The whole batch on the sim (its shared level is one query run), the CTAs of one kv head profiled. Declared
    bytes: the shared K/V once, each request's own K/V, q and out; FLOPs over every request's whole context."""
    rng = np.random.default_rng(0)
    kv = paged_kv(np.array([SHARED] + [OWN] * REQUESTS), block_size=BLOCK, head_size=HEAD, num_kv_heads=KV_HEADS,
                  dtype=np.float16, rng=rng)
    q = rng.standard_normal((REQUESTS, HEADS, HEAD), np.float32).astype(np.float16)
    level = cupaged.CascadeLevel(np.array([0, REQUESTS], np.int32), np.ascontiguousarray(kv.block_tables[:1]),
                                 np.array([SHARED], np.int32))
    tables = np.ascontiguousarray(kv.block_tables[1:, :-(-OWN // BLOCK)])
    own = np.ascontiguousarray(kv.seq_lens[1:])

    def run():
        cupaged.cascade_attention(q, kv.key_cache, kv.value_cache, [level], tables, own)

    kv_bytes = (SHARED + REQUESTS * OWN) * KV_HEADS * HEAD * 2 * 2
    cost = Cost(kv_bytes + 2 * q.nbytes, 4 * REQUESTS * HEADS * (SHARED + OWN) * HEAD)
    plain_floor = REQUESTS * (SHARED + OWN) * KV_HEADS * HEAD * 4 / H200.achievable_bytes_per_s * 1e6 + 2
    r = _model.project(_shape("cascade_decode", REQUESTS, SHARED + OWN, 1, shared_prefix=SHARED), run, cost, 1,
                       (1, KV_HEADS, 1), warm=True)
    r.update(plain_decode_floor_us=plain_floor, below_floor=plain_floor / r["time_us"])
    return r


def draft_tree(nodes=TREE_NODES, fanout=TREE_FANOUT) -> DraftTree:
    """A complete ``fanout``-ary draft tree below the root (the last accepted token) in breadth-first order: with
    the root, ``nodes`` queries."""
    return DraftTree(tokens=[0] * (nodes - 1), parents=[(i - 1) // fanout - 1 for i in range(1, nodes)])


def tree_verify() -> dict:
    """``TREE_SUBSET`` requests of the batch on the sim with the batch's plan, every CTA of one kv head profiled and
    scaled to 64 requests. Declared: the K/V, q, out and the packed mask; FLOPs of the keys each node sees."""
    rng = np.random.default_rng(0)
    context = SHARED - TREE_NODES  # the tree's nodes are the last keys of a 4096-token context
    kv = paged_kv(np.full(TREE_SUBSET, SHARED), block_size=BLOCK, head_size=HEAD, num_kv_heads=KV_HEADS,
                  dtype=np.float16, rng=rng)
    q = rng.standard_normal((TREE_SUBSET * TREE_NODES, HEADS, HEAD), np.float32).astype(np.float16)
    qsl = (np.arange(TREE_SUBSET + 1) * TREE_NODES).astype(np.int32)
    mask = np.tile(tree_mask(draft_tree(), context).ravel(), TREE_SUBSET)
    packed, indptr = cupaged.pack_custom_mask(mask, query_start_loc=qsl, seq_lens=kv.seq_lens)
    split = _production_split()

    def run():
        cupaged.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
                                custom_mask=packed, mask_indptr=indptr, max_query_len=TREE_NODES, min_query_len=TREE_NODES,
                                max_seq_len=SHARED, kv_split_size=split)

    seen = int(tree_mask(draft_tree(), context).sum())
    base = attention_cost(np.full(REQUESTS, SHARED), np.full(REQUESTS, TREE_NODES), num_heads=HEADS,
                          num_kv_heads=KV_HEADS, head_size=HEAD, v_head_size=HEAD, kv_itemsize=2, q_itemsize=2,
                          out_itemsize=2, block_size=BLOCK, causal=True)
    cost = Cost(base.min_bytes + REQUESTS * packed.nbytes // TREE_SUBSET, 4 * REQUESTS * HEADS * seen * HEAD)
    return _model.project(_shape("tree_verify", REQUESTS, SHARED, TREE_NODES, tree_depth=_depth()), run, cost,
                          REQUESTS // TREE_SUBSET, (1, KV_HEADS, 1))


def _depth() -> int:
    tree = draft_tree()
    return max(tree.depth(i) for i in range(len(tree.tokens)))


def _production_split() -> int:
    """The split the whole batch's plan takes (the subset must run it, not its own)."""
    q = np.empty((REQUESTS * TREE_NODES, HEADS, HEAD), np.float16)
    cache = np.empty((1, BLOCK, KV_HEADS, HEAD), np.float16)
    plan = cupaged.plan_attention(q, cupaged.KvView.paged(cache, cache, q),
                                  np.empty((REQUESTS, SHARED // BLOCK), np.int32), np.empty(REQUESTS, np.int32),
                                  np.empty(REQUESTS + 1, np.int32), max_query_len=TREE_NODES, max_seq_len=SHARED)
    return plan.kv_split_size or SHARED


def serving_rows(decode_row: dict | None) -> list:
    """The two rows; ``decode_row`` (decode 64 x 4096, 32 / 8, fp16), when modeled in the same run, prices the 64
    single-token decode steps a tree verification replaces."""
    tree = tree_verify()
    if decode_row is not None:
        steps = TREE_NODES * decode_row["time_us"]
        tree.update(decode_steps_us=steps, vs_decode_steps=steps / tree["time_us"])
    return [cascade_decode(), tree]
