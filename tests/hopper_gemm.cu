// hopper_gemm.cu: C = A B^T for one 128 x 128 tile per CTA, the Hopper way (sm_90a): a worked example
// of what the sim runs (tests/test_hopper_gemm.py checks it against numpy in every scheduling order).
//
//   C[m, n] = sum_k A[m, k] * B[n, k]      A [M, K] bf16, B [N, K] bf16 (K contiguous), C [M, N] f32
//
// One CTA = three warpgroups (384 threads). Warpgroup 0 is the producer: it gives registers back
// (setmaxnreg.dec 40) and one elected thread streams 128 x 64 tiles of A and B through tensor-map copies
// (cp.async.bulk.tensor.2d, 128-byte swizzle) into a 3-stage ring of shared memory, each stage guarded by
// a `full` mbarrier (the copies' bytes complete it) and an `empty` one (both consumers release it).
// Warpgroups 1 and 2 are the consumers (setmaxnreg.inc 232): each owns 64 rows of the tile and runs four
// wgmma.mma_async.m64n128k16 per stage from shared-memory descriptors, accumulating in 64 f32 registers
// per thread, then writes its rows of C. The 128-byte swizzle the copies write is the canonical K-major
// SW128 layout wgmma reads: rows of 128 bytes, 8-row atoms 1024 bytes apart (SBO), and the 16-element
// K slices 32 bytes apart inside an atom (the descriptor's start advances by 32 bytes).
//
// Compiles on its own: NVRTC -arch=sm_90a -std=c++17 (no cuda.h: the tensor map is declared here).
// Test: pytest tests/test_hopper_gemm.py.   Versions: v1 (this one): wait_group 0 per stage.

#ifndef __cuda_cuda_h__
struct alignas(64) CUtensorMap { unsigned long long opaque[16]; };  // cuTensorMapEncodeTiled's 128 bytes
#endif

namespace hgemm {
constexpr int kStages = 3, kBM = 128, kBN = 128, kBK = 64;
constexpr unsigned kTileBytes = kBM * kBK * 2;  // one 128 x 64 bf16 tile: 16 KiB (A and B alike)

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
  asm volatile("{\n\t.reg .pred done;\n\tWAIT:\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
               "@!done bra WAIT;\n\t}" :: "r"(bar), "r"(parity) : "memory");
}

// K-major, 128-byte swizzle: SBO = 1024 bytes (8 rows of 128), LBO unused (1), swizzle code 1.
__device__ __forceinline__ unsigned long long descriptor(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long da, unsigned long long db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, 1, 1, 1, 0, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db));
}

__device__ void produce(const CUtensorMap* map_a, const CUtensorMap* map_b, unsigned tiles, unsigned ring,
                        unsigned full, unsigned empty) {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
  unsigned lane;
  asm volatile("{\n\t.reg .pred leader;\n\telect.sync _|leader, 0xffffffff;\n\tselp.u32 %0, 1, 0, leader;\n\t}"
               : "=r"(lane));
  if (threadIdx.x >= 32 || !lane) return;  // one thread of warp 0 issues every copy
  for (unsigned t = 0; t < tiles; ++t) {
    const unsigned s = t % kStages, bar_full = full + 8 * s, a = ring + 2 * kTileBytes * s;
    wait_parity(empty + 8 * s, ((t / kStages) & 1) ^ 1);  // the consumers released this stage
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar_full), "r"(2 * kTileBytes));
    const int k = int(t) * kBK, m = int(blockIdx.y) * kBM, n = int(blockIdx.x) * kBN;
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" :: "r"(a), "l"(map_a), "r"(k), "r"(m), "r"(bar_full) : "memory");
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" :: "r"(a + kTileBytes), "l"(map_b), "r"(k), "r"(n), "r"(bar_full)
                 : "memory");
  }
}

__device__ void consume(float* c, int m_total, int n_total, unsigned tiles, unsigned ring, unsigned full,
                        unsigned empty) {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int group = int(threadIdx.x) / 128 - 1, t = int(threadIdx.x) % 128;  // consumer 0 or 1: rows 64 group..
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.0f;
  for (unsigned k = 0; k < tiles; ++k) {
    const unsigned s = k % kStages, a = ring + 2 * kTileBytes * s + 64 * 128 * group;
    const unsigned b = ring + 2 * kTileBytes * s + kTileBytes;
    wait_parity(full + 8 * s, (k / kStages) & 1);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    for (int j = 0; j < kBK / 16; ++j) wgmma_m64n128k16(d, descriptor(a + 32 * j), descriptor(b + 32 * j));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    if (t == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(empty + 8 * s) : "memory");
  }
  const int w = t / 32, g = t % 32 / 4, q = t % 4;
  for (int i = 0; i < 64; ++i) {
    const int row = int(blockIdx.y) * kBM + 64 * group + 16 * w + g + 8 * ((i >> 1) & 1);
    const int col = int(blockIdx.x) * kBN + 8 * (i >> 2) + 2 * q + (i & 1);
    if (row < m_total && col < n_total) c[(long long)row * n_total + col] = d[i];
  }
}
}  // namespace hgemm

// grid (ceil(N / 128), ceil(M / 128)), block 384, dynamic shared memory 3 * 32 KiB + 1 KiB (1024-aligned ring)
extern "C" __global__ void __launch_bounds__(384, 1)
hopper_gemm(const __grid_constant__ CUtensorMap map_a,  // over A [M, K] bf16, box (128, 64), 128B swizzle
            const __grid_constant__ CUtensorMap map_b,  // over B [N, K] bf16, box (128, 64), 128B swizzle
            float* c,                                   // [M, N]
            int m_total, int n_total, int k_total) {
  using namespace hgemm;
  extern __shared__ unsigned char smem[];
  __shared__ alignas(8) unsigned long long bars[2 * kStages];  // full[s], then empty[s]
  const unsigned base = smem_addr(smem), ring = base + (1024u - base % 1024u) % 1024u;
  const unsigned full = smem_addr(bars), empty = full + 8 * kStages, tiles = unsigned((k_total + kBK - 1) / kBK);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full + 8 * s));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 2;" :: "r"(empty + 8 * s));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("prefetch.tensormap [%0];" :: "l"(&map_a) : "memory");
    asm volatile("prefetch.tensormap [%0];" :: "l"(&map_b) : "memory");
  }
  __syncthreads();
  if (threadIdx.x < 128) produce(&map_a, &map_b, tiles, ring, full, empty);
  else consume(c, m_total, n_total, tiles, ring, full, empty);
}
