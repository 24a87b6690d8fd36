"""Where an attention launch's issue slots go, on the sim: warp instructions per source file and per 16-byte copy.

Runs one small paged-attention call (or MLA decode) under ``cupaged.sim.profile()`` and prints, for each launch,
the warp-level SASS instructions it issues on sm_90 (the model v2 count, cupaged/sim/profiler/_instructions.py)
split by the file each inlined line came from (the ``// ---- begin`` markers cupaged/_runtime.py writes), the
16-byte ``cp.async`` copies (LDGSTS) it ran, and the instructions per copy of the K/V pipeline
(kernels_cu/attention/kv_pipeline.cuh, issue and waits) and of the whole launch. Shapes are small (the count is
per CTA-work, not per production grid); ``--top N`` lists the N busiest lines.

    python profiling/issue_report.py decode --heads 32/8 --dtype fp16 --context 1024
    python profiling/issue_report.py prefill --heads 32/8 --dtype bf16 --context 512 --q-len 512
    python profiling/issue_report.py mla --heads 16 --context 1024
    python profiling/issue_report.py sass    # static: each hot kernel's sm_90 SASS (nvdisasm), per LDGSTS
"""

from __future__ import annotations

import argparse
import collections
import itertools
import re

import ml_dtypes
import numpy as np

import cupaged
from cupaged import sim
from cupaged.testing import paged_kv

DTYPES = {"fp16": (np.float16, "auto"), "bf16": (ml_dtypes.bfloat16, "auto"), "fp32": (np.float32, "auto"),
          "fp8_e4m3": (np.float16, "fp8_e4m3"), "fp8_bf16": (ml_dtypes.bfloat16, "fp8_e4m3")}
_MARK = re.compile(r"^// ---- (begin|end) (\S+)$")


def files_of(source: str) -> dict:
    """Line (1-based) of the inlined module source -> the file it came from (the innermost begin/end pair)."""
    stack, out = ["<kernel>"], {}
    for n, text in enumerate(source.splitlines(), 1):
        m = _MARK.match(text)
        if m and m.group(1) == "begin":
            stack.append(m.group(2))
        elif m:
            stack.pop()
        out[n] = stack[-1]
    return out


def run_attention(args):
    rng = np.random.default_rng(0)
    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    dtype, kv = DTYPES[args.dtype]
    seqs = [args.context] * args.batch
    cache = paged_kv(seqs, block_size=args.block_size, head_size=args.head_size, num_kv_heads=kv_heads,
                     dtype=dtype, kv_cache_dtype=kv, layout=args.layout, rng=rng, device="sim")
    tokens = args.q_len * args.batch
    q = sim.asarray(rng.standard_normal((tokens, heads, args.head_size)).astype(dtype))
    qsl = None if args.q_len == 1 else sim.asarray(np.arange(args.batch + 1, dtype=np.int32) * args.q_len)
    with sim.profile() as prof:
        cupaged.paged_attention(q, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, qsl,
                                kv_cache_dtype=kv, k_scale=cache.k_scale, v_scale=cache.v_scale,
                                layout=args.layout, kv_split_size=args.split, softcap=args.softcap,
                                alibi_slopes=np.linspace(0.1, 1, heads, dtype=np.float32) if args.alibi else None)
    return prof


def run_mla(args):
    rng = np.random.default_rng(0)
    rank, rope = 512, 64
    cache = paged_kv([args.context] * args.batch, block_size=args.block_size, head_size=rank + rope,
                     dtype=ml_dtypes.bfloat16, rng=rng, device="sim")
    q = sim.asarray(rng.standard_normal((args.batch, int(args.heads), rank + rope)).astype(ml_dtypes.bfloat16))
    with sim.profile() as prof:
        cupaged.mla_decode(q, cache.key_cache[:, :, 0], cache.block_tables, cache.seq_lens, kv_lora_rank=rank,
                           scale=0.1, kv_split_size=args.split)
    return prof


