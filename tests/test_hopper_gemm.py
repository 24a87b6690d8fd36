"""The worked Hopper example, tests/hopper_gemm.cu: a warp-specialised wgmma GEMM fed by tensor-map copies
through a 3-stage mbarrier ring, on the sim in every scheduling order (and on an sm_90 GPU when one exists).

The oracle is numpy: C = A B^T summed in float64 within each 16-wide K slice (one wgmma: exact products)
and rounded to float32 after each slice, the rounding the sim documents for wgmma; on a GPU (whose
tensor cores add with truncated alignment shifts) a tolerance replaces bit-exactness.
"""

from __future__ import annotations

import os
import re
import subprocess

import ml_dtypes
import numpy as np
import pytest

from cupaged import _nvrtc, make_tensor_map, sim
from tests.conftest import Backend, hopper_module, raw_module

SOURCE_PATH = os.path.join(os.path.dirname(__file__), "hopper_gemm.cu")
SHARED = 3 * 32768 + 1024


def source() -> str:
    with open(SOURCE_PATH) as f:
        return f.read()


def reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 accumulation rounded after each 16-wide K slice; each slice's sum exact in float64."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for k in range(0, a.shape[1], 16):
        acc = (acc.astype(np.float64) + a64[:, k:k + 16] @ b64[:, k:k + 16].T).astype(np.float32)
    return acc


def run(backend: Backend, m: int, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
    da, db = backend.asarray(a), backend.asarray(b)
    map_a = make_tensor_map(da, (128, 64), swizzle="128B")
    map_b = make_tensor_map(db, (128, 64), swizzle="128B")
    c = backend.empty((m, n), np.float32)
    f = hopper_module(backend, source()).get_function("hopper_gemm")
    f.max_dynamic_shared_size_bytes = SHARED
    f(((n + 127) // 128, (m + 127) // 128), (384,), (map_a, map_b, c, np.int32(m), np.int32(n), np.int32(k)),
      shared_mem=SHARED)
    return a, b, backend.to_numpy(c)


@pytest.mark.parametrize("m, n, k", [(128, 128, 64), (200, 136, 200)])
def test_hopper_gemm_matches_numpy(backend, m, n, k):
    a, b, c = run(backend, m, n, k)
    if backend.name == "sim":  # K past the end reads zeros: the reference pads K to whole tiles
        pad = -k % 64
        ref = reference(np.pad(a, ((0, 0), (0, pad))), np.pad(b, ((0, 0), (0, pad))))
        np.testing.assert_array_equal(c, ref)
    else:
        np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64).T, rtol=1e-5, atol=1e-4)


def test_sass_shows_gmma_and_tensor_copies():
    """Compiled on its own for sm_90a, the kernel's SASS runs HGMMA and UTMALDG, with no local memory."""
    from cupaged.sim.profiler._sass import nvdisasm

    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm (the profiling extra) is not installed")
    prog = _nvrtc.compile_cubin(source(), arch="sm_90a", options=("-std=c++17", "-Xptxas=-v"))
    assert "0 bytes spill stores" in prog.log and "0 bytes spill loads" in prog.log, prog.log
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hopper_gemm_{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(prog.cubin)
    try:
        sass = subprocess.run([tool, path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)
    opcodes = set(re.findall(r"\b(HGMMA|UTMALDG|SYNCS\.[A-Z.]+|USETMAXREG)", sass))
    assert {"HGMMA", "UTMALDG", "USETMAXREG"} <= opcodes, opcodes


def test_a_missing_fence_before_wgmma_is_caught():
    """The same kernel with its wgmma.fence removed fails on the sim: the first wgmma of each thread needs one."""
    code = source().replace('asm volatile("wgmma.fence.sync.aligned;" ::: "memory");', "")
    be = Backend("sim")
    a = sim.asarray(np.zeros((128, 64), ml_dtypes.bfloat16))
    maps = [make_tensor_map(a, (128, 64), swizzle="128B")] * 2
    c = sim.empty((128, 128), np.float32)
    f = raw_module(be, code).get_function("hopper_gemm")
    f.max_dynamic_shared_size_bytes = SHARED
    with pytest.raises(sim.SimSyncError, match="wgmma.fence"):
        f((1, 1), (384,), (*maps, c, np.int32(128), np.int32(128), np.int32(64)), shared_mem=SHARED)
