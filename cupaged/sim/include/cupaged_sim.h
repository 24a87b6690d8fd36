// cupaged_sim.h: force-included (g++ -include) ahead of an unmodified CUDA source on the sim.
//
// Maps the CUDA language to host C++: execution-space keywords vanish, `__shared__` becomes
// `thread_local` (one OS thread runs one block), the built-in index variables read the current
// fiber, and barriers, warp collectives, atomics and device intrinsics get host definitions.
// NVIDIA's cuda_fp16.h / cuda_bf16.h / cuda_fp8.h compile as host code and convert bit-exactly.
#pragma once
#define __CUDA_SIM__ 1
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <type_traits>
#include <utility>
#include <string>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <vector_types.h>
#include <vector_functions.h>

#undef __shared__
#define __shared__ thread_local
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
// A keyword of nvcc and NVRTC, not a macro of NVIDIA's headers. As a macro it breaks a libstdc++
// header included after it that spells `__attribute__((__noinline__))` (GCC 12: <memory>, which a
// kernel cannot include under NVRTC; should the sim ever need it, include it above).
#define __noinline__ __attribute__((noinline))
#ifndef __grid_constant__
#define __grid_constant__
#endif

#include "cupaged_sim_engine.h"

#define threadIdx (::cupaged_sim::g.cur->tid)
#define blockIdx (::cupaged_sim::g.block_idx)
#define blockDim (::cupaged_sim::g.block)
#define gridDim (::cupaged_sim::g.grid)
static constexpr int warpSize = 32;

namespace cupaged_sim {
template <class T>
inline unsigned long long to_bits(T v) {
  static_assert(sizeof(T) <= 8, "warp collectives move at most 8 bytes per lane");
  unsigned long long b = 0;
  memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
inline T from_bits(unsigned long long b) {
  T v;
  memcpy(&v, &b, sizeof(T));
  return v;
}
[[noreturn]] void trap(const char* what, const char* file, int line) {
  if (!g.cur) { fprintf(stderr, "%s:%d: %s\n", file, line, what); abort(); }
  set_error(E_TRAP, "%s (%s:%d)", what, file, line);
  abort_fiber();
}
}  // namespace cupaged_sim

// ---- barriers
// A barrier's call site is the address of a static object unique to each expansion of the macro
// (each lambda has its own). Not the return address: g++ duplicates calls (jump threading turns
// `if (c) ...; __syncthreads(); if (c) ...` into two paths with a call each), and threads of one
// source barrier then returned to different addresses: a false "divergent __syncthreads".
#define CUPAGED_SIM_SITE() ([]() -> const void* { static const char cupaged_sim_site = 0; return &cupaged_sim_site; }())
#define __syncthreads() ::cupaged_sim::barrier(0, 0, __LINE__, CUPAGED_SIM_SITE())
#define __syncthreads_count(p) ::cupaged_sim::barrier(1, (p) != 0, __LINE__, CUPAGED_SIM_SITE())
#define __syncthreads_and(p) ::cupaged_sim::barrier(2, (p) != 0, __LINE__, CUPAGED_SIM_SITE())
#define __syncthreads_or(p) ::cupaged_sim::barrier(3, (p) != 0, __LINE__, CUPAGED_SIM_SITE())
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}

