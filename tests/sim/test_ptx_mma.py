"""Warp-collective tensor-core PTX (mma.sync, ldmatrix, stmatrix) against models of the PTX ISA.

The models are written from the PTX ISA's "Matrix Fragments for mma.m16n8k8 / mma.m16n8k16 / mma.m16n8k32"
tables and the ldmatrix / stmatrix descriptions, not from the engine's code. With
``groupID = %laneid >> 2`` and ``threadID_in_group = %laneid % 4`` (g, t below); elements are packed
into each 32-bit register low to high (two 16-bit or four 8-bit elements per register):

* A (16 x K), 16-bit types: ``row = g`` for a0,a1,a4,a5 and ``g + 8`` otherwise;
  ``col = 2t + (i & 1)`` for i < 4 and ``+ 8`` for i >= 4 (m16n8k8 has only a0..a3).
* A (16 x 32), .e4m3/.e5m2: ``row = g`` for 0 <= i < 4 or 8 <= i < 12, ``g + 8`` otherwise;
  ``col = 4t + (i & 3)`` for i < 8 and ``+ 16`` for i >= 8.
* B (K x 8): ``col = g``; ``row = 2t + (i & 1)`` (+ 8 for i >= 2) for 16-bit types,
  ``row = 4t + (i & 3)`` (+ 16 for i >= 4) for the 8-bit types.
* C / D (16 x 8): ``row = g`` for c0,c1 and ``g + 8`` for c2,c3; ``col = 2t + (i & 1)``; .f16 C/D
  are two .f16x2 registers {c0,c1}, {c2,c3}.
* ldmatrix/stmatrix .m8n8 .b16: lanes 8j..8j+7 give the row addresses of matrix j (only lanes 0-7
  count for .x1, 0-15 for .x2); register j of a lane holds row g, columns 2t and 2t+1 of matrix j;
  with .trans the matrix is read / written column-major: the lane holds M_j[2t][g], M_j[2t+1][g].

The sim's documented rounding for mma: the K exact products and c summed in float64 in k order,
starting from c, rounded once to the accumulator type. The sim is held to that bit for bit; a GPU
only to within a small tolerance relative to |c| + sum |a b|.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from cupaged import sim
from tests.conftest import Backend, cuda_arch_at_least, raw_module

# name: (PTX, K, input type of A, of B, accumulator ("f32" or "f16"))
MMA = {
    "f16_k16": ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", 16, "f16", "f16", "f32"),
    "bf16_k16": ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", 16, "bf16", "bf16", "f32"),
    "f16_k8": ("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32", 8, "f16", "f16", "f32"),
    "bf16_k8": ("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32", 8, "bf16", "bf16", "f32"),
    "f16_k16_f16acc": ("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16", 16, "f16", "f16", "f16"),
    "f16_k16_inout": ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", 16, "f16", "f16", "f32"),  # "+f" C/D
    "e4m3": ("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32", 32, "e4m3", "e4m3", "f32"),
    "e5m2": ("mma.sync.aligned.m16n8k32.row.col.f32.e5m2.e5m2.f32", 32, "e5m2", "e5m2", "f32"),
    "e4m3_e5m2": ("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e5m2.f32", 32, "e4m3", "e5m2", "f32"),
}
FP8 = ("e4m3", "e5m2", "e4m3_e5m2")
BITS = {"f16": 16, "bf16": 16, "e4m3": 8, "e5m2": 8}
SPECIAL = {"f16": 0x7C00, "bf16": 0x7F80, "e4m3": 0x7F, "e5m2": 0x7C}  # +inf, or NaN where there is no inf
SMEM_ROWS = 64  # shared tile: 64 rows of 8 b16 (16 bytes each)


def _mma_kernel(name, ptx, k, ebits, acc):
    """One warp: registers from A/B/C [32, n] (raw bits), the mma, D [32, n]. ``*_inout`` binds C and
    D to the same variables with "+f", as kernels that accumulate in place do."""
    na, nb, nc = 16 * k * ebits // 1024, 8 * k * ebits // 1024, 4 if acc == "f32" else 2
    cf, io = "f" if acc == "f32" else "r", name.endswith("_inout")
    regs = lambda n, first: ", ".join(f"%{first + i}" for i in range(n))  # noqa: E731
    ops = f"{{{regs(nc, 0)}}}, {{{regs(na, nc)}}}, {{{regs(nb, nc + na)}}}, {{{regs(nc, 0 if io else nc + na + nb)}}}"
    ctype, cin = ("float", "__uint_as_float(C[{}])") if acc == "f32" else ("unsigned", "C[{}]")
    outs = ", ".join(f'"{"+" if io else "="}{cf}"({"c" if io else "d"}{i})' for i in range(nc))
    ins = ", ".join([f'"r"(A[{i}])' for i in range(na)] + [f'"r"(B[{i}])' for i in range(nb)]
                    + ([] if io else [f'"{cf}"(c{i})' for i in range(nc)]))
    dout = "".join(f"D[{i}] = {'__float_as_uint' if acc == 'f32' else ''}({'c' if io else 'd'}{i}); "
                   for i in range(nc))
    return f"""
