// attention/mla_decode.cuh: mla_decode_kernel<T, KV, MT>, MLA over a paged latent cache on tensor cores, 16-bit q,
// every query run (a CTA takes one query of the run at a time: one position for all its heads).
//
// A CTA takes ROWS = 16 MT query heads of one sequence and split (MT 1: 16 heads, 128 threads; MT 2: 32 heads,
// 256 threads); the latent rows (key = the row, value = its first v_head_size entries) arrive in stages of PD_TILE
// keys through kv_pipeline, stay in shared memory in their own type (fp8 is converted to q's type once per tile,
// exactly) and feed both products:
//   scores S = Q K^T: warp w takes m tile w / 4 over the k16 steps of quarter w % 4 (q in registers, 36 per
//     lane), K fragments by ldmatrix; the four partial sums go through shared memory;
//   softmax: warp w owns rows 4w..4w+3 (8 lanes a row): the partials summed in a fixed order, the logit step, the
//     online (m, l) step, P = e^{s - m} in float32;
//   P V: warp w takes MW m tiles and a slice of the 512 columns (64 fp32 accumulators a lane); its P fragments
//     are split in registers into 16-bit parts whose sum keeps P to ~22 bits (fp16: hi + lo, bf16: three
//     parts; two bf16 parts gave up to 8.5 ulps on cancelling outputs), one mma per part, V fragments by
//     ldmatrix.trans: P V at the fp32-P accuracy of the decode accuracy rule.
// The score partials and P are [rows][32] float32 rows with their 8-float groups XOR-swizzled by row % 4
// (md_at), so the mma fragments' float2 stores and loads and the softmax's float4 rows are conflict-free.
// Every (head, key) pair a CTA sees is visible (one query position): the tile's rows past the split's last
// key are zero-filled, never loaded, so a masked weight never meets a loaded value.
//
// Used by:   paged_attention.cu
// Test:      pytest tests/test_mla.py tests/test_decode_traffic.py
// Benchmark: python profiling/bench_mla.py
#pragma once
#include "../common.cuh"
#include "../softmax.cuh"
#include "../tensor_core.cuh"
#include "kv_pipeline.cuh"
#include "logits.cuh"
#include "params.cuh"

