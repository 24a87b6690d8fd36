// wgmma.cuh: the Hopper (sm_90a) instructions as inline PTX -- warpgroup MMA (wgmma) with shared-memory
// descriptors, mbarriers, the async-proxy fence, named barriers and setmaxnreg. The sim emulates each one
// (cupaged/sim/ptx/_hopper_ops.py) and reports a misuse (a register rewritten under a wgmma in flight, a missing
// fence, a barrier that can never complete) as a SimSyncError.
//
// Operand layouts (PTX ISA, "Matrix Descriptor" and "Shared Memory Matrix Layout"), 16-bit elements:
//   K-major with the 128-byte swizzle (Q and K of S = Q K^T): panels of 64 columns (128 bytes a row), 1024-byte
//     aligned, 16-byte chunk c of row r at r * 128 + ((c ^ r % 8) << 4) (wg_at); k-slice j (16 columns) of an
//     operand starts at panel j / 4, + 32 (j % 4) bytes; SBO = 1024 (8 rows), LBO unused.
//   MN-major with the 128-byte swizzle (V as B of O = P V: K = keys, N = the head dimension): the same panels of
//     [keys][64 columns], k-slice j (keys 16 j..) at + 2048 j bytes; LBO = the panel stride (the next 64 of N),
//     SBO = 1024 (the next 8 keys).
// Accumulators (m64nN, f32): thread t of the warpgroup holds rows 16 (t / 32) + t % 32 / 4 (+ 8), register
// 4 n + 2 e + h at row + 8 e, column 8 n + 2 (t % 4) + h: mma.sync's C fragments, n tile by n tile, so the
// accumulators are declared float[N / 8][4] and the softmax of paged_prefill_kernel runs on them unchanged; P's
// A fragment of k-slice j is S's n tiles 2 j, 2 j + 1 packed in pairs.
//
// Used by:   attention/prefill_sm90.cuh (paged_attention_sm90.cu)
// Test:      pytest tests/test_paged_attention_sm90.py; the instructions' emulation: tests/sim/test_ptx_wgmma.py,
//            tests/sim/test_ptx_hopper.py
#pragma once
#include "tensor_core.cuh"

namespace cupaged {

// Byte offset of 16-byte chunk c of row r in a K-major or MN-major operand of 128-byte swizzled panels of PANEL
// bytes (64 16-bit columns a panel).
template <int PANEL>
__device__ __forceinline__ int wg_at(int r, int c) { return (c >> 3) * PANEL + r * 128 + (((c & 7) ^ (r & 7)) << 4); }

__device__ __forceinline__ void wg_mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void wg_mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Until the barrier's phase of this parity has completed.
__device__ __forceinline__ void wg_mbar_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n\t.reg .pred done;\n\tWG_WAIT:\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
               "@!done bra WG_WAIT;\n\t}" ::"r"(bar), "r"(parity) : "memory");
}
// This thread's generic writes to shared memory (stores, landed cp.async) become visible to the async proxy
// (wgmma's operand reads): between a thread's writes and the barrier the readers wait on.
__device__ __forceinline__ void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// A barrier of `threads` threads (a multiple of 32) on named barrier `id` (0 is __syncthreads').
__device__ __forceinline__ void wg_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// The warpgroup's registers a thread from here on (setmaxnreg; every thread of the warpgroup executes it).
template <int N>
__device__ __forceinline__ void wg_registers_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void wg_registers_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }

// Descriptors of 128-byte swizzled operands (1024-byte aligned panels), in two 32-bit words: the low one holds the
// start address (a k-slice's offset is one 32-bit add to it: addresses stay below 256 KB, so the 14-bit field never
// carries) and the LBO, the high one SBO = 1024 and the swizzle mode, the same for every operand here.
//   K-major (Q, K): LBO unused (1). MN-major (V): the next 64 columns LBO bytes on.
constexpr unsigned WG_DESC_HI = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ unsigned wg_desc_lo_k(unsigned a) { return ((a & 0x3FFFFu) >> 4) | (1u << 16); }
__device__ __forceinline__ unsigned wg_desc_lo_mn(unsigned a, unsigned lbo) {
  return ((a & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16);
}
__device__ __forceinline__ unsigned long long wg_desc(unsigned lo) {
  unsigned long long d;
  asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "r"(WG_DESC_HI));
  return d;
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

#define WG_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21," \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21," \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, " \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
  "%62, %63}"
#define WG_D128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21," \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, " \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
  "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, " \
  "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, " \
  "%101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, " \
  "%117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define WG_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_F16(d, i) WG_F4(d, i), WG_F4(d, i + 4), WG_F4(d, i + 8), WG_F4(d, i + 12)
#define WG_F32(d, i) WG_F16(d, i), WG_F16(d, i + 16)
#define WG_F64(d, i) WG_F32(d, i), WG_F32(d, i + 32)
#define WG_F128(d, i) WG_F64(d, i), WG_F64(d, i + 64)
// d (+)= A B, m64n64k16, A and B K-major from descriptors (S = Q K^T).
#define WG_SS(TY) asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " WG_D32 ", %32, %33, 1, 1, " \
                               "1, 0, 0;" : WG_F32(d, 0) : "l"(a), "l"(b))
// d (+)= A B, m64nNk16, A from registers, B MN-major from a descriptor (O += P V).
#define WG_RS(TY, N, D, F, A) asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " D ", " A \
                                           ", 1, 1, 1, 1;" : F(d, 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), \
                                           "l"(b))

template <class T>
__device__ __forceinline__ void wg_ss64(float (&s)[8][4], unsigned long long a, unsigned long long b) {
  float(&d)[32] = reinterpret_cast<float(&)[32]>(s);
  if constexpr (TcHalf<T>::value) WG_SS("f16");
  else WG_SS("bf16");
}

template <class T, int N>
__device__ __forceinline__ void wg_rs(float (&o)[N / 8][4], const unsigned (&a)[4], unsigned long long b) {
  float(&d)[N / 2] = reinterpret_cast<float(&)[N / 2]>(o);
  static_assert(N == 64 || N == 128 || N == 256, "m64nNk16 with N = a head-size bucket");
  if constexpr (N == 64) {
    if constexpr (TcHalf<T>::value) WG_RS("f16", 64, WG_D32, WG_F32, "{%32, %33, %34, %35}, %36");
    else WG_RS("bf16", 64, WG_D32, WG_F32, "{%32, %33, %34, %35}, %36");
  } else if constexpr (N == 128) {
    if constexpr (TcHalf<T>::value) WG_RS("f16", 128, WG_D64, WG_F64, "{%64, %65, %66, %67}, %68");
    else WG_RS("bf16", 128, WG_D64, WG_F64, "{%64, %65, %66, %67}, %68");
  } else {
    if constexpr (TcHalf<T>::value) WG_RS("f16", 256, WG_D128, WG_F128, "{%128, %129, %130, %131}, %132");
    else WG_RS("bf16", 256, WG_D128, WG_F128, "{%128, %129, %130, %131}, %132");
  }
}
#undef WG_SS
#undef WG_RS
#undef WG_F128
#undef WG_F64
#undef WG_F32
#undef WG_F16
#undef WG_F4
#undef WG_D128
#undef WG_D64
#undef WG_D32

}  // namespace cupaged
