// attention/prefill.cuh: paged_prefill_kernel<T, KV, HD, VHD>, FlashAttention-2 on tensor cores for the query runs
// longer than the decode kernels take (q_len > PD_MAX_Q), 16-bit q over flash NHD / HND caches or dense varlen
// rows (QK 192 / V 128 included).
//
// A CTA takes S::ROWS = 128 query rows ((token, head) pairs of one GQA group, token-major, so K/V are read once for
// the group; 64 when V's head size is over 128), MW = 2 m16 tiles a warp (1 above 128), so every K / V fragment a
// warp loads serves 2 tiles of rows, and walks their keys in stages of S::TILE through kv_pipeline:
//   S = Q K^T by mma.sync m16n8k16: Q's A and K's B fragments by ldmatrix from shared tiles whose 16-byte chunks are
//     XOR-swizzled by row (pf_at): conflict-free without padding;
//   the online softmax in registers: a lane holds rows g, g + 8 of each of its warp's m tiles, row maxima and sums
//     over its quad by shuffles; masks (causal, windows, the split's ends, keys past the last) only on tiles not
//     wholly visible to the warp's rows, and a warp skips the tiles none of its rows sees;
//   O += P V: the C fragments of S rounded to q's type are P's A fragments as they lie, V's B fragments come by
//     ldmatrix.trans: FlashAttention-2's accuracy (P in 16 bits; the tolerance table, not the decode ulp rule).
// fp8 caches land as codes and are converted to q's type in shared memory (exact; .b16 ldmatrix of fp8 pairs would
// not give 16-bit fragments), their scales folded into the scores' scale and the output. Head sizes below the
// bucket are zero-filled by the copies (src-size), so the mma sums zeros. Row tiles run heaviest first: the last
// rows of a causal run see the most keys. Every key a stage holds is visible to some row of the CTA or zero-filled
// past the last, so a masked row's 0 weight only ever meets real values. 255 registers (2 CTAs an SM at most).
//
// Used by:   paged_attention.cu
// Test:      pytest tests/test_paged_attention.py tests/test_varlen_attention.py tests/test_prefill_traffic.py
// Benchmark: python profiling/bench_paged_attention.py
#pragma once
#include "../common.cuh"
#include "../softmax.cuh"
#include "../tensor_core.cuh"
#include "kv_pipeline.cuh"
#include "logits.cuh"
#include "params.cuh"