extern "C" __global__ void mma_{name}(const unsigned* A, const unsigned* B, const unsigned* C, unsigned* D,
                                      int nlive) {{
  const int lane = threadIdx.x;
  if (lane >= nlive) return;
  A += lane * {na}; B += lane * {nb}; C += lane * {nc}; D += lane * {nc};
  {ctype} {", ".join(f"c{i} = {cin.format(i)}" for i in range(nc))};
  {ctype} {", ".join(f"d{i}" for i in range(nc))};
  asm volatile("{ptx} {ops};\\n" : {outs} : {ins});
  {dout}
}}
"""


def _ldst_kernel(num, trans, order, store):
    """ldmatrix (R = registers out) or stmatrix (R = registers in, S = shared memory after) of ``num``
    matrices; ``order`` spells the qualifiers m8n8.x4 (0) or, as CuTe does, x4.m8n8 (1)."""
    op = (f"{'stmatrix' if store else 'ldmatrix'}.sync.aligned{f'.m8n8.x{num}' if order == 0 else f'.x{num}.m8n8'}"
          f"{'.trans' if trans else ''}.shared.b16")
    r = ", ".join(f"%{i + store}" for i in range(num))
    if store:
        asm = f'"{op} [%0], {{{r}}};\\n" :: "r"(addr), ' + ", ".join(f'"r"(R[{i}])' for i in range(num))
        tail = f"__syncthreads();\n  for (int i = threadIdx.x; i < {SMEM_ROWS * 8}; i += blockDim.x) S[i] = s[i];"
    else:
        asm = f'"{op} {{{r}}}, [%{num}];\\n" : ' + ", ".join(f'"=r"(R[{i}])' for i in range(num)) + ' : "r"(addr)'
        tail = ""
    return f"""
