"""The H200 model (cupaged/sim/model.py) on figures computed by hand from its documented formulas."""

from __future__ import annotations

import pytest

from cupaged.sim import model
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
