"""reshape_and_cache_flash against cupaged.reference, on the sim (and cuda when a GPU is present).

Caches start NaN-poisoned (0xFF bytes) and results are compared bytewise with the reference, which
copies the original cache: every untouched slot must come back bit-identical.
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
NUM_KV_HEADS = 4


def make_case(rng, num_tokens, head_size, block_size, dtype, layout, *, num_blocks=None, negative_every=0,
              fused=False):
    """key/value (views of a fused QKV buffer when ``fused``), NaN-poisoned caches, random distinct slots."""
    num_blocks = num_blocks or max(4, -(-2 * num_tokens // block_size))
    hd = NUM_KV_HEADS * head_size
    if fused:  # [num_tokens, (q_heads + 2 * kv_heads) * head_size], q with 2 heads per kv head
        qkv = rng.standard_normal((num_tokens, 4 * hd)).astype(dtype)
        key = qkv[:, 2 * hd:3 * hd].reshape(num_tokens, NUM_KV_HEADS, head_size)
        value = qkv[:, 3 * hd:].reshape(num_tokens, NUM_KV_HEADS, head_size)
    else:
        key = rng.standard_normal((num_tokens, NUM_KV_HEADS, head_size)).astype(dtype)
        value = rng.standard_normal((num_tokens, NUM_KV_HEADS, head_size)).astype(dtype)
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_size) if layout == "NHD" else \
        (num_blocks, NUM_KV_HEADS, block_size, head_size)
    poison = np.full(shape, np.nan, dtype=dtype)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)
    if negative_every:
        slots[::negative_every] = -1
    return key, value, poison, slots


def run_and_compare(backend, key, value, cache, slots, layout):
    key_cache, value_cache = backend.asarray(cache), backend.asarray(cache)
    ref_k, ref_v = reference.reshape_and_cache_flash(key, value, cache, cache, slots, layout=layout)
    cupaged.reshape_and_cache_flash(backend.asarray(key) if backend.name != "sim" else key,
                                    backend.asarray(value) if backend.name != "sim" else value,
                                    key_cache, value_cache, backend.asarray(slots), layout=layout)
    for name, got, ref in (("key_cache", key_cache, ref_k), ("value_cache", value_cache, ref_v)):
        got = backend.to_numpy(got)
        assert np.array_equal(got.view(np.uint8), ref.view(np.uint8)), f"{name} differs from the reference"


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_scatter_97_tokens(backend, layout, dtype, head_size, block_size):
    rng = np.random.default_rng(head_size * 1000 + block_size)
    key, value, cache, slots = make_case(rng, 97, head_size, block_size, dtype, layout, negative_every=7)
    run_and_compare(backend, key, value, cache, slots, layout)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_single_token(backend, layout, dtype):
    key, value, cache, slots = make_case(np.random.default_rng(1), 1, 64, 16, dtype, layout)
    run_and_compare(backend, key, value, cache, slots, layout)


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fused_qkv_views_and_int32_slots(backend, slot_dtype, layout):
    key, value, cache, slots = make_case(np.random.default_rng(2), 42, 128, 16, np.float16, layout, fused=True,
                                         negative_every=5)
    assert not key.flags.c_contiguous
    run_and_compare(backend, key, value, cache, slots.astype(slot_dtype), layout)


def test_unaligned_views_take_the_scalar_path(backend):
    """A view starting 2 bytes into its buffer cannot use 16-byte accesses; results must not change."""
    rng = np.random.default_rng(3)
    buf = rng.standard_normal((33, 2 * NUM_KV_HEADS * 64 + 1)).astype(np.float16)
    key = buf[:, 1:1 + NUM_KV_HEADS * 64].reshape(33, NUM_KV_HEADS, 64)
    value = buf[:, 1 + NUM_KV_HEADS * 64:].reshape(33, NUM_KV_HEADS, 64)
    _, _, cache, slots = make_case(rng, 33, 64, 8, np.float16, "NHD")
    run_and_compare(backend, key, value, cache, slots, "NHD")


def test_all_slots_negative_writes_nothing(backend):
    key, value, cache, slots = make_case(np.random.default_rng(4), 9, 64, 16, np.float32, "NHD")
    run_and_compare(backend, key, value, cache, np.full_like(slots, -1), "NHD")


def test_shared_block_cache_strides(backend):
    """Caches that are views of one [num_blocks, 2, ...] buffer (vLLM's combined KV tensor)."""
    rng = np.random.default_rng(5)
    key, value, _, slots = make_case(rng, 20, 64, 8, np.float32, "NHD", num_blocks=6)
    combined = backend.asarray(np.full((6, 2, 8, NUM_KV_HEADS, 64), np.nan, np.float32))
    key_cache, value_cache = combined[:, 0], combined[:, 1]
    cupaged.reshape_and_cache_flash(backend.asarray(key), backend.asarray(value), key_cache, value_cache,
                                    backend.asarray(slots))
    poison = np.full((6, 8, NUM_KV_HEADS, 64), np.nan, np.float32)
    ref_k, ref_v = reference.reshape_and_cache_flash(key, value, poison, poison, slots)
    got = backend.to_numpy(combined)
    assert np.array_equal(got[:, 0], ref_k, equal_nan=True)
    assert np.array_equal(got[:, 1], ref_v, equal_nan=True)


# ---------------------------------------------------------------- validation: clear error, nothing written
def _valid(backend):
    key, value, cache, slots = make_case(np.random.default_rng(6), 10, 64, 8, np.float16, "NHD")
    return dict(key=backend.asarray(key), value=backend.asarray(value), key_cache=backend.asarray(cache),
                value_cache=backend.asarray(cache), slot_mapping=backend.asarray(slots))


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
    "kv_cache_dtype fp8": (lambda a: {"kv_cache_dtype": "fp8"}, NotImplementedError, "kv_cache_dtype"),
    "key not an array": (lambda a: {"key": [1.0]}, TypeError, "key"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_raises_and_writes_nothing(backend, case):
    change, exc, name = BAD_INPUTS[case]
    args = _valid(backend)
    before = [backend.to_numpy(args[c]).copy() for c in ("key_cache", "value_cache")]
    kwargs = {**args, **change(args)}
    with pytest.raises(exc, match=name):
        cupaged.reshape_and_cache_flash(**kwargs)
    for c, b in zip(("key_cache", "value_cache"), before):
        assert np.array_equal(backend.to_numpy(args[c]).view(np.uint8), b.view(np.uint8)), f"{c} was written"


def test_validate_catches_slot_outside_pool(backend, monkeypatch):
    args = _valid(backend)
    slots = backend.to_numpy(args["slot_mapping"]).copy()
    slots[3] = args["key_cache"].shape[0] * args["key_cache"].shape[1]
    args["slot_mapping"] = backend.asarray(slots)
    before = backend.to_numpy(args["key_cache"]).copy()
    with pytest.raises(ValueError, match=r"slot_mapping\[3\]"):
        cupaged.reshape_and_cache_flash(**args, validate=True)
    monkeypatch.setenv("CUPAGED_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"slot_mapping\[3\]"):
        cupaged.reshape_and_cache_flash(**args)
    assert np.array_equal(backend.to_numpy(args["key_cache"]).view(np.uint8), before.view(np.uint8))


def test_backend_mix_names_the_arguments(monkeypatch):
    """numpy data beside a cupy cache is a TypeError naming both sides (a stand-in cupy module
    lets this run without a GPU)."""
    fake = types.ModuleType("cupy")

    class FakeDeviceArray:
        ndim, shape, dtype = 4, (8, 8, 4, 64), np.dtype(np.float16)

    fake.ndarray = FakeDeviceArray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    key, value, cache, slots = make_case(np.random.default_rng(7), 4, 64, 8, np.float16, "NHD")
    with pytest.raises(TypeError, match=r"numpy: key, value, value_cache.*cupy: key_cache|cupy: key_cache.*numpy: key"):
        cupaged.reshape_and_cache_flash(key, value, FakeDeviceArray(), cache, slots)
