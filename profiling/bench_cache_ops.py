"""Benchmark of the KV cache writes (kernels_cu/cache_ops.cu): achieved GB/s and % of peak.
Gathers and block copies: bench_cache_gather.py.

GPU: each op is timed with CUDA events, L2 flushed between reps, inside an NVTX range named by its
config; bytes moved = bytes read + bytes written. Sim (no GPU): one tiny size per op as a smoke
test; those are CPU timings of the simulator, not GPU timings. ``--model`` (sim): the H200 model of
a 16k-token reshape_and_cache_flash (fp16 and fp8), projected from 256 tokens (profiling/_model.py).

    python profiling/bench_cache_ops.py [--json out.json] [--model]
    nsys profile -t cuda,nvtx python profiling/bench_cache_ops.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

import cupaged  # noqa: E402


def _pool(xp, rng, tokens, block_size):
    num_blocks = -(-tokens // block_size) * 2
    return num_blocks, xp.asarray(rng.permutation(num_blocks * block_size)[:tokens].astype(np.int64))


def flash(xp, alloc, tokens, heads, head_size, block_size, layout="NHD", kv="auto"):
    rng = np.random.default_rng(0)
    key = xp.asarray(rng.standard_normal((tokens, heads, head_size)).astype(np.float16))
    value = xp.asarray(rng.standard_normal((tokens, heads, head_size)).astype(np.float16))
    num_blocks, slots = _pool(xp, rng, tokens, block_size)
    shape = (num_blocks, block_size, heads, head_size) if layout == "NHD" else (num_blocks, heads, block_size, head_size)
    cache_dtype = np.float16 if kv == "auto" else np.uint8
    kc, vc = alloc(shape, cache_dtype), alloc(shape, cache_dtype)
    nbytes = 2 * key.nbytes + 2 * key.size * np.dtype(cache_dtype).itemsize + slots.nbytes
    label = f"reshape_and_cache_flash t={tokens} h={heads} d={head_size} bs={block_size} {layout} fp16->{kv}"
    return label, (lambda: cupaged.reshape_and_cache_flash(key, value, kc, vc, slots, kv, 0.05, 0.05, layout=layout)), nbytes


def vllm(xp, alloc, tokens, heads, head_size, block_size, kv="auto"):
    rng = np.random.default_rng(0)
    key = xp.asarray(rng.standard_normal((tokens, heads, head_size)).astype(np.float16))
    value = xp.asarray(rng.standard_normal((tokens, heads, head_size)).astype(np.float16))
    num_blocks, slots = _pool(xp, rng, tokens, block_size)
    cache_dtype = np.float16 if kv == "auto" else np.uint8
    x = 16 // np.dtype(cache_dtype).itemsize
    kc = alloc((num_blocks, heads, head_size // x, block_size, x), cache_dtype)
    vc = alloc((num_blocks, heads, head_size, block_size), cache_dtype)
    nbytes = 2 * key.nbytes + 2 * key.size * np.dtype(cache_dtype).itemsize + slots.nbytes
    label = f"reshape_and_cache t={tokens} h={heads} d={head_size} bs={block_size} fp16->{kv}"
    return label, (lambda: cupaged.reshape_and_cache(key, value, kc, vc, slots, kv, 0.05, 0.05)), nbytes


def mla_write(xp, alloc, tokens, block_size, kv="auto"):
    rng = np.random.default_rng(0)
    kv_c = xp.asarray(rng.standard_normal((tokens, 512)).astype(np.float16))
    k_pe = xp.asarray(rng.standard_normal((tokens, 64)).astype(np.float16))
    num_blocks, slots = _pool(xp, rng, tokens, block_size)
    cache = alloc((num_blocks, block_size, 576), np.float16 if kv == "auto" else np.uint8)
    nbytes = kv_c.nbytes + k_pe.nbytes + tokens * 576 * cache.itemsize + slots.nbytes
    return (f"concat_and_cache_mla t={tokens} bs={block_size} fp16->{kv}",
            lambda: cupaged.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv, 0.05), nbytes)


GPU = [
    (flash, (4096, 8, 128, 16)), (flash, (16384, 8, 128, 16)), (flash, (16384, 8, 128, 16, "HND")),
    (flash, (16384, 8, 128, 16, "NHD", "fp8")), (vllm, (16384, 8, 128, 16)), (vllm, (16384, 8, 128, 16, "fp8")),
    (mla_write, (16384, 64)), (mla_write, (16384, 64, "fp8")),
]
SIM = [(flash, (64, 4, 128, 16)), (flash, (64, 4, 128, 16, "HND", "fp8")), (vllm, (64, 4, 128, 16)),
       (mla_write, (64, 16))]


def _shape(op, tokens, heads, head_size, kv):
    return dict(op=op, batch=1, context=tokens, q_len=tokens, num_heads=heads, num_kv_heads=heads, head_size=head_size,
                kv_dtype={"auto": "fp16", "fp8": "fp8_e4m3"}[kv], causal=False)


# (shape, make, full args, profiled args, factor): a 16k-token prefill chunk written into the cache,
# modeled from 256 of its tokens (one CTA per token, all alike)
MODEL = [(_shape("reshape_and_cache_flash", 16384, 8, 128, kv), flash, (16384, 8, 128, 16, "NHD", kv),
          (256, 8, 128, 16, "NHD", kv), 64) for kv in ("auto", "fp8")]


def main(argv=None):
    _bench.run_bandwidth_table(GPU, SIM, MODEL, "cache_ops", argv, __doc__)


if __name__ == "__main__":
    main()
