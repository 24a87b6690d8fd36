"""Warp collectives of the sim backend against models written from the CUDA Programming Guide.

The models below are written from the documented semantics of the warp intrinsics (CUDA C++
Programming Guide, "Warp Shuffle Functions", "Warp Vote Functions", "Warp Match Functions",
"Warp Reduce Functions"), not from the engine's code:

* ``__shfl_sync(m, v, srcLane, w)``: the warp is cut into subsections of ``w`` lanes; a lane gets
  ``v`` of lane ``srcLane mod w`` of its own subsection.
* ``__shfl_up_sync(m, v, d, w)``: lane ``i`` (index within its subsection) gets ``v`` of ``i - d``;
  the source does not wrap, so the lowest ``d`` lanes of each subsection keep their own value.
* ``__shfl_down_sync``: likewise ``i + d``; the highest ``d`` lanes keep their own value.
* ``__shfl_xor_sync(m, v, laneMask, w)``: lane gets ``v`` of ``lane ^ laneMask``; a subsection may
  read from earlier subsections but reading from a later one returns the caller's own value.
* votes, ``__match_any_sync``, ``__reduce_*_sync`` act on the lanes named in the mask (lanes that do
  not exist in a partial last warp do not take part).
"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import sim

WIDTHS = (1, 2, 4, 8, 16, 32)
IDX, UP, DOWN, XOR = range(4)
FULL = 0xFFFFFFFF

SRC = r"""
#include <cuda_fp16.h>

// One warp per block. Block b shuffles with mode[b] and width[b]; arg is per lane.
template <class T>
__global__ void shfl(const T* in, T* out, const int* mode, const int* width, const int* arg) {
  const int b = blockIdx.x, lane = threadIdx.x, i = b * 32 + lane;
  const T v = in[i];
  const int a = arg[i], w = width[b];
  T r;
  switch (mode[b]) {
    case 0: r = __shfl_sync(0xffffffffu, v, a, w); break;
    case 1: r = __shfl_up_sync(0xffffffffu, v, (unsigned)a, w); break;
    case 2: r = __shfl_down_sync(0xffffffffu, v, (unsigned)a, w); break;
    default: r = __shfl_xor_sync(0xffffffffu, v, a, w); break;
  }
  out[i] = r;
}

// The same without the width argument (it defaults to warpSize).
extern "C" __global__ void shfl_default(const float* in, float* out, const int* mode, const int* arg) {
  const int b = blockIdx.x, lane = threadIdx.x, i = b * 32 + lane;
  const float v = in[i];
  const int a = arg[i];
  float r;
  switch (mode[b]) {
    case 0: r = __shfl_sync(0xffffffffu, v, a); break;
    case 1: r = __shfl_up_sync(0xffffffffu, v, (unsigned)a); break;
    case 2: r = __shfl_down_sync(0xffffffffu, v, (unsigned)a); break;
    default: r = __shfl_xor_sync(0xffffffffu, v, a); break;
  }
  out[i] = r;
}

// Divergent halves of each warp shuffle among themselves with half-warp masks.
extern "C" __global__ void shfl_halves(const int* in, int* out) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32;
  const int v = in[t];
  if (lane < 16) {
    out[t] = __shfl_xor_sync(0x0000ffffu, v, 3) + 1000 * __shfl_sync(0x0000ffffu, v, 15);
  } else {
    out[t] = __shfl_down_sync(0xffff0000u, v, 2) + 1000 * __shfl_up_sync(0xffff0000u, v, 5, 16);
  }
}

// The CUDA Programming Guide's shuffle examples: broadcast, inclusive scan by 8, butterfly reduction.
extern "C" __global__ void guide_examples(const int* in, int* out) {
  const int laneId = threadIdx.x & 0x1f, b = blockIdx.x;
  int* o = out + 3 * 32 * b;
  int value = in[b * 32 + laneId];
  o[laneId] = __shfl_sync(0xffffffff, value, 0);
  int scan = value;
  for (int i = 1; i <= 4; i *= 2) {
    int n = __shfl_up_sync(0xffffffff, scan, i, 8);
    if ((laneId & 7) >= i) scan += n;
  }
  o[32 + laneId] = scan;
  for (int i = 16; i >= 1; i /= 2) value += __shfl_xor_sync(0xffffffff, value, i, 32);
  o[64 + laneId] = value;
}

