// tensor_core.cuh: the Ampere tensor-core instructions as inline PTX (sm_80+; the sim emulates each one
// with the ISA's exact fragment layouts): ldmatrix (plain and .trans) and mma.sync m16n8k16 with fp32
// accumulators, for __half and __nv_bfloat16 operands; tc_part (P in 16-bit parts) and tc_fp8x2 (fp8 codes to a
// fragment register).
//
// Fragments (PTX ISA, "Matrix fragments for mma.m16n8k16"; g = lane / 4, t = lane % 4), each register two
// 16-bit elements, the lower-numbered column in the low half:
//   A 16x16 (row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..): one ldmatrix.x4
//     whose lane l gives the address of row l % 16, column 8 (l / 16) of a row-major tile.
//   B 16x8 (col): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g). From a tile stored [n][k] (k contiguous): plain
//     ldmatrix, lane l addressing n row 8 (l / 16) + l % 8 and k column 8 (l / 8 % 2) gives b0, b1 of n tile 0,
//     then of n tile 1. From a tile stored [k][n] (n contiguous): ldmatrix.trans, lane l addressing k row l % 16
//     and n column 8 (l / 16), gives b0, b1 of n tile 0, then of n tile 1.
//   C 16x8 fp32: c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..).
// ldmatrix row addresses are 16-byte aligned; 8 rows read at one column are conflict-free when the row
// stride in 4-byte words is 4 or 20 mod 32 (the callers pad their rows).
//
// Used by:   paged_attention.cu: attention/decode_mma.cuh, prefill.cuh, mla_decode.cuh
// Test:      pytest tests/test_mla.py tests/test_decode_accuracy.py tests/test_paged_attention.py (through those
//            kernels); the instructions' emulation: tests/sim/test_ptx_mma.py, tests/sim/test_gemm.py
// Benchmark: python profiling/bench_mla.py; python profiling/bench_paged_attention.py
#pragma once
#include "common.cuh"

namespace cupaged {

__device__ __forceinline__ unsigned tc_smem(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void tc_ldmatrix_x4(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tc_smem(row)) : "memory");
}

__device__ __forceinline__ void tc_ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tc_smem(row)) : "memory");
}

template <class T> struct TcHalf { static constexpr bool value = false; };
template <> struct TcHalf<__half> { static constexpr bool value = true; };

__device__ __forceinline__ void tc_ldmatrix_x2(unsigned (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(tc_smem(row)) : "memory");
}

// d += a (16x16, row) * b (16x8, col), every product exact and summed in fp32; T: __half or __nv_bfloat16.
template <class T>
__device__ __forceinline__ void tc_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (TcHalf<T>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// d += a (16x8, row: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..)) * b (8x8, col: b0 = (k 2t..2t+1, n g)), in fp32.
template <class T>
__device__ __forceinline__ void tc_mma_k8(float (&d)[4], const unsigned (&a)[2], unsigned b0) {
  if constexpr (TcHalf<T>::value) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(b0));
  } else {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(b0));
  }
}

// Two 16-bit elements as one fragment register: lo in the low half.
template <class T>
__device__ __forceinline__ unsigned tc_pack(T lo, T hi) {
  return unsigned(*reinterpret_cast<const unsigned short*>(&lo)) |
         unsigned(*reinterpret_cast<const unsigned short*>(&hi)) << 16;
}

// The next 16-bit part of float32 elements x (a fragment register): x keeps what is left, so parts taken in turn
// sum to x (fp16: two keep ~22 bits, bf16: three).
template <class T>
__device__ __forceinline__ unsigned tc_part(float2& x) {
  const T a = from_float<T>(x.x), b = from_float<T>(x.y);
  x = make_float2(x.x - to_float(a), x.y - to_float(b));
  return tc_pack<T>(a, b);
}

// Two fp8 codes (the low 16 bits) as a fragment register of two T: exact (every fp8 value is a T).
template <int KV, class T>
__device__ __forceinline__ unsigned tc_fp8x2(unsigned codes) {
  unsigned bits;  // two halves
  if constexpr (KV == KV_E5M2) {  // an e5m2 code is the top byte of its half
    bits = (codes & 0xffu) << 8 | (codes & 0xff00u) << 16;
  } else {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((unsigned short)codes, __NV_E4M3);
    bits = unsigned(h.x) | unsigned(h.y) << 16;
  }
  if constexpr (TcHalf<T>::value) return bits;
  const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(*reinterpret_cast<const __half2*>(&bits)));
  return *reinterpret_cast<const unsigned*>(&b);  // one cvt.rn.bf16x2.f32
}

}  // namespace cupaged
