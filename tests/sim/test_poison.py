"""CUPAGED_SIM_POISON: what unwritten memory reads as on the sim.

``nan`` (default) fills shared memory, the pad and slack around arrays and pending cp.async
destinations with 0xFF bytes (NaN in every float format, -1 as an integer); ``large`` with 0x7B
bytes, a large positive value in every format. NaN is invisible to some bugs: fmaxf ignores it,
so a max reduction that forgot its initializer passes under ``nan`` and fails under ``large``.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import sim

SRC = r"""
// A max reduction over the block whose accumulator was never initialized (the bug).
extern "C" __global__ void block_max(const float* x, float* out) {
  __shared__ float m;
  __syncthreads();
  for (int t = 0; t < blockDim.x; ++t) {
    if (threadIdx.x == t) m = fmaxf(m, x[t]);
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = m;
}
// Reads what a pending cp.async destination holds before the wait, then after it.
extern "C" __global__ void pending(const unsigned* src, unsigned* out) {
  __shared__ __align__(16) unsigned s[4];
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(s))), "l"(src));
  asm volatile("cp.async.commit_group;\n" ::);
  out[0] = s[0];
  asm volatile("cp.async.wait_group 0;\n" ::);
  out[1] = s[0];
}
"""


@pytest.fixture(scope="module")
def fn():
    return sim.RawModule(code=SRC).get_function


@pytest.mark.parametrize("poison, byte", [("nan", 0xFF), ("large", 0x7B)])
def test_poison_fills_shared_memory_arrays_and_pending_copies(fn, monkeypatch, poison, byte):
    monkeypatch.setenv("CUPAGED_SIM_POISON", poison)
    word = np.uint32(byte * 0x01010101)
    a = sim.empty(5, np.uint32)
    np.testing.assert_array_equal(a, word)  # an empty array holds poison
    out = sim.zeros(2, np.uint32)
    fn("pending")((1,), (1,), (sim.asarray(np.array([7, 8, 9, 10], np.uint32)), out))
    np.testing.assert_array_equal(out, [word, 7])
    x = np.array([-3.0, -1.5, -2.0], np.float32)
    got = sim.zeros(1, np.float32)
    fn("block_max")((1,), (3,), (sim.asarray(x), got))
    if poison == "nan":
        assert got[0] == -1.5  # fmaxf(NaN, x) is x: the missing initializer goes unseen
    else:
        assert got[0] == np.frombuffer(bytes([byte] * 4), np.float32)[0] > 1e36  # the bug shows


def test_unknown_poison_is_rejected(monkeypatch):
    monkeypatch.setenv("CUPAGED_SIM_POISON", "zero")
    with pytest.raises(ValueError, match="CUPAGED_SIM_POISON must be nan or large"):
        sim.empty(4)
