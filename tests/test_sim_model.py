"""The H200 model (cupaged/sim/model.py) on figures computed by hand from its documented formulas."""

from __future__ import annotations

import numpy as np
import pytest

from cupaged.sim import _launch_model, model
from cupaged.sim.model import H200, Terms


@pytest.mark.parametrize("registers, threads, smem, arch, expected", [
    (32, 128, 0, "sm_90", 16),            # threads: 2048 / 128
    (32, 32, 0, "sm_90", 32),             # the 32-CTA cap
    (144, 128, 0, "sm_90", 3),            # 144 regs -> 4608 per warp, 18432 per CTA: 65536 // 18432
    (255, 256, 0, "sm_90", 1),            # 255 -> 8192 per warp (256-register units), 65536 // 65536
    (32, 128, 100 * 1024, "sm_90", 2),    # 228 KiB // (100 KiB + 1 KiB reserved)
    (32, 128, 100 * 1024, "sm_80", 1),    # 164 KiB // 101 KiB
    (32, 128, 228 * 1024, "sm_90", 0),    # does not fit with the reservation
])
def test_ctas_per_sm(registers, threads, smem, arch, expected):
    assert model.ctas_per_sm(registers, threads, smem, arch) == expected


def _terms(**kw):
    base = dict(unique_bytes=0.0, bytes=0.0, inflight_bytes=0.0, wavefronts=0.0, mma_flops=0.0, cuda_core_flops=0.0)
    return Terms(**{**base, **kw})


def test_hbm_bound_full_waves():
    # 2 waves of 132 SMs x 2 CTAs, each CTA 1 MB unique with ample bytes in flight: 528 MB / 4.8 TB/s
    t = _terms(unique_bytes=1e6, bytes=1e6, inflight_bytes=64e3)
    us, bound, waves, terms = model.launch_time_us(t, 528, 2)
    assert waves == 2 and bound == "hbm"
    assert us == pytest.approx(2.0 + 528e6 / 4.8e12 * 1e6)
    assert terms["hbm"] == pytest.approx(110.0)


def test_littles_law_bounds_a_thin_pipeline():
    # 132 CTAs, one per SM, 2 KB in flight each: 132 * 2 KB / 0.8 µs = 337.92 GB/s < HBM
    t = _terms(unique_bytes=1e6, bytes=1e6, inflight_bytes=2048)
    us, bound, waves, terms = model.launch_time_us(t, 132, 1)
    assert bound == "latency" and waves == 1
    assert us == pytest.approx(2.0 + 132e6 / (132 * 2048 / 0.8e-6) * 1e6)
    assert H200.little_bytes_per_sm == pytest.approx(4.8e12 * 0.8e-6 / 132)  # ~29 KB


def test_tail_wave_and_compute_terms():
    # 140 CTAs at 1 per SM: a full wave of 132 and a tail of 8 (one per SM); each CTA 1.83e6 shared
    # wavefronts = 1 ms at 1.83 GHz, so 2 waves x 1000 µs; mma and fp32 terms per SM
    t = _terms(wavefronts=1.83e6)
    us, bound, waves, _ = model.launch_time_us(t, 140, 1)
    assert (waves, bound) == (2, "shared") and us == pytest.approx(2.0 + 2000.0)
    t = _terms(mma_flops=5e9 / 132 * 132)  # one CTA per SM: per-SM mma rate 660e12 / 132
    us, bound, _, _ = model.launch_time_us(t, 132, 1)
    assert bound == "mma" and us == pytest.approx(2.0 + 5e9 / (660e12 / 132) * 1e6)
    t = _terms(cuda_core_flops=1e6)
    us, bound, _, _ = model.launch_time_us(t, 264, 2)  # two CTAs stacked per SM
    assert bound == "fp32" and us == pytest.approx(2.0 + 2e6 / (2 * 128 * 1.83e9) * 1e6)


def test_empty_launch_costs_the_overhead():
    us, bound, waves, _ = model.launch_time_us(_terms(), 0, 4)
    assert (us, bound, waves) == (2.0, "launch", 0)


COPY = r"""
extern "C" __global__ void copy_f32(const float* src, float* dst, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i];
}
"""


