// cache_ops.cu: write new keys/values into the paged KV cache (reads and block copies: cache_gather.cu),
// and convert whole arrays to and from fp8 codes (vLLM's convert_fp8).
//
// Maths: cache[slot / block_size, slot % block_size, h, :] = quantize(key[t, h, :], k_scale[h])
// for every token t whose slot = slot_mapping[t] >= 0 (negative slots are padding); quantize is
// the identity for kv_cache_dtype "auto" and saturate(x / scale) to fp8 e4m3/e5m2 otherwise.
// convert_fp8, elementwise: codes = saturate(x / scale) (floats -> uint8), or x = float(code) * scale.
//
// Layouts (docs/conventions.md §4), strides in elements, last dimension contiguous:
//   key, value           [num_tokens, num_kv_heads, head_size]   any token / head stride (fused QKV views)
//   slot_mapping         int64 or int32 [num_tokens]
//   flash NHD            [num_blocks, block_size, num_kv_heads, head_size]
//   flash HND            [num_blocks, num_kv_heads, block_size, head_size]
//   vLLM key cache       [num_blocks, num_kv_heads, head_size / x, block_size, x], x = 16 / sizeof(cache)
//   vLLM value cache     [num_blocks, num_kv_heads, head_size, block_size]
//   MLA cache            [num_blocks, block_size, kv_lora_rank + rope_dim]
//   convert_fp8 dst, src any shape, the same for both, C-contiguous: seen as [n] elements
// Both flash layouts are one kernel: the wrapper passes (block, slot-in-block, head) strides. Cache
// offsets are 64-bit: num_blocks * block stride passes 2^31 elements in production caches.
//
// Versions (all memory-bound copies: every byte read once, written once):
//   v1 reshape_and_cache_flash_kernel: one CTA per token, 16-byte loads of VEC source elements.
//   v1 reshape_and_cache_kernel: one CTA per token; a key chunk of x elements is one 16-byte
//      store in the vLLM layout, value elements are block_size apart (inherent to that layout).
//   v1 concat_and_cache_mla_kernel: one CTA per token, latent then rope part.
//   v1 convert_fp8_kernel: grid-stride over [n]; per step 16 bytes of floats and 16 / sizeof(T) codes,
//      each one vector access when both arrays are 16-byte aligned (else element by element); a scalar tail.
//
// Used by:   cupaged/cache_ops.py (reshape_and_cache_flash, reshape_and_cache, concat_and_cache_mla),
//            cupaged/convert_fp8.py (convert_fp8), cupaged/selftest.py; reference: cupaged/reference/cache_ops.py
// Test:      pytest tests/test_cache_ops.py      (sim; cuda too when a GPU is present; -m slow: the full
//            grid and 64-bit offsets); also tests/test_kv_cache.py, test_api_fuzz.py, test_bad_input.py,
//            test_runtime.py; as every family, test_compile_gate.py and sim/test_params.py
// Benchmark: python profiling/bench_cache_ops.py
#include "common.cuh"

namespace cupaged {

constexpr int CACHE_OPS_THREADS = 256;  // per CTA (the launcher reads it from here)

template <class T, int KV, class SlotT, int VEC>
__global__ void __launch_bounds__(CACHE_OPS_THREADS) reshape_and_cache_flash_kernel(
    const T* __restrict__ key,              // [num_tokens, num_kv_heads, head_size]
    const T* __restrict__ value,            // [num_tokens, num_kv_heads, head_size]
    typename CacheType<KV, T>::type* __restrict__ key_cache,    // NHD or HND, see strides
    typename CacheType<KV, T>::type* __restrict__ value_cache,  // same shape and strides as key_cache
    const SlotT* __restrict__ slot_mapping, // [num_tokens]; < 0 = padding
    const float* __restrict__ k_scale,      // [1] or [num_kv_heads], or nullptr: use k_scale_value
    const float* __restrict__ v_scale,
    float k_scale_value, float v_scale_value, int scale_per_head,
    long long key_stride, long long key_head_stride, long long value_stride, long long value_head_stride,
    long long block_stride, long long page_stride, long long head_stride,
    int num_kv_heads, int head_size, int block_size) {
  const long long token = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[token]);
  if (slot < 0) return;
  const long long cache_base = slot / block_size * block_stride + slot % block_size * page_stride;
  const int chunks_per_head = head_size / VEC;
  for (int i = threadIdx.x; i < num_kv_heads * chunks_per_head; i += blockDim.x) {
    const int h = i / chunks_per_head;
    const int e = (i - h * chunks_per_head) * VEC;
    const long long dst = cache_base + h * head_stride + e;
    quantize_chunk<KV, VEC, (VEC > 1)>(key_cache + dst, key + token * key_stride + h * key_head_stride + e,
                                       read_scale(k_scale, k_scale_value, scale_per_head, h));
    quantize_chunk<KV, VEC, (VEC > 1)>(value_cache + dst, value + token * value_stride + h * value_head_stride + e,
                                       read_scale(v_scale, v_scale_value, scale_per_head, h));
  }
}

