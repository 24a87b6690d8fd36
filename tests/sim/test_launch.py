"""Launching on the sim: CuPy's call convention, argument checking, index variables, name
expressions, compile errors, the compile cache, and the cost of one launch."""

from __future__ import annotations

import os
import stat
import time

import ml_dtypes
import numpy as np
import pytest

from cupaged import sim

SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void saxpy(const float* x, float* y, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

extern "C" __global__ void wide(const long long* in, long long* out, long long add, unsigned long long mul,
                                double scale, double* dout) {
  const int i = threadIdx.x;
  out[i] = (long long)((unsigned long long)in[i] * mul) + add;
  dout[i] = scale * i;
}

// Every index variable, for a 3-D grid of 3-D blocks.
extern "C" __global__ void indices(int* out) {
  const int tl = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int bl = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  int* o = out + 12 * (bl * blockDim.x * blockDim.y * blockDim.z + tl);
  o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
  o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
  o[6] = blockDim.x; o[7] = blockDim.y; o[8] = blockDim.z;
  o[9] = gridDim.x; o[10] = gridDim.y; o[11] = gridDim.z;
}

struct Params { int n; float a; };

extern "C" __global__ void by_struct(Params p, float* y) {
  if (threadIdx.x < p.n) y[threadIdx.x] = p.a * threadIdx.x;
}

namespace ns {
template <int B, class T>
__global__ void __launch_bounds__(B) scale(const T* __restrict__ src, T* __restrict__ dst, T factor, int n) {
  const int i = blockIdx.x * B + threadIdx.x;
  if (i < n) dst[i] = T(float(src[i]) * float(factor));
}
}  // namespace ns

extern "C" __global__ void __launch_bounds__(64) lb_after_void(int* out) { out[threadIdx.x] = 1; }
extern "C" __global__ __launch_bounds__(64) void lb_before_void(int* out) { out[threadIdx.x] = 2; }

extern "C" __global__ void tiny(const float* x, float* y) { y[threadIdx.x] = x[threadIdx.x] + 1.0f; }
"""
NAMES = ("ns::scale<128, __half>", "ns::scale<64, __nv_bfloat16>", "ns::scale<32, float>")


@pytest.fixture(scope="module")
def mod():
    return sim.RawModule(code=SRC, options=("-std=c++17",), name_expressions=NAMES)


@pytest.fixture
def fn(mod):
    return mod.get_function


def test_cupy_call_convention(fn):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    y0 = rng.standard_normal(1000).astype(np.float32)
    y = y0.copy()  # a plain numpy array: copied in and written back
    fn("saxpy")((8,), (128,), (x, y, np.float32(2.5), np.int32(1000)))
    np.testing.assert_array_equal(y, np.float32(2.5) * x + y0)
    yg = sim.asarray(y0)  # guarded: passed without a copy
    fn("saxpy")(8, 128, [x, yg, np.float32(2.5), np.int32(1000)])  # ints and lists work too
    np.testing.assert_array_equal(yg, np.float32(2.5) * x + y0)


def test_python_int_and_float_are_int64_and_float64(fn):
    inp = np.array([1, -2, 3, 2**40], np.int64)
    out, dout = sim.zeros(4, np.int64), sim.zeros(4, np.float64)
    fn("wide")((1,), (4,), (inp, out, 2**33, 3, 0.5, dout))  # Python int -> long long / uint64, float -> double
    np.testing.assert_array_equal(out, inp * 3 + 2**33)
    np.testing.assert_array_equal(dout, 0.5 * np.arange(4))


def test_index_variables_3d(fn):
    grid, block = (2, 3, 2), (4, 2, 3)
    nthreads = np.prod(grid) * np.prod(block)
    out = sim.zeros(12 * nthreads, np.int32)
    fn("indices")(grid, block, (out,))
    got = out.reshape(-1, 12)
    rows = []
    for bz in range(grid[2]):
        for by in range(grid[1]):
            for bx in range(grid[0]):
                for tz in range(block[2]):
                    for ty in range(block[1]):
                        for tx in range(block[0]):
                            rows.append((tx, ty, tz, bx, by, bz, *block, *grid))
    np.testing.assert_array_equal(got, np.array(rows))


def test_struct_by_value(fn):
    p = np.array((20, 1.5), dtype=[("n", "<i4"), ("a", "<f4")])[()]
    y = sim.zeros(32)
    fn("by_struct")((1,), (32,), (p, y))
    np.testing.assert_array_equal(y, np.where(np.arange(32) < 20, 1.5 * np.arange(32), 0))
    with pytest.raises(TypeError, match="p is a 8-byte struct"):
        fn("by_struct")((1,), (32,), (np.int32(20), y))


@pytest.mark.parametrize("name, dtype, block", [(NAMES[0], np.float16, 128), (NAMES[1], ml_dtypes.bfloat16, 64),
                                               (NAMES[2], np.float32, 32)])
def test_templated_name_expressions(fn, name, dtype, block):
    n = 300
    src = np.random.default_rng(1).standard_normal(n).astype(dtype)
    dst = sim.zeros(n, dtype)
    fn(name)(((n + block - 1) // block,), (block,), (src, dst, dtype(0.75), np.int32(n)))
    want = (src.astype(np.float32) * np.float32(0.75)).astype(dtype)
    np.testing.assert_array_equal(dst.view(np.uint16 if dtype != np.float32 else np.uint32),
                                  want.view(np.uint16 if dtype != np.float32 else np.uint32))


def test_launch_bounds_placements(fn):
    out = sim.zeros(64, np.int32)
    fn("lb_after_void")((1,), (64,), (out,))
    assert (out == 1).all()
    fn("lb_before_void")((1,), (64,), (out,))
    assert (out == 2).all()


def test_unknown_kernel_name(mod):
    with pytest.raises(KeyError, match=r"no kernel .*nope.* in this module"):
        mod.get_function("nope")


# ---------------------------------------------------------------- argument checking
def test_wrong_dtype_array_names_the_parameter(fn):
    x64, y = np.zeros(10, np.float64), sim.zeros(10)
    with pytest.raises(TypeError, match=r"saxpy: x points to f32: expected a float32 array, got float64"):
        fn("saxpy")((1,), (32,), (x64, y, np.float32(1), np.int32(10)))
    with pytest.raises(TypeError, match=r"y points to f32.*got int32"):
        fn("saxpy")((1,), (32,), (y, np.zeros(10, np.int32), np.float32(1), np.int32(10)))
    with pytest.raises(TypeError, match=r"src points to f16: expected a float16 array, got float32"):
        fn(NAMES[0])((1,), (128,), (np.zeros(4, np.float32), sim.zeros(4, np.float16), np.float16(1), np.int32(4)))
    with pytest.raises(TypeError, match=r"in points to i64.*got int32"):
        fn("wide")((1,), (4,), (np.zeros(4, np.int32), sim.zeros(4, np.int64), 1, 1, 1.0, sim.zeros(4, np.float64)))
    with pytest.raises(TypeError, match=r"x is a pointer.*pass a numpy array, got list"):
        fn("saxpy")((1,), (32,), ([0.0] * 10, y, np.float32(1), np.int32(10)))


def test_python_scalars_for_narrow_parameters_name_the_parameter(fn):
    x, y = sim.zeros(10), sim.zeros(10)
    with pytest.raises(TypeError, match=r"saxpy: a expects float32, got float64"):
        fn("saxpy")((1,), (32,), (x, y, 2.0, np.int32(10)))
    with pytest.raises(TypeError, match=r"saxpy: n expects int32, got int64"):
        fn("saxpy")((1,), (32,), (x, y, np.float32(2), 10))
    with pytest.raises(TypeError, match=r"saxpy: n expects int32, got float32"):
        fn("saxpy")((1,), (32,), (x, y, np.float32(2), np.float32(10)))
    with pytest.raises(TypeError, match=r"factor expects float16, got float32"):
        fn(NAMES[0])((1,), (128,), (sim.zeros(4, np.float16), sim.zeros(4, np.float16), np.float32(1), np.int32(4)))
    with pytest.raises(TypeError, match=r"n expects int32, got bool"):
        fn("saxpy")((1,), (32,), (x, y, np.float32(2), True))


def test_wrong_argument_count_names_the_parameters(fn):
    x, y = sim.zeros(10), sim.zeros(10)
    with pytest.raises(TypeError, match=r"saxpy\(x, y, a, n\) takes 4 arguments, got 3"):
        fn("saxpy")((1,), (32,), (x, y, np.float32(2)))
    with pytest.raises(TypeError, match=r"takes 4 arguments, got 5"):
        fn("saxpy")((1,), (32,), (x, y, np.float32(2), np.int32(10), np.int32(1)))


def test_bad_launch_configuration(fn):
    x, y = sim.zeros(10), sim.zeros(10)
    for grid, block in (((0,), (32,)), ((1,), (0,)), ((1, 1, 1, 1), (32,)), ((1,), (2048,)), ((1,), (1, 1, 65))):
        with pytest.raises(ValueError):
            fn("saxpy")(grid, block, (x, y, np.float32(1), np.int32(10)))


# ---------------------------------------------------------------- compile errors and the cache
def test_compile_error_carries_gxx_message():
    src = 'extern "C" __global__ void broken(float* y) { y[0] = undeclared_thing + 1; }'
    with pytest.raises(sim.SimCompileError, match=r"(?s)error: .*undeclared_thing.*was not declared"):
        sim.RawModule(code=src)
    with pytest.raises(sim.SimCompileError, match="error"):
        sim.RawModule(code='extern "C" __global__ void k(float* y) { y[0] = ; }')


def test_compile_cache_is_private_and_reused(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(root))
    src = 'extern "C" __global__ void inc(int* v) { v[threadIdx.x] += 1; }  // cache test'
    old = os.umask(0o002)  # a common umask: group-writable by default
    try:
        m = sim.RawModule(code=src)
    finally:
        os.umask(old)
    for d in (root, root / "sim"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    files = list((root / "sim").iterdir())
    assert {f.suffix for f in files} == {".so", ".smem"}
    for f in files:
        assert not f.stat().st_mode & 0o022, f
    so = next(f for f in files if f.suffix == ".so")
    mtime = so.stat().st_mtime_ns
    t0 = time.perf_counter()
    m2 = sim.RawModule(code=src)  # cache hit: no compiler run
    assert time.perf_counter() - t0 < 0.5
    assert so.stat().st_mtime_ns == mtime
    v = sim.zeros(32, np.int32)
    m.get_function("inc")((1,), (32,), (v,))
    m2.get_function("inc")((1,), (32,), (v,))
    assert (v == 2).all()


@pytest.mark.parametrize("which", ["root", "sim"])
def test_cache_writable_by_others_is_refused(tmp_path, monkeypatch, which):
    root = tmp_path / "cache"
    (root / "sim").mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    (root if which == "root" else root / "sim").chmod(0o777)
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(root))
    with pytest.raises(sim.SimCompileError, match="refusing to use the compile cache"):
        sim.RawModule(code='extern "C" __global__ void k(int* v) { v[0] = 1; }')


# ---------------------------------------------------------------- cost
def test_launch_cost(fn):
    """Measured, not asserted: the cost of launching a tiny kernel (1 block of 32 threads)."""
    k = fn("tiny")
    xg, yg = sim.zeros(32), sim.zeros(32)
    xp, yp = np.zeros(32, np.float32), np.zeros(32, np.float32)
    for args in ((xg, yg), (xp, yp)):
        k((1,), (32,), args)  # warm up
    res = {}
    for label, args in (("guarded", (xg, yg)), ("plain numpy", (xp, yp))):
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            k((1,), (32,), args)
        res[label] = (time.perf_counter() - t0) / n * 1e6
    print(f"\nsim launch cost, tiny kernel 1x32 threads: guarded arrays {res['guarded']:.1f} us/launch, "
          f"plain numpy arrays {res['plain numpy']:.1f} us/launch")
    assert (yg == 1).all() and (yp == 1).all()


PER_KERNEL = r"""
#define THREADS 64
#define HALF (THREADS / 2)
__device__ float helper(int i) { __shared__ float h[8]; h[i & 7] = 0.0f; __syncthreads(); return h[0]; }
// 120 KiB of static shared memory, only in this kernel
extern "C" __global__ void big(float* out) {
  __shared__ float tile[30 * 1024];
  tile[threadIdx.x] = 1.0f;
  __syncthreads();
  out[0] = tile[7] + helper(threadIdx.x);
}
extern "C" __global__ void __launch_bounds__(HALF) small(float* out) {
  extern __shared__ float dyn[];
  __shared__ float a[100];
  a[threadIdx.x] = dyn[0] = 2.0f;
  __syncthreads();
  out[0] = a[5] + dyn[0] + helper(threadIdx.x);
}
"""


def test_static_shared_memory_and_launch_bounds_are_per_kernel():
    """The GPU charges each kernel its own static __shared__ (plus what device helpers and
    namespace-scope variables declare), not the module's sum; and a launch above a kernel's
    __launch_bounds__ fails. (The sim once charged every kernel the module's total.)"""
    mod = sim.RawModule(code=PER_KERNEL)
    assert mod.static_shared_bytes == {"big": 120 * 1024 + 32, "small": 400 + 32}
    small = mod.get_function("small")
    assert small.max_threads_per_block == 32 and mod.get_function("big").max_threads_per_block == 1024
    small.max_dynamic_shared_size_bytes = 150 * 1024  # 150 KiB + 432 B fit sm_90's 227 KiB; 150 + 120 would not
    out = sim.zeros(1)
    small((1,), (32,), (out,), shared_mem=150 * 1024)
    assert out[0] == 4.0
    with pytest.raises(ValueError, match=r"block of 33 threads exceeds its __launch_bounds__\(32\)"):
        small((1,), (33,), (out,), shared_mem=16)


def test_paged_attention_is_charged_its_own_static_shared_memory():
    from cupaged import _runtime

    family = next(f for f in _runtime.families() if f.stem == "paged_attention")
    mod = _runtime.sim_module(family.source, family.options, family.name_expressions, None)
    charged = mod.static_shared_bytes
    # ~8.2 KB at most today (paged_decode_mma_kernel's q and P^T tiles and its stages' KvRows); the module's sum
    # is ~360 KB
    assert max(charged.values()) <= 12 * 1024 < sum(charged.values())


def test_static_shared_memory_of_kernels_named_by_enumerators():
    """A name expression may pass an enumerator as an int template argument; each kernel is charged
    its own arrays (the enumerator names once left every kernel charged the module's sum)."""
    src = r"""
namespace ns {
enum Kind { A = 0, B = 5 };
template <int K> __global__ void k(float* out) {
  __shared__ float buf[64 + K];
  buf[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x];
}
}  // namespace ns
"""
    mod = sim.RawModule(code=src, options=("-std=c++17",), name_expressions=("ns::k<ns::A>", "ns::k<ns::B>"))
    assert mod.static_shared_bytes == {"ns::k<ns::A>": 4 * 64, "ns::k<ns::B>": 4 * 69}
