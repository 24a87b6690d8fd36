"""The H200 model (cupaged/sim/model.py) on figures computed by hand from its documented formulas."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from cupaged.sim import model
from cupaged.sim.profiler import _launch_model
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
    base = dict(unique_bytes=0.0, bytes=0.0, inflight_bytes=0.0, wavefronts=0.0, mma_flops=0.0, warp_instructions=0.0,
                mufu_instructions=0.0)
    return Terms(**{**base, **kw})


def test_hbm_bound_full_waves():
    # 2 waves of 132 SMs x 2 CTAs, each CTA 1 MB unique with ample bytes in flight: 528 MB / 4.3 TB/s
    t = _terms(unique_bytes=1e6, bytes=1e6, inflight_bytes=64e3)
    us, bound, waves, terms = model.launch_time_us(t, 528, 2)
    assert waves == 2 and bound == "hbm"
    assert us == pytest.approx(2.0 + 528e6 / 4.3e12 * 1e6)
    assert terms["hbm"] == pytest.approx(528e6 / 4.3e12 * 1e6)  # ~122.8 µs
    assert model.TERM_NAMES == ("hbm", "latency", "shared", "mma", "issue", "mufu")
    assert tuple(terms) == model.TERM_NAMES + model.MMA_PARTS == model.TERM_NAMES + ("mma_hmma", "mma_gmma",
                                                                                     "mma_gmma_fp8")


def test_littles_law_bounds_a_thin_pipeline():
    # 132 CTAs, one per SM, 2 KB in flight each: 132 * 2 KB / 0.8 µs = 337.92 GB/s < 4.3 TB/s
    t = _terms(unique_bytes=1e6, bytes=1e6, inflight_bytes=2048)
    us, bound, waves, terms = model.launch_time_us(t, 132, 1)
    assert bound == "latency" and waves == 1
    assert us == pytest.approx(2.0 + 132e6 / (132 * 2048 / 0.8e-6) * 1e6)
    assert H200.little_bytes_per_sm == pytest.approx(4.3e12 * 0.8e-6 / 132)  # ~26 KB


def test_issue_bound():
    # 132 CTAs, one per SM, each issuing 1e6 warp instructions: 4 schedulers at 1.83 GHz,
    # 1e6 / (4 x 1.83e9) s = 136.6 µs; two CTAs stacked per SM (264 at 2 per SM) take twice that
    t = _terms(unique_bytes=1e3, bytes=1e3, inflight_bytes=1e3, warp_instructions=1e6)
    us, bound, waves, terms = model.launch_time_us(t, 132, 1)
    assert (bound, waves) == ("issue", 1)
    assert terms["issue"] == pytest.approx(1e6 / (4 * 1.83e9) * 1e6) and us == pytest.approx(2.0 + terms["issue"])
    us, bound, _, _ = model.launch_time_us(t, 264, 2)
    assert bound == "issue" and us == pytest.approx(2.0 + 2e6 / (4 * 1.83e9) * 1e6)


def test_mufu_bound():
    # 264 CTAs at 2 per SM, each 1e5 warp instructions, all MUFU (exp2): per SM 2e5 MUFU warp
    # instructions x 32 lanes / 16 lanes per clock = 4e5 clocks = 218.6 µs; issue is 2e5 / 4 clocks
    t = _terms(warp_instructions=1e5, mufu_instructions=1e5)
    us, bound, _, terms = model.launch_time_us(t, 264, 2)
    assert bound == "mufu" and us == pytest.approx(2.0 + 2e5 * 2 / 1.83e9 * 1e6)
    assert terms["issue"] == pytest.approx(2e5 / (4 * 1.83e9) * 1e6)


def test_hbm_term_is_the_unique_bytes_with_a_partial_wave():
    # 300 CTAs at 1 per SM: waves of 132, 132 and 36. HBM is device-wide: 300 x 1 MB / 4.3 TB/s,
    # however the waves split them. The partial wave's 36 CTAs keep 36 x 2 KB in flight, so each
    # streams its 1 MB at 2 KB per 0.8 µs like a full wave's: 3 waves x 390.6 µs of latency.
    t = _terms(unique_bytes=1e6, bytes=1e6, inflight_bytes=2048)
    us, bound, waves, terms = model.launch_time_us(t, 300, 1)
    assert terms["hbm"] == pytest.approx(300e6 / 4.3e12 * 1e6, rel=1e-12)
    assert (waves, bound) == (3, "latency")
    assert terms["latency"] == pytest.approx(3 * 1e6 * 0.8e-6 / 2048 * 1e6)
    assert us == pytest.approx(2.0 + terms["latency"])


@pytest.mark.parametrize("ctas, per_sm, busiest", [
    (140, 1, [1, 1]),     # a full wave of 132 and a tail of 8, one per SM
    (400, 2, [2, 2]),     # 264 + 136: the tail's 136 CTAs over 132 SMs put 2 on the busiest
    (628, 4, [4, 1]),     # 528 + 100: one CTA on each of 100 SMs
    (50, 4, [1]),         # a lone partial wave
])
def test_tail_wave_is_its_busiest_sm(ctas, per_sm, busiest):
    # each CTA: 1.83e6 shared wavefronts (1 ms at 1.83 GHz), 1e6 warp instructions (136.6 µs),
    # 1e3 MUFU ones (1.1 µs), 1e9 mma FLOPs (200 µs at 660 TFLOP/s / 132 SMs); each wave's per-SM
    # terms are its busiest SM's CTAs times those
    t = _terms(wavefronts=1.83e6, warp_instructions=1e6, mufu_instructions=1e3, mma_flops=1e9)
    us, bound, waves, terms = model.launch_time_us(t, ctas, per_sm)
    assert (waves, bound) == (len(busiest), "shared")
    assert us == pytest.approx(2.0 + sum(busiest) * 1000.0)
    assert terms["issue"] == pytest.approx(sum(busiest) * 1e6 / (4 * 1.83e9) * 1e6)
    assert terms["mufu"] == pytest.approx(sum(busiest) * 1e3 * 2 / 1.83e9 * 1e6)
    assert terms["mma"] == pytest.approx(sum(busiest) * 1e9 / (660e12 / 132) * 1e6)


def test_mma_bound():
    t = _terms(mma_flops=5e9 / 132 * 132)  # one CTA per SM: per-SM mma rate 660e12 / 132
    us, bound, _, _ = model.launch_time_us(t, 132, 1)
    assert bound == "mma" and us == pytest.approx(2.0 + 5e9 / (660e12 / 132) * 1e6)


def test_tensor_core_peaks():
    # H100 / H200 SXM dense peaks: wgmma 989 TFLOP/s with 16-bit inputs, 1979 with fp8; mma.sync 2/3 of 989
    assert (H200.mma_flops_per_s, H200.gmma_flops_per_s, H200.gmma_fp8_flops_per_s) == (660e12, 989e12, 1979e12)


@pytest.mark.parametrize("ctas, per_sm, busiest", [(132, 1, 1), (264, 2, 2), (140, 1, 2)])
def test_mma_term_sums_each_kind_at_its_peak(ctas, per_sm, busiest):
    # Per CTA 1e9 mma.sync FLOPs (HMMA: 1e9 / (660e12 / 132) s = 200 µs), 2e9 wgmma bf16 (HGMMA: 2e9 / (989e12 /
    # 132) = 266.94 µs) and 4e9 wgmma fp8 (QGMMA: 4e9 / (1979e12 / 132) = 266.80 µs): the mma term is their sum,
    # 733.74 µs per CTA on the busiest SM (2 stacked: twice that; 140 at 1 per SM: two waves of one each).
    t = _terms(mma_flops=1e9, gmma_flops=2e9, gmma_fp8_flops=4e9, warp_instructions=1e3, bytes=1e3)
    us, bound, waves, terms = model.launch_time_us(t, ctas, per_sm)
    parts = {"mma_hmma": 1e9 / (660e12 / 132) * 1e6, "mma_gmma": 2e9 / (989e12 / 132) * 1e6,
             "mma_gmma_fp8": 4e9 / (1979e12 / 132) * 1e6}
    for name, one in parts.items():
        assert terms[name] == pytest.approx(busiest * one)
    assert terms["mma"] == pytest.approx(busiest * sum(parts.values())) == pytest.approx(busiest * 733.74, rel=1e-4)
    assert bound == "mma" and us == pytest.approx(2.0 + terms["mma"])


def test_a_part_of_mma_never_bounds_alone():
    # wgmma fp8 work alone: mma and mma_gmma_fp8 are equal, and the bound is the term, not its part
    us, bound, _, terms = model.launch_time_us(_terms(gmma_fp8_flops=1979e12 / 132 * 1e-4), 132, 1)
    assert terms["mma"] == terms["mma_gmma_fp8"] == pytest.approx(100.0) and terms["mma_hmma"] == 0.0
    assert bound == "mma" and us == pytest.approx(102.0)


def test_empty_launch_costs_the_overhead():
    us, bound, waves, _ = model.launch_time_us(_terms(), 0, 4)
    assert (us, bound, waves) == (2.0, "launch", 0)


COPY = r"""
extern "C" __global__ void copy_f32(const float* src, float* dst, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i];
}
"""


@pytest.fixture(scope="module")
def copy_profile():
    """132 CTAs x 128 threads of COPY, one float each, profiled."""
    from cupaged import sim

    n = 132 * 128
    src = sim.asarray(np.arange(n, dtype=np.float32))
    dst = sim.zeros(n, np.float32)
    kernel = sim.RawModule(code=COPY).get_function("copy_f32")
    with sim.profile() as prof:
        kernel((132,), (128,), (src, dst, np.int32(n)))
    np.testing.assert_array_equal(dst, src)
    return prof


def test_model_of_a_profiled_copy(copy_profile):
    # 512 B read + 512 B written per CTA, one 4-byte load in flight per thread (512 B per CTA). One
    # wave (a handful of registers: 16 CTAs/SM fit), one CTA per SM: Little's law gives 132 x 512 B /
    # 0.8 µs = 84.48 GB/s, so the latency term bounds: 132 x 1024 B / 84.48 GB/s = 1.6 µs, plus the
    # 2 µs launch. A few instructions per warp, 4 warps per SM: nanoseconds of issue.
    n = 132 * 128
    launch = copy_profile.launches[0]
    m = launch.model
    assert (m.ctas, m.waves, m.bound, m.unique_bytes, m.bytes) == (132, 1, "latency", 2 * 4 * n, 2 * 4 * n)
    assert m.ctas_per_sm == 16 and m.min_bytes is None and m.traffic_ratio is None
    assert m.time_us == pytest.approx(2.0 + 1.6)
    assert m.terms_us["hbm"] == pytest.approx(2 * 4 * n / 4.3e12 * 1e6)
    counted = getattr(launch, "warp_instructions", None)
    assert m.warp_instructions == counted
    assert m.terms_us["issue"] == pytest.approx((counted or 0) / 132 / (4 * 1.83e9) * 1e6)
    projected = _launch_model.model_of(launch, ctas=132 * 16 * 3)  # 3 full waves, 16 CTAs per SM
    assert (projected.waves, projected.bound) == (3, "latency")
    assert projected.time_us == pytest.approx(2.0 + 3 * 1024 * 132 * 16 / (512 * 16 * 132 / 0.8e-6) * 1e6)
    table = copy_profile.table()
    assert "copy_f32" in table and "132×1×1 × 128×1×1" in table and "a proxy, not a measurement" in table
    assert "issue µs" in table and "| bound" in table and "4.3 TB/s" in table and "4.8 TB/s" in table


def _with_counts(launch, **counts):
    """``launch`` with instruction counts set by hand (read by the model like the profiler's own)."""
    fields = {f.name: getattr(launch, f.name) for f in dataclasses.fields(launch)}
    ns = types.SimpleNamespace(**{**fields, **counts})
    ns.model = _launch_model.model_of(ns)
    return ns


def test_model_of_counted_instructions(copy_profile):
    # The copy's 132 CTAs made to issue 1e6 warp instructions each, 2,000 of them MUFU: one CTA per
    # SM, issue = 1e6 / (4 x 1.83e9) s = 136.6 µs bounds (over 1.6 µs of latency); mufu = 2,000 x 32
    # / 16 clocks = 2.19 µs. Projected to 3 waves of 16 CTAs per SM: 48 CTAs per SM, 48 x that issue.
    mix = dict(total=132 * 10**6, mma=0, fp32=132 * 10**5, mufu=132 * 2000, memory=132 * 10**5, int_control=0)
    mix["int_control"] = mix["total"] - sum(v for k, v in mix.items() if k != "total")
    launch = _with_counts(copy_profile.launches[0], warp_instructions=132 * 10**6, instruction_mix=mix)
    m = launch.model
    assert (m.bound, m.warp_instructions, m.instruction_mix) == ("issue", 132 * 10**6, mix)
    assert m.terms_us["issue"] == pytest.approx(1e6 / (4 * 1.83e9) * 1e6)
    assert m.terms_us["mufu"] == pytest.approx(2000 * 32 / 16 / 1.83e9 * 1e6)
    assert m.time_us == pytest.approx(2.0 + 1e6 / (4 * 1.83e9) * 1e6)
    ctas = 132 * 16 * 3
    projected = _launch_model.model_of(launch, ctas=ctas)
    assert (projected.bound, projected.warp_instructions) == ("issue", ctas * 10**6)
    assert projected.instruction_mix == {k: v * ctas // 132 for k, v in mix.items()}
    assert projected.time_us == pytest.approx(2.0 + 48 * 1e6 / (4 * 1.83e9) * 1e6)
    table = _launch_model.table([launch])
    assert f"| {m.terms_us['issue']:.1f} " in table and "| issue " in table and "not counted" not in table


def test_model_of_gmma_flops(copy_profile):
    # The copy's launch (132 CTAs, one per SM) made to do tensor-core work, as the profiler records it for the
    # whole launch: 132 x 1e9 mma.sync FLOPs, 132 x 3e9 wgmma bf16, 132 x 6e9 wgmma fp8. Per SM: 1e9 / 5e12 s
    # = 200 µs of HMMA, 3e9 / (989e12 / 132) = 400.4 µs of HGMMA, 6e9 / (1979e12 / 132) = 400.2 µs of QGMMA.
    launch = _with_counts(copy_profile.launches[0], mma_flops=132 * 10**9, gmma_flops=132 * 3 * 10**9,
                          gmma_fp8_flops=132 * 6 * 10**9)
    m = launch.model
    want = {"mma_hmma": 1e9 / (660e12 / 132) * 1e6, "mma_gmma": 3e9 / (989e12 / 132) * 1e6,
            "mma_gmma_fp8": 6e9 / (1979e12 / 132) * 1e6}
    assert {k: m.terms_us[k] for k in want} == pytest.approx(want)
    assert m.bound == "mma" and m.terms_us["mma"] == pytest.approx(sum(want.values()))
    assert m.time_us == pytest.approx(2.0 + sum(want.values()))
    assert tuple(m.terms_us) == model.TERM_NAMES + model.MMA_PARTS  # a bench row's terms_us gains keys only
    projected = _launch_model.model_of(launch, ctas=132 * 2)  # twice the CTAs, one wave (16 per SM fit)
    assert projected.terms_us["mma_gmma"] == pytest.approx(2 * want["mma_gmma"])
    older = types.SimpleNamespace(**{k: v for k, v in vars(launch).items() if k not in ("gmma_flops",
                                                                                       "gmma_fp8_flops")})
    assert _launch_model.model_of(older).terms_us["mma"] == pytest.approx(want["mma_hmma"])  # a record without them


def test_uncounted_instructions_say_why(copy_profile):
    note = "nvdisasm not found: install the [profiling] extra"
    launch = _with_counts(copy_profile.launches[0], warp_instructions=None, instruction_mix=None,
                          instructions_note=note)
    m = launch.model
    assert (m.warp_instructions, m.instruction_mix, m.terms_us["issue"], m.terms_us["mufu"]) == (None, None, 0.0, 0.0)
    assert m.bound == "latency" and m.time_us == pytest.approx(2.0 + 1.6)
    table = _launch_model.table([launch])
    assert f"Instructions not counted ({note}): the issue and mufu terms are 0 for copy_f32." in table


def test_pct_of_achievable_and_peak_bandwidth():
    # 1 GB declared moved in 250 µs + 2 µs: 3.968 TB/s, 82.7% of 4.8 TB/s, 92.3% of 4.3 TB/s
    m = _launch_model.LaunchModel(252.0, "hbm", 1, 132, 1, 32, 0, 10**9, 10**9, 10**9, None, 1.0, 0, 0, {}, None, None)
    assert m.pct_of_peak_bw == pytest.approx(100 * 1e9 / 252e-6 / 4.8e12)
    assert m.pct_of_achievable_bw == pytest.approx(100 * 1e9 / 252e-6 / 4.3e12) == m.pct_of_copy_bw


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
