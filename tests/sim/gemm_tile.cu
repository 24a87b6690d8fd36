// gemm_tile.cu: a worked example of the Ampere tensor-core pipeline: cp.async double buffering,
// ldmatrix (plain and .trans) and mma.sync m16n8k16, checked on the sim and by the NVRTC gate.
//
// Maths: C[m, n] = sum_k A[m, k] * B[k, n]; fp16 inputs, every product and sum in fp32.
//
// Layouts, row-major, strides in elements; M, N multiples of 64, K a multiple of 32, base
// pointers 16-byte aligned (so every row start and every 8-half chunk is too):
//   A  [M, K] __half  (row stride K)
//   B  [K, N] __half  (row stride N)
//   C  [M, N] float   (row stride N)
// Grid (N / 64, M / 64), 128 threads: CTA (x, y) owns the 64x64 tile C[64y.., 64x..]; warp w owns
// its 32x32 quadrant (rows 32 * (w / 2), columns 32 * (w % 2)) as 2 x 4 mma tiles of 16x8, i.e.
// 32 fp32 accumulators per thread. K is walked in steps of BK = 32 (two k16 mma steps).
//
// Shared memory, two stages (s = kt % 2), rows padded by 8 halves (16 bytes):
//   sA[s] [64 rows m][40 halves]: k in 0..31, 32..39 unused; 80-byte rows
//   sB[s] [32 rows k][72 halves]: n in 0..63, 64..71 unused; 144-byte rows
// Rows stay 16-byte aligned (80 = 5 * 16, 144 = 9 * 16), as cp.async's 16-byte copies and
// ldmatrix's row addresses require. Each ldmatrix phase reads 8 rows of 16 bytes at one column;
// the padding shifts consecutive rows by 20 (A) or 4 (B) banks mod 32, so the 8 rows cover all 32
// banks once: no bank conflicts (unpadded, 64- and 128-byte strides would put them on 2 or 1
// bank groups: 4- and 8-way conflicts).
//
// Fragments (PTX ISA, "Matrix fragments for mma.m16n8k16", g = lane / 4, t = lane % 4):
//   A 16x16: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..). These are
//     the four 8x8 quadrants [rows 0-7 | 8-15] x [cols 0-7 | 8-15] in the order TL, BL, TR, BR, each
//     in ldmatrix's layout (lane holds row g, columns 2t, 2t+1): one ldmatrix.x4 with lane l
//     giving the address of row l % 16, column 8 * (l / 16).
//   B 16x8 ("col"): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g). sB holds B as [k][n], so an 8x8
//     block read with .trans gives lane l the stored elements (2t, g), (2t+1, g): exactly b0. One
//     ldmatrix.x4.trans over k 0-15 x n 0-15 yields b0, b1 of n tile 0 and b0, b1 of n tile 1,
//     with the same lane -> row addressing as A (k row l % 16, n column 8 * (l / 16)).
//   C 16x8 fp32: c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..): stored as two float2.
//
// Pipeline and barriers, iteration kt (stage s = kt % 2):
//   1. issue the cp.async group for tile kt+1 into stage s^1, then wait_group 1: this thread's
//      group for tile kt has landed, the one just issued may still be in flight (last tile:
//      nothing to issue, wait_group 0). The wait covers only the calling thread's copies, so
//   2. __syncthreads (after the wait): every thread's copies for tile kt are visible to the warps
//      whose ldmatrix reads them.
//   3. ldmatrix + mma on stage s.
//   4. __syncthreads (after the mma): iteration kt+1 overwrites stage s with tile kt+2; no warp
//      may still be reading it (write-after-read).
// -DGEMM_SKIP_WAIT removes the waits of step 1 (a bug injected on purpose: tiles read before their
// copies land). The sim keeps a copy's destination 0xFF (fp16 NaN) until a wait covers its group,
// so that variant must produce NaN there; on a GPU it is a race. A final wait_group 0 stays, so no
// copy is still in flight when the CTA exits. -DGEMM_SKIP_WAR_BARRIER removes the barrier of
// step 4: a warp that runs ahead overwrites a stage others still read; the sim's reverse and random
// orders let warps run ahead between barriers, so that variant fails there.
//
// Test: pytest tests/sim/test_gemm.py (sim in three scheduling orders, NVRTC sm_80 / sm_90 with no
// spills, the SKIP_WAIT variant; cuda when a GPU is present).
#include <cuda_fp16.h>

