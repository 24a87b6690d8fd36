"""make_tensor_map (cupaged/_tensor_map.py): the sim's 128-byte encoding field by field, the checks of
cuTensorMapEncodeTiled's documented requirements (the same errors for numpy and cupy arrays, before any driver
call), the cuda path's driver call through a fake cuda-bindings, and on a GPU the driver's map passed by value."""

from __future__ import annotations

import gc
import os
import re
import struct
import sys
import types
import weakref

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import sim
from cupaged._cuda_paths import cuda_include_dirs
from cupaged._tensor_map import CUDA_DTYPE, SIM_DTYPE, make_tensor_map
from tests import fake_cupy
from tests.conftest import Backend, cuda_arch_at_least, gpu_available, raw_module

SIM_LAYOUT = "<IIQ5Q4Q5I5BBBBB11s"  # magic rank address dims strides box element-strides size swizzle oob type
DTYPES = [(np.uint8, 0), (np.int8, 0), (ml_dtypes.float8_e4m3fn, 0), (ml_dtypes.float8_e5m2, 0), (np.uint16, 1),
          (np.int16, 1), (np.float16, 6), (ml_dtypes.bfloat16, 9), (np.uint32, 2), (np.int32, 3), (np.float32, 7),
          (np.uint64, 4), (np.int64, 5), (np.float64, 8)]  # CUtensorMapDataType of each


def decode(m) -> dict:
    assert len(bytes(m)) == 128 == struct.calcsize(SIM_LAYOUT)
    v = struct.unpack(SIM_LAYOUT, bytes(m))
    return dict(magic=v[0], rank=v[1], address=v[2], dims=v[3:8], strides=v[8:12], box=v[12:17], steps=v[17:22],
                size=v[22], swizzle=v[23], oob=v[24], type=v[25], reserved=v[26])


