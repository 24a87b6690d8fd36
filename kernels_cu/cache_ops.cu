// cache_ops.cu: scatter new keys/values into the paged KV cache.
//
// Maths: key_cache[slot / block_size, slot % block_size, h, :] = key[t, h, :] for every token t
// whose slot = slot_mapping[t] is >= 0 (negative slots are padding and skipped); same for values.
//
// Layouts (DESIGN.md §4), all strides in elements, last dimension contiguous:
//   key, value           [num_tokens, num_kv_heads, head_size]   any token / head stride (fused QKV views)
//   key/value_cache NHD  [num_blocks, block_size, num_kv_heads, head_size]
//                   HND  [num_blocks, num_kv_heads, block_size, head_size]
// Both cache layouts are one kernel: the wrapper passes (block, slot-in-block, head) strides.
//
// Versions:
//   v1 reshape_and_cache_flash_kernel: one CTA per token, each thread moves 16-byte vectors
//      (VEC elements) of every head; VEC = 1 when an address or stride is not 16-byte aligned.
//      Pure copy: memory-bound, every byte read once and written once.
//
// Test:      pytest tests/test_cache_ops.py        (sim; cuda too when a GPU is present)
// Benchmark: python profiling/bench_cache_ops.py
#include "common.cuh"

namespace cupaged {

template <class T, class SlotT, int VEC>
__global__ void __launch_bounds__(256) reshape_and_cache_flash_kernel(
    const T* __restrict__ key,              // [num_tokens, num_kv_heads, head_size]
    const T* __restrict__ value,            // [num_tokens, num_kv_heads, head_size]
    T* __restrict__ key_cache,              // [num_blocks, block_size, num_kv_heads, head_size] (NHD) or HND
    T* __restrict__ value_cache,            // same shape and strides as key_cache
    const SlotT* __restrict__ slot_mapping, // [num_tokens]; < 0 = padding
    long long key_stride, long long key_head_stride,
    long long value_stride, long long value_head_stride,
    long long block_stride, long long page_stride, long long head_stride,
    int num_kv_heads, int head_size, int block_size) {
  const long long token = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[token]);
  if (slot < 0) return;
  const long long block = slot / block_size;
  const long long offset = slot % block_size;
  const long long cache_base = block * block_stride + offset * page_stride;
  const int vecs_per_head = head_size / VEC;
  const int n = num_kv_heads * vecs_per_head;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / vecs_per_head;
    const int e = (i - h * vecs_per_head) * VEC;
    const long long dst = cache_base + h * head_stride + e;
    store_vec<T, VEC>(key_cache + dst, load_vec<T, VEC>(key + token * key_stride + h * key_head_stride + e));
    store_vec<T, VEC>(value_cache + dst, load_vec<T, VEC>(value + token * value_stride + h * value_head_stride + e));
  }
}

}  // namespace cupaged
