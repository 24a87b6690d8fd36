// attention/prefill_sm90.cuh: paged_prefill_sm90_kernel<T, KV, HD, VHD>, FlashAttention-3's structure for Hopper
// (sm_90a): the query runs paged_prefill_kernel takes on other GPUs, with the same parameters, the same rows and
// the same results (docs/hopper-prefill.md).
//
// A CTA takes S::ROWS = 128 query rows ((token, head) pairs of one GQA group, token-major, as paged_prefill_kernel's)
// and is three warpgroups:
//   warpgroup 0, the producer (setmaxnreg.dec): its 128 threads bring each tile of S::TILE keys (the CTA's visible
//     keys lo..hi, zero-filled past hi) into a ring of S::STAGES stages, K and V in q's type and the wgmma layout
//     (128-byte swizzled panels, wgmma.cuh): 16-bit rows by cp.async through kv_issue (kv_pipeline.cuh: a key's row
//     offset placed once a tile, whatever the layout: paged NHD / HND or dense rows), fp8 codes and unaligned rows
//     through registers (hp_issue_regs: converted to q's type on the way, exact). Each thread's copies of a tile
//     land, then it fences them into the async proxy and arrives on the stage's `full` mbarrier;
//   warpgroups 1 and 2, the consumers (setmaxnreg.inc), 64 rows each, read every stage: S = Q K^T by HD / 16
//     wgmma m64n64k16 from shared memory, the online softmax of paged_prefill_kernel on the accumulators (pf_softmax:
//     the logit step of logits.cuh, masks only on tiles not wholly visible to a warp's rows), P rounded to q's type
//     straight into A fragments, O += P V by wgmma m64nVHDk16 (V MN-major), then lane 0 of each warp arrives on the
//     stage's `empty` mbarrier. A warpgroup skips the tiles none of its rows sees (it still releases them).
// Every key a stage holds is visible to some row of the CTA or zero-filled past the last, so a masked row's 0
// weight only ever meets real values (masking by selection). The row tiles of a CTA run heaviest first; the ring
// runs on across them. Split partials, sinks, the LSE: pf_store, as paged_prefill_kernel's.
//
// Used by:   paged_attention_sm90.cu
// Test:      pytest tests/test_paged_attention_sm90.py
// Benchmark: python profiling/bench_paged_attention.py --model --arch sm_90
#pragma once
#include "../wgmma.cuh"
#include "prefill.cuh"

