"""Inline PTX (``asm``) on the sim against numpy models written from the PTX ISA, bit-exact where it is.

Models (PTX ISA, "Logic and Shift", "Data Movement and Conversion", "Floating Point" instructions):
``lop3.b32 d, a, b, c, immLut``: immLut = F(0xF0, 0xCC, 0xAA), so bit k of immLut selects the minterm
(a, b, c) = (k>>2 & 1, k>>1 & 1, k & 1). ``prmt.b32``: bytes {b, a} = {b7..b4, b3..b0}; generic form:
nibble i of c picks byte i of d by its 3 lsbs, its msb replicates that byte's sign; the modes index
the ISA's table (``PRMT_MODES``, dest bytes 3..0) by c[1:0]. ``cvt.rn.{f16,bf16}x2.f32 d, a, b``:
d[31:16] = cvt(a), d[15:0] = cvt(b), nearest-even, overflow to inf. ``cvt.rn.f16x2.{e4m3,e5m2}x2 d, a``:
a[15:8] to d[31:16] (exact). ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32 d, a, b``: a to d[15:8]; NaN stays
NaN, |x| > MAX_NORM (inf too) gives the sign-preserved MAX_NORM. NaN compares by NaN-ness. ``ex2``/
``rcp.approx``: within 2/1 ulp of the correctly rounded result; ``lg2``: 2^-22 absolute in (0.5, 2),
relative outside; ``tanh``: 2^-11 relative; ``.ftz`` flushes subnormal inputs and results to
sign-preserving zero. ``cp.async``: with src-size only src-size bytes are read and the rest of cp-size
is zero-filled; ``wait_group N`` completes all but the N most recent groups; ``wait_all`` = commit +
``wait_group 0``; ``__pipeline_memcpy_async(d, s, n, zfill)`` zeroes the last zfill of n bytes
(cuda_pipeline_primitives.h). Sim-only contract: a cp.async destination reads 0xFF bytes from issue
until a wait covers its group; misaligned or out-of-bounds copies raise SimMemoryError; an instruction
the sim does not emulate is a SimCompileError naming it and the source line of its asm statement.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from cupaged import sim
from cupaged.sim._memory import poison_byte
from tests.conftest import cuda_arch_at_least, raw_module

U32 = np.uint32


def poison() -> np.uint32:
    """What an unlanded cp.async destination reads as: CUPAGED_SIM_POISON's byte in every byte."""
    return U32(poison_byte() * 0x01010101)
PRMT_MODES = {"f4e": (0x3210, 0x4321, 0x5432, 0x6543), "b4e": (0x5670, 0x6701, 0x7012, 0x0123),
              "rc8": (0x0000, 0x1111, 0x2222, 0x3333), "ecl": (0x3210, 0x3211, 0x3222, 0x3333),
              "ecr": (0x0000, 0x1110, 0x2210, 0x3210), "rc16": (0x1010, 0x3232, 0x1010, 0x3232)}
ARGS3 = "const unsigned* a, const unsigned* b, const unsigned* c, unsigned* out"

