// attention/decode.cuh: paged_decode_kernel<T, KV, HD, VT>, decode on CUDA cores: the short query runs
// (q_len <= PD_MAX_Q: decode, speculative decoding) of 16-bit q with head size 256, and every run of float32 q
// (16-bit q with head sizes up to 128 takes paged_decode_mma_kernel).
//
// A CTA takes a tile of up to PD_ROWS = 4 query rows ((token, head) pairs of one GQA group, so every K/V byte it
// reads serves all of its heads) over one KV split, its K/V tiles brought in by kv_pipeline. A lane owns 8
// dimensions of a key row: the LPR = HD / 8 lanes of a slot read one row with conflict-free vector loads and that
// row serves all the CTA's rows, whose q and output accumulators live in registers (q in its own type: 16-bit
// pairs take half the registers). fp8 converts in pairs in registers, its scales folded into q and the output;
// vLLM's values (VT) arrive as V^T tiles read down a column. Each slot keeps its own online softmax over the keys
// it took (pd_consume); the slots of a warp merge by shuffles and the warps through shared memory, once at the end
// (pd_finish, pd_store, which paged_decode_mma_kernel shares).
//
// Used by:   paged_attention.cu; decode_mma.cuh (pd_store)
// Test:      pytest tests/test_paged_attention.py tests/test_decode_accuracy.py tests/test_decode_traffic.py
//            tests/test_paged_attention_vllm.py
// Benchmark: python profiling/bench_paged_attention.py
#pragma once
#include "../common.cuh"
#include "../softmax.cuh"
#include "kv_pipeline.cuh"
#include "logits.cuh"
#include "params.cuh"

namespace cupaged {

constexpr int PD_ROWS = 4;  // query rows per paged_decode_kernel CTA (8 would need ~230 registers)

template <class CacheT, int HD, bool V_TRANSPOSED>
struct PdSmem {
  static constexpr int TILE = sizeof(CacheT) == 4 && HD == 256 ? 16 : PD_TILE;  // keys a stage (16: 3 stages < 99 KB)
  static constexpr int PITCH = HD * int(sizeof(CacheT));                  // K (and V) rows' bytes
  static constexpr int K_DIMS = HD, V_DIMS = HD;
  static constexpr bool PREFETCH = true;                                  // table entries a tile ahead (kv_pipeline)
  static constexpr bool VT = V_TRANSPOSED;  // vLLM's values: V^T rows of TILE keys (+16 bytes), read down a column
  static constexpr int VT_PITCH = TILE * int(sizeof(CacheT)) + 16;
  static constexpr int STAGE = TILE * PITCH + (VT ? HD * VT_PITCH : TILE * PITCH);  // K tile then V tile, bytes
  static constexpr int STAGES = 4 * STAGE <= PD_SMEM_FOR_4 ? 4 : 3 * STAGE <= PD_SMEM_FOR_3 ? 3 : 2;
  static constexpr int MERGE = (4 * PD_ROWS * (HD + 2) + PD_ROWS * (HD + 3)) * 4;  // pd_store's, pd_prior's
  static constexpr int BYTES = STAGES * STAGE > MERGE ? STAGES * STAGE : MERGE;
  static __device__ __forceinline__ int k_at(int j, int c) { return j * PITCH + c * 16; }  // kv_issue's placement
  static __device__ __forceinline__ int v_at(int j, int c) { return (TILE + j) * PITCH + c * 16; }
  static __device__ __forceinline__ int vt_at(int run, int dim) { return TILE * PITCH + dim * VT_PITCH + run * 16; }
};

// A lane's 8 elements of a shared K/V row, loaded whole (one conflict-free 16-byte load for 16-bit types, 8
// bytes for fp8, two 16-byte loads for float32), and element pair e, e + 1 of them as float32, unscaled (the
// caller folds an fp8 scale into q or the output): fp8 codes convert as a pair in registers.
template <class CacheT>
struct PdRow8 {
  Vec<CacheT, 8> v;
};

template <class CacheT, int STRIDE = 1>
__device__ __forceinline__ PdRow8<CacheT> pd_load8(const CacheT* row) {
  PdRow8<CacheT> r;
  if constexpr (STRIDE > 1) {  // a column of a V^T tile: elements STRIDE apart
#pragma unroll
    for (int e = 0; e < 8; ++e) r.v.v[e] = row[e * STRIDE];
  } else if constexpr (sizeof(CacheT) == 4) {
    const Vec<CacheT, 4> a = load_vec<CacheT, 4>(row), b = load_vec<CacheT, 4>(row + 4);
#pragma unroll
    for (int e = 0; e < 4; ++e) { r.v.v[e] = a.v[e]; r.v.v[e + 4] = b.v[e]; }
  } else {
    r.v = load_vec<CacheT, 8>(row);
  }
  return r;
}

template <int KV, class CacheT>
__device__ __forceinline__ float2 pd_pair(const PdRow8<CacheT>& r, int e) {
  if constexpr (KV != KV_AUTO) {
    const unsigned short codes = (unsigned short)(r.v.v[e] | (r.v.v[e + 1] << 8));
    return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(codes, KV == KV_E4M3 ? __NV_E4M3 : __NV_E5M2)));
  } else {
    return make_float2(to_float(r.v.v[e]), to_float(r.v.v[e + 1]));
  }
}

