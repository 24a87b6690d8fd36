"""``python -m cupaged selftest``: compile every shipped kernel on the backend at hand (the sim
without a GPU), run each on a small random case against cupaged.reference, print one table.

Each kernel family contributes cases to CASES: a case takes (asarray, rng) and returns (error, bound)
of its worst element under the elementwise rule |got - ref| <= atol + rtol · |ref|
(cupaged.testing.compare): the case passes when error <= bound, i.e. when every element does. Rows
are printed as the cases finish (the first case of a family waits for its compile, announced on
stderr). Attention cases read poisoned caches built by cupaged.testing.paged_kv.
"""

from __future__ import annotations

import sys
import time

import ml_dtypes
import numpy as np

from cupaged import reference
from cupaged.attention import KvView, plan_attention, run_attention
from cupaged._backend import GpuUnavailableError, gpu_module, host_copy, is_host_array, require_gpu
from cupaged.merge_attn_states import merge_attn_states
from cupaged.mla import mla_decode
from cupaged.paged_attention import paged_attention
from cupaged.paged_attention_vllm import paged_attention_v1, paged_attention_v2
from cupaged.rope import RotaryEmbedding, rope_and_cache
from cupaged.testing import compare, paged_kv, tolerance
from cupaged.varlen_attention import varlen_attention
from cupaged.cache_gather import copy_blocks, cp_gather_cache, gather_and_maybe_dequant_cache
from cupaged.cache_ops import concat_and_cache_mla, reshape_and_cache, reshape_and_cache_flash
from cupaged.convert_fp8 import convert_fp8

__all__ = ["CASES", "run"]


def _worst(*checks):
    """(error, bound) of the element nearest (or furthest past) its bound over (got, ref, tolerance)
    checks; a tolerance is what cupaged.testing.compare takes, (0, 0) for exact (uint8 caches: codes)."""
    worst = max((compare(got, ref, tol) for got, ref, tol in checks), key=lambda c: c.ratio)
    return worst.error, worst.bound


EXACT = (0.0, 0.0)


def _kv(rng, tokens, heads, head_size, dtype):
    return (rng.standard_normal((tokens, heads, head_size)).astype(dtype),
            rng.standard_normal((tokens, heads, head_size)).astype(dtype))


def _slots(rng, tokens, slots_in_pool):
    slots = rng.permutation(slots_in_pool)[:tokens].astype(np.int64)
    slots[::6] = -1
    return slots


def _cache_dtype(dtype, kv_cache_dtype):
    return dtype if kv_cache_dtype == "auto" else np.uint8


def _flash(dtype, layout, kv_cache_dtype="auto"):
    def case(asarray, rng):
        tokens, heads, head_size, blocks, block_size = 37, 4, 80, 12, 5
        key, value = _kv(rng, tokens, heads, head_size, dtype)
        shape = (blocks, block_size, heads, head_size) if layout == "NHD" else (blocks, heads, block_size, head_size)
        cache = np.zeros(shape, _cache_dtype(dtype, kv_cache_dtype))
        slots = _slots(rng, tokens, blocks * block_size)
        kc, vc = asarray(cache), asarray(cache)
        reshape_and_cache_flash(asarray(key), asarray(value), kc, vc, asarray(slots), kv_cache_dtype, 0.05, 0.07,
                                layout=layout)
        rk, rv = reference.reshape_and_cache_flash(key, value, cache, cache, slots, kv_cache_dtype, 0.05, 0.07,
                                                   layout=layout)
        return _worst((kc, rk, EXACT), (vc, rv, EXACT))  # a copy / quantization must be exact
    return case


def _convert_fp8(dtype, kv_dtype):
    def case(asarray, rng):
        x = (40 * rng.standard_normal(97)).astype(dtype)  # past +-448 * 0.05: saturates
        codes, back = asarray(np.zeros(97, np.uint8)), asarray(np.zeros(97, dtype))
        convert_fp8(codes, asarray(x), 0.05, kv_dtype)
        convert_fp8(back, codes, 0.05, kv_dtype)
        ref = reference.convert_fp8(np.zeros(97, np.uint8), x, 0.05, kv_dtype)
        return _worst((codes, ref, EXACT), (back, reference.convert_fp8(x, ref, 0.05, kv_dtype), EXACT))
    return case


