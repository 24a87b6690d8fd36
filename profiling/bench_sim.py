"""Cost of a launch on the CPU simulator (cupaged.sim): what the test suite pays per kernel call.

Times tiny kernels end to end (argument checks, staging, fibers, barriers) on guarded arrays and on
plain numpy arrays (copied in and out per launch). CPU timings of the sim, not GPU timings.

    python profiling/bench_sim.py
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

from cupaged import sim  # noqa: E402

SOURCE = r"""
extern "C" __global__ void axpy(const float* x, float* y, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
extern "C" __global__ void reverse_block(float* y) {
  __shared__ float s[128];
  s[threadIdx.x] = threadIdx.x;
  __syncthreads();
  y[blockIdx.x * 128 + threadIdx.x] = s[127 - threadIdx.x];
}
"""


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    module = sim.RawModule(code=SOURCE)
    axpy, reverse = module.get_function("axpy"), module.get_function("reverse_block")
    guarded = (sim.zeros(32, np.float32), sim.zeros(32, np.float32))
    plain = (np.zeros(32, np.float32), np.zeros(32, np.float32))
    out = sim.zeros(64 * 128, np.float32)
    cases = [
        ("1 block x 32 threads, guarded arrays", lambda: axpy((1,), (32,), (*guarded, np.float32(2), np.int32(32)))),
        ("1 block x 32 threads, plain numpy arrays", lambda: axpy((1,), (32,), (*plain, np.float32(2), np.int32(32)))),
        ("64 blocks x 128 threads, one barrier", lambda: reverse((64,), (128,), (out,))),
    ]
    rows = []
    for label, run in cases:
        run()
        with _bench.nvtx_range(label):
            ms = _bench.time_cpu(lambda: [run() for _ in range(50)], reps=5) / 50
        rows.append(_bench.summarize(label, "v1", ms, 0, None))
    _bench.print_table(rows, "SIM launch cost (CPU timings of the simulator, not GPU timings)")


if __name__ == "__main__":
    main()
