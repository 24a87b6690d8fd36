"""Out-of-range indices on the default path (no validate=) never corrupt the process, and a fault
names the array the address was computed from.

Every store of a sim kernel is checked (cupaged_sim_bounds.h): a kernel writes only its arguments'
arrays, shared memory, its stack and the module's own data, so a wild store is a SimMemoryError at
the launch that made it, before it lands. Before, a slot of 100 000 in a 32-slot cache wrote into
whatever memory lay there: the process segfaulted later in garbage collection, or nothing was
reported at all. Each guarded array sits inside 1 GiB guard zones (cupaged/sim/_memory.py), so an
address up to that far past an array -- a slot or block id far out of range -- is named after it
(slot 10 000 was blamed on slot_mapping, value_cache or key depending on the run, block id 1000 on
q with a negative offset). Loads are not checked on the default path (CUPAGED_SIM_BOUNDS=1 checks
them): a wild load faults in its array's guard zone, or reads garbage beyond it.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import cupaged
from cupaged import sim
from cupaged.sim import _memory

F16 = np.float16
SRC = r"""
extern "C" __global__ void poke(float* a, long long i, float v) { a[i] = v; }
extern "C" __global__ void poke_const(const float* a, float* out, long long i) {
  const_cast<float*>(a)[i] = 1.0f;
  out[0] = 2.0f;
}
"""


def _untouched(*arrays):
    """Every live guarded array's pad and slack are poison still, and the process goes on."""
    gc.collect()
    assert all(b.damaged() is None for b in _memory.live_buffers())
    return [a.copy() for a in arrays]


@pytest.mark.parametrize("slot", [10_000, 100_000, 200_000, 500_000])
@pytest.mark.parametrize("guarded", [True, False])
def test_flash_cache_write_past_the_pool(slot, guarded):
    rng = np.random.default_rng(slot)
    key = rng.standard_normal((2, 2, 64)).astype(F16)
    caches = [np.zeros((2, 16, 2, 64), F16) for _ in range(2)]  # 32 slots
    if guarded:
        caches = [sim.asarray(c) for c in caches]
    with pytest.raises(sim.SimMemoryError, match=rf"past the end of an array: key_cache at byte offset {slot * 256}"):
        cupaged.reshape_and_cache_flash(key, key, *caches, np.array([slot, 0]))
    before = _untouched(*caches)
    cupaged.reshape_and_cache_flash(key, key, *caches, np.array([3, 0]))  # the next launch is sound
    np.testing.assert_array_equal(caches[0][0, 3], key[0])
    np.testing.assert_array_equal(caches[0][1:], before[0][1:])


def test_mla_cache_write_past_the_pool():
    kv_c, k_pe = np.ones((2, 512), F16), np.ones((2, 64), F16)
    cache = sim.zeros((2, 16, 576), F16)
    with pytest.raises(sim.SimMemoryError, match=rf"past the end of an array: kv_cache at byte offset "):
        cupaged.concat_and_cache_mla(kv_c, k_pe, cache, np.array([0, 300_000]))
    _untouched(cache)


def test_rope_and_cache_write_past_the_pool():
    rope = cupaged.RotaryEmbedding(64)
    q, k, v = (np.ones((2, h, 64), F16) for h in (4, 2, 2))
    caches = [sim.zeros((2, 16, 2, 64), F16) for _ in range(2)]
    with pytest.raises(sim.SimMemoryError, match=r"past the end of an array: key_cache at byte offset "):
        cupaged.rope_and_cache(q, k, v, np.array([0, 1], np.int64), rope.cos_sin_cache(16), *caches,
                               np.array([300_000, 0]))
    _untouched(*caches)


def test_block_id_past_the_pool_is_named_after_the_cache():
    """A wild read (not checked on the default path) faults in the guard zone of the cache it
    started from, whatever array lies beyond."""
    q = sim.asarray(np.ones((1, 4, 64), F16))
    caches = [sim.zeros((4, 16, 2, 64), F16) for _ in range(2)]
    tables = sim.asarray(np.array([[1000]], np.int32))
    with pytest.raises(sim.SimMemoryError, match=r"out-of-bounds access of (key|value)_cache at byte offset \d+"):
        cupaged.paged_attention(q, *caches, tables, sim.asarray(np.array([5], np.int32)))


def test_store_into_an_array_that_is_not_an_argument():
    """Beyond its guard zone an address meets other memory: another live array's bytes (the guard
    zones let nothing there through before: they are readable, writable memory)."""
    a, b = sim.zeros(10), sim.zeros(10)
    kernel = sim.RawModule(code=SRC).get_function("poke")
    with pytest.raises(sim.SimMemoryError, match=r"out-of-bounds write of a at byte offset -?\d+: .*in the memory of a "
                                                 r"40-byte guarded array that is not an argument of this launch"):
        kernel((1,), (1,), (a, np.int64((b.ctypes.data + 8 - a.ctypes.data) // 4), np.float32(7)))
    assert not b.any() and not a.any()


def test_store_into_the_heap_is_stopped_before_it_lands():
    heap = np.zeros(4096, np.float32)  # numpy's own memory, beyond every guarded mapping
    a = sim.zeros(10)
    kernel = sim.RawModule(code=SRC).get_function("poke")
    with pytest.raises(sim.SimMemoryError, match=r"out-of-bounds write of a at byte offset -?\d+: address .*far "
                                                 r"outside its memory .*stopped before it landed"):
        kernel((1,), (1,), (a, np.int64((heap.ctypes.data + 64 - a.ctypes.data) // 4), np.float32(7)))
    assert not heap.any()


def test_store_through_a_const_argument_stays_allowed():
    """The arrays a launch was given are its to write, whatever the parameter's constness (a cast
    is legal C++): only memory it was not given is refused."""
    a, out = sim.zeros(4), sim.zeros(1)
    sim.RawModule(code=SRC).get_function("poke_const")((1,), (1,), (a, out, np.int64(2)))
    assert a[2] == 1.0 and out[0] == 2.0