// Cascade (p.prior_splits > 0, one split): a warp a row. Its lanes take a split each of the shared level's partials
// (every slot written: pa_mark_empty) and find the row's max mn over its own state and those splits; then the warp
// sums the splits' outputs weighted by l_s e^{m_s - mn} (4 columns a lane, an empty split never read) into `prior`
// ([ROWS][HD + 3]: that sum, the own state's factor e^{m - mn}, mn, the splits' L), once a row, not a column.
template <int HD, int ROWS>
__device__ __forceinline__ void pd_prior(float* prior, const float* wm, const float* wl, const PaRow* rows,
                                         int nrows, const float* max_logits, const float* exp_sums,
                                         const void* tmp_output, const PaParams& p) {
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < nrows; r += PD_THREADS / 32) {
    float mx = neg_inf(), sum = 0.0f;
    for (int w = 0; w < 4; ++w) mx = fmaxf(mx, wm[w * ROWS + r]);
    for (int w = 0; w < 4; ++w)
      if (wm[w * ROWS + r] != neg_inf()) sum += wl[w * ROWS + r] * expf(wm[w * ROWS + r] - mx);
    const long long th = (long long)rows[r].token * p.num_heads + rows[r].head;
    const float l = lane < p.prior_splits ? exp_sums[th * p.prior_splits + lane] : 0.0f;
    const float m = l > 0.0f ? max_logits[th * p.prior_splits + lane] : neg_inf();
    float mn = fmaxf(sum > 0.0f ? mx : neg_inf(), m);
    for (int o = 16; o > 0; o /= 2) mn = fmaxf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    const float share = l > 0.0f ? expf(m - mn) * l : 0.0f;
    float total = share;
    for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
    float* pr = prior + r * (HD + 3);
    for (int c = 0; c < (HD + 127) / 128; ++c) {  // every lane takes every shuffle (HD 64: half the lanes idle)
      const int d0 = 128 * c + 4 * lane;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int s = 0; s < p.prior_splits; ++s) {
        const float w = __shfl_sync(0xffffffffu, share, s);
        if (w > 0.0f && d0 < p.v_head_size) {
          const float4 x = pa_load_partial4<float>(tmp_output, (th * p.prior_splits + s) * p.v_head_size + d0, 0);
          acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
        }
      }
      if (d0 < HD) { pr[d0] = acc.x; pr[d0 + 1] = acc.y; pr[d0 + 2] = acc.z; pr[d0 + 3] = acc.w; }
    }
    if (lane == 0) {
      pr[HD] = sum > 0.0f ? expf(mx - mn) : 0.0f;
      pr[HD + 1] = mn;
      pr[HD + 2] = total;
    }
  }
  __syncthreads();
}