// ---- warp collectives (the last lane of the mask to arrive computes every lane's result)
namespace cupaged_sim {
template <class T>
inline T shfl(int kind, unsigned mask, T var, int arg, int width, int line) {
  return from_bits<T>(collective(kind, mask, to_bits(var), arg, width, line));
}
inline unsigned vote(int kind, unsigned mask, int pred, int line) {
  int p = pred != 0;
  return unsigned(collective(kind, mask, 0, 0, 32, line, &p));
}
}  // namespace cupaged_sim
#define __shfl_sync(m, v, ...) ::cupaged_sim::shfl_idx(m, v, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(m, v, ...) ::cupaged_sim::shfl_up(m, v, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(m, v, ...) ::cupaged_sim::shfl_down(m, v, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(m, v, ...) ::cupaged_sim::shfl_xor(m, v, __LINE__, __VA_ARGS__)
namespace cupaged_sim {
template <class T> inline T shfl_idx(unsigned m, T v, int line, int src, int w = 32) { return shfl(SHFL_IDX, m, v, src, w, line); }
template <class T> inline T shfl_up(unsigned m, T v, int line, unsigned d, int w = 32) { return shfl(SHFL_UP, m, v, int(d), w, line); }
template <class T> inline T shfl_down(unsigned m, T v, int line, unsigned d, int w = 32) { return shfl(SHFL_DOWN, m, v, int(d), w, line); }
template <class T> inline T shfl_xor(unsigned m, T v, int line, int lm, int w = 32) { return shfl(SHFL_XOR, m, v, lm, w, line); }
template <class T> inline unsigned match_any(unsigned m, T v, int line) { return unsigned(collective(MATCH_ANY, m, to_bits(v), 0, 32, line)); }
template <class T> inline unsigned match_all(unsigned m, T v, int* pred, int line) {
  int p = 0;
  unsigned r = unsigned(collective(MATCH_ALL, m, to_bits(v), 0, 32, line, &p));
  *pred = p;
  return r;
}
inline unsigned reduce(int kind, unsigned m, unsigned v, int line) { return unsigned(collective(kind, m, v, 0, 32, line)); }
}  // namespace cupaged_sim
#define __all_sync(m, p) int(::cupaged_sim::vote(::cupaged_sim::VOTE_ALL, m, p, __LINE__))
#define __any_sync(m, p) int(::cupaged_sim::vote(::cupaged_sim::VOTE_ANY, m, p, __LINE__))
#define __ballot_sync(m, p) ::cupaged_sim::vote(::cupaged_sim::BALLOT, m, p, __LINE__)
#define __syncwarp(...) ((void)::cupaged_sim::collective(::cupaged_sim::SYNCWARP, ::cupaged_sim::syncwarp_mask(__VA_ARGS__), 0, 0, 32, __LINE__))
#define __match_any_sync(m, v) ::cupaged_sim::match_any(m, v, __LINE__)
#define __match_all_sync(m, v, p) ::cupaged_sim::match_all(m, v, p, __LINE__)
#define __reduce_add_sync(m, v) ::cupaged_sim::reduce_add(m, v, __LINE__)
#define __reduce_and_sync(m, v) ::cupaged_sim::reduce(::cupaged_sim::RED_AND, m, unsigned(v), __LINE__)
#define __reduce_or_sync(m, v) ::cupaged_sim::reduce(::cupaged_sim::RED_OR, m, unsigned(v), __LINE__)
#define __reduce_xor_sync(m, v) ::cupaged_sim::reduce(::cupaged_sim::RED_XOR, m, unsigned(v), __LINE__)
#define __reduce_min_sync(m, v) ::cupaged_sim::reduce_minmax(true, m, v, __LINE__)
#define __reduce_max_sync(m, v) ::cupaged_sim::reduce_minmax(false, m, v, __LINE__)
namespace cupaged_sim {
inline unsigned syncwarp_mask(unsigned m = 0xFFFFFFFFu) { return m; }
inline int reduce_minmax(bool mn, unsigned m, int v, int line) { return int(reduce(mn ? RED_MIN : RED_MAX, m, unsigned(v), line)); }
inline unsigned reduce_minmax(bool mn, unsigned m, unsigned v, int line) { return reduce(mn ? RED_UMIN : RED_UMAX, m, v, line); }
// CUDA overloads __reduce_add_sync for int and unsigned (crt/sm_80_rt.h): the int one returns int,
// so a negative sum stays negative when it is widened or converted to floating point.
inline int reduce_add(unsigned m, int v, int line) { return int(reduce(RED_ADD, m, unsigned(v), line)); }
inline unsigned reduce_add(unsigned m, unsigned v, int line) { return reduce(RED_ADD, m, v, line); }
}  // namespace cupaged_sim
// The lanes that reach this call site together (see settle_activemask in the engine).
#define __activemask() ::cupaged_sim::activemask(CUPAGED_SIM_SITE(), __LINE__)
inline unsigned __lanemask_lt() { return (1u << ::cupaged_sim::g.cur->lane) - 1u; }

// ---- traps
#define __trap() ::cupaged_sim::trap("__trap()", __FILE__, __LINE__)
inline void __brkpt() {}
inline void __nanosleep(unsigned) {}

