"""Synchronization errors, traps, timeouts and scheduling order on the sim.

Every failure must raise (never hang, never kill the process), and the process must stay usable:
each error test launches a correct kernel afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import sim

SRC = r"""
#include <cassert>

extern "C" __global__ void ok(const float* x, float* y, int n) {
  __shared__ float s[256];
  const int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  s[t] = i < n ? x[i] : 0.0f;
  __syncthreads();
  if (i < n) y[i] = s[t] + s[(t + 1) % blockDim.x] + __shfl_xor_sync(0xffffffffu, s[t], 1);
}

extern "C" __global__ void divergent_sync(float* y) {
  if (threadIdx.x < 16) {
    __syncthreads();  // @div_a
  } else {
    __syncthreads();  // @div_b
  }
  y[threadIdx.x] = 1.0f;
}

// g++ -O2 duplicates the barrier call here (jump threading on the repeated condition): threads
// with t < n and t >= n reach two copies of one source barrier, which is not a divergence.
extern "C" __global__ void duplicated_barrier(const float* x, float* y, int n) {
  __shared__ float s[256];
  const int t = threadIdx.x;
  float a;
  if (t < n) a = x[t] * 2.0f; else a = -1.0f;
  s[t] = a;
  __syncthreads();
  if (t < n) y[t] = s[(t + 1) % blockDim.x]; else y[t] = 5.0f;
}

extern "C" __global__ void divergent_kind(float* y) {
  int r;
  if (threadIdx.x < 40) r = __syncthreads_count(1);
  else r = __syncthreads_or(1);
  y[threadIdx.x] = r;
}

extern "C" __global__ void exit_while_waiting(float* y, int quitter) {
  if (threadIdx.x == quitter) return;
  __syncthreads();  // @exit_wait
  y[threadIdx.x] = 1.0f;
}

extern "C" __global__ void shfl_vs_barrier(float* y) {
  float v = threadIdx.x;
  if (threadIdx.x % 32 < 16) {
    v = __shfl_sync(0xffffffffu, v, 0);  // @dl_shfl
  } else {
    __syncthreads();  // @dl_bar
  }
  y[threadIdx.x] = v;
}

extern "C" __global__ void shfl_excludes_caller(float* y) {
  y[threadIdx.x] = __shfl_sync(0xfffffffeu, 1.0f, 1);
}

extern "C" __global__ void shfl_reads_outside_mask(float* y) {
  if (threadIdx.x < 16) y[threadIdx.x] = __shfl_sync(0x0000ffffu, 1.0f, 20);
}

extern "C" __global__ void device_assert(const int* x) {
  assert(x[threadIdx.x] >= 0);
}

extern "C" __global__ void trap(int who) {
  if (threadIdx.x == who && blockIdx.x == 2) __trap();
}

extern "C" __global__ void int_div(const int* a, const int* b, int* c) {
  const int t = threadIdx.x;
  c[t] = a[t] / b[t];
}

extern "C" __global__ void spin(const volatile int* flag) {
  while (flag[0] == 0) { }
}

__device__ int recurse(int n) {
  volatile char buf[1024];
  buf[0] = (char)n;
  return n ? recurse(n - 1) + buf[0] : 0;
}
extern "C" __global__ void deep(int n, int* out) { out[threadIdx.x] = recurse(n); }

extern "C" __global__ void shfl_width(float* y, int w) { y[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1, w); }

// A race: each thread reads its neighbour's shared slot with no barrier after the neighbour's write.
extern "C" __global__ void racy(float* y) {
  __shared__ float s[64];
  const int t = threadIdx.x;
  s[t] = t;
  float v = s[(t + 1) % blockDim.x];
  __syncthreads();
  y[blockIdx.x * blockDim.x + t] = v;
}

// A correct reduction (shared memory tree, then shuffles): one partial sum per block.
extern "C" __global__ void block_sum(const float* x, float* partial, int n) {
  __shared__ float s[256];
  const int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  s[t] = i < n ? x[i] * 1.000001f : 0.0f;
  __syncthreads();
  for (int k = blockDim.x / 2; k >= 32; k /= 2) {
    if (t < k) s[t] += s[t + k];
    __syncthreads();
  }
  if (t < 32) {
    float v = s[t];
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    if (t == 0) partial[blockIdx.x] = v;
  }
}