// The end of a decode CTA's row tile, once every warp has written its (m, l, o) of each of the ROWS rows to `smem`
// as [4][ROWS] maxima, [4][ROWS] sums, [4][ROWS][HD] outputs (o with the V scale): merge the warps and write the
// partials of a split or the finished output and LSE (the layouts every kernel here shares).
template <class T, int HD, int ROWS>
__device__ __forceinline__ void pd_store(const unsigned char* smem, const PaRow* rows, int nrows, int split,
                                         int num_splits, int seq_len, T* out, float* lse, float* max_logits,
                                         float* exp_sums, void* tmp_output, const PaParams& p) {
  const float* wm = reinterpret_cast<const float*>(smem);
  const float* wl = wm + 4 * ROWS;
  const float* wo = wl + 4 * ROWS;
  float* prior = const_cast<float*>(wo) + 4 * ROWS * HD;  // [ROWS][HD + 3]
  __syncthreads();
  if (p.prior_splits && num_splits == 1)
    pd_prior<HD, ROWS>(prior, wm, wl, rows, nrows, max_logits, exp_sums, tmp_output, p);
  // vLLM v2 leaves the empty ones unwritten; cascade's shared levels (partials_only) write every one
  const bool partial = (num_splits > 1 || p.always_partials) && seq_len > 0 || p.partials_only;
  for (int i = threadIdx.x; i < nrows * HD; i += PD_THREADS) {
    const int r = i / HD, d = i % HD;
    if (d >= p.v_head_size) continue;
    float mx = neg_inf(), sum = 0.0f, acc = 0.0f;
    for (int w = 0; w < 4; ++w) mx = fmaxf(mx, wm[w * ROWS + r]);
    for (int w = 0; w < 4; ++w)
      if (wm[w * ROWS + r] != neg_inf()) {
        const float f = expf(wm[w * ROWS + r] - mx);
        sum += wl[w * ROWS + r] * f;
        acc += wo[(w * ROWS + r) * HD + d] * f;
      }
    const PaRow row = rows[r];
    const long long th = (long long)row.token * p.num_heads + row.head;
    if (partial) {
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      pa_store_partial<T>(tmp_output, (th * p.max_splits + split) * p.v_head_size + d, acc * inv,
                          p.partials_in_out_type);
      if (d == 0) { max_logits[th * p.max_splits + split] = mx; exp_sums[th * p.max_splits + split] = sum; }
    }
    if (num_splits == 1 && !p.partials_only) {  // the whole context was this CTA's: finish the row here
      if (p.prior_splits) {  // cascade: the shared level's partials join the row (pd_prior)
        const float* pr = prior + r * (HD + 3);
        acc = acc * pr[HD] + pr[d];
        sum = sum * pr[HD] + pr[HD + 2];
        mx = pr[HD + 1];
      }
      const SoftmaxFinish fin = softmax_finish(mx, sum, row.sink);
      out[row.token * p.out_token_stride + row.head * p.out_head_stride + d] = from_float<T>(acc * fin.scale);
      if (lse && d == 0) lse[(long long)row.head * p.num_tokens + row.token] = fin.lse;
    }
  }
  __syncthreads();  // the next row tile rewrites rows and the stages
}

// The end of a paged_decode_kernel row tile: merge the slots of each warp (shuffles), hand the warps' states to
// pd_store through shared memory (the maxima back in natural units).
template <int HD>
__device__ __forceinline__ void pd_finish(unsigned char* smem, float (&m)[PD_ROWS], float (&l)[PD_ROWS],
                                          float (&o)[PD_ROWS][8], float oscale) {
  constexpr int LPR = HD / 8, ROWS = PD_ROWS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) m[r] = pa_natural(m[r]);
#pragma unroll
  for (int off = LPR; off < 32; off <<= 1)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[r], off), l2 = __shfl_xor_sync(0xffffffffu, l[r], off);
      const float mx = fmaxf(m[r], m2);
      const float a = softmax_weight(m[r], mx), b = softmax_weight(m2, mx);
      l[r] = l[r] * a + l2 * b;
#pragma unroll
      for (int d = 0; d < 8; ++d) o[r][d] = o[r][d] * a + __shfl_xor_sync(0xffffffffu, o[r][d], off) * b;
      m[r] = mx;
    }
  float* wm = reinterpret_cast<float*>(smem);  // pd_store's layout
  float* wl = wm + 4 * ROWS;
  float* wo = wl + 4 * ROWS;
  __syncthreads();  // every warp is done with the last stage: its bytes become the merge area
  if (lane < LPR)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {  // two 16-byte stores per lane: contiguous across lanes, conflict-free
      float* dst = wo + (warp * ROWS + r) * HD + lane * 8;
      *reinterpret_cast<float4*>(dst) = make_float4(o[r][0] * oscale, o[r][1] * oscale, o[r][2] * oscale,
                                                    o[r][3] * oscale);  // with the V scale
      *reinterpret_cast<float4*>(dst + 4) = make_float4(o[r][4] * oscale, o[r][5] * oscale, o[r][6] * oscale,
                                                        o[r][7] * oscale);
      if (lane == 0) { wm[warp * ROWS + r] = m[r]; wl[warp * ROWS + r] = l[r]; }
    }
}

