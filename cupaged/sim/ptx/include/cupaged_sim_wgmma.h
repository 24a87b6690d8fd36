// cupaged_sim_wgmma.h: wgmma.mma_async and its fence / commit_group / wait_group on the sim.
//
// wgmma.mma_async.sync.aligned.m64nNkK: D (64 x N) = A (64 x K) * B (K x N) + (scale-d ? C : 0), with
// K = 16 for f16/bf16 inputs and 32 for e4m3/e5m2. The 128 threads of a warpgroup all execute the
// statement (cupaged_sim_async.h's warpgroup rendezvous); the last to arrive computes.
//  * Fragments (PTX ISA, wgmma register fragments): warp w of the warpgroup holds rows 16w..16w+15;
//    lane l (group g = l / 4, t = l % 4) holds, of the f32 accumulator, register i at row 16w + g +
//    8 * (i / 2 % 2), column 8 * (i / 4) + 2t + i % 2; an f16 accumulator packs the pairs (i, i + 1)
//    into one register, the lower column in the low half. A from registers is mma.sync's A fragment
//    of m16n8k16 (m16n8k32 for 8-bit types) per warp.
//  * Shared-memory operands come from matrix descriptors: start address, leading and stride byte
//    offsets (bits 0-13, 16-29, 32-45, each >> 4), base offset (49-51) and swizzle (62-63: 0 none,
//    1 128B, 2 64B, 3 32B). Element (r, k) of an operand (r: M for A, N for B) sits in the canonical
//    layouts, with T = 16 / element bytes and W = swizzle bytes / 16:
//      K-major, none:      start + (r % 8) * 16 + (r / 8) * SBO + (k / T) * LBO + (k % T) * bytes
//      K-major, swizzled:  start + (r % 8) * 16W + (r / 8) * SBO + (k / T) * 16 + (k % T) * bytes
//      MN-major, none:     start + (r % T) * bytes + (r / T) * SBO + (k % 8) * 16 + (k / 8) * LBO
//      MN-major, swizzled: start + (r % T) * bytes + (r / T % W) * 16 + (r / TW) * LBO + (k % 8) * 16W + (k / 8) * SBO
//    and a swizzle of 2^B chunks XORs address bits [4, 4+B) with ((address >> 7) - base offset) mod 2^B.
//    MN-major (the transpose immediates) exists for 16-bit inputs only.
//  * Rounding: products are exact; C + A[r,0]B[0,c] + ... + A[r,K-1]B[K-1,c] is summed in float64 in
//    that order and rounded once to f32 (or f16), as the mma.sync emulation does.
//  * Asynchrony: the statement writes poison into its accumulator registers; the values land when a
//    wgmma.wait_group covers the wgmma's group, written through the addresses of the C++ variables the
//    asm bound (they must still be alive then, as registers are on a GPU). A wgmma whose accumulators
//    are still in flight from an earlier one chains to it, as the hardware orders same-shape
//    accumulation. The variables A's registers came from read poison too until that wait, which
//    restores them (reading them before is undefined in the ISA). Errors: a register in flight written
//    by another instruction; a thread's first
//    wgmma without a wgmma.fence before it; after a landing, A registers, or accumulators whose values
//    changed, used without a wgmma.fence in between; warpgroup operands (descriptors, scale-d) that
//    differ between threads; shared operands written by generic stores without fence.proxy.async.
#pragma once