def report(prof, top: int) -> None:
    for launch in prof.launches:
        count = launch.instructions
        print(f"{launch.kernel}  grid {tuple(launch.grid)}")
        if count.warp_instructions is None:
            print(f"  not counted: {count.note}")
            continue
        files = files_of(launch.source)
        by_file = collections.Counter()
        for line, n in count.instructions_by_line.items():
            by_file[files.get(line, str(line).rsplit(":", 1)[0]) if isinstance(line, int) else "<header>"] += n
        total, copies = count.warp_instructions, count.by_opcode.get("LDGSTS", 0)
        print(f"  warp instructions {total:,}   16-byte copies (LDGSTS) {copies:,}   residual {count.residual:.3f}")
        for name, n in by_file.most_common():
            print(f"    {name:<28} {n:>12,}  {100 * n / total:5.1f}%")
        if copies:
            pipe = sum(n for f, n in by_file.items() if f.endswith("kv_pipeline.cuh"))
            print(f"  per copy: kv_pipeline.cuh {pipe / copies:.1f}, whole launch {total / copies:.1f}")
        mix = ", ".join(f"{k} {v:,}" for k, v in count.instruction_mix.items() if k != "total")
        print(f"  mix: {mix}")
        lines = launch.source.splitlines()
        for line, n in sorted(count.instructions_by_line.items(), key=lambda kv: -kv[1])[:top]:
            text = lines[line - 1].strip()[:90] if isinstance(line, int) else line
            print(f"    {n:>10,}  {files.get(line, '?') if isinstance(line, int) else ''}:{line}  {text}")


HOT = ("paged_decode_kernel<__half, cupaged::KV_AUTO, 128, false>",
       "paged_decode_mma_kernel<__half, cupaged::KV_AUTO, 128, false, false>",
       "paged_decode_mma_kernel<__half, cupaged::KV_E4M3, 128, false, false>",
       "paged_prefill_kernel<__nv_bfloat16, cupaged::KV_AUTO, 128, 128>",
       "paged_prefill_kernel<__nv_bfloat16, cupaged::KV_AUTO, 192, 128>",
       "mla_decode_kernel<__nv_bfloat16, cupaged::KV_AUTO, 1>")
_ELEMENTS = ("kv_copy_elems", "d[e] =", "(int e)")  # the element-by-element path's lines (unaligned views)


def static_report() -> None:
    """Each hot kernel's sm_90 SASS: instructions per file, and the copy code's (kernels_cu/attention/kv_pipeline.cuh,
    the element-by-element path left out) per LDGSTS: the static cost of a 16-byte copy, its tile bookkeeping
    included."""
    from cupaged._attention_kernels import FAMILY
    from cupaged.sim.profiler import _sass

    source = FAMILY.source
    files, lines = files_of(source), source.splitlines()
    for name in HOT:
        blocks = _sass.kernel_blocks(source, FAMILY.options, f"cupaged::{name}", "sm_90")
        by_file, copies, pipeline = collections.Counter(), 0, 0
        for block in blocks:
            for op, line in zip(block.opcodes, block.lines):
                where = files.get(line, "?") if isinstance(line, int) else "<other>"
                by_file[where] += 1
                copies += op.startswith("LDGSTS")
                if where.endswith("kv_pipeline.cuh") and not any(t in lines[line - 1] for t in _ELEMENTS):
                    pipeline += 1
        total = sum(by_file.values())
        gaps = sorted(b - a for block in blocks for a, b in itertools.pairwise(
            [i for i, op in enumerate(block.opcodes) if op.startswith("LDGSTS")]))
        steady = f"{gaps[0]} to {gaps[-1]}, median {gaps[len(gaps) // 2]}" if gaps else "- (no two in one block)"
        print(f"{name}: {total} SASS instructions, {copies} LDGSTS; kv_pipeline.cuh (vector paths) {pipeline} = "
              f"{pipeline / max(copies, 1):.1f} a copy; between consecutive copies of a block: {steady}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op", choices=("decode", "prefill", "mla", "sass"))
    ap.add_argument("--heads", default="32/8", help="q/kv heads (MLA: q heads)")
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--q-len", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layout", default="NHD")
    ap.add_argument("--split", type=int, default=None, help="kv_split_size")
    ap.add_argument("--softcap", type=float, default=None)
    ap.add_argument("--alibi", action="store_true")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    if args.op == "sass":
        return static_report()
    if args.op == "prefill" and args.q_len == 1:
        args.q_len = args.context
    report(run_mla(args) if args.op == "mla" else run_attention(args), args.top)


if __name__ == "__main__":
    main()
