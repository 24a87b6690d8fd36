// cupaged_sim_bounds.h: byte-exact bounds of every memory access of a sim module (CUPAGED_SIM_BOUNDS=1).
//
// In that mode modules are compiled with g++'s AddressSanitizer instrumentation in its out-of-line form
// (-fsanitize=address, asan-instrumentation-with-call-threshold=0, no stack or global redzones):
// every load and store calls __asan_{load,store}N_noabort(address) first. No ASan runtime is linked:
// these entry points are the sim's. They look the address up in the launch's table of guarded
// arrays (every live one, sorted by mapping base): an access that touches the pad, slack or guard
// zone of an array -- any byte outside the array's own bytes -- is a SimMemoryError naming it,
// where guard pages alone let reads of up to 15 bytes after an array's end and 4 KiB before its
// start through (reading poison). Addresses outside every guarded mapping (shared memory, the
// fiber's stack, the sim's own state) pass.
//
// On x86-64 the entry points are assembly: the common cases (an address in an array, looked up in
// a table of 1 MiB granules, or in the gap between arrays the previous unguarded access fell in)
// cost a few instructions; otherwise they save the caller's registers (for attributing a wild
// access that faults right after: the caller's base and index registers are still intact here,
// not at the fault) and call check_slow. Included by cupaged_sim_engine.h in namespace cupaged_sim.
#pragma once

struct Region {  // mirrored by numpy in cupaged/sim/_memory.py: one guarded array's mapping
  unsigned long long base, lo, hi, end;  // mapping [base, end), the array's own bytes [lo, hi)
};

static const Region* g_regions;
static int g_nregions;
extern "C" {
// the gap between arrays the previous access outside every array fell in (an empty range when none;
// cut to 64 MiB around that access, so a wild address far away still takes the slow path), and the
// registers of the last slow check
__attribute__((visibility("hidden"))) unsigned long long cupaged_sim_gap_lo = 1, cupaged_sim_gap_hi = 0;
__attribute__((visibility("hidden"))) unsigned long long cupaged_sim_hook_regs[16];
}
static unsigned long long g_hook_addr;  // the address of the last access that matched no array

// A direct-mapped table of 1 MiB granules: the entry of granule a >> 20 holds the bytes [lo, hi) of
// the array whose mapping covers it. Mappings are at least 2 MiB of guard zones apart, so a
// granule meets one at most; two granules of one slot mark it kSlotShared (the slow path decides).
static const unsigned long long kSlotEmpty = ~1ull, kSlotShared = ~0ull;
extern "C" {
__attribute__((visibility("hidden"))) unsigned long long cupaged_sim_granules[4096][3];
}

__attribute__((no_sanitize_address)) static void build_granules() {
  if (!g_nregions) return;  // a build without the bounds instrumentation: nothing calls the hooks
  for (auto& e : cupaged_sim_granules) e[0] = kSlotEmpty;
  for (int i = 0; i < g_nregions; ++i) {
    const Region& r = g_regions[i];
    for (unsigned long long gr = r.base >> 20; gr <= (r.end - 1) >> 20; ++gr) {
      unsigned long long* e = cupaged_sim_granules[gr & 4095];
      if (e[0] == kSlotEmpty) { e[0] = gr; e[1] = r.lo; e[2] = r.hi; }
      else if (e[0] != gr) e[0] = kSlotShared;
    }
  }
}

__attribute__((no_sanitize_address, noinline)) static void out_of_bounds(const Region* r, uintptr_t a, size_t n,
                                                                         bool write) {
  set_error(E_MEMORY, "out-of-bounds %s of %zu byte(s), %s an array", write ? "write" : "read", n,
            a < r->lo ? "before the start of" : "past the end of");
  instrumented_fault(a, write);
}

extern "C" __attribute__((visibility("hidden"), no_sanitize_address)) void cupaged_sim_check_slow(uintptr_t a, size_t n,
                                                                                               int write) {
  if (!g.cur || !g_nregions) return;  // outside a launch (module constructors) or no arrays
  int lo = 0, hi = g_nregions;
  while (lo < hi) {  // the last region whose mapping starts at or below a
    int m = (lo + hi) >> 1;
    if (g_regions[m].base <= a) lo = m + 1;
    else hi = m;
  }
  const Region* r = lo ? &g_regions[lo - 1] : nullptr;
  if (!r || a >= r->end) {  // in no guarded array (shared memory, a stack, the sim's state), or wild
    const unsigned long long window = 64ull << 20;
    unsigned long long gap_lo = r ? r->end : 0, gap_hi = lo < g_nregions ? g_regions[lo].base : ~0ull;
    cupaged_sim_gap_lo = a - gap_lo > window ? a - window : gap_lo;
    cupaged_sim_gap_hi = gap_hi - a > window ? a + window : gap_hi;
    g_hook_addr = a;  // a fault may follow
    return;
  }
  if (a >= r->lo && a + n <= r->hi) return;
  out_of_bounds(r, a, n, write != 0);
}

