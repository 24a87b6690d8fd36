"""Engine and profiler state never outlives the launch that lent it.

A launch lends the engine memory that Python owns and frees when the call returns: the profiler's
record (``ProfLaunch`` and its ``ProfArg`` rows, cupaged/sim/profiler/_probe.py) and the bounds table of
guarded arrays (cupaged/sim/_memory.py ``regions``). The profiled build instruments the engine's own
code too, so the next launch's wrapper and prologue call the access hooks before that launch has
installed anything; if the previous launch's argument ranges were still set there, a hook that
matched them read the freed record (an intermittent segfault of CI: whether the read faulted
depended on what reused the memory).

The repro makes the dangling read certain: the arguments' ranges overlap (one array passed for two
parameters) and straddle the engine's own state (one array allocated above the profiled module,
one below), the freed record is kept and overwritten, as reuse by Python would, and a second
profiled launch follows. It runs in a subprocess, since the failure it guards against kills the
process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cupaged import sim

SRC = r"""
extern "C" __global__ void add3(const float* a, float* b, const float* c) {
  b[threadIdx.x] = a[threadIdx.x] + c[threadIdx.x];
}
"""

REPRO = textwrap.dedent(r'''
    import ctypes, mmap, sys
    import numpy as np
    from cupaged import sim
    from cupaged.sim import _memory
    from cupaged.sim.profiler import _profile

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    FAILED = ctypes.c_void_p(-1).value

    def fill_above(boundary):
        """Reserve every free range of address space above `boundary` (Linux places a mapping in the
        highest gap it fits, so this takes halving sizes), so that the next mappings land below it."""
        kept, size = [], 1 << 30
        while size >= mmap.PAGESIZE:
            p = libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, -1, 0)
            if p is not None and p != FAILED and p > boundary:
                kept.append(p)
                continue
            if p is not None and p != FAILED:
                libc.munmap(ctypes.c_void_p(p), ctypes.c_size_t(size))
            size //= 2
        return kept

    mod = sim.RawModule(code=sys.argv[1])
    kernel = mod.get_function("add3")
    above = sim.zeros(32, np.float32)
    reserved = fill_above(_memory.guarded_buffer(above).end_addr)
    lib = mod._variant(0, True)[0]  # loads the profiled build, now below `above`
    below = sim.zeros(32, np.float32)
    engine = ctypes.addressof(lib.cupaged_sim_error().contents)
    if not below.ctypes.data < engine < above.ctypes.data:
        print(f"layout: {below.ctypes.data:#x} {engine:#x} {above.ctypes.data:#x}")
        sys.exit(3)

    records = []
    make = _profile.LaunchProbe.__init__
    def keep(self, *args, **kwargs):
        make(self, *args, **kwargs)
        records.append(self.structs)  # stands for the freed record, kept to be overwritten
    _profile.LaunchProbe.__init__ = keep

    above[:] = np.arange(32)
    for launch in range(2):
        with sim.profile() as prof:
            kernel((1,), (32,), (above, below, above))
        ctypes.memset(ctypes.addressof(records[-1].launch), 0x41, ctypes.sizeof(records[-1].launch))
        ctypes.memset(ctypes.addressof(records[-1].args), 0x41, ctypes.sizeof(records[-1].args))
    traffic = prof.launches[0].args
    print(float(below.sum()), traffic["b"].bytes_written, traffic["a"].bytes_read)
''')


def test_profiled_launch_after_a_freed_record_with_overlapping_ranges():
    sim.RawModule(code=SRC).get_function("add3")  # compile both builds here: the child only loads them
    with sim.profile():
        sim.RawModule(code=SRC).get_function("add3")((1,), (32,), (sim.zeros(32), sim.zeros(32), sim.zeros(32)))
    done = subprocess.run([sys.executable, "-c", REPRO, SRC], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    total, written, read = done.stdout.split()
    assert float(total) == 2 * np.arange(32).sum()
    assert (int(written), int(read)) == (32 * 4, 2 * 32 * 4)  # a and c are one array: the first parameter counts both


@pytest.mark.parametrize("name, value, expected", [
    ("CUPAGED_SIM_ORDER", "random:abc", "CUPAGED_SIM_ORDER: the seed"),
    ("CUPAGED_SIM_ORDER", "random:-1", "CUPAGED_SIM_ORDER: the seed"),
    ("CUPAGED_SIM_ORDER", "reverse:3", "CUPAGED_SIM_ORDER must be"),
    ("CUPAGED_SIM_TIMEOUT", "abc", "CUPAGED_SIM_TIMEOUT must be"),
    ("CUPAGED_SIM_TIMEOUT", "0", "CUPAGED_SIM_TIMEOUT must be"),
    ("CUPAGED_SIM_TIMEOUT", "nan", "CUPAGED_SIM_TIMEOUT must be"),
    ("CUPAGED_SIM_ARCH", "sm_75", "CUPAGED_SIM_ARCH must be one of .*sm_80 or newer.*'sm_75'"),
    ("CUPAGED_SIM_ARCH", "hopper", "CUPAGED_SIM_ARCH must be one of"),
])
def test_environment_variables_are_parsed_with_their_name(monkeypatch, name, value, expected):
    kernel = sim.RawModule(code=SRC).get_function("add3")
    plain = np.ones(32, np.float32)  # staged through a copy: nothing is copied back on a rejection
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=expected):
        kernel((1,), (32,), (plain, plain, plain))
    np.testing.assert_array_equal(plain, 1.0)