namespace cupaged {

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of ROW-byte rows (ROW a multiple of 128): the chunk's
// low 3 bits XOR the row's, so ldmatrix's 8 rows at one chunk hit 8 different 16-byte bank groups.
template <int ROW>
__device__ __forceinline__ int pf_at(int row, int chunk) { return row * ROW + ((chunk ^ (row & 7)) << 4); }

template <class CacheT, int HD, int VHD>
struct PfSmem {
  static constexpr int MW = VHD > 128 ? 1 : 2;     // m16 tiles a warp: K / V fragments serve MW tiles of rows
  static constexpr int ROWS = 64 * MW;             // query rows a CTA
  static constexpr int TILE = HD > 64 ? 32 : 64;   // keys per stage: S is MW x TILE / 8 fragments a lane
  static constexpr int K_DIMS = HD, V_DIMS = VHD;
  static constexpr bool PREFETCH = true, VT = false, CONVERT = sizeof(CacheT) == 1;
  static constexpr int KROW = HD * int(sizeof(CacheT)), VROW = VHD * int(sizeof(CacheT));  // a stage's rows, bytes
  static constexpr int STAGE = TILE * (KROW + VROW);
  static constexpr int FIXED = ROWS * HD * 2 + (CONVERT ? TILE * (HD + VHD) * 2 : 0);  // the q and converted tiles
  static constexpr int STAGES = 3 * STAGE + FIXED <= PF_SMEM_FOR_3 ? 3 : 2;
  static constexpr int Q = STAGES * STAGE;                  // [ROWS][HD] of q's type (pf_at)
  static constexpr int CK = Q + ROWS * HD * 2;              // fp8: the stage's K [TILE][HD] and V [TILE][VHD] in q's
  static constexpr int CV = CK + (CONVERT ? TILE * HD * 2 : 0);  // type (pf_at)
  static constexpr int BYTES = CV + (CONVERT ? TILE * VHD * 2 : 0);
  // kv_issue's placement: 16-bit rows swizzled as the mma reads them; fp8 codes plain (pf_convert reads them)
  static __device__ __forceinline__ int k_at(int j, int c) { return CONVERT ? j * KROW + c * 16 : pf_at<KROW>(j, c); }
  static __device__ __forceinline__ int v_at(int j, int c) {
    return TILE * KROW + (CONVERT ? j * VROW + c * 16 : pf_at<VROW>(j, c));
  }
  static __device__ __forceinline__ int vt_at(int, int) { return 0; }
};

// fp8 codes of a stage -> q's type in the swizzled K and V tiles, 8 codes a thread a step (8-byte reads, 16-byte
// writes: both conflict-free); exact.
template <int KV, class T, class S>
__device__ __forceinline__ void pf_convert(unsigned char* ck, unsigned char* cv, const unsigned char* stage) {
  constexpr int KC = S::K_DIMS / 8, VC = S::V_DIMS / 8;  // 8-element chunks of a row
  for (int i = threadIdx.x; i < S::TILE * (KC + VC); i += PD_THREADS) {
    const bool is_v = i >= S::TILE * KC;
    const int k = i - is_v * S::TILE * KC, j = is_v ? k / VC : k / KC, c = is_v ? k % VC : k % KC;
    const uint2 codes =
        *reinterpret_cast<const uint2*>(stage + (is_v ? S::TILE * S::KROW + j * S::VROW : j * S::KROW) + c * 8);
    const uint4 w = make_uint4(tc_fp8x2<KV, T>(codes.x), tc_fp8x2<KV, T>(codes.x >> 16), tc_fp8x2<KV, T>(codes.y),
                               tc_fp8x2<KV, T>(codes.y >> 16));
    *reinterpret_cast<uint4*>(is_v ? cv + pf_at<S::V_DIMS * 2>(j, c) : ck + pf_at<S::K_DIMS * 2>(j, c)) = w;
  }
}

// Chunk c (8 elements) of a row's q (rows: its token and head), zero past head_size: one 16-byte load where the row
// allows it.
template <class T>
__device__ __forceinline__ uint4 pf_q_chunk(const T* q, const PaRow& row, int c, const PaParams& p) {
  const T* src = q + row.token * p.q_token_stride + row.head * p.q_head_stride + 8 * c;
  if (8 * c + 8 <= p.head_size && reinterpret_cast<unsigned long long>(src) % 16 == 0)
    return *reinterpret_cast<const uint4*>(src);
  unsigned e[4];  // a head size's last chunk, or a view at an odd offset
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int d = 8 * c + 2 * k;
    const T zero = from_float<T>(0.0f);
    e[k] = tc_pack<T>(d < p.head_size ? src[2 * k] : zero, d + 1 < p.head_size ? src[2 * k + 1] : zero);
  }
  return make_uint4(e[0], e[1], e[2], e[3]);
}

