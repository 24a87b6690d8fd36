"""Sim errors name kernel parameters as the source does: the names are read from the parameter
list after comments are removed (shape comments hold commas and angle brackets)."""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import _runtime, sim
from cupaged.sim._params import param_names

TRICKY = r"""
namespace ns {
template <class T, int N>
struct Pair { T a[N]; };

// A declaration first: unnamed parameters, which the definition below names.
template <class T, int N> __global__ void tricky(const T*, Pair<T, N>, T* __restrict__, int);

template <class T, int N>
__global__ void __launch_bounds__(256, 1) tricky(
    const T* __restrict__ src,          // [num_tokens, num_heads, head_size], or nullptr (use <dst>)
    Pair<T, N> pair /* {a, b}, twice */,
    T* __restrict__ dst,                // [num_tokens, (x, y)]
    int n) {                            // <, >, (, )
  if (threadIdx.x < n) dst[threadIdx.x] = src[threadIdx.x] + pair.a[0];
}
}  // namespace ns

// extern "C" __global__ void commented_out(float* x) {}  -- not a kernel of this source
extern "C" __global__ void defaults(float* out, unsigned int, const long long stride = 4,
                                    [[maybe_unused]] int __attribute__((unused)) flags = (1 << 2) | 1,
                                    int cmp = 3 >= 2) {
  out[threadIdx.x] = float(stride);
}
"""


@pytest.mark.parametrize("name, count, want", [
    ("ns::tricky<float, 2>", 4, ["src", "pair", "dst", "n"]),
    ("ns::tricky<__half, 128>", 4, ["src", "pair", "dst", "n"]),
    ("defaults", 5, ["out", "argument 1", "stride", "flags", "cmp"]),
    ("ns::tricky<float, 2>", 3, None),  # no overload with 3 parameters
    ("no_such_kernel", 1, None),
])
def test_param_names_from_source(name, count, want):
    assert param_names(TRICKY, name, count) == want


def test_commented_out_kernel_is_not_a_kernel_and_errors_name_parameters():
    mod = sim.RawModule(code=TRICKY, name_expressions=("ns::tricky<float, 2>",))
    k = mod.get_function("ns::tricky<float, 2>")
    assert k.param_names == ("src", "pair", "dst", "n")
    with pytest.raises(KeyError):
        mod.get_function("commented_out")
    with pytest.raises(TypeError, match=r"ns::tricky<float, 2>: dst points to f32: expected a float32 array"):
        k((1,), (4,), (np.zeros(4, np.float32), np.zeros((), np.dtype([("a", np.float32, 2)]))[()],
                       np.zeros(4, np.float64), np.int32(4)))


def test_every_shipped_kernel_gets_its_parameter_names():
    """Through the RawKernel machinery, so the count is the compiled kernel's (the modules are
    the ones the op tests already built: memoized in-process and cached on disk)."""
    for family in _runtime.families():
        for name in family.name_expressions:
            kernel = family.function(name, np)
            assert len(kernel.param_names) == len(kernel.param_types) > 0, name
            unnamed = [p for p in kernel.param_names if p.startswith("argument ") or not p.isidentifier()]
            assert not unnamed, f"{family.stem}: {name}: {kernel.param_names}"
            assert len(set(kernel.param_names)) == len(kernel.param_names), name
