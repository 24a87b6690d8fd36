// attention/merge.cuh: paged_attention_reduce_kernel<T>, the split merge: the partials of the KV splits of one
// (token, head) and PA_MERGE_COLS columns into out and the LSE, the sink added once (softmax_merge, softmax.cuh).
//
// A warp a (token, head, PA_MERGE_COLS columns), 4 columns a lane (one vector load a split): the warp merges the
// splits' states itself (no barrier; the 4 warps of an MLA head's 512 columns each do the same few instructions),
// then takes the splits PA_MERGE_LOADS at a time (i + k <= 31: n <= 32), their weights shuffled from the lanes
// that computed them and their loads in flight together, added in split order. The split count comes from
// pa_keys, as the kernels that wrote the partials took it; a sequence of one split was finished by its kernel.
//
// Used by:   paged_attention.cu (launched by cupaged/attention.py run_attention after a kernel that splits)
// Test:      pytest tests/test_paged_attention.py tests/test_paged_attention_vllm.py tests/test_mla.py (splits)
// Benchmark: python profiling/bench_paged_attention.py
#pragma once
#include "../common.cuh"
#include "../softmax.cuh"
#include "params.cuh"

namespace cupaged {

constexpr int PA_MERGE_COLS = 128;  // the reduce kernel's output columns a warp: 4 a lane
constexpr int PA_MERGE_LOADS = 8;   // splits a lane loads back to back: 128 bytes in flight
constexpr int PA_MERGE_CTAS = 5;    // CTAs an SM the registers allow: ptxas's budget (its own choice spilled 4-20 B)

template <class T>
__global__ void __launch_bounds__(PA_THREADS, PA_MERGE_CTAS) paged_attention_reduce_kernel(
    T* __restrict__ out,                     // [num_tokens, num_heads, v_head_size]
    float* __restrict__ lse,                 // [num_heads, num_tokens] or nullptr
    const float* __restrict__ max_logits,    // [num_tokens, num_heads, max_splits]
    const float* __restrict__ exp_sums,      // [num_tokens, num_heads, max_splits]
    const void* __restrict__ tmp_output,     // [num_tokens, num_heads, max_splits, v_head_size] float32 or T
    const int* __restrict__ seq_lens,        // [num_seqs], or cu_seqlens_k [num_seqs + 1] (dense)
    int dense,
    const int* __restrict__ query_start_loc, // [num_seqs + 1] or nullptr
    const int* __restrict__ seqused_k,       // dense: [num_seqs] or nullptr
    const float* __restrict__ sinks,         // [num_heads] or nullptr
    const float* __restrict__ prior_lse,     // [num_heads, num_tokens]: a prior state whose output is out (cascade),
    PaParams p, int num_seqs) {              // merged as one more split; or nullptr
  const int token = blockIdx.x, lane = threadIdx.x % 32;
  const int chunks = (p.v_head_size + PA_MERGE_COLS - 1) / PA_MERGE_COLS;
  const int item = blockIdx.y * (PA_THREADS / 32) + threadIdx.x / 32;  // the warp's (head, column chunk)
  if (item >= p.num_heads * chunks) return;
  const int head = item / chunks, d0 = item % chunks * PA_MERGE_COLS + 4 * lane;
  int seq = token;
  if (query_start_loc) {  // the sequence holding this token: last s with query_start_loc[s] <= token
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
    }
    seq = lo;
    if (token >= query_start_loc[num_seqs]) return;
  }
  const PaKeys keys = pa_keys(seq, dense, seq_lens, seqused_k, p);
  const int num_splits = keys.seq_len > 0 || !prior_lse ? keys.splits.count : 0;  // no keys: no partials written
  if (num_splits <= 1 && !prior_lse) return;  // finished by the main kernel
  const long long th = (long long)token * p.num_heads + head;
  const float* m = max_logits + th * p.max_splits;
  const float* l = exp_sums + th * p.max_splits;
  const float sink = sinks ? sinks[head] : neg_inf();
  const float prior = prior_lse ? lse_state(prior_lse[(long long)head * p.num_tokens + token]) : neg_inf();
  const SoftmaxMerge mg = softmax_merge(m, l, num_splits, sink, prior, lane);
  const float inv = softmax_inverse(mg.total);
  if (lse && lane == 0 && item % chunks == 0) lse[(long long)head * p.num_tokens + token] = mg.lse;
  // v_head_size is a multiple of 8: a lane's 4 columns are all in or out.
  const bool live = d0 < p.v_head_size;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int s0 = 0; s0 < num_splits; s0 += 32) {
    const int s = s0 + lane, n = min(32, num_splits - s0);  // w_s l_s of split s, -1 for an empty one (skipped)
    const float share = s < num_splits && l[s] > 0.0f ? softmax_share(m[s], l[s], mg.mx) : -1.0f;
    for (int i = 0; i < n; i += PA_MERGE_LOADS) {  // the weights first, then every load of the group in flight
      float w[PA_MERGE_LOADS];
      float4 x[PA_MERGE_LOADS];
#pragma unroll
      for (int k = 0; k < PA_MERGE_LOADS; ++k) {
        const float wk = __shfl_sync(0xffffffffu, share, i + k);
        w[k] = i + k < n && live ? wk : -1.0f;
      }
#pragma unroll
      for (int k = 0; k < PA_MERGE_LOADS; ++k)
        if (w[k] >= 0.0f)
          x[k] = pa_load_partial4<T>(tmp_output, (th * p.max_splits + s0 + i + k) * p.v_head_size + d0,
                                     p.partials_in_out_type);
#pragma unroll
      for (int k = 0; k < PA_MERGE_LOADS; ++k)
        if (w[k] >= 0.0f) {
          acc[0] += w[k] * x[k].x; acc[1] += w[k] * x[k].y; acc[2] += w[k] * x[k].z; acc[3] += w[k] * x[k].w;
        }
    }
  }
  T* o = out + token * p.out_token_stride + head * p.out_head_stride + d0;
  if (!live) return;
  if (prior_lse) {  // the prior state's output, this lane's columns of out: read (its LSE again) before written
    const float w = softmax_weight(lse_state(prior_lse[(long long)head * p.num_tokens + token]), mg.mx);
    for (int k = 0; k < 4; ++k) acc[k] += w > 0.0f ? w * to_float(o[k]) : 0.0f;
  }
  for (int k = 0; k < 4; ++k) o[k] = from_float<T>(acc[k] * inv);
}

}  // namespace cupaged
