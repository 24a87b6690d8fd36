"""Benchmark of paged attention (kernels_cu/paged_attention.cu): decode and prefill.

Decode: batch 1/8/64/256 x context 512/4k/32k x GQA 1/4/8 x head 128 x fp16/fp8 caches, 8 KV heads.
Prefill: chunks of 512 and 2k new tokens over an equal cached prefix. GPU: CUDA events with L2 flushed
between reps, NVTX ranges named by config; prints µs, achieved GB/s (K/V bytes read / time), % of
the device's spec bandwidth and of the device-to-device copy bandwidth measured in the same run,
TFLOP/s for prefill; ``--json FILE`` writes every row. Goal on H100/H200: decode >= 80% of spec
bandwidth whenever a call reads >= 256 MB of K/V. Sim (no GPU): a smoke run with tiny sizes.

    python profiling/bench_paged_attention.py [--json out.json] [--quick]
    nsys profile -t cuda,nvtx python profiling/bench_paged_attention.py --quick
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

import cupaged  # noqa: E402
from cupaged import sim  # noqa: E402

KV_HEADS, HEAD, BLOCK = 8, 128, 16


def setup(xp, alloc, num_seqs, context, q_len, gqa, kv_cache_dtype, kv_heads=KV_HEADS, head=HEAD, block=BLOCK):
    rng = np.random.default_rng(0)
    blocks_per_seq = -(-context // block)
    num_blocks = num_seqs * blocks_per_seq
    cache_dtype = np.float16 if kv_cache_dtype == "auto" else np.uint8
    kc, vc = alloc((num_blocks, block, kv_heads, head), cache_dtype), alloc((num_blocks, block, kv_heads, head), cache_dtype)
    for c in (kc, vc):  # fp8 codes 0..99 are small positive e4m3 values
        c[...] = xp.asarray(rng.integers(0, 100, c.shape).astype(np.uint8) if cache_dtype == np.uint8
                            else (rng.standard_normal(c.shape) * 0.1).astype(np.float16))
    tables = xp.asarray(rng.permutation(num_blocks).astype(np.int32).reshape(num_seqs, blocks_per_seq))
    seq_lens = xp.asarray(np.full(num_seqs, context, np.int32))
    q = xp.asarray(rng.standard_normal((num_seqs * q_len, kv_heads * gqa, head)).astype(np.float16))
    qsl = None if q_len == 1 else xp.asarray((np.arange(num_seqs + 1) * q_len).astype(np.int32))
    kv_bytes = 2 * num_seqs * context * kv_heads * head * np.dtype(cache_dtype).itemsize
    causal_pairs = num_seqs * kv_heads * gqa * (q_len * context - q_len * (q_len - 1) / 2)
    flops = 4 * head * causal_pairs

    def run():
        cupaged.paged_attention(q, kc, vc, tables, seq_lens, qsl, kv_cache_dtype=kv_cache_dtype, k_scale=0.01,
                                v_scale=0.01, max_query_len=q_len, max_seq_len=context)

    return run, kv_bytes, flops


def configs(quick):
    batches, contexts, gqas = ((1, 64), (4096,), (8,)) if quick else ((1, 8, 64, 256), (512, 4096, 32768), (1, 4, 8))
    for b, ctx, g, kv in itertools.product(batches, contexts, gqas, ("auto", "fp8")):
        yield f"decode b={b} ctx={ctx} gqa={g} d={HEAD} {kv}", (b, ctx, 1, g, kv)
    for chunk in (512, 2048):
        yield f"prefill chunk={chunk} prefix={chunk} gqa=4 d={HEAD} auto", (1, 2 * chunk, chunk, 4, "auto")


def copy_bandwidth(cp, nbytes=1 << 30):
    src, dst = cp.ones(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
    ms = _bench.time_gpu(cp, lambda: dst.__setitem__(Ellipsis, src), reps=10, flush_bytes=1 << 20)
    return 2 * nbytes / (np.median(ms) * 1e-3) / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write every row to this file")
    parser.add_argument("--quick", action="store_true", help="a few configs only")
    args = parser.parse_args(argv)
    cp = _bench.gpu()
    rows, records = [], []
    if cp is None:
        for label, cfg in (("decode b=4 ctx=300 gqa=4 d=64 auto", (4, 300, 1, 4, "auto")),
                           ("decode b=4 ctx=300 gqa=4 d=64 fp8", (4, 300, 1, 4, "fp8")),
                           ("prefill chunk=32 prefix=32 gqa=2 d=64 auto", (1, 64, 32, 2, "auto"))):
            run, kv_bytes, flops = setup(np, sim.empty, *cfg, kv_heads=2, head=64)
            with _bench.nvtx_range(label):
                rows.append(_bench.summarize(label, "v1", _bench.time_cpu(run), kv_bytes, None))
        _bench.print_table(rows, "SIM SMOKE RUN (no GPU): CPU timings of the simulator, not GPU timings")
        return
    device, peak = _bench.peak_bandwidth_gbps(cp)
    copy_gbps = copy_bandwidth(cp)
    free = cp.cuda.runtime.memGetInfo()[0]
    for label, cfg in configs(args.quick):
        b, ctx, q_len, g, kv = cfg
        if 2 * b * ctx * KV_HEADS * HEAD * 2 > 0.4 * free:
            continue
        run, kv_bytes, flops = setup(cp, cp.empty, *cfg)
        with _bench.nvtx_range(label):
            ms = _bench.time_gpu(cp, run)
        row = _bench.summarize(label, "v1", ms, kv_bytes, peak)
        med_s = float(np.median(ms)) * 1e-3
        tflops = flops / med_s / 1e12
        rows.append(row + (f"{100 * kv_bytes / med_s / 1e9 / copy_gbps:.0f}%", f"{tflops:.1f}"))
        records.append(dict(config=label, median_us=med_s * 1e6, kv_bytes=kv_bytes, gbps=kv_bytes / med_s / 1e9,
                            pct_spec=None if not peak else 100 * kv_bytes / med_s / 1e9 / peak,
                            pct_copy=100 * kv_bytes / med_s / 1e9 / copy_gbps, tflops=tflops))
    _bench.print_table(rows, f"{device}: spec {peak or '?'} GB/s, measured copy {copy_gbps:.0f} GB/s",
                       extra=("% of copy", "TFLOP/s"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, spec_gbps=peak, copy_gbps=copy_gbps, rows=records), f, indent=1)


if __name__ == "__main__":
    main()