// ---- bit casts and integer intrinsics
inline int __float_as_int(float x) { int r; memcpy(&r, &x, 4); return r; }
inline unsigned __float_as_uint(float x) { unsigned r; memcpy(&r, &x, 4); return r; }
inline float __int_as_float(int x) { float r; memcpy(&r, &x, 4); return r; }
inline float __uint_as_float(unsigned x) { float r; memcpy(&r, &x, 4); return r; }
inline long long __double_as_longlong(double x) { long long r; memcpy(&r, &x, 8); return r; }
inline double __longlong_as_double(long long x) { double r; memcpy(&r, &x, 8); return r; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
  return (x >> 16) | (x << 16);
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((unsigned long long)a * b >> 32); }
inline int __mulhi(int a, int b) { return int((long long)a * b >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) { return (unsigned long long)((unsigned __int128)a * b >> 64); }
inline int __mul24(int a, int b) { return int((long long)((a << 8) >> 8) * ((b << 8) >> 8)); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((v >> (((s >> (4 * i)) & 7u) * 8)) & 0xFFu) << (8 * i);
  return r;
}
// min / max: exactly the overloads of CUDA's crt/math_functions.h{,pp}, no more, so overload
// resolution (and ambiguity, e.g. min(long long, int)) is the same as under NVRTC. A signed/unsigned
// mix converts both to the unsigned type, as C++'s usual arithmetic conversions would:
// min(-1, 1u) is 1u, and max(-1, 1u) is 0xFFFFFFFF.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
namespace cupaged_sim {
template <class R> inline R min_in(R a, R b) { return a < b ? a : b; }  // compared in the result type
template <class R> inline R max_in(R a, R b) { return a > b ? a : b; }
}  // namespace cupaged_sim
#define CUPAGED_SIM_MINMAX(R, A, B) \
  inline R min(A a, B b) { return ::cupaged_sim::min_in<R>(a, b); } \
  inline R max(A a, B b) { return ::cupaged_sim::max_in<R>(a, b); }
CUPAGED_SIM_MINMAX(unsigned, unsigned, unsigned) CUPAGED_SIM_MINMAX(unsigned, int, unsigned)
CUPAGED_SIM_MINMAX(unsigned, unsigned, int)
CUPAGED_SIM_MINMAX(long, long, long) CUPAGED_SIM_MINMAX(unsigned long, unsigned long, unsigned long)
CUPAGED_SIM_MINMAX(unsigned long, long, unsigned long) CUPAGED_SIM_MINMAX(unsigned long, unsigned long, long)
CUPAGED_SIM_MINMAX(long long, long long, long long)
CUPAGED_SIM_MINMAX(unsigned long long, unsigned long long, unsigned long long)
CUPAGED_SIM_MINMAX(unsigned long long, long long, unsigned long long)
CUPAGED_SIM_MINMAX(unsigned long long, unsigned long long, long long)
#undef CUPAGED_SIM_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(double(a), b); }
inline double max(float a, double b) { return fmax(double(a), b); }
inline double min(double a, float b) { return fmin(a, double(b)); }
inline double max(double a, float b) { return fmax(a, double(b)); }
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

// ---- float intrinsics (the GPU's approximate ones are exp2/log2-based; compare with tolerances)
inline float __expf(float x) { return exp2f(x * 1.4426950408889634f); }
inline float __logf(float x) { return log2f(x) * 0.6931471805599453f; }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return exp2f(y * log2f(x)); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float exp10f(float x) { return powf(10.0f, x); }
inline int __float2int_rn(float x) { return int(nearbyintf(x)); }
inline int __float2int_rz(float x) { return int(x); }
inline int __float2int_rd(float x) { return int(floorf(x)); }
inline int __float2int_ru(float x) { return int(ceilf(x)); }
inline unsigned __float2uint_rn(float x) { return unsigned(nearbyintf(x)); }
inline float __int2float_rn(int x) { return float(x); }
inline float __uint2float_rn(unsigned x) { return float(x); }
inline __half __hfma(__half a, __half b, __half c) { return __float2half_rn(fmaf(__half2float(a), __half2float(b), __half2float(c))); }
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __float2bfloat16_rn(fmaf(__bfloat162float(a), __bfloat162float(b), __bfloat162float(c)));
}

// Half and bfloat16 math that cuda_fp16.h / cuda_bf16.h declare for the device only: computed in
// float and rounded once to the type. The GPU's are approximations (ex2.approx.f16, tanh.approx
// ...) that may differ by an ulp or more: compare GPU and sim results with tolerances. (trunc,
// ceil, floor and rint are exact either way.)
#define CUPAGED_SIM_HMATH(name, expr) \
  inline __half h##name(__half a) { float x = __half2float(a); return __float2half_rn(expr); } \
  inline __half2 h2##name(__half2 a) { return __halves2half2(h##name(__low2half(a)), h##name(__high2half(a))); } \
  inline __nv_bfloat16 h##name(__nv_bfloat16 a) { float x = __bfloat162float(a); return __float2bfloat16_rn(expr); } \
  inline __nv_bfloat162 h2##name(__nv_bfloat162 a) { \
    return __halves2bfloat162(h##name(__low2bfloat16(a)), h##name(__high2bfloat16(a))); \
  }
