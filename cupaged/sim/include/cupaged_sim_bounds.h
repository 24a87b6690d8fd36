// cupaged_sim_bounds.h: the access checks of a sim module's instrumented builds.
//
// Every build but the profiler's is compiled with g++'s AddressSanitizer instrumentation in its
// out-of-line form (-fsanitize=address, asan-instrumentation-with-call-threshold=0, no stack or
// global redzones): every store -- and under CUPAGED_SIM_BOUNDS=1 every load too -- calls
// __asan_{store,load}N_noabort(address) first. No ASan runtime is linked: these entry points are
// the sim's.
//   * Stores, always: a kernel may write only the arrays it was given (pointer arguments and
//     pointers in by-value struct arguments: the launch's targets), shared memory, its own stack and
//     the module's own data. A store anywhere else -- past an array into another array, the Python
//     heap or a library -- is a SimMemoryError at the launch that made it, before it corrupts the
//     process; a store into an array's pad, slack or guard zone is one too.
//   * Loads, under CUPAGED_SIM_BOUNDS=1: an access that touches the pad, slack or guard zone of a
//     live guarded array (any byte outside the array's own bytes) is a SimMemoryError naming it, where
//     guard pages alone let reads of up to 15 bytes after an array's end (and into the pad before its
//     start) through, reading poison. Other addresses (shared memory, stacks, the sim's state) pass.
// Engine code that runs outside a CUDA thread (the scheduler, a signal handler) is not checked.
//
// On x86-64 the entry points are assembly: the common cases (an address in a target array, looked
// up in a table of 1 MiB granules; for a store, shared memory, the fiber stacks or the module's
// data; for a load, the gap between arrays the previous unguarded load fell in) cost a few
// instructions; otherwise they save the caller's registers (for attributing a wild access: the
// caller's base and index registers are still intact here) and call check_slow. Included by
// cupaged_sim_engine.h in namespace cupaged_sim.
#pragma once
#include <link.h>

struct Region {  // mirrored by numpy in cupaged/sim/_memory.py: one guarded array's mapping
  unsigned long long base, lo, hi, end;  // mapping [base, end), the array's own bytes [lo, hi)
  unsigned long long target;             // 1: the launch may write it (an argument's memory)
};

static const Region* g_regions;
static int g_nregions;
extern "C" {
// the gap between arrays the previous load outside every array fell in (an empty range when none;
// cut to 64 MiB around that access, so a wild address far away still takes the slow path), and the
// registers of the last slow check
__attribute__((visibility("hidden"))) unsigned long long cupaged_sim_gap_lo = 1, cupaged_sim_gap_hi = 0;
__attribute__((visibility("hidden"))) unsigned long long cupaged_sim_hook_regs[16];
// where a store may go besides the target arrays, as (first byte, size) pairs: the fiber stacks,
// shared memory, the module's writable segments (size 0: none)
__attribute__((visibility("hidden"))) unsigned long long cupaged_sim_store_ok[4][2];
}
static unsigned long long g_hook_addr;  // the address of the last access that matched no array

// A direct-mapped table of 1 MiB granules: the entry of granule a >> 20 holds the bytes [lo, hi) of
// the array whose own bytes meet it, and whether it is a target. Arrays' bytes are at least 2 MiB
// of guard zones apart, so a granule meets one at most; two granules of one slot mark it
// kSlotShared (the slow path decides).
static const unsigned long long kSlotEmpty = ~1ull, kSlotShared = ~0ull;
extern "C" {
__attribute__((visibility("hidden"))) unsigned long long cupaged_sim_granules[4096][4];
}

// The module's writable segments (.data, .bss: the engine's state and a kernel's static locals).
__attribute__((no_sanitize_address)) static int module_segment(dl_phdr_info* info, size_t, void* out) {
  const uintptr_t self = reinterpret_cast<uintptr_t>(&g);
  int found = 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_LOAD && self >= lo && self < lo + ph.p_memsz) found = 1;
  }
  if (!found) return 0;
  int k = 2;
  for (int i = 0; i < info->dlpi_phnum && k < 4; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_W)) continue;
    auto* ok = static_cast<unsigned long long(*)[2]>(out);
    ok[k][0] = info->dlpi_addr + ph.p_vaddr;
    ok[k++][1] = ph.p_memsz;
  }
  return 1;
}