// (256, 1): without a minimum-blocks hint ptxas for sm_90 caps this kernel at 32 registers and spills.
template <class T, int KV, class SlotT, bool VEC>
__global__ void __launch_bounds__(CACHE_OPS_THREADS, 1) reshape_and_cache_kernel(
    const T* __restrict__ key,              // [num_tokens, num_kv_heads, head_size]
    const T* __restrict__ value,            // [num_tokens, num_kv_heads, head_size]
    typename CacheType<KV, T>::type* __restrict__ key_cache,    // [num_blocks, num_kv_heads, head_size/x, block_size, x]
    typename CacheType<KV, T>::type* __restrict__ value_cache,  // [num_blocks, num_kv_heads, head_size, block_size]
    const SlotT* __restrict__ slot_mapping, // [num_tokens]; < 0 = padding
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    float k_scale_value, float v_scale_value, int scale_per_head,
    long long key_stride, long long key_head_stride, long long value_stride, long long value_head_stride,
    long long kc_block_stride, long long kc_head_stride, long long kc_chunk_stride, long long kc_page_stride,
    long long vc_block_stride, long long vc_head_stride, long long vc_dim_stride,
    int num_kv_heads, int head_size, int block_size) {
  typedef typename CacheType<KV, T>::type CacheT;
  constexpr int X = 16 / int(sizeof(CacheT));
  const long long token = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[token]);
  if (slot < 0) return;
  const long long block = slot / block_size, offset = slot % block_size;
  const int chunks_per_head = head_size / X;
  for (int i = threadIdx.x; i < num_kv_heads * chunks_per_head; i += blockDim.x) {
    const int h = i / chunks_per_head;
    const int c = i - h * chunks_per_head;
    CacheT* dst = key_cache + block * kc_block_stride + h * kc_head_stride + c * kc_chunk_stride + offset * kc_page_stride;
    quantize_chunk<KV, X, VEC>(dst, key + token * key_stride + h * key_head_stride + c * X,
                               read_scale(k_scale, k_scale_value, scale_per_head, h));
  }
  for (int i = threadIdx.x; i < num_kv_heads * head_size; i += blockDim.x) {
    const int h = i / head_size;
    const int d = i - h * head_size;
    value_cache[block * vc_block_stride + h * vc_head_stride + d * vc_dim_stride + offset] =
        quantize<KV>(value[token * value_stride + h * value_head_stride + d],
                     read_scale(v_scale, v_scale_value, scale_per_head, h));
  }
}

template <class T, int KV, class SlotT>
__global__ void __launch_bounds__(CACHE_OPS_THREADS) concat_and_cache_mla_kernel(
    const T* __restrict__ kv_c,             // [num_tokens, kv_lora_rank]
    const T* __restrict__ k_pe,             // [num_tokens, rope_dim]
    typename CacheType<KV, T>::type* __restrict__ kv_cache,  // [num_blocks, block_size, kv_lora_rank + rope_dim]
    const SlotT* __restrict__ slot_mapping, // [num_tokens]; < 0 = padding
    const float* __restrict__ scale, float scale_value,
    long long kv_c_stride, long long k_pe_stride, long long block_stride, long long entry_stride,
    int kv_lora_rank, int rope_dim, int block_size) {
  const long long token = blockIdx.x;
  const long long slot = static_cast<long long>(slot_mapping[token]);
  if (slot < 0) return;
  const float s = read_scale(scale, scale_value, 0, 0);
  auto* dst = kv_cache + slot / block_size * block_stride + slot % block_size * entry_stride;
  for (int i = threadIdx.x; i < kv_lora_rank + rope_dim; i += blockDim.x) {
    const T x = i < kv_lora_rank ? kv_c[token * kv_c_stride + i] : k_pe[token * k_pe_stride + i - kv_lora_rank];
    dst[i] = quantize<KV>(x, s);
  }
}

// convert_fp8's element types: QUANTIZE reads T and writes fp8 codes, otherwise the reverse.
template <class T, bool QUANTIZE> struct Fp8Conversion { typedef T Src; typedef unsigned char Dst; };
template <class T> struct Fp8Conversion<T, false> { typedef unsigned char Src; typedef T Dst; };

// 16 / sizeof(T) codes dequantized into as many elements of T: one load of the codes, one 16-byte store.
template <int KV, class T>
__device__ __forceinline__ void dequantize_chunk(T* dst, const unsigned char* src, float scale) {
  constexpr int N = 16 / int(sizeof(T));
  const Vec<unsigned char, N> in = load_vec<unsigned char, N>(src);
  Vec<T, N> out;
#pragma unroll
  for (int i = 0; i < N; ++i) out.v[i] = dequantize<KV, T>(in.v[i], scale);
  store_vec<T, N>(dst, out);
}

// Grid-stride, so any n runs on a capped grid; 64-bit indices: a whole KV cache may pass 2^31 elements.
template <class T, int KV, bool QUANTIZE>
__global__ void __launch_bounds__(CACHE_OPS_THREADS) convert_fp8_kernel(
    typename Fp8Conversion<T, QUANTIZE>::Dst* __restrict__ dst,        // [n]: fp8 codes, or T
    const typename Fp8Conversion<T, QUANTIZE>::Src* __restrict__ src,  // [n]: T, or fp8 codes
    const float* __restrict__ scale,        // [1], or nullptr: use scale_value
    float scale_value, long long n, int vec) {
  constexpr int N = 16 / int(sizeof(T));  // elements per vector step: 16 bytes of T
  const float s = read_scale(scale, scale_value, 0, 0);
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long vectors = vec ? n / N : 0;
  for (long long i = first; i < vectors; i += stride) {
    if constexpr (QUANTIZE) {
      quantize_chunk<KV, N, true>(dst + i * N, src + i * N, s);
    } else {
      dequantize_chunk<KV>(dst + i * N, src + i * N, s);
    }
  }
  for (long long i = vectors * N + first; i < n; i += stride) {
    if constexpr (QUANTIZE) {
      dst[i] = quantize<KV>(src[i], s);
    } else {
      dst[i] = dequantize<KV, T>(src[i], s);
    }
  }
}

}  // namespace cupaged