extern "C" __global__ void {'stm' if store else 'ldm'}_x{num}_{int(trans)}_{order}(
    const unsigned short* G, const int* offs, unsigned* R, unsigned short* S, int nlive) {{
  __shared__ __align__(16) unsigned short s[{SMEM_ROWS * 8}];
  for (int i = threadIdx.x; i < {SMEM_ROWS * 8}; i += blockDim.x) s[i] = G[i];
  __syncthreads();
  if ((int)threadIdx.x >= nlive) return;
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(s)) + 2u * offs[threadIdx.x];
  R += threadIdx.x * {num};
  asm volatile({asm});
  {tail}
}}
"""


LD = [(n, t, o) for n in (1, 2, 4) for t in (False, True) for o in (0, 1)]
SOURCES = {  # module: (source, the arch NVRTC needs for it)
    "mma": ("".join(_mma_kernel(n, *v[:2], BITS[v[2]], v[4]) for n, v in MMA.items() if n not in FP8), "sm_80"),
    "fp8": ("".join(_mma_kernel(n, *MMA[n][:2], 8, "f32") for n in FP8), "sm_89"),
    "ldm": ("".join(_ldst_kernel(*c, store=False) for c in LD), "sm_80"),
    "stm": ("".join(_ldst_kernel(*c, store=True) for c in LD), "sm_90"),
}


@functools.lru_cache(maxsize=None)
def _module(backend_name, which):
    return raw_module(Backend(backend_name), SOURCES[which][0])


def test_sources_compile_under_nvrtc():
    """The PTX itself is valid: every source compiles to a cubin for the arch it needs."""
    from cupaged._nvrtc import compile_cubin

    for which, (src, arch) in SOURCES.items():
        assert compile_cubin(src, arch=arch, options=("-std=c++17",)).cubin, which


# ---------------------------------------------------------------- fragment models (PTX ISA tables)
G, T = np.arange(32)[:, None] >> 2, np.arange(32)[:, None] & 3  # groupID, threadID_in_group of each lane


def a_coords(k, ebits):
    """(row, col) of element a_i of each lane, shape [32, n]."""
    i = np.arange(16 * k // 32)[None, :]
    if ebits == 16:
        return G + 8 * ((i // 2) % 2), 2 * T + (i & 1) + 8 * (i >= 4)
    return G + 8 * ((i // 4) % 2), 4 * T + (i & 3) + 16 * (i >= 8)


def b_coords(k, ebits):
    i = np.arange(8 * k // 32)[None, :]
    if ebits == 16:
        return 2 * T + (i & 1) + 8 * (i >= 2), G + 0 * i
    return 4 * T + (i & 3) + 16 * (i >= 4), G + 0 * i


def c_coords():
    i = np.arange(4)[None, :]
    return G + 8 * (i >= 2), 2 * T + (i & 1)


def pack(bits, coords, ebits):
    """Per-lane registers [32, nregs] holding the elements ``bits[row, col]`` low to high."""
    rows, cols = coords
    per = 32 // ebits
    e = bits[rows, cols].astype(np.uint64) << (ebits * (np.arange(rows.shape[1]) % per)).astype(np.uint64)
    return e.reshape(32, -1, per).sum(axis=2).astype(np.uint32)


def unpack(regs, coords, ebits, shape):
    rows, cols = coords
    per = 32 // ebits
    shift = (ebits * (np.arange(rows.shape[1]) % per)).astype(np.uint64)
    e = (np.repeat(regs.astype(np.uint64), per, axis=1) >> shift) & np.uint64(2**ebits - 1)
    out = np.full(shape, -1, np.int64)
    out[rows, cols] = e
    assert (out >= 0).all(), "the model must cover every element once"
    return out


def decode(bits, ty):
    """float64 values of raw element bits of type ``ty``."""
    b = bits.astype(np.int64)
    if ty == "f16":
        return b.astype(np.uint16).view(np.float16).astype(np.float64)
    if ty == "bf16":
        return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    mb = 3 if ty == "e4m3" else 2  # e4m3: bias 7, no inf; e5m2: bias 15, IEEE-like
    e, m, bias = (b >> mb) & (127 >> mb), b & ((1 << mb) - 1), 7 if ty == "e4m3" else 15
    v = np.where(e == 0, m * 2.0 ** (1 - bias - mb), (1 + m / 2**mb) * 2.0 ** (e - bias))
    if ty == "e5m2":  # exponent all ones: inf (m == 0) or NaN
        v = np.where(e == 31, np.where(m == 0, np.inf, np.nan), v)
    else:  # e4m3: S.1111.111 is NaN; S.1111.110 = 448 is the largest finite value
        v = np.where((e == 15) & (m == 7), np.nan, v)
    return np.where(b & 0x80, -v, v)


def random_bits(rng, ty, shape, small=False):
    """Exactly representable values, both signs; fp8: every finite code (incl. +-0, subnormals)."""
    if ty in ("e4m3", "e5m2"):
        codes = np.arange(256)
        bad = (codes & 0x7F) == 0x7F if ty == "e4m3" else (codes & 0x7C) == 0x7C  # NaN (and e5m2 inf)
        return rng.choice(codes[~bad], shape).astype(np.uint8)
    lo, hi = (-12, 3) if small else ((-26, 8) if ty == "f16" else (-20, 10))  # f16: down to subnormal/0
    v = rng.choice([-1.0, 1.0], shape) * 2.0 ** rng.uniform(lo, hi, shape) * (1 + rng.random(shape))
    if ty == "f16":
        return v.astype(np.float16).view(np.uint16)
    return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # bf16: keep the top half


def mma_reference(a, b, c):
    """float64 sum in k order starting from c (each product is exact in float64)."""
    s = c.astype(np.float64).copy()
    for kk in range(a.shape[1]):
        s += a[:, kk:kk + 1] * b[kk:kk + 1, :]
    return s


# ---------------------------------------------------------------- mma
def run_mma(backend, name, a_bits, b_bits, c):
    """D [16, 8] (float32, or float16 for the f16 accumulator) from one warp's mma_<name>."""
    _, k, ta, tb, acc = MMA[name]
    cbits = 32 if acc == "f32" else 16
    regs = [pack(a_bits, a_coords(k, BITS[ta]), BITS[ta]), pack(b_bits, b_coords(k, BITS[tb]), BITS[tb]),
            pack(c.view(f"u{cbits // 8}"), c_coords(), cbits)]
    regs = [backend.asarray(r) for r in regs] + [backend.asarray(np.zeros_like(regs[2]))]
    fn = _module(backend.name, "fp8" if name in FP8 else "mma").get_function(f"mma_{name}")
    fn((1,), (32,), (*regs, np.int32(32)))
    d = unpack(backend.to_numpy(regs[3]), c_coords(), cbits, (16, 8))
    return d.astype(f"u{cbits // 8}").view(c.dtype)