// The order in which blocks / threads start.
extern "C" __global__ void block_order(int* counter, int* out) {
  if (threadIdx.x == 0) out[blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)] = atomicAdd(counter, 1);
}
extern "C" __global__ void thread_order(int* counter, int* out) {
  out[threadIdx.x] = atomicAdd(counter, 1);
}
"""


def line_of(tag: str) -> int:
    return next(i for i, ln in enumerate(SRC.splitlines(), 1) if f"// @{tag}" in ln)


@pytest.fixture(scope="module")
def mod():
    return sim.RawModule(code=SRC, options=("-std=c++17",))


@pytest.fixture
def fn(mod):
    return mod.get_function


def still_usable(fn):
    """A correct launch right after an error computes the right values."""
    x = np.arange(100, dtype=np.float32)
    y = sim.zeros(100)
    fn("ok")((2,), (64,), (x, y, np.int32(100)))
    s = np.concatenate([x, np.zeros(28, np.float32)]).reshape(2, 64)
    want = (s + np.roll(s, -1, axis=1) + s.reshape(2, 32, 2)[:, :, ::-1].reshape(2, 64)).ravel()[:100]
    np.testing.assert_array_equal(y, want)


def test_correct_kernel(fn):
    still_usable(fn)


def test_divergent_syncthreads(fn):
    with pytest.raises(sim.SimSyncError, match="divergent __syncthreads") as e:
        fn("divergent_sync")((1,), (32,), (sim.zeros(32),))
    msg = str(e.value)
    assert f"line {line_of('div_a')}" in msg and f"line {line_of('div_b')}" in msg, msg
    still_usable(fn)


def test_barrier_duplicated_by_the_compiler_is_one_site(fn):
    x = np.arange(64, dtype=np.float32)
    y = sim.zeros(64)
    fn("duplicated_barrier")((1,), (64,), (x, y, np.int32(40)))
    s = np.where(np.arange(64) < 40, 2 * x, -1)
    np.testing.assert_array_equal(y, np.where(np.arange(64) < 40, np.roll(s, -1), 5))


def test_divergent_syncthreads_variants(fn):
    with pytest.raises(sim.SimSyncError, match="__syncthreads_count.*__syncthreads_or"):
        fn("divergent_kind")((1,), (64,), (sim.zeros(64),))
    still_usable(fn)


@pytest.mark.parametrize("quitter", [0, 5, 31, 63])
def test_thread_exits_while_others_wait(fn, quitter, monkeypatch):
    for order in ("natural", "reverse"):
        monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
        with pytest.raises(sim.SimSyncError, match=rf"__syncthreads \(line {line_of('exit_wait')}\)"):
            fn("exit_while_waiting")((1,), (64,), (sim.zeros(64), np.int32(quitter)))
    still_usable(fn)


def test_deadlock_is_reported_not_hung(fn):
    with pytest.raises(sim.SimSyncError, match="deadlock") as e:
        fn("shfl_vs_barrier")((1,), (64,), (sim.zeros(64),))
    msg = str(e.value)
    for w in (0, 1):
        assert f"warp {w} lanes 0-15 wait at __shfl_sync (line {line_of('dl_shfl')})" in msg, msg
        assert f"warp {w} lanes 16-31 wait at __syncthreads (line {line_of('dl_bar')})" in msg, msg
    still_usable(fn)


def test_shuffle_mask_excluding_caller(fn):
    with pytest.raises(sim.SimSyncError, match="lane 0 of warp 0.*0xfffffffe.*excludes"):
        fn("shfl_excludes_caller")((1,), (32,), (sim.zeros(32),))
    still_usable(fn)


def test_shuffle_reading_lane_outside_mask(fn):
    with pytest.raises(sim.SimSyncError, match="reads lane 20, which is outside the mask"):
        fn("shfl_reads_outside_mask")((1,), (32,), (sim.zeros(32),))
    still_usable(fn)


def test_device_assert(fn):
    x = np.zeros(32, np.int32)
    fn("device_assert")((1,), (32,), (x,))  # holds: no error
    x[17] = -1
    with pytest.raises(sim.SimTrapError, match=r"assertion failed: x\[threadIdx.x\] >= 0.*thread \(17,0,0\)"):
        fn("device_assert")((1,), (32,), (x,))
    still_usable(fn)


def test_trap(fn):
    with pytest.raises(sim.SimTrapError, match=r"__trap\(\).*thread \(9,0,0\) of block \(2,0,0\)"):
        fn("trap")((3,), (32,), (np.int32(9),))
    still_usable(fn)


def test_integer_division_by_zero(fn):
    a = np.arange(32, dtype=np.int32) * 7
    b = np.full(32, 3, np.int32)
    c = sim.zeros(32, np.int32)
    fn("int_div")((1,), (32,), (a, b, c))
    np.testing.assert_array_equal(c, a // 3)
    b[11] = 0
    with pytest.raises(sim.SimTrapError, match=r"division by zero.*thread \(11,0,0\)"):
        fn("int_div")((1,), (32,), (a, b, c))
    still_usable(fn)


def test_endless_spin_times_out(fn, monkeypatch):
    monkeypatch.setenv("CUPAGED_SIM_TIMEOUT", "0.5")
    with pytest.raises(sim.SimTimeoutError, match="time limit"):
        fn("spin")((1,), (32,), (np.zeros(1, np.int32),))
    fn("spin")((1,), (32,), (np.ones(1, np.int32),))  # the flag set: returns at once
    still_usable(fn)


def test_stack_overflow(fn):
    out = sim.zeros(32, np.int32)
    fn("deep")((1,), (32,), (np.int32(10), out))
    assert (out == 55).all()
    with pytest.raises(sim.SimMemoryError, match=r"stack overflow .*128 KiB.*in thread \(\d+,0,0\)"):
        fn("deep")((1,), (32,), (np.int32(1000), out))
    still_usable(fn)


def test_shuffle_width_not_a_power_of_two(fn):
    with pytest.raises(sim.SimSyncError, match="width 12 is not a power of two"):
        fn("shfl_width")((1,), (32,), (sim.zeros(32), np.int32(12)))
    y = sim.zeros(32)
    fn("shfl_width")((1,), (32,), (y, np.int32(8)))
    assert (y == 1).all()


# ---------------------------------------------------------------- order
def run(fn, order, monkeypatch, name, grid, block, *args):
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    fn(name)(grid, block, args)


def test_race_shows_as_order_dependence(fn, monkeypatch):
    outs = {}
    for order in ("natural", "reverse"):
        y = sim.zeros(128)
        run(fn, order, monkeypatch, "racy", (2,), (64,), y)
        outs[order] = y.tobytes()
    assert outs["natural"] != outs["reverse"]


def test_correct_kernel_bitwise_identical_in_every_order(fn, monkeypatch):
    n = 5000
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    results = {}
    for order in ("natural", "reverse", "random:1", "random:2", "random"):
        p = sim.zeros(20)
        run(fn, order, monkeypatch, "block_sum", (20,), (256,), x, p, np.int32(n))
        results[order] = p.tobytes()
    assert len(set(results.values())) == 1
    p = np.frombuffer(results["natural"], np.float32)
    np.testing.assert_allclose(p, np.pad(x * np.float32(1.000001), (0, 120)).reshape(20, 256).sum(1), rtol=1e-5)


def test_block_and_thread_order(fn, monkeypatch):
    def orders(order):
        c, out = sim.zeros(1, np.int32), sim.zeros(24, np.int32)
        run(fn, order, monkeypatch, "block_order", (2, 3, 4), (32,), c, out)
        c2, out2 = sim.zeros(1, np.int32), sim.zeros(64, np.int32)
        run(fn, order, monkeypatch, "thread_order", (1,), (64,), c2, out2)
        return out.copy(), out2.copy()

    b, t = orders("natural")
    np.testing.assert_array_equal(b, np.arange(24))
    np.testing.assert_array_equal(t, np.arange(64))
    b, t = orders("reverse")
    np.testing.assert_array_equal(b, np.arange(24)[::-1])
    np.testing.assert_array_equal(t, np.arange(64)[::-1])
    b1, t1 = orders("random:5")
    assert sorted(b1) == list(range(24)) and sorted(t1) == list(range(64))
    assert list(b1) != list(range(24)) and list(t1) != list(range(64))
    b2, t2 = orders("random:5")  # a seed reproduces its order
    np.testing.assert_array_equal(b1, b2)
    np.testing.assert_array_equal(t1, t2)
    b3, t3 = orders("random:6")
    assert list(b3) != list(b1) or list(t3) != list(t1)


def test_bad_order_spec(fn, monkeypatch):
    monkeypatch.setenv("CUPAGED_SIM_ORDER", "backwards")
    with pytest.raises(ValueError, match="CUPAGED_SIM_ORDER"):
        fn("ok")((1,), (32,), (np.zeros(32, np.float32), sim.zeros(32), np.int32(32)))


MISSING_BARRIER = r"""
// Thread 0 publishes a value the others read, with the barrier after the write forgotten (the
// pattern of paged_attention's key span). Warps: thread 0 and its readers sit in different warps.
extern "C" __global__ void publish(const int* x, int* y) {
  __shared__ int span;
  if (threadIdx.x == 0) span = 0;
  __syncthreads();
  if (threadIdx.x == 0) span = x[0];
  y[threadIdx.x] = span + 1;  // a __syncthreads() belongs before this read
}
"""


def test_the_default_orders_catch_a_missing_barrier(monkeypatch):
    """Natural order runs thread 0 first and hides the bug; reverse order shows it, which is why
    every backend-parametrized kernel test runs in all three (tests/conftest.py: SIM_ORDERS)."""
    from tests.conftest import SIM_ORDERS

    kernel = sim.RawModule(code=MISSING_BARRIER).get_function("publish")
    results = {}
    for order in SIM_ORDERS:
        monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
        y = sim.zeros(64, np.int32)
        kernel((1,), (64,), (sim.asarray(np.array([41], np.int32)), y))
        results[order] = y.copy()
    assert (results["natural"] == 42).all()
    assert (results["reverse"] != 42).any()


ACTIVEMASK = r"""
// Three branches of one warp each ask __activemask(); then the reconverged warp; then after a
// barrier, a branch that splits the second warp (16 threads: lanes 16-31 do not exist).
extern "C" __global__ void am(unsigned* out) {
  const int lane = threadIdx.x % 32;
  unsigned m;
  if (lane < 10) m = __activemask();
  else if (lane % 2) m = __activemask();
  else m = __activemask();
  out[threadIdx.x] = m;
  out[48 + threadIdx.x] = __activemask();
  __syncthreads();
  if (threadIdx.x < 40) out[96 + threadIdx.x] = __activemask();
}
"""


@pytest.mark.parametrize("order", ["natural", "reverse", "random:5"])
def test_activemask_is_the_lanes_at_the_same_call_site(monkeypatch, order):
    """__activemask() is the set of lanes of the warp that reach the same call site before their
    next scheduling point: inside divergent code, the lanes of that branch (not every live lane)."""
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    out = sim.zeros(144, np.uint32)
    sim.RawModule(code=ACTIVEMASK).get_function("am")((1,), (48,), (out,))
    lane = np.arange(48) % 32
    odd, even = sum(1 << l for l in range(11, 32, 2)), sum(1 << l for l in range(10, 32, 2))
    branch = np.where(lane < 10, 0x3FF, np.where(lane % 2 == 1, odd, even))
    branch[32:] = np.where(lane[32:] < 10, 0x3FF, np.where(lane[32:] % 2 == 1, odd & 0xFFFF, even & 0xFFFF))
    np.testing.assert_array_equal(out[:48], branch)
    np.testing.assert_array_equal(out[48:96], [0xFFFFFFFF] * 32 + [0xFFFF] * 16)
    np.testing.assert_array_equal(out[96:136], [0xFFFFFFFF] * 32 + [0xFF] * 8)
