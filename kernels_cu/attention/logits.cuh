// attention/logits.cuh: the logit step, written once for every attention kernel of paged_attention.cu.
//
// Maths, for key j of a query row at position pos (docs/conventions.md §4):
//   s_j = softcap(scale * q . k_j) - slope * |j - pos|      softcap(x) = c tanh(x / c), before the bias
// for the keys the row sees (its window, causality, its split's keys: lo..hi); the others are masked by
// selection, never by a zero weight times a loaded value. The online softmax keeps a row's running max m and
// sum l = sum_j e^{s_j - m}: a tile of logits with max mx moves m to max(m, mx) and rescales l and the output
// accumulated so far by e^{m_old - m} (pa_rescale), then adds its weights e^{s_j - m} (softmax_weight,
// softmax.cuh). The sink joins once, when a row is finished or its splits merged (softmax_finish, softmax_merge).
//
// The kernels hold their scores in different places (a lane's keys of one row in paged_decode_kernel, mma
// fragments in paged_decode_mma_kernel and paged_prefill_kernel, rows of shared memory in mla_decode_kernel), so
// each walks its own layout and calls these for each score and each row: the same floats in the same order in
// all of them. Which keys a row sees is decided here once (pa_visible, pa_row); mla_decode_kernel's rows all see
// every key it loads (one query position a pass), so it masks only the zero-filled tail of its last tile.
//
// Used by:   decode.cuh (pd_consume), decode_mma.cuh (pm_softmax), prefill.cuh (pf_softmax),
//            mla_decode.cuh (md_softmax); pa_row also by the kernels' row tiles
// Test:      pytest tests/test_paged_attention.py tests/test_varlen_attention.py tests/test_decode_accuracy.py
//            (softcap, ALiBi, windows, sinks on every kernel); tests/test_source_layout.py (written once)
#pragma once
#include "../softmax.cuh"
#include "params.cuh"