namespace cupaged_sim {
namespace ptx {

struct WgmmaArgs {  // one thread's operands of a wgmma.mma_async
  int n, ta, tb, cf16, trans_a, trans_b, neg_a, neg_b;  // the statement's (the same in every thread)
  unsigned long long desc_a, desc_b;
  int scale_d;
  unsigned* a;  // the A fragment's 4 registers, or null (A from desc_a)
  unsigned* d;        // in: C, out: D (n / 2 registers, n / 4 for an f16 accumulator)
};

inline int imm01(unsigned long long v, int line) {
  if (v > 1) fail(E_SYNC, line, "wgmma.mma_async: a transpose immediate must be 0 or 1, got %lld", (long long)v);
  return int(v);
}
inline int neg(unsigned long long v, int line) {  // imm-scale-a/b: 1, or -1 to negate the matrix
  if ((long long)v != 1 && (long long)v != -1)
    fail(E_SYNC, line, "wgmma.mma_async: imm-scale-a/b must be 1 or -1, got %lld", (long long)v);
  return (long long)v == -1;
}
// The variable an "r" operand came from (poisoned while a wgmma reads it), or null for a temporary.
template <class T>
inline void* lvalue_address(T&& x) {
  if constexpr (std::is_lvalue_reference_v<T&&> && sizeof(std::remove_reference_t<T>) == 4) return (void*)(&x);
  else return nullptr;
}
inline unsigned poison_word() { return 0x01010101u * static_cast<unsigned char>(g.poison); }

CUPAGED_SIM_ASYNC_FN static unsigned long long wgmma_address(unsigned long long desc, int r, int k, int bytes, bool mn, int line) {
  unsigned long long start = (desc & 0x3FFFu) << 4, lbo = (desc >> 16 & 0x3FFFu) << 4, sbo = (desc >> 32 & 0x3FFFu) << 4;
  int base = int(desc >> 49 & 7u), code = int(desc >> 62);
  int mode = code == 0 ? 0 : 4 - code;  // 1 128B -> 3 bits, 2 64B -> 2, 3 32B -> 1
  int t = 16 / bytes, w = 1 << mode;
  unsigned long long a;
  if (!mn) a = start + (r % 8) * 16 * (mode ? w : 1) + (r / 8) * sbo + (k / t) * (mode ? 16 : lbo) + (k % t) * bytes;
  else if (!mode) a = start + (r % t) * bytes + (r / t) * sbo + (k % 8) * 16 + (k / 8) * lbo;
  else a = start + (r % t) * bytes + (r / t % w) * 16 + (r / (t * w)) * lbo + (k % 8) * 16 * w + (k / 8) * sbo;
  if (mode) a ^= (((a >> 7) - unsigned(base)) & unsigned(w - 1)) << 4;
  if (g.smem_size > (1ull << 18)) {  // the module's static __shared__ of every kernel precede the dynamic buffer
    set_error(E_MEMORY, "inline PTX (line %d): wgmma.mma_async: this launch's shared window is %llu bytes (the static "
              "__shared__ variables of every kernel in the module, then the dynamic buffer), over the 256 KB a matrix "
              "descriptor's start address reaches: addresses past it would wrap; keep the kernels of a wgmma module's "
              "shared memory dynamic", line, g.smem_size);
    abort_fiber();
  }
  if (a + bytes > g.smem_size) {
    set_error(E_MEMORY, "inline PTX (line %d): wgmma.mma_async: the descriptor 0x%016llx puts element (%d, %d) at shared "
              "address 0x%llx, outside the block's %llu bytes of shared memory", line, desc, r, k, a, g.smem_size);
    abort_fiber();
  }
  proxy_read(a, size_t(bytes), "wgmma.mma_async", line);
  return a;
}

CUPAGED_SIM_ASYNC_FN static double wgmma_element(const unsigned char* p, int type) {
  unsigned short h = (unsigned short)(p[0] | (type <= T_BF16 ? p[1] << 8 : 0));
  return type == T_F16 ? f16_value(h) : type == T_BF16 ? bf16_value(h) : f16_value(fp8_to_f16_bits(p[0], type == T_E5M2));
}

CUPAGED_SIM_ASYNC_FN static void wgmma_compute(int base) {
  static double A[64][32], B[32][256];  // module data: a fiber's stack is too small for them
  const WgmmaArgs& p = *static_cast<const WgmmaArgs*>(g.threads[base].xop);
  for (int i = base + 1; i < base + 128; ++i) {
    const WgmmaArgs& q = *static_cast<const WgmmaArgs*>(g.threads[i].xop);
    if (q.desc_a != p.desc_a || q.desc_b != p.desc_b || q.scale_d != p.scale_d) {
      g.cur = &g.threads[i];
      fail(E_SYNC, g.threads[i].line, "wgmma.mma_async: thread %d passes %s differing from thread %d's: they must be the "
           "same across the warpgroup", i, q.scale_d != p.scale_d ? "scale-d" : "a matrix descriptor", base);
    }
  }
  const bool fp8 = p.ta >= T_E4M3;
  const int K = fp8 ? 32 : 16, bytes = fp8 ? 1 : 2, per = fp8 ? 4 : 2, line = g.threads[base].line;
  const double sa = p.neg_a ? -1.0 : 1.0, sb = p.neg_b ? -1.0 : 1.0;
  for (int t = 0; t < 128; ++t) {
    const WgmmaArgs& q = *static_cast<const WgmmaArgs*>(g.threads[base + t].xop);
    if (!q.a) break;
    int w = t / 32, grp = t % 32 >> 2, tig = t & 3;
    for (int i = 0; i < 4 * per; ++i) {
      int row = 16 * w + grp + 8 * ((i / per) & 1), col = tig * per + i % per + (K / 2) * (i >= 2 * per);
      A[row][col] = sa * element(q.a[i / per], i % per, p.ta);
    }
  }
  if (!p.a)
    for (int r = 0; r < 64; ++r)
      for (int k = 0; k < K; ++k)
        A[r][k] = sa * wgmma_element(reinterpret_cast<unsigned char*>(g.smem_base) +
                                     wgmma_address(p.desc_a, r, k, bytes, p.trans_a, line), p.ta);
  for (int c = 0; c < p.n; ++c)
    for (int k = 0; k < K; ++k)
      B[k][c] = sb * wgmma_element(reinterpret_cast<unsigned char*>(g.smem_base) +
                                   wgmma_address(p.desc_b, c, k, bytes, p.trans_b, line), p.tb);
  for (int t = 0; t < 128; ++t) {
    unsigned* d = static_cast<const WgmmaArgs*>(g.threads[base + t].xop)->d;
    unsigned c[128];
    memcpy(c, d, sizeof(unsigned) * unsigned(p.cf16 ? p.n / 4 : p.n / 2));
    int w = t / 32, grp = t % 32 >> 2, tig = t & 3;
    for (int i = 0; i < p.n / 2; ++i) {
      int row = 16 * w + grp + 8 * (i >> 1 & 1), col = 8 * (i >> 2) + 2 * tig + (i & 1), half = p.cf16 ? (i & 1) : 0;
      unsigned cr = c[p.cf16 ? i / 2 : i];
      double acc = !p.scale_d ? 0.0 : p.cf16 ? f16_value((unsigned short)(cr >> (16 * half))) : f32(cr);
      for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
      unsigned& reg = d[p.cf16 ? i / 2 : i];
      if (!p.cf16) reg = unsigned(of(float(acc)));
      else reg = (half ? reg & 0xFFFFu : 0u) | unsigned(__half_as_ushort(__double2half(acc))) << (16 * half);
    }
  }
  CUPAGED_SIM_PROF(if (g_prof) (fp8 ? g_prof->gmma_fp8_flops : g_prof->gmma_flops) += 2ull * 64 * unsigned(p.n) * unsigned(K));
}

CUPAGED_SIM_ASYNC_FN static long wgmma_find(const WgReg* a, size_t n, const void* reg) {
  for (size_t j = n; j-- > 0;)
    if (a[j].reg == reg) return long(j);
  return -1;
}

// A register in flight (accumulator or A fragment) used again: the current variable must still hold
// poison, and the value is the in-flight one; the older entry goes.
CUPAGED_SIM_ASYNC_FN static bool wgmma_chain(WgThread& w, const void* reg, unsigned& value, unsigned pw, const char* what,
                                             int i, int line) {
  long e = wgmma_find(w.regs, w.n, reg);
  if (e < 0) return false;
  if (value != pw)
    fail(E_SYNC, line, "wgmma.mma_async: %s register %d of thread %d was written by another instruction while a wgmma "
         "on it was in flight", what, i, g.cur->linear);
  value = w.regs[e].value;
  memmove(w.regs + e, w.regs + e + 1, (w.n - size_t(e) - 1) * sizeof(WgReg));
  --w.n;
  return true;
}

// One thread's part of wgmma.mma_async: regs[i] is the variable bound to accumulator register i,
// aregs[j] the variable A's register j came from (null: A from shared memory, or a temporary).
CUPAGED_SIM_ASYNC_FN inline void wgmma(const void* site, int line, WgmmaArgs& args, void* const* regs, void* const* aregs) {
  SimThread* t = g.cur;
  WgThread& w = g_wgt[t->linear];
  const unsigned pw = poison_word();
  const int nd = args.cf16 ? args.n / 4 : args.n / 2;
  if (!w.fenced && !w.issued)
    fail(E_SYNC, line, "wgmma.mma_async: a thread's first wgmma.mma_async must follow a wgmma.fence (thread %d)", t->linear);
  if (!w.fenced && w.landed && args.a)
    fail(E_SYNC, line, "wgmma.mma_async: A registers after a wgmma.wait_group without a wgmma.fence in between (thread %d)",
         t->linear);
  for (int j = 0; args.a && j < 4; ++j)
    if (aregs[j]) wgmma_chain(w, aregs[j], args.a[j], pw, "A fragment", j, line);
  for (int i = 0; i < nd; ++i) {
    if (wgmma_chain(w, regs[i], args.d[i], pw, "accumulator", i, line)) {  // chained to the wgmma writing it
    } else if (!w.fenced && w.landed && args.scale_d) {
      long l = wgmma_find(w.log, w.nlog, regs[i]);
      if (l < 0 || w.log[l].value != args.d[i])
        fail(E_SYNC, line, "wgmma.mma_async: accumulator register %d of thread %d changed after a wgmma.wait_group without "
             "a wgmma.fence in between", i, t->linear);
    }
  }
  t->xop = &args;
  warpgroup_op("wgmma.mma_async", &wgmma_compute, site, line);
  for (int i = 0; i < nd; ++i) {
    wg_push(w.regs, w.n, w.cap, WgReg{regs[i], args.d[i], w.committed, false});
    args.d[i] = pw;
  }
  for (int j = 0; args.a && j < 4; ++j)  // A's variables read poison until the wait (the ISA: undefined)
    if (aregs[j]) {
      wg_push(w.regs, w.n, w.cap, WgReg{aregs[j], args.a[j], w.committed, true});
      memcpy(aregs[j], &pw, 4);
    }
  w.issued = true;
}

CUPAGED_SIM_ASYNC_FN inline void wgmma_fence() {
  WgThread& w = g_wgt[g.cur->linear];
  w.fenced = true;
  w.landed = false;
  w.nlog = 0;
}
CUPAGED_SIM_ASYNC_FN inline void wgmma_commit() { ++g_wgt[g.cur->linear].committed; }

CUPAGED_SIM_ASYNC_FN inline void wgmma_wait(unsigned long long pending, int line) {
  WgThread& w = g_wgt[g.cur->linear];
  const unsigned pw = poison_word(), done = pending >= w.committed ? 0u : w.committed - unsigned(pending);
  size_t k = 0;
  for (size_t j = 0; j < w.n; ++j) {
    WgReg r = w.regs[j];
    if (r.group >= done) { w.regs[k++] = r; continue; }
    if (memcmp(r.reg, &pw, 4) != 0)
      fail(E_SYNC, line, "wgmma.wait_group: %s register of thread %d was written by another instruction while its "
           "wgmma was in flight", r.a_fragment ? "an A fragment" : "an accumulator", g.cur->linear);
    memcpy(r.reg, &r.value, 4);
    wg_push(w.log, w.nlog, w.logcap, r);
    w.landed = true;
    w.fenced = false;
  }
  w.n = k;
}

}  // namespace ptx
}  // namespace cupaged_sim
