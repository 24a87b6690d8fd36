"""Benchmark of rotary embeddings (kernels_cu/rope.cu): RotaryEmbedding's in-place rotation and rope_and_cache
(RoPE fused with the flash-layout cache write), achieved GB/s and % of peak.

GPU: each op is timed with CUDA events, L2 flushed between reps, inside an NVTX range named by its config; bytes
moved = q and k read and written, v read, and each written token's k and v stored (fp16 or fp8). Sim (no GPU): one
tiny size per op as a smoke test (CPU timings of the simulator, not GPU timings). ``--model`` (sim): the H200
model of a 16k-token rope_and_cache (32/8 heads, d128, fp16 and fp8), projected from 256 tokens
(profiling/_model.py).

    python profiling/bench_rope.py [--json out.json] [--model]
    nsys profile -t cuda,nvtx python profiling/bench_rope.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

import cupaged  # noqa: E402


def _qkv(xp, rng, tokens, heads, kv_heads, head_size):
    fused = xp.asarray(rng.standard_normal((tokens, heads + 2 * kv_heads, head_size)).astype(np.float16))
    return fused[:, :heads], fused[:, heads:heads + kv_heads], fused[:, heads + kv_heads:]


def rotate(xp, alloc, tokens, heads, kv_heads, head_size):
    rng = np.random.default_rng(0)
    q, k, _ = _qkv(xp, rng, tokens, heads, kv_heads, head_size)
    positions = xp.asarray(rng.integers(0, 8192, tokens).astype(np.int64))
    emb = cupaged.RotaryEmbedding(head_size)
    nbytes = 2 * (q.size + k.size) * 2 + positions.nbytes
    return f"rope t={tokens} h={heads}/{kv_heads} d={head_size} fp16", (lambda: emb(positions, q, k)), nbytes


def fused(xp, alloc, tokens, heads, kv_heads, head_size, block_size, kv="auto"):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(xp, rng, tokens, heads, kv_heads, head_size)
    positions = xp.asarray(rng.integers(0, 8192, tokens).astype(np.int64))
    table = xp.asarray(cupaged.RotaryEmbedding(head_size).cos_sin_cache(8192))
    num_blocks = -(-tokens // block_size) * 2
    slots = xp.asarray(rng.permutation(num_blocks * block_size)[:tokens].astype(np.int64))
    cache_dtype = np.float16 if kv == "auto" else np.uint8
    kc = alloc((num_blocks, block_size, kv_heads, head_size), cache_dtype)
    vc = alloc((num_blocks, block_size, kv_heads, head_size), cache_dtype)
    written = tokens * kv_heads * head_size
    nbytes = 2 * (q.size + k.size) * 2 + written * (2 + 2 * np.dtype(cache_dtype).itemsize) + positions.nbytes + \
        slots.nbytes
    label = f"rope_and_cache t={tokens} h={heads}/{kv_heads} d={head_size} bs={block_size} fp16->{kv}"
    return label, (lambda: cupaged.rope_and_cache(q, k, v, positions, table, kc, vc, slots, kv, 0.05, 0.05)), nbytes


GPU = [(rotate, (16384, 32, 8, 128)), (fused, (16384, 32, 8, 128, 16)), (fused, (16384, 32, 8, 128, 16, "fp8"))]
SIM = [(rotate, (64, 4, 2, 128)), (fused, (64, 4, 2, 128, 16)), (fused, (64, 4, 2, 128, 16, "fp8"))]


def _shape(tokens, heads, kv_heads, head_size, kv):
    return dict(op="rope_and_cache", batch=1, context=tokens, q_len=tokens, num_heads=heads, num_kv_heads=kv_heads,
                head_size=head_size, kv_dtype={"auto": "fp16", "fp8": "fp8_e4m3"}[kv], causal=False)


# (shape, make, full args, profiled args, factor): a 16k-token prefill's q / k / v, modeled from 256 tokens (one CTA
# per token, all alike)
MODEL = [(_shape(16384, 32, 8, 128, kv), fused, (16384, 32, 8, 128, 16, kv), (256, 32, 8, 128, 16, kv), 64)
         for kv in ("auto", "fp8")]


def main(argv=None):
    _bench.run_bandwidth_table(GPU, SIM, MODEL, "rope", argv, __doc__)


if __name__ == "__main__":
    main()
