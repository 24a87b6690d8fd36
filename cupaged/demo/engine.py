"""The demo's serving loop: continuous batching on a :class:`cupaged.BlockPool` and a :class:`cupaged.KVCache`.

Each step schedules, vLLM v1 style, a token budget over the running requests (one token for a decoding request,
the next chunk of a prefilling one) and then admits waiting requests while budget and sequence slots remain; a
new request's first chunk starts after its prefix-cache hit (``BlockPool.cached_prefix_len``), so the hit tokens
are neither budgeted nor computed. The pool plans the whole step at once; when it runs out of blocks the
newest running request is preempted -- freed, and queued again to recompute its prompt and what it generated
(its freed full blocks stay in the prefix cache) -- and the step is planned again. After the step a request that
has consumed its whole history samples its next token; the parallel-sampling request forks once its prompt is in
the cache (the child shares its blocks; copy-on-write runs through ``copy_blocks``). With ``speculative`` K a decoding
request drafts up to K tokens as a tree and the step verifies them under a tree mask (cupaged/demo/speculative.py);
its root and draft slots are appended by count (their ids are not known when the step is planned, and the rejected
ones are given back), so its later blocks do not feed the prefix cache.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cupaged._backend import host_copy
from cupaged.cache_gather import copy_blocks
from cupaged.demo.speculative import Speculator, accept, compact
from cupaged.pool import BatchPlan, BlockPool, OutOfBlocks

__all__ = ["Request", "Engine", "blocks_needed", "drop_cached"]


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence: ``tokens`` its history (prompt, then what it generated), ``computed`` how many of them have
    their keys and values in the cache. ``temperature`` 0: greedy. ``logits``: (position, float32 row, chosen
    token) for every token it sampled, for ``--verify``."""

    seq_id: int
    prompt: list
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    fork_as: int | None = None          # seq_id of a parallel sample forked once the prompt is cached
    tokens: list = dataclasses.field(default_factory=list)
    computed: int = 0
    logits: list = dataclasses.field(default_factory=list)
    rng: object = None

    def __post_init__(self):
        self.tokens = list(self.prompt) if not self.tokens else self.tokens
        self.rng = np.random.default_rng(self.seed) if self.rng is None else self.rng

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def sample(self, row: np.ndarray) -> int:
        if self.temperature == 0.0:
            return int(np.argmax(row))
        z = row.astype(np.float64) / self.temperature
        p = np.exp(z - z.max())
        return int(self.rng.choice(p.size, p=p / p.sum()))


