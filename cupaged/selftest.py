"""``python -m cupaged selftest``: compile every shipped kernel on the backend at hand (the sim
without a GPU), run each on a small random case against cupaged.reference, print one table.

Each kernel family contributes cases to CASES: a case takes (asarray, rng) and returns
(max abs error, tolerance) for one small problem.
"""

from __future__ import annotations

import sys
import time

import ml_dtypes
import numpy as np

from cupaged import reference
from cupaged.cache_gather import copy_blocks, cp_gather_cache, gather_and_maybe_dequant_cache
from cupaged.cache_ops import concat_and_cache_mla, reshape_and_cache, reshape_and_cache_flash

__all__ = ["CASES", "run"]


def _to_numpy(a):
    return a if isinstance(a, np.ndarray) else a.get()


def _max_err(pairs) -> float:
    """Max |got - ref| over (got, ref) pairs; inf when NaN positions differ (uint8 caches compare as codes)."""
    err = 0.0
    for got, ref in pairs:
        got, ref = _to_numpy(got).astype(np.float64), np.asarray(ref).astype(np.float64)
        if got.shape != ref.shape or not np.array_equal(np.isnan(got), np.isnan(ref)):
            return float("inf")
        err = max(err, float(np.nanmax(np.abs(got - ref), initial=0.0)))
    return err


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
        return _max_err([(kc, rk), (vc, rv)]), 0.0  # a copy / quantization must be exact
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
        return _max_err([(kc, rk), (vc, rv)]), 0.0
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
        return _max_err([(cache, ref_cache), (dst, ref_dst)]), 0.0
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
    return _max_err([(got[0], ref_k[0]), (got[1], ref_v[0]), (dst, ref_dst)]), 0.0


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
}


def _backend():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cuda", cupy.asarray
    except Exception:  # no cupy / driver / device: the sim it is
        pass
    from cupaged import sim

    return "sim", sim.asarray


def run(backend: str | None = None, out=None) -> int:
    out = out or sys.stdout
    name, asarray = _backend()
    if backend == "sim":
        from cupaged import sim

        name, asarray = "sim", sim.asarray
    elif backend == "cuda" and name != "cuda":
        print("selftest: --backend cuda needs cupy and a GPU", file=sys.stderr)
        return 2
    rows, failed = [], 0
    start = time.perf_counter()
    for label, case in CASES.items():
        try:
            err, tol = case(asarray, np.random.default_rng(0))
            ok = err <= tol
            rows.append((label, name, f"{err:.3g}", f"{tol:.3g}", "ok" if ok else "FAIL"))
        except Exception as e:  # report every kernel, then fail
            ok = False
            rows.append((label, name, "-", "-", f"ERROR {type(e).__name__}: {e}"))
        failed += not ok
    head = ("kernel", "backend", "max abs error", "tolerance", "ok")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    for r in [head] + rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)) + " | " + r[4], file=out)
    print(f"{len(rows) - failed} of {len(rows)} kernels ok on {name} in {time.perf_counter() - start:.1f} s", file=out)
    return 1 if failed else 0
