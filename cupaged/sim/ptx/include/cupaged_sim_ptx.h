// cupaged_sim_ptx.h: what inline PTX becomes on the sim (included by cupaged_sim.h).
//
// The sim's compile step (cupaged/sim/ptx/_asm.py) rewrites each `asm` statement of the kernel source
// into C++ that binds its operands by constraint ("r" -> uint32_t, "h" -> uint16_t, "l" ->
// uint64_t, "f" float, "d" double, "n" an immediate) and calls the functions below, one per PTX
// instruction. Addresses of the `.shared` state space are offsets from `smem_base` (the start of
// the block's shared memory, static then dynamic), as `__cvta_generic_to_shared` returns them.
// Warp-wide instructions (mma.sync, ldmatrix, stmatrix) live in cupaged_sim_mma.h.
#pragma once

namespace cupaged_sim {
namespace ptx {

// ---- operand binding: a C++ value as register bits, and register bits into a C++ lvalue
template <class R, class T>
inline R in(const T& v) {
  if constexpr (std::is_pointer_v<T>) return R(reinterpret_cast<uintptr_t>(v));
  else if constexpr (std::is_floating_point_v<R>) { static_assert(std::is_arithmetic_v<T>, "an \"f\"/\"d\" operand must be arithmetic"); return R(v); }
  else if constexpr (std::is_integral_v<T> || std::is_enum_v<T>) return R(v);
  else {
    static_assert(sizeof(T) == sizeof(R), "an asm operand's C++ type does not fit its constraint's register size");
    R r;
    memcpy(&r, &v, sizeof r);
    return r;
  }
}
template <class T, class R>
inline void out(T& lv, const R& bits) {
  if constexpr (std::is_floating_point_v<R> && std::is_arithmetic_v<T>) lv = T(bits);
  else if constexpr (std::is_integral_v<T> && std::is_integral_v<R>) lv = T(bits);
  else {
    static_assert(sizeof(T) == sizeof(R), "an asm output's C++ type does not fit its constraint's register size");
    memcpy(&lv, &bits, sizeof lv);
  }
}
// Raw bits of a register of any width, and the inverse.
template <class T> inline unsigned long long bits(const T& v) {
  unsigned long long b = 0;
  memcpy(&b, &v, sizeof(T) < 8 ? sizeof(T) : 8);
  return b;
}
template <class T> inline void set(T& r, unsigned long long b) { memcpy(&r, &b, sizeof(T)); }
inline float f32(unsigned long long b) { return from_bits<float>(b); }
inline unsigned long long of(float f) { return to_bits(f); }

[[noreturn]] inline void fail(int code, int line, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (line > 0) set_error(code, "inline PTX (line %d): %s", line, buf);
  else set_error(code, "%s", buf);
  abort_fiber();
}

// ---- special registers
inline unsigned laneid() { return unsigned(g.cur->lane); }
inline unsigned warpid() { return unsigned(g.cur->warp); }

// ---- state spaces
inline unsigned long long to_shared(const void* p, int line) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(g.smem_base);
  if (a < b || a - b >= g.smem_size)
    fail(E_MEMORY, line, "__cvta_generic_to_shared(%p): not an address in the block's shared memory", p);
  return a - b;
}
inline char* shared_ptr(unsigned long long a, unsigned size, unsigned align, int line, const char* op) {
  if (a % align) fail(E_MEMORY, line, "%s: misaligned shared address 0x%llx (needs %u-byte alignment)", op, a, align);
  if (a > g.smem_size || size > g.smem_size - a)
    fail(E_MEMORY, line, "%s: shared address 0x%llx + %u bytes is outside the block's %llu bytes of shared memory",
         op, a, size, g.smem_size);
  return g.smem_base + a;
}
inline char* global_ptr(unsigned long long a, unsigned align, int line, const char* op, bool write = false) {
  if (a % align) {  // reported as a misaligned typed access is: the launcher names the array and the offset
    set_error(E_MEMORY, "inline PTX (line %d): %s: misaligned global %s (needs %u-byte alignment)", line, op,
              write ? "store" : "access", align);
    instrumented_fault(a, write);
  }
  return reinterpret_cast<char*>(uintptr_t(a));
}
// space: 0 generic, 1 global, 2 shared
inline char* address(int space, unsigned long long a, unsigned size, int line, const char* op, bool write = false) {
  return space == 2 ? shared_ptr(a, size, size, line, op) : global_ptr(a, size, line, op, write);
}
inline unsigned long long load(const char* p, unsigned size, bool sign) {
  unsigned long long v = 0;
  memcpy(&v, p, size);
  if (sign && size < 8 && (v >> (8 * size - 1) & 1)) v |= ~0ull << (8 * size);
  return v;
}
inline void store(char* p, unsigned size, unsigned long long v) { memcpy(p, &v, size); }

// ---- integer and bit instructions
inline unsigned prmt(unsigned a, unsigned b, unsigned c, int mode) {
  unsigned char x[8];
  for (int i = 0; i < 4; ++i) { x[i] = (unsigned char)(a >> (8 * i)); x[4 + i] = (unsigned char)(b >> (8 * i)); }
  static const unsigned char kModes[6][4][4] = {  // f4e b4e rc8 ecl ecr rc16: byte selected per c[1:0]
      {{0, 1, 2, 3}, {1, 2, 3, 4}, {2, 3, 4, 5}, {3, 4, 5, 6}}, {{0, 7, 6, 5}, {1, 0, 7, 6}, {2, 1, 0, 7}, {3, 2, 1, 0}},
      {{0, 0, 0, 0}, {1, 1, 1, 1}, {2, 2, 2, 2}, {3, 3, 3, 3}}, {{0, 1, 2, 3}, {1, 1, 2, 3}, {2, 2, 2, 3}, {3, 3, 3, 3}},
      {{0, 0, 0, 0}, {0, 1, 1, 1}, {0, 1, 2, 2}, {0, 1, 2, 3}}, {{0, 1, 0, 1}, {2, 3, 2, 3}, {0, 1, 0, 1}, {2, 3, 2, 3}}};
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    unsigned char byte;
    if (mode < 0) {
      unsigned s = c >> (4 * i) & 0xFu;
      byte = x[s & 7u];
      if (s & 8u) byte = (byte & 0x80u) ? 0xFFu : 0x00u;
    } else {
      byte = x[kModes[mode][c & 3u][i]];
    }
    r |= unsigned(byte) << (8 * i);
  }
  return r;
}
inline unsigned lop3(unsigned a, unsigned b, unsigned c, unsigned lut) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((lut >> ((a >> i & 1u) << 2 | (b >> i & 1u) << 1 | (c >> i & 1u))) & 1u) << i;
  return r;
}

