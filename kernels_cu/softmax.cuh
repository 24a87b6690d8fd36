// softmax.cuh: finishing and merging softmax states, the arithmetic every attention kernel shares.
//
// Maths. A softmax state over a set of logits s_j is (m, l) with m = max_j s_j and l = sum_j e^{s_j - m},
// so LSE = m + log l; the empty set is (-inf, 0). Attention carries with it the normalised output
// o = sum_j e^{s_j - m} v_j / l. States over disjoint sets of keys, i = 1..n, merge into one:
//   M = max_i m_i over non-empty states,  w_i = e^{m_i - M} (0 for an empty state),  L = sum_i w_i l_i,
//   out = sum_i w_i l_i o_i / L,  LSE = M + log L.
// An LSE alone is the state (LSE, 1). A sink logit (docs/conventions.md §4) is the state (sink, 1) with
// no output: it joins M and L once, in the final merge (never in a split's partial), and adds nothing to
// out. L = 0 (every state empty, no sink) gives out 0 and LSE -inf, never 0/0. Empty states are skipped
// by selection, never weighted by zero: an empty split's m or partial output may be -inf or garbage.
//
// Used by:   paged_attention.cu (softmax_finish: one CTA's state and the sink; softmax_merge: a warp's merge of
//            the splits in attention/merge.cuh; softmax_weight: the online-softmax step of attention/logits.cuh),
//            merge_attn_states.cu (lse_merge: two LSE states).
// Python:    through those kernels: cupaged/attention.py (and the ops on it: paged_attention.py,
//            paged_attention_vllm.py, varlen_attention.py, mla.py), merge_attn_states.py.
// Test:      pytest tests/test_paged_attention.py tests/test_merge_attn_states.py tests/test_decode_accuracy.py
//            (and every test those kernels' headers list)
// Benchmark: python profiling/bench_paged_attention.py; bench_mla.py; bench_merge_attn_states.py
#pragma once
#include "common.cuh"

namespace cupaged {

// M so far, folding in state (m, l); start from the sink (-inf without one).
__device__ __forceinline__ float softmax_max(float mx, float m, float l) { return l > 0.0f ? fmaxf(mx, m) : mx; }

// e^{x - M} for x <= M: the weight of logit x, or the factor that rescales a state whose max was x, under the max
// M; 0 for x = -inf (a masked logit, an empty state, no sink): selected, never e^{-inf - (-inf)} = NaN.
__device__ __forceinline__ float softmax_weight(float x, float mx) { return x == neg_inf() ? 0.0f : expf(x - mx); }

// LSE = M + log L; -inf when L = 0 (nothing visible, no sink).
__device__ __forceinline__ float softmax_lse(float mx, float total) {
  return total > 0.0f ? mx + logf(total) : neg_inf();
}

// One state (m, l) whose output is still the unnormalised sum acc = l o, finished with the sink:
// out = acc * scale (0 for an empty row), lse as above.
struct SoftmaxFinish {
  float scale, lse;
};

__device__ __forceinline__ SoftmaxFinish softmax_finish(float m, float l, float sink) {
  const float mx = softmax_max(sink, m, l);
  const float w = l > 0.0f ? expf(m - mx) : 0.0f;
  const float total = softmax_weight(sink, mx) + w * l;
  return {total > 0.0f ? w / total : 0.0f, softmax_lse(mx, total)};
}

// n states (m[i], l[i]), the sink and a prior state (cascade's: an LSE, l = 1; -inf: none), merged by the 32 lanes
// of a warp (lane i folds states i, i + 32, ...):
// M, L and the LSE, the same bits in every lane (a butterfly's two partners add the same two numbers) and fixed by
// n alone. The caller weights the output o_i of each non-empty state (l[i] > 0) by softmax_share(m[i], l[i], M)
// and scales the sum by softmax_inverse(L), taken right after the merge: the IEEE reciprocal's slow path is a
// call, and the registers live across it (many, after the weighted loop) are saved to local memory.
struct SoftmaxMerge {
  float mx, total, lse;
};

// 1 / L, 0 when L = 0 (nothing visible, no sink).
// L >= 1 when positive (the state holding M adds e^0 l >= 1), so MUFU.RCP's estimate refined by one Newton step is
// within an ulp of the IEEE reciprocal and needs no slow path: __frcp_rn's is a call, and the registers live
// across it (the prior state's output, cascade's) were saved to local memory (8-20 B of spills on sm_80 / sm_90).
__device__ __forceinline__ float softmax_inverse(float total) {
  if (!(total > 0.0f)) return 0.0f;
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(total));
  return fmaf(fmaf(-total, r, 1.0f), r, r);
}

// w_i l_i, the term of a non-empty state in L.
__device__ __forceinline__ float softmax_share(float m, float l, float mx) { return expf(m - mx) * l; }

__device__ __forceinline__ SoftmaxMerge softmax_merge(const float* m, const float* l, int n, float sink, float prior,
                                                      int lane) {
  float mx = fmaxf(sink, prior);
#pragma unroll 1
  for (int i = lane; i < n; i += 32) mx = softmax_max(mx, m[i], l[i]);
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float total = lane == 0 ? softmax_weight(sink, mx) + softmax_weight(prior, mx) : 0.0f;
#pragma unroll 1
  for (int i = lane; i < n; i += 32)
    if (l[i] > 0.0f) total += softmax_share(m[i], l[i], mx);
  for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
  return {mx, total, softmax_lse(mx, total)};
}

// Two LSE states with normalised outputs o1, o2: out = w1 o1 + w2 o2 and the merged LSE. An infinite LSE
// of either sign is an empty state (FlashAttention-2 writes +inf for a row without keys). Both empty:
// w1 = 1, w2 = 0 and LSE -inf, and only then is the LSE -inf (callers copy o1 bit for bit).
struct LseMerge {
  float w1, w2, lse;
};

// An LSE as a state's logit: an infinite one of either sign is an empty state, -inf.
__device__ __forceinline__ float lse_state(float lse) { return isinf(lse) ? neg_inf() : lse; }

__device__ __forceinline__ LseMerge lse_merge(float lse1, float lse2) {
  lse1 = lse_state(lse1);
  lse2 = lse_state(lse2);
  const float mx = fmaxf(lse1, lse2);
  if (mx == neg_inf()) return {1.0f, 0.0f, neg_inf()};
  const float e1 = expf(lse1 - mx), e2 = expf(lse2 - mx), total = e1 + e2;
  return {e1 / total, e2 / total, mx + logf(total)};  // ratios first: never scale an output by e^{...} alone
}

}  // namespace cupaged
