"""cupaged.testing: assert_close on hand-made cases, poison, and the paged-KV builder's promises
(live block ids used once, garbage table tails, every unused slot poisoned, the K/V it returned is
what a read through the table finds)."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from cupaged import reference, sim
from cupaged.testing import TOLERANCES, assert_close, compare, paged_kv, poison, poisoned, tolerance


def test_assert_close_passes_within_and_at_the_bound():
    ref = np.array([[2.0, -4.0], [0.0, 1e6]])
    assert_close(ref, ref, atol=0.0, rtol=0.0)
    assert_close(ref + [[1.0, -1.5], [0.5, 250000.5]], ref, atol=0.5, rtol=0.25)  # every element exactly at its bound
    assert_close(np.float16(1.0009765625), np.float16(1.0), np.float16)


def test_assert_close_fails_on_one_element_just_outside():
    ref = np.linspace(-3, 3, 24).reshape(2, 3, 4)
    got = ref.copy()
    atol, rtol = TOLERANCES[np.dtype(np.float32)]
    got[1, 2, 3] += (atol + rtol * abs(ref[1, 2, 3])) * (1 + 1e-6)
    with pytest.raises(AssertionError, match=r"out: 1 of 24 elements out of tolerance .*worst at \(1, 2, 3\): got "
                                             r"3\.0000\d+, ref 3\.0"):
        assert_close(got, ref, np.float32, "out")
    got[1, 2, 3] = ref[1, 2, 3] + (atol + rtol * abs(ref[1, 2, 3])) * (1 - 1e-6)
    assert_close(got, ref, np.float32)


def test_nan_in_actual_always_fails():
    ref = np.zeros(5)
    got = ref.copy()
    got[3] = np.nan
    with pytest.raises(AssertionError, match=r"1 of 5 .*worst at \(3,\): got nan"):
        assert_close(got, ref, atol=1e9, rtol=1e9)
    with pytest.raises(AssertionError, match="1 of 5"):
        assert_close(got, np.where(np.arange(5) == 3, np.nan, 0.0), atol=1.0)  # NaN against NaN too
    with pytest.raises(AssertionError, match="2 of 5"):
        assert_close(got.astype(ml_dtypes.bfloat16), np.where(np.arange(5) == 1, np.nan, 0.0), ml_dtypes.bfloat16)


def test_infinities_must_match():
    ref = np.array([-np.inf, np.inf, 1.0])
    assert_close(ref, ref, "lse")
    for got in ([np.inf, np.inf, 1.0], [-1e30, np.inf, 1.0], [-np.inf, np.inf, np.inf]):
        with pytest.raises(AssertionError, match="1 of 3"):
            assert_close(np.array(got), ref, "lse")


def test_tolerance_sources():
    ref = np.ones(4, np.float32)
    assert_close(ref + 1.5e-3, ref, (1e-3, 1e-3))  # an (atol, rtol) pair
    assert_close((ref + 1.5e-3).astype(np.float16), ref)  # None: actual's dtype
    with pytest.raises(AssertionError):
        assert_close(ref + 1.5e-3, ref)  # float32's tolerance
    with pytest.raises(AssertionError):
        assert_close(ref + 2e-4, ref, "lse")
    assert_close(ref + 0.03, ref, tolerance(np.float16, "fp8"))
    assert tolerance(np.float32) == TOLERANCES[np.dtype(np.float32)]
    assert tolerance(np.float32, "fp8_e5m2") == TOLERANCES["fp8"]
    with pytest.raises(ValueError, match="no tolerance"):
        assert_close(ref.astype(np.int32), ref)
    with pytest.raises(AssertionError, match=r"x: shape \(4,\) != \(2, 2\)"):
        assert_close(ref, ref.reshape(2, 2), what="x")


def test_compare_reports_the_element_nearest_its_bound():
    ref = np.array([1.0, 100.0, -10.0, 0.0])
    c = compare(ref + [0.5, 40.0, 1.0, 0.0], ref, atol=0.0, rtol=0.5)  # error / bound: 1, 0.8, 0.2, 0 (0 / 0)
    assert (c.index, c.error, c.bound, c.failures, c.size, c.ratio) == ((0,), 0.5, 0.5, 0, 4, 1.0)
    c = compare(ref + [0.0, 0.0, 0.0, 1e-9], ref, atol=0.0, rtol=0.5)  # any error under a zero bound
    assert (c.index, c.failures, c.ratio) == ((3,), 1, np.inf)
    assert compare(np.zeros(0), np.zeros(0), atol=0.0).failures == 0
    codes = np.array([1, 255], np.uint8)
    assert compare(codes, codes, (0.0, 0.0)).failures == 0  # uint8 caches compare as codes


@pytest.mark.parametrize("dtype, bits", [(np.float32, None), (np.float16, None), (ml_dtypes.bfloat16, None),
                                         (np.uint8, 0xFF), (np.int32, -1)])
def test_poison(dtype, bits):
    a = np.zeros((3, 4), dtype)
    assert poison(a, (slice(None), 1)) is a
    if bits is None:
        assert np.isnan(a[:, 1].astype(np.float32)).all() and not np.isnan(a[:, [0, 2, 3]].astype(np.float32)).any()
    else:
        assert (a[:, 1] == bits).all() and (a[:, [0, 2, 3]] == 0).all()
    g = poisoned((2, 5), dtype, "sim")
    assert sim.asarray(g) is g, "not in guarded sim memory"
    assert (g.view(np.uint8) == poisoned((2, 5), dtype).view(np.uint8)).all()


LAYOUTS = ["NHD", "HND", "vllm", "mla"]
SEQ_LENS = [1, 15, 16, 17, 0, 40]  # around block_size 16, and a padded slot


def _build(layout, kv_cache_dtype, table_tail, **extra):
    return paged_kv(SEQ_LENS, block_size=16, head_size=64, num_kv_heads=2, dtype=np.float16, layout=layout,
                    kv_cache_dtype=kv_cache_dtype, spare_blocks=3, spare_columns=2, table_tail=table_tail,
                    rng=np.random.default_rng(3), **extra)


def _live(kv):
    """(block id, offset) of every slot a token holds."""
    return {(int(kv.block_tables[s, p // 16]), p % 16) for s, n in enumerate(SEQ_LENS) for p in range(n)}


def _slots(cache, layout, which):
    """The cache as [num_blocks, block_size, everything else] (a copy)."""
    axes = {"NHD": (0, 1, 2, 3), "mla": (0, 1, 2), "HND": (0, 2, 1, 3),
            "vllm": (0, 3, 1, 2, 4) if which == "k" else (0, 3, 1, 2)}[layout]
    t = np.transpose(cache, axes)
    return t.reshape(*t.shape[:2], -1)


@pytest.mark.parametrize("layout, kv_cache_dtype, table_tail",
                         list(itertools.product(LAYOUTS, ["auto", "fp8"], ["out_of_range", "other_blocks"])))
def test_paged_kv(layout, kv_cache_dtype, table_tail):
    kv = _build(layout, kv_cache_dtype, table_tail)
    caches = [kv.key_cache] + ([] if layout == "mla" else [kv.value_cache])
    num_blocks = caches[0].shape[0]
    need = [-(-n // 16) for n in SEQ_LENS]
    assert num_blocks == sum(need) + 3 and kv.block_tables.shape == (len(SEQ_LENS), max(need) + 2)
    assert kv.block_tables.dtype == np.int32 and kv.seq_lens.tolist() == SEQ_LENS
    live = np.concatenate([kv.block_tables[s, :n] for s, n in enumerate(need)])
    assert len(set(live.tolist())) == len(live) and ((0 <= live) & (live < num_blocks)).all()
    for s, n in enumerate(need):
        tail = kv.block_tables[s, n:]
        if table_tail == "out_of_range":
            assert (tail >= num_blocks).all()
        else:
            assert ((0 <= tail) & (tail < num_blocks)).all() and not np.isin(tail, kv.block_tables[s, :n]).any()
    used = _live(kv)
    fp8 = kv_cache_dtype != "auto"
    for which, cache in zip("kv", caches):
        slots = _slots(cache, layout, which)
        poisoned_slot = (slots == 0xFF).all(axis=2) if fp8 else np.isnan(slots.astype(np.float32)).all(axis=2)
        anything_poisoned = (slots == 0xFF).any(axis=2) if fp8 else np.isnan(slots.astype(np.float32)).any(axis=2)
        for b, o in itertools.product(range(num_blocks), range(16)):
            assert (not anything_poisoned[b, o]) if (b, o) in used else poisoned_slot[b, o], (which, b, o)
    for s, n in enumerate(SEQ_LENS):  # read back through the table (the reference's gather, raw codes for fp8)
        if layout == "mla":
            back = [reference.dense_kv(kv.key_cache[:, :, None], kv.key_cache[:, :, None], kv.block_tables[s], n)[0]]
        else:
            back = reference.dense_kv(kv.key_cache, kv.value_cache, kv.block_tables[s], n, layout=layout)
        for got, want in zip(back, (kv.keys[s], kv.values[s] if kv.values else None)):
            assert want.dtype == (np.uint8 if fp8 else np.float16)
            assert np.array_equal(got, want.reshape(got.shape).astype(np.float64)), (s, layout)
    if fp8:
        assert isinstance(kv.k_scale, float) and kv.k_scale > 0 and isinstance(kv.v_scale, float) and kv.v_scale > 0
    else:
        assert kv.k_scale == kv.v_scale == 1.0
    if not fp8:
        values = np.concatenate([k.reshape(-1) for k in kv.keys]).astype(np.float32)
        assert 0.8 < values.std() < 1.2 and abs(values.mean()) < 0.1  # standard normal


def test_paged_kv_fp8_scales_and_poisoned_window():
    kv = paged_kv([40, 33], block_size=16, head_size=32, num_kv_heads=4, kv_cache_dtype="fp8_e5m2",
                  per_head_scales=True, poison_before=[30, 0], rng=np.random.default_rng(1))
    assert kv.k_scale.shape == (4,) and kv.k_scale.dtype == np.float32 and (kv.k_scale > 0).all()
    values = [reference.dequantize_fp8(k, kv.k_scale[:, None], "fp8_e5m2") for k in kv.keys]
    amax = np.nanmax(np.abs(np.concatenate(values)), axis=(0, 2))
    np.testing.assert_allclose(amax / kv.k_scale, 64, rtol=0.13)  # max|x| / 64, up to e5m2's rounding
    assert (kv.keys[0][:30] == 0xFF).all() and not (kv.keys[0][30:] == 0xFF).any()
    assert (kv.key_cache[kv.block_tables[0, 0]] == 0xFF).all()  # positions 0..15: before the window
    fixed = paged_kv([5], block_size=4, head_size=16, num_kv_heads=1, kv_cache_dtype="fp8", kv_scale=0.25)
    assert (fixed.k_scale, fixed.v_scale) == (0.25, 0.25)


def test_paged_kv_on_the_sim_and_its_draws():
    kv = paged_kv([20, 3], block_size=8, head_size=16, num_kv_heads=2, dtype=np.float32, rng=np.random.default_rng(5),
                  device="sim")
    for a in (kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens):
        assert sim.asarray(a) is a, "not in guarded sim memory"
    again = paged_kv([20, 3], block_size=8, head_size=16, num_kv_heads=2, dtype=np.float32,
                     rng=np.random.default_rng(5))
    assert np.array_equal(again.key_cache, kv.key_cache, equal_nan=True)
    assert np.array_equal(again.block_tables, kv.block_tables)


def test_paged_kv_bad_arguments():
    with pytest.raises(ValueError, match="other_blocks"):
        paged_kv([20], block_size=8, head_size=16, spare_columns=1, table_tail="other_blocks")
    with pytest.raises(ValueError, match="layout"):
        paged_kv([20], block_size=8, head_size=16, layout="NDH")
    with pytest.raises(ValueError, match="multiple of 8"):
        paged_kv([20], block_size=8, head_size=12, layout="vllm")
    with pytest.raises(ValueError, match="device"):
        paged_kv([20], block_size=8, head_size=16, device="tpu")
