"""Benchmark of paged attention (kernels_cu/paged_attention.cu): decode and prefill.

GPU: CUDA events with L2 flushed between reps, NVTX ranges named by config; rows of µs, GB/s (the
op's declared minimum bytes, cupaged/_cost.py, / time), % of the H200 spec bandwidth and of the
device-to-device copy measured in the same run, TFLOP/s; model rows a ``--model`` run cached are
printed beside. ``--model`` (sim, no GPU): the H200 model projected to these production shapes
(profiling/_model.py): decode 64 x 4096 with 32/8 and 64/8 heads,
head 128, fp16 / bf16 / fp8_e4m3; decode 1 x 32768 32/8 fp16; prefill 8 x 2048 causal 32/8 bf16; varlen 4 x 4096
non-causal, 128 heads, QK 192 / V 128 bf16 (MLA prefill's shape); a mixed batch of 4 prefill chunks of 512 and 256
decode tokens (contexts 2048, 32/8 heads, bf16) beside its two halves alone; ``cascade_decode`` (64 requests
behind one 4096-token prompt, 256 own tokens each) and ``tree_verify`` (64 requests verifying 64-token draft trees
over 4096-token contexts), profiling/_serving_rows.py; then the prefill rows again on sm_90's route
(paged_prefill_sm90_kernel, rows with ``arch`` "sm_90": 8 x 2048 at head sizes 64, 128 and 256, varlen 192 / 128,
the mixed batch and its halves; the others are sm_80's route, the sim's default) (``--sweep`` adds decode contexts
512..16384 and prefill lengths 512 and 1024). On an sm_90 GPU the prefill rows are measured on both routes (the
device's and sm_80's, ``arch`` in each row). Without either: a
smoke run of tiny sizes on the sim (CPU timings of the simulator, not GPU timings).

    python profiling/bench_paged_attention.py [--json out.json] [--model [--sweep]] [--quick]
    nsys profile -t cuda,nvtx python profiling/bench_paged_attention.py --quick
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402
import _model  # noqa: E402
from _serving_rows import serving_rows  # noqa: E402

import cupaged  # noqa: E402
from cupaged.testing import paged_kv  # noqa: E402
from cupaged._attention_kernels import hopper_constants, prefill_shape  # noqa: E402
from cupaged._cost import attention_cost  # noqa: E402
from cupaged._plan import split_count  # noqa: E402
from cupaged.paged_attention import workspace_bytes  # noqa: E402

KV_HEADS, HEAD, BLOCK = 8, 128, 16
DTYPES = {"fp16": (np.float16, "auto"), "bf16": (ml_dtypes.bfloat16, "auto"), "fp8_e4m3": (np.float16, "fp8_e4m3"),
          "fp8": (np.float16, "fp8")}


def shape(op, batch, context, q_len, heads, kv_heads, head, kv_dtype, causal=True) -> dict:
    return dict(op=op, batch=batch, context=context, q_len=q_len, num_heads=heads, num_kv_heads=kv_heads,
                head_size=head, kv_dtype=kv_dtype, causal=causal)


def cost(s: dict):
    """The op's declared minimum bytes and FLOPs at shape ``s`` (cupaged/_cost.py)."""
    dtype, kv = DTYPES[s["kv_dtype"]]
    itemsize = np.dtype(dtype).itemsize
    return attention_cost(np.full(s["batch"], s["context"]), np.full(s["batch"], s["q_len"]),
                          num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"], head_size=s["head_size"],
                          v_head_size=s["head_size"], kv_itemsize=1 if kv != "auto" else itemsize,
                          query_start_loc=s["q_len"] > 1,
                          q_itemsize=itemsize, out_itemsize=itemsize, block_size=BLOCK, causal=s["causal"])