def test_model_of_a_profiled_copy():
    # 132 CTAs x 128 threads, one float each: 512 B read + 512 B written per CTA, one 4-byte load in
    # flight per thread (512 B per CTA). One wave (a handful of registers: 16 CTAs/SM fit), one CTA per
    # SM: Little's law gives 132 x 512 B / 0.8 µs = 84.48 GB/s, so the latency term bounds:
    # 132 x 1024 B / 84.48 GB/s = 1.6 µs, plus the 2 µs launch.
    from cupaged import sim

    n = 132 * 128
    src = sim.asarray(np.arange(n, dtype=np.float32))
    dst = sim.zeros(n, np.float32)
    kernel = sim.RawModule(code=COPY).get_function("copy_f32")
    with sim.profile() as prof:
        kernel((132,), (128,), (src, dst, np.int32(n)))
    np.testing.assert_array_equal(dst, src)
    m = prof.launches[0].model
    assert (m.ctas, m.waves, m.bound, m.unique_bytes, m.bytes) == (132, 1, "latency", 2 * 4 * n, 2 * 4 * n)
    assert m.ctas_per_sm == 16 and m.min_bytes is None and m.traffic_ratio is None
    assert m.time_us == pytest.approx(2.0 + 1.6)
    projected = _launch_model.model_of(prof.launches[0], ctas=132 * 16 * 3)  # 3 full waves, 16 CTAs per SM
    assert (projected.waves, projected.bound) == (3, "latency")
    assert projected.time_us == pytest.approx(2.0 + 3 * 1024 * 132 * 16 / (512 * 16 * 132 / 0.8e-6) * 1e6)
    table = prof.table()
    assert "copy_f32" in table and "132×1×1 × 128×1×1" in table and "a proxy, not a measurement" in table


def test_a_profiled_decode_declares_its_minimum():
    # Decode of 3 sequences over a paged fp16 cache: the launch carries the op's declared minimum
    # (cupaged/_cost.py), and the kernel moves close to it (each K/V byte once, fp32 partials none).
    import cupaged
    from cupaged import sim
    from cupaged._cost import attention_cost

    rng = np.random.default_rng(1)
    kc = sim.asarray(rng.standard_normal((12, 16, 2, 64)).astype(np.float16))
    vc = sim.asarray(rng.standard_normal((12, 16, 2, 64)).astype(np.float16))
    q = rng.standard_normal((3, 8, 64)).astype(np.float16)
    tables = rng.permutation(12).astype(np.int32).reshape(3, 4)
    lens = np.array([64, 37, 50], np.int32)
    with sim.profile() as prof:
        cupaged.paged_attention(q, kc, vc, tables, lens, kv_split_size=64)
    launch = prof.launches[0]
    want = attention_cost(lens, [1, 1, 1], num_heads=8, num_kv_heads=2, head_size=64, v_head_size=64, kv_itemsize=2,
                          q_itemsize=2, out_itemsize=2, block_size=16, causal=True, query_start_loc=False)
    assert (launch.declared.op, launch.declared.min_bytes, launch.declared.flops) == ("decode", want.min_bytes, want.flops)
    kv = sum(launch.args[k].unique_bytes_read for k in ("key_cache", "value_cache"))
    assert kv == 2 * int(lens.sum()) * 2 * 64 * 2  # every visible K/V byte once, nothing past seq_len
    assert 1.0 <= launch.model.traffic_ratio < 1.1


SUM_ALL = r"""
extern "C" __global__ void sum_all(const float* src, float* dst, int n) {  // every CTA reads all of src
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += src[i];
  if (threadIdx.x == 0) dst[blockIdx.x] = s;  // (lane 0's share only: the traffic is what counts)
}
"""


def test_sampled_distinct_bytes_never_exceed_the_array():
    # 8 CTAs each read the same 1 KiB; profiled 2 of them (block_stride 4). Scaling the sample's
    # distinct bytes by 4 would claim 4 KiB read: capped at the array, 1 KiB (L2 serves the rest).
    from cupaged import sim

    src, dst = sim.asarray(np.ones(256, np.float32)), sim.zeros(8, np.float32)
    kernel = sim.RawModule(code=SUM_ALL).get_function("sum_all")
    with sim.profile(block_stride=(4, 1, 1)) as prof:
        kernel((8,), (32,), (src, dst, np.int32(256)))
    launch = prof.launches[0]
    assert (launch.ctas, launch.ctas_profiled, launch.args["src"].unique_bytes_read) == (8, 2, 1024)
    m = launch.model
    assert m.unique_bytes == 1024 + 8 * 4  # src once, 8 CTAs x 4 bytes of dst (scaled: distinct per CTA)
    assert m.bytes == 8 * 1024 + 8 * 4  # requested bytes do scale
