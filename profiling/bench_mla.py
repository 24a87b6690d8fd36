"""Benchmark of MLA decode (kernels_cu/paged_attention.cu, shared-KV mode) and the chunked-context
prefill driver.

Decode is compute-bound on CUDA cores with 128 heads (~240 FLOP per cache byte): the table reports
TFLOP/s (4 · heads · 576-ish FLOP per key) beside GB/s of latent cache read. GPU: CUDA events, L2
flushed between reps, NVTX ranges named by config. Sim (no GPU): a smoke run with tiny sizes.

    python profiling/bench_mla.py
    nsys profile -t cuda,nvtx python profiling/bench_mla.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

import cupaged  # noqa: E402
from cupaged import sim  # noqa: E402

RANK, ROPE = 512, 64


def decode(xp, alloc, num_seqs, context, heads, kv_cache_dtype="auto", block=64):
    rng = np.random.default_rng(0)
    blocks_per_seq = -(-context // block)
    cache_dtype = np.float16 if kv_cache_dtype == "auto" else np.uint8
    cache = alloc((num_seqs * blocks_per_seq, block, RANK + ROPE), cache_dtype)
    cache[...] = xp.asarray(rng.integers(0, 100, cache.shape).astype(np.uint8) if cache_dtype == np.uint8
                            else (rng.standard_normal(cache.shape) * 0.1).astype(np.float16))
    tables = xp.asarray(rng.permutation(num_seqs * blocks_per_seq).astype(np.int32).reshape(num_seqs, -1))
    lens = xp.asarray(np.full(num_seqs, context, np.int32))
    q = xp.asarray(rng.standard_normal((num_seqs, heads, RANK + ROPE)).astype(np.float16))
    nbytes = num_seqs * context * (RANK + ROPE) * np.dtype(cache_dtype).itemsize
    flops = 2 * num_seqs * heads * context * ((RANK + ROPE) + RANK)
    label = f"mla_decode b={num_seqs} ctx={context} heads={heads} bs={block} {kv_cache_dtype}"

    def run():
        cupaged.mla_decode(q, cache, tables, lens, scale=0.04, kv_cache_dtype=kv_cache_dtype, k_scale=0.01,
                           max_seq_len=context)

    return label, run, nbytes, flops


GPU = [(1, 4096, 128), (8, 4096, 128), (64, 4096, 128), (128, 8192, 16), (64, 4096, 128, "fp8"), (32, 32768, 128)]
SIM = [(2, 128, 16), (1, 64, 128, "fp8")]


def main():
    cp = _bench.gpu()
    rows = []
    if cp is None:
        for cfg in SIM:
            label, run, nbytes, flops = decode(np, sim.empty, *cfg, block=16)
            with _bench.nvtx_range(label):
                rows.append(_bench.summarize(label, "v1", _bench.time_cpu(run), nbytes, None))
        _bench.print_table(rows, "SIM SMOKE RUN (no GPU): CPU timings of the simulator, not GPU timings")
        return
    device, peak = _bench.peak_bandwidth_gbps(cp)
    for cfg in GPU:
        label, run, nbytes, flops = decode(cp, cp.empty, *cfg)
        with _bench.nvtx_range(label):
            ms = _bench.time_gpu(cp, run)
        rows.append(_bench.summarize(label, "v1", ms, nbytes, peak) + (f"{flops / (np.median(ms) * 1e-3) / 1e12:.1f}",))
    _bench.print_table(rows, f"{device} (peak {peak or '?'} GB/s)", extra=("TFLOP/s",))


if __name__ == "__main__":
    main()
