"""Speculative decoding with draft trees (``python -m cupaged demo --speculative K``).

Each step every decoding request drafts K tokens with a cheaper model -- the target's own first layer, embeddings
and head (``TinyDecoder.first_layers``), which reads and writes the target's layer-0 cache, since layer 0's keys and
values are a function of the token and its position alone -- arranged as a tree: the draft's top 2 below the
request's last accepted token (the root), then a greedy chain under the best. Nodes are listed parent before
child, chain first (``[best, chain..., runner-up]``), so the chain's drafting passes are plain causal decode steps
over consecutive key indices. The target then verifies the root and all K nodes in one step under a tree mask:
node i sits at key index ctx + 1 + i (the root at ctx), sees the context, the root, its ancestors and itself, and is
rotated at position ctx + depth. Acceptance walks the tree from the root: a greedy request takes the child whose
token is the target's argmax at its parent, so it emits exactly what plain greedy decoding would, and then the
target's own next token (the bonus); a sampled request takes the ratio rule (SpecInfer's, for a draft that proposes
deterministically: q is a point mass, so a child x is accepted with probability p(x), else p loses x and the next
child is tried, and when none is taken the token is drawn from what is left of p -- p exactly). The accepted nodes'
keys and values move to consecutive slots (``compact``) and the pool gives the rejected ones back
(``BlockPool.truncate``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cupaged import pack_custom_mask
from cupaged._backend import host_copy
from cupaged.pool import BatchPlan
from cupaged.pool._batch_plan import shared_prefix_blocks

__all__ = ["DraftTree", "tree_mask", "step_mask", "accept", "compact", "Speculator"]


@dataclasses.dataclass
class DraftTree:
    """Draft tokens below a root (the request's last accepted token, key index ctx): node i holds ``tokens[i]``
    at key index ctx + 1 + i, below ``parents[i]`` (an earlier node, or -1: the root); children in draft rank."""

    tokens: list
    parents: list

    def depth(self, node: int) -> int:
        return 0 if node < 0 else 1 + self.depth(self.parents[node])

    def children(self, node: int) -> list:
        return [i for i, p in enumerate(self.parents) if p == node]


def tree_mask(tree: DraftTree, ctx: int) -> np.ndarray:
    """bool ``[1 + k, ctx + 1 + k]``: row 0 the root (keys 0..ctx), row 1 + i node i (the context, the root, its
    ancestors and itself)."""
    k = len(tree.tokens)
    mask = np.zeros((1 + k, ctx + 1 + k), bool)
    mask[:, :ctx + 1] = True
    for i, p in enumerate(tree.parents):
        mask[1 + i, ctx + 1:] = mask[1 + p, ctx + 1:]  # parent before child: its row is complete
        mask[1 + i, ctx + 1 + i] = True
    return mask


def step_mask(plan, trees: dict):
    """(packed uint8, indptr) of a step's custom mask: ``trees`` {batch index: DraftTree} get tree rows, every other
    sequence its causal rows."""
    q_lens, seq_lens = np.diff(plan.query_start_loc), plan.seq_lens
    rows = []
    for s, (q_len, seq_len) in enumerate(zip(q_lens.tolist(), seq_lens.tolist())):
        tree = trees.get(s)
        if tree is None:
            rows.append(np.tri(q_len, seq_len, seq_len - q_len, bool).reshape(-1))
        else:
            rows.append(tree_mask(tree, seq_len - q_len).reshape(-1))
    return pack_custom_mask(np.concatenate(rows), query_start_loc=plan.query_start_loc, seq_lens=seq_lens)


def _choose(request, row: np.ndarray, kids: list, tokens: list):
    """(token, the child taken or None) at a node whose target logits are ``row``: greedy, the argmax (as
    Request.sample); sampled, the ratio rule for deterministic proposals over the children in rank order."""
    if request.temperature == 0.0:
        token = int(np.argmax(row))
        return token, next((c for c in kids if tokens[c] == token), None)
    z = row.astype(np.float64) / request.temperature
    p = np.exp(z - z.max())
    for c in kids:
        x = tokens[c]
        if request.rng.random() * p.sum() < p[x]:
            return x, c
        p[x] = 0.0
    return int(request.rng.choice(p.size, p=p / p.sum())), None


def accept(request, tree: DraftTree, rows: np.ndarray):
    """Walk ``tree`` from the root with the target's logits ``rows`` ``[1 + k, vocab]`` (the root's, then each
    node's): (accepted nodes root first, [(row, token)] to emit: one per accepted node and the bonus)."""
    path, emitted, node = [], [], -1
    while True:
        row = rows[1 + node]
        token, node = _choose(request, row, tree.children(node), tree.tokens)
        emitted.append((row, token))
        if node is None:
            return path, emitted
        path.append(node)


def compact(kv_cache, src, dst) -> None:
    """Move every layer's key and value rows from slots ``src`` to ``dst`` (int64, distinct), all read first."""
    if not len(src):
        return
    xp, bs = kv_cache.xp, kv_cache.block_size
    src, dst = (xp.asarray(np.asarray(a, np.int64)) for a in (src, dst))
    at = {"NHD": lambda s: (s // bs, s % bs), "HND": lambda s: (s // bs, slice(None), s % bs)}[kv_cache.layout]
    for cache in kv_cache.key_caches + kv_cache.value_caches:
        cache[at(dst)] = cache[at(src)]


class Speculator:
    """Drafts ``k`` tokens a decoding request with ``draft`` (a TinyDecoder sharing the target's cache for its
    layers) and turns a step's plan into a tree-verify plan. Counters: ``drafted``, ``accepted``, ``verified``
    (tree verifications: one a request and step)."""

    def __init__(self, draft, k: int):
        self.draft_model, self.k = draft, k
        self.drafted = self.accepted = self.verified = 0

    def draft(self, requests: dict, plan, token_ids: np.ndarray, kv_cache):
        """Draft a tree for each of ``requests`` {batch index: (request, k)} (the plan holds its root and k slots
        after its context), writing the nodes into ``token_ids``; returns (the plan with the nodes' positions and
        the step's tree mask, {batch index: DraftTree})."""
        qsl, vocab = plan.query_start_loc, self.draft_model.config.vocab_size
        chain_len = {s: k - 1 if k > 1 and vocab > 1 else k for s, (_, k) in requests.items()}
        chains, runner_up = {s: [] for s in requests}, {}
        for j in range(max(chain_len.values())):
            batch = [s for s in requests if chain_len[s] > j]
            at = np.array([qsl[s] + j for s in batch])  # the pass's query: the root, then chain node j - 1
            ids = [requests[s][0].tokens[-1] if j == 0 else chains[s][j - 1] for s in batch]
            logits = host_copy(self.draft_model.logits(self.draft_model.forward(
                self.draft_model.xp.asarray(np.array(ids, np.int64)), _pass_plan(plan, batch, at), kv_cache)))
            for s, row in zip(batch, logits):
                top = np.argsort(-row, kind="stable")[:2]
                chains[s].append(int(top[0]))
                if j == 0 and chain_len[s] < requests[s][1]:
                    runner_up[s] = int(top[1])
        trees, positions = {}, plan.positions.copy()
        for s, (request, k) in requests.items():
            chain, extra = chains[s], [runner_up[s]] if s in runner_up else []
            tree = DraftTree(chain + extra, list(range(-1, len(chain) - 1)) + [-1] * len(extra))
            token_ids[qsl[s] + 1:qsl[s] + 1 + k] = tree.tokens
            positions[qsl[s] + 1:qsl[s] + 1 + k] = positions[qsl[s]] + [tree.depth(i) for i in range(k)]
            trees[s] = tree
            self.drafted += k
        packed, indptr = step_mask(plan, trees)
        return dataclasses.replace(plan, positions=positions, custom_mask=packed, mask_indptr=indptr,
                                   _staging=None), trees


def _pass_plan(plan, batch: list, at: np.ndarray) -> BatchPlan:
    """A drafting pass: one query for each sequence ``batch`` (batch indices of ``plan``) at step token ``at``,
    causal over the keys before it (the chain's nodes are consecutive)."""
    qsl = plan.query_start_loc
    seq_lens = (plan.seq_lens[batch] - (qsl[np.array(batch) + 1] - at) + 1).astype(np.int32)
    tables = plan.block_tables[batch]
    return BatchPlan(query_start_loc=np.arange(len(batch) + 1, dtype=np.int32), seq_lens=seq_lens,
                     block_tables=tables, slot_mapping=plan.slot_mapping[at], positions=plan.positions[at],
                     max_seq_len=int(seq_lens.max()), max_query_len=1,
                     seq_ids=tuple(plan.seq_ids[s] for s in batch), block_size=plan.block_size,
                     shared_prefix_blocks=shared_prefix_blocks(tables, seq_lens, 1, plan.block_size))
