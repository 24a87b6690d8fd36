"""Valid CUDA that NVRTC compiles also compiles and runs correctly on the sim.

Each source below is compiled with NVRTC (``test_sources_compile_under_nvrtc``: proof that it is
valid CUDA, no GPU needed) and run on the sim against a numpy model written from CUDA's documented
semantics:

* ``__noinline__`` (a keyword of nvcc/NVRTC, not a macro of NVIDIA's headers).
* ``min`` / ``max``: exactly the overloads of ``crt/math_functions.h``: a signed/unsigned mix
  compares both converted to the unsigned type (``min(-1, 1u) == 1u``); ``min(long long, int)`` is
  ambiguous under NVRTC, and so on the sim.
* ``hexp`` ... ``hrint`` and their ``h2`` / bfloat16 forms, device-only in cuda_fp16.h /
  cuda_bf16.h: the sim computes in float and rounds once, so each result is within 1 ulp of the
  correctly rounded value (the GPU's are approximations: compare GPU and sim with tolerances).
* cooperative groups (CUDA Programming Guide, "Cooperative Groups"): ``thread_block``;
  ``tiled_partition<N>`` makes tiles of N consecutive thread ranks; a tile's shuffles act like the
  warp shuffles with width N within the tile (``shfl(v, s)`` reads rank ``s mod N``, ``shfl_up``
  and ``shfl_down`` keep their own value when the source is outside the tile); ``ballot`` bit i is
  tile rank i; ``cg::reduce`` gives every thread the reduction of its tile.
* ``__shared__ alignas(16) T x[...]`` (``alignas`` after ``__shared__``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupaged import sim

OPTS = ("-std=c++17",)

# ---------------------------------------------------------------- __noinline__
NOINLINE_SRC = r"""
__device__ __noinline__ int twice(int x) { return 2 * x; }
template <class T> __device__ __noinline__ T add(T a, T b) { return a + b; }
static __device__ __noinline__ float halve(float x) { return 0.5f * x; }
struct Three { __device__ __noinline__ static int get() { return 3; } };

extern "C" __global__ void noinline_k(const int* in, int* out, float* f) {
  const int i = threadIdx.x;
  out[i] = add(twice(in[i]), Three::get());
  f[i] = halve(float(in[i]));
}
"""

# ---------------------------------------------------------------- min / max
MINMAX_PAIRS = [  # (A, B, result type): every overload of crt/math_functions.h
    ("int", "int", "int"), ("unsigned", "unsigned", "unsigned"),
    ("int", "unsigned", "unsigned"), ("unsigned", "int", "unsigned"),
    ("long", "long", "long"), ("unsigned long", "unsigned long", "unsigned long"),
    ("long", "unsigned long", "unsigned long"), ("unsigned long", "long", "unsigned long"),
    ("long long", "long long", "long long"),
    ("unsigned long long", "unsigned long long", "unsigned long long"),
    ("long long", "unsigned long long", "unsigned long long"),
    ("unsigned long long", "long long", "unsigned long long"),
    ("float", "float", "float"), ("double", "double", "double"),
    ("float", "double", "double"), ("double", "float", "double"),
]
CTYPE = {"int": np.int32, "unsigned": np.uint32, "long": np.int64, "unsigned long": np.uint64,
         "long long": np.int64, "unsigned long long": np.uint64, "float": np.float32, "double": np.float64}

MINMAX_SRC = r"""
template <class A, class B> struct same { static constexpr bool value = false; };
template <class A> struct same<A, A> { static constexpr bool value = true; };
""" + "".join(
    f"static_assert(same<decltype(min(({a})1, ({b})1)), {r}>::value && "
    f"same<decltype(max(({a})1, ({b})1)), {r}>::value, \"min/max({a}, {b}) returns {r}\");\n"
    for a, b, r in MINMAX_PAIRS) + r"""
template <class A, class B>
__global__ void minmax(const A* a, const B* b, decltype(min(A(), B()))* lo, decltype(max(A(), B()))* hi, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { lo[i] = min(a[i], b[i]); hi[i] = max(a[i], b[i]); }
}

