"""A few small kernel launches on the GPU for profiling/gpu_check.sh's ncu and compute-sanitizer
phases: paged-attention decode and prefill (fp16, 8/2 heads, head 128, block 16, over poisoned caches; "prefill"
takes the device's route, paged_prefill_sm90_kernel on sm_90, "prefill80" sm_80's mma.sync kernel through
plan_attention(arch="sm_80")), reshape_and_cache_flash and merge_attn_states, each checked against
cupaged.reference.

    python profiling/gpu_check_kernels.py [decode] [prefill] [prefill80] [flash] [merge]   # default: all five

CuPy's memory pool is switched off, so every array is its own cudaMalloc and memcheck sees an access
past its end. Exit 0 when every result is within tolerance, 1 otherwise, 2 without a GPU.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def main(argv=None) -> int:
    names = list(argv if argv is not None else sys.argv[1:]) or ["decode", "prefill", "prefill80", "flash", "merge"]
    if os.environ.get("GPU_CHECK_KERNELS_SIM") == "1":  # tests/test_gpu_check.py: the same cases on the sim
        from cupaged import sim

        dev, sync = sim.asarray, lambda: None
    else:
        from cupaged._backend import GpuUnavailableError, require_gpu

        try:
            cupy = require_gpu()  # the package's one probe: names the cause, driver and extra
        except GpuUnavailableError as e:
            print(f"gpu_check_kernels: {e}", file=sys.stderr)
            return 2
        cupy.cuda.set_allocator(None)  # no pool: memcheck bounds each array on its own
        dev, sync = cupy.asarray, cupy.cuda.Device().synchronize
    import cupaged
    from cupaged import reference
    from cupaged.cache_ops import reshape_and_cache_flash
    from cupaged.merge_attn_states import merge_attn_states
    from cupaged.paged_attention import paged_attention
    from cupaged.testing import compare, paged_kv, tolerance

    rng = np.random.default_rng(0)

    def attention(seqs, decode, arch=None):
        kv = paged_kv([s for _, s in seqs], block_size=16, head_size=128, num_kv_heads=2, dtype=np.float16,
                      spare_blocks=2, spare_columns=1, table_tail="other_blocks", rng=rng)
        q = rng.standard_normal((sum(ql for ql, _ in seqs), 8, 128)).astype(np.float16)
        qsl = None if decode else np.cumsum([0] + [ql for ql, _ in seqs]).astype(np.int32)
        args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
        if arch is None:
            out = paged_attention(*map(dev, args), None if qsl is None else dev(qsl))
        else:  # that architecture's plan
            dq, dk, dv, dt, ds = map(dev, args)
            view = cupaged.KvView.paged(dk, dv, dq)
            plan = cupaged.plan_attention(dq, view, dt, ds, dev(qsl), arch=arch)
            out = dev(np.zeros_like(q))
            cupaged.run_attention(plan, dq, view, out, None, dt, ds, dev(qsl))
        ref, _ = reference.paged_attention(*args, qsl)
        return [(out, ref, tolerance(np.float16))]

    def flash():
        key, value = (rng.standard_normal((37, 2, 128)).astype(np.float16) for _ in range(2))
        cache = np.zeros((12, 16, 2, 128), np.float16)
        slots = rng.permutation(12 * 16)[:37].astype(np.int64)
        slots[::6] = -1
        kc, vc = dev(cache), dev(cache)
        reshape_and_cache_flash(dev(key), dev(value), kc, vc, dev(slots))
        rk, rv = reference.reshape_and_cache_flash(key, value, cache, cache, slots)
        return [(kc, rk, (0.0, 0.0)), (vc, rv, (0.0, 0.0))]

    def merge():
        po, so = (rng.standard_normal((37, 4, 128)).astype(np.float16) for _ in range(2))
        pl, sl = (rng.uniform(-4, 4, (4, 37)).astype(np.float32) for _ in range(2))
        out, out_lse = dev(np.zeros_like(po)), dev(np.zeros((4, 37), np.float32))
        merge_attn_states(out, dev(po), dev(pl), dev(so), dev(sl), out_lse)
        ref, ref_lse = reference.merge_attn_states(po, pl, so, sl)
        return [(out, ref, np.float16), (out_lse, ref_lse, "lse")]

    cases = {"decode": lambda: attention(((1, 300), (1, 33), (1, 1)), True),
             "prefill": lambda: attention(((16, 40), (20, 20)), False),
             "prefill80": lambda: attention(((16, 40), (20, 20)), False, "sm_80"),
             "flash": flash, "merge": merge}
    failed = 0
    for name in names:
        try:
            checks = cases[name]()
            sync()
            worst = max((compare(got, want, tol) for got, want, tol in checks), key=lambda c: c.ratio)
            ok = worst.error <= worst.bound
            print(f"{name}: {'ok' if ok else 'FAIL'} (max error {worst.error:.3g}, bound {worst.bound:.3g})", flush=True)
        except Exception as e:  # report every case, then fail
            ok = False
            print(f"{name}: ERROR {type(e).__name__}: {e}", flush=True)
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