namespace {

constexpr int BM = 64, BN = 64, BK = 32, THREADS = 128;
constexpr int A_LD = BK + 8;  // halves per sA row
constexpr int B_LD = BN + 8;  // halves per sB row

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1 (.cg); both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// Tile kt of A (rows m0.., columns 32 kt..) and B (rows 32 kt.., columns n0..) into one stage:
// 256 16-byte chunks each, 2 per thread; chunk c is A row c / 4, halves 8 (c % 4) and B row c / 8,
// halves 8 (c % 8), so consecutive threads read consecutive global bytes.
__device__ __forceinline__ void load_tile(__half* sa, __half* sb, const __half* A, const __half* B,
                                          int m0, int n0, int k0, int N, int K) {
  for (int c = threadIdx.x; c < 256; c += THREADS) {
    cp_async16(sa + (c >> 2) * A_LD + (c & 3) * 8, A + static_cast<long long>(m0 + (c >> 2)) * K + k0 + (c & 3) * 8);
    cp_async16(sb + (c >> 3) * B_LD + (c & 7) * 8, B + static_cast<long long>(k0 + (c >> 3)) * N + n0 + (c & 7) * 8);
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const __half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                                  const __half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_addr(p)) : "memory");
}

// d += a (16x16, row) * b (16x8, col), fp32 accumulate.
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
gemm_tile(const __half* __restrict__ A,  // [M, K]
          const __half* __restrict__ B,  // [K, N]
          float* __restrict__ C,         // [M, N]
          int M, int N, int K) {
  alignas(16) __shared__ __half sA[2][BM * A_LD];
  alignas(16) __shared__ __half sB[2][BK * B_LD];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;  // the warp's quadrant within the tile
  const int tiles = K / BK;

  float acc[2][4][4] = {};  // [m16 tile][n8 tile][c0..c3]
  load_tile(sA[0], sB[0], A, B, m0, n0, 0, N, K);
  for (int kt = 0; kt < tiles; ++kt) {
    const int s = kt & 1;
    const bool next = kt + 1 < tiles;
    if (next) load_tile(sA[s ^ 1], sB[s ^ 1], A, B, m0, n0, (kt + 1) * BK, N, K);  // overlaps the mma below
#ifndef GEMM_SKIP_WAIT
    if (next) asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // tile kt landed; kt+1 may be in flight
    else asm volatile("cp.async.wait_group 0;\n" ::: "memory");       // last tile: wait for everything
#endif
    __syncthreads();  // all threads' copies of tile kt are visible
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned a[2][4], b[4][2];
      for (int mi = 0; mi < 2; ++mi)
        ldmatrix_x4(a[mi], &sA[s][(wm + mi * 16 + lane % 16) * A_LD + kk + (lane / 16) * 8]);
      for (int nj = 0; nj < 2; ++nj)
        ldmatrix_x4_trans(b[2 * nj][0], b[2 * nj][1], b[2 * nj + 1][0], b[2 * nj + 1][1],
                          &sB[s][(kk + lane % 16) * B_LD + wn + nj * 16 + (lane / 16) * 8]);
      for (int mi = 0; mi < 2; ++mi)
        for (int ni = 0; ni < 4; ++ni) mma16816(acc[mi][ni], a[mi], b[ni]);
    }
#ifndef GEMM_SKIP_WAR_BARRIER
    __syncthreads();  // stage s is free: the next iteration's load_tile overwrites it
#endif
  }
#ifdef GEMM_SKIP_WAIT
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // no copy in flight at exit
#endif

  const int g = lane / 4, t = lane % 4;
  for (int mi = 0; mi < 2; ++mi)
    for (int ni = 0; ni < 4; ++ni) {
      float* c = C + static_cast<long long>(m0 + wm + mi * 16 + g) * N + n0 + wn + ni * 8 + 2 * t;
      *reinterpret_cast<float2*>(c) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);          // row g
      *reinterpret_cast<float2*>(c + 8 * N) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);  // row g + 8
    }
  (void)M;  // the grid covers M; kept for the call's symmetry with N and K
}