OPS = r"""
#define LOP(d, x, y, z, imm) asm volatile("lop3.b32 %0, %1, %2, %3, " #imm ";" : "=r"(d) : "r"(x), "r"(y), "r"(z))
extern "C" __global__ void operands(ARGS3) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned x = a[i], y = b[i], z = c[i];
  unsigned lane, acc = x, d0, d1, d2, d3;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  asm("lop3.b32 %0, %0, %1, %2, 0x96;" : "+r"(acc) : "r"(y), "r"(z));
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d0) : "r"(x), "r"(y), "r"(z), "n"(0xE8));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d1) : "r"(x), "r"(y), "r"(z));
  LOP(d2, x, y, z, 0x1A);
  asm volatile("{\n\t"
               ".reg .b32 t;\n\t"
               "lop3.b32 t, %1, %2, %3, 0x80;\n\t"
               "prmt.b32 %0, t, %1, 0x7531;\n\t"
               "}\n" : "=r"(d3) : "r"(x), "r"(y), "r"(z));
  unsigned* o = out + 6 * i;
  o[0] = lane; o[1] = acc; o[2] = d0; o[3] = d1; o[4] = d2; o[5] = d3;
}
""".replace("ARGS3", ARGS3)
LOP3 = r"""
template <int L> __device__ unsigned lop(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(L));
  return d;
}
template <int L, int N> __device__ void lops(unsigned a, unsigned b, unsigned c, unsigned* o) {  // [L, L + N)
  if constexpr (N == 1) o[L] = lop<L>(a, b, c);
  else { lops<L, N / 2>(a, b, c, o); lops<L + N / 2, N / 2>(a, b, c, o); }
}
extern "C" __global__ void lop3_all(ARGS3) { const int i = threadIdx.x; lops<0, 256>(a[i], b[i], c[i], out + 256 * i); }
""".replace("ARGS3", ARGS3)
PRMT = r"""
#define P(k, m) asm("prmt.b32" m " %0, %1, %2, %3;" : "=r"(d) : "r"(a[i]), "r"(b[i]), "r"(c[i])); out[6 * i + k] = d
extern "C" __global__ void prmt_modes(ARGS3) {
  const int i = threadIdx.x;
  unsigned d;
  P(0, ".f4e"); P(1, ".b4e"); P(2, ".rc8"); P(3, ".ecl"); P(4, ".ecr"); P(5, ".rc16");
}
""".replace("ARGS3", ARGS3)
CVT = r"""
extern "C" __global__ void cvt_pack(const float* a, const float* b, unsigned* h, unsigned* bf, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(a[i]), "f"(b[i])); h[i] = d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(a[i]), "f"(b[i])); bf[i] = d;
}
extern "C" __global__ void approx(const float* x, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v)); out[i] = r;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v)); out[n + i] = r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v)); out[2 * n + i] = r;
  asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(v)); out[3 * n + i] = r;
}
"""
FP8 = r"""
extern "C" __global__ void fp8_to_f16x2(const unsigned short* codes, unsigned* e4, unsigned* e5, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const unsigned short c = codes[i];
    unsigned d;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(c)); e4[i] = d;
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(d) : "h"(c)); e5[i] = d;
  }
}
extern "C" __global__ void f32_to_fp8x2(const float* a, const float* b, unsigned short* e4, unsigned short* e5, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(a[i]), "f"(b[i])); e4[i] = d;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(d) : "f"(a[i]), "f"(b[i])); e5[i] = d;
}
"""
MEM = r"""
#define V4(c, v, o) c(v[o]), c(v[o + 1]), c(v[o + 2]), c(v[o + 3])
extern "C" __global__ void mem(const unsigned* g, const float* gf, unsigned* out, float* fout) {
  __shared__ __align__(16) unsigned sm[64 * 8];
  const int i = threadIdx.x, n = blockDim.x, j = (i + 5) % n;
  unsigned x[4], y[4], z[8], *o = out + 24 * i;
  float f[4];
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "l"(g + 4 * i));
  asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];" : V4("=f", f, 0) : "l"(gf + 4 * i));
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : V4("=r", y, 0) : "l"(g + 4 * ((i + 1) % n)));
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(&sm[8 * i]));
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
               :: "r"(s), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]) : "memory");
  asm volatile("st.shared.v4.u32 [%0+16], {%1, %2, %3, %4};" :: "r"(s), V4("r", y, 0) : "memory");
  __syncthreads();
  const unsigned t = static_cast<unsigned>(__cvta_generic_to_shared(&sm[8 * j]));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : V4("=r", z, 0) : "r"(t) : "memory");
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4+16];" : V4("=r", z, 4) : "r"(t) : "memory");
  for (int k = 0; k < 8; ++k) { o[8 + k] = z[k]; o[16 + k] = sm[8 * j + k]; }
  for (int k = 0; k < 4; ++k) { o[k] = x[k]; o[4 + k] = y[k]; fout[4 * i + k] = f[k]; }
}
// 32 threads, shared_mem = 512: round trips, and st.shared through the shared address of dyn
extern "C" __global__ void cvta(unsigned* out) {
  __shared__ float st[32];
  extern __shared__ __align__(16) float dyn[];
  const int i = threadIdx.x, j = (i + 1) % 32;
  const size_t a = __cvta_generic_to_shared(&st[i]), b = __cvta_generic_to_shared(&dyn[4 * i]);
  unsigned* o = out + 8 * i;
  o[0] = __cvta_shared_to_generic(a) == static_cast<void*>(&st[i]);
  o[1] = __cvta_shared_to_generic(b) == static_cast<void*>(&dyn[4 * i]);
  o[2] = unsigned(a - __cvta_generic_to_shared(&st[0]));
  o[3] = unsigned(b - __cvta_generic_to_shared(&dyn[0]));
  o[4] = (a >> 32) == 0 && (b >> 32) == 0 && a != b;
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
               :: "r"(static_cast<unsigned>(b)), "r"(i), "r"(i + 100u), "r"(i + 200u), "r"(i + 300u) : "memory");
  __syncthreads();
  o[5] = __float_as_uint(dyn[4 * j]); o[6] = __float_as_uint(dyn[4 * j + 1]); o[7] = __float_as_uint(dyn[4 * j + 3]);
}
"""
CPASYNC = r"""
#include <cuda_pipeline_primitives.h>
#define CP(kind, n, dst, src) \
  asm volatile("cp.async." kind ".shared.global [%0], [%1], " #n ";" :: "r"(smem(dst)), "l"(src) : "memory")
#define COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define WAIT(n) asm volatile("cp.async.wait_group %0;\n" :: "n"(n) : "memory")
#define WAIT_ALL() asm volatile("cp.async.wait_all;" ::: "memory")
#define COPY(o, s, n) for (int k = 0; k < n; ++k) (o)[k] = (s)[k]
__device__ __forceinline__ unsigned smem(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
// 32 threads; out[phase][group][128]: before any wait, after wait_group 1, after wait_all
extern "C" __global__ void groups(const unsigned* src, unsigned* out) {
  __shared__ __align__(16) unsigned sm[3][128];
  const int i = threadIdx.x;
  for (int g = 0; g < 3; ++g) for (int k = 0; k < 4; ++k) sm[g][4 * i + k] = 0x5A5A5A5Au;
  CP("ca", 8, &sm[0][4 * i], src + 4 * i); CP("ca", 8, &sm[0][4 * i + 2], src + 4 * i + 2); COMMIT();
  CP("cg", 16, &sm[1][4 * i], src + 128 + 4 * i); COMMIT();
  for (int k = 0; k < 4; ++k) CP("ca", 4, &sm[2][4 * i + k], src + 256 + 4 * i + k);
  COMMIT();
  for (int g = 0; g < 3; ++g) COPY(out + g * 128 + 4 * i, &sm[g][4 * i], 4);
  WAIT(1);
  for (int g = 0; g < 3; ++g) COPY(out + 384 + g * 128 + 4 * i, &sm[g][4 * i], 4);
  WAIT_ALL();
  for (int g = 0; g < 3; ++g) COPY(out + 768 + g * 128 + 4 * i, &sm[g][4 * i], 4);
}
// 64 threads, 16 bytes each; mode picks the form; arg is src-size, the predicate or zfill
extern "C" __global__ void fill(const unsigned char* src, const int* arg, unsigned char* out, int mode) {
  __shared__ __align__(16) unsigned char sm[64 * 16];
  const int i = threadIdx.x, v = arg[i];
  for (int k = 0; k < 16; ++k) sm[16 * i + k] = 0x5A;
  const unsigned d = smem(&sm[16 * i]);
  const unsigned char* s = src + 16 * i;
  if (mode == 0)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], %2, %3;\n" :: "r"(d), "l"(s), "n"(16), "r"(v) : "memory");
  if (mode == 1) asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" :: "r"(d), "l"(s), "r"(v) : "memory");
  if (mode == 2) asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(d), "l"(s), "r"(v) : "memory");
  if (mode == 3)
    asm volatile("{\n  .reg .pred p;\n  setp.ne.b32 p, %0, 0;\n  @p cp.async.cg.shared.global [%1], [%2], %3;\n}\n"
                 :: "r"(v), "r"(d), "l"(s), "n"(16) : "memory");
  if (mode >= 4) __pipeline_memcpy_async(&sm[16 * i], s, 16 >> (mode - 4), v);
  if (mode >= 4) __pipeline_commit(); else COMMIT();
  if (mode >= 4) __pipeline_wait_prior(0); else WAIT(0);
  COPY(out + 16 * i, &sm[16 * i], 16);
}
// 32 threads, src[384]; out[6][128]: stages 0 and 1 after wait_prior(1); stage 1 after wait_prior(0);
// the neighbour's stage 0 after __syncthreads; stage 0 refilled, before and after its wait
extern "C" __global__ void stages(const float* src, float* out) {
  __shared__ __align__(16) float sm[2][128];
  const int i = threadIdx.x, j = (i + 1) % 32;
  for (int k = 0; k < 4; ++k) sm[0][4 * i + k] = sm[1][4 * i + k] = 0.0f;
  __pipeline_memcpy_async(&sm[0][4 * i], src + 4 * i, 16); __pipeline_commit();
  __pipeline_memcpy_async(&sm[1][4 * i], src + 128 + 4 * i, 16); __pipeline_commit();
  __pipeline_wait_prior(1);
  COPY(out + 4 * i, &sm[0][4 * i], 4); COPY(out + 128 + 4 * i, &sm[1][4 * i], 4);
  __pipeline_wait_prior(0);
  __syncthreads();
  COPY(out + 256 + 4 * i, &sm[1][4 * i], 4); COPY(out + 384 + 4 * i, &sm[0][4 * j], 4);
  __syncthreads();
  __pipeline_memcpy_async(&sm[0][4 * i], src + 256 + 4 * i, 16); __pipeline_commit();
  COPY(out + 512 + 4 * i, &sm[0][4 * i], 4);
  __pipeline_wait_prior(0);
  COPY(out + 640 + 4 * i, &sm[0][4 * i], 4);
}
// 32 lanes copy 16 bytes each; odd lanes wait, then even lanes; out[2][128]: the partner lane's slot after each
extern "C" __global__ void per_thread(const unsigned* src, unsigned* out) {
  __shared__ __align__(16) unsigned sm[128];
  const int i = threadIdx.x, j = i ^ 1;
  CP("cg", 16, &sm[4 * i], src + 4 * i); COMMIT();
  if (i & 1) WAIT_ALL();
  __syncthreads();
  COPY(out + 4 * i, &sm[4 * j], 4);
  __syncthreads();
  if (!(i & 1)) WAIT(0);
  __syncthreads();
  COPY(out + 128 + 4 * i, &sm[4 * j], 4);
}
// sim-only misuse of src[64]: 0 misaligned source, 1 misaligned destination, 2 source past the end,
// 3 src-size 0 at the end (reads nothing)
extern "C" __global__ void misuse(const float* src, float* out, int mode) {
  __shared__ __align__(16) float sm[8];
  if (mode == 0) CP("cg", 16, &sm[0], src + 1);
  if (mode == 1) CP("ca", 8, &sm[1], src);
  if (mode == 2) CP("cg", 16, &sm[0], src + 64);
  if (mode == 3)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(smem(sm)), "l"(src + 64), "r"(0) : "memory");
  WAIT_ALL();
  COPY(out, sm, 4);
}
"""
VALID = {"OPS": OPS, "LOP3": LOP3, "PRMT": PRMT, "CVT": CVT, "FP8": FP8, "MEM": MEM, "CPASYNC": CPASYNC}


