"""Shared and global memory on the sim: static/dynamic shared memory, limits, poison fill, and
out-of-bounds detection for guarded arrays and plain numpy arrays."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cupaged import sim

NAN_BITS = np.uint32(0xFFFFFFFF)

SRC = r"""
extern __shared__ float dyn_f[];  // namespace scope ...

// Static shared memory: reverse each block's slice.
extern "C" __global__ void smem_reverse(const float* in, float* out) {
  __shared__ float s[256];
  const int t = threadIdx.x, n = blockDim.x, b = blockIdx.x;
  s[t] = in[b * n + t];
  __syncthreads();
  out[b * n + t] = s[n - 1 - t];
}

// Two extern __shared__ arrays (one at namespace scope, one declared in the kernel) alias.
extern "C" __global__ void smem_alias(const float* in, unsigned* out_bits, int* same_addr) {
  extern __shared__ unsigned dyn_u[];  // ... and function scope
  const int t = threadIdx.x;
  dyn_f[t] = in[t];
  __syncthreads();
  out_bits[t] = dyn_u[t];
  if (t == 0) same_addr[0] = (void*)dyn_f == (void*)dyn_u;
}

// Fill n bytes of dynamic shared memory, then check them all from other threads.
extern "C" __global__ void smem_big(int n, int* bad) {
  extern __shared__ unsigned char big[];
  const int t = threadIdx.x, nt = blockDim.x;
  for (int i = t; i < n; i += nt) big[i] = (unsigned char)(i * 7 + 3);
  __syncthreads();
  int errors = 0;
  for (int i = (t + 1) % nt; i < n; i += nt) errors += big[i] != (unsigned char)(i * 7 + 3);
  bad[t] = errors;
}

// Shared memory is written only in block `writer`: every other block must read the poison fill.
extern "C" __global__ void smem_no_leak(int writer, unsigned* out_static, unsigned* out_dyn) {
  __shared__ float s[64];
  extern __shared__ float d[];
  const int t = threadIdx.x, b = blockIdx.x;
  if (b == writer) { s[t] = 1.0f; d[t] = 2.0f; }
  __syncthreads();
  out_static[b * blockDim.x + t] = __float_as_uint(s[t]);
  out_dyn[b * blockDim.x + t] = __float_as_uint(d[t]);
}

// Dynamic shared memory access at float index i by thread 1 (write if w, else read).
extern "C" __global__ void smem_at(long long i, int w, float* out) {
  extern __shared__ float d[];
  if (threadIdx.x == 1) {
    if (w) d[i] = 5.0f;
    else out[0] = d[i];
  }
}

// Global accesses at an arbitrary index by thread 3 of block 1.
extern "C" __global__ void read_at(const float* src_vals, float* dst, long long i) {
  if (threadIdx.x == 3 && blockIdx.x == 1) dst[0] = src_vals[i];
}
extern "C" __global__ void write_at(float* dst_vals, long long i) {
  if (threadIdx.x == 3 && blockIdx.x == 1) dst_vals[i] = 9.0f;
}

// Uninitialized locals are filled with a pattern, so block 1 cannot see what block 0 left on the stack.
extern "C" __global__ void uninit_local(unsigned* out) {
  float local[4];
  if (blockIdx.x == 0) for (int i = 0; i < 4; ++i) local[i] = 1.0f;
  out[blockIdx.x * blockDim.x + threadIdx.x] = __float_as_uint(local[threadIdx.x % 4]);
}

extern "C" __global__ void null_write(int* out, int who) {
  int* p = out + 1 == nullptr ? out : nullptr;
  if (threadIdx.x == who) *p = 1;
  else out[threadIdx.x] = 2;
}

// Strided views: scale columns [0, ncols) of a row-major view with leading dimension ld.
extern "C" __global__ void scale_cols(float* m, int ld, int ncols, float a) {
  const int r = blockIdx.x, c = threadIdx.x;
  if (c < ncols) m[(long long)r * ld + c] *= a;
}