namespace cupaged {

constexpr int MD_HD = 576;  // the latent row's capacity (attention.py MLA_BUCKET; values: its first 512)

// Element (row, col) of a swizzled [rows][32] float32 array.
__device__ __forceinline__ int md_at(int row, int col) { return row * PD_TILE + (col ^ (row & 3) << 3); }

template <class CacheT, int MT>
struct MdSmem {
  static constexpr int ROWS = 16 * MT, TILE = PD_TILE;
  static constexpr bool PREFETCH = false;  // block ids read at the barrier: no register held across a tile
  static constexpr int ROW = MD_HD * int(sizeof(CacheT)) + 16;  // a stage's row, bytes (+16: conflict-free)
  static constexpr int TROW = MD_HD * 2 + 16;                   // a 16-bit row, the mma operands' tile
  static constexpr int STAGE = PD_TILE * ROW;
  static constexpr int STAGES = MT == 1 ? MD_STAGES_16 : MD_STAGES_32;
  static constexpr int CONV = STAGES * STAGE;                   // fp8: the converted tile
  static constexpr int SPART = CONV + (sizeof(CacheT) == 1 ? PD_TILE * TROW : 0);  // [4][ROWS][32] floats
  static constexpr int P = SPART + 4 * ROWS * PD_TILE * 4;       // [ROWS][32] floats
  static constexpr int ALPHA = P + ROWS * PD_TILE * 4;           // [ROWS] this tile's rescale factors
  static constexpr int STATE = ALPHA + ROWS * 4;                 // [3][ROWS] each row's m, l and ALiBi slope
  static constexpr int BYTES = STATE + 3 * ROWS * 4;
};

// Issue tile `tile`'s latent rows into a stage (row j at j * ROW); rows past tile.n and bytes past head_size are
// zero-filled.
template <class CacheT, int ROW, int THREADS>
__device__ __forceinline__ void md_issue(unsigned char* stage, const CacheT* kv_cache,
                                         const KvRows<PD_TILE, sizeof(CacheT), false>& rows, KvTile tile,
                                         const PaParams& p) {
  kv_issue_rows<CacheT, PD_TILE, MD_HD, THREADS>(stage, kv_cache, [&](int j) { return rows.k[j]; },
                                                 16 / int(sizeof(CacheT)), 1, p.head_size, p.vec_k, tile.n,
                                                 [](int j, int c) { return j * ROW + c * 16; });
}

// fp8 stage -> the 16-bit tile, 8 codes a thread (8-byte reads, 16-byte writes: conflict-free); exact.
template <int KV, class T, int ROW, int TROW>
__device__ __forceinline__ void md_convert(unsigned char* dst, const unsigned char* src) {
  constexpr int CHUNKS = MD_HD / 8;
  for (int i = threadIdx.x; i < PD_TILE * CHUNKS; i += blockDim.x) {
    const int j = i / CHUNKS, c = i - j * CHUNKS;
    const uint2 codes = *reinterpret_cast<const uint2*>(src + j * ROW + c * 8);
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = tc_fp8x2<KV, T>((k < 2 ? codes.x : codes.y) >> (16 * (k % 2)));
    }
    *reinterpret_cast<uint4*>(dst + j * TROW + c * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Warp w's partial scores: m tile w / 4 (16 heads) x the tile's 32 keys over k16 steps 9 (w % 4) .. + 8, 16
// keys at a time (q stays in registers; 8 accumulators live, not 16).
template <class T, int ROWS, int TROW>
__device__ __forceinline__ void md_scores(float* spart, const unsigned char* kt, const unsigned (&qa)[9][4], int warp,
                                          int lane) {
  const int kq = warp & 3, i = lane >> 3, row = kq * ROWS + (warp >> 2) * 16 + (lane >> 2), col = 2 * (lane & 3);
#pragma unroll 1
  for (int np = 0; np < 2; ++np) {  // keys 16 np .. 16 np + 15: b0, b1 of two n tiles
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int k = 0; k < 9; ++k) {
      unsigned b[4];
      tc_ldmatrix_x4(b, kt + (np * 16 + (i >> 1) * 8 + (lane & 7)) * TROW + ((kq * 9 + k) * 16 + (i & 1) * 8) * 2);
      tc_mma<T>(s[0], qa[k], b[0], b[1]);
      tc_mma<T>(s[1], qa[k], b[2], b[3]);
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      *reinterpret_cast<float2*>(spart + md_at(row, col + 16 * np + 8 * n)) = make_float2(s[n][0], s[n][1]);
      *reinterpret_cast<float2*>(spart + md_at(row + 8, col + 16 * np + 8 * n)) = make_float2(s[n][2], s[n][3]);
    }
  }
}

// Row r = 4 warp + lane / 8, keys base + 4 (lane % 8) .. + 3 of a tile with n keys: the logit step in base 2
// (logits.cuh: q . k scaled once by qscale2 unless `biased`) and the online-softmax step of the row's (m, l, slope)
// in `state` (shared memory: registers are q's and o's), P and the row's rescale factor.
template <int ROWS>
__device__ __forceinline__ void md_softmax(const float* spart, float* ps, float* alpha_s, float* state, int r, int j0,
                                           int n, int base, int pos, bool biased, float qscale, float qscale2,
                                           float softcap) {
  float m = state[r];
  const float l = state[ROWS + r], slope = state[2 * ROWS + r];
  float4 acc = *reinterpret_cast<const float4*>(spart + md_at(r, j0));
#pragma unroll
  for (int kq = 1; kq < 4; ++kq) {  // row kq ROWS + r has r's swizzle: ROWS is a multiple of 4
    const float4 x = *reinterpret_cast<const float4*>(spart + md_at(kq * ROWS + r, j0));
    acc = make_float4(acc.x + x.x, acc.y + x.y, acc.z + x.z, acc.w + x.w);
  }
  float x[4] = {acc.x, acc.y, acc.z, acc.w}, mx = neg_inf();
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    if (biased) x[e] = pa_logit(x[e], qscale, softcap, slope, base + j0 + e, pos);
    if (j0 + e >= n) x[e] = neg_inf();  // the tile's n keys (all visible: one position); the rest are zero-filled
    mx = fmaxf(mx, x[e]);
  }
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float factor = biased ? 1.0f : qscale2;
  const float alpha = pa_rescale(m, mx * factor), pivot = pa_pivot(m);
  float sum = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    x[e] = pa_exp2(fmaf(x[e], factor, -pivot));  // masking by selection: 2^-inf = 0
    sum += x[e];
  }
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (j0 == 0) {  // every lane of the row has read the state (the shuffles above converged them)
    alpha_s[r] = alpha;
    state[r] = m;
    state[ROWS + r] = l * alpha + sum;
  }
  *reinterpret_cast<float4*>(ps + md_at(r, j0)) = make_float4(x[0], x[1], x[2], x[3]);
}