@pytest.mark.parametrize("name", list(MMA))
def test_mma(backend, name):
    _, k, ta, tb, acc = MMA[name]
    if name in FP8 and not cuda_arch_at_least(backend, 89):
        pytest.skip("needs sm_89")
    for seed in range(4):
        rng = np.random.default_rng([seed, list(MMA).index(name)])
        a_bits, b_bits = random_bits(rng, ta, (16, k), acc == "f16"), random_bits(rng, tb, (k, 8), acc == "f16")
        if seed == 0:  # +inf (e4m3: NaN) in A row 3, -inf (-NaN) in B column 2; NaN where inf meets 0 or -inf
            a_bits[3, 5], b_bits[7, 2] = SPECIAL[ta], SPECIAL[tb] | (0x80 << (BITS[tb] - 8))
        c = ((rng.standard_normal((16, 8)) * 2.0 ** rng.uniform(-4, 8, (16, 8))).astype(np.float32) if acc == "f32"
             else (rng.standard_normal((16, 8)) * 8).astype(np.float16))
        got = run_mma(backend, name, a_bits, b_bits, c)
        av, bv = decode(a_bits, ta), decode(b_bits, tb)
        with np.errstate(invalid="ignore"):
            ref = mma_reference(av, bv, c)
            want = ref.astype(c.dtype)
        if backend.name == "sim":  # bit for bit (any NaN matches any NaN)
            bad = np.argwhere((got.view(f"u{c.itemsize}") != want.view(f"u{c.itemsize}"))
                              & ~(np.isnan(got) & np.isnan(want)))
            assert not len(bad), (f"{name} seed {seed}: {len(bad)} of 128 differ; first D[{bad[0][0]},{bad[0][1]}] "
                                  f"got {got[tuple(bad[0])]!r} want {want[tuple(bad[0])]!r}")
        else:
            rtol = 1e-5 if acc == "f32" and name not in FP8 else 2e-3
            fin = np.isfinite(ref)
            np.testing.assert_array_equal(got[~fin], ref[~fin])  # the same infinities and NaNs
            bound = rtol * (np.abs(c) + np.abs(av) @ np.abs(bv))[fin] + 1e-30
            err = np.abs(got[fin].astype(np.float64) - ref[fin])
            assert (err <= bound).all(), f"{name} seed {seed}: worst {np.max(err / bound)} x the bound"


def test_mma_f16_accumulator_rounds_once():
    """c + p0 + p1 = 1 + 2^-11 + 2^-40: just above the f16 midpoint between 1 and 1 + 2^-10, so one
    rounding gives 1 + 2^-10; rounding to float32 first lands on the midpoint and then on 1."""
    a = np.zeros((16, 16), np.float16)
    b = np.zeros((16, 8), np.float16)
    a[:, 0], b[0, :], a[:, 1], b[1, :] = 2.0**-11, 1.0, 2.0**-20, 2.0**-20
    got = run_mma(Backend("sim"), "f16_k16_f16acc", a.view(np.uint16), b.view(np.uint16), np.ones((16, 8), np.float16))
    assert (got == np.float16(1 + 2.0**-10)).all(), got


# ---------------------------------------------------------------- ldmatrix / stmatrix
def frag_8x8(ms, trans):
    """Registers [32, num] of 8x8 b16 matrices ``ms`` [num, 8, 8], as ldmatrix delivers them and stmatrix
    takes them."""
    m = ms.transpose(0, 2, 1) if trans else ms
    lo, hi = m[:, G[:, 0], 2 * T[:, 0]], m[:, G[:, 0], 2 * T[:, 0] + 1]  # [num, 32]
    return (lo.astype(np.uint32) | hi.astype(np.uint32) << 16).T.copy()


def test_models_agree_with_each_other():
    """Independent tables, one known identity: ldmatrix.x4 of A's quadrants (rows 0-7 | 8-15 x cols
    0-7 | 8-15) gives the m16n8k16 A fragment, .x2.trans of B [16, 8] the B fragment and .x2 of an f16
    C the C fragment. Plus a few fp8 codes whose values the formats fix."""
    bits = np.random.default_rng(1).integers(0, 2**16, (16, 16), dtype=np.uint16)
    quads = np.stack([bits[r:r + 8, c:c + 8] for c in (0, 8) for r in (0, 8)])
    np.testing.assert_array_equal(frag_8x8(quads, False), pack(bits, a_coords(16, 16), 16))
    halves = bits[:, :8].reshape(2, 8, 8)
    np.testing.assert_array_equal(frag_8x8(halves, True), pack(bits[:, :8], b_coords(16, 16), 16))
    np.testing.assert_array_equal(frag_8x8(halves, False), pack(bits[:, :8], c_coords(), 16))
    a8 = np.arange(512).reshape(16, 32) % 251
    assert np.array_equal(unpack(pack(a8, a_coords(32, 8), 8), a_coords(32, 8), 8, (16, 32)), a8)
    e4 = decode(np.array([0x7E, 0xFE, 0x08, 0x01, 0x38, 0x80]), "e4m3")
    e5 = decode(np.array([0x7B, 0x04, 0x01, 0x3C, 0xBD, 0xFC]), "e5m2")
    assert e4.tolist() == [448.0, -448.0, 2.0**-6, 2.0**-9, 1.0, -0.0]
    assert e5.tolist() == [57344.0, 2.0**-14, 2.0**-16, 1.0, -1.25, -np.inf]


