"""Arrays of other libraries (cupaged/_interop.py): every public op takes them without a copy and routes
them by device -- CPU ones (DLPack on the CPU, the numpy array protocols) run on the sim and are written
in place; GPU ones (``__cuda_array_interface__``, DLPack on CUDA) become cupy arrays. Fake interface
objects stand in for torch / JAX / numba; a fake ``cupy`` for the GPU routes. No GPU needed."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import inspect
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupaged
from cupaged import _interop
from cupaged._interop import _DLManagedTensor, as_native
from tests import fake_cupy
from cupaged.testing import assert_close, tolerance
from tests.conftest import gpu_available
from tests.test_api_fuzz import OPS
from tests.test_paged_attention import Case, build


class ArrayInterface:
    """Exposes only ``__array_interface__`` (numba host arrays, many C extensions)."""

    def __init__(self, a):
        self.base, self.__array_interface__ = a, a.__array_interface__


class DLPackOnly:
    """Exposes only DLPack, on the wrapped array's device (torch tensors, JAX arrays)."""

    def __init__(self, a):
        self.base = a

    def __dlpack__(self, **kwargs):
        return self.base.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.base.__dlpack_device__()


class TorchLikeCpu(DLPackOnly):
    """torch.Tensor on the CPU: its ``__cuda_array_interface__`` property raises AttributeError."""

    @property
    def __cuda_array_interface__(self):
        raise AttributeError("Can't get __cuda_array_interface__ on non-CUDA tensor")


def _foreign(value, i=0):
    """``value`` with every array (also inside lists) wrapped in one of the fake interfaces, in turn."""
    if isinstance(value, list):
        return [_foreign(v, i + j) for j, v in enumerate(value)]
    if isinstance(value, np.ndarray) and value.dtype == ml_dtypes.bfloat16:  # as torch.bfloat16 exports it
        return _RawDLPack(value.view(np.uint16))
    if isinstance(value, np.ndarray):
        return (ArrayInterface, DLPackOnly, TorchLikeCpu)[i % 3](value)
    return value


@pytest.mark.parametrize("op", [op for op in OPS if op != "KVCache and BlockPool"])
def test_every_op_takes_cpu_arrays_of_other_libraries(op):
    """Each op's fuzz call with every array wrapped: same results, written arrays written in place."""

    @settings(max_examples=6, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        call = OPS[op](data)
        result = call.fn(**{k: _foreign(v, i) for i, (k, v) in enumerate(call.kwargs.items())})
        for r in result if isinstance(result, tuple) else (result,):
            assert r is None or isinstance(r, np.ndarray)
        call.check(result)  # reads the caller's own arrays: the writes went through the wrappers
    run()


def test_every_public_op_is_wrapped():
    for name in cupaged.__all__:
        fn = getattr(cupaged, name)
        if inspect.isfunction(fn) and name != "workspace_bytes":  # the one function of sizes only
            assert hasattr(fn, "__wrapped__"), f"cupaged.{name} does not take arrays of other libraries"
    for name in ("paged", "dense", "mla"):
        assert hasattr(getattr(cupaged.KvView, name), "__wrapped__"), f"KvView.{name}"


def test_plans_and_views_pass_on_the_fast_path():
    plain = _interop._PLAIN_TYPES
    assert {cupaged.AttentionPlan, cupaged.KvView} <= plain


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):  # DLPack >= 1.0
    pass


