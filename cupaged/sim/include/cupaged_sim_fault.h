// cupaged_sim_fault.h: the memory operand of a faulting x86-64 instruction, for sim error messages.
//
// A load or store through a non-canonical address (bits 63..47 not all equal, e.g. p[1LL << 60])
// raises a general-protection fault, not a page fault, and Linux delivers it as SIGSEGV with
// si_code SI_KERNEL and si_addr 0. The engine's signal handler recomputes the address from the
// instruction at RIP and the registers saved in the signal's context, and reports the base and
// index register values too, so Python can name the argument a wild access started from.
//
// Decoded: legacy and REX prefixes, VEX (C4/C5; the kernels are built without AVX, so only library
// code has it), the 1-, 2- and 3-byte opcode maps, ModRM + SIB + displacement, string
// instructions (rsi/rdi) and moffs. Immediates are never needed: only a RIP-relative operand
// depends on the instruction's length, and that one is never non-canonical. Not decoded (the
// address stays unknown): EVEX, FS/GS-relative operands, and instructions without a memory operand.
#pragma once
#include <csignal>
#include <cstring>

namespace cupaged_sim {

struct MemOperand {
  unsigned long long addr;   // effective address
  unsigned long long base;   // value of the base register, 0 when there is none
  unsigned long long index;  // value of the index register (unscaled), 0 when there is none
};

static bool non_canonical(unsigned long long a) { return (long long)(a << 16) >> 16 != (long long)a; }

#if defined(__x86_64__)
static const int kGreg[16] = {REG_RAX, REG_RCX, REG_RDX, REG_RBX, REG_RSP, REG_RBP, REG_RSI, REG_RDI,
                              REG_R8,  REG_R9,  REG_R10, REG_R11, REG_R12, REG_R13, REG_R14, REG_R15};

static bool has_modrm(unsigned char op) {  // one-byte opcode map
  if (op < 0x40) return (op & 7) < 4;     // add/or/adc/sbb/and/sub/xor/cmp r/m forms
  return op == 0x63 || op == 0x69 || op == 0x6B || (op >= 0x80 && op <= 0x8F) || op == 0xC0 || op == 0xC1 ||
         op == 0xC6 || op == 0xC7 || (op >= 0xD0 && op <= 0xD3) || (op >= 0xD8 && op <= 0xDF) || op == 0xF6 ||
         op == 0xF7 || op == 0xFE || op == 0xFF;
}

static bool has_modrm_0f(unsigned char op) {  // two-byte opcode map: all but these
  return !((op >= 0x05 && op <= 0x09) || op == 0x0B || op == 0x0E || (op >= 0x30 && op <= 0x37) || op == 0x77 ||
           (op >= 0x80 && op <= 0x8F) || (op >= 0xA0 && op <= 0xA2) || (op >= 0xA8 && op <= 0xAA) || op >= 0xC8);
}

template <class T>
static T read_at(const unsigned char*& p) {
  T v;
  memcpy(&v, p, sizeof v);
  p += sizeof v;
  return v;
}

static bool decode_mem_operand(const unsigned char* p, const greg_t* r, MemOperand* out) {
  bool addr32 = false;
  for (int n = 0;; ++p, ++n) {
    unsigned char b = *p;
    if (n == 14) return false;
    if (b == 0x64 || b == 0x65) return false;  // FS/GS: the segment base is not in gregs
    if (b == 0x67) addr32 = true;
    else if (b != 0x66 && b != 0xF0 && b != 0xF2 && b != 0xF3 && b != 0x26 && b != 0x2E && b != 0x36 && b != 0x3E)
      break;
  }
  unsigned rex = (*p & 0xF0) == 0x40 ? *p++ & 0xF : 0;  // W R X B
  unsigned char op = *p++;
  bool modrm;
  if (op == 0xC4 || op == 0xC5) {  // VEX: inverted R (and X, B in the 3-byte form)
    unsigned char b1 = *p++;
    rex = op == 0xC5 ? 0 : ((~b1 >> 5) & 3);
    if (op == 0xC4) ++p;  // W vvvv L pp
    modrm = !(op == 0xC5 || (b1 & 0x1F) == 1) || *p != 0x77;  // vzeroupper / vzeroall
    ++p;
  } else if (op == 0x62) {
    return false;  // EVEX
  } else if (op == 0x0F) {
    unsigned char op2 = *p++;
    modrm = op2 == 0x38 || op2 == 0x3A ? (++p, true) : has_modrm_0f(op2);
  } else if (op >= 0xA0 && op <= 0xA3) {  // mov with a 64-bit absolute address (moffs)
    out->addr = addr32 ? read_at<unsigned>(p) : read_at<unsigned long long>(p);
    out->base = out->index = 0;
    return true;
  } else if ((op >= 0xA4 && op <= 0xA7) || (op >= 0xAA && op <= 0xAF)) {  // movs cmps stos lods scas
    unsigned long long si = (unsigned long long)r[REG_RSI], di = (unsigned long long)r[REG_RDI];
    if (addr32) { si &= 0xFFFFFFFFull; di &= 0xFFFFFFFFull; }
    bool reads_si = op <= 0xA7 || op == 0xAC || op == 0xAD, reads_di = op != 0xAC && op != 0xAD;
    out->addr = reads_si && (!reads_di || non_canonical(si)) ? si : di;  // of two, the one that faults
    out->base = out->addr;
    out->index = 0;
    return true;
  } else {
    modrm = has_modrm(op);
  }
  if (!modrm) return false;
  unsigned char m = *p++;
  unsigned mod = m >> 6, rm = m & 7;
  if (mod == 3) return false;             // a register operand
  if (rm == 5 && mod == 0) return false;  // RIP-relative: canonical, and needs the length
  int base = int(rm | (rex & 1) << 3), index = -1, scale = 1;
  if (rm == 4) {
    unsigned char sib = *p++;
    scale = 1 << (sib >> 6);
    index = int((sib >> 3 & 7) | (rex & 2) << 2);
    if (index == 4) index = -1;  // no index (rsp cannot be one; r12 can)
    base = (sib & 7) == 5 && mod == 0 ? -1 : int((sib & 7) | (rex & 1) << 3);
  }
  long long disp = base < 0 || mod == 2 ? read_at<int>(p) : mod == 1 ? (long long)(signed char)*p : 0;
  out->base = base < 0 ? 0 : (unsigned long long)r[kGreg[base]];
  out->index = index < 0 ? 0 : (unsigned long long)r[kGreg[index]];
  out->addr = out->base + out->index * (unsigned long long)scale + (unsigned long long)disp;
  if (addr32) out->addr &= 0xFFFFFFFFull;
  return true;
}
#endif

}  // namespace cupaged_sim
