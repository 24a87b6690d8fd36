"""Benchmark of merge_attn_states (kernels_cu/merge_attn_states.cu): achieved GB/s and % of peak.

GPU: each config is timed with CUDA events, L2 flushed between reps, inside an NVTX range named by
its config; bytes moved = both partial outputs and LSEs read + output and output LSE written (the
kernel is a pure stream: its bound is those bytes / HBM bandwidth). Sim (no GPU): tiny sizes as a
smoke test; those are CPU timings of the simulator, not GPU timings. ``--model`` (sim): the H200
model of a 16k-token x 32-head fp16 merge, projected from 512 tokens (profiling/_model.py).

    python profiling/bench_merge_attn_states.py [--json out.json] [--model]
    nsys profile -t cuda,nvtx python profiling/bench_merge_attn_states.py
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

from cupaged._backend import on_sim  # noqa: E402
from cupaged.merge_attn_states import merge_attn_states  # noqa: E402

DTYPE_NAMES = {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16", np.dtype(ml_dtypes.bfloat16): "bf16"}


def _normal(xp, rng, shape, dtype):
    """Random data made where it lives (GPU-sized outputs would take seconds on the host)."""
    if on_sim(xp):
        return rng.standard_normal(shape, np.float32).astype(dtype)
    return xp.random.RandomState(0).standard_normal(shape, dtype=np.float32).astype(dtype)


def merge(xp, alloc, tokens, heads, head_size, dtype=np.float16):
    """A chunked-prefill merge: random partial outputs, LSEs with 10% +inf (empty rows) per side."""
    rng = np.random.default_rng(0)
    shape = (tokens, heads, head_size)
    prefix_output, suffix_output = (_normal(xp, rng, shape, dtype) for _ in range(2))
    lses = []
    for _ in range(2):
        lse = rng.standard_normal((heads, tokens), np.float32) * 4
        lse[rng.random(lse.shape) < 0.1] = np.inf
        lses.append(xp.asarray(lse))
    output, output_lse = alloc(shape, dtype), alloc((heads, tokens), np.float32)
    nbytes = 3 * output.nbytes + 3 * output_lse.nbytes
    label = f"merge_attn_states t={tokens} h={heads} d={head_size} {DTYPE_NAMES[np.dtype(dtype)]}"
    return label, (lambda: merge_attn_states(output, prefix_output, lses[0], suffix_output, lses[1], output_lse)), \
        nbytes


GPU = [(merge, (t, h, d)) for t in (4096, 16384) for h in (32, 128) for d in (128, 512)] + \
      [(merge, (16384, 32, 128, ml_dtypes.bfloat16)), (merge, (16384, 32, 128, np.float32))]
SIM = [(merge, (17, 4, 128)), (merge, (5, 2, 512, np.float32))]


# (shape, make, full args, profiled args, factor): 16k tokens x 32 heads, modeled from 512 tokens
MODEL = [(dict(op="merge_attn_states", batch=1, context=16384, q_len=16384, num_heads=32, num_kv_heads=32,
               head_size=128, kv_dtype=None, causal=False), merge, (16384, 32, 128), (512, 32, 128), 32)]


def main(argv=None):
    _bench.run_bandwidth_table(GPU, SIM, MODEL, "merge_attn_states", argv, __doc__)


if __name__ == "__main__":
    main()