// out = a + b elementwise (arguments may be views of one buffer, or the same array).
extern "C" __global__ void add(const float* a, const float* b, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}
"""


@pytest.fixture(scope="module")
def mod():
    return sim.RawModule(code=SRC, options=("-std=c++17",))


@pytest.fixture
def fn(mod):
    return mod.get_function


# ---------------------------------------------------------------- shared memory
def test_static_shared_memory(fn):
    x = np.random.default_rng(0).standard_normal(3 * 200).astype(np.float32)
    out = sim.zeros(600)
    fn("smem_reverse")((3,), (200,), (x, out))
    np.testing.assert_array_equal(out, x.reshape(3, 200)[:, ::-1].ravel())


def test_two_extern_shared_arrays_alias(fn):
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    bits, same = sim.zeros(64, np.uint32), sim.zeros(1, np.int32)
    fn("smem_alias")((1,), (64,), (x, bits, same), shared_mem=64 * 4)
    assert same[0] == 1
    np.testing.assert_array_equal(bits, x.view(np.uint32))


def test_dynamic_shared_memory_above_48k_needs_opt_in(fn, monkeypatch):
    k = fn("smem_big")
    bad = sim.zeros(128, np.int32)
    k((1,), (128,), (np.int32(48 * 1024), bad), shared_mem=48 * 1024)  # the default limit itself is fine
    assert not bad.any()
    n = 100 * 1024
    with pytest.raises(ValueError, match="max_dynamic_shared_size_bytes"):
        k((1,), (128,), (np.int32(n), bad), shared_mem=n)
    k.max_dynamic_shared_size_bytes = n
    bad[:] = -1
    k((2,), (128,), (np.int32(n), bad), shared_mem=n)
    assert not bad.any()


def test_dynamic_shared_memory_limited_by_arch(fn, monkeypatch):
    k = fn("smem_big")
    bad = sim.zeros(64, np.int32)
    n = 200 * 1024  # above sm_80's 163 KiB, below sm_90's 227 KiB
    k.max_dynamic_shared_size_bytes = n
    monkeypatch.setenv("CUPAGED_SIM_ARCH", "sm_80")
    with pytest.raises(ValueError, match="sm_80"):
        k((1,), (64,), (np.int32(n), bad), shared_mem=n)
    monkeypatch.setenv("CUPAGED_SIM_ARCH", "sm_90")
    bad[:] = -1
    k((1,), (64,), (np.int32(n), bad), shared_mem=n)
    assert not bad.any()
    k.max_dynamic_shared_size_bytes = 228 * 1024
    with pytest.raises(ValueError, match="sm_90"):
        k((1,), (64,), (np.int32(n), bad), shared_mem=228 * 1024)
    k.max_dynamic_shared_size_bytes = 48 * 1024


def test_unwritten_shared_memory_reads_nan_and_does_not_leak_between_blocks(fn, monkeypatch):
    nb, nt = 4, 64
    for order in ("natural", "reverse"):
        monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
        for writer in (0, 2, -1):  # -1: no block writes
            s, d = sim.zeros(nb * nt, np.uint32), sim.zeros(nb * nt, np.uint32)
            fn("smem_no_leak")((nb,), (nt,), (np.int32(writer), s, d), shared_mem=nt * 4)
            want_s = np.full((nb, nt), NAN_BITS)
            want_d = np.full((nb, nt), NAN_BITS)
            if writer >= 0:
                want_s[writer] = np.float32(1).view(np.uint32)
                want_d[writer] = np.float32(2).view(np.uint32)
            np.testing.assert_array_equal(s.reshape(nb, nt), want_s, err_msg=f"{order} writer={writer}")
            np.testing.assert_array_equal(d.reshape(nb, nt), want_d, err_msg=f"{order} writer={writer}")


def test_threads_per_block_limit(fn):
    out = sim.zeros(1)
    fn("smem_at")((1,), (1024,), (np.int64(0), np.int32(0), out), shared_mem=4)  # 1024 is fine
    for block in ((1025,), (32, 33), (8, 8, 17)):
        with pytest.raises(ValueError, match="1024"):
            fn("smem_at")((1,), block, (np.int64(0), np.int32(0), out), shared_mem=4)


def test_uninitialized_locals_do_not_leak_between_blocks(fn, monkeypatch):
    for order in ("natural", "reverse"):
        monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
        out = sim.zeros(3 * 32, np.uint32)
        fn("uninit_local")((3,), (32,), (out,))
        got = out.reshape(3, 32)
        assert (got[0] == np.float32(1).view(np.uint32)).all()
        assert (got[1:] != np.float32(1).view(np.uint32)).all(), (order, [hex(v) for v in got[1:, :4].ravel()])


def test_null_pointer_write(fn):
    out = sim.zeros(32, np.int32)
    with pytest.raises(sim.SimMemoryError, match=r"address 0x0 \(not inside any argument\) in thread \(5,0,0\)"):
        fn("null_write")((1,), (32,), (out, np.int32(5)))
    fn("null_write")((1,), (32,), (out, np.int32(-1)))
    assert (out == 2).all()


def test_extern_shared_memory_without_shared_mem(fn):
    with pytest.raises(sim.SimMemoryError, match=r"dynamic shared memory write at byte offset 0, past the launch's "
                                                 r"shared_mem=0 bytes in thread \(1,0,0\)"):
        fn("smem_at")((1,), (32,), (np.int64(0), np.int32(1), sim.zeros(1)))


@pytest.mark.parametrize("w", [1, 0])
def test_dynamic_shared_memory_beyond_launch_size(fn, w):
    out = sim.zeros(1)
    k = fn("smem_at")
    k((1,), (32,), (np.int64(255), np.int32(w), out), shared_mem=1024)  # the last float: fine
    # next page: caught at once, for reads and writes
    with pytest.raises(sim.SimMemoryError, match=r"dynamic shared memory .*byte offset 4096.*thread \(1,0,0\)"):
        k((1,), (32,), (np.int64(1024), np.int32(w), out), shared_mem=1024)
    if w:  # a write just past the end, in the same page: caught at once too (every store is checked)
        with pytest.raises(sim.SimMemoryError, match=r"dynamic shared memory write at byte offset 1024, past the "
                                                     r"launch's shared_mem=1024 bytes in thread \(1,0,0\)"):
            k((1,), (32,), (np.int64(256), np.int32(w), out), shared_mem=1024)
    k((1,), (32,), (np.int64(3), np.int32(w), out), shared_mem=1024)  # usable afterwards


# ---------------------------------------------------------------- global memory bounds
N = 64  # floats: 256 bytes, a multiple of 16, so the array ends right at its guard page


def _array(kind, n=N):
    x = np.arange(n, dtype=np.float32)
    return sim.asarray(x) if kind == "guarded" else x


@pytest.mark.parametrize("kind", ["guarded", "plain"])
@pytest.mark.parametrize("index", [N, N + 1, N + 20_000, -1024, -20_000])
def test_out_of_bounds_read(fn, kind, index):
    x, dst = _array(kind), sim.zeros(1)
    with pytest.raises(sim.SimMemoryError) as e:
        fn("read_at")((2,), (32,), (x, dst, np.int64(index)))
    msg = str(e.value)
    assert "src_vals" in msg and f"byte offset {4 * index}" in msg, msg
    assert "thread (3,0,0)" in msg and "block (1,0,0)" in msg, msg
    fn("read_at")((2,), (32,), (x, dst, np.int64(N - 1)))  # usable afterwards
    assert dst[0] == N - 1


@pytest.mark.parametrize("kind", ["guarded", "plain"])
@pytest.mark.parametrize("index", [N, N + 20_000, -1024, -20_000])
def test_out_of_bounds_write(fn, kind, index):
    x = _array(kind)
    with pytest.raises(sim.SimMemoryError) as e:
        fn("write_at")((2,), (32,), (x, np.int64(index)))
    msg = str(e.value)
    assert "dst_vals" in msg and f"byte offset {4 * index}" in msg, msg
    assert "thread (3,0,0)" in msg and "block (1,0,0)" in msg, msg
    fn("write_at")((2,), (32,), (x, np.int64(0)))  # usable afterwards, with the same array
    assert x[0] == 9.0 and x[1] == 1.0


@pytest.mark.parametrize("kind", ["guarded", "plain"])
@pytest.mark.parametrize("index", [10, 11, -1, -3])
def test_small_overrun_inside_slack_found_after_launch(fn, kind, index):
    """10 floats (40 bytes) leave slack before the guard page; writes there are found afterwards."""
    x = _array(kind, 10)
    with pytest.raises(sim.SimMemoryError, match=rf"dst_vals.*byte offset {4 * index}\b"):
        fn("write_at")((2,), (32,), (x, np.int64(index)))
    fn("write_at")((2,), (32,), (x, np.int64(9)))  # the slack was repaired: usable afterwards
    assert x[9] == 9.0


def test_overrun_in_slack_then_fault_leaves_array_usable():
    """A launch that damages the slack (stopped at that store since every store is checked; it went on
    to fault further on before) must not poison the next launch."""
    src = r"""
    extern "C" __global__ void two_writes(float* v, int n) {
      if (threadIdx.x == 0) { v[n] = 1.0f; v[n + 5000] = 2.0f; }
    }
    extern "C" __global__ void fill(float* v, int n) { if (threadIdx.x < n) v[threadIdx.x] = 3.0f; }
    """
    m = sim.RawModule(code=src)
    x = sim.zeros(10)
    with pytest.raises(sim.SimMemoryError, match="past the end of an array: v at byte offset 40 "):
        m.get_function("two_writes")((1,), (32,), (x, np.int32(10)))
    m.get_function("fill")((1,), (32,), (x, np.int32(10)))
    np.testing.assert_array_equal(x, 3.0)


# ---------------------------------------------------------------- views
@pytest.mark.parametrize("kind", ["guarded", "plain"])
def test_strided_column_view_written_back(fn, kind):
    rows, ld = 5, 192
    fused = np.random.default_rng(2).standard_normal((rows, ld)).astype(np.float32)
    buf = sim.asarray(fused) if kind == "guarded" else fused.copy()
    view = buf[:, 64:128]  # a column slice of a fused buffer, not contiguous
    assert not view.flags.c_contiguous
    fn("scale_cols")((rows,), (64,), (view, np.int32(ld), np.int32(64), np.float32(3.0)))
    want = fused.copy()
    want[:, 64:128] *= 3.0
    np.testing.assert_array_equal(buf, want)


@pytest.mark.parametrize("kind", ["guarded", "plain"])
def test_arguments_that_are_views_of_one_buffer(fn, kind):
    n = 100
    base = np.random.default_rng(3).standard_normal(3 * n).astype(np.float32)
    buf = sim.asarray(base) if kind == "guarded" else base.copy()
    a, b, out = buf[:n], buf[n:2 * n], buf[2 * n:]
    fn("add")((4,), (32,), (a, b, out, np.int32(n)))
    np.testing.assert_array_equal(buf[2 * n:], base[:n] + base[n:2 * n])
    np.testing.assert_array_equal(buf[:2 * n], base[:2 * n])
    # the same array as input and output
    fn("add")((4,), (32,), (a, a, a, np.int32(n)))
    np.testing.assert_array_equal(buf[:n], 2 * base[:n])
    # overlapping, shifted input views of one buffer
    fn("add")((4,), (32,), (buf[1:n + 1], buf[:n], buf[2 * n:], np.int32(n)))
    shifted = np.concatenate([2 * base[1:n], base[n:n + 1]])
    np.testing.assert_array_equal(buf[2 * n:], shifted + 2 * base[:n])


def test_guarded_allocation_helpers():
    e = sim.empty((3, 5), np.float32)
    assert e.shape == (3, 5) and np.isnan(e).all()  # 0xFF bytes: NaN
    z = sim.zeros(7, np.int32)
    assert (z == 0).all()
    a = sim.asarray(np.arange(4.0))
    assert sim.asarray(a) is a and a.dtype == np.float64
    f = sim.empty((4, 6), np.float16, order="F")
    assert f.flags.f_contiguous and f.shape == (4, 6)


def test_staged_copies_keep_the_address_alignment():
    """A plain numpy view 4 bytes into its buffer is staged at the same address mod 16, so a kernel
    (or a wrapper choosing 16-byte accesses) sees the alignment the array really has."""
    mod = sim.RawModule(code=r'''
extern "C" __global__ void addr_mod16(const float* x, const float* y, long long* out) {
  out[0] = (long long)((unsigned long long)x % 16);
  out[1] = (long long)((unsigned long long)y % 16);
}''')
    base = np.zeros(64, np.float32)
    out = np.zeros(2, np.int64)
    for x, y in ((base[1:], base[8:]), (base[3:9], base[:5]), (base[4:], np.zeros(3, np.float32)[1:])):
        mod.get_function("addr_mod16")((1,), (1,), (x, y, out))
        assert out.tolist() == [x.ctypes.data % 16, y.ctypes.data % 16]


def test_guarded_array_larger_than_ram_is_refused_before_anything_is_touched():
    """sim memory is written whole (poison) at birth: past RAM the OOM killer ended the process."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(MemoryError, match=rf"cannot allocate {ram + 1} bytes of guarded sim memory"):
        sim.empty(ram + 1, np.uint8)
