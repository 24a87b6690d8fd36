"""Cache writes (reshape_and_cache_flash, reshape_and_cache, concat_and_cache_mla) against
cupaged.reference, on the sim (and cuda when a GPU is present).

Caches start poisoned (0xFF bytes: NaN in every float format and in fp8) and results are compared
bytewise with the reference, which copies the original cache: every untouched slot must come back
bit-identical, and fp8 bytes must equal the reference's own quantization exactly.
"""

from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FP8 = ["fp8", "fp8_e5m2"]


def dtype_id(d):
    return np.dtype(d).name


def kv_data(rng, num_tokens, num_kv_heads, head_size, dtype, *, fused=False):
    """key/value [num_tokens, num_kv_heads, head_size]; views of one fused QKV buffer when ``fused``."""
    hd = num_kv_heads * head_size
    if fused:  # [num_tokens, (q_heads + 2 * kv_heads) * head_size], 2 q heads per kv head
        qkv = rng.standard_normal((num_tokens, 4 * hd)).astype(dtype)
        return (qkv[:, 2 * hd:3 * hd].reshape(num_tokens, num_kv_heads, head_size),
                qkv[:, 3 * hd:].reshape(num_tokens, num_kv_heads, head_size))
    return (rng.standard_normal((num_tokens, num_kv_heads, head_size)).astype(dtype),
            rng.standard_normal((num_tokens, num_kv_heads, head_size)).astype(dtype))


def poisoned(shape, dtype):
    return np.full(shape, 0xFF, np.uint8).view(np.dtype(dtype)).reshape(shape) if np.dtype(dtype).itemsize == 1 \
        else np.full(shape, np.nan, dtype)


def random_slots(rng, num_tokens, num_blocks, block_size, negative_every=0):
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)
    if negative_every:
        slots[::negative_every] = -1
    return slots


def fp8_scale(x, per_head=False, kind="float"):
    """k_scale = amax / 64 (per tensor, or per kv head), as a float or a float32 array."""
    x = np.asarray(x, dtype=np.float32)
    if per_head:
        return (np.abs(x).max(axis=(0, 2)) / 64).astype(np.float32)
    amax = float(np.abs(x).max()) / 64
    return amax if kind == "float" else np.array([amax], np.float32)


def on_backend(backend, *arrays):
    """numpy arrays pass straight to the sim (plain arrays are staged by it; views keep their
    strides); cuda gets device copies."""
    return arrays if backend.name == "sim" else tuple(None if a is None else backend.asarray(a) for a in arrays)


def assert_bytes_equal(got, ref, name):
    got = np.asarray(got)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    diff = np.flatnonzero(got.view(np.uint8).reshape(-1) != np.asarray(ref).view(np.uint8).reshape(-1))
    assert diff.size == 0, f"{name}: {diff.size} bytes differ from the reference, first at byte {diff[0]}"


def check_dequantized(cache_bytes, scale, kv_cache_dtype, reference_values, what):
    """The fp8 cache, dequantized, is within half a unit in the last place of the float input it
    stores: relative 2^-4 for e4m3 (3 mantissa bits), 2^-3 for e5m2, plus half the smallest
    subnormal times the scale near zero. This is the exact bound for round-to-nearest."""
    fmt = reference.FP8[kv_cache_dtype]
    info = ml_dtypes.finfo(fmt)
    got = reference.dequantize_fp8(cache_bytes, scale, kv_cache_dtype).astype(np.float64)
    ref = np.asarray(reference_values, dtype=np.float64)
    rtol = 2.0 ** -(info.nmant + 1)
    atol = float(info.smallest_subnormal) / 2 * np.asarray(scale, np.float64)
    bad = ~(np.abs(got - ref) <= atol + rtol * np.abs(ref) * (1 + 1e-6))
    assert not bad.any(), f"{what}: {int(bad.sum())} dequantized values off by more than half an fp8 ulp"