def _rope(dtype, kv_cache_dtype, neox):
    """rope_and_cache: q and k rotated in place (48 of 64 dims), the rotated k and v written into an NHD cache."""
    def case(asarray, rng):
        tokens, blocks, block_size = 37, 12, 5
        q, (k, v) = rng.standard_normal((tokens, 4, 64)).astype(dtype), _kv(rng, tokens, 2, 64, dtype)
        table, pos = RotaryEmbedding(64, is_neox_style=neox, rotary_dim=48).cos_sin_cache(512), rng.integers(0, 512, 37)
        cache, slots = np.zeros((blocks, block_size, 2, 64), _cache_dtype(dtype, kv_cache_dtype)), _slots(rng, 37, 60)
        dq, dk, kc, vc = asarray(q), asarray(k), asarray(cache), asarray(cache)
        rope_and_cache(dq, dk, asarray(v), asarray(pos), asarray(table), kc, vc, asarray(slots), kv_cache_dtype, 0.05,
                       0.07, is_neox_style=neox)
        rq, rk, _, rv = reference.rope.rope_and_cache(q, k, v, pos, table, cache, cache, slots, kv_cache_dtype, 0.05,
                                                      0.07, is_neox_style=neox)
        own, _ = reference.reshape_and_cache_flash(host_copy(dk), v, cache, cache, slots, kv_cache_dtype, 0.05, 0.07)
        return _worst((dq, rq, tolerance(dtype)), (dk, rk, tolerance(dtype)), (kc, own, EXACT), (vc, rv, EXACT))
    return case


def _rope_call(dtype):
    """RotaryEmbedding's in-place rotation, cos and sin computed in the kernel, YaRN's attention factor too."""
    def case(asarray, rng):
        yarn, rr = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, reference.rope
        q, k, pos = rng.standard_normal((37, 4, 64)).astype(dtype), rng.standard_normal((37, 2, 64)).astype(dtype), \
            rng.integers(0, 512, 37)
        dq, dk = asarray(q), asarray(k)
        RotaryEmbedding(64, rope_theta=1.5e5, scaling=yarn, max_position_embeddings=256)(asarray(pos), dq, dk)
        table = rr.cos_sin_cache(512, rr.inv_freq(64, 1.5e5, yarn, max_position_embeddings=256),
                                 rr.attention_factor(yarn, max_position_embeddings=256))
        tol = tolerance(dtype)
        return _worst((dq, rr.rotate(q, pos, table), tol), (dk, rr.rotate(k, pos, table), tol))
    return case


