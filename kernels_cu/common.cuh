// common.cuh: device helpers shared by every kernel family.
//
// Compiled by NVRTC (GPU) and by g++ through the sim's shim (CPU), so only what both accept:
// no <cmath>/<cstdint>, no INFINITY, no std::. Element types are float, __half and
// __nv_bfloat16; arithmetic is always float32. fp8 caches are bytes (unsigned char).
//
// Used by:   every kernels_cu/*.cu (cache_ops.cu, cache_gather.cu, paged_attention.cu, merge_attn_states.cu)
//            and softmax.cuh; inlined into each source by cupaged/_runtime.py (KernelFamily.source);
//            KvDtype is mirrored by KV_CODE in cupaged/_cache_args.py (cache_ops.py, cache_gather.py)
//            and by the name expressions of cupaged/attention.py.
// Test:      through its kernels' tests; tests/test_runtime.py checks it is inlined once per source.
// Benchmark: through its kernels' benchmarks (profiling/bench_*.py).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace cupaged {

// N elements of T moved as one access: 16 bytes become one 128-bit load/store when aligned.
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <class T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// -inf without <cmath> (NVRTC has no INFINITY): the LSE of an empty row, a masked logit.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// ---- fp8 KV cache (docs/conventions.md §4): stored = saturate(x / scale) rounded to nearest even,
// read = float(stored) * scale. KV_AUTO caches hold the source type itself and ignore scales.
enum KvDtype { KV_AUTO = 0, KV_E4M3 = 1, KV_E5M2 = 2 };

template <int KV, class T> struct CacheType { typedef unsigned char type; };
template <class T> struct CacheType<KV_AUTO, T> { typedef T type; };

template <int KV, class T>
__device__ __forceinline__ typename CacheType<KV, T>::type quantize(T x, float scale) {
  if constexpr (KV == KV_AUTO) {
    return x;
  } else {
    // a divide, not a multiply by the reciprocal: bit-identical to the references
    return __nv_cvt_float_to_fp8(to_float(x) / scale, __NV_SATFINITE, KV == KV_E4M3 ? __NV_E4M3 : __NV_E5M2);
  }
}

template <int KV, class OutT, class CacheT>
__device__ __forceinline__ OutT dequantize(CacheT x, float scale) {
  if constexpr (KV == KV_AUTO) {
    return x;
  } else {
    const __half h(__nv_cvt_fp8_to_halfraw(x, KV == KV_E4M3 ? __NV_E4M3 : __NV_E5M2));
    return from_float<OutT>(__half2float(h) * scale);
  }
}

// A scale given as a float (ptr == nullptr) or as a device array of 1 or per-head values.
__device__ __forceinline__ float read_scale(const float* ptr, float value, int per_head, int head) {
  return ptr == nullptr ? value : ptr[per_head ? head : 0];
}

// N elements (in registers) quantized into N cache elements: one N * sizeof(CacheT)-byte store when VEC (the
// wrapper checked alignment), else element by element.
template <int KV, int N, bool VEC, class T, class CacheT>
__device__ __forceinline__ void quantize_store(CacheT* dst, const T (&in)[N], float scale) {
  if constexpr (VEC) {
    Vec<CacheT, N> out;
#pragma unroll
    for (int i = 0; i < N; ++i) out.v[i] = quantize<KV>(in[i], scale);
    store_vec<CacheT, N>(dst, out);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = quantize<KV>(in[i], scale);
  }
}

// N source elements quantized into N cache elements; 16-byte source loads when VEC, then quantize_store.
template <int KV, int N, bool VEC, class T, class CacheT>
__device__ __forceinline__ void quantize_chunk(CacheT* dst, const T* src, float scale) {
  T in[N];
  if constexpr (VEC) {
    constexpr int L = (16 / int(sizeof(T))) < N ? (16 / int(sizeof(T))) : N;
#pragma unroll
    for (int i = 0; i < N; i += L) {
      const Vec<T, L> x = load_vec<T, L>(src + i);
#pragma unroll
      for (int j = 0; j < L; ++j) in[i + j] = x.v[j];
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) in[i] = src[i];
  }
  quantize_store<KV, N, VEC>(dst, in, scale);
}

}  // namespace cupaged