def launch(backend, src, name, grid, block, *args, shared_mem=0):
    """Run kernel ``name`` of ``src``; returns every array argument (as numpy) after the launch."""
    dev = [backend.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    raw_module(backend, src).get_function(name)((grid,), (block,), tuple(dev), shared_mem=shared_mem)
    return [backend.to_numpy(d) for d in dev if not np.isscalar(d)]


def check(got, want, what, isnan=None):
    got, want = np.asarray(got).ravel(), np.broadcast_to(want, np.shape(got)).ravel()
    ok = (got == want) | (isnan(got) & isnan(want) if isnan else False)
    bad = np.flatnonzero(~ok)
    assert bad.size == 0, (f"{what}: {bad.size} of {ok.size} differ, first at {bad[:4].tolist()}: got "
                           f"{[hex(int(v)) for v in got[bad[:4]]]}, want {[hex(int(v)) for v in want[bad[:4]]]}")


def rand_u32(rng, n):
    return rng.integers(0, 2**32, n, dtype=np.uint64).astype(U32)


def lop3(a, b, c, lut):
    d = np.zeros_like(a)
    for k in range(8):
        if lut >> k & 1:
            d |= (a if k & 4 else ~a) & (b if k & 2 else ~b) & (c if k & 1 else ~c)
    return d


def prmt(a, b, c, mode=None):
    src = (b.astype(np.uint64) << np.uint64(32)) | a
    ctl = c if mode is None else np.array(PRMT_MODES[mode], U32)[c & 3]
    d = np.zeros_like(a)
    for k in range(4):
        sel = (ctl >> U32(4 * k)) & U32(0xF)
        byte = ((src >> (U32(8) * (sel & U32(7))).astype(np.uint64)) & np.uint64(0xFF)).astype(U32)
        d |= np.where(sel & 8, np.where(byte & 0x80, U32(0xFF), U32(0)), byte).astype(U32) << U32(8 * k)
    return d


def test_laneid_and_operand_forms(backend):
    rng = np.random.default_rng(1)
    a, b, c = (rand_u32(rng, 192) for _ in range(3))
    out = launch(backend, OPS, "operands", 2, 96, a, b, c, np.zeros(6 * 192, U32))[3].reshape(192, 6)
    check(out[:, 0], np.arange(192) % 96 % 32, "%laneid, 96-thread blocks")
    check(out[:, 1], a ^ b ^ c, '"+r" in-out lop3 0x96')
    check(out[:, 2], lop3(a, b, c, 0xE8), '"n" immediate lop3 0xE8')
    check(out[:, 3], prmt(a, b, c), "prmt.b32, random selectors (sign bits included)")
    check(out[:, 4], lop3(a, b, c, 0x1A), "lop3 from a macro, #imm and string concatenation")
    check(out[:, 5], prmt(a & b & c, a, np.full_like(a, 0x7531)), "{ .reg .b32 t; lop3 t; prmt t }")


def test_lop3_every_immlut(backend):
    rng = np.random.default_rng(2)
    a, b, c = (rand_u32(rng, 64) for _ in range(3))
    out = launch(backend, LOP3, "lop3_all", 1, 64, a, b, c, np.zeros(64 * 256, U32))[3].reshape(64, 256)
    for lut in range(256):
        check(out[:, lut], lop3(a, b, c, lut), f"lop3 immLut=0x{lut:02x}")


def test_prmt_modes(backend):
    rng = np.random.default_rng(3)
    a, b, c = (rand_u32(rng, 256) for _ in range(3))
    out = launch(backend, PRMT, "prmt_modes", 1, 256, a, b, c, np.zeros(6 * 256, U32))[3].reshape(256, 6)
    for k, mode in enumerate(PRMT_MODES):
        check(out[:, k], prmt(a, b, c, mode), f"prmt.b32.{mode}")


def f16_nan(h): return ((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0)
def bf16_nan(h): return ((h & 0x7F80) == 0x7F80) & ((h & 0x7F) != 0)
def e4m3_nan(c): return (c & 0x7F) == 0x7F
def e5m2_nan(c): return ((c & 0x7C) == 0x7C) & ((c & 3) != 0)


def test_cvt_f32_pairs_to_f16x2_bf16x2(backend):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(3000) * 2.0 ** rng.integers(-30, 30, 3000)).astype(np.float32)
    h = rng.integers(0x0400, 0x7BFF, 500).astype(np.uint16)  # halfway between two f16 / two bf16
    f16_ties = (h.view(np.float16).astype(np.float64) + (h + 1).view(np.float16).astype(np.float64)) / 2
    bf_ties = ((rand_u32(rng, 500) & U32(0xFFFF0000)) | U32(0x8000)).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65519, 65520, 1e5, -7e4, 3.4028235e38,
                        -3.4e38, 1e-6, -3e-8, 6e-8, 1e-40, -1e-39, 1.0 + 2**-11, 1.0 + 3 * 2**-11], np.float32)
    x = np.concatenate([x, f16_ties.astype(np.float32), bf_ties, special])
    a, b = rng.permutation(x), rng.permutation(x)
    n = a.size
    _, _, got_h, got_bf = launch(backend, CVT, "cvt_pack", (n + 255) // 256, 256, a, b,
                                 np.zeros(n, U32), np.zeros(n, U32), np.int32(n))
    with np.errstate(over="ignore", invalid="ignore"):
        for got, dt, isnan in ((got_h, np.float16, f16_nan), (got_bf, ml_dtypes.bfloat16, bf16_nan)):
            check(got >> 16, a.astype(dt).view(np.uint16), f"cvt.rn.{dt.__name__}x2.f32 upper = cvt(a)", isnan)
            check(got & 0xFFFF, b.astype(dt).view(np.uint16), f"cvt.rn.{dt.__name__}x2.f32 lower = cvt(b)", isnan)