# ---------------------------------------------------------------- reshape_and_cache_flash
def flash_case(backend, rng, *, num_tokens, num_kv_heads, head_size, block_size, dtype, layout,
               kv_cache_dtype="auto", scale_kind="float", fused=False, negative_every=7, slot_dtype=np.int64):
    key, value = kv_data(rng, num_tokens, num_kv_heads, head_size, dtype, fused=fused)
    num_blocks = max(4, -(-2 * num_tokens // block_size))
    shape = (num_blocks, block_size, num_kv_heads, head_size) if layout == "NHD" else \
        (num_blocks, num_kv_heads, block_size, head_size)
    cache = poisoned(shape, dtype if kv_cache_dtype == "auto" else np.uint8)
    slots = random_slots(rng, num_tokens, num_blocks, block_size, negative_every).astype(slot_dtype)
    k_scale = fp8_scale(key, per_head=scale_kind == "per_head", kind=scale_kind)
    v_scale = fp8_scale(value, per_head=scale_kind == "per_head", kind=scale_kind)
    key_cache, value_cache = backend.asarray(cache), backend.asarray(cache)
    args = on_backend(backend, key, value)
    cupaged.reshape_and_cache_flash(*args, key_cache, value_cache, backend.asarray(slots), kv_cache_dtype,
                                    k_scale, v_scale, layout=layout)
    ref_k, ref_v = reference.reshape_and_cache_flash(key, value, cache, cache, slots, kv_cache_dtype,
                                                     k_scale, v_scale, layout=layout)
    got_k, got_v = backend.to_numpy(key_cache), backend.to_numpy(value_cache)
    assert_bytes_equal(got_k, ref_k, "key_cache")
    assert_bytes_equal(got_v, ref_v, "value_cache")
    if kv_cache_dtype != "auto":
        keep = slots >= 0
        blocks, offsets = np.divmod(slots[keep].astype(np.int64), block_size)
        stored = got_k[blocks, offsets] if layout == "NHD" else got_k[blocks, :, offsets]
        scale = np.asarray(k_scale, np.float32).reshape(-1)
        check_dequantized(stored, scale[None, :, None] if scale.size > 1 else scale, kv_cache_dtype, key[keep], "key")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_flash_97_tokens(backend, layout, dtype, head_size, block_size):
    flash_case(backend, np.random.default_rng(head_size * 100 + block_size), num_tokens=97, num_kv_heads=4,
               head_size=head_size, block_size=block_size, dtype=dtype, layout=layout)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype", FP8 + ["fp8_e4m3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_size", [64, 80, 120, 256])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_flash_fp8(backend, layout, kv_cache_dtype, dtype, head_size, block_size):
    flash_case(backend, np.random.default_rng(head_size + block_size), num_tokens=42, num_kv_heads=8,
               head_size=head_size, block_size=block_size, dtype=dtype, layout=layout, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("scale_kind", ["array", "per_head"])
@pytest.mark.parametrize("kv_cache_dtype", FP8)
def test_flash_fp8_scale_arrays(backend, scale_kind, kv_cache_dtype):
    flash_case(backend, np.random.default_rng(11), num_tokens=42, num_kv_heads=8, head_size=128, block_size=16,
               dtype=np.float16, layout="NHD", kv_cache_dtype=kv_cache_dtype, scale_kind=scale_kind)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_flash_single_token(backend, layout, dtype):
    flash_case(backend, np.random.default_rng(1), num_tokens=1, num_kv_heads=4, head_size=64, block_size=16,
               dtype=dtype, layout=layout, negative_every=0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_flash_fused_qkv_views_and_int32_slots(backend, kv_cache_dtype, slot_dtype, layout):
    flash_case(backend, np.random.default_rng(2), num_tokens=42, num_kv_heads=4, head_size=128, block_size=16,
               dtype=np.float16, layout=layout, kv_cache_dtype=kv_cache_dtype, fused=True, negative_every=5,
               slot_dtype=slot_dtype)


def test_flash_unaligned_views_take_the_scalar_path(backend):
    """A view starting 2 bytes into its buffer cannot use 16-byte accesses; results must not change."""
    rng = np.random.default_rng(3)
    buf = rng.standard_normal((33, 2 * 4 * 64 + 1)).astype(np.float16)
    key = buf[:, 1:1 + 4 * 64].reshape(33, 4, 64)
    value = buf[:, 1 + 4 * 64:].reshape(33, 4, 64)
    cache = poisoned((9, 8, 4, 64), np.float16)
    slots = random_slots(rng, 33, 9, 8)
    kc, vc = backend.asarray(cache), backend.asarray(cache)
    cupaged.reshape_and_cache_flash(*on_backend(backend, key, value), kc, vc, backend.asarray(slots))
    ref_k, ref_v = reference.reshape_and_cache_flash(key, value, cache, cache, slots)
    assert_bytes_equal(backend.to_numpy(kc), ref_k, "key_cache")
    assert_bytes_equal(backend.to_numpy(vc), ref_v, "value_cache")


def test_flash_caches_as_views_of_one_buffer(backend):
    """key/value caches as the halves of one [num_blocks, 2, ...] buffer (vLLM's combined KV tensor)."""
    rng = np.random.default_rng(5)
    key, value = kv_data(rng, 20, 4, 64, np.float32)
    slots = random_slots(rng, 20, 6, 8, negative_every=3)
    combined = backend.asarray(np.full((6, 2, 8, 4, 64), np.nan, np.float32))
    cupaged.reshape_and_cache_flash(*on_backend(backend, key, value), combined[:, 0], combined[:, 1],
                                    backend.asarray(slots))
    poison = np.full((6, 8, 4, 64), np.nan, np.float32)
    ref_k, ref_v = reference.reshape_and_cache_flash(key, value, poison, poison, slots)
    got = backend.to_numpy(combined)
    assert_bytes_equal(np.ascontiguousarray(got[:, 0]), ref_k, "key half")
    assert_bytes_equal(np.ascontiguousarray(got[:, 1]), ref_v, "value half")


def test_fp8_saturates_and_keeps_nan(backend):
    """Values beyond the format's range saturate to ±448 / ±57344 (__NV_SATFINITE); NaN stays NaN."""
    key = np.array([[[1000.0, -1000.0, np.inf, -np.inf, np.nan, 0.5, -0.0, 3e-4] * 2]], np.float32)
    for kv_cache_dtype, limit in (("fp8", 448.0), ("fp8_e5m2", 57344.0)):
        big = key.copy()
        big[..., :4] *= 1.0 if kv_cache_dtype == "fp8" else 100.0
        cache = backend.asarray(poisoned((1, 1, 1, 16), np.uint8))
        other = backend.asarray(poisoned((1, 1, 1, 16), np.uint8))
        cupaged.reshape_and_cache_flash(*on_backend(backend, big, big), cache, other, backend.asarray(np.zeros(1, np.int64)),
                                        kv_cache_dtype, 1.0, 1.0)
        got = reference.dequantize_fp8(backend.to_numpy(cache), 1.0, kv_cache_dtype).reshape(-1)[:8]
        assert got[0] == limit and got[1] == -limit and got[2] == limit and got[3] == -limit
        assert np.isnan(got[4]) and got[5] == 0.5
        assert_bytes_equal(backend.to_numpy(cache), reference.quantize_fp8(big, 1.0, kv_cache_dtype).reshape(1, 1, 1, 16),
                           "saturated codes")


# ---------------------------------------------------------------- reshape_and_cache (vLLM layout)
def vllm_caches(num_blocks, num_kv_heads, head_size, block_size, cache_dtype):
    x = 16 // np.dtype(cache_dtype).itemsize
    return (poisoned((num_blocks, num_kv_heads, head_size // x, block_size, x), cache_dtype),
            poisoned((num_blocks, num_kv_heads, head_size, block_size), cache_dtype))


VLLM_GRID = [(kv, dt, hs, bs) for kv in ["auto"] + FP8 for dt in DTYPES for hs in (64, 80, 120, 256)
             for bs in (8, 16, 32) if kv == "auto" or hs % 16 == 0]  # fp8 with head 120: see below


@pytest.mark.parametrize("kv_cache_dtype, dtype, head_size, block_size", VLLM_GRID,
                         ids=[f"{kv}-{dtype_id(dt)}-h{hs}-bs{bs}" for kv, dt, hs, bs in VLLM_GRID])
def test_vllm_layout(backend, kv_cache_dtype, dtype, head_size, block_size):
    rng = np.random.default_rng(head_size * 7 + block_size)
    key, value = kv_data(rng, 42, 8, head_size, dtype, fused=block_size == 16)
    num_blocks = -(-84 // block_size)
    cache_dtype = dtype if kv_cache_dtype == "auto" else np.uint8
    kc0, vc0 = vllm_caches(num_blocks, 8, head_size, block_size, cache_dtype)
    slots = random_slots(rng, 42, num_blocks, block_size, negative_every=6)
    k_scale = fp8_scale(key)
    v_scale = fp8_scale(value, per_head=True) if block_size == 32 else fp8_scale(value)
    kc, vc = backend.asarray(kc0), backend.asarray(vc0)
    if block_size == 32:  # per-head scales must come in pairs
        k_scale = np.full(8, k_scale, np.float32)
    cupaged.reshape_and_cache(*on_backend(backend, key, value), kc, vc, backend.asarray(slots), kv_cache_dtype,
                              k_scale, v_scale)
    ref_k, ref_v = reference.reshape_and_cache(key, value, kc0, vc0, slots, kv_cache_dtype, k_scale, v_scale)
    assert_bytes_equal(backend.to_numpy(kc), ref_k, "key_cache")
    assert_bytes_equal(backend.to_numpy(vc), ref_v, "value_cache")


def test_vllm_layout_rejects_head_120_fp8(backend):
    key, value = kv_data(np.random.default_rng(0), 4, 2, 120, np.float16)
    kc = backend.asarray(np.zeros((4, 2, 7, 8, 16), np.uint8))
    vc = backend.asarray(np.zeros((4, 2, 120, 8), np.uint8))
    before = backend.to_numpy(kc).copy()
    with pytest.raises(ValueError, match=r"head_size=120.*multiple of 16"):
        cupaged.reshape_and_cache(*on_backend(backend, key, value), kc, vc, backend.asarray(np.arange(4)), "fp8")
    assert np.array_equal(backend.to_numpy(kc), before)


# ---------------------------------------------------------------- concat_and_cache_mla
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_concat_and_cache_mla(backend, kv_cache_dtype, dtype):
    rng = np.random.default_rng(9)
    num_tokens, rank, rope, block_size, num_blocks = 37, 512, 64, 16, 8
    kv_c = rng.standard_normal((num_tokens, rank + 32)).astype(dtype)[:, :rank]  # strided view
    k_pe = rng.standard_normal((num_tokens, rope)).astype(dtype)
    cache0 = poisoned((num_blocks, block_size, rank + rope), dtype if kv_cache_dtype == "auto" else np.uint8)
    slots = random_slots(rng, num_tokens, num_blocks, block_size, negative_every=4)
    scale = fp8_scale(np.concatenate([kv_c, k_pe], axis=1), kind="array")
    cache = backend.asarray(cache0)
    cupaged.concat_and_cache_mla(*on_backend(backend, kv_c, k_pe), cache, backend.asarray(slots), kv_cache_dtype, scale)
    ref = reference.concat_and_cache_mla(kv_c, k_pe, cache0, slots, kv_cache_dtype, scale)
    assert_bytes_equal(backend.to_numpy(cache), ref, "kv_cache")


# ---------------------------------------------------------------- validation: clear error, nothing written
def _valid(backend):
    rng = np.random.default_rng(6)
    key, value = kv_data(rng, 10, 4, 64, np.float16)
    cache = poisoned((8, 8, 4, 64), np.float16)
    return dict(key=backend.asarray(key), value=backend.asarray(value), key_cache=backend.asarray(cache),
                value_cache=backend.asarray(cache), slot_mapping=backend.asarray(random_slots(rng, 10, 8, 8)))


FP8_CACHES = lambda a: {"key_cache": a["key_cache"].view(np.uint8)[..., :64],  # noqa: E731
                        "value_cache": a["value_cache"].view(np.uint8)[..., :64], "kv_cache_dtype": "fp8"}
BAD_INPUTS = {
    "key dtype": (lambda a: {"key": a["key"].astype(np.float64)}, TypeError, "key"),
    "key ndim": (lambda a: {"key": a["key"].reshape(10, -1)}, ValueError, "key"),
    "value shape": (lambda a: {"value": a["value"][:, :2]}, ValueError, "value"),
    "value dtype": (lambda a: {"value": a["value"].astype(np.float32)}, TypeError, "value"),
    "key_cache dtype": (lambda a: {"key_cache": a["key_cache"].astype(np.float32)}, TypeError, "key_cache"),
    "key_cache heads": (lambda a: {"key_cache": a["key_cache"][:, :, :2]}, ValueError, "key_cache"),
    "key_cache ndim": (lambda a: {"key_cache": a["key_cache"][0]}, ValueError, "key_cache"),
    "value_cache shape": (lambda a: {"value_cache": a["value_cache"][:3]}, ValueError, "value_cache"),
    "key_cache last dim strided": (lambda a: {"key_cache": a["key_cache"][..., ::2]}, ValueError, "key_cache"),
    "slot dtype": (lambda a: {"slot_mapping": a["slot_mapping"].astype(np.float32)}, TypeError, "slot_mapping"),
    "slot length": (lambda a: {"slot_mapping": a["slot_mapping"][:5]}, ValueError, "slot_mapping"),
    "slot ndim": (lambda a: {"slot_mapping": a["slot_mapping"].reshape(2, 5)}, ValueError, "slot_mapping"),
    "layout": (lambda a: {"layout": "NDH"}, ValueError, "layout"),
    "HND shapes for NHD": (lambda a: {"layout": "HND"}, ValueError, "key_cache"),
    "kv_cache_dtype unknown": (lambda a: {"kv_cache_dtype": "int8"}, ValueError, "kv_cache_dtype"),
    "fp8 with float caches": (lambda a: {"kv_cache_dtype": "fp8"}, TypeError, "key_cache"),
    "fp8 scale zero": (lambda a: {**FP8_CACHES(a), "k_scale": 0.0}, ValueError, "k_scale"),
    "fp8 scale float64 array": (lambda a: {**FP8_CACHES(a), "k_scale": np.ones(1)}, TypeError, "k_scale"),
    "fp8 scale wrong size": (lambda a: {**FP8_CACHES(a), "v_scale": np.ones(3, np.float32)}, ValueError, "v_scale"),
    "fp8 scale string": (lambda a: {**FP8_CACHES(a), "v_scale": "1"}, TypeError, "v_scale"),
    "key not an array": (lambda a: {"key": [1.0]}, TypeError, "key"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_flash_bad_input_raises_and_writes_nothing(backend, case):
    change, exc, name = BAD_INPUTS[case]
    args = _valid(backend)
    before = [backend.to_numpy(args[c]).copy() for c in ("key_cache", "value_cache")]
    with pytest.raises(exc, match=name):
        cupaged.reshape_and_cache_flash(**{**args, **change(args)})
    for c, b in zip(("key_cache", "value_cache"), before):
        assert_bytes_equal(backend.to_numpy(args[c]), b, f"{c} after a rejected call")


def test_validate_catches_slot_outside_pool(backend, monkeypatch):
    args = _valid(backend)
    slots = backend.to_numpy(args["slot_mapping"]).copy()
    slots[3] = 8 * 8
    args["slot_mapping"] = backend.asarray(slots)
    before = backend.to_numpy(args["key_cache"]).copy()
    with pytest.raises(ValueError, match=r"slot_mapping\[3\]"):
        cupaged.reshape_and_cache_flash(**args, validate=True)
    monkeypatch.setenv("CUPAGED_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"slot_mapping\[3\]"):
        cupaged.reshape_and_cache_flash(**args)
    assert_bytes_equal(backend.to_numpy(args["key_cache"]), before, "key_cache")


@pytest.mark.parametrize("change, exc, name", [
    (lambda kc, vc: {"key_cache": kc[:, :, :3]}, ValueError, "key_cache"),
    (lambda kc, vc: {"value_cache": vc[..., :4]}, ValueError, "value_cache"),
    (lambda kc, vc: {"key_cache": kc.astype(np.float32)}, TypeError, "key_cache"),
    (lambda kc, vc: {"kv_cache_dtype": "fp8"}, TypeError, "key_cache"),
], ids=["key_cache chunks", "value_cache block_size", "key_cache dtype", "fp8 float caches"])
def test_vllm_layout_bad_input(backend, change, exc, name):
    key, value = kv_data(np.random.default_rng(0), 4, 2, 64, np.float16)
    kc0, vc0 = vllm_caches(4, 2, 64, 8, np.float16)
    kc, vc = backend.asarray(kc0), backend.asarray(vc0)
    args = dict(key=backend.asarray(key), value=backend.asarray(value), key_cache=kc, value_cache=vc,
                slot_mapping=backend.asarray(np.arange(4)))
    with pytest.raises(exc, match=name):
        cupaged.reshape_and_cache(**{**args, **change(kc, vc)})
    assert_bytes_equal(backend.to_numpy(kc), kc0, "key_cache")


@pytest.mark.parametrize("change, exc, name", [
    (lambda a: {"k_pe": a["k_pe"][:3]}, ValueError, "k_pe"),
    (lambda a: {"k_pe": a["k_pe"].astype(np.float32)}, TypeError, "k_pe"),
    (lambda a: {"kv_cache": a["kv_cache"][..., :500]}, ValueError, "kv_cache"),
    (lambda a: {"kv_c": a["kv_c"].astype(np.int32)}, TypeError, "kv_c"),
    (lambda a: {"kv_cache_dtype": "fp8", "kv_cache": a["kv_cache"].view(np.uint8)[..., :576]}, ValueError, "scale"),
], ids=["k_pe rows", "k_pe dtype", "kv_cache width", "kv_c dtype", "fp8 scale per head"])
def test_mla_bad_input(backend, change, exc, name):
    cache0 = poisoned((4, 16, 576), np.float16)
    a = dict(kv_c=backend.asarray(np.ones((5, 512), np.float16)), k_pe=backend.asarray(np.ones((5, 64), np.float16)),
             kv_cache=backend.asarray(cache0), slot_mapping=backend.asarray(np.arange(5)))
    kwargs = {**a, **change(a)}
    if "scale" in name:
        kwargs["scale"] = np.ones(2, np.float32)
    with pytest.raises(exc, match=name):
        cupaged.concat_and_cache_mla(**kwargs)
    assert_bytes_equal(backend.to_numpy(a["kv_cache"]), cache0, "kv_cache")


def test_backend_mix_names_the_arguments(monkeypatch):
    """numpy data beside a cupy cache is a TypeError naming both sides (a stand-in cupy module
    lets this run without a GPU)."""
    fake = types.ModuleType("cupy")

    class FakeDeviceArray:
        ndim, shape, dtype = 4, (8, 8, 4, 64), np.dtype(np.float16)

    fake.ndarray = FakeDeviceArray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    key, value = kv_data(np.random.default_rng(7), 4, 4, 64, np.float16)
    cache = poisoned((8, 8, 4, 64), np.float16)
    with pytest.raises(TypeError, match=r"cupy: key_cache; numpy: key, value, value_cache, slot_mapping"):
        cupaged.reshape_and_cache_flash(key, value, FakeDeviceArray(), cache, np.arange(4))


def test_dequantized_reference_is_close_to_input():
    """The tolerance check used above can fail: a wrong scale is caught."""
    x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    s = fp8_scale(x)
    check_dequantized(reference.quantize_fp8(x, s), s, "fp8", x, "x")
    with pytest.raises(AssertionError):
        check_dequantized(reference.quantize_fp8(x, s), 2 * s, "fp8", x, "x")