#if defined(__x86_64__)
// rdi = address; the fast path clobbers only rax and the flags (rsi is the size in the N forms).
// rdi = address. Fast paths: the granule's array holds [a, a + n), or a lies in the gap the previous
// unguarded access fell in. They clobber only rax and the flags (rcx, rdx are restored).
#define CUPAGED_SIM_FIXED_ONE(name, n, write)                                                       \
  ".globl " #name "\n.hidden " #name "\n.type " #name ", @function\n" #name ":\n"                   \
  "  pushq %rcx\n  pushq %rdx\n  movq %rdi, %rcx\n  shrq $20, %rcx\n  movl %ecx, %edx\n"            \
  "  andl $4095, %edx\n  leaq (%rdx,%rdx,2), %rdx\n  leaq cupaged_sim_granules(%rip), %rax\n"       \
  "  leaq (%rax,%rdx,8), %rax\n  cmpq (%rax), %rcx\n  jne 3f\n"                                     \
  "  cmpq 8(%rax), %rdi\n  jb 2f\n  leaq " #n "(%rdi), %rdx\n  cmpq 16(%rax), %rdx\n  ja 2f\n"       \
  "1:\n  popq %rdx\n  popq %rcx\n  ret\n"                                                             \
  "3:\n  movq cupaged_sim_gap_lo(%rip), %rax\n  cmpq %rax, %rdi\n  jb 2f\n"                          \
  "  leaq " #n "(%rdi), %rax\n  cmpq cupaged_sim_gap_hi(%rip), %rax\n  jbe 1b\n"                     \
  "2:\n  popq %rdx\n  popq %rcx\n  call cupaged_sim_save_regs\n  movl $" #n ", %esi\n"               \
  "  movl $" #write ", %edx\n  jmp cupaged_sim_check_slow\n"
#define CUPAGED_SIM_FIXED(n)                                                                        \
  asm(".text\n" CUPAGED_SIM_FIXED_ONE(__asan_load##n##_noabort, n, 0)                               \
      CUPAGED_SIM_FIXED_ONE(__asan_store##n##_noabort, n, 1))
// Saves the caller's general registers (as they were at the hook's entry: the call pushed only
// the return address, so rsp is the hook's rsp - 8) into cupaged_sim_hook_regs, in ucontext order
// (r8..r15, rdi, rsi, rbp, rbx, rdx, rax, rcx, rsp). Clobbers rax.
asm(".text\n.globl cupaged_sim_save_regs\n.hidden cupaged_sim_save_regs\n.type cupaged_sim_save_regs, @function\n"
    "cupaged_sim_save_regs:\n  leaq cupaged_sim_hook_regs(%rip), %rax\n"
    "  movq %r8, 0(%rax)\n  movq %r9, 8(%rax)\n  movq %r10, 16(%rax)\n  movq %r11, 24(%rax)\n"
    "  movq %r12, 32(%rax)\n  movq %r13, 40(%rax)\n  movq %r14, 48(%rax)\n  movq %r15, 56(%rax)\n"
    "  movq %rdi, 64(%rax)\n  movq %rsi, 72(%rax)\n  movq %rbp, 80(%rax)\n  movq %rbx, 88(%rax)\n"
    "  movq %rdx, 96(%rax)\n  movq $0, 104(%rax)\n  movq %rcx, 112(%rax)\n  movq %rsp, 120(%rax)\n  ret\n"
    ".size cupaged_sim_save_regs, .-cupaged_sim_save_regs\n");
CUPAGED_SIM_FIXED(1);
CUPAGED_SIM_FIXED(2);
CUPAGED_SIM_FIXED(4);
CUPAGED_SIM_FIXED(8);
CUPAGED_SIM_FIXED(16);
#undef CUPAGED_SIM_FIXED
#undef CUPAGED_SIM_FIXED_ONE
// the N forms: rsi holds the size already
asm(".text\n.globl __asan_loadN_noabort\n.hidden __asan_loadN_noabort\n.type __asan_loadN_noabort, @function\n"
    "__asan_loadN_noabort:\n  call cupaged_sim_save_regs\n  xorl %edx, %edx\n  jmp cupaged_sim_check_slow\n"
    ".globl __asan_storeN_noabort\n.hidden __asan_storeN_noabort\n.type __asan_storeN_noabort, @function\n"
    "__asan_storeN_noabort:\n  call cupaged_sim_save_regs\n  movl $1, %edx\n  jmp cupaged_sim_check_slow\n");
#else
#define CUPAGED_SIM_ASAN(n)                                                                                 \
  extern "C" __attribute__((visibility("hidden"), no_sanitize_address)) void __asan_load##n##_noabort(uintptr_t a) { \
    cupaged_sim_check_slow(a, n, 0);                                                                        \
  }                                                                                                         \
  extern "C" __attribute__((visibility("hidden"), no_sanitize_address)) void __asan_store##n##_noabort(uintptr_t a) { \
    cupaged_sim_check_slow(a, n, 1);                                                                        \
  }
CUPAGED_SIM_ASAN(1)
CUPAGED_SIM_ASAN(2)
CUPAGED_SIM_ASAN(4)
CUPAGED_SIM_ASAN(8)
CUPAGED_SIM_ASAN(16)
#undef CUPAGED_SIM_ASAN
extern "C" __attribute__((visibility("hidden"), no_sanitize_address)) void __asan_loadN_noabort(uintptr_t a, size_t n) {
  cupaged_sim_check_slow(a, n, 0);
}
extern "C" __attribute__((visibility("hidden"), no_sanitize_address)) void __asan_storeN_noabort(uintptr_t a, size_t n) {
  cupaged_sim_check_slow(a, n, 1);
}
#endif
extern "C" __attribute__((visibility("hidden"))) void __asan_init() {}
extern "C" __attribute__((visibility("hidden"))) void __asan_version_mismatch_check_v8() {}
extern "C" __attribute__((visibility("hidden"))) void __asan_handle_no_return() {}
extern "C" __attribute__((visibility("hidden"))) void __asan_before_dynamic_init(const char*) {}
extern "C" __attribute__((visibility("hidden"))) void __asan_after_dynamic_init() {}
