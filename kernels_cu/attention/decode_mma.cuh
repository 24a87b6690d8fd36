// attention/decode_mma.cuh: paged_decode_mma_kernel<T, KV, HD, VT, TREE>, decode on tensor cores for tiles of 8 query
// rows: 16-bit q, head sizes up to 128, every group and layout (VT: vLLM's V^T tiles are the A operand as they
// lie). The plan sends float32 and head size 256 to paged_decode_kernel: a choice from the model's shape and cache,
// never the batch's, so a sequence takes the same kernel in every batch.
//
// The GEMMs are transposed so the 8 rows are the n8 side of mma.sync m16n8k16 and 16 keys its m side: warp w
// takes keys 16 w .. 16 w + 15 of every 64-key stage, with its own online softmax:
//   S^T = K Q^T: A = K rows by ldmatrix (fp8: 4 codes a lane converted in registers, q's columns permuted to
//     match), B = Q^T by ldmatrix from the shared q tile (no register held across the tiles);
//   O^T += V^T P^T: A = V rows by ldmatrix.trans (fp8: byte pairs of two keys regrouped) or, for vLLM's values,
//     the V^T tile by plain ldmatrix (fp8: 4 keys' codes a lane, P^T's keys permuted to match); B = P^T, which
//     a lane gets from the S^T fragments through a per-warp shared array (a transposition), split in registers
//     into 16-bit parts (fp16 and fp8 caches: 2 half parts, bf16: 3) so P V keeps fp32-P accuracy; O^T is
//     HD / 4 fp32 a lane.
// A lane's S^T and O^T fragments hold the same two rows (2t, 2t + 1): the softmax needs no shuffle beyond each
// row's max over the 8 lanes of its keys. Every key a stage holds is visible to some row of the tile (or, for
// V^T, a key of the same block before the first: real data) or zero-filled past the last, so a row's 0 weight
// only ever meets real values. The warps' states merge as paged_decode_kernel's do (pd_store).
//
// Used by:   paged_attention.cu
// Test:      pytest tests/test_paged_attention.py tests/test_decode_accuracy.py tests/test_decode_traffic.py
//            tests/test_paged_attention_vllm.py
// Benchmark: python profiling/bench_paged_attention.py
#pragma once
#include "../common.cuh"
#include "../tensor_core.cuh"
#include "decode.cuh"
#include "kv_pipeline.cuh"
#include "logits.cuh"
#include "params.cuh"