// The named forms of crt/math_functions.h.
extern "C" __global__ void named_minmax(const unsigned* u, const long long* ll, unsigned* ou,
                                        long long* oll, unsigned long long* oull, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int j = n - 1 - i;
  ou[2 * i] = umin(u[i], u[j]); ou[2 * i + 1] = umax(u[i], u[j]);
  oll[2 * i] = llmin(ll[i], ll[j]); oll[2 * i + 1] = llmax(ll[i], ll[j]);
  oull[2 * i] = ullmin(ll[i], ll[j]); oull[2 * i + 1] = ullmax(ll[i], ll[j]);
}
"""
MINMAX_NAMES = [f"minmax<{a}, {b}>" for a, b, _ in MINMAX_PAIRS]

# ---------------------------------------------------------------- half / bfloat16 math
# name: (lo, hi, reference in float64); inputs drawn uniformly, rcp's with a random sign.
HMATH = {
    "exp": (-9, 10, np.exp), "exp2": (-14, 15, np.exp2), "exp10": (-4, 4.5, lambda x: 10.0 ** x),
    "log": (1e-3, 6e4, np.log), "log2": (1e-3, 6e4, np.log2), "log10": (1e-3, 6e4, np.log10),
    "sqrt": (0, 6e4, np.sqrt), "rsqrt": (1e-3, 6e4, lambda x: 1 / np.sqrt(x)), "rcp": (1e-2, 1e3, lambda x: 1 / x),
    "sin": (-8, 8, np.sin), "cos": (-8, 8, np.cos), "tanh": (-4, 4, np.tanh), "tanh_approx": (-4, 4, np.tanh),
    "trunc": (-50, 50, np.trunc), "ceil": (-50, 50, np.ceil), "floor": (-50, 50, np.floor), "rint": (-50, 50, np.rint),
}
EXACT = ("trunc", "ceil", "floor", "rint")

HMATH_SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// x, y: [function][n]. y2lo / y2hi: the h2 form on the pair (x[i], x[n - 1 - i]).
template <class T, class T2>
__global__ void hmath(const T* x, T* y, T* y2lo, T* y2hi, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int k = 0;
#define F(name) { const T a = x[k * n + i], b = x[k * n + n - 1 - i]; y[k * n + i] = h##name(a); \
    const T2 r = h2##name(T2(a, b)); y2lo[k * n + i] = r.x; y2hi[k * n + i] = r.y; ++k; }
  """ + " ".join(f"F({f})" for f in HMATH) + r"""
#undef F
}
"""
HMATH_TYPES = {"f16": ("hmath<__half, __half2>", np.float16), "bf16": ("hmath<__nv_bfloat16, __nv_bfloat162>", ml_dtypes.bfloat16)}

