// cupaged_sim_mma.h: the warp-wide PTX instructions mma.sync, ldmatrix and stmatrix on the sim.
//
// Each lane hands over its fragment registers exactly as the PTX ISA lays them out (groupID =
// laneid >> 2, threadID_in_group = laneid % 4); the last lane of the warp to arrive assembles the
// whole matrices, computes, and scatters every lane's results. All 32 lanes must execute the same
// statement (`.sync.aligned`); a partial warp is a SimSyncError.
//
// Rounding of mma: the products of f16/bf16/fp8 inputs are exact; d = c + a[.,0]b[0,.] + ... +
// a[.,K-1]b[K-1,.] is summed in float64 in that order and rounded once (to nearest even) to
// float32, or to f16 for the f16 accumulator. Tensor cores add with truncated alignment shifts, so a
// GPU can differ from the sim by a few ulp of the result; compare GPU and sim with tolerances.
#pragma once

namespace cupaged_sim {
namespace ptx {

enum ElemType { T_F16, T_BF16, T_E4M3, T_E5M2 };

inline double element(unsigned reg, int i, int type) {  // element i (lowest bits first) of a register
  switch (type) {
    case T_F16: return f16_value((unsigned short)(reg >> (16 * i)));
    case T_BF16: return bf16_value((unsigned short)(reg >> (16 * i)));
    default: return f16_value(fp8_to_f16_bits((unsigned char)(reg >> (8 * i)), type == T_E5M2));
  }
}

// m16n8kK, A row-major 16xK, B column-major Kx8, C/D 16x8. Operands of a lane, in order: A registers,
// B registers, C registers; D registers come out (4 f32, or 2 f16x2 when CF16).
template <int K, int TA, int TB, bool CF16>
CUPAGED_SIM_TRUSTED CUPAGED_SIM_PROF(__attribute__((no_sanitize_thread))) void mma_compute(int base) {
  CUPAGED_SIM_PROF(if (g_prof) g_prof->mma_flops += 2ull * 16 * 8 * K);
  constexpr bool kFp8 = TA >= T_E4M3;
  constexpr int kPer = kFp8 ? 4 : 2;             // elements per 32-bit register
  constexpr int kA = 16 * K / 32 / kPer, kB = 8 * K / 32 / kPer, kC = CF16 ? 2 : 4;
  double A[16][K], B[K][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const unsigned* r = g.threads[base + l].xin;
    int grp = l >> 2, tig = l & 3;
    for (int i = 0; i < kA * kPer; ++i) {
      int row = grp + 8 * ((i / kPer) & 1);
      int col = kFp8 ? tig * 4 + (i & 3) + 16 * (i >= 8) : tig * 2 + (i & 1) + 8 * (i >= 4);
      A[row][col] = element(r[i / kPer], i % kPer, TA);
    }
    for (int i = 0; i < kB * kPer; ++i) {
      int k = kFp8 ? tig * 4 + (i & 3) + 16 * (i >= 4) : tig * 2 + (i & 1) + 8 * (i >= 2);
      B[k][grp] = element(r[kA + i / kPer], i % kPer, TB);
    }
    for (int i = 0; i < 4; ++i) {
      unsigned c = r[kA + kB + (CF16 ? i / 2 : i)];
      C[grp + 8 * (i >= 2)][tig * 2 + (i & 1)] = CF16 ? f16_value((unsigned short)(c >> (16 * (i & 1)))) : f32(c);
    }
  }
  for (int l = 0; l < 32; ++l) {
    unsigned* d = g.threads[base + l].xout;
    int grp = l >> 2, tig = l & 3;
    for (int i = 0; i < kC; ++i) d[i] = 0;
    for (int i = 0; i < 4; ++i) {
      int row = grp + 8 * (i >= 2), col = tig * 2 + (i & 1);
      double acc = C[row][col];
      for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
      if (CF16) d[i / 2] |= unsigned(__half_as_ushort(__double2half(acc))) << (16 * (i & 1));
      else d[i] = unsigned(of(float(acc)));
    }
  }
}

template <int K, int TA, int TB, bool CF16>
inline void mma(const void* site, int line, const unsigned* in, unsigned* out) {
  g.cur->xin = in;
  g.cur->xout = out;
  warp_op("mma.sync", &mma_compute<K, TA, TB, CF16>, site, line);
}

// ldmatrix / stmatrix .m8n8.xNUM: lanes 8i..8i+7 give the shared addresses of the 8 rows (8 b16
// each, 16-byte aligned) of matrix i; register i of lane l holds row l/4, elements 2(l%4), 2(l%4)+1
// (with .trans: column l/4, rows 2(l%4), 2(l%4)+1), the lower-numbered element in the low half.
template <int NUM, bool TRANS, bool STORE>
CUPAGED_SIM_TRUSTED CUPAGED_SIM_PROF(__attribute__((no_sanitize_thread))) void matrix_compute(int base) {
  unsigned short M[NUM][8][8];
  char* row[NUM][8];
  for (int i = 0; i < NUM; ++i)
    for (int r = 0; r < 8; ++r) {
      SimThread* t = &g.threads[base + 8 * i + r];
      unsigned long long a = t->xaddr;
      if (a % 16 || a > g.smem_size || g.smem_size - a < 16) {
        g.cur = t;
        fail(E_MEMORY, t->line, "%s: lane %d gives row %d of matrix %d at shared address 0x%llx, which is %s",
             STORE ? "stmatrix" : "ldmatrix", t->lane, r, i, a,
             a % 16 ? "misaligned (rows need 16-byte alignment)" : "outside the block's shared memory");
      }
      row[i][r] = g.smem_base + a;
      if (!STORE) memcpy(M[i][r], row[i][r], 16);
    }
  for (int l = 0; l < 32; ++l) {
    unsigned* reg = STORE ? const_cast<unsigned*>(g.threads[base + l].xin) : g.threads[base + l].xout;
    for (int i = 0; i < NUM; ++i)
      for (int h = 0; h < 2; ++h) {
        int r = TRANS ? 2 * (l & 3) + h : l >> 2, c = TRANS ? l >> 2 : 2 * (l & 3) + h;
        if (STORE) M[i][r][c] = (unsigned short)(reg[i] >> (16 * h));
        else reg[i] = (h ? reg[i] : 0u) | unsigned(M[i][r][c]) << (16 * h);
      }
  }
  if (STORE)
    for (int i = 0; i < NUM; ++i)
      for (int r = 0; r < 8; ++r) memcpy(row[i][r], M[i][r], 16);
#if defined(CUPAGED_SIM_PROFILE)
  if (g_prof)  // one wavefront per matrix when its 8 rows fall in distinct groups of 4 banks
    for (int i = 0; i < NUM; ++i) {
      int groups[8] = {0}, worst = 0;
      for (int r = 0; r < 8; ++r) {
        bool repeat = false;
        for (int q = 0; q < r; ++q) repeat |= row[i][q] == row[i][r];
        if (repeat) continue;
        const int c = ++groups[(uintptr_t(row[i][r]) >> 4) & 7u];
        worst = c > worst ? c : worst;  // not std::max: an out-of-line call here would be instrumented
      }
      prof_wavefronts(prof_line_site(g.threads[base].line), unsigned(worst));  // the asm statement's line
    }
#endif
}

template <int NUM, bool TRANS>
inline void ldmatrix(const void* site, int line, unsigned long long addr, unsigned* out) {
  g.cur->xaddr = addr;
  g.cur->xout = out;
  warp_op("ldmatrix", &matrix_compute<NUM, TRANS, false>, site, line);
}

template <int NUM, bool TRANS>
inline void stmatrix(const void* site, int line, unsigned long long addr, const unsigned* in) {
  g.cur->xaddr = addr;
  g.cur->xin = in;
  warp_op("stmatrix", &matrix_compute<NUM, TRANS, true>, site, line);
}

}  // namespace ptx
}  // namespace cupaged_sim