namespace cupaged {

constexpr int PM_TILE = 64;  // keys per stage: 16 per warp, the m16 side of the mma
constexpr int PM_ROWS = 8;   // query rows per CTA: the n8 side

template <class CacheT, int HD, bool V_TRANSPOSED>
struct PmSmem {
  static constexpr int TILE = PM_TILE, PITCH = HD * int(sizeof(CacheT)) + 16;  // +16 bytes: ldmatrix conflict-free
  static constexpr bool VT = V_TRANSPOSED;
  static constexpr int VT_PITCH = !VT ? 0 : sizeof(CacheT) == 1 ? TILE : TILE * 2 + 16;  // V^T rows (kv_vt_col)
  static constexpr int K_DIMS = HD, V_DIMS = HD;
  static constexpr bool PREFETCH = true;
  static constexpr int STAGE = TILE * PITCH + (VT ? HD * VT_PITCH : TILE * PITCH);
  static constexpr int STAGES = 3 * STAGE <= PM_SMEM_FOR_3 ? 3 : 2;
  static constexpr int MERGE = (4 * PM_ROWS * (HD + 2) + PM_ROWS * (HD + 3)) * 4;  // pd_store's, pd_prior's
  static constexpr int BYTES = STAGES * STAGE > MERGE ? STAGES * STAGE : MERGE;
  static __device__ __forceinline__ int k_at(int j, int c) { return j * PITCH + c * 16; }  // kv_issue's placement
  static __device__ __forceinline__ int v_at(int j, int c) { return (TILE + j) * PITCH + c * 16; }
  static __device__ __forceinline__ int vt_at(int run, int dim) {
    return TILE * PITCH + dim * VT_PITCH + kv_vt_col<16 / int(sizeof(CacheT))>(run, dim);
  }
};

// The dimension of q held in column k of the shared q tile: 16-bit caches in order; an fp8 ldmatrix row gives a
// lane 4 consecutive codes, dims 4t .. 4t + 3, used as k 2t, 2t + 1, 2t + 8, 2t + 9 of a k16 step, so q's columns
// are permuted the same way (pi(k) = 4 ((k & 7) >> 1) + (k & 1) + 2 (k >> 3) within each 16).
template <int KV>
__device__ __forceinline__ int pm_qdim(int k) {
  return KV == KV_AUTO ? k : (k & ~15) + 4 * ((k & 7) >> 1) + (k & 1) + 2 * (k >> 3 & 1);
}

// The dimension of O^T row g (+ 8 h) of m tile mt: fp8 V rows' fragments pair dims 2g, 2g + 1 of one ldmatrix row.
template <int KV, bool VT>
__device__ __forceinline__ int pm_odim(int mt, int g, int h) {
  return 16 * mt + (KV == KV_AUTO || VT ? g + 8 * h : 2 * g + h);
}

// The key (of the warp's 16) of element i of a lane's P^T B fragment (k 2t, 2t + 1, 2t + 8, 2t + 9): fp8 V^T rows
// give a lane 4 consecutive keys' codes, 4t .. 4t + 3, used as those four k.
template <int KV, bool VT>
__device__ __forceinline__ int pm_pkey(int t, int i) {
  return KV != KV_AUTO && VT ? 4 * t + i : 2 * t + (i & 1) + 8 * (i >> 1);
}

// S^T (16 keys x 8 rows) of the warp's keys, whose K rows start at kt; Q^T's B fragments by ldmatrix from the q
// tile qs ([8 rows][HD + 8], columns pm_qdim), two k16 steps a load, so q holds no register across the tiles.
template <class T, int KV, int HD, int PITCH>
__device__ __forceinline__ void pm_scores(float (&s)[4], const unsigned char* kt, const T* qs, int lane) {
  const unsigned char* at = kt + (lane & 15) * PITCH + (lane >> 4) * 16;  // key l % 16, bytes 16 (l / 16) ..
  const T* qat = qs + (lane & 7) * (HD + 8) + (lane >> 3) * 8;              // row l % 8, columns 8 (l / 8) ..
#pragma unroll
  for (int kp = 0; kp < HD / 32; ++kp) {  // k16 steps 2 kp, 2 kp + 1
    unsigned b[4], r[4];
    tc_ldmatrix_x4(b, qat + 32 * kp);
    if constexpr (KV == KV_AUTO) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tc_ldmatrix_x4(r, at + 64 * kp + 32 * h);
        tc_mma<T>(s, r, b[2 * h], b[2 * h + 1]);
      }
    } else {  // 32 codes a row: both steps from one load
      tc_ldmatrix_x4(r, at + 32 * kp);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned a[4] = {tc_fp8x2<KV, T>(r[2 * h]), tc_fp8x2<KV, T>(r[2 * h + 1]),
                               tc_fp8x2<KV, T>(r[2 * h] >> 16), tc_fp8x2<KV, T>(r[2 * h + 1] >> 16)};
        tc_mma<T>(s, a, b[2 * h], b[2 * h + 1]);
      }
    }
  }
}

// O^T += V^T P^T over warp `warp`'s 16 keys (its V rows from vt, or V^T at vt), one mma per part of P, the
// smallest first. PV: the product's 16-bit type, q's for 16-bit caches; __half for fp8 ones (every fp8 value is a
// half, and P in two half parts keeps fp32-P accuracy as in fp16 decode: fewer conversions and mmas than three
// bf16 parts).
template <int KV, class T> struct PmPv { typedef __half type; };
template <class T> struct PmPv<KV_AUTO, T> { typedef T type; };

