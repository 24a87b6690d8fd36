"""``python -m cupaged selftest``: compile every shipped kernel on the backend at hand (the sim
without a GPU), run each on a small random case against cupaged.reference, print one table.

Each kernel family contributes cases to CASES: a case takes (xp, asarray, rng) and returns
(max abs error, tolerance) for one small problem.
"""

from __future__ import annotations

import sys
import time

import ml_dtypes
import numpy as np

from cupaged import reference
from cupaged.cache_ops import reshape_and_cache_flash

__all__ = ["CASES", "run"]


def _to_numpy(a):
    return a if isinstance(a, np.ndarray) else a.get()


def _cache_flash(dtype, layout):
    def case(asarray, rng):
        tokens, heads, head_size, blocks, block_size = 37, 4, 80, 12, 5
        key = rng.standard_normal((tokens, heads, head_size)).astype(dtype)
        value = rng.standard_normal((tokens, heads, head_size)).astype(dtype)
        shape = (blocks, block_size, heads, head_size) if layout == "NHD" else (blocks, heads, block_size, head_size)
        cache = np.full(shape, np.nan, dtype)
        slots = rng.permutation(blocks * block_size)[:tokens].astype(np.int64)
        slots[::6] = -1
        kc, vc = asarray(cache), asarray(cache)
        reshape_and_cache_flash(asarray(key), asarray(value), kc, vc, asarray(slots), layout=layout)
        rk, rv = reference.reshape_and_cache_flash(key, value, cache, cache, slots, layout=layout)
        err = 0.0
        for got, ref in ((kc, rk), (vc, rv)):
            got = _to_numpy(got).astype(np.float64)
            ref = ref.astype(np.float64)
            if not np.array_equal(np.isnan(got), np.isnan(ref)):
                return float("inf"), 0.0
            err = max(err, float(np.nanmax(np.abs(got - ref), initial=0.0)))
        return err, 0.0  # a copy must be exact
    return case


CASES = {
    f"reshape_and_cache_flash {np.dtype(dt).name} {layout}": _cache_flash(dt, layout)
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16) for layout in ("NHD", "HND")
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


def run(backend: str | None = None, out=sys.stdout) -> int:
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