_DLManagedTensorVersioned._fields_ = [
    ("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensorVersioned))), ("flags", ctypes.c_uint64),
    ("dl_tensor", _interop._DLTensor)]


class _RawDLPack:
    """A CPU DLPack producer of a tensor of DLPack type ``code`` (4: bfloat16, as torch exports torch.bfloat16)
    over ``data``'s bytes: a versioned capsule ("dltensor_versioned") when the consumer asks with max_version
    >= (1, 0), as numpy's from_dlpack does, the legacy "dltensor" one otherwise. numpy refuses these codes as it
    refuses torch's bfloat16 (numpy 2: RuntimeError "Unsupported dtype in DLTensor.", not a BufferError), so
    cupaged reads the capsule itself. Counts its deleter's calls; the capsules carry no destructor, so a tensor
    numpy refused stays unreleased (the producer keeps the memory alive either way)."""

    def __init__(self, data: np.ndarray, code: int = 4):
        self.data, self.code, self.deleted, self.asked = data, code, 0, []
        self.shape = (ctypes.c_int64 * data.ndim)(*data.shape)
        self.strides = (ctypes.c_int64 * data.ndim)(*(s // data.itemsize for s in data.strides))
        self.tensors = []  # every managed tensor handed out, and its deleter, alive as long as the producer

    def _delete(self, _):
        self.deleted += 1

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.asked.append(max_version)
        versioned = max_version is not None and max_version[0] >= 1
        kind = _DLManagedTensorVersioned if versioned else _DLManagedTensor
        managed = kind()
        if versioned:
            managed.version.major, managed.version.minor = 1, 0
        managed.deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(kind))(self._delete)
        t = managed.dl_tensor
        t.data, t.device_type, t.ndim = self.data.ctypes.data, 1, self.data.ndim
        t.code, t.bits, t.lanes = self.code, 8 * self.data.itemsize, 1
        t.shape, t.strides = self.shape, self.strides
        self.tensors.append((managed, managed.deleter))
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(managed), b"dltensor_versioned" if versioned else b"dltensor", None)

    def __dlpack_device__(self):
        return (1, 0)


def test_the_bfloat16_producer_is_refused_by_numpy_as_torchs_tensors_are():
    """The stand-in is faithful: numpy's own from_dlpack asks for a versioned capsule and refuses the dtype
    with the error torch's bfloat16 tensors get (not the BufferError cupaged caught before)."""
    producer = _RawDLPack(np.zeros((2, 3), np.uint16))
    with pytest.raises(RuntimeError, match="Unsupported dtype in DLTensor"):
        np.from_dlpack(producer)
    assert producer.asked[0] >= (1, 0)


def test_bfloat16_dlpack_on_the_cpu_is_a_view():
    values = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    bits = values.view(np.uint16).copy()
    producer = _RawDLPack(bits[:, 1:])  # strided: the view must follow the producer's strides
    view = as_native("q", producer)
    assert view.dtype == ml_dtypes.bfloat16 and view.shape == (3, 3)
    assert np.array_equal(view.astype(np.float32), values[:, 1:].astype(np.float32))
    view[0, 0] = 100.0
    assert bits[0, 1] == np.array(100.0, ml_dtypes.bfloat16).view(np.uint16)  # the same memory
    assert producer.deleted == 0
    del view
    gc.collect()
    assert producer.deleted == 1  # the tensor cupaged took is released exactly once, when the view dies


def test_other_dtypes_numpy_refuses_are_type_errors_naming_the_argument():
    float8 = _RawDLPack(np.zeros(4, np.uint8), code=10)  # kDLFloat8_e4m3fn: neither numpy's nor bfloat16
    with pytest.raises(TypeError, match=r"^q \(_RawDLPack, __dlpack__ on the CPU\) cannot be viewed.*code 10, 8 bits"):
        as_native("q", float8)


if importlib.util.find_spec("torch") is not None:  # torch is no dependency: checked against it where installed
    @pytest.mark.parametrize("kind", ["contiguous", "strided", "transposed", "float16"])
    def test_torch_cpu_tensors_are_views(kind):
        """Real torch CPU tensors: bfloat16 ones contiguous, strided and transposed (numpy refuses them:
        cupaged reads the capsule), and a float16 one numpy takes itself."""
        import torch

        base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        tensor = {"contiguous": base.to(torch.bfloat16), "strided": base.to(torch.bfloat16)[:, 1::2],
                  "transposed": base.to(torch.bfloat16).T, "float16": base.to(torch.float16)}[kind]
        view = as_native("q", tensor)
        assert view.dtype == (np.float16 if kind == "float16" else ml_dtypes.bfloat16)
        assert view.shape == tuple(tensor.shape)
        assert np.array_equal(view.astype(np.float32), tensor.float().numpy())
        view[0, 0] = 100.0
        assert tensor[0, 0].item() == 100.0  # the same memory

    def test_torch_bfloat16_cpu_tensors_run_an_op_in_place():
        import torch

        rng = np.random.default_rng(0)
        key, value = (torch.from_numpy(rng.standard_normal((5, 2, 64)).astype(np.float32)).to(torch.bfloat16)
                      for _ in range(2))
        key_cache, value_cache = (torch.full((4, 16, 2, 64), float("nan"), dtype=torch.bfloat16) for _ in range(2))
        slots = torch.tensor([3, 17, -1, 40, 63])
        as_numpy = lambda t: t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # noqa: E731
        want_k, want_v = cupaged.reference.reshape_and_cache_flash(as_numpy(key), as_numpy(value), as_numpy(key_cache),
                                                                   as_numpy(value_cache), slots.numpy())
        cupaged.reshape_and_cache_flash(key, value, key_cache, value_cache, slots)
        assert np.array_equal(as_numpy(key_cache).view(np.uint16), want_k.view(np.uint16))
        assert np.array_equal(as_numpy(value_cache).view(np.uint16), want_v.view(np.uint16))


class CudaArrayInterface:
    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False), "version": 3}


class CudaDLPack:
    def __init__(self, device_type=2):
        self.device_type = device_type

    def __dlpack__(self, **kwargs):
        raise AssertionError("only cupy's from_dlpack may consume it")

    def __dlpack_device__(self):
        return (self.device_type, 0)


