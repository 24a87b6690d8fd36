// merge_attn_states.cu: merge two partial attention states (prefix and suffix) of the same queries.
//
// Maths, per (token t, head h), in float32 with LSEs in natural log (section 2.2 of arXiv 2501.01005;
// softmax.cuh's lse_merge, the arithmetic paged_attention.cu's split merge shares):
//   p, s = prefix_lse[h, t], suffix_lse[h, t], each +inf taken as -inf (FA2 writes +inf for empty rows)
//   M = max(p, s);  w_p = e^{p - M} / (e^{p - M} + e^{s - M}),  w_s = 1 - w_p (computed as its own ratio)
//   output[t, h, :] = w_p * prefix_output[t, h, :] + w_s * suffix_output[t, h, :]
//   output_lse[h, t] = M + log(e^{p - M} + e^{s - M})
// Special rows, copied bit for bit instead of merged:
//   p = s = -inf (no key on either side)          -> prefix_output, LSE -inf (never NaN)
//   t >= prefill_tokens_with_context (no prefix)   -> suffix_output, suffix_lse as stored
//
// Layouts (docs/conventions.md §4), strides in elements:
//   output, prefix_output, suffix_output  [num_tokens, num_heads, head_size]  any token and head stride
//                                         (padded heads, fused buffers), head_size contiguous
//   prefix_lse, suffix_lse, output_lse    [num_heads, num_tokens] float32, any strides
// output may be the very same view as prefix_output or suffix_output, and output_lse as prefix_lse or
// suffix_lse (merge in place): every element is read before it is written, see the barrier below.
//
// Versions (memory-bound: each output element reads 2 and writes 1 element, LSEs are 3 floats a row):
//   v1 merge_attn_states_kernel: a CTA is ROWS (token, head) rows x PACKS threads; a thread owns
//      16-byte packs of one row (one 128-bit load/store when VEC, i.e. the wrapper saw every address
//      and stride aligned; element by element otherwise). One 32-bit divide per thread, no 64-bit
//      index arithmetic on the hot path. Head size is a run-time value (any multiple of 8).
//
// Used by:   cupaged/merge_attn_states.py (the family and the op), mla.py (mla_chunked_prefill merges each
//            context chunk into the running state), selftest.py; oracle: cupaged/reference/merge_attn_states.py
// Test:      pytest tests/test_merge_attn_states.py     (sim; cuda too when a GPU is present); also
//            test_mla.py (chunked prefill), test_api_fuzz.py, test_compile_gate.py
// Benchmark: python profiling/bench_merge_attn_states.py
#include "common.cuh"
#include "softmax.cuh"

namespace cupaged {

constexpr int MERGE_THREADS = 256;  // per CTA (the launcher reads it from here)

// One 16-byte pack of T: a single vector access when VEC, else PACK scalar accesses.
template <class T, bool VEC>
__device__ __forceinline__ Vec<T, int(16 / sizeof(T))> load_pack(const T* p) {
  constexpr int PACK = int(16 / sizeof(T));
  if constexpr (VEC) {
    return load_vec<T, PACK>(p);
  } else {
    Vec<T, PACK> v;
#pragma unroll
    for (int i = 0; i < PACK; ++i) v.v[i] = p[i];
    return v;
  }
}

template <class T, bool VEC>
__device__ __forceinline__ void store_pack(T* p, const Vec<T, int(16 / sizeof(T))>& v) {
  constexpr int PACK = int(16 / sizeof(T));
  if constexpr (VEC) {
    store_vec<T, PACK>(p, v);
  } else {
#pragma unroll
    for (int i = 0; i < PACK; ++i) p[i] = v.v[i];
  }
}

// blockDim = (threads per row, rows per CTA); rows are (token, head) pairs, head fastest.
template <class T, bool VEC>
__global__ void __launch_bounds__(MERGE_THREADS) merge_attn_states_kernel(
    T* output,                            // [num_tokens, num_heads, head_size]
    float* output_lse,                    // [num_heads, num_tokens] or nullptr
    const T* prefix_output,               // [num_tokens, num_heads, head_size]
    const float* prefix_lse,              // [num_heads, num_tokens]
    const T* suffix_output,               // [num_tokens, num_heads, head_size]
    const float* suffix_lse,              // [num_heads, num_tokens]
    long long out_token_stride, long long out_head_stride,
    long long prefix_token_stride, long long prefix_head_stride,
    long long suffix_token_stride, long long suffix_head_stride,
    long long out_lse_head_stride, long long out_lse_token_stride,
    long long prefix_lse_head_stride, long long prefix_lse_token_stride,
    long long suffix_lse_head_stride, long long suffix_lse_token_stride,
    int num_tokens, int num_heads, int head_size, int prefill_tokens_with_context) {
  constexpr int PACK = int(16 / sizeof(T));
  const unsigned row = blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < unsigned(num_tokens) * unsigned(num_heads);
  const int token = live ? int(row / unsigned(num_heads)) : 0;
  const int head = live ? int(row - unsigned(token) * unsigned(num_heads)) : 0;
  float p = 0.0f, s = 0.0f;
  if (live) {
    p = prefix_lse[head * prefix_lse_head_stride + token * prefix_lse_token_stride];
    s = suffix_lse[head * suffix_lse_head_stride + token * suffix_lse_token_stride];
  }
  // In place, output_lse is prefix_lse or suffix_lse: every thread of the CTA (a row's threads all
  // sit in one CTA) must have read its row's LSEs before thread x = 0 overwrites them.
  __syncthreads();
  if (!live) return;

  const bool no_prefix = token >= prefill_tokens_with_context;
  const LseMerge mg = lse_merge(p, s);
  if (output_lse != nullptr && threadIdx.x == 0)
    output_lse[head * out_lse_head_stride + token * out_lse_token_stride] = no_prefix ? s : mg.lse;

  T* out = output + token * out_token_stride + head * out_head_stride;
  const T* pre = prefix_output + token * prefix_token_stride + head * prefix_head_stride;
  const T* suf = suffix_output + token * suffix_token_stride + head * suffix_head_stride;
  const T* copy_from = no_prefix ? suf : mg.lse == neg_inf() ? pre : nullptr;  // the same for the whole row
  for (int e = threadIdx.x * PACK; e < head_size; e += blockDim.x * PACK) {
    if (copy_from != nullptr) {
      store_pack<T, VEC>(out + e, load_pack<T, VEC>(copy_from + e));
    } else {
      const Vec<T, PACK> a = load_pack<T, VEC>(pre + e), b = load_pack<T, VEC>(suf + e);
      Vec<T, PACK> o;
#pragma unroll
      for (int i = 0; i < PACK; ++i) o.v[i] = from_float<T>(mg.w1 * to_float(a.v[i]) + mg.w2 * to_float(b.v[i]));
      store_pack<T, VEC>(out + e, o);
    }
  }
}

}  // namespace cupaged