# ---------------------------------------------------------------- cooperative groups
CG_SRC = r"""
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
namespace cg = cooperative_groups;

struct Quad { float a, b, c, d; };

// One row of outputs per thread, at its block's linear index * block size + block rank.
// geo: the block's and the tile's geometry. arg: [shfl source, up/down delta, xor mask, predicate].
template <unsigned N>
__global__ void tiles(const float* fv, const int* iv, const int* arg, int* geo, float* fo, int* io,
                      unsigned* ballot) {
  __shared__ float s_tile[1024], s_block[1024];
  cg::thread_block block = cg::this_thread_block();
  cg::thread_block_tile<N> tile = cg::tiled_partition<N>(block);  // converted from <N, thread_block>
  const unsigned r = block.thread_rank();
  const unsigned g = (blockIdx.x + blockIdx.y * gridDim.x) * block.size() + r;
  const float v = fv[g];
  const int w = iv[g];
  const int* a = arg + 4 * g;

  int* G = geo + 21 * g;
  const dim3 gi = block.group_index(), ti = block.thread_index(), gd = block.group_dim(), dt = block.dim_threads();
  G[0] = r; G[1] = block.size(); G[2] = block.num_threads();
  G[3] = gi.x; G[4] = gi.y; G[5] = gi.z; G[6] = ti.x; G[7] = ti.y; G[8] = ti.z;
  G[9] = gd.x; G[10] = gd.y; G[11] = gd.z; G[12] = dt.x; G[13] = dt.y; G[14] = dt.z;
  G[15] = tile.thread_rank(); G[16] = tile.size(); G[17] = tile.num_threads();
  G[18] = tile.meta_group_rank(); G[19] = tile.meta_group_size();
  G[20] = int(cg::thread_rank(tile) + 100 * cg::group_size(tile));

  float* F = fo + 12 * g;
  F[0] = tile.shfl(v, a[0]);
  F[1] = tile.shfl_up(v, unsigned(a[1]));
  F[2] = tile.shfl_down(v, unsigned(a[1]));
  F[3] = tile.shfl_xor(v, unsigned(a[2]));
  F[4] = float(tile.shfl_xor(double(v) * 3.0, unsigned(a[2])));  // 8 bytes
  const Quad q = tile.shfl(Quad{v, v + 1.0f, v + 2.0f, v + 3.0f}, a[0]);  // 16 bytes: in slices
  F[5] = q.a; F[6] = q.d;
  F[7] = cg::reduce(tile, v, cg::plus<float>());
  F[8] = cg::reduce(tile, v, cg::greater<float>());
  F[9] = cg::reduce(tile, v, cg::less<float>());
  // Ordering through shared memory: the neighbour in the tile, the mirror in the block.
  s_tile[r] = v;
  tile.sync();
  F[10] = s_tile[(r & ~(N - 1)) | ((r + 1) & (N - 1))];
  s_block[r] = v;
  cg::sync(block);
  F[11] = s_block[block.size() - 1 - r];
  block.sync();

  int* I = io + 5 * g;
  I[0] = tile.any(a[3]);
  I[1] = tile.all(a[3]);
  I[2] = cg::reduce(tile, w, cg::plus<int>());
  I[3] = cg::reduce(tile, w, cg::less<int>());
  I[4] = cg::reduce(tile, w, cg::greater<int>());
  ballot[g] = tile.ballot(a[3]);
}

// A tile of a tile: the meta group is the parent tile's.
template <unsigned P, unsigned N>
__global__ void nested(const float* fv, int* geo, float* fo) {
  auto block = cg::this_thread_block();
  auto parent = cg::tiled_partition<P>(block);
  auto tile = cg::tiled_partition<N>(parent);
  const unsigned r = block.thread_rank();
  geo[3 * r] = tile.thread_rank(); geo[3 * r + 1] = tile.meta_group_rank(); geo[3 * r + 2] = tile.meta_group_size();
  fo[r] = cg::reduce(tile, fv[r], cg::plus<float>());
}
"""
TILE_SIZES = (1, 2, 4, 8, 16, 32)
CG_NAMES = [f"tiles<{n}>" for n in TILE_SIZES] + ["nested<16, 4>", "nested<32, 8>"]

CG_SYNC_SRC = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

extern "C" __global__ void loop_sync(float* y) {
  auto block = cg::this_thread_block();
  for (int k = 0; k < 3; ++k) {
    y[block.thread_rank()] += 1.0f;
    block.sync();
  }
}

extern "C" __global__ void divergent_block_sync(float* y) {
  auto block = cg::this_thread_block();
  if (block.thread_rank() < 32) {
    block.sync();  // @cg_div_a
  } else {
    cg::sync(block);  // @cg_div_b
  }
  y[block.thread_rank()] = 1.0f;
}
"""

# ---------------------------------------------------------------- alignas after __shared__
ALIGNAS_SRC = r"""
template <class T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };
template <int A> struct Member { char c; alignas(A) char m; };

