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
  PaRow row{0, 0, 0, -1, 0.0f, neg_inf(), 0};
  if (r < nrows) {
    const int i = (row0 + r) / group;
    row.pos = sq.seq_len - sq.q_len + i;
    row.token = sq.q_start + i;
    row.head = kv_head * group + (row0 + r) % group;
    const PaRange vis = pa_visible(row.pos, sq.seq_len, p);
    row.lo = max(vis.lo, sq.split_lo);
    row.hi = min(vis.hi, sq.split_hi);
    row.slope = alibi_slopes ? alibi_slopes[row.head] : 0.0f;
    row.sink = sinks ? sinks[row.head] : neg_inf();
  }
  return row;
}

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

// The logit of key `key` for a query row at `pos` with ALiBi slope `slope` (0 without ALiBi). paged_decode_kernel,
// one key at a time on CUDA cores, composes the two steps itself and branches over the bias when the launch has no
// slopes (the same floats, a conversion and an FMA less); in the tensor-core kernels' unrolled fragment loops that
// branch moved ptxas's register allocation by up to 19 registers, so they always subtract it.
__device__ __forceinline__ float pa_logit(float qk, float qscale, float softcap, float slope, int key, int pos) {
  return pa_alibi(pa_capped_logit(qk, qscale, softcap), slope, key, pos);
}

// Whether a row whose visible keys are lo..hi (pa_row: its window and causal bound within its split) sees `key`;
// a key it does not see is selected out, never weighted by 0.
__device__ __forceinline__ bool pa_sees(int key, int lo, int hi) { return key >= lo && key <= hi; }

// The online-softmax rescale: a row's running max m meets logits whose max is mx; m moves on to max(m, mx) and
// the returned factor rescales the row's sum and output so far (0 while the row has seen no key).
__device__ __forceinline__ float pa_rescale(float& m, float mx) {
  const float mn = fmaxf(m, mx);
  const float alpha = softmax_weight(m, mn);
  m = mn;
  return alpha;
}

}  // namespace cupaged