def setup(device, num_seqs, context, q_len, gqa, kv_dtype, kv_heads=KV_HEADS, head=HEAD, block=BLOCK,
          kv_split_size=None, workspace=False, arch=None):
    """A launch of ``num_seqs`` sequences of ``context`` tokens on ``device`` ("sim" or "cuda"): caches from
    cupaged.testing.paged_kv (shuffled blocks, a last block's unused slots poisoned; fp8 at scale 0.1).
    ``workspace``: the split partials live in one buffer across calls (a projection's warm-up run fills
    the partials of the CTAs its profiled run skips, so the merge reads real ones). ``arch``: the kernels of that
    architecture's plan (plan_attention(arch=...) and run_attention; None: paged_attention, the device's)."""
    rng = np.random.default_rng(0)
    dtype, kv_cache_dtype = DTYPES[kv_dtype]
    kv = paged_kv(np.full(num_seqs, context), block_size=block, head_size=head, num_kv_heads=kv_heads, dtype=dtype,
                  kv_cache_dtype=kv_cache_dtype, kv_scale=0.1, rng=rng, device=device)
    if device == "sim":
        xp = np
    else:
        import cupy as xp
    q = xp.asarray(rng.standard_normal((num_seqs * q_len, kv_heads * gqa, head), np.float32).astype(dtype))
    qsl = None if q_len == 1 else xp.asarray((np.arange(num_seqs + 1) * q_len).astype(np.int32))
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl)  # not kv: its host copy goes
    scales = dict(k_scale=kv.k_scale, v_scale=kv.v_scale)
    if workspace:
        splits = split_count(context, kv_split_size)
        scales["workspace"] = xp.zeros(workspace_bytes(num_seqs * q_len, kv_heads * gqa, splits, head), np.uint8)

    def run():
        cupaged.paged_attention(*args, kv_cache_dtype=kv_cache_dtype, **scales, max_query_len=q_len,
                                max_seq_len=context, kv_split_size=kv_split_size)

    if arch is None:
        return run
    view = cupaged.KvView.paged(kv.key_cache, kv.value_cache, q, kv_cache_dtype)
    plan = cupaged.plan_attention(q, view, *args[3:], max_query_len=q_len, max_seq_len=context,
                                  kv_split_size=kv_split_size, arch=arch)
    out = xp.empty((q.shape[0], q.shape[1], head), q.dtype)
    partials = None
    if plan.partial_shapes is not None:  # one set across calls, as the workspace above
        partials = tuple(xp.zeros(shape, np.float32) for shape in plan.partial_shapes)

    def run_plan():
        cupaged.run_attention(plan, q, view, out, None, *args[3:], k_scale=kv.k_scale, v_scale=kv.v_scale,
                              partials=partials)

    return run_plan


