// hopper_attention.cu: FlashAttention-3's inner loop on the sim -- the first working step of the sm_90a
// prefill (docs/hopper-prefill.md), as a worked example before it becomes a kernel family with routing.
//
//   out[i, h] = softmax(scale q[i, h] K_b^T + mask) V_b        varlen, bf16, head size 128, GQA, causal or not
//
// q [total_q, num_heads, 128], k / v [total_k, num_kv_heads, 128] bf16 (sequence b owns rows cu_seqlens[b]..),
// out [total_q, num_heads, 128] bf16, lse [num_heads, total_q] f32 (natural log; -inf for a row that sees
// nothing). Causal masking is bottom-right aligned, as varlen_attention's.
// One CTA = 128 query rows of one (sequence, head): warpgroup 0 is the producer (one thread streams the Q tile
// and 64-key K/V tiles through tensor-map copies, 128-byte swizzle, into a 2-stage full/empty mbarrier ring),
// warpgroups 1 and 2 the consumers, 64 rows each, sharing every K/V tile: S = Q K^T (8 wgmma m64n64k16 from
// descriptors), the online softmax in the
// accumulator registers (exp2, the scale's log2 e folded in), P = bf16(S) packed straight into A fragments,
// O += P V (4 wgmma m64n128k16, A from registers, V MN-major). Keys past the sequence's end score -inf, and
// the V rows behind them are zeroed in shared memory before P V (a masked key must not reach the output
// through 0 * NaN). Test: pytest tests/test_hopper_attention.py.
// v0: one consumer of 64 rows. v1 (this one): two consumers of 64 rows share each K/V tile, halving its reads;
// no ping-pong, no setmaxnreg yet.

#include <cuda_bf16.h>
#ifndef __cuda_cuda_h__
struct alignas(64) CUtensorMap { unsigned long long opaque[16]; };  // cuTensorMapEncodeTiled's 128 bytes
#endif

namespace hattn {
constexpr int kRows = 128, kKeys = 64, kStages = 2;  // a consumer owns 64 of the rows
constexpr unsigned kPanel = 64 * 128;  // 64 rows of 64 bf16 columns (128 bytes): half of a 128-wide tile
constexpr unsigned kTile = 2 * kPanel;

__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
  asm volatile("{\n\t.reg .pred done;\n\tWAIT:\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
               "@!done bra WAIT;\n\t}" :: "r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void load(unsigned dst, const CUtensorMap* map, int col, int head, int row, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];" :: "r"(dst), "l"(map), "r"(col), "r"(head), "r"(row), "r"(bar)
               : "memory");
}