def to_fp8(x, dt, top):
    """Nearest-even onto the grid of codes 0..top, |x| > MAX_NORM (inf too) to MAX_NORM, NaN to NaN."""
    grid = np.arange(top + 1, dtype=np.uint8).view(dt).astype(np.float64)
    mag = np.minimum(np.abs(x.astype(np.float64)), grid[-1])
    hi = np.minimum(np.searchsorted(grid, mag), top)
    lo = np.maximum(hi - 1, 0)
    dlo, dhi = mag - grid[lo], grid[hi] - mag
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.where(np.isnan(x), 0x7F, code | np.signbit(x).astype(np.int64) << 7).astype(np.uint16)


FP8_TYPES = ((ml_dtypes.float8_e4m3fn, 0x7E, e4m3_nan, "e4m3x2"), (ml_dtypes.float8_e5m2, 0x7B, e5m2_nan, "e5m2x2"))


def test_cvt_fp8x2_to_f16x2_every_pair(backend):
    if not cuda_arch_at_least(backend, 89):
        pytest.skip("fp8 cvt needs sm_89")
    codes = np.arange(65536, dtype=np.uint16)
    _, e4, e5 = launch(backend, FP8, "fp8_to_f16x2", 64, 256, codes, np.zeros(65536, U32), np.zeros(65536, U32),
                       np.int32(65536))
    for got, (dt, _, _, name) in zip((e4, e5), FP8_TYPES):
        def f16(byte): return byte.astype(np.uint8).view(dt).astype(np.float16).view(np.uint16)
        check(got >> 16, f16(codes >> 8), f"cvt.rn.f16x2.{name} upper = cvt(a[15:8])", f16_nan)
        check(got & 0xFFFF, f16(codes & 0xFF), f"cvt.rn.f16x2.{name} lower = cvt(a[7:0])", f16_nan)


