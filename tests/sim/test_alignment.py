"""The sim catches misaligned accesses the GPU faults on but x86 tolerates.

The module is compiled with -fsanitize=alignment and the engine is the handler: a typed access
(a float4 / uint4 / __half2 load or store) at an address that is not a multiple of its type's
alignment is a SimMemoryError naming the argument, the byte offset and the CUDA thread. The
attention tests below break cupaged's own alignment check (which decides whether a kernel may use
16-byte loads) on purpose: with misaligned caches the kernel must then fail, not pass.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import _attention_args, sim
from tests.test_paged_attention import BF16, C, build

SRC = r"""
#include <cuda_fp16.h>
extern "C" __global__ void load4(const float* x, float* y, int offset) {
  const float4 v = *reinterpret_cast<const float4*>(x + 4 * threadIdx.x + offset);
  y[threadIdx.x] = v.x + v.y + v.z + v.w;
}
extern "C" __global__ void store_half2(__half* y, int offset) {
  *reinterpret_cast<__half2*>(y + 2 * threadIdx.x + offset) = __floats2half2_rn(1.0f, 2.0f);
}
"""


@pytest.fixture(scope="module")
def fn():
    return sim.RawModule(code=SRC).get_function


def test_aligned_vector_access_runs(fn):
    x = sim.asarray(np.arange(64, dtype=np.float32))
    y = sim.zeros(8, np.float32)
    fn("load4")((1,), (8,), (x, y, np.int32(4)))
    np.testing.assert_array_equal(y, np.arange(4, 36, dtype=np.float32).reshape(8, 4).sum(1))


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_misaligned_float4_load_names_the_argument(fn, offset):
    x = sim.asarray(np.arange(64, dtype=np.float32))
    with pytest.raises(sim.SimMemoryError, match=rf"misaligned .*16-byte-aligned type .*: x at byte offset {4 * offset} "
                                                  r".*in thread \(0,0,0\)"):
        fn("load4")((1,), (1,), (x, sim.zeros(8, np.float32), np.int32(offset)))


def test_misaligned_half2_store_names_the_argument(fn):
    with pytest.raises(sim.SimMemoryError, match=r"misaligned (store|access) of a 4-byte-aligned type .*: y at byte offset 2"):
        fn("store_half2")((1,), (1,), (sim.zeros(16, np.float16), np.int32(1)))


def _misaligned(a: np.ndarray) -> np.ndarray:
    """``a``'s values in guarded memory whose start is one element past a 16-byte boundary."""
    buf = sim.empty(a.size + 1, a.dtype)
    out = buf[1:].reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32, BF16])
def test_misaligned_caches_fail_when_the_alignment_check_is_broken(monkeypatch, dtype):
    inputs, options, _ = build(C(dtype=dtype, seqs=((1, 37), (1, 16))))
    args = {k: (None if v is None else sim.asarray(v)) for k, v in inputs.items()}
    args["key_cache"], args["value_cache"] = _misaligned(inputs["key_cache"]), _misaligned(inputs["value_cache"])
    monkeypatch.setattr(_attention_args, "_aligned", lambda *a: True)  # the bug: 16-byte loads on any address
    with pytest.raises(sim.SimMemoryError, match=r"misaligned .*: (key|value)_cache.* at byte offset"):
        cupaged.paged_attention(**args, **options)