CUPAGED_SIM_HMATH(exp, expf(x)) CUPAGED_SIM_HMATH(exp2, exp2f(x)) CUPAGED_SIM_HMATH(exp10, exp10f(x))
CUPAGED_SIM_HMATH(log, logf(x)) CUPAGED_SIM_HMATH(log2, log2f(x)) CUPAGED_SIM_HMATH(log10, log10f(x))
CUPAGED_SIM_HMATH(sqrt, sqrtf(x)) CUPAGED_SIM_HMATH(rsqrt, 1.0f / sqrtf(x)) CUPAGED_SIM_HMATH(rcp, 1.0f / x)
CUPAGED_SIM_HMATH(sin, sinf(x)) CUPAGED_SIM_HMATH(cos, cosf(x))
CUPAGED_SIM_HMATH(tanh, tanhf(x)) CUPAGED_SIM_HMATH(tanh_approx, tanhf(x))
CUPAGED_SIM_HMATH(trunc, truncf(x)) CUPAGED_SIM_HMATH(ceil, ceilf(x)) CUPAGED_SIM_HMATH(floor, floorf(x))
CUPAGED_SIM_HMATH(rint, nearbyintf(x))
#undef CUPAGED_SIM_HMATH

// ---- memory access hints
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---- atomics: fibers switch only at barriers and collectives, so plain read-modify-write is atomic
template <class T> inline T atomicAdd(T* p, T v) { T o = *p; *p = T(o + v); return o; }
inline __half atomicAdd(__half* p, __half v) { __half o = *p; *p = __hadd(o, v); return o; }
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) { __nv_bfloat16 o = *p; *p = __hadd(o, v); return o; }
template <class T> inline T atomicSub(T* p, T v) { T o = *p; *p = T(o - v); return o; }
template <class T> inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <class T> inline T atomicMin(T* p, T v) { T o = *p; *p = v < o ? v : o; return o; }
template <class T> inline T atomicMax(T* p, T v) { T o = *p; *p = v > o ? v : o; return o; }
template <class T> inline T atomicAnd(T* p, T v) { T o = *p; *p = o & v; return o; }
template <class T> inline T atomicOr(T* p, T v) { T o = *p; *p = o | v; return o; }
template <class T> inline T atomicXor(T* p, T v) { T o = *p; *p = o ^ v; return o; }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { T o = *p; if (memcmp(&o, &cmp, sizeof(T)) == 0) *p = v; return o; }
inline unsigned atomicInc(unsigned* p, unsigned lim) { unsigned o = *p; *p = o >= lim ? 0 : o + 1; return o; }
inline unsigned atomicDec(unsigned* p, unsigned lim) { unsigned o = *p; *p = (o == 0 || o > lim) ? lim : o - 1; return o; }
#define atomicAdd_block atomicAdd
#define atomicAdd_system atomicAdd
#define atomicMax_block atomicMax
#define atomicMin_block atomicMin
#define atomicExch_block atomicExch
#define atomicCAS_block atomicCAS

// ---- clocks (for timing only). CUDA's clock() is the host C library's here: defining our own
// clashed with <ctime>, which CCCL headers such as <cuda/std/type_traits> pull in.
inline long long clock64() { return (long long)__builtin_ia32_rdtsc(); }

