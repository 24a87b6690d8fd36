"""Benchmark of the KV cache ops (kernels_cu/cache_ops.cu).

GPU: each op is timed with CUDA events, L2 flushed between reps, inside an NVTX range named by its
config; bytes moved = bytes read + bytes written. Sim (no GPU): one tiny size per op as a smoke
test; those are CPU timings of the simulator, not GPU timings.

    python profiling/bench_cache_ops.py
    nsys profile -t cuda,nvtx python profiling/bench_cache_ops.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

import cupaged  # noqa: E402
from cupaged import sim  # noqa: E402

GPU_CONFIGS = [  # (num_tokens, num_kv_heads, head_size, block_size, layout)
    (256, 8, 128, 16, "NHD"), (4096, 8, 128, 16, "NHD"), (4096, 8, 128, 16, "HND"), (16384, 8, 128, 16, "NHD"),
    (16384, 8, 64, 32, "NHD"), (16384, 1, 576, 16, "NHD"),
]
SIM_CONFIGS = [(64, 4, 128, 16, "NHD"), (64, 4, 128, 16, "HND")]


def case(xp, alloc, num_tokens, num_kv_heads, head_size, block_size, layout, dtype=np.float16):
    rng = np.random.default_rng(0)
    num_blocks = -(-num_tokens // block_size) * 2
    key = xp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_size)).astype(dtype))
    value = xp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_size)).astype(dtype))
    shape = (num_blocks, block_size, num_kv_heads, head_size) if layout == "NHD" else \
        (num_blocks, num_kv_heads, block_size, head_size)
    key_cache, value_cache = alloc(shape, dtype), alloc(shape, dtype)
    slots = xp.asarray(rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64))
    nbytes = 2 * 2 * key.nbytes + slots.nbytes  # read K,V + write K,V + read slots

    def run():
        cupaged.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, layout=layout)

    return run, nbytes


def main():
    cp = _bench.gpu()
    rows = []
    if cp is None:
        for cfg in SIM_CONFIGS:
            run, nbytes = case(sim, sim.empty, *cfg)
            label = "reshape_and_cache_flash t=%d h=%d d=%d bs=%d %s fp16" % cfg
            with _bench.nvtx_range(label):
                ms = _bench.time_cpu(run)
            rows.append(_bench.summarize(label, "v1", ms, nbytes, None))
        _bench.print_table(rows, "SIM SMOKE RUN (no GPU): CPU timings of the simulator, not GPU timings")
        return
    device, peak = _bench.peak_bandwidth_gbps(cp)
    for cfg in GPU_CONFIGS:
        run, nbytes = case(cp, cp.empty, *cfg)
        label = "reshape_and_cache_flash t=%d h=%d d=%d bs=%d %s fp16" % cfg
        with _bench.nvtx_range(label):
            ms = _bench.time_gpu(cp, run)
        rows.append(_bench.summarize(label, "v1", ms, nbytes, peak))
    _bench.print_table(rows, f"{device} (peak {peak or '?'} GB/s)")


if __name__ == "__main__":
    main()