// Block size not a multiple of 32: sources stay inside the lanes that exist.
extern "C" __global__ void shfl_partial_warp(const int* in, int* out) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int v = in[t];
  out[t] = __shfl_xor_sync(0xffffffffu, v, 5, 16) + 1000 * __shfl_down_sync(0xffffffffu, v, 3, 16);
}

// Votes, match and reduce. Each warp w of block b: lanes in masks[b*nw+w] run the collectives with
// that mask, the other lanes (complement, as passed in cmasks) run them with theirs.
__device__ void votes_body(unsigned m, int t, const int* pred, const int* ival, const unsigned* uval,
                           const long long* lval, const float* fval,
                           int* o_all, int* o_any, unsigned* o_ballot,
                           unsigned* o_match_i, unsigned* o_match_l, unsigned* o_match_f,
                           unsigned* o_match_all, int* o_match_all_pred,
                           long long* o_radd, long long* o_rmin, long long* o_rmax,
                           unsigned* o_uadd, unsigned* o_umin, unsigned* o_umax,
                           unsigned* o_and, unsigned* o_or, unsigned* o_xor) {
  o_all[t] = __all_sync(m, pred[t]);
  o_any[t] = __any_sync(m, pred[t]);
  o_ballot[t] = __ballot_sync(m, pred[t]);
  o_match_i[t] = __match_any_sync(m, ival[t] & 3);
  o_match_l[t] = __match_any_sync(m, lval[t]);
  o_match_f[t] = __match_any_sync(m, fval[t]);
  int p = -7;
  o_match_all[t] = __match_all_sync(m, pred[t], &p);
  o_match_all_pred[t] = p;
  // The int overloads return int: a negative sum or minimum must stay negative when widened.
  long long s = __reduce_add_sync(m, ival[t]);
  long long mn = __reduce_min_sync(m, ival[t]);
  long long mx = __reduce_max_sync(m, ival[t]);
  o_radd[t] = s;
  o_rmin[t] = mn;
  o_rmax[t] = mx;
  o_uadd[t] = __reduce_add_sync(m, uval[t]);
  o_umin[t] = __reduce_min_sync(m, uval[t]);
  o_umax[t] = __reduce_max_sync(m, uval[t]);
  o_and[t] = __reduce_and_sync(m, uval[t]);
  o_or[t] = __reduce_or_sync(m, uval[t]);
  o_xor[t] = __reduce_xor_sync(m, uval[t]);
}

extern "C" __global__ void votes(const unsigned* masks, const unsigned* cmasks, const int* pred,
                                 const int* ival, const unsigned* uval, const long long* lval,
                                 const float* fval,
                                 int* o_all, int* o_any, unsigned* o_ballot,
                                 unsigned* o_match_i, unsigned* o_match_l, unsigned* o_match_f,
                                 unsigned* o_match_all, int* o_match_all_pred,
                                 long long* o_radd, long long* o_rmin, long long* o_rmax,
                                 unsigned* o_uadd, unsigned* o_umin, unsigned* o_umax,
                                 unsigned* o_and, unsigned* o_or, unsigned* o_xor) {
  const int nw = (blockDim.x + 31) / 32, w = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned m = masks[blockIdx.x * nw + w];
  if (m >> lane & 1u) {
    votes_body(m, t, pred, ival, uval, lval, fval, o_all, o_any, o_ballot, o_match_i, o_match_l, o_match_f,
               o_match_all, o_match_all_pred, o_radd, o_rmin, o_rmax, o_uadd, o_umin, o_umax, o_and, o_or, o_xor);
  } else {
    votes_body(cmasks[blockIdx.x * nw + w], t, pred, ival, uval, lval, fval, o_all, o_any, o_ballot, o_match_i,
               o_match_l, o_match_f, o_match_all, o_match_all_pred, o_radd, o_rmin, o_rmax, o_uadd, o_umin,
               o_umax, o_and, o_or, o_xor);
  }
}

