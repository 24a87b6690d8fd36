"""The product of :meth:`cupaged.pool.BlockPool.plan`: the index arrays one forward step's kernels
take (docs/conventions.md §4), and their upload to the GPU in one copy from pinned staging memory."""

from __future__ import annotations

import dataclasses
import functools

from cupaged._backend import default_array_module, is_host_array, on_sim, resolve_array_module
from cupaged._host_transfer import PinnedStaging

__all__ = ["BatchPlan", "PinnedStaging", "default_array_module", "shared_prefix_blocks"]


_FIELDS = ("slot_mapping", "positions", "query_start_loc", "seq_lens", "block_tables")  # int64 first
_MASK_FIELDS = ("custom_mask", "mask_indptr")  # optional: uploaded when set


@dataclasses.dataclass(frozen=True, eq=False)
class BatchPlan:
    """Index arrays of one step, sequences in batch order (S sequences, T new tokens).

    ``query_start_loc`` int32 [S+1], ``seq_lens`` int32 [S] (context including the new tokens),
    ``block_tables`` int32 [S, max_blocks] (0-padded), ``slot_mapping`` int64 [T] (-1 for
    positions served by the prefix cache), ``positions`` int64 [T]; ``max_seq_len`` and
    ``max_query_len`` are the host-side launch hints of docs/conventions.md §6; ``seq_ids`` the
    sequences' ids in batch order (a tuple from ``plan``, the id array from ``plan_decode``; None
    for a plan made by hand), which per-request state such as cross attention's context keys and
    values is found by; ``block_size`` the pool's (None for a plan made by hand), which a cache
    read with the plan must share; ``shared_prefix_blocks`` how many leading blocks every sequence's table holds
    alike, all of them context before every sequence's new tokens (prefix-cache hits of one prompt, forks): the
    shared prefix cascade attention reads once (0 for one sequence, none shared, or a plan made by hand).
    ``custom_mask`` / ``mask_indptr`` (None: none): a tree mask for the step, as :func:`cupaged.paged_attention`
    takes it (FlashInfer's: per sequence q_len x seq_len booleans, row-major, concatenated, or those bit-packed
    by ``cupaged.pack_custom_mask``); speculative decoding sets them on a plan (``dataclasses.replace``) to verify
    draft trees, whose positions then follow each node's depth rather than its index. The arrays belong to the
    caller: no later pool call changes them.
    """

    query_start_loc: object
    seq_lens: object
    block_tables: object
    slot_mapping: object
    positions: object
    max_seq_len: int
    max_query_len: int
    seq_ids: object = None
    block_size: int | None = None
    shared_prefix_blocks: int = 0
    custom_mask: object = None
    mask_indptr: object = None
    _staging: PinnedStaging | None = dataclasses.field(default=None, repr=False)  # the pool's

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def to_device(self, xp=None) -> BatchPlan:
        """The same plan on the device: cupy arrays uploaded with one host-to-device copy on the
        current stream (asynchronous, from pinned memory), or guarded numpy arrays on the sim.
        ``xp`` as for :class:`cupaged.KVCache` (None: cupy when a GPU is usable, else the sim)."""
        if not is_host_array(self.seq_lens):
            return self
        xp = resolve_array_module(xp)
        arrays = {f: getattr(self, f) for f in _FIELDS + _MASK_FIELDS if getattr(self, f) is not None}
        if on_sim(xp):
            arrays = {f: xp.asarray(a) for f, a in arrays.items()}
        else:
            arrays = (self._staging or _shared_staging()).upload(xp, arrays)
        return dataclasses.replace(self, **arrays, _staging=None)


@functools.cache
def _shared_staging() -> PinnedStaging:
    """For plans made outside a pool: a staging that outlives the copies it starts (a temporary
    one could hand its pinned memory back while the copy still reads it)."""
    return PinnedStaging()


def shared_prefix_blocks(block_tables, seq_lens, q_lens, block_size: int) -> int:
    """The leading columns of ``block_tables`` (host, [S, width]) equal in every row and whole blocks of context
    before each sequence's first new token (seq_len - q_len); 0 for fewer than two sequences."""
    if block_tables.shape[0] < 2 or block_tables.shape[1] == 0:
        return 0
    same = (block_tables == block_tables[:1]).all(axis=0)
    n = int(same.size if same.all() else same.argmin())
    return min(n, int((seq_lens - q_lens).min()) // block_size)
