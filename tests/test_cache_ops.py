"""Cache writes (reshape_and_cache_flash, reshape_and_cache, concat_and_cache_mla) and the whole-array
fp8 conversion (convert_fp8) against cupaged.reference, on the sim (and cuda when a GPU is present).

Caches start poisoned (0xFF bytes: NaN in every float format and in fp8) and results are compared
bytewise with the reference, which copies the original cache: every untouched slot must come back
bit-identical, and fp8 bytes must equal the reference's own quantization exactly.

The default run is a covering set (covering_set below): every kernel instantiation (dtype x
kv-cache dtype x slot dtype x vector / scalar path) once, and every two values of any two axes
(layout, head size, block size, scale kind, fused views, token count) together at least once; each
case checks that the instantiation it means to cover is the one launched. `-m slow` runs the full
product of the grid axes and the 64-bit offset cases (a cache past 2^31 elements, 2 GiB).
"""

from __future__ import annotations

import importlib
import itertools
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import _cache_args, cache_ops, reference
from cupaged.testing import poisoned
from tests.conftest import Backend

convert_fp8_module = importlib.import_module("cupaged.convert_fp8")  # (the package exports the function)

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
FP8 = ["fp8", "fp8_e5m2"]
KV_CACHE_DTYPES = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
SLOT_DTYPES = [np.int64, np.int32]


def dtype_id(d):
    return np.dtype(d).name


def covering_set(axes: dict, full=(), valid=lambda row: True) -> list[dict]:
    """Rows (dicts axis -> value) in which every two values of any two axes meet at least once
    (pairwise), with the axes named in ``full`` in their whole product; ``valid(partial row)`` rules
    combinations out. Greedy and deterministic: each other axis takes the value that meets the most
    pairs not met yet (the least used one on a tie)."""
    names = list(axes)
    order = {n: i for i, n in enumerate(names)}

    def pair(a, x, b, y):
        return (a, x, b, y) if order[a] < order[b] else (b, y, a, x)

    todo = {pair(a, x, b, y) for a, b in itertools.combinations(names, 2) for x in axes[a] for y in axes[b]
            if valid({a: x, b: y})}
    used = {n: dict.fromkeys(axes[n], 0) for n in names}
    rows = []

    def complete(row):
        for n in names:
            if n not in row:
                options = [v for v in axes[n] if valid({**row, n: v})]
                row[n] = max(options, key=lambda v: (sum(pair(a, row[a], n, v) in todo for a in row), -used[n][v]))
            used[n][row[n]] += 1
        todo.difference_update(pair(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2))
        rows.append(row)

    for values in itertools.product(*(axes[n] for n in full)):
        if valid(dict(zip(full, values))):
            complete(dict(zip(full, values)))
    while todo:
        a, x, b, y = min(todo, key=lambda p: (order[p[0]], order[p[2]], axes[p[0]].index(p[1]), axes[p[2]].index(p[3])))
        complete({a: x, b: y})
    return rows


def full_product(axes: dict, valid=lambda row: True) -> list[dict]:
    rows = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    return [r for r in rows if valid(r)]


def case_id(case: dict) -> str:
    def text(k, v):
        if k == "vec":
            return "vec" if v else "scalar"
        if k == "fused":
            return "fused" if v else "plain"
        if isinstance(v, bool):
            return k if v else f"no_{k}"
        if isinstance(v, type):
            return dtype_id(v)
        return f"{k[0]}{v}" if isinstance(v, int) else str(v)

    return "-".join(text(k, v) for k, v in case.items())


def kv_data(rng, num_tokens, num_kv_heads, head_size, dtype):
    """key/value [num_tokens, num_kv_heads, head_size], each contiguous."""
    shape = (num_tokens, num_kv_heads, head_size)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def kv_views(backend, rng, num_tokens, num_kv_heads, head_size, dtype, *, fused=False, aligned=True):
    """key/value [num_tokens, num_kv_heads, head_size] on the backend: two arrays, or with ``fused``
    the K and V slices of one QKV buffer [num_tokens, (2 q + 2 kv heads) * head_size]; not
    ``aligned``: views starting one element into their buffer (no 16-byte access is possible)."""
    hd, skew = num_kv_heads * head_size, 0 if aligned else 1
    if not fused and aligned:
        return tuple(backend.asarray(a) for a in kv_data(rng, num_tokens, num_kv_heads, head_size, dtype))
    first = 2 * hd if fused else 0
    buf = backend.asarray(rng.standard_normal((num_tokens, first + 2 * hd + skew)).astype(dtype))
    return (buf[:, first + skew:first + skew + hd].reshape(num_tokens, num_kv_heads, head_size),
            buf[:, first + skew + hd:first + skew + 2 * hd].reshape(num_tokens, num_kv_heads, head_size))


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