def production_plan(s: dict):
    """The AttentionPlan the full batch of shape ``s`` gets (shape-only stand-ins: the plan reads no contents)."""
    dtype, kv_cache_dtype = DTYPES[s["kv_dtype"]]
    q = np.empty((s["batch"] * s["q_len"], s["num_heads"], s["head_size"]), dtype)
    cache = np.empty((1, BLOCK, s["num_kv_heads"], s["head_size"]), np.uint8 if kv_cache_dtype != "auto" else dtype)
    kv = cupaged.KvView.paged(cache, cache, q, kv_cache_dtype)
    qsl = None if s["q_len"] == 1 else np.empty(s["batch"] + 1, np.int32)
    return cupaged.plan_attention(q, kv, np.empty((s["batch"], -(-s["context"] // BLOCK)), np.int32),
                                  np.empty(s["batch"], np.int32), qsl, max_query_len=s["q_len"],
                                  max_seq_len=s["context"])


def production_split(s: dict) -> int:
    """The kv_split_size the plan gives the full batch of shape ``s``, or the context when it does not split."""
    return production_plan(s).kv_split_size or s["context"]


def symmetric_stride(n: int, samples: int = 4) -> int:
    """The largest stride ``t`` whose sample 0, t, 2t, ... of ``n`` CTAs ends on the last ((n - 1) % t == 0) and
    takes at least ``samples`` (1: all ``n``). The sample is evenly spread and symmetric about the middle, so its mean
    of any work affine in the index, or alike over each pair it, n - 1 - it, is the grid's exactly: a causal prefill's
    row tile r of 32 tokens loads and multiplies r + 1 key tiles of 32 (of 16 tokens: r // 2 + 1, alike over pairs
    when n is even), plus the same fixed work each. A stride that stops short of the end instead takes the first CTA
    of every stratum, the heaviest row tile (the kernel runs them heaviest first): model v1's stride of 16 over 64
    tiles averaged 40 key tiles against a true 32.5."""
    return max((t for t in range(1, n) if (n - 1) % t == 0 and (n - 1) // t + 1 >= samples), default=1)


def block_stride(s: dict) -> tuple:
    """The CTAs a projection of shape ``s`` profiles (grid: x row tile + tiles x split, y kv heads, z sequences):
    one kv head (each does the same work), every sequence of the subset (one length: the same work), and every CTA
    along x (a decode's splits differ: a short last one, where their keys fall in the blocks), but for the row tiles
    of a prefill that does not split and fills every tile: a symmetric sample of them (:func:`symmetric_stride`)."""
    plan = production_plan(s)
    rows = s["q_len"] * (s["num_heads"] // s["num_kv_heads"])
    per_tile = (hopper_constants()["HP_ROWS"] if plan.arch == "sm_90"  # query rows a CTA
                else prefill_shape(s["head_size"], s["head_size"])[0])
    full = plan.max_splits == 1 and rows == plan.tiles * per_tile
    return symmetric_stride(plan.tiles) if full else 1, s["num_kv_heads"], 1


def project(s: dict, subset: int, stride=None) -> dict:
    """Model row of shape ``s``: its plan (the split the full batch gets) run on ``subset`` sequences, the CTAs of
    ``stride`` profiled (default :func:`block_stride`, unbiased)."""
    gqa = s["num_heads"] // s["num_kv_heads"]
    split = production_split(s)
    splits = split < s["context"]
    run = setup("sim", subset, s["context"], s["q_len"], gqa, s["kv_dtype"], s["num_kv_heads"], s["head_size"],
                kv_split_size=split, workspace=splits)
    return _model.project(s, run, cost(s), s["batch"] // subset, stride or block_stride(s), warm=splits)


MIXED = dict(chunks=4, chunk=512, decodes=256, context=2048, heads=32, kv_heads=8, kv_dtype="bf16")


def mixed_batches(m=MIXED) -> dict:
    """(q_lens, contexts) of the mixed batch and of its prefill and decode halves alone."""
    prefill = [m["chunk"]] * m["chunks"], [m["context"]] * m["chunks"]
    decode = [1] * m["decodes"], [m["context"]] * m["decodes"]
    return {"mixed": (prefill[0] + decode[0], prefill[1] + decode[1]), "prefill": prefill, "decode": decode}


def project_ragged(name: str, q_lens, contexts, m=MIXED) -> dict:
    """Model row of a ragged paged batch (every sequence given a query_start_loc run), run whole on the sim with the
    CTAs of one kv head profiled (every kv head does the same work)."""
    dtype, kv_cache_dtype = DTYPES[m["kv_dtype"]]
    rng = np.random.default_rng(0)
    kv = paged_kv(contexts, block_size=BLOCK, head_size=HEAD, num_kv_heads=m["kv_heads"], dtype=dtype, rng=rng)
    q = rng.standard_normal((sum(q_lens), m["heads"], HEAD), np.float32).astype(dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)

    def run():
        cupaged.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl,
                                max_query_len=max(q_lens), max_seq_len=max(contexts))

    s = shape(name, len(q_lens), max(contexts), max(q_lens), m["heads"], m["kv_heads"], HEAD, m["kv_dtype"])
    c = attention_cost(np.array(contexts), np.array(q_lens), num_heads=m["heads"], num_kv_heads=m["kv_heads"],
                       head_size=HEAD, v_head_size=HEAD, kv_itemsize=np.dtype(dtype).itemsize,
                       q_itemsize=np.dtype(dtype).itemsize, out_itemsize=np.dtype(dtype).itemsize, block_size=BLOCK,
                       causal=True)
    return _model.project(s, run, c, 1, (1, m["kv_heads"], 1))


def project_varlen(batch=4, length=4096, heads=128, qk=192, vd=128, subset_heads=8) -> dict:
    """Model row of varlen_attention (dense rows, non-causal, MLA prefill's 192 / 128): one sequence of ``length``
    with ``subset_heads`` heads run (every CTA does the same work), one CTA profiled, scaled to the batch's grid."""
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((length, subset_heads, qk), np.float32) * 0.3).astype(bf16)
    k = rng.standard_normal((length, subset_heads, qk), np.float32).astype(bf16)
    v = rng.standard_normal((length, subset_heads, vd), np.float32).astype(bf16)
    cu = np.array([0, length], np.int32)

    def run():
        cupaged.varlen_attention(q, k, v, cu, cu, causal=False, max_seqlen_q=length)

    s = dict(shape("varlen", batch, length, length, heads, heads, qk, "bf16", causal=False), v_head_size=vd)
    c = attention_cost(np.full(batch, length), np.full(batch, length), num_heads=heads, num_kv_heads=heads,
                       head_size=qk, v_head_size=vd, kv_itemsize=2, q_itemsize=2, out_itemsize=2, block_size=None,
                       causal=False)
    return _model.project(s, run, c, batch * heads // subset_heads, (length // 128, subset_heads, 1))


@contextlib.contextmanager
def sim_arch(arch: str):
    """Plans made on the sim for ``arch`` (CUPAGED_SIM_ARCH) inside the block."""
    old = os.environ.get("CUPAGED_SIM_ARCH")
    os.environ["CUPAGED_SIM_ARCH"] = arch
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUPAGED_SIM_ARCH")
        else:
            os.environ["CUPAGED_SIM_ARCH"] = old


def hopper_rows() -> list:
    """The prefill rows on sm_90's route (paged_prefill_sm90_kernel; ``arch`` "sm_90"): 8 x 2048 causal 32/8 bf16 at
    head sizes 64, 128 and 256, the varlen 192 / 128 row and the mixed batch beside its halves."""
    with sim_arch("sm_90"):
        rows = [project(dict(shape("prefill", 8, 2048, 2048, 32, 8, d, "bf16"), arch="sm_90"), 1)
                for d in (64, 128, 256)]
        rows.append(dict(project_varlen(), arch="sm_90"))
        rows += [dict(project_ragged(name, *batch), arch="sm_90") for name, batch in mixed_batches().items()]
    return rows


def model_rows(sweep: bool) -> list:
    rows = [project(*m) for m in model_shapes(sweep)]
    rows.append(project_varlen())
    rows += [project_ragged(name, *batch) for name, batch in mixed_batches().items()]
    decode = next((r for r in rows if (r["op"], r["batch"], r["context"], r["num_heads"], r["kv_dtype"]) ==
                   ("decode", 64, 4096, 32, "fp16")), None)
    return rows + hopper_rows() + serving_rows(decode)


def model_shapes(sweep: bool):
    """(shape, profiled sequences): of those, the CTAs :func:`block_stride` picks."""
    for heads, kv in itertools.product((32, 64), ("fp16", "bf16", "fp8_e4m3")):
        yield shape("decode", 64, 4096, 1, heads, 8, HEAD, kv), 2
    yield shape("decode", 1, 32768, 1, 32, 8, HEAD, "fp16"), 1  # all 99 splits of a kv head: +5 s on 2 cores
    yield shape("prefill", 8, 2048, 2048, 32, 8, HEAD, "bf16"), 1
    if sweep:
        for ctx, heads, kv in itertools.product((512, 1024, 2048, 8192, 16384), (32, 64), ("fp16", "fp8_e4m3")):
            yield shape("decode", 64, ctx, 1, heads, 8, HEAD, kv), 1
        for length in (512, 1024):  # 1024: 32 row tiles, 31 prime: all 32 (+11 s)
            yield shape("prefill", 8, length, length, 32, 8, HEAD, "bf16"), 1


def gpu_configs(quick):
    batches, contexts, gqas = ((1, 64), (4096,), (8,)) if quick else ((1, 8, 64, 256), (512, 4096, 32768), (1, 4, 8))
    for b, ctx, g, kv in itertools.product(batches, contexts, gqas, ("fp16", "fp8_e4m3")):
        yield shape("decode", b, ctx, 1, KV_HEADS * g, KV_HEADS, HEAD, kv)
    for chunk in (512, 2048):
        yield shape("prefill", 1, 2 * chunk, chunk, 4 * KV_HEADS, KV_HEADS, HEAD, "fp16")
    yield shape("prefill", 8, 2048, 2048, 32, 8, HEAD, "bf16")


def copy_bandwidth(cp, nbytes=1 << 30):
    src, dst = cp.ones(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
    ms = _bench.time_gpu(cp, lambda: dst.__setitem__(Ellipsis, src), reps=10, flush_bytes=1 << 20)
    return 2 * nbytes / (np.median(ms) * 1e-3) / 1e9


def measured_rows(cp, quick):
    device, peak = _bench.peak_bandwidth_gbps(cp)
    copy_gbps = copy_bandwidth(cp)
    free = cp.cuda.runtime.memGetInfo()[0]
    cc = str(cp.cuda.Device().compute_capability)
    sm90 = cc == "90"
    rows, table = [], []
    for s in gpu_configs(quick):
        c = cost(s)
        if c.min_bytes > 0.4 * free:
            continue
        # a prefill on sm_90 measures both routes: the device's (the Hopper kernel) and sm_80's (mma.sync)
        for arch in (None, "sm_80") if s["q_len"] > 1 and sm90 else (None,):
            run = setup("cuda", s["batch"], s["context"], s["q_len"], s["num_heads"] // s["num_kv_heads"],
                        s["kv_dtype"], arch=arch)
            label = _model.label(s) + (f" [{arch}]" if arch else "")
            with _bench.nvtx_range(label):
                ms = _bench.time_gpu(cp, run)
            r = _model.row(dict(s, arch=arch or f"sm_{cc}"), "measured", float(np.median(ms)) * 1e3, c,
                           device=device)
            r["pct_of_copy_bw"] = 100 * r["gbps"] / copy_gbps  # against this device's measured copy
            rows.append(r)
            table.append(_bench.summarize(label, "v5", ms, c.min_bytes, peak) +
                         (f"{r['pct_of_copy_bw']:.0f}%", f"{r['tflops']:.1f}"))
    _bench.print_table(table, f"{device}: spec {peak or '?'} GB/s, measured copy {copy_gbps:.0f} GB/s",
                       extra=("% of copy", "TFLOP/s"))
    return rows, dict(device=device, spec_gbps=peak, copy_gbps=copy_gbps)


def main(argv=None):
    parser = _model.bench_parser(__doc__)
    parser.add_argument("--sweep", action="store_true", help="with --model: decode contexts and prefill lengths too")
    parser.add_argument("--quick", action="store_true", help="GPU: a few configs only")
    args = parser.parse_args(argv)
    cp = _bench.gpu()
    if cp is not None:
        rows, meta = measured_rows(cp, args.quick)
        _model.finish_measured("paged_attention", rows, args.json, **meta)
    elif args.model:
        _model.finish_model("paged_attention", model_rows(args.sweep), args.json)
    else:
        table = []
        for s in (shape("decode", 4, 300, 1, 8, 2, 64, "fp16"), shape("decode", 4, 300, 1, 8, 2, 64, "fp8"),
                  shape("prefill", 1, 64, 32, 4, 2, 64, "fp16")):
            run = setup("sim", s["batch"], s["context"], s["q_len"], 4 if s["q_len"] == 1 else 2, s["kv_dtype"],
                        kv_heads=2, head=64)
            with _bench.nvtx_range(_model.label(s)):
                table.append(_bench.summarize(_model.label(s), "v5", _bench.time_cpu(run), cost(s).min_bytes, None))
        _bench.print_table(table, "SIM SMOKE RUN (no GPU): CPU timings of the simulator, not GPU timings")


if __name__ == "__main__":
    main()
