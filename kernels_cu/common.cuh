// common.cuh: device helpers shared by every kernel family.
//
// Compiled by NVRTC (GPU) and by g++ through the sim's shim (CPU), so only what both accept:
// no <cmath>/<cstdint>, no INFINITY, no std::. Element types are float, __half and
// __nv_bfloat16; arithmetic is always float32.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

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

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace cupaged