// __syncwarp orders shared-memory traffic between the lanes of a warp (full and half masks).
extern "C" __global__ void syncwarp(const float* in, float* out) {
  __shared__ float s[128];
  const int t = threadIdx.x, lane = t % 32, base = t - lane;
  s[t] = in[blockIdx.x * blockDim.x + t];
  __syncwarp();
  float a = s[base + (lane + 1) % 32];
  __syncwarp();
  s[t] = a * 2.0f;
  if (lane < 16) {
    __syncwarp(0x0000ffffu);
    a += s[base + (lane + 3) % 16];
  } else {
    __syncwarp(0xffff0000u);
    a -= s[base + 16 + (lane + 5) % 16];
  }
  out[blockIdx.x * blockDim.x + t] = a;
}

// __syncthreads_count / _and / _or over the block.
extern "C" __global__ void bar_votes(const int* pred, int* o_count, int* o_and, int* o_or) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int p = pred[t];
  o_count[t] = __syncthreads_count(p);
  o_and[t] = __syncthreads_and(p);
  o_or[t] = __syncthreads_or(p);
}
"""

TYPES = {"float": np.float32, "double": np.float64, "int": np.int32, "long long": np.int64, "__half": np.float16}


@pytest.fixture(scope="module")
def mod():
    return sim.RawModule(code=SRC, options=("-std=c++17",),
                         name_expressions=tuple(f"shfl<{t}>" for t in TYPES))


# ---------------------------------------------------------------- documented shuffle semantics
def shfl_model(mode: int, width: int, vals: np.ndarray, args) -> np.ndarray:
    """One warp's results from the CUDA Programming Guide's description of the four shuffles."""
    out = vals.copy()
    for lane in range(32):
        base, i, a = lane // width * width, lane % width, int(args[lane])
        if mode == IDX:
            src = base + a % width  # "srcLane modulo width", within the same subsection
        elif mode == UP:
            src = base + i - a if i - a >= 0 else lane  # does not wrap: the lowest a lanes keep theirs
        elif mode == DOWN:
            src = base + i + a if i + a < width else lane  # the highest a lanes keep theirs
        else:
            j = lane ^ a  # earlier subsections may be read, later ones give the caller's own value
            src = j if j // width <= lane // width else lane
        out[lane] = vals[src]
    return out


def shfl_cases(rng):
    """(mode, width, per-lane args) for every mode and width and a spread of offsets."""
    cases = []
    for w in WIDTHS:
        for _ in range(3):
            cases.append((IDX, w, rng.integers(-40, 70, 32)))  # incl. negative and >= width source lanes
        cases.append((IDX, w, np.full(32, -1)))
        cases.append((IDX, w, np.full(32, 33)))
        for d in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31):  # incl. deltas >= width: every lane keeps its own
            cases.append((UP, w, np.full(32, d)))
            cases.append((DOWN, w, np.full(32, d)))
        for lm in (0, 1, 2, 3, 4, 5, 8, 12, 16, 31):  # incl. masks reaching later subsections
            cases.append((XOR, w, np.full(32, lm)))
    return cases


def guide_examples_model(vals):
    """The Programming Guide's three shuffle examples, run on the model: broadcast of lane 0, the
    inclusive scan in subsections of 8 lanes (__shfl_up_sync, width 8), the butterfly sum
    (__shfl_xor_sync, width 32)."""
    bcast = shfl_model(IDX, 32, vals, [0] * 32)
    scan = vals.copy()
    for i in (1, 2, 4):
        n = shfl_model(UP, 8, scan, [i] * 32)
        scan = np.where(np.arange(32) % 8 >= i, scan + n, scan)
    red = vals.copy()
    for i in (16, 8, 4, 2, 1):
        red = red + shfl_model(XOR, 32, red, [i] * 32)
    return bcast, scan, red


def test_shfl_model_reproduces_the_guide_examples():
    """The model gives what the Guide says its examples compute."""
    v = np.arange(32) * 3 + 1
    bcast, scan, red = guide_examples_model(v)
    assert (bcast == v[0]).all()
    np.testing.assert_array_equal(scan, np.cumsum(v.reshape(4, 8), axis=1).ravel())
    assert (red == v.sum()).all()


def test_guide_examples_on_the_sim(mod):
    v = np.random.default_rng(9).integers(-100, 100, 64).astype(np.int32)
    out = sim.zeros(3 * 64, np.int32)
    mod.get_function("guide_examples")((2,), (32,), (v, out))
    for b in range(2):
        want = guide_examples_model(v[b * 32:(b + 1) * 32])
        for k in range(3):
            np.testing.assert_array_equal(out[(3 * b + k) * 32:(3 * b + k + 1) * 32], want[k])


def _values(dtype, rng, n):
    if dtype == np.float16:
        return rng.standard_normal(n).astype(np.float16)
    if np.issubdtype(dtype, np.floating):
        return (rng.standard_normal(n) * 1e3).astype(dtype)
    if dtype == np.int64:
        # differ in the upper 32 bits too, so a 4-byte shuffle would be caught
        return rng.integers(-(2**62), 2**62, n, dtype=np.int64)
    return rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(dtype)


@pytest.mark.parametrize("ctype", list(TYPES))
def test_shfl_every_mode_width_offset(mod, ctype):
    dtype = TYPES[ctype]
    rng = np.random.default_rng(1234)
    cases = shfl_cases(rng)
    nb = len(cases)
    vals = _values(dtype, rng, nb * 32)
    mode = np.array([c[0] for c in cases], np.int32)
    width = np.array([c[1] for c in cases], np.int32)
    arg = np.concatenate([c[2] for c in cases]).astype(np.int32)
    out = sim.zeros(nb * 32, dtype)
    mod.get_function(f"shfl<{ctype}>")((nb,), (32,), (sim.asarray(vals), out, mode, width, arg))
    want = np.concatenate([shfl_model(m, w, vals[b * 32:(b + 1) * 32], a)
                           for b, (m, w, a) in enumerate(cases)])
    for b, (m, w, a) in enumerate(cases):  # bitwise, and name the first failing case
        got_b, want_b = out[b * 32:(b + 1) * 32], want[b * 32:(b + 1) * 32]
        assert got_b.tobytes() == want_b.tobytes(), (
            f"{['idx', 'up', 'down', 'xor'][m]} width={w} args={list(a)}:\n got {got_b}\nwant {want_b}")


def test_shfl_default_width_is_warp_size(mod):
    rng = np.random.default_rng(7)
    cases = [c for c in shfl_cases(rng) if c[1] == 32]
    nb = len(cases)
    vals = rng.standard_normal(nb * 32).astype(np.float32)
    mode = np.array([c[0] for c in cases], np.int32)
    arg = np.concatenate([c[2] for c in cases]).astype(np.int32)
    out = sim.zeros(nb * 32, np.float32)
    mod.get_function("shfl_default")((nb,), (32,), (vals, out, mode, arg))
    want = np.concatenate([shfl_model(m, 32, vals[b * 32:(b + 1) * 32], a) for b, (m, _, a) in enumerate(cases)])
    np.testing.assert_array_equal(out, want)


def test_shfl_half_warp_masks_in_divergent_branches(mod):
    nb, nt = 3, 64
    vals = np.random.default_rng(3).integers(-500, 500, nb * nt).astype(np.int32)
    out = sim.zeros(nb * nt, np.int32)
    mod.get_function("shfl_halves")((nb,), (nt,), (vals, out))
    want = np.empty_like(vals)
    for w in range(nb * nt // 32):
        v = vals[w * 32:(w + 1) * 32]
        lo = v[:16]  # each half is a group of its own: lanes 0..15 and 16..31
        want[w * 32:w * 32 + 16] = [lo[lane ^ 3] + 1000 * lo[15] for lane in range(16)]
        down = shfl_model(DOWN, 32, v, [2] * 32)[16:]  # lanes 30, 31 keep their own value
        up = shfl_model(UP, 16, v, [5] * 32)[16:]  # width 16: lanes 16..20 keep their own value
        want[w * 32 + 16:w * 32 + 32] = down + 1000 * up
    np.testing.assert_array_equal(out, want)


def test_shfl_partial_last_warp(mod):
    nb, nt = 2, 48  # warp 1 has 16 lanes
    vals = np.random.default_rng(4).integers(-500, 500, nb * nt).astype(np.int32)
    out = sim.zeros(nb * nt, np.int32)
    mod.get_function("shfl_partial_warp")((nb,), (nt,), (vals, out))
    want = np.empty_like(vals)
    for b in range(nb):
        for w0, n in ((0, 32), (32, 16)):
            v = np.zeros(32, np.int32)
            v[:n] = vals[b * nt + w0:b * nt + w0 + n]
            r = shfl_model(XOR, 16, v, [5] * 32) + 1000 * shfl_model(DOWN, 16, v, [3] * 32)
            want[b * nt + w0:b * nt + w0 + n] = r[:n]
    np.testing.assert_array_equal(out, want)


# ---------------------------------------------------------------- votes, match, reduce
MASKS = (FULL, 0x0000FFFF, 0xFFFF0000, 0x55555555, 0x00000100, 0x8000_0001, 0x0F0F_F0F0, 0x7FFFFFFF)


@pytest.mark.parametrize("nt", [96, 80])  # 80: the last warp has 16 lanes
def test_votes_match_reduce_partial_masks(mod, nt):
    rng = np.random.default_rng(nt)
    nw = (nt + 31) // 32
    nb = 2 * len(MASKS)
    n = nb * nt
    masks = np.array([MASKS[(b + w) % len(MASKS)] if (b // len(MASKS)) == 0 else int(rng.integers(1, 2**32))
                      for b in range(nb) for w in range(nw)], np.uint32)
    live = np.array([(1 << min(32, nt - w * 32)) - 1 for w in range(nw)] * nb, np.uint64).astype(np.uint32)
    cmasks = (~masks & live).astype(np.uint32)
    pred = (rng.random(n) < 0.6).astype(np.int32)
    pred[:nt] = 1  # a block where every predicate is true
    pred[nt:2 * nt] = 0  # and one where every one is false
    pred[2 * nt:3 * nt] = rng.integers(-3, 4, nt)  # any non-zero value counts as true
    ival = rng.integers(-1000, 1000, n).astype(np.int32)
    uval = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    lval = (rng.integers(0, 2, n) << 40).astype(np.int64) + rng.integers(0, 2, n)  # differ in high words
    fval = rng.choice(np.array([0.5, -0.0, 0.0, 3.25], np.float32), n)
    outs = {name: sim.zeros(n, dt) for name, dt in (
        ("all", np.int32), ("any", np.int32), ("ballot", np.uint32), ("match_i", np.uint32),
        ("match_l", np.uint32), ("match_f", np.uint32), ("match_all", np.uint32), ("match_all_pred", np.int32),
        ("radd", np.int64), ("rmin", np.int64), ("rmax", np.int64), ("uadd", np.uint32), ("umin", np.uint32),
        ("umax", np.uint32), ("and", np.uint32), ("or", np.uint32), ("xor", np.uint32))}
    mod.get_function("votes")((nb,), (nt,), (masks, cmasks, pred, ival, uval, lval, fval, *outs.values()))

    for b in range(nb):
        for w in range(nw):
            nl = min(32, nt - w * 32)
            for m in (int(masks[b * nw + w]), int(cmasks[b * nw + w])):
                lanes = [ln for ln in range(nl) if m >> ln & 1]
                if not lanes:
                    continue
                idx = [b * nt + w * 32 + ln for ln in lanes]
                p = pred[idx] != 0
                ballot = sum(1 << ln for ln, q in zip(lanes, p) if q)
                part = sum(1 << ln for ln in lanes)

                def match(vals):
                    return [sum(1 << lanes[k] for k in range(len(lanes)) if vals[k] == vals[j])
                            for j in range(len(lanes))]

                f = fval[idx]
                want = {
                    "all": [int(p.all())] * len(idx), "any": [int(p.any())] * len(idx), "ballot": [ballot] * len(idx),
                    "match_i": match(ival[idx] & 3), "match_l": match(lval[idx]),
                    # floats are matched by bit pattern: -0.0 and 0.0 differ
                    "match_f": match(f.view(np.uint32)),
                    # __match_all_sync compares the raw values (here pred itself, not its truth)
                    "match_all": [part if len(set(pred[idx])) == 1 else 0] * len(idx),
                    "match_all_pred": [int(len(set(pred[idx])) == 1)] * len(idx),
                    "radd": [int(ival[idx].sum())] * len(idx), "rmin": [int(ival[idx].min())] * len(idx),
                    "rmax": [int(ival[idx].max())] * len(idx),
                    "uadd": [int(uval[idx].astype(np.uint64).sum()) % 2**32] * len(idx),
                    "umin": [int(uval[idx].min())] * len(idx), "umax": [int(uval[idx].max())] * len(idx),
                    "and": [int(np.bitwise_and.reduce(uval[idx]))] * len(idx),
                    "or": [int(np.bitwise_or.reduce(uval[idx]))] * len(idx),
                    "xor": [int(np.bitwise_xor.reduce(uval[idx]))] * len(idx),
                }
                for name, wv in want.items():
                    got = [int(x) for x in outs[name][idx]]
                    assert got == wv, f"{name} block {b} warp {w} mask {m:#010x}: got {got}, want {wv}"


def test_syncwarp_orders_shared_memory(mod, monkeypatch):
    nb, nt = 2, 96
    vals = np.random.default_rng(5).standard_normal(nb * nt).astype(np.float32)
    want = np.empty_like(vals)
    for b in range(nb):
        for w in range(nt // 32):
            v = vals[b * nt + w * 32:b * nt + w * 32 + 32]
            a = v[(np.arange(32) + 1) % 32]
            s = a * 2.0
            r = a.copy()
            for lane in range(32):
                r[lane] = a[lane] + s[(lane + 3) % 16] if lane < 16 else a[lane] - s[16 + (lane + 5) % 16]
            want[b * nt + w * 32:b * nt + w * 32 + 32] = r
    for order in ("natural", "reverse", "random:11"):
        monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
        out = sim.zeros(nb * nt, np.float32)
        mod.get_function("syncwarp")((nb,), (nt,), (vals, out))
        np.testing.assert_array_equal(out, want, err_msg=order)


@pytest.mark.parametrize("nt", [96, 100])
def test_syncthreads_count_and_or(mod, nt):
    rng = np.random.default_rng(nt)
    nb = 5
    pred = (rng.random(nb * nt) < 0.5).astype(np.int32) * rng.integers(1, 9, nb * nt).astype(np.int32)
    pred[:nt] = 1
    pred[nt:2 * nt] = 0
    pred[2 * nt:3 * nt] = 0
    pred[3 * nt - 1] = -4  # a single true predicate, and not 1
    outs = [sim.zeros(nb * nt, np.int32) for _ in range(3)]
    mod.get_function("bar_votes")((nb,), (nt,), (pred, *outs))
    p = (pred != 0).reshape(nb, nt)
    np.testing.assert_array_equal(outs[0].reshape(nb, nt), np.repeat(p.sum(1, keepdims=True), nt, 1))
    np.testing.assert_array_equal(outs[1].reshape(nb, nt), np.repeat(p.all(1, keepdims=True), nt, 1))
    np.testing.assert_array_equal(outs[2].reshape(nb, nt), np.repeat(p.any(1, keepdims=True), nt, 1))