def blocks_needed(request: Request, block_size: int) -> int:
    """The blocks ``request`` holds at its peak, its last step: every token of its history but the last one it
    samples, whose keys and values are never computed. A pool of fewer can never serve it."""
    return -(-(len(request.prompt) + request.max_new_tokens - 1) // block_size)


def drop_cached(plan: BatchPlan) -> tuple[BatchPlan, np.ndarray]:
    """The plan without the positions the prefix cache served (slot -1: their keys and values are in the cache
    already), and the kept token indices. Context lengths and tables stay: the remaining queries attend over the
    cached prefix."""
    keep = np.flatnonzero(plan.slot_mapping >= 0)
    if keep.size == plan.num_tokens:
        return plan, keep
    seq_of = np.repeat(np.arange(plan.num_seqs), np.diff(plan.query_start_loc))
    q_lens = np.bincount(seq_of[keep], minlength=plan.num_seqs)
    qsl = np.zeros(plan.num_seqs + 1, np.int32)
    np.cumsum(q_lens, out=qsl[1:])
    trimmed = dataclasses.replace(plan, query_start_loc=qsl, slot_mapping=plan.slot_mapping[keep],
                                  positions=plan.positions[keep], max_query_len=int(q_lens.max(initial=0)),
                                  _staging=None)
    return trimmed, keep


class Engine:
    """Serves :class:`Request` s on ``model`` (a TinyDecoder) with ``kv_cache``'s blocks, ``token_budget`` tokens
    and ``max_num_seqs`` sequences a step; ``speculative`` K > 0 drafts up to K tokens a decoding request with
    ``draft`` (cupaged/demo/speculative.py). Counters for the closing table: ``stats`` (and ``speculator``'s)."""

    def __init__(self, model, kv_cache, *, token_budget: int, max_num_seqs: int, speculative: int = 0, draft=None):
        self.model, self.kv = model, kv_cache
        self.speculator = Speculator(draft, speculative) if speculative else None
        self.pool = BlockPool(kv_cache.num_blocks, kv_cache.block_size, enable_prefix_caching=True)
        self.token_budget, self.max_num_seqs = token_budget, max_num_seqs
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.stats = dict(steps=0, prompt_tokens=0, hit_tokens=0, computed_tokens=0, generated=0, preemptions=0,
                          forks=0, copies=0, peak_blocks=0, waste_sum=0.0, max_batch_tokens=0, mixed_steps=0)

    def add(self, request: Request) -> None:
        need = blocks_needed(request, self.pool.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(f"request {request.seq_id} needs {need} blocks; the pool has {self.pool.num_blocks}")
        self.waiting.append(request)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _schedule(self, admit: int):
        """(request, new token count incl. prefix hits) pairs: running requests first, then up to ``admit`` new."""
        batch, budget = [], self.token_budget
        for r in self.running:
            n = min(len(r.tokens) - r.computed, budget)
            if n == len(r.tokens) - r.computed == 1 and r.generated and self.speculator:  # the root and its drafts
                n += min(self.speculator.k, r.max_new_tokens - r.generated - 1, budget - 1)
            if n:
                batch.append((r, n))
                budget -= n
        for r in self.waiting[:admit]:
            if budget == 0:
                break
            hits = self.pool.cached_prefix_len(r.tokens)
            n = min(len(r.tokens) - hits, budget)
            batch.append((r, hits + n))
            budget -= n
        return batch

    def _plan(self):
        """Plan a step, preempting (or admitting fewer) until the pool can hold it."""
        admit = max(self.max_num_seqs - len(self.running), 0)
        while True:
            batch = self._schedule(admit)
            new = [r for r, _ in batch if r not in self.running]
            chunks = [np.asarray(r.tokens[r.computed:r.computed + n], np.int64) for r, n in batch]
            try:  # draft slots by count: their ids come after planning (0 stands in)
                plan = self.pool.plan([(r.seq_id, ids if ids.size == n else n) for (r, n), ids in zip(batch, chunks)])
                chunks = [np.pad(ids, (0, n - ids.size)) for (_, n), ids in zip(batch, chunks)]
                return batch, new, plan, np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
            except OutOfBlocks:
                if new:
                    admit = len(new) - 1
                    continue
                victim = self.running.pop()
                self.pool.free(victim.seq_id)
                victim.computed = 0
                self.waiting.insert(0, victim)
                self.stats["preemptions"] += 1
                if not self.running:
                    raise

    def step(self) -> int:
        """Run one step; returns the number of tokens generated."""
        batch, new, plan, token_ids = self._plan()
        for r in new:
            self.waiting.remove(r)
            self.running.append(r)
            self.stats["prompt_tokens"] += len(r.tokens)
        copies = self.pool.take_pending_copies()
        if copies.shape[0]:
            copy_blocks(self.kv.key_caches, self.kv.value_caches, copies)
            self.stats["copies"] += copies.shape[0]
        self.stats["hit_tokens"] += int((plan.slot_mapping < 0).sum())
        plan, keep = drop_cached(plan)
        token_ids = token_ids[keep]
        drafting = {i: (r, r.computed + n - len(r.tokens)) for i, (r, n) in enumerate(batch)
                    if r.computed + n > len(r.tokens)}
        trees = {}
        if drafting:
            plan, trees = self.speculator.draft(drafting, plan, token_ids, self.kv)
        xp = self.model.xp
        hidden = self.model.forward(xp.asarray(token_ids), plan, self.kv)
        qsl = np.asarray(plan.query_start_loc)
        sampling = [i for i, (r, n) in enumerate(batch) if r.computed + n == len(r.tokens)]
        at = np.concatenate([qsl[1:][sampling] - 1] + [np.arange(qsl[i], qsl[i + 1]) for i in trees]).astype(np.int64)
        rows = host_copy(self.model.logits(hidden[xp.asarray(at)])) if at.size else None
        self._account(batch, plan)
        for i, (r, n) in enumerate(batch):
            r.computed += 0 if i in trees else n  # a verified tree's request: once its path is accepted
        generated = 0
        for row, i in zip(rows if rows is not None else (), sampling):
            for r in self._fork(batch[i][0]):
                self._emit(r, row)
                generated += 1
        if trees:
            generated += self._accept(batch, plan, trees, rows[len(sampling):])
        for r in [r for r in self.running if r.generated >= r.max_new_tokens]:
            self.running.remove(r)
            self.pool.free(r.seq_id)
            self.finished.append(r)
        return generated

    def _fork(self, r: Request):
        """The request, and its parallel sample once its prompt is cached (the child shares every block)."""
        if r.fork_as is None or r.generated:
            return [r]
        child = Request(r.fork_as, r.prompt, r.max_new_tokens, r.temperature, r.seed + 1, tokens=list(r.tokens),
                        computed=r.computed)
        r.fork_as = None
        self.pool.fork(r.seq_id, child.seq_id)
        self.running.append(child)
        self.stats["forks"] += 1
        return [r, child]

    def _accept(self, batch, plan, trees: dict, rows: np.ndarray) -> int:
        """Accept each verified tree's path (``rows``: the target's logits at every tree's root and nodes, in
        ``trees``' order), move the accepted keys and values to consecutive slots, give the rest back to the pool;
        returns the tokens emitted."""
        qsl, spec = np.asarray(plan.query_start_loc), self.speculator
        src, dst, emitted, start = [], [], 0, 0
        for i, tree in trees.items():
            r, k = batch[i][0], len(tree.tokens)
            path, tokens = accept(r, tree, rows[start:start + 1 + k])
            start += 1 + k
            for row, token in tokens:
                self._emit(r, row, token)
            for depth, node in enumerate(path, 1):  # node i's slot is the step's token qsl[i] + 1 + node
                if node + 1 != depth:
                    src.append(plan.slot_mapping[qsl[i] + 1 + node])
                    dst.append(plan.slot_mapping[qsl[i] + depth])
            r.computed = len(r.tokens) - 1
            self.pool.truncate(r.seq_id, r.computed)
            spec.accepted += len(path)
            spec.verified += 1
            emitted += len(tokens)
        compact(self.kv, src, dst)
        return emitted

    def _emit(self, r: Request, row: np.ndarray, token: int | None = None) -> None:
        token = r.sample(row) if token is None else token
        r.logits.append((len(r.tokens) - 1, row.copy(), token))
        r.tokens.append(token)
        self.stats["generated"] += 1

    def _account(self, batch, plan):
        s, usage = self.stats, self.pool.usage()
        s["steps"] += 1
        s["computed_tokens"] += plan.num_tokens
        s["max_batch_tokens"] = max(s["max_batch_tokens"], plan.num_tokens)
        s["peak_blocks"] = max(s["peak_blocks"], usage.blocks_in_use)
        s["waste_sum"] += usage.waste
        decoding = sum(1 for r, _ in batch if r.computed == len(r.tokens) - 1 >= len(r.prompt))
        s["mixed_steps"] += int(0 < decoding < len(batch))