def _vllm(dtype, kv_cache_dtype):
    def case(asarray, rng):
        tokens, heads, head_size, blocks, block_size = 42, 8, 64, 8, 16
        x = 16 // np.dtype(_cache_dtype(dtype, kv_cache_dtype)).itemsize
        key, value = _kv(rng, tokens, heads, head_size, dtype)
        kc0 = np.zeros((blocks, heads, head_size // x, block_size, x), _cache_dtype(dtype, kv_cache_dtype))
        vc0 = np.zeros((blocks, heads, head_size, block_size), kc0.dtype)
        slots = _slots(rng, tokens, blocks * block_size)
        kc, vc = asarray(kc0), asarray(vc0)
        reshape_and_cache(asarray(key), asarray(value), kc, vc, asarray(slots), kv_cache_dtype, 0.05, 0.07)
        rk, rv = reference.reshape_and_cache(key, value, kc0, vc0, slots, kv_cache_dtype, 0.05, 0.07)
        return _worst((kc, rk, EXACT), (vc, rv, EXACT))
    return case


def _mla_write_and_gather(dtype, kv_cache_dtype):
    def case(asarray, rng):
        tokens, blocks, block_size = 40, 6, 16
        kv_c = rng.standard_normal((tokens, 512)).astype(dtype)
        k_pe = rng.standard_normal((tokens, 64)).astype(dtype)
        cache0 = np.zeros((blocks, block_size, 576), _cache_dtype(dtype, kv_cache_dtype))
        slots = np.arange(tokens, dtype=np.int64)
        cache = asarray(cache0)
        concat_and_cache_mla(asarray(kv_c), asarray(k_pe), cache, asarray(slots), kv_cache_dtype, 0.05)
        ref_cache = reference.concat_and_cache_mla(kv_c, k_pe, cache0, slots, kv_cache_dtype, 0.05)
        table = rng.permutation(blocks).astype(np.int32).reshape(2, 3)
        cu = np.array([0, 30, 45], np.int32)
        t2s = np.repeat(np.arange(2), [30, 15]).astype(np.int32)
        starts = np.array([2, 7], np.int32)
        dst0 = np.zeros((45, 576), dtype)
        dst = asarray(dst0)
        gather_and_maybe_dequant_cache(asarray(ref_cache), dst, asarray(table), asarray(cu), asarray(t2s), 45,
                                       kv_cache_dtype, 0.05, asarray(starts))
        ref_dst = reference.gather_and_maybe_dequant_cache(ref_cache, dst0, table, cu, t2s, 45, kv_cache_dtype, 0.05,
                                                           starts)
        return _worst((cache, ref_cache, EXACT), (dst, ref_dst, EXACT))
    return case


def _copy_and_cp_gather(asarray, rng):
    caches = [rng.standard_normal((20, 16, 2, 64)).astype(np.float16) for _ in range(2)]
    mapping = np.array([[0, 5], [7, 19], [3, 4]], np.int64)
    got = [asarray(c) for c in caches]
    copy_blocks(got[:1], got[1:], mapping)
    ref_k, ref_v = reference.copy_blocks(caches[:1], caches[1:], mapping)
    table = rng.permutation(20).astype(np.int32).reshape(4, 5)
    cu = np.array([0, 17, 17, 50, 51], np.int32)
    dst0 = np.zeros((51, 2, 64), np.float16)
    dst = asarray(dst0)
    cp_gather_cache(asarray(ref_k[0]), dst, asarray(table), asarray(cu), 4)
    ref_dst = reference.cp_gather_cache(ref_k[0], dst0, table, cu, 4)
    return _worst((got[0], ref_k[0], EXACT), (got[1], ref_v[0], EXACT), (dst, ref_dst, EXACT))


def _paged_pool(rng, seqs, heads, head_size, dtype, kv_cache_dtype="auto", layout="NHD"):
    """q and poisoned caches holding each sequence's keys at shuffled blocks (block size 16), the table's
    tail other sequences' blocks, fp8 at scale 0.05 (cupaged.testing.paged_kv)."""
    kv = paged_kv([s for _, s in seqs], block_size=16, head_size=head_size, num_kv_heads=heads[1], dtype=dtype,
                  layout=layout, kv_cache_dtype=kv_cache_dtype, kv_scale=0.05, spare_blocks=3, spare_columns=1,
                  table_tail="other_blocks", rng=rng)
    q = rng.standard_normal((sum(ql for ql, _ in seqs), heads[0], head_size)).astype(dtype)
    return q, kv


def _attention(dtype, kv_cache_dtype="auto", heads=(8, 2), **options):
    """A decode token, a 6-token run (both decode kernels' q_len <= 16: GQA 8 takes paged_decode_mma_kernel) and
    a 20-token run (paged_prefill_kernel for 16-bit q; float32 takes paged_decode_kernel for every run)."""
    def case(asarray, rng):
        seqs = ((1, 300), (6, 40), (20, 20))
        q, kv = _paged_pool(rng, seqs, heads, 80, dtype, kv_cache_dtype)
        k, v, table, seq_lens, scale = kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, kv.k_scale
        qsl = np.array([0, 1, 7, 27], np.int32)
        opts = dict(options)
        split = opts.pop("kv_split_size", None)
        if opts.pop("sinks", False):
            opts["sinks"] = rng.uniform(0, 2, heads[0]).astype(np.float32)
        if opts.pop("tree", False):  # causal, each run's own keys dropped at random below the diagonal (a tree's)
            rows = [np.tri(n, s, s - n, dtype=bool) & ((np.arange(s) < s - n) | np.eye(n, s, s - n, dtype=bool)
                                                        | (rng.random((n, s)) < 0.5)) for n, s in seqs]
            opts["custom_mask"] = np.concatenate([r.ravel() for r in rows])
        dev_opts = {k: asarray(x) if is_host_array(x) else x for k, x in opts.items()}
        out, lse = paged_attention(asarray(q), asarray(k), asarray(v), asarray(table), asarray(seq_lens), asarray(qsl),
                                   kv_cache_dtype=kv_cache_dtype, k_scale=scale, v_scale=scale, return_lse=True,
                                   kv_split_size=split, **dev_opts)
        ref_out, ref_lse = reference.paged_attention(q, k, v, table, seq_lens, qsl, kv_cache_dtype=kv_cache_dtype,
                                                     k_scale=scale, v_scale=scale, **opts)
        return _worst((out, ref_out, tolerance(dtype, kv_cache_dtype)), (lse, ref_lse, "lse"))
    return case


def _hopper(dtype, kv_cache_dtype="auto"):
    """The Hopper prefill (paged_prefill_sm90_kernel): a plan made for sm_90 on the sim; on a GPU the device's own
    plan, which is that kernel's on sm_90 (sm_90a code loads nowhere else)."""
    def case(asarray, rng):
        seqs = ((1, 300), (70, 90), (20, 20))
        q, kv = _paged_pool(rng, seqs, (8, 2), 128, dtype, kv_cache_dtype)
        qsl = np.array([0, 1, 71, 91], np.int32)
        dq, table, seq_lens, starts = (asarray(x) for x in (q, kv.block_tables, kv.seq_lens, qsl))
        view = KvView.paged(asarray(kv.key_cache), asarray(kv.value_cache), dq, kv_cache_dtype)
        plan = plan_attention(dq, view, table, seq_lens, starts, arch="sm_90" if is_host_array(dq) else None)
        out, lse = asarray(np.zeros(q.shape, q.dtype)), asarray(np.zeros((8, q.shape[0]), np.float32))
        run_attention(plan, dq, view, out, lse, table, seq_lens, starts, k_scale=kv.k_scale, v_scale=kv.v_scale)
        ref_out, ref_lse = reference.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                                     qsl, kv_cache_dtype=kv_cache_dtype, k_scale=kv.k_scale,
                                                     v_scale=kv.v_scale)
        return _worst((out, ref_out, tolerance(dtype, kv_cache_dtype)), (lse, ref_lse, "lse"))
    return case


def _vllm_attention(version):
    def case(asarray, rng):
        seqs = ((1, 700), (1, 33), (1, 1))
        q, pool = _paged_pool(rng, seqs, (8, 2), 64, np.float16, layout="vllm")
        kv, vv, table, seq_lens = pool.key_cache, pool.value_cache, pool.block_tables, pool.seq_lens
        out = asarray(np.zeros(q.shape, np.float16))
        args = (asarray(q), asarray(kv), asarray(vv), 2, 0.125, asarray(table), asarray(seq_lens), 16, 700, None)
        if version == 1:
            paged_attention_v1(out, *args)
        else:
            parts = [asarray(np.zeros((3, 8, 2), np.float32)) for _ in range(2)]
            paged_attention_v2(out, *parts, asarray(np.zeros((3, 8, 2, 64), np.float16)), *args)
        ref = reference.paged_attention_v1(q, kv, vv, 2, 0.125, table, seq_lens)
        return _worst((out, ref, np.float16))
    return case


def _merge(dtype):
    def case(asarray, rng):
        tokens, heads, head_size, with_context = 37, 4, 80, 30
        po, so = (rng.standard_normal((tokens, heads, head_size)).astype(dtype) for _ in range(2))
        pl, sl = (rng.uniform(-4, 4, (heads, tokens)).astype(np.float32) for _ in range(2))
        pl[0, 3] = sl[1, 5] = np.inf  # FA2's empty rows count as -inf
        pl[2, 7] = sl[2, 7] = -np.inf  # both sides empty: the prefix output, LSE -inf
        out, out_lse = asarray(np.zeros_like(po)), asarray(np.zeros((heads, tokens), np.float32))
        merge_attn_states(out, asarray(po), asarray(pl), asarray(so), asarray(sl), out_lse, with_context)
        ref, ref_lse = reference.merge_attn_states(po, pl, so, sl, with_context)
        return _worst((out, ref, dtype), (out_lse, ref_lse, "lse"))  # an infinite LSE must match exactly
    return case


def _varlen(dtype, causal):
    def case(asarray, rng):
        cq, ck = np.array([0, 1, 18, 21], np.int32), np.array([0, 1, 18, 40], np.int32)
        q = rng.standard_normal((21, 8, 192)).astype(dtype)
        k = rng.standard_normal((40, 2, 192)).astype(dtype)
        v = rng.standard_normal((40, 2, 128)).astype(dtype)
        out, lse = varlen_attention(asarray(q), asarray(k), asarray(v), asarray(cq), asarray(ck), causal=causal,
                                    return_lse=True)
        ref, ref_lse = reference.varlen_attention(q, k, v, cq, ck, causal=causal)
        return _worst((out, ref, tolerance(dtype)), (lse, ref_lse, "lse"))
    return case


def _mla(dtype, kv_cache_dtype, heads=32):
    """mla_decode_kernel: 32 heads take a CTA of 32 heads (256 threads), 16 one of 16."""
    def case(asarray, rng):
        q, kv = _paged_pool(rng, ((1, 300), (1, 17), (1, 0)), (heads, 1), 576, dtype, kv_cache_dtype, layout="mla")
        cache, table, seq_lens = kv.key_cache, kv.block_tables, kv.seq_lens
        out = mla_decode(asarray(q), asarray(cache), asarray(table), asarray(seq_lens), scale=0.04,
                         kv_cache_dtype=kv_cache_dtype, k_scale=kv.k_scale, kv_split_size=128)
        ref, _ = reference.mla_decode(q, cache, table, seq_lens, scale=0.04, kv_cache_dtype=kv_cache_dtype,
                                      k_scale=kv.k_scale)
        return _worst((out, ref, tolerance(dtype, kv_cache_dtype)))
    return case


_DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16)
CASES = {
    **{f"reshape_and_cache_flash {np.dtype(dt).name} {layout}": _flash(dt, layout)
       for dt in _DTYPES for layout in ("NHD", "HND")},
    **{f"reshape_and_cache_flash {np.dtype(dt).name} {kv}": _flash(dt, "NHD", kv)
       for dt in (np.float16, ml_dtypes.bfloat16) for kv in ("fp8", "fp8_e5m2")},
    **{f"reshape_and_cache {np.dtype(dt).name} {kv}": _vllm(dt, kv) for dt in _DTYPES for kv in ("auto", "fp8")},
    **{f"concat_and_cache_mla + gather {np.dtype(dt).name} {kv}": _mla_write_and_gather(dt, kv)
       for dt in (np.float16, ml_dtypes.bfloat16) for kv in ("auto", "fp8")},
    "copy_blocks + cp_gather_cache float16": _copy_and_cp_gather,
    **{f"convert_fp8 {np.dtype(dt).name} {kv}": _convert_fp8(dt, kv)
       for dt, kv in ((np.float32, "fp8"), (ml_dtypes.bfloat16, "fp8_e5m2"))},
    **{f"rope_and_cache {np.dtype(dt).name} {kv} {'neox' if neox else 'gptj'}": _rope(dt, kv, neox)
       for dt, kv, neox in ((np.float32, "auto", True), (ml_dtypes.bfloat16, "auto", False), (np.float16, "fp8", True))},
    "RotaryEmbedding yarn bfloat16 (cos / sin in the kernel)": _rope_call(ml_dtypes.bfloat16),
    **{f"paged_attention {np.dtype(dt).name}": _attention(dt) for dt in _DTYPES},
    "paged_attention bfloat16 window+sinks+softcap": _attention(ml_dtypes.bfloat16, sliding_window=16, sinks=True,
                                                                softcap=30.0),
    "paged_attention float16 fp8 split-KV ALiBi": _attention(np.float16, "fp8", kv_split_size=64,
                                                             alibi_slopes=np.linspace(0.1, 0.8, 8, dtype=np.float32)),
    "paged_attention bfloat16 GQA 8 fp8_e5m2 sinks (tensor cores)": _attention(ml_dtypes.bfloat16, "fp8_e5m2",
                                                                             heads=(16, 2), sinks=True),
    "paged_attention float16 GQA 8 tree mask (tensor cores)": _attention(np.float16, heads=(8, 1), tree=True),
    "paged_attention float16 window_size (24, 4) non-causal": _attention(np.float16, causal=False,
                                                                         window_size=(24, 4)),
    "paged_attention bfloat16 sm_90 plan (Hopper prefill)": _hopper(ml_dtypes.bfloat16),
    "paged_attention float16 fp8 sm_90 plan (Hopper prefill)": _hopper(np.float16, "fp8"),
    "paged_attention_v1 float16": _vllm_attention(1),
    "paged_attention_v2 float16": _vllm_attention(2),
    **{f"merge_attn_states {np.dtype(dt).name}": _merge(dt) for dt in _DTYPES},
    "varlen_attention float16 192/128 causal": _varlen(np.float16, True),
    "varlen_attention bfloat16 192/128 non-causal": _varlen(ml_dtypes.bfloat16, False),
    "mla_decode bfloat16": _mla(ml_dtypes.bfloat16, "auto"),
    "mla_decode bfloat16 16 heads": _mla(ml_dtypes.bfloat16, "auto", heads=16),
    "mla_decode float16 fp8 split-KV": _mla(np.float16, "fp8"),
}