// ---- kernel launch and parameter type report, used by the generated wrappers
namespace cupaged_sim {
template <class T> struct TypeCode { static constexpr const char* value = nullptr; };
#define CUPAGED_SIM_TYPE(T, s) template <> struct TypeCode<T> { static constexpr const char* value = s; };
CUPAGED_SIM_TYPE(float, "f32") CUPAGED_SIM_TYPE(double, "f64") CUPAGED_SIM_TYPE(__half, "f16")
CUPAGED_SIM_TYPE(__nv_bfloat16, "bf16") CUPAGED_SIM_TYPE(__nv_fp8_e4m3, "e4m3") CUPAGED_SIM_TYPE(__nv_fp8_e5m2, "e5m2")
CUPAGED_SIM_TYPE(bool, "b8") CUPAGED_SIM_TYPE(char, "i8") CUPAGED_SIM_TYPE(signed char, "i8")
CUPAGED_SIM_TYPE(unsigned char, "u8") CUPAGED_SIM_TYPE(short, "i16") CUPAGED_SIM_TYPE(unsigned short, "u16")
CUPAGED_SIM_TYPE(int, "i32") CUPAGED_SIM_TYPE(unsigned, "u32") CUPAGED_SIM_TYPE(long, "i64")
CUPAGED_SIM_TYPE(unsigned long, "u64") CUPAGED_SIM_TYPE(long long, "i64") CUPAGED_SIM_TYPE(unsigned long long, "u64")
CUPAGED_SIM_TYPE(float2, "f32") CUPAGED_SIM_TYPE(float4, "f32") CUPAGED_SIM_TYPE(double2, "f64")
CUPAGED_SIM_TYPE(int2, "i32") CUPAGED_SIM_TYPE(int4, "i32") CUPAGED_SIM_TYPE(uint2, "u32") CUPAGED_SIM_TYPE(uint4, "u32")
CUPAGED_SIM_TYPE(char4, "i8") CUPAGED_SIM_TYPE(uchar4, "u8") CUPAGED_SIM_TYPE(__half2, "f16") CUPAGED_SIM_TYPE(__nv_bfloat162, "bf16")
#undef CUPAGED_SIM_TYPE

template <class A>
std::string param_code() {
  if constexpr (std::is_pointer_v<A>) {
    using E = std::remove_cv_t<std::remove_pointer_t<A>>;
    if constexpr (std::is_void_v<E>) return "ptr:void";
    else {
      const char* c = TypeCode<E>::value;
      return c ? std::string("ptr:") + c : "ptr:void";
    }
  } else {
    using E = std::remove_cv_t<A>;
    const char* c = TypeCode<E>::value;
    return c ? std::string(c) : "struct:" + std::to_string(sizeof(E));
  }
}

template <class... A>
const char* param_codes(void (*)(A...)) {
  static std::string s = [] {
    std::string r;
    ((r += param_code<A>() + ","), ...);
    return r;
  }();
  return s.c_str();
}

template <class... A, size_t... I>
void call_kernel(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*reinterpret_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <class... A>
int launch(void (*f)(A...), const LaunchConfig* cfg, void** args) {
  struct Ctx { void (*f)(A...); void** args; } ctx{f, args};
  g.thunk = [](void* c) {
    auto* x = static_cast<Ctx*>(c);
    call_kernel(x->f, x->args, std::index_sequence_for<A...>{});
  };
  g.thunk_ctx = &ctx;
  return run_launch(cfg);
}
}  // namespace cupaged_sim

// ---- inline PTX (the compile step rewrites each asm statement into calls to these)
#include "cupaged_sim_ptx.h"
#include "cupaged_sim_mma.h"
#include "cupaged_sim_hopper.h"
#include "cupaged_sim_wgmma.h"

// ---- alignas after __shared__
// `__shared__ alignas(16) float x[N];` is valid CUDA (__shared__ is a GNU attribute there, so the
// alignas still leads the declaration), but with `__shared__` as `thread_local` g++ rejects a
// standard attribute in the middle of the decl-specifiers (-fpermissive drops the alignment), and
// no spelling of `__shared__` alone can move thread_local behind it. So the keyword itself becomes
// GNU `aligned`, which g++ accepts anywhere and which means the same on a declaration or a class
// head; this holds for every alignas after this header. Its argument, a type or a constant, goes
// through a template argument, which takes either; a top-level `>` in the constant then needs
// parentheses (`alignas((sizeof(T) > 4) ? 16 : 8)`), which NVRTC does not ask for.
namespace cupaged_sim {
template <class T, class... Ts> constexpr size_t alignas_value() {
  size_t a = alignof(T);
  ((a = alignof(Ts) > a ? alignof(Ts) : a), ...);
  return a;
}
template <size_t N, size_t... Ns> constexpr size_t alignas_value() {
  size_t a = N;
  ((a = Ns > a ? Ns : a), ...);
  return a ? a : 1;  // alignas(0) is ignored
}
}  // namespace cupaged_sim
#define alignas(...) __attribute__((aligned(::cupaged_sim::alignas_value<__VA_ARGS__>())))