def record_launches(monkeypatch, family) -> list[list[str]]:
    """The template arguments of every kernel of ``family`` launched from now on, in order."""
    args = []
    function = family.function

    def record(name, xp):
        args.append(name[name.index("<") + 1:-1].split(", "))
        return function(name, xp)

    monkeypatch.setattr(family, "function", record)
    return args


@pytest.fixture
def launched(monkeypatch):
    return record_launches(monkeypatch, cache_ops.FAMILY)


def slot_type(slot_dtype) -> str:
    return "int" if np.dtype(slot_dtype) == np.int32 else "long long"


# ---------------------------------------------------------------- reshape_and_cache_flash
FLASH_GRID = dict(dtype=DTYPES, kv_cache_dtype=KV_CACHE_DTYPES, slot_dtype=SLOT_DTYPES, vec=[True, False],
                  layout=["NHD", "HND"], head_size=[64, 80, 120, 128, 256], block_size=[1, 5, 16, 32])
FLASH_VARIANTS = dict(scale_kind=["float", "array", "per_head"], fused=[False, True], num_tokens=[97, 42, 1])
FLASH_COVERING = covering_set({**FLASH_GRID, **FLASH_VARIANTS}, full=("dtype", "kv_cache_dtype", "slot_dtype", "vec"))


