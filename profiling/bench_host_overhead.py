"""Per-call host overhead of the public ops: the Python an op runs around its kernel launches (argument
checks, planning, parameter packing), with the launches themselves stubbed out.

``KernelFamily.function`` is replaced by a stub that keeps its name check and returns one memoized
no-op kernel per name expression: nothing is compiled, looked up in a module or launched, so the
table is the op's own Python and excludes the launch (CuPy's argument packing and cuLaunchKernel on
a GPU, the whole kernel on the sim) and function()'s own memo lookup. Each op is called as a
serving loop calls it: caller-provided ``out=`` / ``workspace=`` / partial buffers, default
``validate`` (no content checks), warmed up first (memoized constants, the first call's one-time
work). Times are timeit loops (gc off) of ``--number`` calls, ``--reps`` calls in all (fewer, at
least 5 loops, where they would take more than ``--budget`` seconds); median and p20-p80 of the
loops' per-call means, in µs.

The arrays are numpy (the sim's host path) without a GPU and cupy with one (what gpu_check.sh
records): the paths differ in ``address()``, ``struct_arg``, uploads and allocations (guarded sim
memory takes ~0.3 ms per MB; CuPy's pool microseconds), so sim rows are a proxy for the GPU's.

Configs: a decode step of 64 sequences x 1,024 keys, 32/8 heads, head_size 128, block 16, fp16
(4,096 blocks); prefill / varlen: 8 sequences x 128 new tokens over 1,024 keys; MLA: 16 heads,
latent 576 = 512 + 64 rope, prefill q/k 192 and v 128; copy_blocks: 4 layers (8 caches: the decode
step's two, repeated), 8 pairs;
run_attention: the decode step with a plan made once outside the loop. mla_decode gets the
``workspace=`` where it takes one.

    python profiling/bench_host_overhead.py [--reps 2000] [--number 10] [--budget 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import sys
import timeit

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402
import _model  # noqa: E402

import cupaged  # noqa: E402
from cupaged import _runtime  # noqa: E402
from cupaged.paged_attention import workspace_bytes  # noqa: E402

B, H, KVH, D, BS, CTX = 64, 32, 8, 128, 16, 1024  # decode: seqs, heads, KV heads, head_size, block, keys
P, QLEN = 8, 128                                  # prefill: seqs, new tokens each
MLA_H, RANK, ROPE, MLA_QK, MLA_V = 16, 512, 64, 192, 128
BLOCKS = B * CTX // BS


class NoLaunch:
    """A compiled kernel's stand-in: takes a launch, counts it, runs nothing (attention.py sets the
    shared-memory attribute)."""

    max_dynamic_shared_size_bytes = 0

    def __init__(self):
        self.calls = 0

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls += 1


@contextlib.contextmanager
def no_launches():
    """KernelFamily.function stubbed for the duration; yields the {name: NoLaunch} it hands out."""
    kernels: dict[str, NoLaunch] = {}

    def function(family, name, xp):
        if name not in family.name_expressions:
            raise KeyError(f"{name!r} is not a name expression of kernels_cu/{family.stem}.cu")
        kernel = kernels.get(name)
        if kernel is None:
            kernel = kernels[name] = NoLaunch()
        return kernel

    real = _runtime.KernelFamily.function
    _runtime.KernelFamily.function = function
    try:
        yield kernels
    finally:
        _runtime.KernelFamily.function = real


def cases(xp):
    """(op, config, call) per measured op, arrays on ``xp``."""
    f16, i32 = np.float16, np.int32
    z = xp.zeros
    decode = f"b={B} ctx={CTX} h={H}/{KVH} d={D} bs={BS} fp16"
    prefill = f"b={P} q={QLEN} ctx={CTX} h={H}/{KVH} d={D} bs={BS} fp16"
    mla = f"b={B} ctx={CTX} h={MLA_H} latent={RANK}+{ROPE} bs={BS} fp16"

    q, out = z((B, H, D), f16), z((B, H, D), f16)
    k_cache, v_cache = z((BLOCKS, BS, KVH, D), f16), z((BLOCKS, BS, KVH, D), f16)
    k_vllm, v_vllm = z((BLOCKS, KVH, D // 8, BS, 8), f16), z((BLOCKS, KVH, D, BS), f16)
    mla_cache = z((BLOCKS, BS, RANK + ROPE), f16)
    tables = xp.arange(BLOCKS, dtype=i32).reshape(B, CTX // BS)
    seq_lens = xp.full((B,), CTX, i32)
    workspace = z((workspace_bytes(B, H, 8, RANK),), np.uint8)  # split partials of up to 8 splits, any op here
    key, value, slots = z((B, KVH, D), f16), z((B, KVH, D), f16), xp.arange(B, dtype=np.int64) * BS

    q_pre, out_pre = z((P * QLEN, H, D), f16), z((P * QLEN, H, D), f16)
    qsl = xp.arange(0, P * QLEN + 1, QLEN, dtype=i32)
    pre_tables, pre_lens = tables[:P], seq_lens[:P]
    k_dense, v_dense = z((P * CTX, KVH, D), f16), z((P * CTX, KVH, D), f16)
    cu_k = xp.arange(0, P * CTX + 1, CTX, dtype=i32)

    partitions = -(-CTX // cupaged.paged_attention_vllm.PARTITION_SIZE)
    exp_sums, max_logits = z((B, H, partitions), np.float32), z((B, H, partitions), np.float32)
    tmp_output = z((B, H, partitions, D), f16)

    latent_rows = z((P * CTX, RANK + ROPE), f16)
    token_to_seq = xp.repeat(xp.arange(P, dtype=i32), CTX)
    mla_q, mla_out = z((B, MLA_H, RANK + ROPE), f16), z((B, MLA_H, RANK), f16)
    kv_c, k_pe = z((B, RANK), f16), z((B, ROPE), f16)
    q_mla, k_new = z((P * QLEN, MLA_H, MLA_QK), f16), z((P * QLEN, MLA_H, MLA_QK), f16)
    v_new, out_mla = z((P * QLEN, MLA_H, MLA_V), f16), z((P * QLEN, MLA_H, MLA_V), f16)
    context = np.full(P, CTX - QLEN, np.int64)
    k_up, v_up = z((P * CTX, MLA_H, MLA_QK), f16), z((P * CTX, MLA_H, MLA_V), f16)
    latent_workspace = z((8192, RANK + ROPE), f16)
    takes_workspace = "workspace" in inspect.signature(cupaged.mla_decode).parameters
    mla_workspace = dict(workspace=workspace) if takes_workspace else {}

    def up_proj(latent):
        return k_up[:latent.shape[0]], v_up[:latent.shape[0]]

    suffix, lse = z((P * QLEN, H, D), f16), [z((H, P * QLEN), np.float32) for _ in range(3)]
    caches = [k_cache] * 4 + [v_cache] * 4
    mapping = xp.asarray(np.arange(16, dtype=np.int64).reshape(8, 2))
    kv = cupaged.KvView.paged(k_cache, v_cache, q)
    plan = cupaged.plan_attention(q, kv, tables, seq_lens)
    scale = 1 / math.sqrt(D)

    return [
        ("reshape_and_cache_flash", f"t={B} h={KVH} d={D} bs={BS} NHD fp16",
         lambda: cupaged.reshape_and_cache_flash(key, value, k_cache, v_cache, slots)),
        ("reshape_and_cache", f"t={B} h={KVH} d={D} bs={BS} vllm fp16",
         lambda: cupaged.reshape_and_cache(key, value, k_vllm, v_vllm, slots)),
        ("concat_and_cache_mla", f"t={B} latent={RANK}+{ROPE} bs={BS} fp16",
         lambda: cupaged.concat_and_cache_mla(kv_c, k_pe, mla_cache, slots)),
        ("gather_and_maybe_dequant_cache", f"b={P} t={P * CTX} row={RANK + ROPE} fp16",
         lambda: cupaged.gather_and_maybe_dequant_cache(mla_cache, latent_rows, pre_tables, cu_k, token_to_seq,
                                                        P * CTX)),
        ("cp_gather_cache", f"b={P} t={P * CTX} row={RANK + ROPE} fp16",
         lambda: cupaged.cp_gather_cache(mla_cache, latent_rows, pre_tables, cu_k, P)),
        ("copy_blocks", f"4 layers k+v, {mapping.shape[0]} pairs, block {BS}x{KVH}x{D} fp16",
         lambda: cupaged.copy_blocks(caches[:4], caches[4:], mapping)),
        ("paged_attention", f"decode {decode}",
         lambda: cupaged.paged_attention(q, k_cache, v_cache, tables, seq_lens, max_seq_len=CTX, out=out,
                                         workspace=workspace)),
        ("paged_attention", f"prefill {prefill}",
         lambda: cupaged.paged_attention(q_pre, k_cache, v_cache, pre_tables, pre_lens, qsl, max_query_len=QLEN,
                                         max_seq_len=CTX, out=out_pre, workspace=workspace)),
        ("paged_attention_v1", f"decode {decode} vllm",
         lambda: cupaged.paged_attention_v1(out, q, k_vllm, v_vllm, KVH, scale, tables, seq_lens, BS, CTX, None)),
        ("paged_attention_v2", f"decode {decode} vllm, {partitions} partitions",
         lambda: cupaged.paged_attention_v2(out, exp_sums, max_logits, tmp_output, q, k_vllm, v_vllm, KVH, scale,
                                            tables, seq_lens, BS, CTX, None)),
        ("varlen_attention", f"b={P} q={QLEN} k={CTX} h={H}/{KVH} d={D} fp16",
         lambda: cupaged.varlen_attention(q_pre, k_dense, v_dense, qsl, cu_k, max_seqlen_q=QLEN, max_seqlen_k=CTX,
                                          out=out_pre)),
        ("mla_decode", mla,
         lambda: cupaged.mla_decode(mla_q, mla_cache, tables, seq_lens, scale=1 / math.sqrt(MLA_QK),
                                    max_seq_len=CTX, out=mla_out, **mla_workspace)),
        ("mla_chunked_prefill", f"b={P} q={QLEN} ctx={CTX - QLEN} h={MLA_H} qk={MLA_QK} v={MLA_V} fp16, 1 chunk",
         lambda: cupaged.mla_chunked_prefill(q_mla, k_new, v_new, mla_cache, pre_tables, qsl, context, up_proj,
                                             workspace=latent_workspace, out=out_mla)),
        ("merge_attn_states", f"t={P * QLEN} h={H} d={D} fp16, output_lse",
         lambda: cupaged.merge_attn_states(out_pre, q_pre, lse[0], suffix, lse[1], lse[2])),
        ("run_attention", f"decode {decode}, plan made once",
         lambda: cupaged.run_attention(plan, q, kv, out, None, tables, seq_lens)),
    ]


def measure(call, reps: int, number: int, budget_s: float, warmup: int = 20) -> np.ndarray:
    """Per-call µs: the means of timeit loops of ``number`` calls, ``reps`` calls in all, or fewer loops
    (at least 5) when they would take longer than ``budget_s``."""
    for _ in range(warmup):
        call()
    timer = timeit.Timer(call)
    first = timer.timeit(number)
    loops = min(max(1, reps // number), max(5, int(budget_s / max(first, 1e-9))))
    return np.array([first, *timer.repeat(repeat=loops - 1, number=number)]) / number * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2000, help="timed calls per op (default 2000)")
    parser.add_argument("--number", type=int, default=10, help="calls per timeit loop (default 10)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per op at most (default 1: fewer "
                        "calls for the slow ones, at least 5 loops)")
    parser.add_argument("--json", metavar="FILE", help="write the rows to FILE ({'rows': [...]})")
    args = parser.parse_args(argv)
    cp = _bench.gpu()
    xp, backend = (np, "sim") if cp is None else (cp, "cupy")
    device = "sim" if cp is None else _bench.peak_bandwidth_gbps(cp)[0]
    rows = []
    with no_launches() as kernels:
        for op, config, call in cases(xp):
            with _bench.nvtx_range(f"{op} {config}"):
                us = measure(call, args.reps, args.number, args.budget)
            before = sum(k.calls for k in kernels.values())
            call()
            launches = sum(k.calls for k in kernels.values()) - before
            p20, p80 = np.percentile(us, [20, 80])
            rows.append(dict(op=op, config=config, backend=backend, source="host", launches=launches,
                             calls=len(us) * args.number, median_us=float(np.median(us)), p20_us=float(p20),
                             p80_us=float(p80)))
    head = ("op", "config", "launches", "calls", "median µs", "p20–p80 µs")
    lines = [(r["op"], r["config"], str(r["launches"]), str(r["calls"]), f"{r['median_us']:.1f}",
              f"{r['p20_us']:.1f}–{r['p80_us']:.1f}") for r in rows]
    widths = [max(len(x[i]) for x in lines + [head]) for i in range(len(head))]
    print(f"HOST OVERHEAD per call, {'numpy arrays on the sim' if cp is None else 'cupy arrays on ' + device}, "
          f"kernel launches stubbed: CPU time of the Python around them (timeit loops of {args.number} calls)")
    for x in [head] + lines:
        print(" | ".join(c.ljust(w) for c, w in zip(x, widths)))
    _model.write_json(args.json, rows, device=device, backend=backend, launches="stubbed")


if __name__ == "__main__":
    main()