template <class PV, int KV, int HD, int PITCH, int VT_PITCH, int PARTS>
__device__ __forceinline__ void pm_values(float (&o)[HD / 16][4], const unsigned char* vt,
                                          const unsigned (&pf)[PARTS][2], int warp, int lane) {
  if constexpr (VT_PITCH > 0 && KV == KV_AUTO) {  // V^T rows (dims) are A rows: ldmatrix, dim l % 16, keys 8 (l / 16)
    const unsigned char* at = vt + (lane & 15) * VT_PITCH + 32 * warp + (lane >> 4) * 16;
#pragma unroll
    for (int mt = 0; mt < HD / 16; ++mt) {
      unsigned a[4];
      tc_ldmatrix_x4(a, at + 16 * mt * VT_PITCH);
#pragma unroll
      for (int k = PARTS - 1; k >= 0; --k) tc_mma<PV>(o[mt], a, pf[k][0], pf[k][1]);
    }
  } else if constexpr (VT_PITCH > 0) {  // fp8 V^T: dim l of 32, the warp's run; keys 4t .. 4t + 3 a lane (pm_pkey)
#pragma unroll
    for (int mp = 0; mp < HD / 32; ++mp) {
      unsigned r[4];
      tc_ldmatrix_x4(r, vt + (32 * mp + lane) * VT_PITCH + kv_vt_col<16>(warp, lane));  // (32 mp + l) / 2: l / 2
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned a[4] = {tc_fp8x2<KV, PV>(r[2 * h]), tc_fp8x2<KV, PV>(r[2 * h + 1]),
                               tc_fp8x2<KV, PV>(r[2 * h] >> 16), tc_fp8x2<KV, PV>(r[2 * h + 1] >> 16)};
#pragma unroll
        for (int k = PARTS - 1; k >= 0; --k) tc_mma<PV>(o[2 * mp + h], a, pf[k][0], pf[k][1]);
      }
    }
  } else if constexpr (KV == KV_AUTO) {  // .trans of key rows (l & 7) + 8 (l >> 4), dims 8 (l >> 3 & 1) ..: a0 .. a3
    const unsigned char* at = vt + ((lane & 7) + 8 * (lane >> 4)) * PITCH + (lane >> 3 & 1) * 16;
#pragma unroll
    for (int mt = 0; mt < HD / 16; ++mt) {
      unsigned a[4];
      tc_ldmatrix_x4_trans(a, at + 32 * mt);
#pragma unroll
      for (int k = PARTS - 1; k >= 0; --k) tc_mma<PV>(o[mt], a, pf[k][0], pf[k][1]);
    }
  } else {  // .trans of byte pairs: keys 2t, 2t + 1 of dims 2g, 2g + 1, regrouped into one pair a dimension
    const unsigned char* at = vt + ((lane & 7) + 8 * (lane >> 3 & 1)) * PITCH + (lane >> 4) * 16;
#pragma unroll
    for (int mp = 0; mp < HD / 32; ++mp) {
      unsigned r[4];
      tc_ldmatrix_x4_trans(r, at + 32 * mp);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned x = r[2 * h], y = r[2 * h + 1];  // keys 0-7, keys 8-15
        const unsigned a[4] = {tc_fp8x2<KV, PV>((x & 0xffu) | (x >> 8 & 0xff00u)),
                               tc_fp8x2<KV, PV>((x >> 8 & 0xffu) | (x >> 16 & 0xff00u)),
                               tc_fp8x2<KV, PV>((y & 0xffu) | (y >> 8 & 0xff00u)),
                               tc_fp8x2<KV, PV>((y >> 8 & 0xffu) | (y >> 16 & 0xff00u))};
#pragma unroll
        for (int k = PARTS - 1; k >= 0; --k) tc_mma<PV>(o[2 * mp + h], a, pf[k][0], pf[k][1]);
      }
    }
  }
}

// Row 2t + e of the warp's S^T fragment (keys key0, key0 + 8 of this lane): the logit step in base 2 (logits.cuh;
// q . k scaled once by qscale2 without softcap and ALiBi, `biased` false), the row's visible range on the tiles
// that need it (`masked`), then the online-softmax step over the warp's 16 keys: the scores become P (0 where
// masked: selection), (m, l) move on (l over this lane's keys) and the factor that rescales o is returned.
__device__ __forceinline__ float pm_softmax(float (&s)[4], int e, float& m, float& l, const PaRow& row, int key0,
                                            bool masked, bool biased, float qscale, float qscale2, float softcap,
                                            const unsigned char* custom_mask) {
  float x[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + 8 * h;
    x[h] = biased ? pa_logit(s[2 * h + e], qscale, softcap, row.slope, key, row.pos) : s[2 * h + e];
    if (masked && !pa_row_sees(row, key, custom_mask)) x[h] = neg_inf();  // masking by selection
  }
  float mx = fmaxf(x[0], x[1]);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const float factor = biased ? 1.0f : qscale2;
  const float alpha = pa_rescale(m, mx * factor), pivot = pa_pivot(m);
#pragma unroll
  for (int h = 0; h < 2; ++h) s[2 * h + e] = pa_exp2(fmaf(x[h], factor, -pivot));
  l = l * alpha + s[e] + s[2 + e];
  return alpha;
}

// The per-warp P^T array: key k's 8 rows at (k + k / 4) * 8, so the fragments' float2 writes (key g, rows 2t ..)
// and scalar reads (keys 2t .., row g) are both conflict-free.
__device__ __forceinline__ int pm_at(int key) { return (key + (key >> 2)) * 8; }

