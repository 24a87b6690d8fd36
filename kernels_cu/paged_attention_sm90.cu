// paged_attention_sm90.cu: the Hopper (sm_90a) kernels of paged attention, a family of their own because they are
// built for sm_90a alone (wgmma, setmaxnreg); the plan takes them on sm_90 and paged_attention.cu's elsewhere.
//
// Maths, parameters, layouts and results: paged_attention.cu's (one PaParams, one launch signature, one oracle);
//   out[i, h] = softmax(softcap(scale q_i . k_j) - slope_h |j - p_i| over the keys row i sees) V, LSE, split partials.
//   q            [num_tokens, num_heads, head_size], 16-bit
//   key_cache    [num_blocks, block_size, num_kv_heads, head_size] (NHD), [num_blocks, num_kv_heads, block_size,
//                head_size] (HND), or dense rows [total_k, num_kv_heads, head_size]; 16-bit or fp8 codes
//   value_cache  likewise with v_head_size
//   out          [num_tokens, num_heads, v_head_size]; lse [num_heads, num_tokens] float32
//
// Kernels:
//   attention/prefill_sm90.cuh  paged_prefill_sm90_kernel<T, KV, HD, VHD>: the long query runs, warp-specialised:
//                               a producer warpgroup streams K/V tiles into an mbarrier ring, two consumer warpgroups
//                               run wgmma (FlashAttention-3's structure; docs/hopper-prefill.md)
// and the Hopper instructions they use: wgmma.cuh.
//
// Versions:
//   v1: paged_prefill_sm90_kernel: 128 rows a CTA (2 consumer warpgroups of 64), 64-key tiles, 2-4 stages by head
//       size, cp.async producer for 16-bit rows (any layout kv_issue reads), registers for fp8 (converted to q's
//       type on the way) and unaligned rows; no ping-pong or intra-warpgroup overlap yet.
//
// Uses:      attention/*.cuh (params, logits, kv_pipeline, prefill's softmax and store), wgmma.cuh
// Used by:   cupaged/_attention_kernels.py (HOPPER_FAMILY, prefill_route with arch sm_90), cupaged/attention.py
// Test:      pytest tests/test_paged_attention_sm90.py; tests/test_compile_gate.py (sm_90a, no spills)
// Benchmark: python profiling/bench_paged_attention.py --model --arch sm_90
#include "attention/prefill_sm90.cuh"