// o = o * alpha + P V for warp w's MW m tiles (rows row0 ..) and NC n8 tiles of columns c0 .., over k8 steps
// of keys (m16n8k8: half the fragment registers of k16, so q, o and the fragments fit 128 registers); one mma
// per part of P, the smallest first.
template <class T, int MW, int NC, int TROW>
__device__ __forceinline__ void md_values(float (&o)[MW][NC][4], const unsigned char* kt, const float* ps,
                                          const float* alpha_s, int row0, int c0, int lane) {
  constexpr int PARTS = TcHalf<T>::value ? 2 : 3;
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
    const float a0 = alpha_s[row0 + 16 * mi + (lane >> 2)], a1 = alpha_s[row0 + 16 * mi + (lane >> 2) + 8];
    if (__any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f))  // once the rows' maxima settle: no rescale
#pragma unroll
      for (int n = 0; n < NC; ++n) { o[mi][n][0] *= a0; o[mi][n][1] *= a0; o[mi][n][2] *= a1; o[mi][n][3] *= a1; }
  }
  // A fragments: (g, 2t..2t+1) and (g + 8, 2t..2t+1) of keys 8 kk .., rows row0 + 16 mi ..: every row of this
  // lane has the swizzle of row g (md_at), so one base address and constant offsets.
  const float* pa = ps + md_at(row0 + (lane >> 2), 2 * (lane & 3)) - 8 * (lane >> 2 & 3);
#pragma unroll 1
  for (int kk = 0; kk < PD_TILE / 8; ++kk) {  // not unrolled: fragments hoisted across steps would spill
    unsigned pf[MW][PARTS][2];
    const float* at = pa + 8 * (kk ^ (lane >> 2 & 3));
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
      float2 x0 = *reinterpret_cast<const float2*>(at + 16 * mi * PD_TILE);
      float2 x1 = *reinterpret_cast<const float2*>(at + (16 * mi + 8) * PD_TILE);
#pragma unroll
      for (int k = 0; k < PARTS; ++k) { pf[mi][k][0] = tc_part<T>(x0); pf[mi][k][1] = tc_part<T>(x1); }
    }
#pragma unroll
    for (int nq = 0; nq < NC / 4; ++nq) {  // columns c0 + 32 nq .. + 31: b0 of four n tiles (.trans of [key][col])
      unsigned b[4];
      tc_ldmatrix_x4_trans(b, kt + (8 * kk + (lane & 7)) * TROW + (c0 + 32 * nq + (lane >> 3) * 8) * 2);
#pragma unroll
      for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int k = PARTS - 1; k >= 0; --k) tc_mma_k8<T>(o[mi][4 * nq + i], pf[mi][k], b[i]);
    }
  }
}

