"""Bounds beyond what guard pages catch.

Guard pages fault on an access past an array's page, but an array's start is 16-byte aligned and
its end is not page aligned: up to 15 bytes after the end and up to 4 KiB before the start read
poison instead of faulting (0xFF: -1 as an index, which kernels take for padding).
``CUPAGED_SIM_BOUNDS=1`` builds instrumented modules whose every load and store is checked
byte-exactly against the live guarded arrays (CI runs the kernel tests once in that mode). In any
mode, a stray write far past one array that lands in another live array's pad or slack is reported
by the launch that made it.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import sim

SRC = r"""
extern "C" __global__ void gather(const int* idx, int* out, int first) {
  out[threadIdx.x] = idx[first + (int)threadIdx.x];
}
extern "C" __global__ void poke(float* a, long long i) { if (threadIdx.x == 0) a[i] = 1.0f; }
"""


def _gather(first, idx=None):
    idx = sim.asarray(np.arange(10, dtype=np.int32)) if idx is None else idx
    out = sim.zeros(4, np.int32)
    sim.RawModule(code=SRC).get_function("gather")((1,), (4,), (idx, out, np.int32(first)))
    return out


@pytest.mark.parametrize("first, offset", [(7, "40"), (-1, "-4"), (-1000, "-(4000|3996|3992|3988)")])
def test_bounds_mode_catches_reads_just_outside_an_array(monkeypatch, first, offset):
    assert (_gather(first) < 0).any()  # without the mode: poison (-1) comes back, no error
    monkeypatch.setenv("CUPAGED_SIM_BOUNDS", "1")
    with pytest.raises(sim.SimMemoryError, match=rf"out-of-bounds read of 4 byte\(s\), .*: idx at byte offset {offset} "
                                                  r"\(its bytes span 0\.\.40"):
        _gather(first)
    np.testing.assert_array_equal(_gather(3), [3, 4, 5, 6])  # in bounds: fine in the instrumented build


def test_bounds_mode_checks_a_copied_plain_array_exactly(monkeypatch):
    """A plain numpy argument is copied into guarded memory with a few leading bytes (to keep its
    alignment): those are not the array's either."""
    monkeypatch.setenv("CUPAGED_SIM_BOUNDS", "1")
    base = np.arange(12, dtype=np.int32)
    with pytest.raises(sim.SimMemoryError, match=r"idx at byte offset -4 \(its bytes span 0\.\.40"):
        _gather(-1, base[1:11])


def test_stray_write_into_another_array_is_reported_by_its_launch():
    a, b = sim.zeros(10), sim.zeros(10)
    i = (b.ctypes.data - 4 - a.ctypes.data) // 4  # the 4 bytes just before b's start: its pad
    kernel = sim.RawModule(code=SRC).get_function("poke")
    with pytest.raises(sim.SimMemoryError, match="not an argument of this launch"):
        kernel((1,), (32,), (a, np.int64(i)))
    kernel((1,), (32,), (b, np.int64(0)))  # b is intact and usable: the damage was repaired
    assert b[0] == 1.0