def _backend(backend: str | None):
    """(name, asarray) for ``backend``: "sim"; "cuda" (GpuUnavailableError when cupy cannot use the GPU,
    never a quiet fall-back to the sim); None: the GPU when usable, else the sim (cupy installed but
    unusable warns with the cause)."""
    from cupaged import sim

    if backend == "sim":
        return "sim", sim.asarray
    cupy = require_gpu() if backend == "cuda" else gpu_module()
    return ("cuda", cupy.asarray) if cupy is not None else ("sim", sim.asarray)


def run(backend: str | None = None, out=None) -> int:
    out = out or sys.stdout
    try:
        name, asarray = _backend(backend)
    except GpuUnavailableError as e:
        print(f"selftest: --backend cuda cannot use the GPU: {e}", file=sys.stderr)
        return 2
    head = ("kernel", "backend", "max abs error", "tolerance", "ok")
    widths = (max(map(len, [head[0], *CASES])), max(len(head[1]), len(name)), len(head[2]), len(head[3]))

    def row(cells):  # printed as each case finishes: the columns are fixed up front
        print(" | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " | " + cells[4], file=out, flush=True)

    row(head)
    failed = 0
    start = time.perf_counter()
    for label, case in CASES.items():
        try:
            err, tol = case(asarray, np.random.default_rng(0))
            ok = err <= tol
            row((label, name, f"{err:.3g}", f"{tol:.3g}", "ok" if ok else "FAIL"))
        except Exception as e:  # report every kernel, then fail
            ok = False
            row((label, name, "-", "-", f"ERROR {type(e).__name__}: {e}"))
        failed += not ok
    print(f"{len(CASES) - failed} of {len(CASES)} kernels ok on {name} in {time.perf_counter() - start:.1f} s", file=out)
    return 1 if failed else 0