def test_gpu_arrays_become_cupy_arrays_without_a_copy(monkeypatch):
    cupy = fake_cupy.install(monkeypatch)
    cai, managed, cuda = CudaArrayInterface(), CudaDLPack(13), CudaDLPack(2)
    for source, via in ((cai, "asarray"), (cuda, "from_dlpack"), (managed, "from_dlpack")):
        got = as_native("q", source)
        assert isinstance(got, cupy.ndarray) and got.source is source and got.via == via


def test_a_gpu_array_beside_cpu_arrays_is_a_type_error_naming_both_sides(monkeypatch):
    fake_cupy.install(monkeypatch)
    q = np.zeros((1, 4, 64), np.float16)
    cache = np.zeros((2, 16, 4, 64), np.float16)
    with pytest.raises(TypeError, match=r"cupy: q.*numpy: key_cache|numpy: key_cache.*cupy: q"):
        cupaged.paged_attention(CudaArrayInterface(), cache, cache, np.zeros((1, 1), np.int32), np.ones(1, np.int32))
    del q


def test_a_gpu_array_without_cupy_names_the_argument(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises
    for value in (CudaArrayInterface(), CudaDLPack()):
        with pytest.raises(TypeError, match=r"^key_cache is a GPU array .*cupaged\[cuda12\]"):
            cupaged.paged_attention(np.zeros((1, 4, 64), np.float16), value, value, np.zeros((1, 1), np.int32),
                                    np.ones(1, np.int32))


def test_arrays_on_other_devices_or_needing_a_copy_are_type_errors_naming_them():
    class Rocm(CudaDLPack):
        pass

    class CopyOnly:  # an __array__ that cannot hand out a view
        def __array__(self, dtype=None, copy=None):
            if copy is False:
                raise ValueError("a copy is needed")
            return np.zeros(3, np.float32)

    with pytest.raises(TypeError, match=r"^v is a DLPack array on device type 10"):
        cupaged.KvView.dense(np.zeros((3, 1, 32), np.float16), Rocm(10))
    with pytest.raises(TypeError, match=r"^slot_mapping \(CopyOnly, numpy array protocol\) cannot be viewed"):
        cupaged.reshape_and_cache_flash(*(np.zeros((1, 1, 32), np.float16),) * 2,
                                        *(np.zeros((1, 16, 1, 32), np.float16),) * 2, CopyOnly())


def test_up_proj_may_return_arrays_of_other_libraries():
    from tests.test_api_fuzz import prefill_call

    @settings(max_examples=3, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        call = prefill_call(data)
        up = call.kwargs["up_proj"]
        result = call.fn(**{**call.kwargs, "up_proj": lambda rows: tuple(DLPackOnly(a) for a in up(rows))})
        call.check(result)
    run()


@pytest.mark.skipif(not gpu_available(), reason="no GPU")
def test_cuda_arrays_of_other_libraries_run_on_the_gpu_in_place():
    """Objects exposing only __cuda_array_interface__ or a CUDA __dlpack__ (as torch / numba / JAX
    arrays do), wrapping cupy arrays: the cache write lands in the caller's memory and attention over
    it matches the reference."""
    import cupy

    class Cai:
        def __init__(self, a):
            self.base, self.__cuda_array_interface__ = a, a.__cuda_array_interface__

    rng = np.random.default_rng(4)
    key_cache, value_cache = (np.full((8, 16, 2, 64), np.nan, np.float16) for _ in range(2))
    k, v = (rng.standard_normal((40, 2, 64)).astype(np.float16) for _ in range(2))
    slots = rng.permutation(8 * 16)[:40].astype(np.int64)
    want_k, want_v = cupaged.reference.reshape_and_cache_flash(k, v, key_cache, value_cache, slots)
    d_kc, d_vc = cupy.asarray(key_cache), cupy.asarray(value_cache)
    cupaged.reshape_and_cache_flash(Cai(cupy.asarray(k)), DLPackOnly(cupy.asarray(v)), Cai(d_kc), DLPackOnly(d_vc),
                                    Cai(cupy.asarray(slots)))
    assert np.array_equal(d_kc.get().view(np.uint16), want_k.view(np.uint16))
    assert np.array_equal(d_vc.get().view(np.uint16), want_v.view(np.uint16))
    case = Case(heads=(8, 2), head_size=128, block_size=16, seqs=((1, 300), (1, 17)), dtype=np.float16,
                layout="NHD", kv_cache_dtype="auto", causal=True, window=None, softcap=None, sinks=True,
                alibi=False, decode=True)
    inputs, options, (ref_out, _) = build(case, seed=2)
    wrapped = {name: (Cai, DLPackOnly)[i % 2](cupy.asarray(a)) if isinstance(a, np.ndarray) else a
               for i, (name, a) in enumerate({**inputs, **options}.items())}
    out = cupaged.paged_attention(**wrapped)
    assert isinstance(out, cupy.ndarray)
    assert_close(out.get(), ref_out, tolerance(np.float16), "out")
