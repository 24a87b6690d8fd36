"""Benchmark of MLA decode (kernels_cu/paged_attention.cu, mla_decode_kernel on tensor cores).

Decode is compute-bound with 128 heads (~240 FLOP per cache byte): rows report
TFLOP/s (2 · heads · (576 + 512) FLOP per key) beside GB/s of the op's declared minimum bytes
(cupaged/_cost.py: the latent rows once, q, out). GPU: CUDA events, L2 flushed between reps, NVTX
ranges named by config; model rows a ``--model`` run cached are printed beside. ``--model`` (sim):
the H200 model projected to 64 x 4096 with 16 and 128 heads, 576/512, bf16 (profiling/_model.py).
Without either: a smoke run of tiny sizes on the sim (CPU timings, not GPU timings).

    python profiling/bench_mla.py [--json out.json] [--model]
    nsys profile -t cuda,nvtx python profiling/bench_mla.py
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402
import _model  # noqa: E402

import cupaged  # noqa: E402
from cupaged.testing import paged_kv  # noqa: E402
from cupaged._cost import attention_cost  # noqa: E402

RANK, ROPE, BLOCK = 512, 64, 64
DTYPES = {"fp16": (np.float16, "auto"), "bf16": (ml_dtypes.bfloat16, "auto"), "fp8_e4m3": (ml_dtypes.bfloat16, "fp8")}


def shape(batch, context, heads, kv_dtype="bf16"):
    return dict(op="mla_decode", batch=batch, context=context, q_len=1, num_heads=heads, num_kv_heads=1,
                head_size=RANK + ROPE, kv_dtype=kv_dtype, causal=True)


def cost(s, block=BLOCK):
    dtype, kv = DTYPES[s["kv_dtype"]]
    itemsize = np.dtype(dtype).itemsize
    return attention_cost(np.full(s["batch"], s["context"]), np.ones(s["batch"], np.int64), num_heads=s["num_heads"],
                          num_kv_heads=1, head_size=RANK + ROPE, v_head_size=RANK,
                          kv_itemsize=1 if kv != "auto" else itemsize, q_itemsize=itemsize, out_itemsize=itemsize,
                          block_size=block, causal=True, shared_kv=True, query_start_loc=False)


def decode(device, s, block=BLOCK, kv_split_size=None):
    """A launch of shape ``s`` on ``device`` ("sim" or "cuda"): the latent cache from cupaged.testing.paged_kv
    (shuffled blocks, a last block's unused slots poisoned; fp8 at scale 0.1)."""
    rng = np.random.default_rng(0)
    dtype, kv_cache_dtype = DTYPES[s["kv_dtype"]]
    num_seqs, context, heads = s["batch"], s["context"], s["num_heads"]
    kv = paged_kv(np.full(num_seqs, context), block_size=block, head_size=RANK + ROPE, dtype=dtype, layout="mla",
                  kv_cache_dtype=kv_cache_dtype, kv_scale=0.1, rng=rng, device=device)
    if device == "sim":
        xp = np
    else:
        import cupy as xp
    q = xp.asarray(rng.standard_normal((num_seqs, heads, RANK + ROPE), np.float32).astype(dtype))
    args, k_scale = (q, kv.key_cache, kv.block_tables, kv.seq_lens), kv.k_scale  # not kv: its host copy goes

    def run():
        cupaged.mla_decode(*args, scale=0.04, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, max_seq_len=context,
                           kv_split_size=kv_split_size)

    return run


def production_split(s, block=BLOCK):
    """The kv_split_size the plan gives the full batch of shape ``s`` (shape-only stand-ins: the plan reads no
    contents)."""
    dtype, kv_cache_dtype = DTYPES[s["kv_dtype"]]
    q = np.empty((s["batch"], s["num_heads"], RANK + ROPE), dtype)
    cache = np.empty((1, block, RANK + ROPE), np.uint8 if kv_cache_dtype != "auto" else dtype)
    table = np.empty((s["batch"], -(-s["context"] // block)), np.int32)
    plan = cupaged.plan_attention(q, cupaged.KvView.mla(cache, RANK, kv_cache_dtype), table,
                                  np.empty(s["batch"], np.int32), max_seq_len=s["context"])
    return plan.kv_split_size or s["context"]


def project(s, subset):
    """The full batch's plan (its split) on ``subset`` sequences, every CTA profiled: the head tiles of
    one split share their latent rows in L2, so sampling among them would over-count distinct bytes."""
    run = decode("sim", dict(s, batch=subset), kv_split_size=production_split(s))
    return _model.project(s, run, cost(s), s["batch"] // subset)


MODEL = [(shape(64, 4096, 16), 2), (shape(64, 4096, 128), 1)]
GPU = [shape(1, 4096, 128), shape(8, 4096, 128), shape(64, 4096, 128), shape(128, 8192, 16), shape(64, 4096, 16),
       shape(64, 4096, 128, "fp8_e4m3"), shape(32, 32768, 128)]
SIM = [shape(2, 128, 16), shape(1, 64, 128, "fp8_e4m3")]


def main(argv=None):
    args = _model.bench_parser(__doc__).parse_args(argv)
    cp = _bench.gpu()
    if cp is None and args.model:
        _model.finish_model("mla", [project(s, subset) for s, subset in MODEL], args.json)
        return
    table, rows = [], []
    if cp is None:
        for s in SIM:
            run = decode("sim", s, block=16)
            table.append(_bench.summarize(_model.label(s), "v5", _bench.time_cpu(run), cost(s, 16).min_bytes, None))
        _bench.print_table(table, "SIM SMOKE RUN (no GPU): CPU timings of the simulator, not GPU timings")
        return
    device, peak = _bench.peak_bandwidth_gbps(cp)
    for s in GPU:
        run, c = decode("cuda", s), cost(s)
        with _bench.nvtx_range(_model.label(s)):
            ms = _bench.time_gpu(cp, run)
        r = _model.row(s, "measured", float(np.median(ms)) * 1e3, c, device=device)
        rows.append(r)
        table.append(_bench.summarize(_model.label(s), "v5", ms, c.min_bytes, peak) + (f"{r['tflops']:.1f}",))
    _bench.print_table(table, f"{device} (peak {peak or '?'} GB/s)", extra=("TFLOP/s",))
    _model.finish_measured("mla", rows, args.json, device=device)


if __name__ == "__main__":
    main()