// The row tile's q rows (rows: their tokens and heads) into the swizzled q tile, 8 elements a chunk (zero past
// head_size and past the last row).
template <class T, int HD, int ROWS>
__device__ __forceinline__ void pf_load_q(unsigned char* qs, const T* q, const PaRow* rows, int nrows,
                                          const PaParams& p) {
  for (int i = threadIdx.x; i < ROWS * HD / 8; i += PD_THREADS) {
    const int r = i / (HD / 8), c = i % (HD / 8);
    *reinterpret_cast<uint4*>(qs + pf_at<HD * 2>(r, c)) =
        r < nrows ? pf_q_chunk(q, rows[r], c, p) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// S (the warp's MW m16 tiles of rows x TILE keys) = Q K^T: Q's A fragments by ldmatrix (row l % 16 of m tile mi,
// chunk 2 kk + l / 16), K's B fragments by ldmatrix of its rows (key 16 j + 8 (l / 16) + l % 8, chunk
// 2 kk + l / 8 % 2: n tiles 2 j, 2 j + 1), each serving the MW m tiles.
template <class T, int HD, int TILE, int MW>
__device__ __forceinline__ void pf_scores(float (&s)[MW][TILE / 8][4], const unsigned char* qs,
                                          const unsigned char* kt, int warp, int lane) {
  const int qr = 16 * MW * warp + (lane & 15), kr = 8 * (lane >> 4) + (lane & 7);
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    unsigned a[MW][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) tc_ldmatrix_x4(a[mi], qs + pf_at<HD * 2>(qr + 16 * mi, 2 * kk + (lane >> 4)));
#pragma unroll
    for (int j = 0; j < TILE / 16; ++j) {
      unsigned b[4];
      tc_ldmatrix_x4(b, kt + pf_at<HD * 2>(16 * j + kr, 2 * kk + (lane >> 3 & 1)));
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        tc_mma<T>(s[mi][2 * j], a[mi], b[0], b[1]);
        tc_mma<T>(s[mi][2 * j + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

constexpr float PF_HEADROOM = 8.0f;  // base 2: weights up to 256 before a row's max moves on (pa_rescale)

// Row g + 8 e of one m tile of scores (keys key0 + 8 n + h, key0 = the tile's first + 2t): the logit step in base
// 2 (logits.cuh) and, when `masked`, the row's visible range; then the online-softmax step: the scores become
// P = 2^{s2 - m2} (0 where masked: selection), (m, l) move on (l over this lane's keys), and the factor that
// rescales o is returned. Without softcap and ALiBi (`biased` false) the scores stay q . k, their max is scaled
// once and each weight is one FFMA and one MUFU.EX2 (qscale2 = log2(e) qscale > 0); the mask and the bias cost
// nothing on tiles and launches that need none. The max moves on lazily (pa_rescale with PF_HEADROOM): a factor of 1
// (the caller's o untouched) unless a tile's max passes the row's by more than 2^PF_HEADROOM.
template <int NT>
__device__ __forceinline__ float pf_softmax(float (&s)[NT][4], int e, float& m, float& l, const PaRow& row, int key0,
                                            bool masked, bool biased, float qscale, float qscale2, float softcap,
                                            const unsigned char* custom_mask) {
  if (biased) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        s[n][2 * e + h] = pa_logit(s[n][2 * e + h], qscale, softcap, row.slope, key0 + 8 * n + h, row.pos);
  }
  const float factor = biased ? 1.0f : qscale2;
  if (masked && custom_mask) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (!pa_row_sees(row, key0 + 8 * n + h, custom_mask)) s[n][2 * e + h] = neg_inf();
  } else if (masked) {  // the row's range alone: two compares a score
    const int lo = row.lo, hi = row.hi;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (!pa_sees(key0 + 8 * n + h, lo, hi)) s[n][2 * e + h] = neg_inf();
  }
  float mx = neg_inf();
#pragma unroll
  for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * e], s[n][2 * e + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float alpha = pa_rescale(m, mx * factor, PF_HEADROOM);  // lazy: most tiles leave o as it is
  const float pivot = pa_pivot(m);
  float sum = 0.0f;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      s[n][2 * e + h] = pa_exp2(fmaf(s[n][2 * e + h], factor, -pivot));
      sum += s[n][2 * e + h];
    }
  l = l * alpha + sum;
  return alpha;
}

// O += P V over the tile's keys: k step kk of P is S's n tiles 2 kk, 2 kk + 1 rounded to T (the C fragments are the
// A fragments), V's B fragments by ldmatrix.trans of its rows (key 16 kk + l % 16, chunk 2 j + l / 16: n tiles 2 j,
// 2 j + 1), each serving the MW m tiles.
template <class T, int VHD, int TILE, int MW>
__device__ __forceinline__ void pf_values(float (&o)[MW][VHD / 8][4], const float (&s)[MW][TILE / 8][4],
                                          const unsigned char* vt, int lane) {
#pragma unroll
  for (int kk = 0; kk < TILE / 16; ++kk) {
    unsigned a[MW][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
      const float* x = s[mi][2 * kk];
      const float* y = s[mi][2 * kk + 1];
      a[mi][0] = tc_pack<T>(from_float<T>(x[0]), from_float<T>(x[1]));
      a[mi][1] = tc_pack<T>(from_float<T>(x[2]), from_float<T>(x[3]));
      a[mi][2] = tc_pack<T>(from_float<T>(y[0]), from_float<T>(y[1]));
      a[mi][3] = tc_pack<T>(from_float<T>(y[2]), from_float<T>(y[3]));
    }
#pragma unroll
    for (int j = 0; j < VHD / 16; ++j) {
      unsigned b[4];
      tc_ldmatrix_x4_trans(b, vt + pf_at<VHD * 2>(16 * kk + (lane & 15), 2 * j + (lane >> 4)));
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        tc_mma<T>(o[mi][2 * j], a[mi], b[0], b[1]);
        tc_mma<T>(o[mi][2 * j + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// The end of a prefill row tile: each lane's 2 MW rows (their sums over the quad first; `warp`: the warp's place
// among the tile's rows, MW m16 tiles each), written as a split's partials or finished with the sink and the LSE, as
// pd_store does; o carries the V scale `oscale` still.
template <class T, int VHD, int MW>
__device__ __forceinline__ void pf_store(const float (&o)[MW][VHD / 8][4], const float (&m)[MW][2],
                                         float (&l)[MW][2], const PaRow* rows, int nrows, int warp, int split,
                                         int num_splits, int seq_len, float oscale, T* out, float* lse,
                                         float* max_logits, float* exp_sums, void* tmp_output, const PaParams& p) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  // vLLM v2 leaves the empty ones unwritten; cascade's shared levels (partials_only) write every one
  const bool partial = (num_splits > 1 || p.always_partials) && seq_len > 0 || p.partials_only;
  const bool finish = num_splits == 1 && !p.partials_only;  // the whole context was this CTA's
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      l[mi][e] += __shfl_xor_sync(0xffffffffu, l[mi][e], 1);
      l[mi][e] += __shfl_xor_sync(0xffffffffu, l[mi][e], 2);
    }
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 16 * (MW * warp + mi) + g + 8 * e;
      if (r >= nrows) continue;
      const PaRow row = rows[r];
      const long long th = (long long)row.token * p.num_heads + row.head;
      const float lv = l[mi][e], mn = pa_natural(m[mi][e]);
      const SoftmaxFinish fin = softmax_finish(mn, lv, row.sink);
      const float fp = oscale * (lv > 0.0f ? 1.0f / lv : 0.0f), fo = oscale * fin.scale;
      T* dst = out + row.token * p.out_token_stride + row.head * p.out_head_stride;
      const long long at = (th * p.max_splits + split) * p.v_head_size;
      const bool pairs = reinterpret_cast<unsigned long long>(dst) % 4 == 0;  // a lane's 2 columns: one 32-bit store
#pragma unroll
      for (int n = 0; n < VHD / 8; ++n) {
        const int d = 8 * n + 2 * t;  // and d + 1: v_head_size is a multiple of 8
        const float x0 = o[mi][n][2 * e], x1 = o[mi][n][2 * e + 1];
        if (d >= p.v_head_size) break;
        if (partial) {
          pa_store_partial<T>(tmp_output, at + d, x0 * fp, p.partials_in_out_type);
          pa_store_partial<T>(tmp_output, at + d + 1, x1 * fp, p.partials_in_out_type);
        }
        if (finish && pairs) {
          *reinterpret_cast<unsigned*>(dst + d) = tc_pack<T>(from_float<T>(x0 * fo), from_float<T>(x1 * fo));
        } else if (finish) {
          dst[d] = from_float<T>(x0 * fo);
          dst[d + 1] = from_float<T>(x1 * fo);
        }
      }
      if (t == 0 && partial) {
        max_logits[th * p.max_splits + split] = mn;
        exp_sums[th * p.max_splits + split] = lv;
      }
      if (t == 0 && finish && lse) lse[(long long)row.head * p.num_tokens + row.token] = fin.lse;
    }
}

// The keys a row tile loads and masks, a lane a row and the warp's REDUX instructions (no loop over the tile's
// rows): the union of its rows' visible keys (lo..hi: the only ones loaded), the union of this warp's rows'
// (wlo..whi: a tile outside it is skipped) and their intersection (all_lo..all_hi: keys no row of the warp masks).
struct PfKeys {
  int lo, hi, wlo, whi, all_lo, all_hi;
};

template <int ROWS, int MW>
__device__ __forceinline__ PfKeys pf_keys(const PaRow* rows, int nrows, int warp, int lane) {
  int lo = 0x7fffffff, hi = -1, wlo = 0x7fffffff, whi = -1, all_lo = 0, all_hi = 0x7fffffff;
#pragma unroll
  for (int i = 0; i < ROWS / 32; ++i) {  // a count known at compile time: the profiled host build unrolls it too
    const int r = lane + 32 * i;
    if (r < nrows && rows[r].lo <= rows[r].hi) { lo = min(lo, rows[r].lo); hi = max(hi, rows[r].hi); }
  }
  const int r = 16 * MW * warp + lane;  // the warp's rows: its MW m tiles of 16
  if (lane < 16 * MW && r < nrows) {
    if (rows[r].lo <= rows[r].hi) { wlo = rows[r].lo; whi = rows[r].hi; }
    all_lo = rows[r].lo;
    all_hi = min(rows[r].hi, rows[r].full - 1);  // past a custom mask's first drop, its bits are tested
  }
  return {__reduce_min_sync(0xffffffffu, lo), __reduce_max_sync(0xffffffffu, hi), __reduce_min_sync(0xffffffffu, wlo),
          __reduce_max_sync(0xffffffffu, whi), __reduce_max_sync(0xffffffffu, all_lo),
          __reduce_min_sync(0xffffffffu, all_hi)};
}

// Whether a prefill CTA (grid: x = split * p.tiles + row tile, y = kv head, z = sequence) has work: not when its
// sequence's run is a decode kernel's, nor when its split lies past the sequence's last (then marked empty for
// cascade's readers: pa_mark_empty). Every thread alike, before any barrier.
__device__ __forceinline__ bool pf_active(const PaSeq& sq, int split, float* exp_sums, const PaParams& p) {
  if (sq.q_len <= p.decode_max_q) return false;
  if (split >= sq.splits.count)
    pa_mark_empty(sq.q_start, sq.q_len, split, blockIdx.x % p.tiles, blockIdx.y, p.num_heads / p.num_kv_heads,
                  exp_sums, p);
  return split < sq.splits.count;
}

template <class T, int KV, int HD, int VHD>
__global__ void __launch_bounds__(PD_THREADS, SM_REGISTERS / (PD_THREADS * PF_REGISTERS)) paged_prefill_kernel(
    const T* __restrict__ q,                 // [num_tokens, num_heads, head_size]
    const typename CacheType<KV, T>::type* __restrict__ key_cache,    // flash NHD / HND, or dense rows
    const typename CacheType<KV, T>::type* __restrict__ value_cache,  // (v_dim_stride == 1, rows 16-byte aligned)
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
    const int* __restrict__ seqused_k, const unsigned char* __restrict__ custom_mask,
    const int* __restrict__ mask_indptr, const float* __restrict__ sinks, const float* __restrict__ alibi_slopes,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    void* __restrict__ tmp_output, PaParams p) {  // as paged_decode_kernel's
  typedef typename CacheType<KV, T>::type CacheT;
  typedef PfSmem<CacheT, HD, VHD> S;
  constexpr int TILE = S::TILE, MW = S::MW, ROWS = S::ROWS;
  extern __shared__ __align__(128) unsigned char pf_smem[];
  __shared__ PaRow rows[ROWS];
  typedef KvRows<TILE, sizeof(CacheT)> Rows;
  __shared__ Rows kv_rows[S::STAGES];  // each stage's row offsets
  const int kv_head = blockIdx.y, seq = blockIdx.z, split = blockIdx.x / p.tiles;
  const PaSeq sq = pa_seq(seq, split, block_tables, seq_lens, query_start_loc, seqused_k, mask_indptr, p);
  if (!pf_active(sq, split, exp_sums, p)) return;
  const int group = p.num_heads / p.num_kv_heads, all_rows = sq.q_len * group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2;
  const float qscale = p.scale * pa_cache_scale<KV>(k_scale, p.k_scale_value, kv_head, p);
  const float qscale2 = qscale * PA_LOG2E;
  const bool biased = pa_biased(p.softcap, alibi_slopes, qscale2);
  const int* table = block_tables ? block_tables + seq * p.table_stride : nullptr;
  const int ntiles = (all_rows + ROWS - 1) / ROWS;
  for (int it = blockIdx.x % p.tiles; it < ntiles; it += p.tiles) {  // p.tiles apart: rows past the hint too
    const int row0 = (ntiles - 1 - it) * ROWS, nrows = min(ROWS, all_rows - row0);  // heaviest first
    for (int r = threadIdx.x; r < ROWS; r += PD_THREADS) {
      PaRow row = pa_row(r, row0, nrows, group, kv_head, sq, sinks, alibi_slopes, p);
      row.full = pa_mask_full(custom_mask, row, sq.seq_len);
      rows[r] = row;
    }
    __syncthreads();
    pf_load_q<T, HD, ROWS>(pf_smem + S::Q, q, rows, nrows, p);  // kv_pipeline's first barrier publishes the q tile
    const PfKeys keys = pf_keys<ROWS, MW>(rows, nrows, warp, lane);
    const int lo = keys.lo, hi = keys.hi, wlo = keys.wlo, whi = keys.whi, all_lo = keys.all_lo, all_hi = keys.all_hi;
    float o[MW][VHD / 8][4], m[MW][2], l[MW][2];  // rows g, g + 8 of the warp's m tiles
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
      m[mi][0] = m[mi][1] = neg_inf();
      l[mi][0] = l[mi][1] = 0.0f;
#pragma unroll
      for (int n = 0; n < VHD / 8; ++n) o[mi][n][0] = o[mi][n][1] = o[mi][n][2] = o[mi][n][3] = 0.0f;
    }
    kv_pipeline<S>(pf_smem, kv_rows, table, sq.key_row0, lo, hi, p,
                   [&](unsigned char* stage, const Rows& tile_rows, KvTile tile) {
      kv_issue<CacheT, S>(stage, key_cache, value_cache, tile_rows, tile, kv_head, p);
    }, [&](const unsigned char* stage, int base) {
      const unsigned char *kt = stage, *vt = stage + TILE * S::KROW;
      if constexpr (S::CONVERT) {
        pf_convert<KV, T, S>(pf_smem + S::CK, pf_smem + S::CV, stage);
        __syncthreads();  // the converted tiles are in (the pipeline's next barrier precedes the next conversion)
        kt = pf_smem + S::CK;
        vt = pf_smem + S::CV;
      }
      if (base > whi || base + TILE - 1 < wlo) return;  // none of the warp's rows sees these keys (warp-uniform)
      float s[MW][TILE / 8][4];
#pragma unroll
      for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int n = 0; n < TILE / 8; ++n) s[mi][n][0] = s[mi][n][1] = s[mi][n][2] = s[mi][n][3] = 0.0f;
      pf_scores<T, HD, TILE, MW>(s, pf_smem + S::Q, kt, warp, lane);
      // the diagonal, window edges, a custom mask's drops, the last tile
      const bool masked = base < all_lo || base + TILE - 1 > all_hi;
      const int key0 = base + 2 * (lane & 3);
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        const PaRow* wr = rows + 16 * (MW * warp + mi) + g;
        const float a0 = pf_softmax(s[mi], 0, m[mi][0], l[mi][0], wr[0], key0, masked, biased, qscale, qscale2,
                                    p.softcap, custom_mask);
        const float a1 = pf_softmax(s[mi], 1, m[mi][1], l[mi][1], wr[8], key0, masked, biased, qscale, qscale2,
                                    p.softcap, custom_mask);
        if (__any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f))  // once a row's max settles, o needs no rescale
#pragma unroll
          for (int n = 0; n < VHD / 8; ++n) {
            o[mi][n][0] *= a0; o[mi][n][1] *= a0; o[mi][n][2] *= a1; o[mi][n][3] *= a1;
          }
      }
      pf_values<T, VHD, TILE, MW>(o, s, vt, lane);
    });
    pf_store<T, VHD, MW>(o, m, l, rows, nrows, warp, split, sq.splits.count, sq.seq_len,
                         pa_cache_scale<KV>(v_scale, p.v_scale_value, kv_head, p), out, lse, max_logits, exp_sums,
                         tmp_output, p);
    __syncthreads();  // the next row tile rewrites rows and the q tile
  }
}

}  // namespace cupaged