// One key (row j of the stage) for the slot's lanes: q . k over the slot's lanes (a tree per row, interleaved
// with its softmax step: fewer live registers), then, for each row that sees the key, the logit step and
// o = o * alpha + w v. Masking by selection: v is never weighted by 0. `all_see`: every row sees the whole tile
// (the rows' bounds need not be read); `biased`: softcap or ALiBi is on (logits.cuh's base-2 logit step; else
// q . k times qscale2). q stays in its own type (16-bit pairs take half the registers; exact), scaled after the dot
// product.
template <int KV, int LPR, int VSTRIDE, class T, class CacheT>
__device__ __forceinline__ void pd_consume(const CacheT* krow_ptr, const CacheT* vrow_ptr, int key, const PaRow* rows,
                                           int nrows, bool all_see, bool biased, const Vec<T, 8> (&qv)[PD_ROWS],
                                           float qscale, float qscale2, float (&o)[PD_ROWS][8], float (&m)[PD_ROWS],
                                           float (&l)[PD_ROWS], float softcap, const unsigned char* custom_mask) {
  constexpr int ROWS = PD_ROWS;
  const PdRow8<CacheT> krow = pd_load8(krow_ptr);
  float s[ROWS], alpha[ROWS], w[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) s[r] = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; e += 2) {  // 8 dimensions per lane, converted a pair at a time
    const float2 k = pd_pair<KV>(krow, e);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) s[r] = s[r] + to_float(qv[r].v[e]) * k.x + to_float(qv[r].v[e + 1]) * k.y;
  }
  int seen = 0;  // rows that see this key
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int off = LPR / 2; off > 0; off >>= 1) s[r] += __shfl_xor_sync(0xffffffffu, s[r], off);
    alpha[r] = 1.0f;
    w[r] = 0.0f;
    if (r >= nrows || (!all_see && !pa_row_sees(rows[r], key, custom_mask))) continue;
    const float x = biased ? pa_logit(s[r], qscale, softcap, rows[r].slope, key, rows[r].pos) : s[r] * qscale2;
    alpha[r] = pa_rescale(m[r], x);
    w[r] = pa_exp2(x - m[r]);  // a key the row sees: x is finite, no -inf to select
    l[r] = l[r] * alpha[r] + w[r];
    seen |= 1 << r;
  }
  const PdRow8<CacheT> vrow = pd_load8<CacheT, VSTRIDE>(vrow_ptr);  // loaded after the scores: k is dead
#pragma unroll
  for (int e = 0; e < 8; e += 2) {
    const float2 v = pd_pair<KV>(vrow, e);
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      if (seen >> r & 1) {
        o[r][e] = o[r][e] * alpha[r] + w[r] * v.x;
        o[r][e + 1] = o[r][e + 1] * alpha[r] + w[r] * v.y;
      }
  }
}

