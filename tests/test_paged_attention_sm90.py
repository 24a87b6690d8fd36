"""The Hopper route (kernels_cu/paged_attention_sm90.cu: paged_prefill_sm90_kernel) against the float64 reference:
the prefill cases of test_paged_attention.py's covering set, test_varlen_attention.py's grid, understated hints and
tree masks, run through plans
made for sm_90 (CUPAGED_SIM_ARCH=sm_90 on the sim; on a GPU, device 0 must be an sm_90 one), plus the routing itself:
plan_attention(arch=...) picks paged_prefill_sm90_kernel on sm_90 and paged_prefill_kernel elsewhere, and a plan of
either runs on the sim. By default natural and one random order run (reverse under -m slow; tests/conftest.py marks
them); CI's sim-mode passes run them in natural order.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import KvView, reference
from cupaged._attention_kernels import kernel_constants
from cupaged.testing import assert_close, tolerance
from tests import test_attention_hints as hints
from tests import test_custom_mask as masks
from tests import test_paged_attention as paged
from tests import test_varlen_attention as varlen

PD_MAX_Q = kernel_constants()["PD_MAX_Q"]  # longer runs of 16-bit q take the prefill kernel
PREFILL = [c for c in paged.COVERING if c.dtype != paged.F32 and any(q > PD_MAX_Q for q, _ in c.seqs)]


@pytest.fixture(autouse=True)
def sm90(request, monkeypatch):
    """Plans made for sm_90: the sim's by CUPAGED_SIM_ARCH, a GPU's only when it is one."""
    monkeypatch.setenv("CUPAGED_SIM_ARCH", "sm_90")
    backend = request.getfixturevalue("backend") if "backend" in request.fixturenames else None
    if backend is not None and backend.name == "cuda":
        import cupy

        cc = str(cupy.cuda.Device(0).compute_capability)
        if cc != "90":
            pytest.skip(f"no GPU of compute capability 9.0 for the Hopper route: device 0 is sm_{cc}")


@pytest.mark.parametrize("case", PREFILL, ids=[c.id() for c in PREFILL])
def test_covering_set(backend, case):
    paged.check(backend, case)


test_varlen_against_reference = varlen.test_varlen_against_reference
test_hints_out_and_scale = varlen.test_hints_out_and_scale
test_strided_q_and_out_views = paged.test_strided_q_and_out_views
test_split_and_no_split_agree = paged.test_split_and_no_split_agree
# a CTA's later row tiles (rows past the hint) run on through the ring; the prefill kernel alone taking every run
test_paged_attention_understated_hints_still_right = hints.test_paged_attention_understated_hints_still_right
test_paged_attention_min_query_len_drops_the_decode_launch_and_never_a_row = \
    hints.test_paged_attention_min_query_len_drops_the_decode_launch_and_never_a_row
test_tree_masks_match_the_reference = masks.test_tree_masks_match_the_reference


def _dense(lens_q, lens_k, heads=(8, 2), d=128, dtype=ml_dtypes.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = (rng.standard_normal((cq[-1], heads[0], d)) * 0.7).astype(dtype)
    k = rng.standard_normal((ck[-1], heads[1], d)).astype(dtype)
    v = rng.standard_normal((ck[-1], heads[1], d)).astype(dtype)
    return q, k, v, cq, ck


@pytest.mark.parametrize("arch, kernel, threads", [
    ("sm_90", "paged_prefill_sm90_kernel", 384), ("sm_90a", "paged_prefill_sm90_kernel", 384),
    ("sm_80", "paged_prefill_kernel", 128), ("sm_86", "paged_prefill_kernel", 128),
    ("sm_100", "paged_prefill_kernel", 128)])
def test_the_plan_routes_prefill_by_arch(arch, kernel, threads):
    q, k, v, cq, ck = _dense([100, 200], [100, 200])
    plan = cupaged.plan_attention(q, KvView.dense(k, v), None, ck, cq, arch=arch)
    assert plan.arch == arch.rstrip("a")
    first = plan.launches[0]
    assert first.kernel.startswith(f"cupaged::{kernel}<") and first.block == (threads, 1, 1)
    assert plan.launches[1].kernel.startswith("cupaged::paged_decode_mma_kernel<")  # decode runs keep their kernel


def test_the_device_arch_is_the_default(monkeypatch):
    """On the sim: CUPAGED_SIM_ARCH's (sm_80's kernels while it is unset)."""
    q, k, v, cq, ck = _dense([100], [100])
    for value, arch in (("", "sm_80"), ("sm_86", "sm_86"), ("sm_90", "sm_90"), ("sm_90a", "sm_90")):
        monkeypatch.setenv("CUPAGED_SIM_ARCH", value)
        assert cupaged.plan_attention(q, KvView.dense(k, v), None, ck, cq).arch == arch
    monkeypatch.setenv("CUPAGED_SIM_ARCH", "sm_70")
    with pytest.raises(ValueError, match="CUPAGED_SIM_ARCH"):
        cupaged.plan_attention(q, KvView.dense(k, v), None, ck, cq)


@pytest.mark.parametrize("arch", ["sm_70", "90", 90, "sm90", ""])
def test_a_bad_arch_is_a_clear_error(arch):
    q, k, v, cq, ck = _dense([20], [20])
    with pytest.raises(ValueError, match="arch"):
        cupaged.plan_attention(q, KvView.dense(k, v), None, ck, cq, arch=arch)


def test_plans_for_both_archs_run_on_the_sim_and_agree_with_the_reference(monkeypatch):
    """Routing by plan: a plan made for sm_80 and one for sm_90 of the same batch both run on the sim (with
    CUPAGED_SIM_ARCH unset: sm_90's launch limits) and both match the reference."""
    monkeypatch.delenv("CUPAGED_SIM_ARCH")
    q, k, v, cq, ck = _dense([70, 3, 150], [90, 40, 150], heads=(4, 1))
    kv = KvView.dense(k, v)
    want, want_lse = reference.varlen_attention(q, k, v, cq, ck, causal=True)
    for arch in ("sm_80", "sm_90"):
        plan = cupaged.plan_attention(q, kv, None, ck, cq, arch=arch)
        out = np.zeros((q.shape[0], 4, 128), q.dtype)
        lse = np.zeros((4, q.shape[0]), np.float32)
        cupaged.run_attention(plan, q, kv, out, lse, None, ck, cq, causal=True)
        assert_close(out, want, tolerance(q.dtype), f"out ({arch})")
        assert_close(lse, want_lse, "lse", f"lse ({arch})")