// ---- conversions (NVIDIA's host conversions are bit-exact; relu clamps negatives, keeps NaN)
inline float relu(float x) { return x < 0.0f ? 0.0f : x; }
inline unsigned short f16_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
inline unsigned short bf16_bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
inline float f16_value(unsigned short b) { return __half2float(__ushort_as_half(b)); }
inline float bf16_value(unsigned short b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
inline unsigned char to_fp8(float x, bool e5m2) {
  return (unsigned char)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}
inline unsigned short fp8_to_f16_bits(unsigned char v, bool e5m2) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)v, e5m2 ? __NV_E5M2 : __NV_E4M3);
  return h.x;
}
// cvt.rn{.relu}{.satfinite}.{f16,bf16}x2.f32 d, a, b: a -> upper half, b -> lower half
inline unsigned cvt_x2_f32(float a, float b, bool bf16, bool relu_, bool satfinite) {
  auto one = [&](float x) -> unsigned {
    if (relu_) x = relu(x);
    if (satfinite && !std::isnan(x)) {
      float m = bf16 ? 3.3895313892515355e38f : 65504.0f;
      x = x > m ? m : x < -m ? -m : x;
    }
    return bf16 ? bf16_bits(x) : f16_bits(x);
  };
  return one(a) << 16 | one(b);
}
// cvt.rn.satfinite{.relu}.{e4m3,e5m2}x2.f32 d, a, b: a -> upper byte, b -> lower byte
inline unsigned short cvt_fp8x2_f32(float a, float b, bool e5m2, bool relu_) {
  if (relu_) { a = relu(a); b = relu(b); }
  return (unsigned short)(to_fp8(a, e5m2) << 8 | to_fp8(b, e5m2));
}
inline unsigned short cvt_fp8x2_f16x2(unsigned a, bool e5m2, bool relu_) {
  return cvt_fp8x2_f32(f16_value((unsigned short)(a >> 16)), f16_value((unsigned short)a), e5m2, relu_);
}
// cvt.rn{.relu}.f16x2.{e4m3,e5m2}x2 d, a: the upper byte of a -> the upper half of d
inline unsigned cvt_f16x2_fp8x2(unsigned short a, bool e5m2, bool relu_) {
  unsigned short hi = fp8_to_f16_bits((unsigned char)(a >> 8), e5m2), lo = fp8_to_f16_bits((unsigned char)a, e5m2);
  if (relu_) {
    if ((hi & 0x8000u) && (hi & 0x7FFFu) <= 0x7C00u) hi = 0;
    if ((lo & 0x8000u) && (lo & 0x7FFFu) <= 0x7C00u) lo = 0;
  }
  return unsigned(hi) << 16 | lo;
}