namespace cupaged {

constexpr int HP_THREADS = 384;              // the producer warpgroup and two consumer warpgroups
constexpr int HP_ROWS = 128;                 // query rows a CTA: 64 a consumer warpgroup
constexpr int HP_PRODUCER_REGISTERS = 80;    // setmaxnreg: 128 x 80 + 256 x 216 = SM_REGISTERS
constexpr int HP_CONSUMER_REGISTERS = 216;
constexpr int HP_SMEM_LIMIT = 232448;        // sm_90's dynamic shared memory a block (227 KB), static included
constexpr int HP_FIXED = 9216;               // of which the alignment slack (1 KB), the mbarriers and the rows

template <class CacheT, int HD, int VHD>
struct HpSmem {
  static constexpr int ROWS = HP_ROWS, TILE = 64, PANEL = TILE * 128;  // a panel: 64 rows (keys) of 64 columns
  static constexpr int K_DIMS = HD, V_DIMS = VHD, KP = HD / 64, VP = VHD / 64;
  static constexpr int STAGE = (KP + VP) * PANEL;  // a tile's K panels, then its V panels, in q's type
  static constexpr int Q = 2 * KP * PANEL;         // each consumer's 64 q rows
  static constexpr int FIT = (HP_SMEM_LIMIT - HP_FIXED - Q) / STAGE;
  static constexpr int STAGES = FIT < 4 ? FIT : 4;
  static constexpr int BARS = Q + STAGES * STAGE, ROW_AT = BARS + 64;  // full[s], empty[s]; then the PaRows
  static_assert(1024 + 64 + ROWS * sizeof(PaRow) <= HP_FIXED, "the mbarriers and rows fit their allowance");
  // all dynamic (no static __shared__): the sim's shared window stays within the 256 KB a descriptor addresses
  static constexpr int BYTES = HP_FIXED + Q + STAGES * STAGE;
  static __device__ __forceinline__ int k_at(int j, int c) { return wg_at<PANEL>(j, c); }
  static __device__ __forceinline__ int v_at(int j, int c) { return KP * PANEL + wg_at<PANEL>(j, c); }
};

// Elements 8 c .. 8 c + 7 of a row (element d at src + (d / X) cs + (d % X) es, X = 16 / sizeof(CacheT)) in q's type,
// zero past `dims` or when not `live`: one 8- or 16-byte load when `vec`, else element by element.
template <int KV, class T, class CacheT>
__device__ __forceinline__ uint4 hp_chunk(const CacheT* src, int c, long long cs, long long es, int dims, bool vec,
                                          bool live) {
  constexpr int X = 16 / int(sizeof(CacheT));
  if (!live || 8 * c >= dims) return make_uint4(0u, 0u, 0u, 0u);
  const CacheT* from = src + (8 * c / X) * cs + (8 * c % X) * es;
  if constexpr (sizeof(CacheT) == 1) {
    uint2 codes = make_uint2(0u, 0u);
    if (vec && 8 * c + 8 <= dims) {
      codes = *reinterpret_cast<const uint2*>(from);
    } else {
      for (int e = 0; e < 8 && 8 * c + e < dims; ++e)
        (e < 4 ? codes.x : codes.y) |= unsigned(from[e * es]) << 8 * (e % 4);
    }
    return make_uint4(tc_fp8x2<KV, T>(codes.x), tc_fp8x2<KV, T>(codes.x >> 16), tc_fp8x2<KV, T>(codes.y),
                      tc_fp8x2<KV, T>(codes.y >> 16));
  } else {
    unsigned w[4];
    for (int k = 0; k < 4; ++k) {
      const int d = 8 * c + 2 * k;
      w[k] = tc_pack<T>(d < dims ? from[2 * k * es] : CacheT(), d + 1 < dims ? from[(2 * k + 1) * es] : CacheT());
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// A thread's key j of a tile starting at `base` (past hi: none) into a stage, its chunks (8 elements) of parity h: a
// warp takes 16 keys, two threads a key, so each copy instruction reads whole 32-byte sectors; a quarter warp (the
// 8 16-byte accesses of one shared-memory wavefront) takes keys 2 apart, whose chunks 2 i + h land in 8 different
// 16-byte bank groups of the swizzled rows (2 i ^ h ^ j % 8): no bank conflicts. 16-bit rows: one cp.async a chunk (`async`: rows 16-byte aligned), zero-filled past
// the head size and the last key; fp8 codes and unaligned rows through registers, converted to q's type (exact).
template <int KV, class T, class CacheT, class S>
__device__ __forceinline__ void hp_issue(unsigned char* stage, const CacheT* key_cache, const CacheT* value_cache,
                                         const int* table, long long key_row0, int base, int hi, int kv_head,
                                         bool async, const PaParams& p) {
  constexpr int X = 16 / int(sizeof(CacheT));
  const int lane = threadIdx.x % 32, quarter = lane / 8, h = lane % 2;
  const int j = 16 * int(threadIdx.x / 32) + 8 * (quarter / 2) + quarter % 2 + 2 * (lane % 8 / 2), pos = base + j;
  const bool live = pos <= hi;
  long long row = key_row0 + pos, kb = 0, vb = 0;
  if (table && live) {
    const int b = kv_block_of(pos, p), block = table[b];
    row = pos - b * p.block_size;
    kb = block * p.k_block_stride;
    vb = block * p.v_block_stride;
  }
  const CacheT* kr = key_cache + kv_head * p.k_head_stride + (live ? kb + row * p.k_page_stride : 0);
  const CacheT* vr = value_cache + kv_head * p.v_head_stride + (live ? vb + row * p.v_page_stride : 0);
  if (async) {  // chunk c = 2 i + h: trip counts known at compile time, so every loop unrolls whole
#pragma unroll
    for (int i = 0; i < S::K_DIMS / 16; ++i)
      kv_copy16(stage + S::k_at(j, 2 * i + h), kr + (2 * i + h) * p.k_chunk_stride,
                !live || 16 * i + 8 * h >= p.head_size);
#pragma unroll
    for (int i = 0; i < S::V_DIMS / 16; ++i)
      kv_copy16(stage + S::v_at(j, 2 * i + h), vr + 16 * i + 8 * h, !live || 16 * i + 8 * h >= p.v_head_size);
    return;
  }
#pragma unroll 2
  for (int i = 0; i < S::K_DIMS / 16; ++i)
    *reinterpret_cast<uint4*>(stage + S::k_at(j, 2 * i + h)) =
        hp_chunk<KV, T>(kr, 2 * i + h, p.k_chunk_stride, 1, p.head_size, p.vec_k, live);
#pragma unroll 2
  for (int i = 0; i < S::V_DIMS / 16; ++i)
    *reinterpret_cast<uint4*>(stage + S::v_at(j, 2 * i + h)) =
        hp_chunk<KV, T>(vr, 2 * i + h, X * p.v_dim_stride, p.v_dim_stride, p.v_head_size, p.vec_v, live);
}

// The producer's part of one row tile: its keys lo..hi in tiles of S::TILE through the ring; n counts the CTA's
// tiles so far (stage n % STAGES, phase n / STAGES). cp.async tiles are published a tile late (their copies wait
// for one more group), register tiles at once.
template <int KV, class T, class CacheT, class S>
__device__ __forceinline__ void hp_produce(unsigned char* ring, unsigned full, unsigned empty, const int* table,
                                           long long key_row0, int lo, int hi, int& n, const CacheT* key_cache,
                                           const CacheT* value_cache, int kv_head, const PaParams& p) {
  const bool async = sizeof(CacheT) == 2 && p.vec_k && p.vec_v;
  const int ntiles = hi >= lo ? (hi - lo) / S::TILE + 1 : 0;
  for (int u = 0; u < ntiles; ++u, ++n) {
    const int s = n % S::STAGES;
    wg_mbar_wait(empty + 8 * s, ((n / S::STAGES) & 1) ^ 1);  // the consumers are done with the stage's last tile
    hp_issue<KV, T, CacheT, S>(ring + s * S::STAGE, key_cache, value_cache, table, key_row0,
                               lo + u * S::TILE, hi, kv_head, async, p);
    if (async) {
      asm volatile("cp.async.commit_group;" ::: "memory");
      if (u == 0) continue;
      asm volatile("cp.async.wait_group 1;" ::: "memory");  // the previous tile's copies landed
    }
    wg_fence_proxy();
    wg_mbar_arrive(full + 8 * ((async ? n - 1 : n) % S::STAGES));
  }
  if (async && ntiles > 0) {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    wg_fence_proxy();
    wg_mbar_arrive(full + 8 * ((n - 1) % S::STAGES));
  }
}

// A consumer warpgroup's 64 q rows (rows: its own) into its panels, zero past its nrows.
template <class T, class S>
__device__ __forceinline__ void hp_load_q(unsigned char* qs, const T* q, const PaRow* rows, int nrows,
                                          const PaParams& p) {
  for (int i = threadIdx.x % 128; i < 64 * S::K_DIMS / 8; i += 128) {
    const int r = i / (S::K_DIMS / 8), c = i % (S::K_DIMS / 8);
    *reinterpret_cast<uint4*>(qs + wg_at<S::PANEL>(r, c)) =
        r < nrows ? pf_q_chunk(q, rows[r], c, p) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// One tile of a consumer warpgroup: S = Q K^T, the online softmax of the thread's rows g, g + 8 (wr: its warp's
// rows from g), O += P V. q, k, v: the shared addresses of the warpgroup's q panels and the stage's K and V panels.
template <class T, class S>
__device__ __forceinline__ void hp_step(float (&o)[1][S::V_DIMS / 8][4], float (&m)[1][2], float (&l)[1][2],
                                        unsigned q, unsigned k, unsigned v, const PaRow* wr, int key0, bool masked,
                                        bool biased, float qscale, float qscale2, float softcap,
                                        const unsigned char* custom_mask) {
  float s[S::TILE / 8][4];
#pragma unroll
  for (int n = 0; n < S::TILE / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
  const unsigned dq = wg_desc_lo_k(q), dk = wg_desc_lo_k(k), dv = wg_desc_lo_mn(v, S::PANEL);
  wg_fence();
#pragma unroll
  for (int j = 0; j < S::K_DIMS / 16; ++j) {
    const unsigned at = ((j / 4) * S::PANEL + 32 * (j % 4)) >> 4;  // k-slice j, in the descriptors' 16-byte units
    wg_ss64<T>(s, wg_desc(dq + at), wg_desc(dk + at));
  }
  wg_commit();
  wg_wait<0>();
  const float a0 = pf_softmax(s, 0, m[0][0], l[0][0], wr[0], key0, masked, biased, qscale, qscale2, softcap,
                              custom_mask);
  const float a1 = pf_softmax(s, 1, m[0][1], l[0][1], wr[8], key0, masked, biased, qscale, qscale2, softcap,
                              custom_mask);
  if (__any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f))  // once a row's max settles, o needs no rescale
#pragma unroll
    for (int n = 0; n < S::V_DIMS / 8; ++n) {
      o[0][n][0] *= a0; o[0][n][1] *= a0; o[0][n][2] *= a1; o[0][n][3] *= a1;
    }
  unsigned a[S::TILE / 16][4];  // every fragment of P first: a wgmma in flight still reads its A registers
#pragma unroll
  for (int j = 0; j < S::TILE / 16; ++j) {
    a[j][0] = tc_pack<T>(from_float<T>(s[2 * j][0]), from_float<T>(s[2 * j][1]));
    a[j][1] = tc_pack<T>(from_float<T>(s[2 * j][2]), from_float<T>(s[2 * j][3]));
    a[j][2] = tc_pack<T>(from_float<T>(s[2 * j + 1][0]), from_float<T>(s[2 * j + 1][1]));
    a[j][3] = tc_pack<T>(from_float<T>(s[2 * j + 1][2]), from_float<T>(s[2 * j + 1][3]));
  }
  wg_fence();
#pragma unroll
  for (int j = 0; j < S::TILE / 16; ++j) wg_rs<T, S::V_DIMS>(o[0], a[j], wg_desc(dv + (2048u >> 4) * j));
  wg_commit();
  wg_wait<0>();
}

// A consumer warpgroup's part of one row tile (its 64 rows from row0 + 64 c; `rows` the CTA's): its rows and q
// panels, every tile of the CTA's keys lo..hi from the ring (n counts the CTA's tiles, as the producer's), its
// rows' results (pf_store).
template <class T, class S>
__device__ __forceinline__ void hp_consume(unsigned char* smem, PaRow* rows, unsigned full, unsigned empty, int row0,
                                           int nrows, int lo, int hi, int& n, int group, int kv_head, int split,
                                           const PaSeq& sq, const T* q, const float* sinks, const float* alibi_slopes,
                                           const unsigned char* custom_mask, float qscale, float oscale, T* out,
                                           float* lse, float* max_logits, float* exp_sums, void* tmp_output,
                                           const PaParams& p) {
  // the warpgroup, through a shuffle so that ptxas knows it warp-uniform: the descriptors built from it stay in
  // uniform registers (no R2UR a wgmma)
  const int c = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0) - 1;
  const int tid = threadIdx.x % 128, warp = threadIdx.x / 32 - 4, lane = threadIdx.x % 32;
  const int first = 64 * c, mine = min(max(nrows - first, 0), 64);
  wg_sync(2 + c, 128);  // the warpgroup's last row tile is done with its rows and q panels
  if (tid < 64) {
    PaRow row = pa_row(first + tid, row0, nrows, group, kv_head, sq, sinks, alibi_slopes, p);
    row.full = pa_mask_full(custom_mask, row, sq.seq_len);
    rows[first + tid] = row;
  }
  wg_sync(2 + c, 128);
  unsigned char* qs = smem + c * S::KP * S::PANEL;
  hp_load_q<T, S>(qs, q, rows + first, mine, p);
  wg_fence_proxy();
  wg_sync(2 + c, 128);  // the q panels are in, for the async proxy
  // keys no row of the warp masks (all_lo..all_hi), and the warpgroup's (wlo..whi: rows' ranges grow with the row)
  const int r = 16 * warp + (lane & 15);
  const bool real = lane < 16 && r < nrows;
  const int all_lo = __reduce_max_sync(0xffffffffu, real ? rows[r].lo : 0);
  const int all_hi = __reduce_min_sync(0xffffffffu, real ? min(rows[r].hi, rows[r].full - 1) : 0x7fffffff);
  const int wlo = mine ? rows[first].lo : 0x7fffffff, whi = mine ? rows[first + mine - 1].hi : -1;
  const float qscale2 = qscale * PA_LOG2E;
  const bool biased = pa_biased(p.softcap, alibi_slopes, qscale2);
  float o[1][S::V_DIMS / 8][4], m[1][2] = {{neg_inf(), neg_inf()}}, l[1][2] = {{0.0f, 0.0f}};
#pragma unroll
  for (int i = 0; i < S::V_DIMS / 8; ++i) o[0][i][0] = o[0][i][1] = o[0][i][2] = o[0][i][3] = 0.0f;
  const int ntiles = hi >= lo ? (hi - lo) / S::TILE + 1 : 0;
  const unsigned ring = tc_smem(smem + S::Q);
  for (int u = 0; u < ntiles; ++u, ++n) {
    const int s = n % S::STAGES, base = lo + u * S::TILE;
    wg_mbar_wait(full + 8 * s, (n / S::STAGES) & 1);
    if (base <= whi && base + S::TILE - 1 >= wlo) {  // warpgroup-uniform: some row of the warpgroup sees a key
      const unsigned k = ring + s * S::STAGE;
      hp_step<T, S>(o, m, l, tc_smem(qs), k, k + S::KP * S::PANEL, rows + 16 * warp + lane / 4, base + 2 * (lane & 3),
                    base < all_lo || base + S::TILE - 1 > all_hi, biased, qscale, qscale2, p.softcap, custom_mask);
    }
    if (lane == 0) wg_mbar_arrive(empty + 8 * s);
  }
  pf_store<T, S::V_DIMS, 1>(o, m, l, rows, nrows, warp, split, sq.splits.count, sq.seq_len, oscale, out, lse,
                            max_logits, exp_sums, tmp_output, p);
}

template <class T, int KV, int HD, int VHD>
__global__ void __launch_bounds__(HP_THREADS, 1) paged_prefill_sm90_kernel(
    const T* __restrict__ q,                 // [num_tokens, num_heads, head_size]
    const typename CacheType<KV, T>::type* __restrict__ key_cache,    // flash NHD / HND, or dense rows
    const typename CacheType<KV, T>::type* __restrict__ value_cache,  // (v_dim_stride == 1)
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
    const int* __restrict__ seqused_k, const unsigned char* __restrict__ custom_mask,
    const int* __restrict__ mask_indptr, const float* __restrict__ sinks, const float* __restrict__ alibi_slopes,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    void* __restrict__ tmp_output, PaParams p) {  // as paged_prefill_kernel's
  typedef typename CacheType<KV, T>::type CacheT;
  typedef HpSmem<CacheT, HD, VHD> S;
  extern __shared__ __align__(128) unsigned char hp_smem[];
  const int kv_head = blockIdx.y, seq = blockIdx.z, split = blockIdx.x / p.tiles;
  const PaSeq sq = pa_seq(seq, split, block_tables, seq_lens, query_start_loc, seqused_k, mask_indptr, p);
  if (!pf_active(sq, split, exp_sums, p)) return;
  const int group = p.num_heads / p.num_kv_heads, all_rows = sq.q_len * group;
  unsigned char* smem = hp_smem + (1024u - tc_smem(hp_smem) % 1024u) % 1024u;  // 1024-byte aligned panels
  PaRow* rows = reinterpret_cast<PaRow*>(smem + S::ROW_AT);
  const unsigned full = tc_smem(smem + S::BARS), empty = full + 8 * S::STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::STAGES; ++s) {
      wg_mbar_init(full + 8 * s, 128);  // every producer thread, once its copies landed
      wg_mbar_init(empty + 8 * s, 8);   // every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const float qscale = p.scale * pa_cache_scale<KV>(k_scale, p.k_scale_value, kv_head, p);
  const int* table = block_tables ? block_tables + seq * p.table_stride : nullptr;
  const int ntiles = (all_rows + S::ROWS - 1) / S::ROWS;
  auto keys = [&](int row0, int nrows) {  // the CTA's: the first row's lo to the last row's hi (both grow with the row)
    return PaRange{pa_row(0, row0, nrows, group, kv_head, sq, sinks, alibi_slopes, p).lo,
                   pa_row(nrows - 1, row0, nrows, group, kv_head, sq, sinks, alibi_slopes, p).hi};
  };
  int n = 0;  // the CTA's key tiles so far: both roles count them alike
  // row tiles p.tiles apart (rows past the hint too), heaviest first; each role apart, after its setmaxnreg
  if (threadIdx.x < 128) {
    wg_registers_dec<HP_PRODUCER_REGISTERS>();
    for (int it = blockIdx.x % p.tiles; it < ntiles; it += p.tiles) {
      const int row0 = (ntiles - 1 - it) * S::ROWS;
      const PaRange k = keys(row0, min(S::ROWS, all_rows - row0));
      hp_produce<KV, T, CacheT, S>(smem + S::Q, full, empty, table, sq.key_row0, k.lo, k.hi, n, key_cache,
                                   value_cache, kv_head, p);
    }
    return;
  }
  wg_registers_inc<HP_CONSUMER_REGISTERS>();
  const float oscale = pa_cache_scale<KV>(v_scale, p.v_scale_value, kv_head, p);
  for (int it = blockIdx.x % p.tiles; it < ntiles; it += p.tiles) {
    const int row0 = (ntiles - 1 - it) * S::ROWS, nrows = min(S::ROWS, all_rows - row0);
    const PaRange k = keys(row0, nrows);
    hp_consume<T, S>(smem, rows, full, empty, row0, nrows, k.lo, k.hi, n, group, kv_head, split, sq, q, sinks,
                     alibi_slopes, custom_mask, qscale, oscale, out, lse, max_logits, exp_sums, tmp_output, p);
  }
}

}  // namespace cupaged