template <class T, int KV, int HD, bool VT>
__global__ void __launch_bounds__(PD_THREADS, SM_REGISTERS / (PD_THREADS * PD_REGISTERS)) paged_decode_kernel(
    const T* __restrict__ q,                 // [num_tokens, num_heads, head_size]
    const typename CacheType<KV, T>::type* __restrict__ key_cache,    // flash NHD / HND, dense rows, or vLLM's
    const typename CacheType<KV, T>::type* __restrict__ value_cache,  // (VT: values [.., head_size, block_size])
    const int* __restrict__ block_tables,    // [num_seqs, max_blocks_per_seq], or nullptr: dense varlen keys
    const int* __restrict__ seq_lens,        // [num_seqs], or cu_seqlens_k [num_seqs + 1] when dense
    const int* __restrict__ query_start_loc, // [num_seqs + 1], or nullptr: one query per sequence
    const int* __restrict__ seqused_k,       // dense: [num_seqs] or nullptr
    const unsigned char* __restrict__ custom_mask,  // bit-packed per-sequence q_len x seq_len masks, or nullptr
    const int* __restrict__ mask_indptr,            // [num_seqs + 1]: each sequence's first byte of custom_mask
    const float* __restrict__ sinks, const float* __restrict__ alibi_slopes,  // [num_heads] or nullptr
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,     // [1] / [num_kv_heads] or nullptr
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    void* __restrict__ tmp_output, PaParams p) {  // the split partials: paged_attention.cu's header
  typedef typename CacheType<KV, T>::type CacheT;
  typedef PdSmem<CacheT, HD, VT> S;
  constexpr int LPR = HD / 8, SLOTS = 32 / LPR, ROWS = PD_ROWS, TILE = S::TILE;
  extern __shared__ __align__(16) unsigned char pd_smem[];
  __shared__ PaRow rows[ROWS];
  typedef KvRows<TILE, sizeof(CacheT)> Rows;
  __shared__ Rows kv_rows[S::STAGES];  // each stage's row offsets
  const int kv_head = blockIdx.y, seq = blockIdx.z, split = blockIdx.x / p.decode_tiles;
  const PaSeq sq = pa_seq(seq, split, block_tables, seq_lens, query_start_loc, seqused_k, mask_indptr, p);
  const int group = p.num_heads / p.num_kv_heads;
  if (sq.q_len > p.decode_max_q) return;  // a longer run is paged_prefill_kernel's
  if (split >= sq.splits.count) {
    pa_mark_empty(sq.q_start, sq.q_len, split, blockIdx.x % p.decode_tiles, kv_head, group, exp_sums, p);
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, slot = lane / LPR, d0 = lane % LPR * 8;
  const float qscale = p.scale * pa_cache_scale<KV>(k_scale, p.k_scale_value, kv_head, p);
  const float qscale2 = qscale * PA_LOG2E;
  const bool biased = pa_biased(p.softcap, alibi_slopes, qscale2);
  const float oscale = pa_cache_scale<KV>(v_scale, p.v_scale_value, kv_head, p);
  const int* table = block_tables ? block_tables + seq * p.table_stride : nullptr;
  for (int row0 = (blockIdx.x % p.decode_tiles) * ROWS; row0 < sq.q_len * group; row0 += p.decode_tiles * ROWS) {
    const int nrows = min(ROWS, sq.q_len * group - row0);
    Vec<T, 8> qv[ROWS];
    float o[ROWS][8], m[ROWS], l[ROWS];
    int lo = 0x7fffffff, hi = -1;             // the union of the rows' visible keys: the only ones loaded
    int lo_all = 0, hi_all = 0x7fffffff;      // their intersection: keys every row sees
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      PaRow row = pa_row(r, row0, nrows, group, kv_head, sq, sinks, alibi_slopes, p);
      if (row.lo <= row.hi) { lo = min(lo, row.lo); hi = max(hi, row.hi); }
      if (r < nrows) { lo_all = max(lo_all, row.lo); hi_all = min(hi_all, row.hi); }
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        qv[r].v[e] = r < nrows && d0 + e < p.head_size
                         ? q[row.token * p.q_token_stride + row.head * p.q_head_stride + d0 + e] : from_float<T>(0.0f);
        o[r][e] = 0.0f;
      }
      m[r] = neg_inf();
      l[r] = 0.0f;
      pa_keep_row(rows, r, row, custom_mask, sq.seq_len);
    }
    hi_all = pa_unmasked_hi(rows, nrows, hi_all, custom_mask);  // tiles past a mask's first drop test it
    const int first = VT ? lo & -(16 / int(sizeof(CacheT))) : lo;  // V^T: tiles start at whole 16-byte runs
    kv_pipeline<S>(pd_smem, kv_rows, table, sq.key_row0, first, hi, p,
                   [&](unsigned char* stage, const Rows& tile_rows, KvTile tile) {
      kv_issue<CacheT, S>(stage, key_cache, value_cache, tile_rows, tile, kv_head, p);
    }, [&](const unsigned char* stage, int base) {
      const bool all_see = base >= lo_all && base + TILE - 1 <= hi_all;
      for (int j = warp * (TILE / 4) + slot; j < (warp + 1) * (TILE / 4); j += SLOTS)
        pd_consume<KV, LPR, VT ? S::VT_PITCH / int(sizeof(CacheT)) : 1>(
            reinterpret_cast<const CacheT*>(stage + j * S::PITCH) + d0,
            reinterpret_cast<const CacheT*>(stage + (VT ? S::vt_at(0, d0) + j * int(sizeof(CacheT))
                                                        : (TILE + j) * S::PITCH + d0 * int(sizeof(CacheT)))),
            base + j, rows, nrows, all_see, biased, qv, qscale, qscale2, o, m, l, p.softcap, custom_mask);
    });
    pd_finish<HD>(pd_smem, m, l, o, oscale);
    pd_store<T, HD, ROWS>(pd_smem, rows, nrows, split, sq.splits.count, sq.seq_len, out, lse, max_logits, exp_sums,
                          tmp_output, p);
  }
}

}  // namespace cupaged
