// attention/merge.cuh: paged_attention_reduce_kernel<T>, the split merge: the partials of the KV splits of one
// (token, head) and PA_MERGE_COLS columns into out and the LSE, the sink added once (softmax_merge, softmax.cuh).
//
// Each split's weight goes once into shared memory, then the partial rows are read coalesced (4 columns a lane),
// the 4 warps' loads in flight together (each takes every fourth split), their sums added in a fixed order. The
// split count comes from pa_keys, as the kernels that wrote the partials took it; a sequence of one split was
// finished by its kernel and is skipped.
//
// Used by:   paged_attention.cu (launched by cupaged/attention.py run_attention after a kernel that splits)
// Test:      pytest tests/test_paged_attention.py tests/test_paged_attention_vllm.py tests/test_mla.py (splits)
// Benchmark: python profiling/bench_paged_attention.py
#pragma once
#include "../common.cuh"
#include "../softmax.cuh"
#include "params.cuh"

namespace cupaged {

constexpr int PA_MERGE_COLS = 128;  // the reduce kernel's output columns a CTA: 4 a lane

template <class T>
__global__ void __launch_bounds__(PA_THREADS) paged_attention_reduce_kernel(
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
    PaParams p, int num_seqs) {
  const int token = blockIdx.x, head = blockIdx.y;
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
  const int num_splits = pa_keys(seq, dense, seq_lens, seqused_k, p).splits.count;
  if (num_splits <= 1) return;  // finished by the main kernel
  const long long th = (long long)token * p.num_heads + head;
  const float* m = max_logits + th * p.max_splits;
  const float* l = exp_sums + th * p.max_splits;
  __shared__ SoftmaxMerge mg;
  __shared__ float share[PA_THREADS];  // w_s l_s of a chunk of splits, -1 for an empty one (skipped by selection)
  __shared__ __align__(16) float part[4][PA_MERGE_COLS];  // each warp's sums over its splits
  if (threadIdx.x == 0) mg = softmax_merge(m, l, num_splits, sinks ? sinks[head] : neg_inf());
  __syncthreads();
  // Lane l takes columns PA_MERGE_COLS blockIdx.z + 4 l .. + 3 (one vector load), warp w the splits w, w + 4, ...:
  // the 4 warps' loads in flight together. v_head_size is a multiple of 8: a lane's 4 columns are all in or out.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d0 = blockIdx.z * PA_MERGE_COLS + 4 * lane;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int s0 = 0; s0 < num_splits; s0 += PA_THREADS) {  // every split's weight once, then coalesced partial rows
    const int s = s0 + threadIdx.x;
    share[threadIdx.x] = s < num_splits && l[s] > 0.0f ? softmax_share(m[s], l[s], mg.mx) : -1.0f;
    __syncthreads();
    for (int i = warp; i < PA_THREADS && s0 + i < num_splits; i += 4) {
      const float w = share[i];
      if (w < 0.0f || d0 >= p.v_head_size) continue;
      const float4 x = pa_load_partial4<T>(tmp_output, (th * p.max_splits + s0 + i) * p.v_head_size + d0,
                                           p.partials_in_out_type);
      acc[0] += w * x.x; acc[1] += w * x.y; acc[2] += w * x.z; acc[3] += w * x.w;
    }
    __syncthreads();
  }
  *reinterpret_cast<float4*>(&part[warp][4 * lane]) = make_float4(acc[0], acc[1], acc[2], acc[3]);  // conflict-free
  __syncthreads();
  const int c = threadIdx.x, d = blockIdx.z * PA_MERGE_COLS + c;  // a column a thread: the warps' sums in a fixed order
  if (d < p.v_head_size)
    out[token * p.out_token_stride + head * p.out_head_stride + d] =
        from_float<T>((((part[0][c] + part[1][c]) + part[2][c]) + part[3][c]) * mg.inv);
  if (lse && threadIdx.x == 0 && blockIdx.z == 0) lse[(long long)head * p.num_tokens + token] = mg.lse;
}

}  // namespace cupaged
