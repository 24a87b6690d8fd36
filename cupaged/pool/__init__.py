"""Block pool: the host side of a paged KV cache, after vLLM's block manager (PagedAttention).

A sequence's tokens live in fixed-size blocks named by its block table; a token at position p
sits in slot ``table[p // block_size] * block_size + p % block_size``. Blocks are allocated as a
sequence grows, so at most one partly filled block per sequence is wasted. Blocks are reference
counted: ``fork`` shares every block of a sequence (parallel sampling, beam search) and the first
append into a shared, partly filled block gets a private copy (copy-on-write; the copies to run
come from ``take_pending_copies``, for ``cupaged.copy_blocks``). With prefix caching, full
blocks are found by a hash chained over the token ids of every block up to them, so requests
with a common prompt prefix share its blocks.

A step of an engine: ``plan`` (or ``plan_decode``) the batch, run ``take_pending_copies()``
through ``copy_blocks``, then write the step's keys and values with ``reshape_and_cache*`` at
``plan.slot_mapping``; fork, free and ``truncate`` (speculative decoding's rejected draft tokens)
between steps. Every call either succeeds whole or raises and changes nothing (``OutOfBlocks``
when the blocks run out: preempt, or wait).

Per-sequence state is kept in numpy arrays indexed by a row number, so a decode step
(``plan_decode``) updates only the entries that change and does no per-sequence Python work.

Modules, one responsibility each:
  ``_block_pool.py``      ``BlockPool`` and ``PoolUsage``, the public API;
  ``_append.py``          appending to a batch of sequences, all or nothing (``append``, ``plan``);
  ``_decode_step.py``     the vectorized decode step (``plan_decode``);
  ``_sequence_table.py``  per-sequence rows: block tables, lengths, prefix-cache chain hashes;
  ``_allocator.py``       physical blocks: reference counts, free list, prefix cache, pending copies;
  ``_batch_plan.py``      ``BatchPlan``, a step's index arrays, and their upload to the device.
"""

from cupaged.pool._allocator import OutOfBlocks
from cupaged.pool._batch_plan import BatchPlan
from cupaged.pool._block_pool import BlockPool, PoolUsage

__all__ = ["BlockPool", "BatchPlan", "OutOfBlocks", "PoolUsage"]