// The end of a paged_decode_mma_kernel row tile: each row's sum over the lanes of its keys, then the warp's
// (m, l, o with the V scale) of its 8 rows into shared memory in pd_store's layout.
template <int KV, bool VT, int HD>
__device__ __forceinline__ void pm_finish(unsigned char* smem, const float (&o)[HD / 16][4], const float (&m)[2],
                                          float (&l)[2], float oscale) {
  const int warp = threadIdx.x / 32, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l[e] += __shfl_xor_sync(0xffffffffu, l[e], off);
  float* wm = reinterpret_cast<float*>(smem);
  float* wo = wm + 8 * PM_ROWS;
  __syncthreads();  // every warp is done with the last stage: its bytes become the merge area
#pragma unroll
  for (int mt = 0; mt < HD / 16; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i)  // c0, c1: rows 2t, 2t + 1 of one dimension; c2, c3: of the other
      wo[(warp * PM_ROWS + 2 * t + (i & 1)) * HD + pm_odim<KV, VT>(mt, g, i >> 1)] = o[mt][i] * oscale;
  if (g == 0)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      wm[warp * PM_ROWS + 2 * t + e] = pa_natural(m[e]);
      wm[(4 + warp) * PM_ROWS + 2 * t + e] = l[e];
    }
}

// TREE: the instantiation a launch with a custom mask takes
template <class T, int KV, int HD, bool VT, bool TREE>
__global__ void __launch_bounds__(PD_THREADS, SM_REGISTERS / (PD_THREADS * PM_REGISTERS)) paged_decode_mma_kernel(
    const T* __restrict__ q,                 // [num_tokens, num_heads, head_size <= 128]
    const typename CacheType<KV, T>::type* __restrict__ key_cache,    // as paged_decode_kernel's
    const typename CacheType<KV, T>::type* __restrict__ value_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
    const int* __restrict__ seqused_k, const unsigned char* __restrict__ tree_mask,
    const int* __restrict__ mask_indptr, const float* __restrict__ sinks, const float* __restrict__ alibi_slopes,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    void* __restrict__ tmp_output, PaParams p) {
  // without TREE no trace of a mask in the loop (nullptr): its code and registers cost fp8 decode 5% of its issue
  const unsigned char* const custom_mask = TREE ? tree_mask : nullptr;
  typedef typename CacheType<KV, T>::type CacheT;
  typedef PmSmem<CacheT, HD, VT> S;
  typedef typename PmPv<KV, T>::type PV;
  constexpr int MT = HD / 16, ROWS = PM_ROWS, PARTS = TcHalf<PV>::value ? 2 : 3;
  extern __shared__ __align__(16) unsigned char pd_smem[];
  __shared__ PaRow rows[ROWS];
  typedef KvRows<S::TILE, sizeof(CacheT)> Rows;
  __shared__ Rows kv_rows[S::STAGES];  // each stage's row offsets
  __shared__ __align__(8) float pt[4][160];  // each warp's P^T (pm_at)
  __shared__ __align__(16) T qs[PM_ROWS][HD + 8];  // the tile's q rows (+8: ldmatrix conflict-free)
  const int kv_head = blockIdx.y, seq = blockIdx.z, split = blockIdx.x / p.decode_tiles;
  const PaSeq sq = pa_seq(seq, split, block_tables, seq_lens, query_start_loc, seqused_k, mask_indptr, p);
  const int group = p.num_heads / p.num_kv_heads;
  if (sq.q_len > p.decode_max_q) return;
  if (split >= sq.splits.count) {
    pa_mark_empty(sq.q_start, sq.q_len, split, blockIdx.x % p.decode_tiles, kv_head, group, exp_sums, p);
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const float qscale = p.scale * pa_cache_scale<KV>(k_scale, p.k_scale_value, kv_head, p);
  const float qscale2 = qscale * PA_LOG2E;
  const bool biased = pa_biased(p.softcap, alibi_slopes, qscale2);
  const int* table = block_tables ? block_tables + seq * p.table_stride : nullptr;
  for (int row0 = (blockIdx.x % p.decode_tiles) * ROWS; row0 < sq.q_len * group; row0 += p.decode_tiles * ROWS) {
    const int nrows = min(ROWS, sq.q_len * group - row0);
    int lo = 0x7fffffff, hi = -1;         // the union of the rows' visible keys: the only ones loaded
    int lo_all = 0, hi_all = 0x7fffffff;  // their intersection: keys every row sees
    for (int r = 0; r < ROWS; ++r) {
      PaRow row = pa_row(r, row0, nrows, group, kv_head, sq, sinks, alibi_slopes, p);
      if (row.lo <= row.hi) { lo = min(lo, row.lo); hi = max(hi, row.hi); }
      if (r < nrows) { lo_all = max(lo_all, row.lo); hi_all = min(hi_all, row.hi); }
      pa_keep_row(rows, r, row, custom_mask, sq.seq_len);
    }
    hi_all = pa_unmasked_hi(rows, nrows, hi_all, custom_mask);  // tiles past a mask's first drop test it
    for (int i = threadIdx.x; i < ROWS * HD; i += PD_THREADS) {  // the q tile (kv_pipeline's barrier publishes it)
      const int r = i / HD, k = i % HD, d = pm_qdim<KV>(k), rr = row0 + r;
      const T* qrow =
          q + (sq.q_start + rr / group) * p.q_token_stride + (kv_head * group + rr % group) * p.q_head_stride;
      qs[r][k] = r < nrows && d < p.head_size ? qrow[d] : from_float<T>(0.0f);
    }
    float o[MT][4], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};  // rows 2t, 2t + 1
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    const int first = VT ? lo & -(16 / int(sizeof(CacheT))) : lo;  // V^T: tiles start at whole 16-byte runs
    kv_pipeline<S>(pd_smem, kv_rows, table, sq.key_row0, first, hi, p,
                   [&](unsigned char* stage, const Rows& tile_rows, KvTile tile) {
      kv_issue<CacheT, S>(stage, key_cache, value_cache, tile_rows, tile, kv_head, p);
    }, [&](const unsigned char* stage, int base) {
      const int key0 = base + 16 * warp;
      if (key0 > hi) return;  // the warp's keys are all past the last (warp-uniform)
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // S^T: keys key0 + g (+ 8), rows 2t, 2t + 1
      pm_scores<T, KV, HD, S::PITCH>(s, stage + 16 * warp * S::PITCH, &qs[0][0], lane);
      // a window's edge, a custom mask's drops, the last tile, rows past nrows
      const bool masked = key0 < lo_all || key0 + 15 > hi_all;
      float alpha[2];
#pragma unroll
      for (int e = 0; e < 2; ++e)  // row 2t + e
        alpha[e] = pm_softmax(s, e, m[e], l[e], rows[2 * t + e], key0 + g, masked, biased, qscale, qscale2, p.softcap,
                              custom_mask);
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f))  // once the maxima settle: no rescale
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          o[mt][0] *= alpha[0]; o[mt][1] *= alpha[1]; o[mt][2] *= alpha[0]; o[mt][3] *= alpha[1];
        }
      float* pw = pt[warp];  // P^T to B fragments: (keys 2t, 2t + 1 | 2t + 8, 2t + 9; row g)
      *reinterpret_cast<float2*>(pw + pm_at(g) + 2 * t) = make_float2(s[0], s[1]);
      *reinterpret_cast<float2*>(pw + pm_at(g + 8) + 2 * t) = make_float2(s[2], s[3]);
      __syncwarp();
      float2 b0 = make_float2(pw[pm_at(pm_pkey<KV, VT>(t, 0)) + g], pw[pm_at(pm_pkey<KV, VT>(t, 1)) + g]);
      float2 b1 = make_float2(pw[pm_at(pm_pkey<KV, VT>(t, 2)) + g], pw[pm_at(pm_pkey<KV, VT>(t, 3)) + g]);
      __syncwarp();  // read before the next tile's writes
      unsigned pf[PARTS][2];
#pragma unroll
      for (int k = 0; k < PARTS; ++k) { pf[k][0] = tc_part<PV>(b0); pf[k][1] = tc_part<PV>(b1); }
      pm_values<PV, KV, HD, S::PITCH, S::VT_PITCH, PARTS>(  // the warp's V rows, or V^T (the warp's 16 columns)
          o, stage + S::TILE * S::PITCH + (VT ? 0 : 16 * warp * S::PITCH), pf, warp, lane);
    });
    // the V scale read here, not held in a register across the tiles
    pm_finish<KV, VT, HD>(pd_smem, o, m, l, pa_cache_scale<KV>(v_scale, p.v_scale_value, kv_head, p));
    pd_store<T, HD, ROWS>(pd_smem, rows, nrows, split, sq.splits.count, sq.seq_len, out, lse, max_logits, exp_sums,
                          tmp_output, p);
  }
}

}  // namespace cupaged