namespace cupaged {

// One query row of a CTA.
struct PaRow {
  int token, head, lo, hi;  // keys lo..hi (inclusive) are visible within this split
  float slope, sink;
  int pos;                  // the query's position (the ALiBi distance)
  int mask_bit;             // custom masks: the bit of key 0 in this row of its sequence's mask
  int full;                 // keys 0 .. full - 1 all pass the row's custom mask (pa_mask_full; seq_len without one)
};

// The keys 0 .. seq_len - 1 a query at position pos sees: pos - window_left .. pos + window_right, each side
// unbounded at -1 (an empty range when lo > hi, e.g. a causal query before the first key).
struct PaRange {
  int lo, hi;
};

__device__ __forceinline__ PaRange pa_visible(int pos, int seq_len, const PaParams& p) {
  const int lo = p.window_left >= 0 && p.window_left < pos ? pos - p.window_left : 0;
  const int hi = p.window_right >= 0 && p.window_right < seq_len - 1 - pos ? pos + p.window_right : seq_len - 1;
  return {lo, hi};
}

// Query row r of a CTA's row tile at row0 ((token, head) pairs of the sequence's GQA group, token-major): its
// keys lo..hi within this split (lo > hi: none, as for rows past nrows), its ALiBi slope and its sink.
__device__ __forceinline__ PaRow pa_row(int r, int row0, int nrows, int group, int kv_head, const PaSeq& sq,
                                        const float* sinks, const float* alibi_slopes, const PaParams& p) {
  PaRow row{0, 0, 0, -1, 0.0f, neg_inf(), 0, 0, sq.seq_len};
  if (r < nrows) {
    const int i = (row0 + r) / group;
    row.pos = sq.seq_len - sq.q_len + i;
    row.token = sq.q_start + i;
    row.head = kv_head * group + (row0 + r) % group;
    row.mask_bit = sq.mask0 + i * sq.seq_len;  // row i of the sequence's q_len x seq_len mask
    const PaRange vis = pa_visible(row.pos, sq.seq_len, p);
    row.lo = max(vis.lo, sq.split_lo);
    row.hi = min(vis.hi, sq.split_hi);
    row.slope = alibi_slopes ? alibi_slopes[row.head] : 0.0f;
    row.sink = sinks ? sinks[row.head] : neg_inf();
  }
  return row;
}

// Base 2. The kernels' online softmax runs on logits times log2(e), so a weight is one MUFU.EX2: e^{s - m} =
// 2^{s2 - m2}, s2 = log2(e) s. Without softcap and ALiBi, log2(e) is folded into the score's scale (s2 = qk *
// qscale2, qscale2 = log2(e) qscale: one multiply a score); with them, the natural logit (pa_logit) is scaled.
// The row's max leaves the kernel in natural units (pa_natural), where the LSE, the split partials and the sink
// live.
constexpr float PA_LOG2E = 1.4426950408889634f;
constexpr float PA_LN2 = 0.6931471805599453f;

// 2^x, flushed to zero below 2^-126 (a weight that small is 0 beside the row's largest, which is 1); 2^-inf = 0.
__device__ __forceinline__ float pa_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Whether a launch takes the logit step's slow path (pa_logit): softcap or ALiBi on, or a scale qscale2 = log2(e)
// qscale that cannot stand for the logit's order (not positive).
__device__ __forceinline__ bool pa_biased(float softcap, const float* alibi_slopes, float qscale2) {
  return softcap > 0.0f || alibi_slopes || !(qscale2 > 0.0f);
}

// A base-2 max in natural units.
__device__ __forceinline__ float pa_natural(float m2) { return m2 * PA_LN2; }

// The max a row's base-2 weights are taken against: m2, or 0 while the row has seen no key (every logit so far
// -inf, whose weight 2^{-inf - 0} is 0: no -inf - (-inf)).
__device__ __forceinline__ float pa_pivot(float m2) { return m2 == neg_inf() ? 0.0f : m2; }

// The logit before its bias: the score qk = q . k times qscale (the softmax scale, an fp8 K scale folded in),
// soft-capped (softcap 0: none).
__device__ __forceinline__ float pa_capped_logit(float qk, float qscale, float softcap) {
  float x = qk * qscale;
  if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
  return x;
}

// ALiBi's bias on logit x of key `key` for a query at `pos` (slope 0: none, and an exact 0 subtracted).
__device__ __forceinline__ float pa_alibi(float x, float slope, int key, int pos) {
  return x - slope * fabsf(float(key - pos));
}

// The logit of key `key` for a query row at `pos` with ALiBi slope `slope` (0 without ALiBi), in base 2 (see
// below): the kernels take it where softcap or ALiBi is on, and qk * qscale2 where neither is.
__device__ __forceinline__ float pa_logit(float qk, float qscale, float softcap, float slope, int key, int pos) {
  return pa_alibi(pa_capped_logit(qk, qscale, softcap), slope, key, pos) * PA_LOG2E;
}

// Whether a row whose visible keys are lo..hi (pa_row: its window and causal bound within its split) sees `key`;
// a key it does not see is selected out, never weighted by 0.
__device__ __forceinline__ bool pa_sees(int key, int lo, int hi) { return key >= lo && key <= hi; }

// And with a custom mask (FlashInfer's: per sequence a q_len x seq_len bit matrix, row-major, packed little-endian by
// 8 from the sequence's byte mask_indptr[seq]; nullptr: none), whether the row's mask keeps `key`. The mask byte is
// read only for a key the row's range admits, so a row past nrows (an empty range) reads none.
__device__ __forceinline__ bool pa_mask_bit(const unsigned char* custom_mask, int bit) {
  return custom_mask[bit >> 3] >> (bit & 7) & 1;
}

__device__ __forceinline__ bool pa_row_sees(const PaRow& row, int key, const unsigned char* custom_mask) {
  return pa_sees(key, row.lo, row.hi) && (!custom_mask || pa_mask_bit(custom_mask, row.mask_bit + key));
}

// The first of the row's visible keys its custom mask drops (seq_len when it drops none, or without a mask): a tile
// before it needs no mask test. A tree's every node sees the whole context, so only the tiles of its own nodes are
// tested. A scan of whole 32-bit words (the wrapper aligns the mask to 4 bytes), once a row and a row tile.
__device__ __forceinline__ int pa_mask_full(const unsigned char* custom_mask, const PaRow& row, int seq_len) {
  if (!custom_mask || row.lo > row.hi) return seq_len;
  const int n = row.hi + 1;
  int j = 0;
  for (; j < n && (row.mask_bit + j) % 32; ++j)
    if (!pa_mask_bit(custom_mask, row.mask_bit + j)) return j;
  const unsigned* words = reinterpret_cast<const unsigned*>(custom_mask);
  while (j + 32 <= n && words[(row.mask_bit + j) / 32] == 0xffffffffu) j += 32;
  for (; j < n; ++j)
    if (!pa_mask_bit(custom_mask, row.mask_bit + j)) return j;
  return seq_len;
}

// A decode kernel's row r, kept in shared memory by thread r with its mask's full prefix (pa_mask_full), and the
// keys every row of the tile sees (hi_all): with a custom mask, none past a row's first drop (a barrier publishes
// the rows first: uniform, every thread or none).
__device__ __forceinline__ void pa_keep_row(PaRow* rows, int r, PaRow row, const unsigned char* custom_mask,
                                            int seq_len) {
  if (threadIdx.x != r) return;
  row.full = pa_mask_full(custom_mask, row, seq_len);
  rows[r] = row;
}

__device__ __forceinline__ int pa_unmasked_hi(const PaRow* rows, int nrows, int hi_all,
                                              const unsigned char* custom_mask) {
  if (!custom_mask) return hi_all;
  __syncthreads();
  for (int r = 0; r < nrows; ++r) hi_all = min(hi_all, rows[r].full - 1);
  return hi_all;
}

// The online-softmax rescale (base 2): a row's running max m meets logits whose max is mx; m moves on to
// max(m, mx) and the returned factor rescales the row's sum and output so far (0 while the row has seen no key).
__device__ __forceinline__ float pa_rescale(float& m, float mx) {
  const float mn = fmaxf(m, mx);
  const float alpha = m == neg_inf() ? 0.0f : pa_exp2(m - mn);
  m = mn;
  return alpha;
}

// The lazy rescale of the prefill kernels: m moves on only where the tile's max passes it by more than
// `headroom` (base 2), so most tiles leave the row's sum and output as they are (factor 1: the caller skips the
// pass over o). Weights are then up to 2^headroom, not 1: exact in float32 and well inside 16-bit P's range; the
// sum, the LSE (m + log l) and a split's partials (m, l relative to it) are the same numbers.
__device__ __forceinline__ float pa_rescale(float& m, float mx, float headroom) {
  if (m != neg_inf() && !(mx > m + headroom)) return 1.0f;
  return pa_rescale(m, mx);
}

}  // namespace cupaged