static unsigned g_granules_used[4096];  // the entries the previous launch filled
static int g_ngranules_used = -1;         // -1: the table was never cleared

// The launch's tables: the granules of its regions, and where else a store may go.
__attribute__((no_sanitize_address)) static void build_tables(char* stacks, size_t stacks_size) {
  if (g_ngranules_used < 0)
    for (auto& e : cupaged_sim_granules) e[0] = kSlotEmpty;
  for (int i = 0; i < g_ngranules_used; ++i) cupaged_sim_granules[g_granules_used[i]][0] = kSlotEmpty;
  g_ngranules_used = 0;
  for (int i = 0; i < g_nregions; ++i) {
    const Region& r = g_regions[i];
    if (r.hi <= r.lo) continue;
    for (unsigned long long gr = r.lo >> 20; gr <= (r.hi - 1) >> 20; ++gr) {
      unsigned long long* e = cupaged_sim_granules[gr & 4095];
      if (e[0] == kSlotEmpty) {
        e[0] = gr; e[1] = r.lo; e[2] = r.hi; e[3] = r.target;
        g_granules_used[g_ngranules_used++] = unsigned(gr & 4095);
      } else if (e[0] != gr) {
        e[0] = kSlotShared;
      }
    }
  }
  auto& ok = cupaged_sim_store_ok;
  ok[0][0] = reinterpret_cast<uintptr_t>(stacks);
  ok[0][1] = stacks_size;
  ok[1][0] = reinterpret_cast<uintptr_t>(g.smem_base);
  ok[1][1] = g.smem_size;
  if (!ok[2][1]) dl_iterate_phdr(module_segment, ok);  // once per process: the module does not move
}

__attribute__((no_sanitize_address, noinline)) static void out_of_bounds(const Region* r, uintptr_t a, size_t n,
                                                                         bool write) {
  set_error(E_MEMORY, "out-of-bounds %s of %zu byte(s), %s an array", write ? "write" : "read", n,
            a < r->lo ? "before the start of" : "past the end of");
  instrumented_fault(a, write);
}

__attribute__((no_sanitize_address, noinline)) static void wild_store(uintptr_t a, size_t n, bool array) {
  for (int i = 0; i < 16; ++i) g.err.regs[i] = cupaged_sim_hook_regs[i];  // what the address came from
  set_error(E_MEMORY, "wild write of %zu byte(s) %s", n,
            array ? "into a guarded array that is not an argument of this launch"
                  : "outside every argument, shared memory and the thread's stack");
  instrumented_fault(a, true);
}

// Whether the current frame is a CUDA thread's (its fiber's stack), not the scheduler's or a signal
// handler's: only code running for a CUDA thread is checked.
__attribute__((no_sanitize_address, always_inline)) static inline bool in_cuda_thread() {
  uintptr_t sp = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  uintptr_t lo = reinterpret_cast<uintptr_t>(g.cur->fiber.stack);
  return sp - lo < kStackSize;
}

extern "C" __attribute__((visibility("hidden"), no_sanitize_address)) void cupaged_sim_check_slow(uintptr_t a, size_t n,
                                                                                               int write) {
  if (!g.cur || !in_cuda_thread()) return;  // outside a launch (module constructors), or the engine's own code
  int lo = 0, hi = g_nregions;
  while (lo < hi) {  // the last region whose mapping starts at or below a
    int m = (lo + hi) >> 1;
    if (g_regions[m].base <= a) lo = m + 1;
    else hi = m;
  }
  const Region* r = lo ? &g_regions[lo - 1] : nullptr;
  if (r && a < r->end) {
    if (a < r->lo || a + n > r->hi) out_of_bounds(r, a, n, write != 0);
    if (write && !r->target) wild_store(a, n, true);
    return;
  }
  if (write) {
    for (auto& ok : cupaged_sim_store_ok)
      if (a >= ok[0] && a - ok[0] + n <= ok[1]) return;
    wild_store(a, n, false);
  }
  // a load in no guarded array (shared memory, a stack, the sim's state), or wild
  const unsigned long long window = 64ull << 20;
  unsigned long long gap_lo = r ? r->end : 0, gap_hi = lo < g_nregions ? g_regions[lo].base : ~0ull;
  cupaged_sim_gap_lo = a - gap_lo > window ? a - window : gap_lo;
  cupaged_sim_gap_hi = gap_hi - a > window ? a + window : gap_hi;
  g_hook_addr = a;  // a fault may follow
}