// The end of a CTA: each lane's (row, column pair) of o, finished (sink, LSE) or written as a split's partials.
template <class T, int MW, int NC>
__device__ __forceinline__ void md_finish(const float (&o)[MW][NC][4], const float* state, int rows, int row0,
                                          int c0, int head0, int token, int split, int num_splits, int seq_len,
                                          float oscale, const float* sinks, T* out, float* lse, float* max_logits,
                                          float* exp_sums, void* tmp_output, const PaParams& p) {
  const int lane = threadIdx.x & 31;
  const bool partial = (num_splits > 1 || p.always_partials) && seq_len > 0;
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + 16 * mi + (lane >> 2) + 8 * h, head = head0 + r;
      if (head >= p.num_heads) continue;
      const float m = pa_natural(state[r]), l = state[rows + r];
      const long long th = (long long)token * p.num_heads + head;
      const SoftmaxFinish fin = softmax_finish(m, l, sinks ? sinks[head] : neg_inf());
      const float fp = oscale * (l > 0.0f ? 1.0f / l : 0.0f), fo = oscale * fin.scale;
#pragma unroll
      for (int n = 0; n < NC; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = c0 + 8 * n + 2 * (lane & 3) + e;
          if (d >= p.v_head_size) continue;
          if (partial)
            pa_store_partial<T>(tmp_output, (th * p.max_splits + split) * p.v_head_size + d, o[mi][n][2 * h + e] * fp,
                                p.partials_in_out_type);
          if (num_splits == 1)
            out[token * p.out_token_stride + head * p.out_head_stride + d] = from_float<T>(o[mi][n][2 * h + e] * fo);
        }
      if (c0 == 0 && (lane & 3) == 0) {
        if (partial) { max_logits[th * p.max_splits + split] = m; exp_sums[th * p.max_splits + split] = l; }
        if (num_splits == 1 && lse) lse[(long long)head * p.num_tokens + token] = fin.lse;
      }
    }
}