def flash_case(backend, launched, *, dtype, kv_cache_dtype, slot_dtype, vec, layout, head_size, block_size,
               scale_kind="float", fused=False, num_tokens=97, num_kv_heads=4):
    """One reshape_and_cache_flash call; ``vec``: the 16-byte path (aligned key/value), else views
    one element off alignment take the scalar one."""
    rng = np.random.default_rng(head_size * 100 + block_size * 3 + num_tokens)
    key, value = kv_views(backend, rng, num_tokens, num_kv_heads, head_size, dtype, fused=fused, aligned=vec)
    host_key, host_value = backend.to_numpy(key), backend.to_numpy(value)
    num_blocks = max(4, -(-2 * num_tokens // block_size))
    shape = (num_blocks, block_size, num_kv_heads, head_size) if layout == "NHD" else \
        (num_blocks, num_kv_heads, block_size, head_size)
    cache = poisoned(shape, dtype if kv_cache_dtype == "auto" else np.uint8)
    slots = random_slots(rng, num_tokens, num_blocks, block_size, 7 if num_tokens > 1 else 0).astype(slot_dtype)
    k_scale = fp8_scale(host_key, per_head=scale_kind == "per_head", kind=scale_kind)
    v_scale = fp8_scale(host_value, per_head=scale_kind == "per_head", kind=scale_kind)
    key_cache, value_cache = backend.asarray(cache), backend.asarray(cache)
    cupaged.reshape_and_cache_flash(key, value, key_cache, value_cache, backend.asarray(slots), kv_cache_dtype,
                                    k_scale, v_scale, layout=layout)
    assert launched[-1][2:] == [slot_type(slot_dtype), str(16 // np.dtype(dtype).itemsize if vec else 1)]
    ref_k, ref_v = reference.reshape_and_cache_flash(host_key, host_value, cache, cache, slots, kv_cache_dtype,
                                                     k_scale, v_scale, layout=layout)
    got_k, got_v = backend.to_numpy(key_cache), backend.to_numpy(value_cache)
    assert_bytes_equal(got_k, ref_k, "key_cache")
    assert_bytes_equal(got_v, ref_v, "value_cache")
    if kv_cache_dtype != "auto":
        keep = slots >= 0
        blocks, offsets = np.divmod(slots[keep].astype(np.int64), block_size)
        stored = got_k[blocks, offsets] if layout == "NHD" else got_k[blocks, :, offsets]
        scale = np.asarray(k_scale, np.float32).reshape(-1)
        check_dequantized(stored, scale[None, :, None] if scale.size > 1 else scale, kv_cache_dtype,
                          host_key[keep], "key")


@pytest.mark.parametrize("case", FLASH_COVERING, ids=list(map(case_id, FLASH_COVERING)))
def test_flash_covering_set(backend, launched, case):
    flash_case(backend, launched, **case)


@pytest.mark.slow
@pytest.mark.parametrize("case", full_product(FLASH_GRID), ids=case_id)
def test_flash_full_grid(backend, launched, case):
    flash_case(backend, launched, **case)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_flash_head_size_off_the_vector_width_takes_the_scalar_path(backend, launched, dtype):
    """head_size 66 is no multiple of any vector width (4 floats, 8 halves): aligned data, scalar kernel."""
    rng = np.random.default_rng(4)
    key, value = kv_data(rng, 19, 3, 66, dtype)
    cache = poisoned((6, 8, 3, 66), dtype)
    slots = random_slots(rng, 19, 6, 8, negative_every=4)
    kc, vc = backend.asarray(cache), backend.asarray(cache)
    cupaged.reshape_and_cache_flash(*on_backend(backend, key, value), kc, vc, backend.asarray(slots))
    assert launched[-1][3] == "1"
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


@pytest.mark.slow
def test_flash_64bit_offsets(backend, launched):
    """A cache past 2^31 elements (2 GiB of fp8: the K and V halves of one [num_blocks, 2, ...]
    buffer). Tokens written into blocks whose offset block_id * block stride passes 2^31 land where
    the reference puts them, with int64 and int32 slots, and the blocks around them stay untouched
    (32-bit offset arithmetic would wrap to a block near the start, or fault)."""
    block_size, num_kv_heads, head_size = 16, 2, 64
    block_stride = 2 * block_size * num_kv_heads * head_size  # elements of one block, K and V halves
    num_blocks = 2**31 // block_stride + 3
    targets = np.array([1, 2**31 // block_stride + 1, num_blocks - 3, num_blocks - 1])
    assert targets[1] * block_stride > 2**31
    combined = backend.empty((num_blocks, 2, block_size, num_kv_heads, head_size), np.uint8)
    watched = np.unique(np.concatenate([targets - 1, targets, np.minimum(targets + 1, num_blocks - 1)]))
    combined[backend.asarray(watched)] = 0xFF  # cuda's empty holds garbage: poison the blocks compared below
    before = backend.to_numpy(combined[backend.asarray(watched)])
    rng = np.random.default_rng(8)
    offsets = np.stack([rng.choice(block_size, 4, replace=False) for _ in targets])
    slots = rng.permutation((targets[:, None] * block_size + offsets).reshape(-1))
    slots = np.insert(slots, [3, 11], -1)  # padding tokens, skipped
    key, value = kv_data(rng, len(slots), num_kv_heads, head_size, np.float16)
    for part, slot_dtype in ((slice(0, 9), np.int64), (slice(9, None), np.int32)):
        cupaged.reshape_and_cache_flash(*on_backend(backend, key[part], value[part]), combined[:, 0], combined[:, 1],
                                        backend.asarray(slots[part].astype(slot_dtype)), "fp8", 0.05, 0.05)
        assert launched[-1][2] == slot_type(slot_dtype)
    local = np.where(slots < 0, -1, np.searchsorted(watched, slots // block_size) * block_size + slots % block_size)
    ref_k, ref_v = reference.reshape_and_cache_flash(key, value, before[:, 0], before[:, 1], local, "fp8", 0.05, 0.05)
    got = backend.to_numpy(combined[backend.asarray(watched)])
    assert_bytes_equal(got[:, 0], ref_k, "key half of the watched blocks")
    assert_bytes_equal(got[:, 1], ref_v, "value half of the watched blocks")


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


def vllm_valid(row):
    """fp8 packs x = 16 elements: head_size 120 is rejected (test_vllm_layout_rejects_head_120_fp8)."""
    return row.get("kv_cache_dtype", "auto") == "auto" or row.get("head_size", 64) % 16 == 0


VLLM_GRID = dict(dtype=DTYPES, kv_cache_dtype=["auto"] + FP8, slot_dtype=SLOT_DTYPES, vec=[True, False],
                 head_size=[64, 80, 120, 256], block_size=[8, 16, 32])
VLLM_VARIANTS = dict(per_head_scales=[False, True], fused=[False, True])
VLLM_COVERING = covering_set({**VLLM_GRID, **VLLM_VARIANTS}, full=("dtype", "kv_cache_dtype", "slot_dtype", "vec"),
                             valid=vllm_valid)


def vllm_case(backend, launched, *, dtype, kv_cache_dtype, slot_dtype, vec, head_size, block_size,
              per_head_scales=False, fused=False, num_kv_heads=8, num_tokens=42):
    rng = np.random.default_rng(head_size * 7 + block_size)
    key, value = kv_views(backend, rng, num_tokens, num_kv_heads, head_size, dtype, fused=fused, aligned=vec)
    host_key, host_value = backend.to_numpy(key), backend.to_numpy(value)
    num_blocks = -(-2 * num_tokens // block_size)
    kc0, vc0 = vllm_caches(num_blocks, num_kv_heads, head_size, block_size,
                           dtype if kv_cache_dtype == "auto" else np.uint8)
    slots = random_slots(rng, num_tokens, num_blocks, block_size, negative_every=6).astype(slot_dtype)
    k_scale, v_scale = fp8_scale(host_key, per_head_scales), fp8_scale(host_value, per_head_scales)
    kc, vc = backend.asarray(kc0), backend.asarray(vc0)
    cupaged.reshape_and_cache(key, value, kc, vc, backend.asarray(slots), kv_cache_dtype, k_scale, v_scale)
    assert launched[-1][2:] == [slot_type(slot_dtype), "true" if vec else "false"]
    ref_k, ref_v = reference.reshape_and_cache(host_key, host_value, kc0, vc0, slots, kv_cache_dtype, k_scale, v_scale)
    assert_bytes_equal(backend.to_numpy(kc), ref_k, "key_cache")
    assert_bytes_equal(backend.to_numpy(vc), ref_v, "value_cache")


@pytest.mark.parametrize("case", VLLM_COVERING, ids=list(map(case_id, VLLM_COVERING)))
def test_vllm_layout_covering_set(backend, launched, case):
    vllm_case(backend, launched, **case)


@pytest.mark.slow
@pytest.mark.parametrize("case", full_product(VLLM_GRID, vllm_valid), ids=case_id)
def test_vllm_layout_full_grid(backend, launched, case):
    vllm_case(backend, launched, **case)


def test_vllm_layout_rejects_head_120_fp8(backend):
    key, value = kv_data(np.random.default_rng(0), 4, 2, 120, np.float16)
    kc = backend.asarray(np.zeros((4, 2, 7, 8, 16), np.uint8))
    vc = backend.asarray(np.zeros((4, 2, 120, 8), np.uint8))
    before = backend.to_numpy(kc).copy()
    with pytest.raises(ValueError, match=r"head_size=120.*multiple of 16"):
        cupaged.reshape_and_cache(*on_backend(backend, key, value), kc, vc, backend.asarray(np.arange(4)), "fp8")
    assert np.array_equal(backend.to_numpy(kc), before)


# ---------------------------------------------------------------- concat_and_cache_mla
MLA_GRID = dict(dtype=DTYPES, kv_cache_dtype=["auto"] + FP8, slot_dtype=SLOT_DTYPES, block_size=[1, 5, 16])
MLA_COVERING = covering_set(MLA_GRID, full=("dtype", "kv_cache_dtype", "slot_dtype"))


def mla_case(backend, launched, *, dtype, kv_cache_dtype, slot_dtype, block_size):
    rng = np.random.default_rng(9)
    num_tokens, rank, rope = 37, 512, 64
    num_blocks = -(-2 * num_tokens // block_size)
    kv_c = rng.standard_normal((num_tokens, rank + 32)).astype(dtype)[:, :rank]  # strided view
    k_pe = rng.standard_normal((num_tokens, rope)).astype(dtype)
    cache0 = poisoned((num_blocks, block_size, rank + rope), dtype if kv_cache_dtype == "auto" else np.uint8)
    slots = random_slots(rng, num_tokens, num_blocks, block_size, negative_every=4).astype(slot_dtype)
    scale = fp8_scale(np.concatenate([kv_c, k_pe], axis=1), kind="array")
    cache = backend.asarray(cache0)
    cupaged.concat_and_cache_mla(*on_backend(backend, kv_c, k_pe), cache, backend.asarray(slots), kv_cache_dtype, scale)
    assert launched[-1][2] == slot_type(slot_dtype)
    ref = reference.concat_and_cache_mla(kv_c, k_pe, cache0, slots, kv_cache_dtype, scale)
    assert_bytes_equal(backend.to_numpy(cache), ref, "kv_cache")


@pytest.mark.parametrize("case", MLA_COVERING, ids=list(map(case_id, MLA_COVERING)))
def test_concat_and_cache_mla_covering_set(backend, launched, case):
    mla_case(backend, launched, **case)


@pytest.mark.slow
@pytest.mark.parametrize("case", full_product(MLA_GRID), ids=case_id)
def test_concat_and_cache_mla_full_grid(backend, launched, case):
    mla_case(backend, launched, **case)


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


# ---------------------------------------------------------------- arrays that overlap, arrays missing
def _flash_args(backend):
    a = _valid(backend)
    return a, lambda **change: cupaged.reshape_and_cache_flash(**{**a, **change})


def _vllm_args(backend):
    key, value = kv_data(np.random.default_rng(0), 4, 2, 64, np.float16)
    kc, vc = (backend.asarray(c) for c in vllm_caches(4, 2, 64, 8, np.float16))
    a = dict(key=backend.asarray(key), value=backend.asarray(value), key_cache=kc, value_cache=vc,
             slot_mapping=backend.asarray(np.arange(4)))
    return a, lambda **change: cupaged.reshape_and_cache(**{**a, **change})


def _mla_args(backend):
    a = dict(kv_c=backend.asarray(np.ones((5, 512), np.float16)), k_pe=backend.asarray(np.ones((5, 64), np.float16)),
             kv_cache=backend.asarray(poisoned((4, 16, 576), np.float16)), slot_mapping=backend.asarray(np.arange(5)))
    return a, lambda **change: cupaged.concat_and_cache_mla(**{**a, **change})


OVERLAPS = {  # op, the change, the two arguments the error names
    "flash: one array as both caches": (_flash_args, lambda a: {"value_cache": a["key_cache"]},
                                        ("key_cache", "value_cache")),
    "flash: key a view of key_cache": (_flash_args, lambda a: {"key": a["key_cache"].reshape(-1, 4, 64)[:10]},
                                       ("key_cache", "key")),
    "flash: value a view of value_cache": (_flash_args, lambda a: {"value": a["value_cache"].reshape(-1, 4, 64)[5:15]},
                                           ("value_cache", "value")),
    "flash: caches two blocks apart": (_flash_args, lambda a: {"key_cache": a["key_cache"][:4],
                                                               "value_cache": a["key_cache"][2:6]},
                                       ("key_cache", "value_cache")),
    "vllm: value_cache a view of key_cache": (_vllm_args,
                                              lambda a: {"value_cache": a["key_cache"].reshape(4, 2, 64, 8)},
                                              ("key_cache", "value_cache")),
    "vllm: key a view of value_cache": (_vllm_args, lambda a: {"key": a["value_cache"].reshape(-1, 2, 64)[:4]},
                                        ("value_cache", "key")),
    "mla: kv_c a view of kv_cache": (_mla_args, lambda a: {"kv_c": a["kv_cache"].reshape(-1, 576)[3:8, :512]},
                                     ("kv_cache", "kv_c")),
    "mla: k_pe a view of kv_cache": (_mla_args, lambda a: {"k_pe": a["kv_cache"].reshape(-1, 576)[:5, 512:]},
                                     ("kv_cache", "k_pe")),
}


@pytest.mark.parametrize("case", OVERLAPS)
def test_cache_writes_reject_arrays_that_share_memory(backend, case):
    """A cache written over its own input, or both caches in one array, is a ValueError naming both arrays
    (before: accepted, the cache corrupted); nothing is written. Interleaved views that share no byte pass
    (test_flash_caches_as_views_of_one_buffer)."""
    make, change, (first, second) = OVERLAPS[case]
    a, call = make(backend)
    caches = [name for name in ("key_cache", "value_cache", "kv_cache") if name in a]
    before = [backend.to_numpy(a[c]).copy() for c in caches]
    with pytest.raises(ValueError, match=rf"^{first} and {second} share memory"):
        call(**change(a))
    for c, b in zip(caches, before):
        assert_bytes_equal(backend.to_numpy(a[c]), b, f"{c} after a rejected call")


@pytest.mark.parametrize("make", [_flash_args, _vllm_args, _mla_args], ids=["flash", "vllm", "mla"])
def test_cache_writes_name_a_missing_array(make):
    """None for any array is a TypeError naming it (before: an AttributeError on None.ndim)."""
    a, call = make(Backend("sim"))
    for name in a:
        with pytest.raises(TypeError, match=rf"^{name} must be a numpy or cupy array"):
            call(**{name: None})


def test_layouts_give_numpys_exact_overlap():
    """check_no_overlap's path for device arrays: numpy's exact test on a stand-in with the same address,
    shape and strides agrees with the test on the arrays themselves."""
    kv = np.zeros((6, 2, 8, 4, 64), np.float16)
    qkv = np.zeros((10, 12, 64), np.float16)
    pairs = [(kv[:, 0], kv[:, 1]), (kv[:, 0], kv[:, 0, 1:]), (kv[:, 1], kv[:, 1, ::-1]), (qkv[:, :8], qkv[:, 8:10]),
             (qkv[:, :8], qkv[:, 7:9]), (kv, qkv), (kv[:0], kv)]
    for a, b in pairs:
        assert np.shares_memory(_cache_args.layout(a), _cache_args.layout(b)) == np.shares_memory(a, b)


# ---------------------------------------------------------------- convert_fp8 (whole arrays, vLLM's test helper)
def convert_data(rng, shape, dtype, scale):
    """Values whose x / scale spans every fp8 range (log-uniform 2^-20 .. 2^18, both signs: codes that round
    to 0, subnormal codes, normal ones, values past ±448 and ±57344), the specials first: NaN of both signs,
    ±inf, ±0, just past e4m3's 464 rounding threshold."""
    n = int(np.prod(shape))
    x = np.exp2(rng.uniform(-20, 18, n)) * rng.choice([-1.0, 1.0], n) * scale
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 465.0 * scale, -1e5 * scale])
    x[:min(n, specials.size)] = specials[:n]
    with np.errstate(over="ignore"):  # past float16's 65504: inf, as intended
        return x.astype(dtype).reshape(shape)


def assert_same_values(got, ref, name):
    """Bit-identical floats but for NaN payloads: any NaN matches any NaN."""
    got, ref = np.array(got, copy=True).reshape(-1), np.array(ref, copy=True).reshape(-1)
    nan = np.isnan(ref.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan), f"{name}: NaNs at other places than the reference's"
    got[nan], ref[nan] = 0, 0
    assert_bytes_equal(got, ref, name)


def convert_both_ways(backend, x, scale, kv_dtype):
    """x quantized by convert_fp8 into poisoned codes and back into a poisoned array of x's dtype, each checked
    against the reference exactly; returns (codes, back) as numpy."""
    codes = backend.asarray(poisoned(x.shape, np.uint8))
    cupaged.convert_fp8(codes, backend.asarray(x), scale, kv_dtype)
    want = reference.convert_fp8(codes, x, scale, kv_dtype)
    assert_bytes_equal(backend.to_numpy(codes), want, "codes")
    back = backend.asarray(poisoned(x.shape, x.dtype))
    cupaged.convert_fp8(back, codes, scale, kv_dtype)
    assert_same_values(backend.to_numpy(back), reference.convert_fp8(back, want, scale, kv_dtype), "dequantized")
    return backend.to_numpy(codes), backend.to_numpy(back)


@pytest.mark.parametrize("scale", [1.0, 0.05, "array 3.7"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kv_dtype", FP8)
def test_convert_fp8_round_trip(backend, launched, kv_dtype, dtype, scale):
    """[5, 97] values (16-byte steps and a tail) to codes and back: bit-exact against the reference both ways,
    and the round trip itself within half an fp8 ulp, saturated to ±max · scale, NaN kept."""
    value = 3.7 if scale == "array 3.7" else scale
    arg = np.array([value], np.float32) if scale == "array 3.7" else value
    x = convert_data(np.random.default_rng(11), (5, 97), dtype, value)
    codes, back = convert_both_ways(backend, x, arg, kv_dtype)
    kv = _cache_args.KV_CODE[kv_dtype]
    ctype = cache_ops.CTYPE[np.dtype(dtype)]
    assert launched[-2:] == [[ctype, kv, "true"], [ctype, kv, "false"]]
    limit = np.float32(ml_dtypes.finfo(reference.FP8[kv_dtype]).max)
    q = x.astype(np.float32) / np.float32(value)
    nan, saturated = np.isnan(q), np.abs(q) > limit
    assert np.array_equal(np.isnan(back.astype(np.float32)), nan)
    with np.errstate(over="ignore"):  # e5m2's 57344 · 3.7 is inf as a float16
        assert np.array_equal(back[saturated], (np.sign(q[saturated]) * limit * np.float32(value)).astype(dtype))
    fine = ~nan & ~saturated
    check_dequantized(codes[fine], np.float32(value), kv_dtype, x[fine].astype(np.float32), "round trip")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kv_dtype", FP8)
def test_convert_fp8_dequantizes_every_code(backend, kv_dtype, dtype):
    """All 256 codes, three scales, exactly as the reference; a few codes against their known values."""
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    known = {"fp8": {0x7E: 448.0, 0xFE: -448.0, 0x01: 2.0**-9, 0x38: 1.0, 0x80: -0.0},
             "fp8_e5m2": {0x7B: 57344.0, 0xFB: -57344.0, 0x7C: np.inf, 0xFC: -np.inf, 0x01: 2.0**-16, 0x3C: 1.0}}
    for scale in (1.0, 0.37, 1e-3):
        out = backend.asarray(poisoned(codes.shape, dtype))
        cupaged.convert_fp8(out, *on_backend(backend, codes), scale, kv_dtype)
        got = backend.to_numpy(out).reshape(-1)
        assert_same_values(got, reference.convert_fp8(got, codes.reshape(-1), scale, kv_dtype), f"scale {scale}")
        if scale == 1.0:
            assert np.isnan(np.float32(got[0x7F])) and np.isnan(np.float32(got[0xFF]))
            for code, value in known[kv_dtype].items():
                assert np.float32(got[code]) == value and np.signbit(np.float32(got[code])) == np.signbit(value), \
                    f"code {code:#04x}: {got[code]} != {value}"


@pytest.mark.parametrize("kv_dtype, values, codes", [
    ("fp8", [1000, -1000, np.inf, -np.inf, np.nan, -np.nan, 0.5, -0.0, 464, -1e-4],
     [0x7E, 0xFE, 0x7E, 0xFE, 0x7F, 0x7F, 0x30, 0x80, 0x7E, 0x80]),
    ("fp8_e4m3", [448, 2.0**-9, 3 * 2.0**-10, 2.0**-10, 240, 232],
     [0x7E, 0x01, 0x02, 0x00, 0x77, 0x76]),
    ("fp8_e5m2", [1e5, -1e5, np.inf, -np.inf, np.nan, -np.nan, 0.5, -0.0, 61440, 2.0**-16],
     [0x7B, 0xFB, 0x7B, 0xFB, 0x7F, 0x7F, 0x38, 0x80, 0x7B, 0x01]),
], ids=["e4m3 saturation and NaN", "e4m3 subnormals and ties to even", "e5m2 saturation and NaN"])
def test_convert_fp8_codes_as_cuda_satfinite_makes_them(backend, kv_dtype, values, codes):
    """Hand-written codes (not the reference's): saturation to the largest finite code, NaN of either sign to
    0x7F as __NV_SATFINITE does, -0 kept, underflow to ±0, ties to even (2^-10 -> 0; 232 between 224 and 240)."""
    x = np.array(values, np.float32)
    out = backend.asarray(poisoned(x.shape, np.uint8))
    cupaged.convert_fp8(out, *on_backend(backend, x), 1.0, kv_dtype)
    assert backend.to_numpy(out).tolist() == codes


SHAPES = [(), (1,), (97,), (15,), (16,), (2, 3, 17), (4, 16, 2, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_convert_fp8_any_shape(backend, shape):
    """0-d, 1 element, fewer and exactly one 16-byte step, odd sizes, a [num_blocks, block_size, heads, head]
    cache; the dtype and format rotate with the shape."""
    i = SHAPES.index(shape)
    x = convert_data(np.random.default_rng(i), shape, DTYPES[i % 3], 0.5)
    convert_both_ways(backend, x, 0.5, FP8[i % 2])


@pytest.mark.parametrize("shape", [(0,), (3, 0, 5)], ids=["0", "3x0x5"])
def test_convert_fp8_empty_arrays_launch_nothing(backend, launched, shape):
    codes, x = backend.asarray(np.zeros(shape, np.uint8)), backend.asarray(np.zeros(shape, np.float16))
    cupaged.convert_fp8(codes, x, 2.0)
    cupaged.convert_fp8(x, codes, 2.0, "fp8_e5m2")
    assert launched == []
    with pytest.raises(ValueError, match="scale"):  # still checked
        cupaged.convert_fp8(codes, x, 0.0)


@pytest.mark.parametrize("aligned", [True, False], ids=["vec", "scalar"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_convert_fp8_grid_stride_and_unaligned_views(backend, monkeypatch, dtype, aligned):
    """One CTA (the grid cap lowered to 1) loops over 4001 elements; views one element into their buffers
    (C-contiguous but not 16-byte aligned) take the element-by-element path, with the same results."""
    monkeypatch.setattr(convert_fp8_module, "MAX_BLOCKS", 1)
    n, skew = 4001, 0 if aligned else 1
    x = convert_data(np.random.default_rng(3), (n + skew,), dtype, 1.0)
    src = backend.asarray(x)[skew:]
    codes_buf = backend.asarray(poisoned((n + skew,), np.uint8))
    cupaged.convert_fp8(codes_buf[skew:], src, 1.0, "fp8")
    want = reference.convert_fp8(np.uint8(0), x[skew:], 1.0, "fp8")
    got = backend.to_numpy(codes_buf)
    assert_bytes_equal(got[skew:], want, "codes")
    assert got[:skew].tolist() == [0xFF] * skew, "the byte before the view was written"
    back_buf = backend.asarray(poisoned((n + skew,), dtype))
    cupaged.convert_fp8(back_buf[skew:], codes_buf[skew:], 1.0, "fp8")
    assert_same_values(backend.to_numpy(back_buf)[skew:], reference.convert_fp8(x, want, 1.0, "fp8"), "dequantized")
    assert convert_fp8_module.vectorized(codes_buf[skew:], src) == aligned
    assert convert_fp8_module.vectorized(back_buf[skew:], codes_buf[skew:]) == aligned


def test_convert_fp8_as_vllms_tests_use_it(backend):
    """vLLM's test_fp8_e4m3_conversion: a float16 cache to fp8 and back, close to itself."""
    rng = np.random.default_rng(12)
    cache = backend.asarray(rng.uniform(-224, 224, (8, 16, 4, 64)).astype(np.float16))
    cache_fp8 = backend.xp.empty_like(cache, dtype=np.uint8)
    cupaged.convert_fp8(cache_fp8, cache, 1.0, kv_dtype="fp8")
    converted = backend.xp.empty_like(cache)
    cupaged.convert_fp8(converted, cache_fp8, 1.0, kv_dtype="fp8")
    got, want = backend.to_numpy(converted).astype(np.float32), backend.to_numpy(cache).astype(np.float32)
    assert np.all(np.abs(got - want) <= 1e-3 + 0.0625 * np.abs(want))


def _convert_args(backend):
    x = np.random.default_rng(4).standard_normal((4, 8, 16)).astype(np.float16)
    return dict(dst=backend.asarray(poisoned(x.shape, np.uint8)), src=backend.asarray(x), scale=0.5, kv_dtype="fp8")


def _read_only(a):
    view = a[...]
    view.flags.writeable = False
    return view


CONVERT_BAD_INPUTS = {  # change(args, backend), exception, the argument the message names
    "kv_dtype unknown": (lambda a, b: {"kv_dtype": "int8"}, ValueError, "kv_dtype"),
    "kv_dtype auto": (lambda a, b: {"kv_dtype": "auto"}, ValueError, "kv_dtype='auto'"),
    "kv_dtype not a string": (lambda a, b: {"kv_dtype": 3}, ValueError, "kv_dtype"),
    "dst float for float src": (lambda a, b: {"dst": b.asarray(np.zeros((4, 8, 16), np.float16))}, TypeError, "dst"),
    "src float64": (lambda a, b: {"src": b.asarray(np.zeros((4, 8, 16)))}, TypeError, "src"),
    "src int8": (lambda a, b: {"src": b.asarray(np.zeros((4, 8, 16), np.int8))}, TypeError, "src"),
    "both uint8": (lambda a, b: {"src": b.asarray(np.zeros((4, 8, 16), np.uint8))}, TypeError, "dst"),
    "dst float64 for codes": (lambda a, b: {"src": b.asarray(np.zeros((4, 8, 16), np.uint8)),
                                            "dst": b.asarray(np.zeros((4, 8, 16)))}, TypeError, "dst"),
    "shape mismatch": (lambda a, b: {"src": a["src"][:3]}, ValueError, "dst must have src's shape"),
    "same size, other shape": (lambda a, b: {"src": a["src"].reshape(8, 4, 16)}, ValueError, "dst"),
    "src not contiguous": (lambda a, b: {"src": b.asarray(np.zeros((4, 8, 32), np.float16))[..., ::2]},
                           ValueError, "src must be C-contiguous"),
    "dst transposed": (lambda a, b: {"dst": b.asarray(np.zeros((16, 8, 4), np.uint8)).T}, ValueError,
                       "dst must be C-contiguous"),
    "dst shares src's memory": (lambda a, b: {"dst": a["src"].reshape(-1).view(np.uint8)[:512].reshape(4, 8, 16)},
                                ValueError, "dst and src share memory"),
    "dst None": (lambda a, b: {"dst": None}, TypeError, "dst"),
    "src a list": (lambda a, b: {"src": [[1.0]]}, TypeError, "src"),
    "scale zero": (lambda a, b: {"scale": 0.0}, ValueError, "scale"),
    "scale negative": (lambda a, b: {"scale": -1.0}, ValueError, "scale"),
    "scale nan": (lambda a, b: {"scale": float("nan")}, ValueError, "scale"),
    "scale inf": (lambda a, b: {"scale": float("inf")}, ValueError, "scale"),
    "scale 0 as a float32": (lambda a, b: {"scale": 1e-50}, ValueError, "scale"),
    "scale inf as a float32": (lambda a, b: {"scale": 1e39}, ValueError, "scale"),
    "scale string": (lambda a, b: {"scale": "1"}, TypeError, "scale"),
    "scale bool": (lambda a, b: {"scale": True}, TypeError, "scale"),
    "scale float64 array": (lambda a, b: {"scale": np.ones(1)}, TypeError, "scale"),
    "scale of 2 values": (lambda a, b: {"scale": np.ones(2, np.float32)}, ValueError, "scale"),
    "scale 0 under validate": (lambda a, b: {"scale": np.zeros(1, np.float32), "validate": True}, ValueError,
                               r"scale\[0\]"),
    "dst read-only (numpy)": (lambda a, b: {"dst": _read_only(a["dst"])}, ValueError, "dst is read-only"),
}


@pytest.mark.parametrize("case", CONVERT_BAD_INPUTS)
def test_convert_fp8_bad_input_raises_before_any_launch(backend, launched, case):
    change, exc, match = CONVERT_BAD_INPUTS[case]
    if case.endswith("(numpy)") and backend.name != "sim":
        pytest.skip("read-only arrays are numpy's")
    a = _convert_args(backend)
    before = {k: backend.to_numpy(a[k]).copy() for k in ("dst", "src")}
    with pytest.raises(exc, match=match):
        cupaged.convert_fp8(**{**a, **change(a, backend)})
    assert launched == []
    for k, b in before.items():
        assert_bytes_equal(backend.to_numpy(a[k]), b, f"{k} after a rejected call")