#if defined(__x86_64__)
// rdi = address. The granule's entry: rax; the array holds [a, a + n): label 1 (return). They
// clobber only rax and the flags (rcx, rdx are restored); label 2 goes to the slow path.
#define CUPAGED_SIM_GRANULE(n)                                                                      \
  "  pushq %rcx\n  pushq %rdx\n  movq %rdi, %rcx\n  shrq $20, %rcx\n  movl %ecx, %edx\n"            \
  "  andl $4095, %edx\n  shlq $5, %rdx\n  leaq cupaged_sim_granules(%rip), %rax\n"                  \
  "  addq %rdx, %rax\n  cmpq (%rax), %rcx\n  jne 3f\n"                                              \
  "  cmpq 8(%rax), %rdi\n  jb 2f\n  leaq " #n "(%rdi), %rdx\n  cmpq 16(%rax), %rdx\n  ja 2f\n"
#define CUPAGED_SIM_SLOW(n, write)                                                                  \
  "2:\n  popq %rdx\n  popq %rcx\n  call cupaged_sim_save_regs\n  movl $" #n ", %esi\n"               \
  "  movl $" #write ", %edx\n  jmp cupaged_sim_check_slow\n"
#define CUPAGED_SIM_HEAD(name) ".globl " #name "\n.hidden " #name "\n.type " #name ", @function\n" #name ":\n"
// A load: in any array's bytes, or in the gap the previous unguarded load fell in.
#define CUPAGED_SIM_LOAD(n)                                                                         \
  CUPAGED_SIM_HEAD(__asan_load##n##_noabort) CUPAGED_SIM_GRANULE(n)                                 \
  "1:\n  popq %rdx\n  popq %rcx\n  ret\n"                                                             \
  "3:\n  movq cupaged_sim_gap_lo(%rip), %rax\n  cmpq %rax, %rdi\n  jb 2f\n"                          \
  "  leaq " #n "(%rdi), %rax\n  cmpq cupaged_sim_gap_hi(%rip), %rax\n  jbe 1b\n" CUPAGED_SIM_SLOW(n, 0)
// A store: in one of the cupaged_sim_store_ok ranges (the fiber stacks and shared memory first: a
// kernel's most frequent targets, tested with rax alone: a - lo + n <= size, no carry), or in a target
// array's bytes.
#define CUPAGED_SIM_STORE_OK(k, n, next, done)                                                       \
  "  movq %rdi, %rax\n  subq cupaged_sim_store_ok+" #k "*16(%rip), %rax\n  addq $" #n ", %rax\n"     \
  "  jc " #next "\n  cmpq cupaged_sim_store_ok+" #k "*16+8(%rip), %rax\n  jbe " #done "\n"
#define CUPAGED_SIM_STORE(n)                                                                        \
  CUPAGED_SIM_HEAD(__asan_store##n##_noabort)                                                        \
  CUPAGED_SIM_STORE_OK(0, n, 6f, 5f) "6:\n" CUPAGED_SIM_STORE_OK(1, n, 7f, 5f) "7:\n"               \
  CUPAGED_SIM_GRANULE(n)                                                                            \
  "  cmpq $0, 24(%rax)\n  je 2f\n"                                                                   \
  "1:\n  popq %rdx\n  popq %rcx\n5:\n  ret\n"                                                       \
  "3:\n  popq %rdx\n  popq %rcx\n"                                                                  \
  CUPAGED_SIM_STORE_OK(2, n, 8f, 5b) "8:\n" CUPAGED_SIM_STORE_OK(3, n, 9f, 5b) "9:\n"              \
  "  pushq %rcx\n  pushq %rdx\n" CUPAGED_SIM_SLOW(n, 1)
#define CUPAGED_SIM_FIXED(n) asm(".text\n" CUPAGED_SIM_LOAD(n) CUPAGED_SIM_STORE(n))
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
#undef CUPAGED_SIM_STORE
#undef CUPAGED_SIM_STORE_OK
#undef CUPAGED_SIM_LOAD
#undef CUPAGED_SIM_HEAD
#undef CUPAGED_SIM_SLOW
#undef CUPAGED_SIM_GRANULE
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