def _ldst(backend, op, num, trans, order, offs, regs, nthreads=32, nlive=32, seed=0):
    """ldm_/stm_ with random shared memory and per-lane row offsets ``offs`` (in b16 elements);
    returns (shared memory before, registers, shared memory after)."""
    fn = _module(backend.name, op).get_function(f"{op}_x{num}_{int(trans)}_{order}")
    smem = np.random.default_rng([seed, 99]).integers(0, 2**16, (SMEM_ROWS, 8), dtype=np.uint16)
    args = [smem.ravel(), offs.astype(np.int32), regs, np.zeros(SMEM_ROWS * 8, np.uint16)]
    args = [backend.asarray(a) for a in args]
    fn((1,), (nthreads,), (*args, np.int32(nlive)))
    return smem, backend.to_numpy(args[2]), backend.to_numpy(args[3]).reshape(SMEM_ROWS, 8)


@pytest.mark.parametrize("op", ["ldm", "stm"])
@pytest.mark.parametrize("num,trans,order", LD)
def test_ldmatrix_stmatrix(backend, op, num, trans, order):
    if op == "stm" and not cuda_arch_at_least(backend, 90):
        pytest.skip("needs sm_90")
    for seed in range(3):
        rng = np.random.default_rng([seed, num, trans, order])
        rows = rng.permutation(SMEM_ROWS)[:32]  # distinct scattered rows; lanes past .x1/.x2 get unused ones
        if op == "ldm":
            smem, regs, _ = _ldst(backend, op, num, trans, order, rows * 8, np.zeros((32, num), np.uint32), seed=seed)
            want = frag_8x8(smem[rows[:8 * num]].reshape(num, 8, 8), trans)
            np.testing.assert_array_equal(regs, want, err_msg=f"ldmatrix registers, seed {seed}")
        else:
            ms = rng.integers(0, 2**16, (num, 8, 8), dtype=np.uint16)
            smem, _, after = _ldst(backend, op, num, trans, order, rows * 8, frag_8x8(ms, trans), seed=seed)
            smem[rows[:8 * num]] = ms.reshape(-1, 8)  # row r of matrix j goes where lane 8j+r points
            np.testing.assert_array_equal(after, smem, err_msg=f"shared memory after stmatrix, seed {seed}")


# ---------------------------------------------------------------- faults (sim only)
SIM = Backend("sim")


@pytest.mark.parametrize("nthreads,nlive", [(32, 24), (16, 32)])  # lanes 24.. exited; lanes 16.. do not exist
def test_warp_collectives_need_the_whole_warp(nthreads, nlive):
    mma_args = [SIM.asarray(np.zeros((32, n), np.uint32)) for n in (4, 2, 4, 4)]
    with pytest.raises(sim.SimSyncError, match="mma.sync .*sync.aligned"):
        _module("sim", "mma").get_function("mma_f16_k16")((1,), (nthreads,), (*mma_args, np.int32(nlive)))
    with pytest.raises(sim.SimSyncError, match="ldmatrix .*sync.aligned"):
        _ldst(SIM, "ldm", 4, False, 0, np.arange(32) * 8, np.zeros((32, 4), np.uint32), nthreads, nlive)


@pytest.mark.parametrize("op", ["ldm", "stm"])
@pytest.mark.parametrize("lane,offset,what", [(5, 8 * 5 + 4, "misaligned"), (9, 150 * 1024, "outside")])
def test_bad_row_address(op, lane, offset, what):
    """Rows must be 16-byte aligned (8 bytes off here) and inside the block's shared memory (300 KiB
    past the tile is past any block's)."""
    offs = np.arange(32) * 8
    offs[lane] = offset
    with pytest.raises(sim.SimMemoryError, match=f"lane {lane} .*{what}"):
        _ldst(SIM, op, 4, op == "stm", 0, offs, np.zeros((32, 4), np.uint32))
