"""Benchmark of the cache gathers and block copies (kernels_cu/cache_gather.cu): achieved GB/s and % of peak.

GPU: each op is timed with CUDA events, L2 flushed between reps, inside an NVTX range named by its
config; bytes moved = bytes read + bytes written. Sim (no GPU): one tiny size per op as a smoke
test; those are CPU timings of the simulator, not GPU timings. ``--model`` (sim): no rows (the
cache ops' model rows are bench_cache_ops.py's), an empty table.

    python profiling/bench_cache_gather.py [--json out.json] [--model]
    nsys profile -t cuda,nvtx python profiling/bench_cache_gather.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

import cupaged  # noqa: E402


def _latent_cache(xp, rng, tokens, block_size, kv):
    """An MLA latent cache [num_blocks, block_size, 576] holding one sequence of ``tokens``, and its
    shuffled block table [1, num_blocks]."""
    num_blocks = -(-tokens // block_size)
    cache = xp.asarray(rng.integers(0, 120, (num_blocks, block_size, 576)).astype(np.uint8)) if kv != "auto" else \
        xp.asarray(rng.standard_normal((num_blocks, block_size, 576)).astype(np.float16))
    table = xp.asarray(rng.permutation(num_blocks).astype(np.int32).reshape(1, -1))
    return cache, table, xp.asarray(np.array([0, tokens], np.int32))


def mla_gather(xp, alloc, tokens, block_size, kv="auto"):
    rng = np.random.default_rng(0)
    cache, table, cu = _latent_cache(xp, rng, tokens, block_size, kv)
    t2s = xp.asarray(np.zeros(tokens, np.int32))
    dst = alloc((tokens, 576), np.float16)
    nbytes = cache.nbytes + dst.nbytes
    return (f"gather_and_maybe_dequant_cache t={tokens} bs={block_size} {kv}->fp16",
            lambda: cupaged.gather_and_maybe_dequant_cache(cache, dst, table, cu, t2s, tokens, kv, 0.05), nbytes)


def cp_gather(xp, alloc, tokens, block_size):
    rng = np.random.default_rng(0)
    cache, table, cu = _latent_cache(xp, rng, tokens, block_size, "auto")
    dst = alloc((tokens, 576), np.float16)
    nbytes = cache.nbytes + dst.nbytes
    return (f"cp_gather_cache t={tokens} bs={block_size} fp16",
            lambda: cupaged.cp_gather_cache(cache, dst, table, cu, 1), nbytes)


def copy(xp, alloc, num_pairs, block_bytes_shape):
    rng = np.random.default_rng(0)
    caches = [alloc((2 * num_pairs, *block_bytes_shape), np.float16) for _ in range(2)]
    perm = rng.permutation(2 * num_pairs)
    mapping = xp.asarray(np.stack([perm[:num_pairs], perm[num_pairs:]], axis=1).astype(np.int64))
    nbytes = 2 * 2 * num_pairs * int(np.prod(block_bytes_shape)) * 2
    return (f"copy_blocks pairs={num_pairs} block={block_bytes_shape} fp16 K+V",
            lambda: cupaged.copy_blocks(caches[:1], caches[1:], mapping), nbytes)


GPU = [(mla_gather, (32768, 64)), (mla_gather, (32768, 64, "fp8")), (cp_gather, (32768, 64)),
       (copy, (1024, (16, 8, 128)))]
SIM = [(mla_gather, (64, 16, "fp8")), (cp_gather, (64, 16)), (copy, (8, (16, 4, 64)))]
MODEL = []


def main(argv=None):
    _bench.run_bandwidth_table(GPU, SIM, MODEL, "cache_gather", argv, __doc__)


if __name__ == "__main__":
    main()