// ---- approximate math (the GPU's MUFU results are within ~2 ulp of these)
inline float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }

// ---- cp.async: the copy lands in shared memory when a wait covers its commit group
inline void cp_async(unsigned long long dst, unsigned long long src, unsigned cp_size, long long src_size, int line,
                     const char* op) {
  if (cp_size != 4 && cp_size != 8 && cp_size != 16) fail(E_MEMORY, line, "%s: cp-size must be 4, 8 or 16, got %u", op, cp_size);
  if (src_size < 0 || src_size > cp_size)
    fail(E_MEMORY, line, "%s: src-size %lld is outside 0..%u (the copy size)", op, src_size, cp_size);
  char* d = shared_ptr(dst, cp_size, cp_size, line, op);
  AsyncCopy c{d, int(cp_size), g_async_committed[g.cur->linear], {}};
  if (src_size > 0) memcpy(c.data, global_ptr(src, cp_size, line, op), size_t(src_size));  // a fault names the array
#if defined(CUPAGED_SIM_PROFILE)
  if (g_prof) {  // the copy is an access of the emulation's own: its site is the asm statement's line
    const void* site = prof_line_site(line);
    g_prof->cp_async_bytes += cp_size;
    prof_async_issue(cp_size);
    if (src_size > 0) prof_record(uintptr_t(src), unsigned(src_size), false, site);
    prof_record(uintptr_t(d), cp_size, true, site);
  }
#endif
  g_async[g.cur->linear].push(c);
  memset(d, g.poison, cp_size);  // until a wait covers it, the destination holds poison, as a racing read could see
}
inline void cp_async_commit() {
  ++g_async_committed[g.cur->linear];
  CUPAGED_SIM_PROF(if (g_prof) prof_async_commit());
}
inline void cp_async_wait(unsigned long long pending) {
  CUPAGED_SIM_PROF(prof_sched_point(g.cur); if (g_prof) prof_async_wait(pending));
  AsyncQueue& q = g_async[g.cur->linear];
  unsigned done = g_async_committed[g.cur->linear];
  done = pending >= done ? 0u : done - unsigned(pending);
  for (; q.head < q.size && q.data[q.head].group < done; ++q.head)
    memcpy(q.data[q.head].dst, q.data[q.head].data, size_t(q.data[q.head].size));
}
inline void cp_async_wait_all() { cp_async_commit(); cp_async_wait(0); }

}  // namespace ptx
}  // namespace cupaged_sim

// CUDA's address-space conversions (the sim's shared window starts at the block's shared memory)
inline size_t __cvta_generic_to_shared(const void* p) { return size_t(::cupaged_sim::ptx::to_shared(p, 0)); }
inline void* __cvta_shared_to_generic(size_t a) { return ::cupaged_sim::g.smem_base + a; }
inline size_t __cvta_generic_to_global(const void* p) { return size_t(reinterpret_cast<uintptr_t>(p)); }
inline void* __cvta_global_to_generic(size_t a) { return reinterpret_cast<void*>(uintptr_t(a)); }
inline unsigned __isShared(const void* p) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(::cupaged_sim::g.smem_base);
  return a >= b && a - b < ::cupaged_sim::g.smem_size;
}
inline unsigned __isGlobal(const void* p) { return !__isShared(p); }