def test_cvt_satfinite_f32_pairs_to_fp8x2(backend):
    if not cuda_arch_at_least(backend, 89):
        pytest.skip("fp8 cvt needs sm_89")
    rng = np.random.default_rng(5)
    x = [2.0 ** rng.uniform(-19, 18, 4000) * rng.choice([-1, 1], 4000)]
    for dt, top, _, _ in FP8_TYPES:  # every code, every tie between neighbours, the tie above MAX_NORM
        g = np.arange(top + 1, dtype=np.uint8).view(dt).astype(np.float64)
        x += [g, -(g[:-1] + g[1:]) / 2, (g[:-1] + g[1:]) / 2, [g[-1] + (g[-1] - g[-2]) / 2]]
    x.append([0.0, -0.0, np.inf, -np.inf, np.nan, 449, 464, 480, 1e6, -1e6, 57345, 61439, 61440, 1e30, 1e-30, -1e-45])
    x = np.hstack(x).astype(np.float32)
    a, b = rng.permutation(x), rng.permutation(x)
    n = a.size
    _, _, e4, e5 = launch(backend, FP8, "f32_to_fp8x2", (n + 255) // 256, 256, a, b,
                          np.zeros(n, np.uint16), np.zeros(n, np.uint16), np.int32(n))
    for got, (dt, top, isnan, name) in zip((e4, e5), FP8_TYPES):
        check(got >> 8, to_fp8(a, dt, top), f"cvt.rn.satfinite.{name}.f32 upper = cvt(a)", isnan)
        check(got & 0xFF, to_fp8(b, dt, top), f"cvt.rn.satfinite.{name}.f32 lower = cvt(b)", isnan)