template <class T, int KV, int MT>
__global__ void __launch_bounds__(128 * MT, SM_REGISTERS / (128 * MT * MD_REGISTERS)) mla_decode_kernel(
    const T* __restrict__ q,                 // [num_tokens, num_heads, head_size <= 576]
    const typename CacheType<KV, T>::type* __restrict__ key_cache,    // [num_blocks, block_size, head_size] latent
    const typename CacheType<KV, T>::type* __restrict__ value_cache,  // the same array (rows 16-byte aligned)
    const int* __restrict__ block_tables,    // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,        // [num_seqs]
    const int* __restrict__ query_start_loc, // [num_seqs + 1], or nullptr: one query per sequence
    const int* __restrict__ seqused_k,       // dense: [num_seqs] or nullptr
    const unsigned char* __restrict__ custom_mask, const int* __restrict__ mask_indptr,  // nullptr: MLA takes none
    const float* __restrict__ sinks, const float* __restrict__ alibi_slopes,  // [num_heads] or nullptr
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,     // [1] or nullptr
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    void* __restrict__ tmp_output, PaParams p) {  // as paged_decode_kernel's
  typedef typename CacheType<KV, T>::type CacheT;
  typedef MdSmem<CacheT, MT> S;
  constexpr int MW = MT == 1 ? 1 : 2, NC = 16 / MW;  // P V: m tiles and n8 column tiles of a warp
  extern __shared__ __align__(16) unsigned char md_smem[];
  typedef KvRows<PD_TILE, sizeof(CacheT), false> Rows;
  __shared__ Rows kv_rows[S::STAGES];  // each stage's row offsets
  const int seq = blockIdx.z, split = blockIdx.x / p.decode_tiles, tile = blockIdx.x % p.decode_tiles;
  const int head_tiles = (p.num_heads + S::ROWS - 1) / S::ROWS, head0 = tile % head_tiles * S::ROWS;
  const PaSeq sq = pa_seq(seq, split, block_tables, seq_lens, query_start_loc, seqused_k, nullptr, p);
  if (sq.q_len > p.decode_max_q || split >= sq.splits.count) return;  // another kernel's
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float qscale = p.scale * (KV == KV_AUTO ? 1.0f : read_scale(k_scale, p.k_scale_value, 0, 0));
  const float qscale2 = qscale * PA_LOG2E;
  const bool biased = pa_biased(p.softcap, alibi_slopes, qscale2);
  const float oscale = KV == KV_AUTO ? 1.0f : read_scale(v_scale, p.v_scale_value, 0, 0);
  const int r = 4 * warp + (lane >> 3), j0 = (lane & 7) * 4;  // the softmax lane's row and keys
  const int row0 = 16 * MW * (warp / (4 * MW)), c0 = 8 * NC * (warp % (4 * MW));  // the P V slice
  float* state = reinterpret_cast<float*>(md_smem + S::STATE);
  float* ps = reinterpret_cast<float*>(md_smem + S::P);
  float* alpha_s = reinterpret_cast<float*>(md_smem + S::ALPHA);
  const int* table = block_tables + seq * p.table_stride;
  // The run's queries in turn (speculative decoding: q_len > 1), each at one position for all the CTA's heads:
  // query tile / head_tiles, then every p.decode_tiles / head_tiles further (a run longer than the hint said).
  for (int i = tile / head_tiles; i < sq.q_len; i += p.decode_tiles / head_tiles) {
    const int token = sq.q_start + i, pos = sq.seq_len - sq.q_len + i;
    const PaRange vis = pa_visible(pos, sq.seq_len, p);
    const int lo = max(vis.lo, sq.split_lo), hi = min(vis.hi, sq.split_hi);
    unsigned qa[9][4];  // A fragments of m tile warp / 4 over k16 steps 9 (warp % 4) .. + 8
#pragma unroll
    for (int k = 0; k < 9; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int head = head0 + (warp >> 2) * 16 + (lane >> 2) + (e & 1) * 8;
        const int d = ((warp & 3) * 9 + k) * 16 + 2 * (lane & 3) + (e >> 1) * 8;
        const T* row = q + token * p.q_token_stride + head * p.q_head_stride;
        const bool live = head < p.num_heads;
        qa[k][e] = tc_pack<T>(live && d < p.head_size ? row[d] : from_float<T>(0.0f),
                              live && d + 1 < p.head_size ? row[d + 1] : from_float<T>(0.0f));
      }
    if (j0 == 0) {
      state[r] = neg_inf();
      state[S::ROWS + r] = 0.0f;
      state[2 * S::ROWS + r] = alibi_slopes && head0 + r < p.num_heads ? alibi_slopes[head0 + r] : 0.0f;
    }
    float o[MW][NC][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi)
#pragma unroll
      for (int n = 0; n < NC; ++n) o[mi][n][0] = o[mi][n][1] = o[mi][n][2] = o[mi][n][3] = 0.0f;
    kv_pipeline<S>(md_smem, kv_rows, table, 0, lo, hi, p,
                   [&](unsigned char* stage, const Rows& tile_rows, KvTile t) {
      md_issue<CacheT, S::ROW, 128 * MT>(stage, key_cache, tile_rows, t, p);
    }, [&](const unsigned char* stage, int base) {
      const unsigned char* kt = stage;
      if constexpr (KV != KV_AUTO) {
        md_convert<KV, T, S::ROW, S::TROW>(md_smem + S::CONV, kt);
        kt = md_smem + S::CONV;
        __syncthreads();
      }
      md_scores<T, S::ROWS, S::TROW>(reinterpret_cast<float*>(md_smem + S::SPART), kt, qa, warp, lane);
      __syncthreads();  // the four partial sums of every score are in
      md_softmax<S::ROWS>(reinterpret_cast<const float*>(md_smem + S::SPART), ps, alpha_s, state, r, j0,
                          min(PD_TILE, hi - base + 1), base, pos, biased, qscale, qscale2, p.softcap);
      __syncthreads();  // P and the rescale factors are in
      md_values<T, MW, NC, S::TROW>(o, kt, ps, alpha_s, row0, c0, lane);
    });
    __syncthreads();  // the last tile's (m, l) are in
    md_finish<T, MW, NC>(o, state, S::ROWS, row0, c0, head0, token, split, sq.splits.count, sq.seq_len, oscale,
                         sinks, out, lse, max_logits, exp_sums, tmp_output, p);
    __syncthreads();  // the next query rewrites the rows' state and the stages
  }
}

}  // namespace cupaged