def expected(a, box, steps, swizzle: int, data_type: int) -> dict:
    """The encoding, dimension i counted from the innermost (numpy axis rank - 1 - i), unused entries 0."""
    r, pad = a.ndim, lambda values, n=5: tuple(values) + (0,) * (n - len(values))
    inner = [r - 1 - i for i in range(r)]
    return dict(magic=0x4D545043, rank=r, address=a.__array_interface__["data"][0],
                dims=pad([a.shape[k] for k in inner]), strides=pad([a.strides[k] for k in inner[1:]], 4),
                box=pad([box[k] for k in inner]), steps=pad([steps[k] for k in inner]), size=a.itemsize,
                swizzle=swizzle, oob=0, type=data_type, reserved=bytes(11))


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype,code", DTYPES, ids=[np.dtype(d).name for d, _ in DTYPES])
def test_sim_encoding_field_by_field(rank, dtype, code):
    itemsize = np.dtype(dtype).itemsize
    a = sim.zeros((3, 2, 5, 4, 64 // itemsize)[5 - rank:], dtype)
    box = (2, 1, 3, 4, 16 // itemsize)[5 - rank:]
    m = make_tensor_map(a, box)
    assert isinstance(m, np.void) and m.dtype == SIM_DTYPE and m.dtype.itemsize == 128
    assert decode(m) == expected(a, box, (1,) * rank, 0, code)


@pytest.mark.parametrize("swizzle,code,inner", [("none", 0, 64), ("32B", 1, 8), ("64B", 2, 16), ("128B", 3, 32)])
def test_swizzle_and_element_strides(swizzle, code, inner):
    a = sim.zeros((2, 16, 64), np.float32)
    m = make_tensor_map(a, (1, 8, inner), element_strides=(1, 2, 8), swizzle=swizzle)
    assert decode(m) == expected(a, (1, 8, inner), (1, 2, 8), code, 7)


def test_strided_views_encode_their_own_address_and_strides():
    base = sim.zeros((8, 6, 64), np.float16)
    a = base[1::2, 1:5, 8:40]  # every outer dimension strided, the inner one contiguous
    m = make_tensor_map(a, (2, 4, 16))
    assert decode(m) == expected(a, (2, 4, 16), (1, 1, 1), 0, 6)
    assert decode(m)["address"] == base.__array_interface__["data"][0] + (6 * 64 + 64 + 8) * 2
    assert decode(m)["strides"][:2] == (128, 2 * 6 * 128)
    t = sim.zeros((64, 16), np.float32).T[:, :8].T  # a transpose back: outer stride 64, inner contiguous
    assert decode(make_tensor_map(t, (8, 4)))["strides"][0] == 64


def test_the_map_is_aligned_read_only_and_keeps_its_array_alive():
    a = sim.zeros((4, 32), np.float32)
    ref = weakref.ref(a)
    m = make_tensor_map(a, (4, 32))
    assert np.frombuffer(m, np.uint8).ctypes.data % 128 == 0
    with pytest.raises(ValueError, match="read-only"):
        m["rank"] = 3
    del a
    assert gc.collect() >= 0 and ref() is not None
    del m
    assert gc.collect() >= 0 and ref() is None


def test_views_of_guarded_memory_from_other_libraries_are_accepted():
    a = sim.zeros((4, 32), np.float32)  # as a torch CPU tensor over sim memory: numpy's view loses the base chain
    torch_like = types.SimpleNamespace(__dlpack__=a.__dlpack__, __dlpack_device__=a.__dlpack_device__)
    assert decode(make_tensor_map(torch_like, (2, 8)))["address"] == a.__array_interface__["data"][0]
    assert hasattr(make_tensor_map, "__wrapped__")  # @accepts_foreign_arrays, as every public op


def test_only_arrays_in_guarded_memory_are_mapped():
    with pytest.raises(TypeError, match="^array must be a numpy or cupy array, got list"):
        make_tensor_map([1.0, 2.0], (2,))
    with pytest.raises(ValueError, match=r"^array must live in the sim's guarded memory: make it with "
                                         r"cupaged\.sim\.asarray"):
        make_tensor_map(np.zeros((8, 64), np.float32), (4, 8))
    with pytest.raises(ValueError, match="^box entries must each be 1 to 256"):  # the field checks come first
        make_tensor_map(np.zeros((8, 64), np.float32), (0, 8))


F32 = lambda shape=(8, 64): sim.zeros(shape, np.float32)  # noqa: E731
_strided = lambda shape, strides: np.lib.stride_tricks.as_strided(F32(), shape, strides, writeable=False)  # noqa
BAD = [  # (id, array, box, keywords, exception, message start)
    ("rank-0", lambda: F32(()), (), {}, ValueError, "array must have 1 to 5 dimensions"),
    ("rank-6", lambda: F32((1, 1, 1, 1, 1, 4)), (1,) * 6, {}, ValueError, "array must have 1 to 5 dimensions"),
    ("complex", lambda: sim.zeros((4, 8), np.complex64), (4, 2), {}, TypeError, "array must have one of the dtypes"),
    ("bool", lambda: sim.zeros((4, 16), np.bool_), (4, 16), {}, TypeError, "array must have one of the dtypes"),
    ("dim>2^32", lambda: _strided((2**32 + 1, 16), (64, 4)), (1, 4), {}, ValueError,
     "array's dimensions must each be 1 to 2^32"),
    ("inner-strided", lambda: F32()[:, ::2], (4, 8), {}, ValueError, "array must be contiguous in its last dimension"),
    ("stride-20", lambda: F32((4, 5)), (4, 4), {}, ValueError, "array's stride of dimension 0 must be a positive "
                                                               "multiple of 16 bytes below 2^40"),
    ("stride-0", lambda: np.broadcast_to(F32((1, 16)), (3, 16)), (1, 4), {}, ValueError,
     "array's stride of dimension 0 must be a positive multiple of 16"),
    ("stride<0", lambda: F32()[::-1], (4, 8), {}, ValueError, "array's stride of dimension 0 must be a positive"),
    ("stride-2^40", lambda: _strided((2, 16), (2**40, 4)), (1, 4), {}, ValueError,
     "array's stride of dimension 0 must be a positive multiple of 16 bytes below 2^40"),
    ("misaligned", lambda: F32((4, 36))[:, 1:], (4, 4), {}, ValueError, "array's data must be 16-byte aligned"),
    ("box-length", F32, (4,), {}, ValueError, "box must have 2 entries (one per dimension of array, outermost"),
    ("box-int", F32, 4, {}, TypeError, "box must be a sequence of 2 ints"),
    ("box-str", F32, "48", {}, TypeError, "box must be a sequence of 2 ints"),
    ("box-float", F32, (4, 8.0), {}, TypeError, "box entries must be ints, got float 8.0"),
    ("box-bool", F32, (True, 8), {}, TypeError, "box entries must be ints, got bool True"),
    ("box-0", F32, (0, 8), {}, ValueError, r"box entries must each be 1 to 256 (boxDim), got (0, 8)"),
    ("box-257", F32, (257, 8), {}, ValueError, "box entries must each be 1 to 256"),
    ("box-8-bytes", F32, (4, 2), {}, ValueError,
     "box's innermost entry times the itemsize must be a multiple of 16 bytes, got 2 x 4 = 8 bytes"),
    ("steps-length", F32, (4, 8), dict(element_strides=(1,)), ValueError, "element_strides must have 2 entries"),
    ("steps-0", F32, (4, 8), dict(element_strides=(0, 1)), ValueError, "element_strides entries must each be 1 to 8"),
    ("steps-9", F32, (4, 8), dict(element_strides=(1, 9)), ValueError, "element_strides entries must each be 1 to 8"),
    ("steps-float", F32, (4, 8), dict(element_strides=(1.5, 1)), TypeError, "element_strides entries must be ints"),
    ("swizzle-256B", F32, (4, 8), dict(swizzle="256B"), ValueError,
     "swizzle must be one of 'none', '32B', '64B', '128B', got '256B'"),
    ("swizzle-int", F32, (4, 8), dict(swizzle=128), ValueError, "swizzle must be one of"),
    ("span-32B", F32, (4, 16), dict(swizzle="32B"), ValueError, "box's innermost extent must not pass the swizzle "
                                                                "span: swizzle='32B' allows 32 bytes, got 16 x 4 = 64"),
    ("span-128B", F32, (4, 64), dict(swizzle="128B"), ValueError, "box's innermost extent must not pass the swizzle"),
]


@pytest.mark.parametrize("make,box,kwargs,exc,match", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_each_requirement_is_checked_by_name(make, box, kwargs, exc, match):
    with pytest.raises(exc, match="^" + re.escape(match)):
        make_tensor_map(make(), box, **kwargs)


def test_the_limits_themselves_pass():
    a = sim.zeros((2, 256), np.uint8)
    assert decode(make_tensor_map(a, (256, 256), element_strides=(8, 8)))["box"][:2] == (256, 256)
    assert decode(make_tensor_map(a, (1, 128), swizzle="128B"))["swizzle"] == 3
    assert decode(make_tensor_map(sim.zeros(16, np.uint8), (16,)))["strides"] == (0, 0, 0, 0)  # rank 1: none


# ------------------------------------------------------------------ the cuda path, through a fake cupy and driver
class FakeDriver(types.ModuleType):
    """cuda.bindings.driver as far as make_tensor_map uses it: records each encode call."""

    def __init__(self):
        super().__init__("cuda.bindings.driver")
        self.calls, self.result = [], 0
        self.cuuint32_t, self.cuuint64_t = (lambda v: ("u32", v)), (lambda v: ("u64", v))
        self.CUtensorMapDataType, self.CUtensorMapSwizzle = (lambda v: ("type", v)), (lambda v: ("swizzle", v))
        self.CUtensorMapInterleave = types.SimpleNamespace(CU_TENSOR_MAP_INTERLEAVE_NONE=("interleave", 0))
        self.CUtensorMapL2promotion = types.SimpleNamespace(CU_TENSOR_MAP_L2_PROMOTION_L2_128B=("l2", 2))
        self.CUtensorMapFloatOOBfill = types.SimpleNamespace(CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE=("oob", 0))
        self.cuGetErrorName = lambda res: (0, b"CUDA_ERROR_INVALID_VALUE")

    def cuTensorMapEncodeTiled(self, *args):  # noqa: N802 (the driver's name)
        self.calls.append(args)
        return self.result, types.SimpleNamespace(opaque=[0x0101010101010101 * (i + 1) for i in range(16)])


@pytest.fixture
def fake_gpu(monkeypatch):
    """(driver, device_array): a fake cupy whose arrays mirror a numpy array's layout and address, and a fake
    cuda-bindings driver."""
    cupy = fake_cupy.install(monkeypatch)
    cupy.cuda.runtime.setDevice = lambda device: None

    class DeviceArray(cupy.ndarray):
        def __init__(self, host):
            self.shape, self.strides, self.dtype, self.ndim = host.shape, host.strides, host.dtype, host.ndim
            self.data, self.device = types.SimpleNamespace(ptr=host.__array_interface__["data"][0]), cupy.cuda.Device()

    driver = FakeDriver()
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    for name, module in (("cuda", types.ModuleType("cuda")), ("cuda.bindings", bindings),
                         ("cuda.bindings.driver", driver)):
        monkeypatch.setitem(sys.modules, name, module)
    return driver, DeviceArray


@pytest.mark.parametrize("make,box,kwargs,exc,match", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_cupy_arrays_get_the_same_errors_before_any_driver_call(fake_gpu, make, box, kwargs, exc, match):
    driver, device_array = fake_gpu
    host = make()
    with pytest.raises(exc) as on_sim:
        make_tensor_map(host, box, **kwargs)
    with pytest.raises(exc) as on_gpu:
        make_tensor_map(device_array(host), box, **kwargs)
    assert str(on_gpu.value) == str(on_sim.value)
    assert driver.calls == []


def test_cuda_path_calls_the_driver_innermost_first(fake_gpu):
    driver, device_array = fake_gpu
    host = sim.zeros((6, 4, 64), np.float16)[1:5]
    m = make_tensor_map(device_array(host), (2, 4, 32), element_strides=(1, 2, 1), swizzle="64B")
    assert driver.calls == [(
        ("type", 6), ("u32", 3), host.__array_interface__["data"][0], [("u64", 64), ("u64", 4), ("u64", 4)],
        [("u64", 128), ("u64", 512)], [("u32", 32), ("u32", 4), ("u32", 2)], [("u32", 1), ("u32", 2), ("u32", 1)],
        ("interleave", 0), ("swizzle", 2), ("l2", 2), ("oob", 0))]
    assert isinstance(m, np.void) and m.dtype == CUDA_DTYPE
    assert bytes(m) == np.array([0x0101010101010101 * (i + 1) for i in range(16)], "<u8").tobytes()


def test_cuda_path_reports_the_driver_refusal_old_gpus_and_a_missing_cuda_bindings(fake_gpu, monkeypatch):
    driver, device_array = fake_gpu
    a = device_array(sim.zeros((4, 64), np.float32))
    driver.result = 1
    with pytest.raises(RuntimeError, match="^cuTensorMapEncodeTiled refused the map: CUDA_ERROR_INVALID_VALUE"):
        make_tensor_map(a, (4, 8))
    monkeypatch.setattr(type(a.device), "compute_capability", "80")
    with pytest.raises(NotImplementedError, match=r"^array is on device 0 of compute capability 8\.0: tensor maps"):
        make_tensor_map(a, (4, 8))
    monkeypatch.setattr(type(a.device), "compute_capability", "90")
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(ImportError, match=r"cuda-bindings.*install cupaged\[cuda12\] or cupaged\[cuda13\]"):
        make_tensor_map(a, (4, 8))


# ------------------------------------------------------------------ CUDA's own values, the extras, the export
def _enum(header: str, name: str) -> dict[str, int]:
    body = re.search(r"typedef enum %s_enum \{(.*?)\} %s;" % (name, name), header, re.S).group(1)
    names = re.findall(r"^\s*(CU_TENSOR_MAP_\w+)", body, re.M)
    assert "= 0" in body.splitlines()[1] and "=" not in body.split("= 0", 1)[1]  # 0, then consecutive
    return {n: i for i, n in enumerate(names)}


def test_data_type_and_swizzle_values_are_cudas():
    with open(os.path.join(cuda_include_dirs()[0], "cuda.h")) as f:
        header = f.read()
    types_ = _enum(header, "CUtensorMapDataType")  # the values DTYPES and the sim's layout use
    names = "UINT8 UINT16 UINT32 INT32 UINT64 INT64 FLOAT16 FLOAT32 FLOAT64 BFLOAT16".split()
    assert [types_[f"CU_TENSOR_MAP_DATA_TYPE_{n}"] for n in names] == list(range(10))
    swizzles = _enum(header, "CUtensorMapSwizzle")
    assert [swizzles[f"CU_TENSOR_MAP_SWIZZLE_{n}"] for n in ("NONE", "32B", "64B", "128B")] == [0, 1, 2, 3]


@pytest.mark.parametrize("extra,major", [("cuda12", 12), ("cuda13", 13)])
def test_gpu_extras_take_cuda_bindings_of_their_major(extra, major):
    from tests.test_extras import _extra  # skips where tomllib is missing (Python 3.10)

    spec = _extra(extra)["cuda-bindings"].specifier
    assert spec.contains(f"{major}.9.0") and not spec.contains(f"{major - 1}.9.0")
    assert not spec.contains(f"{major + 1}.0.0")


def test_cupaged_exports_exactly_one_tensor_map_callable():
    names = [n for n in dir(cupaged) if "tensor_map" in n and not n.startswith("_")]
    assert names == ["make_tensor_map"] and getattr(cupaged, "make_tensor_map") is make_tensor_map
    modules = [mod for m, mod in list(sys.modules.items()) if m.startswith("cupaged") and mod is not None]
    others = {f"{mod.__name__}.{n}" for mod in modules for n in dir(mod) if "tensor_map" in n and not n.startswith("_")
              and callable(getattr(mod, n)) and getattr(mod, n) is not make_tensor_map}
    assert not others, others


# ------------------------------------------------------------------ passed by value to a kernel
ECHO = r"""
struct alignas(128) Map { unsigned long long q[16]; };  // CUtensorMap's layout and CUDA 13's alignment
extern "C" __global__ void echo(const __grid_constant__ Map m, unsigned long long* out) {
  if (threadIdx.x < 16) out[threadIdx.x] = m.q[threadIdx.x];
}
"""
@pytest.mark.parametrize("name", ["sim", pytest.param(
    "cuda", marks=pytest.mark.skipif(not gpu_available(), reason="no GPU"))])
def test_the_map_reaches_a_kernel_by_value(name):
    backend = Backend(name)
    if not cuda_arch_at_least(backend, 90):
        pytest.skip("no GPU of compute capability 9.0 (tensor maps are Hopper's)")
    a = backend.asarray(np.zeros((16, 64), np.float32))
    m = make_tensor_map(a, (8, 32), swizzle="128B")
    assert m.dtype == (SIM_DTYPE if name == "sim" else CUDA_DTYPE) and len(bytes(m)) == 128
    out = backend.empty((16,), np.uint64)
    raw_module(backend, ECHO, options=("-std=c++17",)).get_function("echo")((1,), (32,), (m, out))
    assert backend.to_numpy(out).tobytes() == bytes(m)