def test_approx_math_within_isa_bounds(backend):
    rng = np.random.default_rng(6)
    inf, nan = np.inf, np.nan
    table = [  # input, ex2, lg2, rcp, tanh (None: left to the bounds); .ftz flushes subnormal inputs and results
        (0.0, 1, -inf, inf, 0.0), (-0.0, 1, -inf, -inf, -0.0), (inf, inf, inf, 0.0, 1), (-inf, 0.0, nan, -0.0, -1),
        (nan, nan, nan, nan, nan), (1e-40, 1, -inf, inf, None), (-1e-40, 1, -inf, -inf, None),
        (2.0**127, inf, None, 0.0, None), (-(2.0**127), 0.0, nan, -0.0, None), (128.0, inf, None, None, None),
        (200.0, inf, None, None, None), (-127.0, 0.0, nan, None, None), (-200.0, 0.0, nan, None, None),
        (2.0**126, None, None, None, None), (-1.0, None, nan, None, None)]
    x = np.concatenate([rng.uniform(-125, 127.5, 1500), rng.uniform(0.5, 2, 500), rng.uniform(-6, 6, 500),
                        2.0 ** rng.uniform(-125, 126, 1500) * rng.choice([-1, 1], 1500), [t[0] for t in table]])
    x = x.astype(np.float32)
    n, xd = x.size, x.astype(np.float64)
    results = launch(backend, CVT, "approx", (n + 255) // 256, 256, x, np.zeros(4 * n, np.float32), np.int32(n))[1]
    results = dict(zip(("ex2", "lg2", "rcp", "tanh"), results.reshape(4, n)))
    with np.errstate(all="ignore"):
        def ulps(got, ref):
            return np.abs(got.view(np.int32).astype(np.int64) - ref.astype(np.float32).view(np.int32))
        lg2 = np.log2(xd)
        bounds = {  # op: (error, bound, where checked)
            "ex2": (ulps(results["ex2"], np.exp2(xd)), 2, (x >= -125) & (x <= 127.5)),
            "rcp": (ulps(results["rcp"], 1 / xd), 1, (np.abs(x) >= 2.0**-125) & (np.abs(x) <= 2.0**126)),
            "lg2": (np.abs(results["lg2"] - lg2), np.where((xd > 0.5) & (xd < 2), 1, np.abs(lg2)) * 2.0**-22,
                    x >= 2.0**-126),
            "tanh": (np.abs(results["tanh"] - np.tanh(xd)), 2.0**-11 * np.abs(np.tanh(xd)), np.isfinite(x))}
        for op, (err, bound, where) in bounds.items():
            bad = np.flatnonzero(where & np.isfinite(x) & ~(err <= bound))
            assert bad.size == 0, f"{op}.approx{x[bad[:3]]} = {results[op][bad[:3]]}: beyond the ISA's bound"
    for r, (v, *want) in enumerate(table):
        for op, w in zip(results, want):
            got = results[op][n - len(table) + r]
            assert w is None or (np.isnan(w) and np.isnan(got)) or (got == w and np.signbit(got) == np.signbit(w)), \
                f"{op}.approx({v}) = {got}, want {w}"


def test_vector_loads_stores_and_cvta(backend):
    rng = np.random.default_rng(7)
    g, gf = rand_u32(rng, 256), rng.standard_normal(256).astype(np.float32)
    _, _, out, fout = launch(backend, MEM, "mem", 1, 64, g, gf, np.zeros(64 * 24, U32), np.zeros(256, np.float32))
    out, i, v4 = out.reshape(64, 24), np.arange(64), g.reshape(64, 4)
    check(out[:, 0:4], v4, "ld.global.nc.v4.u32")
    check(fout.view(U32), gf.view(U32), "ld.global.nc.v4.f32")
    check(out[:, 4:8], v4[(i + 1) % 64], "ld.global.nc.L1::no_allocate.v4.u32")
    stored = np.concatenate([v4[(i + 5) % 64], v4[(i + 6) % 64]], axis=1)
    check(out[:, 8:16], stored, "st.shared.v4.u32 [s] and [s+16], then ld.shared.v4.u32 [t] and [t+16]")
    check(out[:, 16:24], stored, "st.shared.v4.u32 read back through the generic pointer")
    o = launch(backend, MEM, "cvta", 1, 32, np.zeros(32 * 8, U32), shared_mem=512)[0].reshape(32, 8)
    i = np.arange(32)
    check(o[:, 0], 1, "__cvta_shared_to_generic(__cvta_generic_to_shared(p)) == p, static __shared__")
    check(o[:, 1], 1, "__cvta_shared_to_generic(__cvta_generic_to_shared(p)) == p, extern __shared__")
    check(o[:, 2], 4 * i, "shared address of st[i] - st[0]")
    check(o[:, 3], 16 * i, "shared address of dyn[4i] - dyn[0]")
    check(o[:, 4], 1, "shared addresses fit 32 bits and distinct arrays differ")
    check(o[:, 5:8], np.stack([(i + 1) % 32 + k for k in (0, 100, 300)], 1), "st.shared.v4 at dyn's shared address")


def test_cp_async_groups_land_when_waited(backend):
    src = rand_u32(np.random.default_rng(8), 384)
    out = launch(backend, CPASYNC, "groups", 1, 32, src, np.zeros(9 * 128, U32))[1].reshape(3, 3, 128)
    want = src.reshape(3, 128)
    check(out[1, :2], want[:2], "wait_group 1: groups 0 and 1 landed")
    check(out[2], want, "wait_all: every group landed")
    if backend.name == "sim":
        check(out[0], poison(), "sim: before any wait every destination reads 0xFF")
        check(out[1, 2], poison(), "sim: wait_group 1 leaves the newest group in flight (0xFF)")


def test_cp_async_groups_are_per_thread(backend):
    src = rand_u32(np.random.default_rng(11), 128)
    out = launch(backend, CPASYNC, "per_thread", 1, 32, src, np.zeros(256, U32))[1].reshape(2, 32, 4)
    partner = src.reshape(32, 4)[np.arange(32) ^ 1]
    check(out[0, 0::2], partner[0::2], "odd lanes' copies, waited by them, seen by even lanes after __syncthreads")
    check(out[1], partner, "every copy once every lane waited")
    if backend.name == "sim":
        check(out[0, 1::2], poison(), "sim: one lane's wait does not land another lane's copies")


@pytest.mark.parametrize("mode", range(7))
def test_cp_async_src_size_predicate_and_pipeline_zfill(backend, mode):
    rng = np.random.default_rng(9 + mode)
    src = rng.integers(0, 256, 64 * 16, dtype=np.uint8)
    cp = (16, 8, 4, 16, 16, 8, 4)[mode]
    arg = rng.integers(0, 2 if mode == 3 else cp + 1, 64)
    arg[:2] = (0, 1 if mode == 3 else cp)
    out = launch(backend, CPASYNC, "fill", 1, 64, src, arg.astype(np.int32), np.zeros(64 * 16, np.uint8),
                 np.int32(mode))[2].reshape(64, 16)
    k = np.arange(16)
    nread = (16 * arg if mode == 3 else cp - arg if mode >= 4 else arg)[:, None]  # bytes read from src
    size = (16 * arg)[:, None] if mode == 3 else cp  # bytes written to shared memory
    want = np.where(k < nread, src.reshape(64, 16), np.where(k < size, 0, 0x5A))
    what = ("cg.L2::128B 16, src-size", "ca 8, src-size", "ca 4, src-size", "@p cg 16", "__pipeline 16, zfill",
            "__pipeline 8, zfill", "__pipeline 4, zfill")[mode]
    check(out, want, f"cp.async {what}: copied bytes, zero fill, untouched rest")


def test_pipeline_primitives_wait_prior(backend):
    src = np.random.default_rng(10).standard_normal(384).astype(np.float32)
    out = launch(backend, CPASYNC, "stages", 1, 32, src, np.zeros(768, np.float32))[1].view(U32).reshape(6, 128)
    s = src.view(U32).reshape(3, 128)
    check(out[0], s[0], "__pipeline_wait_prior(1): stage 0 landed")
    check(out[2], s[1], "__pipeline_wait_prior(0): stage 1 landed")
    check(out[3], np.roll(s[0], -4), "the neighbour's copy after the wait and __syncthreads")
    check(out[5], s[2], "stage 0 refilled and waited")
    if backend.name == "sim":
        check(out[1], poison(), "sim: stage 1 still in flight after __pipeline_wait_prior(1)")
        check(out[4], poison(), "sim: a refilled stage reads 0xFF, not its old tile, until waited")


def test_cp_async_misuse_sim():
    f = sim.RawModule(code=CPASYNC, options=("-std=c++17",)).get_function("misuse")
    src, out = sim.asarray(np.ones(64, np.float32)), sim.zeros(4, np.float32)
    for mode, what in ((0, r"misaligned global access \(needs 16-byte alignment\): src at byte offset 4 "),
                       (1, "misaligned shared address"), (2, r"\bsrc\b")):
        with pytest.raises(sim.SimMemoryError, match=what):
            f((1,), (1,), (src, out, np.int32(mode)))
    f((1,), (1,), (src, out, np.int32(3)))
    check(out.view(U32), 0, "src-size 0 at the end of the array reads nothing and zero-fills")


BAD = {  # case: (lines above the kernel, a valid asm before the bad one, the bad statement, its opcode)
    "unknown": ("", 'asm("lop3.b32 %0, %1, %2, %3, 0x96;"\n      : "=r"(y) : "r"(y), "r"(y), "r"(y));',
                'asm volatile("foo.bar.b32 %0, %1;" : "=r"(x) : "r"(y));', "foo.bar"),
    "unsupported": ("", "", 'asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");',
                    "tcgen05.fence::before_thread_sync"),
    "macro": ('#define GOOD(d, s) \\\n  asm("lop3.b32 %0, %1, %1, %1, 0xF0;" \\\n      : "=r"(d) : "r"(s))\n'
              '/* a comment\n   over two lines */\n'
              '#define BAD(d, s) asm volatile("foo.bar.b32 %0, %1;" : "=r"(d) : "r"(s))\n',
              "GOOD(y, y);", "BAD(x, y);", "foo.bar"),
    "includes": ("#include <cuda_fp16.h>\n#include <cuda_pipeline_primitives.h>\n// a comment\n", "",
                 'asm volatile("foo.bar.b32 %0, %1;"\n               : "=r"(x) : "r"(y));', "foo.bar"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unsupported_instruction_names_opcode_and_line(case):
    head, good, bad, opcode = BAD[case]
    code = (f'{head}extern "C" __global__ void k(unsigned* o) {{\n  unsigned x, y = o[0];\n  {good}\n'
            f'  /*HERE*/ {bad}\n  o[0] = x;\n}}\n')
    line = next(n for n, text in enumerate(code.splitlines(), 1) if "/*HERE*/" in text)
    with pytest.raises(sim.SimCompileError) as e:
        sim.RawModule(code=code, options=("-std=c++17",)).get_function("k")
    msg = str(e.value)
    assert opcode in msg, msg
    assert re.search(rf"(\bline {line}\b|:{line}\b)", msg), f"line {line} not named: {msg}"
    assert not re.search(rf"(\bline ({line - 1}|{line + 1})\b|:({line - 1}|{line + 1})\b)", msg), msg


@pytest.mark.parametrize("name", sorted(VALID))
def test_sources_compile_under_nvrtc(name):
    from cupaged._nvrtc import compile_cubin

    compile_cubin(VALID[name], arch="sm_89", options=("-std=c++17",), name_expressions=[])