// K-major, 128-byte swizzle (Q and K): SBO 1024 (8 rows of 128 bytes). MN-major (V as B of P V, N = the
// head dimension): LBO = the panel stride (the next 64 columns), SBO 1024 (the next 8 keys).
__device__ __forceinline__ unsigned long long desc_k(unsigned a) {
  return (unsigned long long)((a & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ unsigned long long desc_mn(unsigned a) {
  return (unsigned long long)((a & 0x3FFFFu) >> 4) | ((unsigned long long)(kPanel >> 4) << 16) | (64ull << 32) |
         (1ull << 62);
}

#define HATTN_F8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                       "+f"(d[i + 6]), "+f"(d[i + 7])
__device__ __forceinline__ void qk(float (&s)[32], unsigned long long da, unsigned long long db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
               "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
               "%31}, %32, %33, 1, 1, 1, 0, 0;"
               : HATTN_F8(s, 0), HATTN_F8(s, 8), HATTN_F8(s, 16), HATTN_F8(s, 24) : "l"(da), "l"(db));
}
__device__ __forceinline__ void pv(float (&o)[64], const unsigned (&a)[4], unsigned long long db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
               "%10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "
               "%30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "
               "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, "
               "1, 1, 1, 1;"
               : HATTN_F8(o, 0), HATTN_F8(o, 8), HATTN_F8(o, 16), HATTN_F8(o, 24), HATTN_F8(o, 32), HATTN_F8(o, 40),
                 HATTN_F8(o, 48), HATTN_F8(o, 56)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#undef HATTN_F8

__device__ __forceinline__ unsigned pack(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float quad_max(float x) {  // over the 4 lanes holding one row
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

struct Tile {
  int len_q, len_k, row0, tiles, shift;  // row0: the consumer's first row; a query at row i sits at key i + shift
};

// One key tile: scores, online softmax (m, l per thread row pair), P into A fragments, O += P V.
__device__ void step(const Tile& tl, int t, unsigned q, unsigned k, unsigned v, float scale_log2, int causal,
                     float (&o)[64], float (&m)[2], float (&l)[2]) {
  const int tid = int(threadIdx.x) % 128, row = tl.row0 + 16 * (tid / 32) + tid % 32 / 4, quad = tid % 4;
  float s[32];
  for (int i = 0; i < 32; ++i) s[i] = 0.0f;
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  for (int j = 0; j < 8; ++j)
    qk(s, desc_k(q + (j / 4) * kPanel + 32 * (j % 4)), desc_k(k + (j / 4) * kPanel + 32 * (j % 4)));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  float mx[2] = {neg_inf(), neg_inf()};
  for (int i = 0; i < 32; ++i) {
    const int key = t * kKeys + 8 * (i >> 2) + 2 * quad + (i & 1), r = row + 8 * ((i >> 1) & 1);
    const bool seen = key < tl.len_k && (!causal || key <= r + tl.shift);
    s[i] = seen ? s[i] * scale_log2 : neg_inf();  // masked by selection, whatever the key row held
    mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
  }
  float alpha[2];
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(m[h], quad_max(mx[h]));
    alpha[h] = m_new == neg_inf() ? 1.0f : exp2f(m[h] - m_new);
    m[h] = m_new;
    l[h] *= alpha[h];
  }
  for (int i = 0; i < 32; ++i) {
    const int h = (i >> 1) & 1;
    s[i] = s[i] == neg_inf() ? 0.0f : exp2f(s[i] - m[h]);
    l[h] += s[i];
  }
  for (int i = 0; i < 64; ++i) o[i] *= alpha[(i >> 1) & 1];
  const int valid = tl.len_k - t * kKeys;  // the keys of this tile inside the sequence
  if (valid < kKeys) {  // the rest hold the next sequence or zeros: their V rows must not reach P V
    for (int c = int(threadIdx.x) - 128; c < (kKeys - valid) * 16; c += 256) {  // 16-byte chunks, 8 a panel row
      const unsigned key = unsigned(valid + c / 16), panel = unsigned(c / 8 % 2), chunk = unsigned(c % 8);
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(v + panel * kPanel + key * 128u + chunk * 16u),
                   "r"(0u) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumers read this V tile
  }
  unsigned a[4][4];  // all of P's fragments first: a wgmma in flight still reads its A registers
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < 4; ++r) a[j][r] = pack(s[8 * j + 2 * r], s[8 * j + 2 * r + 1]);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  for (int j = 0; j < 4; ++j) pv(o, a[j], desc_mn(v + 2048u * unsigned(j)));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
}  // namespace hattn

// grid (ceil(max_seqlen_q / 128), num_heads, batch), block 384, dynamic shared memory 6 * 16 KiB + 1 KiB
extern "C" __global__ void __launch_bounds__(384, 1)
hopper_attention(const __grid_constant__ CUtensorMap map_q,  // over q [total_q, num_heads, 128], box (64, 1, 64)
                 const __grid_constant__ CUtensorMap map_k,  // over k [total_k, num_kv_heads, 128], box (64, 1, 64)
                 const __grid_constant__ CUtensorMap map_v,  // over v, likewise
                 const int* cu_seqlens_q, const int* cu_seqlens_k,  // [batch + 1]
                 __nv_bfloat16* out,  // [total_q, num_heads, 128]
                 float* lse,          // [num_heads, total_q]
                 int num_heads, int num_kv_heads, float scale, int causal) {
  using namespace hattn;
  extern __shared__ unsigned char smem[];
  __shared__ alignas(8) unsigned long long bars[1 + 2 * kStages];  // q_full, full[s], empty[s]
  const int b = int(blockIdx.z), h = int(blockIdx.y);
  Tile tl;
  const int q0 = cu_seqlens_q[b], k0 = cu_seqlens_k[b];
  tl.len_q = cu_seqlens_q[b + 1] - q0;
  tl.len_k = cu_seqlens_k[b + 1] - k0;
  tl.row0 = int(blockIdx.x) * kRows;
  tl.shift = tl.len_k - tl.len_q;
  if (tl.row0 >= tl.len_q) return;  // every thread alike: no barrier is used yet
  const int limit = causal ? min(tl.len_k, tl.row0 + kRows + tl.shift) : tl.len_k;
  tl.tiles = limit > 0 ? (limit + kKeys - 1) / kKeys : 0;
  const unsigned base = sa(smem), q = base + (1024u - base % 1024u) % 1024u, ring = q + 2 * kTile;
  const unsigned q_full = sa(bars), full = q_full + 8, empty = full + 8 * kStages;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(q_full));
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(full + 8 * s));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 2;" :: "r"(empty + 8 * s));  // one per consumer
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int hk = h / (num_heads / num_kv_heads);
  if (threadIdx.x < 128) {  // the producer: one thread issues every copy
    if (threadIdx.x != 0) return;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(q_full), "r"(2 * kTile));
    for (int c = 0; c < 2; ++c)  // each consumer's 64 rows: [2 panels][64 rows][128 bytes]
      for (int p = 0; p < 2; ++p) load(q + c * kTile + p * kPanel, &map_q, 64 * p, h, q0 + tl.row0 + 64 * c, q_full);
    for (int t = 0; t < tl.tiles; ++t) {
      const unsigned s = unsigned(t % kStages), k = ring + 2 * kTile * s, bar = full + 8 * s;
      wait_parity(empty + 8 * s, ((t / kStages) & 1) ^ 1);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(2 * kTile));
      for (int p = 0; p < 2; ++p) {
        load(k + p * kPanel, &map_k, 64 * p, hk, k0 + t * kKeys, bar);
        load(k + kTile + p * kPanel, &map_v, 64 * p, hk, k0 + t * kKeys, bar);
      }
    }
    return;
  }
  const int consumer = int(threadIdx.x) / 128 - 1;
  tl.row0 += 64 * consumer;
  float o[64], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  wait_parity(q_full, 0);
  for (int t = 0; t < tl.tiles; ++t) {
    const unsigned s = unsigned(t % kStages), k = ring + 2 * kTile * s;
    wait_parity(full + 8 * s, (t / kStages) & 1);
    step(tl, t, q + consumer * kTile, k, k + kTile, scale * 1.4426950408889634f, causal, o, m, l);
    if (threadIdx.x % 128 == 0)
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(empty + 8 * s) : "memory");
  }
  const int tid = int(threadIdx.x) % 128, quad = tid % 4, total = cu_seqlens_q[gridDim.z];
  for (int half = 0; half < 2; ++half) {
    const int r = tl.row0 + 16 * (tid / 32) + tid % 32 / 4 + 8 * half;
    const float sum = quad_sum(l[half]);
    if (r >= tl.len_q) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    __nv_bfloat16* dst = out + ((long long)(q0 + r) * num_heads + h) * 128;
    for (int j = 0; j < 16; ++j)  // registers 4j + 2 half + e: row r, column 8j + 2 quad + e
      for (int e = 0; e < 2; ++e) dst[8 * j + 2 * quad + e] = __float2bfloat16(o[4 * j + 2 * half + e] * inv);
    if (quad == 0)
      lse[(long long)h * total + q0 + r] = sum > 0.0f ? (m[half] + log2f(sum)) * 0.6931471805599453f : neg_inf();
  }
}