// 8 threads. off: shared-state offsets modulo each array's alignment, then alignofs.
extern "C" __global__ void aligned(const float* in, float* out, unsigned long long* off) {
  __shared__ char pad0;
  __shared__ alignas(16) float x[6];
  __shared__ char pad1;
  __shared__ alignas(float4) char buf[8 * sizeof(float4)];
  __shared__ alignas(128) alignas(16) int big[3];
  __shared__ alignas(64) Vec<float, 2> v[8];
  const int t = threadIdx.x;
  if (t == 0) { pad0 = 1; pad1 = 2; }
  reinterpret_cast<float4*>(buf)[t] = make_float4(in[4 * t], in[4 * t + 1], in[4 * t + 2], in[4 * t + 3]);
  v[t].v[0] = in[t];
  v[t].v[1] = in[t] + 1.0f;
  if (t < 6) x[t] = 2.0f * in[t];
  if (t < 3) big[t] = t;
  __syncthreads();
  const float4 r = reinterpret_cast<const float4*>(buf)[7 - t];
  out[4 * t] = r.x; out[4 * t + 1] = r.y; out[4 * t + 2] = r.z; out[4 * t + 3] = r.w;
  out[32 + t] = v[7 - t].v[1] + (t < 6 ? x[t] : 0.0f) + big[t % 3] + pad0 + pad1;
  if (t == 0) {
    off[0] = __cvta_generic_to_shared(x) % 16;
    off[1] = __cvta_generic_to_shared(buf) % 16;
    off[2] = __cvta_generic_to_shared(big) % 128;
    off[3] = __cvta_generic_to_shared(v) % 64;
    off[4] = alignof(Vec<float, 4>);
    off[5] = alignof(Vec<short, 2>);
    off[6] = alignof(Member<32>);
  }
}
"""

SOURCES = {
    "noinline": (NOINLINE_SRC, []),
    "minmax": (MINMAX_SRC, MINMAX_NAMES),
    "hmath": (HMATH_SRC, [n for n, _ in HMATH_TYPES.values()]),
    "cg": (CG_SRC, CG_NAMES),
    "cg_sync": (CG_SYNC_SRC, []),
    "alignas": (ALIGNAS_SRC, []),
}


def module(which):
    src, names = SOURCES[which]
    return sim.RawModule(code=src, options=OPTS, name_expressions=names)


@pytest.mark.parametrize("which", sorted(SOURCES))
def test_sources_compile_under_nvrtc(which):
    from cupaged._nvrtc import compile_cubin

    src, names = SOURCES[which]
    program = compile_cubin(src, arch="sm_80", options=OPTS, name_expressions=names)
    assert program.cubin and set(program.lowered_names) == set(names)


# ---------------------------------------------------------------- __noinline__
def test_noinline():
    x = np.array([0, 1, -7, 1 << 20, 12345], np.int32)
    out, f = sim.zeros(5, np.int32), sim.zeros(5, np.float32)
    module("noinline").get_function("noinline_k")((1,), (5,), (sim.asarray(x), out, f))
    np.testing.assert_array_equal(out, 2 * x + 3)
    np.testing.assert_array_equal(f, x.astype(np.float32) / 2)


# ---------------------------------------------------------------- min / max
def _values(ctype, rng, n):
    info = np.iinfo(ctype) if np.issubdtype(ctype, np.integer) else None
    if info is None:
        v = rng.standard_normal(n) * 1e3
        v[:4] = [0.0, -0.0, 1.5, -2.5]
        return v.astype(ctype)
    edges = [info.min, info.max, 0, 1, -1 if info.min < 0 else 2, info.min + 1, info.max - 1, 7]
    v = rng.integers(info.min, info.max, n, dtype=ctype, endpoint=True)
    small = rng.integers(-40 if info.min < 0 else 0, 40, n)
    v[len(edges):n // 2] = small[len(edges):n // 2].astype(ctype)  # many small ones, signs mixed
    v[:len(edges)] = np.array(edges, dtype=object).astype(ctype)
    return v


@pytest.mark.parametrize("a_t,b_t,r_t", MINMAX_PAIRS, ids=[f"{a},{b}" for a, b, _ in MINMAX_PAIRS])
def test_min_max_overloads(a_t, b_t, r_t):
    rng = np.random.default_rng(hash((a_t, b_t)) % 2**32)
    n = 200
    a, b = _values(CTYPE[a_t], rng, n), _values(CTYPE[b_t], rng, n)
    b[:8] = b[:8][::-1]  # extremes against extremes
    R = CTYPE[r_t]
    lo, hi = sim.zeros(n, R), sim.zeros(n, R)
    module("minmax").get_function(f"minmax<{a_t}, {b_t}>")((1,), (256,), (sim.asarray(a), sim.asarray(b), lo, hi, np.int32(n)))
    ra, rb = a.astype(R), b.astype(R)  # C++'s conversions: a negative int becomes a large unsigned
    if np.issubdtype(R, np.floating):
        np.testing.assert_array_equal(lo, np.fmin(ra, rb))
        np.testing.assert_array_equal(hi, np.fmax(ra, rb))
    else:
        np.testing.assert_array_equal(lo, np.minimum(ra, rb))
        np.testing.assert_array_equal(hi, np.maximum(ra, rb))
    if a_t == "int" and b_t == "unsigned":
        k = np.flatnonzero(a == -1)[0]
        assert lo[k] == min(np.uint32(0xFFFFFFFF), b[k]) and hi[k] == 0xFFFFFFFF  # max(-1, u) is UINT_MAX


def test_min_max_named():
    rng = np.random.default_rng(5)
    n = 64
    u, ll = _values(np.uint32, rng, n), _values(np.int64, rng, n)
    ou, oll, oull = sim.zeros(2 * n, np.uint32), sim.zeros(2 * n, np.int64), sim.zeros(2 * n, np.uint64)
    module("minmax").get_function("named_minmax")((1,), (n,), (sim.asarray(u), sim.asarray(ll), ou, oll, oull, np.int32(n)))
    np.testing.assert_array_equal(ou[0::2], np.minimum(u, u[::-1]))
    np.testing.assert_array_equal(ou[1::2], np.maximum(u, u[::-1]))
    np.testing.assert_array_equal(oll[0::2], np.minimum(ll, ll[::-1]))
    np.testing.assert_array_equal(oll[1::2], np.maximum(ll, ll[::-1]))
    ull = ll.astype(np.uint64)
    np.testing.assert_array_equal(oull[0::2], np.minimum(ull, ull[::-1]))
    np.testing.assert_array_equal(oull[1::2], np.maximum(ull, ull[::-1]))


# Both compilers resolve the same overload set the same way: these are ambiguous under NVRTC.
@pytest.mark.parametrize("a_t,b_t,ok", [("long long", "int", False), ("int", "long", False), ("unsigned", "long", False),
                                        ("float", "int", False), ("int", "unsigned", True), ("short", "unsigned", True)])
def test_min_max_same_overload_resolution_as_nvrtc(a_t, b_t, ok):
    from cupaged._nvrtc import NvrtcError, compile_cubin

    src = f'extern "C" __global__ void k({a_t} a, {b_t} b, double* o) {{ o[0] = min(a, b); o[1] = max(a, b); }}\n'
    try:
        compile_cubin(src, arch="sm_80", options=OPTS)
        nvrtc_ok = True
    except NvrtcError as e:
        assert "more than one instance" in str(e)
        nvrtc_ok = False
    try:
        sim.RawModule(code=src, options=OPTS).get_function("k")
        sim_ok = True
    except sim.SimCompileError as e:
        assert "ambiguous" in str(e)
        sim_ok = False
    assert nvrtc_ok == sim_ok == ok


# ---------------------------------------------------------------- half / bfloat16 math
def _ordered(h):
    """16-bit float bits -> integers in the order of the values (+0 and -0 both 0): ulp distance."""
    b = h.view(np.uint16).astype(np.int32)
    return np.where(b & 0x8000, -(b & 0x7FFF), b)


@pytest.mark.parametrize("kind", sorted(HMATH_TYPES))
def test_half_math(kind):
    name, dt = HMATH_TYPES[kind]
    rng = np.random.default_rng(11)
    n = 512
    xs = []
    for f, (lo, hi, _) in HMATH.items():
        x = rng.uniform(lo, hi, n)
        if f == "rcp":
            x *= rng.choice([-1.0, 1.0], n)
        if f in EXACT:
            x[:40] = np.arange(-20, 20) + 0.5  # ties: rint rounds them to even
        xs.append(x.astype(dt))
    x = np.stack(xs)
    y, y2lo, y2hi = (sim.zeros(x.shape, dt) for _ in range(3))
    module("hmath").get_function(name)((2,), (256,), (sim.asarray(x), y, y2lo, y2hi, np.int32(n)))
    for k, (f, (_, _, ref_fn)) in enumerate(HMATH.items()):
        ref = ref_fn(x[k].astype(np.float64)).astype(dt)  # correctly rounded (from float64)
        dist = np.abs(_ordered(y[k]) - _ordered(ref))
        if f in EXACT:
            np.testing.assert_array_equal(y[k].astype(np.float64), ref.astype(np.float64), err_msg=f"h{f}")
        else:
            # Computed in float and rounded once: at most 1 ulp from the correctly rounded value,
            # and almost always exactly it (a truncating conversion would miss half the time).
            assert dist.max() <= 1, f"h{f} ({kind}): {dist.max()} ulp at x={x[k][np.argmax(dist)]}"
            assert (dist == 0).mean() >= 0.98, f"h{f} ({kind}): only {(dist == 0).mean():.3f} exact"
        # The h2 form is the scalar one on each half, bit for bit.
        np.testing.assert_array_equal(y2lo[k].view(np.uint16), y[k].view(np.uint16), err_msg=f"h2{f} low")
        np.testing.assert_array_equal(y2hi[k].view(np.uint16), y[k][::-1].view(np.uint16), err_msg=f"h2{f} high")


# ---------------------------------------------------------------- cooperative groups
SIM_ORDERS = ("natural", "reverse", "random:7")
BLOCK, GRID = (8, 4, 3), (2, 2)  # 96 threads: three warps; a 3-D block for thread_index
NT = 96


def _butterfly(v, n, op):
    """NVIDIA's reduction (details/coalesced_reduce.h) over tiles of n, in v's dtype."""
    out = v.copy()
    lanes = np.arange(len(v))
    m = n >> 1
    while m:
        out = op(out, out[lanes ^ m])
        m >>= 1
    return out


@pytest.mark.parametrize("order", SIM_ORDERS)
@pytest.mark.parametrize("n", TILE_SIZES)
def test_tiles(n, order, monkeypatch):
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    rng = np.random.default_rng(n)
    total = GRID[0] * GRID[1] * NT
    fv = rng.standard_normal(total).astype(np.float32)
    iv = rng.integers(-1000, 1000, total).astype(np.int32)
    arg = np.stack([rng.integers(0, 2 * n, total), rng.integers(0, n + 1, total), rng.integers(0, n, total),
                    rng.random(total) < 0.8], axis=1).astype(np.int32)
    geo, fo, io, ballot = sim.zeros((total, 21), np.int32), sim.zeros((total, 12), np.float32), \
        sim.zeros((total, 5), np.int32), sim.zeros(total, np.uint32)
    module("cg").get_function(f"tiles<{n}>")(GRID, BLOCK, (sim.asarray(fv), sim.asarray(iv), sim.asarray(arg),
                                                         geo, fo, io, ballot))
    g = np.arange(total)
    r = g % NT                       # block rank
    b = g // NT                      # linear block index
    base = g - r % n                 # global index of the tile's rank 0
    t = r % n                        # tile rank
    x, y, z = r % 8, r // 8 % 4, r // 32
    expect_geo = np.stack([r, np.full(total, NT), np.full(total, NT), b % 2, b // 2, 0 * r, x, y, z,
                           *[np.full(total, d) for d in BLOCK * 2],
                           t, np.full(total, n), np.full(total, n), r // n, np.full(total, -(-NT // n)),
                           t + 100 * n], axis=1)
    np.testing.assert_array_equal(geo, expect_geo)

    src, d, m, p = arg.T
    up = np.where(t >= d, g - d, g)
    down = np.where(t + d < n, g + d, g)
    np.testing.assert_array_equal(fo[:, 0], fv[base + src % n], "shfl")
    np.testing.assert_array_equal(fo[:, 1], fv[up], "shfl_up")
    np.testing.assert_array_equal(fo[:, 2], fv[down], "shfl_down")
    np.testing.assert_array_equal(fo[:, 3], fv[base + (t ^ m)], "shfl_xor")
    np.testing.assert_array_equal(fo[:, 4], (fv.astype(np.float64) * 3)[base + (t ^ m)].astype(np.float32), "shfl_xor double")
    np.testing.assert_array_equal(fo[:, 5], fv[base + src % n], "shfl 16-byte struct")
    np.testing.assert_array_equal(fo[:, 6], (fv + np.float32(3))[base + src % n], "shfl 16-byte struct")
    np.testing.assert_array_equal(fo[:, 7], _butterfly(fv, n, np.add), "reduce plus<float>: NVIDIA's order")
    tiles = fv.reshape(-1, n)
    np.testing.assert_allclose(fo[:, 7], np.repeat(tiles.astype(np.float64).sum(1), n), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(fo[:, 8], np.repeat(tiles.max(1), n), "reduce greater")
    np.testing.assert_array_equal(fo[:, 9], np.repeat(tiles.min(1), n), "reduce less")
    np.testing.assert_array_equal(fo[:, 10], fv[base + (t + 1) % n], "tile.sync orders shared memory")
    np.testing.assert_array_equal(fo[:, 11], fv[b * NT + NT - 1 - r], "block.sync orders shared memory")

    ptiles = p.reshape(-1, n).astype(bool)
    np.testing.assert_array_equal(io[:, 0], np.repeat(ptiles.any(1), n), "any")
    np.testing.assert_array_equal(io[:, 1], np.repeat(ptiles.all(1), n), "all")
    itiles = iv.reshape(-1, n)
    np.testing.assert_array_equal(io[:, 2], np.repeat(itiles.sum(1), n), "reduce plus<int>")
    np.testing.assert_array_equal(io[:, 3], np.repeat(itiles.min(1), n), "reduce less<int>")
    np.testing.assert_array_equal(io[:, 4], np.repeat(itiles.max(1), n), "reduce greater<int>")
    bits = (ptiles.astype(np.uint64) << np.arange(n, dtype=np.uint64)).sum(1).astype(np.uint32)
    np.testing.assert_array_equal(ballot, np.repeat(bits, n), "ballot: bit i is tile rank i")
    assert p.any() and not p.all()


@pytest.mark.parametrize("parent,n", [(16, 4), (32, 8)])
def test_tile_of_a_tile(parent, n):
    fv = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    geo, fo = sim.zeros((64, 3), np.int32), sim.zeros(64, np.float32)
    module("cg").get_function(f"nested<{parent}, {n}>")((1,), (64,), (sim.asarray(fv), geo, fo))
    r = np.arange(64)
    np.testing.assert_array_equal(geo, np.stack([r % n, r % parent // n, np.full(64, parent // n)], axis=1))
    np.testing.assert_array_equal(fo, _butterfly(fv, n, np.add))


def test_block_sync_in_a_loop_is_one_site():
    y = sim.zeros(64, np.float32)
    module("cg_sync").get_function("loop_sync")((1,), (64,), (y,))
    np.testing.assert_array_equal(y, 3.0)


def test_divergent_block_sync_is_reported():
    lines = CG_SYNC_SRC.splitlines()
    a, b = (next(i for i, s in enumerate(lines, 1) if tag in s) for tag in ("@cg_div_a", "@cg_div_b"))
    with pytest.raises(sim.SimSyncError, match="divergent __syncthreads") as e:
        module("cg_sync").get_function("divergent_block_sync")((1,), (64,), (sim.zeros(64, np.float32),))
    assert f"line {a}" in str(e.value) and f"line {b}" in str(e.value), str(e.value)


# ---------------------------------------------------------------- alignas after __shared__
@pytest.mark.parametrize("order", SIM_ORDERS)
def test_alignas_after_shared(order, monkeypatch):
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    x = np.random.default_rng(2).standard_normal(32).astype(np.float32)
    out, off = sim.zeros(40, np.float32), sim.zeros(7, np.uint64)
    module("alignas").get_function("aligned")((1,), (8,), (sim.asarray(x), out, off))
    np.testing.assert_array_equal(off, [0, 0, 0, 0, 16, 4, 32])
    np.testing.assert_array_equal(out[:32], x.reshape(8, 4)[::-1].ravel())
    t = np.arange(8)
    expect = (x[7 - t] + 1) + np.where(t < 6, 2 * x[np.minimum(t, 5)], 0) + t % 3 + 3
    np.testing.assert_allclose(out[32:], expect.astype(np.float32), rtol=1e-6)


CCCL_SRC = r"""
#include <cuda/std/type_traits>
extern "C" __global__ void traits(float* out) {
  const long long t0 = clock64();
  const int c = clock();
  out[0] = cuda::std::is_same<int, int>::value && !cuda::std::is_same<int, float>::value ? 1.0f : 0.0f;
  out[1] = clock64() >= t0 && c != 0x7fffffff ? 1.0f : 0.0f;
}
"""


def test_cccl_headers_and_clock_compile():
    """<cuda/std/type_traits> pulls in <ctime>: the sim's own clock() used to clash with the C
    library's. (NVRTC compiles it too.)"""
    from cupaged._nvrtc import compile_cubin

    compile_cubin(CCCL_SRC, arch="sm_80", options=("-std=c++17",))
    out = sim.zeros(2)
    sim.RawModule(code=CCCL_SRC, options=("-std=c++17",)).get_function("traits")((1,), (1,), (out,))
    np.testing.assert_array_equal(out, [1.0, 1.0])
