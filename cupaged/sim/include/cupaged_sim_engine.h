// cupaged sim engine: runs one CUDA kernel launch on the CPU.
//
// One OS thread runs the blocks of a launch one after another (natural, reverse or seeded-random
// order). Inside a block every CUDA thread is a fiber with its own mmap'd stack (guard page below).
// Fibers switch cooperatively only at barriers, warp collectives and exit, so everything between
// two of those points is atomic, as plain atomics need. `__shared__` is `thread_local`: the whole
// TLS segment of the module is the block's shared memory (refilled with poison before each block),
// so the engine itself keeps no TLS. Dynamic shared memory is one page-aligned TLS buffer that
// every `extern __shared__` symbol aliases (generated assembly); pages past the launch's size are
// PROT_NONE during the launch.
//
// Errors never hang and never kill the process: a fiber that hits one records it and switches
// back to the scheduler; a signal (SIGSEGV/SIGBUS/SIGFPE/SIGILL/timer) is taken on an alternate
// stack and leaves through siglongjmp. Python reads the error record and raises.
#pragma once
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdlib>
#include <sys/mman.h>
#include <sys/time.h>
#include <unistd.h>
#include <algorithm>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#include "cupaged_sim_fault.h"

extern thread_local char __cupaged_dyn_smem[];  // defined by the generated assembly

namespace cupaged_sim {

// The engine's own code is trusted and not instrumented: its stores (the scheduler's state: most of
// the store checks a launch made before) are not a kernel's. The checks are for the kernel's code.
#define CUPAGED_SIM_TRUSTED __attribute__((no_sanitize_address, no_sanitize_coverage))

enum ErrorCode { OK = 0, E_MEMORY = 1, E_SYNC = 2, E_TRAP = 3, E_TIMEOUT = 4, E_CONFIG = 5, E_OTHER = 6 };

struct LaunchConfig {  // mirrored by ctypes in cupaged/sim/_module.py
  unsigned grid[3];
  unsigned block[3];
  unsigned long long shared_mem;
  int order;  // 0 natural, 1 reverse, 2 random
  unsigned long long seed;
  double timeout_s;
  unsigned long long tls_dyn_offset;  // offset of the dynamic buffer in the module's TLS segment
  int poison;  // the byte unwritten shared memory and pending cp.async destinations hold
  const void* regions;  // the guarded arrays (cupaged_sim_bounds.h), sorted by mapping base
  int nregions;
  void* profile;  // a ProfLaunch (cupaged_sim_profile.h) when profiled, else null
};

struct ErrorInfo {  // mirrored by ctypes in cupaged/sim/_module.py
  int code;
  int has_thread;
  unsigned thread[3];
  unsigned block[3];
  unsigned long long fault_addr;
  int fault_write;
  int signo;
  unsigned long long dyn_smem;
  unsigned long long fault_base;   // base and index register of the faulting memory operand (0: none
  unsigned long long fault_index;  // or not decoded): the argument a wild access started from
  int fault_decoded;  // 0: fault_addr is si_addr; 1: decoded (a general-protection fault); 2: GP, unknown;
                      // 3: found by instrumentation (msg says what; fault_addr is the access's address)
  unsigned long long regs[16];  // general registers at a fault: to rebuild base + scale * index when
                                // instrumentation left only the computed address in the operand
  char msg[8192];
};

static const unsigned long long kDynSmemCapacity = CUPAGED_SIM_DYN_SMEM;
static const size_t kStackSize = 128 * 1024;
static const int kMaxThreads = 1024;

enum State { RUNNABLE, WAIT_BAR, WAIT_WARP, DONE, WAIT_ACTIVE, WAIT_NAMED, WAIT_MBAR, WAIT_WG };
enum Coll {
  SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, VOTE_ALL, VOTE_ANY, BALLOT, SYNCWARP, MATCH_ANY, MATCH_ALL,
  RED_ADD, RED_MIN, RED_MAX, RED_UMIN, RED_UMAX, RED_AND, RED_OR, RED_XOR, WARP_OP
};
static const char* const kCollName[] = {
  "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync", "__all_sync",
  "__any_sync", "__ballot_sync", "__syncwarp", "__match_any_sync", "__match_all_sync",
  "__reduce_add_sync", "__reduce_min_sync", "__reduce_max_sync", "__reduce_min_sync",
  "__reduce_max_sync", "__reduce_and_sync", "__reduce_or_sync", "__reduce_xor_sync", "a warp-wide instruction"};
static const char* const kBarName[] = {"__syncthreads", "__syncthreads_count", "__syncthreads_and",
                                       "__syncthreads_or"};

struct Fiber {
#if defined(__x86_64__)
  void* sp;
#else
  ucontext_t uc;
#endif
  char* stack;  // base of the mapping; the lowest page is the guard
};

struct SimThread {
  uint3 tid;
  int linear, warp, lane;
  int state;
  // barrier
  const void* bar_site;  // identifies the source call site (see CUPAGED_SIM_SITE)
  int bar_line, bar_kind, bar_pred, bar_result;
  // warp collective
  int group, line;
  unsigned long long value, result;
  int arg, width, out_pred;
  // warp-wide instruction (mma, ldmatrix): this lane's operands, read and written by the last lane
  const unsigned* xin;
  unsigned* xout;
  unsigned long long xaddr;
  const void* xop;  // a warpgroup-wide instruction's operands (cupaged_sim_async.h)
  // a wait at a named barrier or an mbarrier (cupaged_sim_async.h): which, and for what phase
  int wait_id, wait_kind;
  unsigned long long wait_value;
  // __activemask(): its call site and result
  const void* am_site;
  unsigned am_result;
  Fiber fiber;
};

struct Group {
  bool active;
  int kind, width, line;
  unsigned mask, arrived;
  const char* name;
  const void* site;        // WARP_OP: the instruction (each inline-PTX statement has its own)
  void (*compute)(int base);  // WARP_OP: computes every lane's results from every lane's operands
};

// A cp.async copy in flight: the source was read at issue (bounds-checked then); the bytes land in
// shared memory when a wait covers its commit group (until then the destination holds poison).
struct AsyncCopy {
  char* dst;
  int size;
  unsigned group;
  unsigned char data[16];
};

struct Warp {
  unsigned live;  // lanes that exist and have not exited
  int am_waiting;  // lanes waiting in __activemask()
  Group groups[32];
};

struct Engine {
  dim3 grid, block;
  uint3 block_idx;
  int nthreads, nwarps, order, exited, poison;
  bool depth_first;  // random order: warps run ahead alone in this barrier interval
  unsigned long long rng;
  SimThread* cur;
  SimThread threads[kMaxThreads];
  Warp warps[kMaxThreads / 32];
  int queue[kMaxThreads * 2], qhead, qtail;  // ring of runnable thread ids
  int bar_arrived;
  Fiber sched;
  void (*thunk)(void*);
  void* thunk_ctx;
  bool failed;
  sigjmp_buf jmp;
  char* altstack;
  char* smem_base;                // shared-state address 0: the start of the module's TLS block
  unsigned long long smem_size;   // static + the launch's dynamic shared memory, in bytes
  ErrorInfo err;
};

// A thread's cp.async copies in flight, oldest first, in the C library's heap: outside what a kernel
// may write, so push is trusted code (clear writes only the engine's state).
struct AsyncQueue {
  AsyncCopy* data = nullptr;
  size_t head = 0, size = 0, cap = 0;
  __attribute__((no_sanitize_address, noinline)) void push(const AsyncCopy& c) {
    if (size == cap && head) {  // the copies a wait has landed leave room at the front
      memmove(data, data + head, (size - head) * sizeof(AsyncCopy));
      size -= head;
      head = 0;
    }
    if (size == cap) {
      cap = cap ? 2 * cap : 64;
      data = static_cast<AsyncCopy*>(realloc(data, cap * sizeof(AsyncCopy)));
    }
    data[size++] = c;
  }
  void clear() { head = size = 0; }
};

static Engine g;
// Every CUDA thread's fiber stack, kStackSize each, in one mapping: one range for the bounds checks.
static char* g_stack_area;
static bool g_stack_guarded[kMaxThreads];  // its lowest page is PROT_NONE (set on first use)
static AsyncQueue g_async[kMaxThreads];
static unsigned g_async_committed[kMaxThreads];  // commit groups closed so far

#include "cupaged_sim_profile.h"

// ---------------------------------------------------------------- errors
CUPAGED_SIM_TRUSTED static void set_error(int code, const char* fmt, ...) {
  if (g.err.code != OK) return;
  g.err.code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g.err.msg, sizeof g.err.msg, fmt, ap);
  va_end(ap);
  if (g.cur) {
    g.err.has_thread = 1;
    g.err.thread[0] = g.cur->tid.x; g.err.thread[1] = g.cur->tid.y; g.err.thread[2] = g.cur->tid.z;
  }
  g.err.block[0] = g.block_idx.x; g.err.block[1] = g.block_idx.y; g.err.block[2] = g.block_idx.z;
}

CUPAGED_SIM_TRUSTED static void append_error(const char* fmt, ...) {
  size_t n = strlen(g.err.msg);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g.err.msg + n, sizeof g.err.msg - n, fmt, ap);
  va_end(ap);
}

// ---------------------------------------------------------------- fibers
#if defined(__x86_64__)
extern "C" void cupaged_sim_switch(void** save_sp, void* new_sp);
asm(R"(
  .text
  .globl cupaged_sim_switch
  .hidden cupaged_sim_switch
  .type cupaged_sim_switch, @function
cupaged_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cupaged_sim_switch, .-cupaged_sim_switch
)");
CUPAGED_SIM_TRUSTED static void switch_to(Fiber* from, Fiber* to) { cupaged_sim_switch(&from->sp, to->sp); }
#else
CUPAGED_SIM_TRUSTED static void switch_to(Fiber* from, Fiber* to) { swapcontext(&from->uc, &to->uc); }
#endif

static void thread_exit();

[[noreturn]] CUPAGED_SIM_TRUSTED static void fiber_main() {
  g.thunk(g.thunk_ctx);
  thread_exit();
  switch_to(&g.cur->fiber, &g.sched);
  __builtin_unreachable();
}

CUPAGED_SIM_TRUSTED static bool map_stacks() {
  if (!g_stack_area) {
    void* p = mmap(nullptr, kStackSize * kMaxThreads, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (p == MAP_FAILED) return false;
    g_stack_area = static_cast<char*>(p);
  }
  return true;
}

CUPAGED_SIM_TRUSTED static bool init_fiber(SimThread* t) {
  char* stack = g_stack_area + kStackSize * size_t(t->linear);
  if (!g_stack_guarded[t->linear]) {
    if (mprotect(stack, 4096, PROT_NONE) != 0) return false;
    g_stack_guarded[t->linear] = true;
  }
  t->fiber.stack = stack;
#if defined(__x86_64__)
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + kStackSize) & ~uintptr_t(15);
  auto* slot = reinterpret_cast<unsigned long long*>(top - 16);  // return address slot
  slot[0] = reinterpret_cast<unsigned long long>(&fiber_main);
  for (int i = 1; i <= 6; ++i) slot[-i] = 0;                  // rbp rbx r12 r13 r14 r15
  unsigned int csr[2];
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
  memcpy(&slot[-7], csr, 8);
  t->fiber.sp = &slot[-7];
#else
  getcontext(&t->fiber.uc);
  t->fiber.uc.uc_stack.ss_sp = stack + 4096;
  t->fiber.uc.uc_stack.ss_size = kStackSize - 4096;
  t->fiber.uc.uc_link = nullptr;
  makecontext(&t->fiber.uc, reinterpret_cast<void (*)()>(&fiber_main), 0);
#endif
  return true;
}

// Leave the current fiber for good after an error; the scheduler sees g.failed.
[[noreturn]] CUPAGED_SIM_TRUSTED static void abort_fiber() {
  g.failed = true;
  switch_to(&g.cur->fiber, &g.sched);
  __builtin_unreachable();
}

CUPAGED_SIM_TRUSTED static void make_runnable(SimThread* t) {
  t->state = RUNNABLE;
  g.queue[g.qtail] = t->linear;
  g.qtail = (g.qtail + 1) % (kMaxThreads * 2);
}

CUPAGED_SIM_TRUSTED static void block_wait() { switch_to(&g.cur->fiber, &g.sched); if (g.failed) abort_fiber(); }

CUPAGED_SIM_TRUSTED static unsigned long long next_random() {  // splitmix64
  unsigned long long z = (g.rng += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Release a set of waiting threads in the launch's order. Natural order: warps advance in lockstep
// from one warp collective to the next (released lanes go to the back of the queue). Reverse: the
// threads of a block are started in reverse, and lanes released by a warp collective go to the
// front, so each warp runs ahead alone until the next block barrier (depth first). Random: at each
// block barrier one of the two at random, with the warps (depth first) or all threads (lockstep)
// shuffled. A barrier missing between warps shows as a result that depends on the order.
CUPAGED_SIM_TRUSTED static void release(int* ids, int n, bool warp = false) {
  if (g.order == 2 && !warp) {
    g.depth_first = next_random() & 1;
    if (g.depth_first && n == g.nthreads) {  // whole warps in a random order, lanes shuffled inside each
      int order[kMaxThreads / 32], k = 0;
      for (int w = 0; w < g.nwarps; ++w) order[w] = w;
      for (int i = g.nwarps - 1; i > 0; --i) { int j = int(next_random() % (i + 1)); int t = order[i]; order[i] = order[j]; order[j] = t; }
      for (int w = 0; w < g.nwarps; ++w) {
        int lo = order[w] * 32, hi = lo + 32 < g.nthreads ? lo + 32 : g.nthreads, first = k;
        for (int i = lo; i < hi; ++i) ids[k++] = i;
        for (int i = k - 1; i > first; --i) { int j = first + int(next_random() % (i - first + 1)); int t = ids[i]; ids[i] = ids[j]; ids[j] = t; }
      }
    } else {
      for (int i = n - 1; i > 0; --i) { int j = int(next_random() % (i + 1)); int t = ids[i]; ids[i] = ids[j]; ids[j] = t; }
    }
  } else if (g.order == 1) {
    for (int i = 0, j = n - 1; i < j; ++i, --j) { int t = ids[i]; ids[i] = ids[j]; ids[j] = t; }
  } else if (g.order == 2) {
    for (int i = n - 1; i > 0; --i) { int j = int(next_random() % (i + 1)); int t = ids[i]; ids[i] = ids[j]; ids[j] = t; }
  }
  if (warp && (g.order == 1 || (g.order == 2 && g.depth_first))) {
    for (int i = n - 1; i >= 0; --i) {  // to the front, ids[0] first
      g.threads[ids[i]].state = RUNNABLE;
      g.qhead = (g.qhead + kMaxThreads * 2 - 1) % (kMaxThreads * 2);
      g.queue[g.qhead] = ids[i];
    }
    return;
  }
  for (int i = 0; i < n; ++i) make_runnable(&g.threads[ids[i]]);
}

static void settle_activemask(Warp* w);

// Lanes of a warp (bit l of mask: thread base + l) done waiting at a warp collective: the current
// thread goes on running, the others are queued.
CUPAGED_SIM_TRUSTED static void release_lanes(int base, unsigned mask) {
  int ids[32], n = 0;
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    if (&g.threads[base + l] != g.cur) ids[n++] = base + l;
    else g.threads[base + l].state = RUNNABLE;
  }
  release(ids, n, true);
}

// ---------------------------------------------------------------- barriers
CUPAGED_SIM_TRUSTED static void release_barrier() {
  SimThread* first = nullptr;
  int count = 0, ids[kMaxThreads], n = 0;
  for (int i = 0; i < g.nthreads; ++i) {
    SimThread* t = &g.threads[i];
    if (t->state != WAIT_BAR) continue;
    if (!first) first = t;
    if (t->bar_site != first->bar_site || t->bar_kind != first->bar_kind) {
      g.cur = t;
      set_error(E_SYNC, "divergent __syncthreads: thread (%u,%u,%u) waits at %s (line %d), thread (%u,%u,%u) at %s (line %d)",
                first->tid.x, first->tid.y, first->tid.z, kBarName[first->bar_kind], first->bar_line,
                t->tid.x, t->tid.y, t->tid.z, kBarName[t->bar_kind], t->bar_line);
      abort_fiber();
    }
    count += t->bar_pred != 0;
    ids[n++] = i;
  }
  int result = first->bar_kind == 1 ? count : first->bar_kind == 2 ? count == n : count > 0;
  for (int i = 0; i < n; ++i) g.threads[ids[i]].bar_result = result;
  g.bar_arrived = 0;
  release(ids, n);
}

CUPAGED_SIM_TRUSTED __attribute__((noinline)) static int barrier(int kind, int pred, int line, const void* site) {
  SimThread* t = g.cur;
  if (g.exited) {
    set_error(E_SYNC, "%s (line %d) reached after %d thread(s) of the block exited: every thread of the block must reach it",
              kBarName[kind], line, g.exited);
    abort_fiber();
  }
  t->bar_site = site;
  t->bar_line = line; t->bar_kind = kind; t->bar_pred = pred;
  t->state = WAIT_BAR;
  CUPAGED_SIM_PROF(prof_sched_point(t));
  if (++g.bar_arrived == g.nthreads) release_barrier();
  else settle_activemask(&g.warps[t->warp]);
  block_wait();
  return t->bar_result;
}

// ---------------------------------------------------------------- __activemask
// The lanes of a warp that reach the same __activemask() call site before their next scheduling
// point: a lane that calls it waits until every other lane of its warp has reached some
// scheduling point (a barrier, a collective, exit, or an __activemask), then learns which lanes
// wait at its call site. Lanes that took another branch are not in the mask, as on the GPU.
CUPAGED_SIM_TRUSTED static void settle_activemask(Warp* w) {
  if (!w->am_waiting) return;
  int base = int(w - g.warps) * 32;
  unsigned waiting = 0;
  for (int l = 0; l < 32 && base + l < g.nthreads; ++l) {
    int st = g.threads[base + l].state;
    if (st == RUNNABLE) return;  // a lane that may still arrive
    if (st == WAIT_ACTIVE) waiting |= 1u << l;
  }
  while (waiting) {
    const void* site = g.threads[base + __builtin_ctz(waiting)].am_site;
    unsigned mask = 0;
    for (int l = 0; l < 32; ++l)
      if ((waiting >> l & 1u) && g.threads[base + l].am_site == site) mask |= 1u << l;
    for (int l = 0; l < 32; ++l)
      if (mask >> l & 1u) g.threads[base + l].am_result = mask;
    w->am_waiting -= __builtin_popcount(mask);
    waiting &= ~mask;
    release_lanes(base, mask);
  }
}

CUPAGED_SIM_TRUSTED __attribute__((noinline)) static unsigned activemask(const void* site, int line) {
  SimThread* t = g.cur;
  Warp* w = &g.warps[t->warp];
  t->am_site = site;
  t->line = line;
  t->state = WAIT_ACTIVE;
  CUPAGED_SIM_PROF(prof_sched_point(t));
  ++w->am_waiting;
  settle_activemask(w);
  if (t->state == WAIT_ACTIVE) block_wait();
  return t->am_result;
}

// ---------------------------------------------------------------- warp collectives
CUPAGED_SIM_TRUSTED static unsigned long long lane_value(Warp* w, Group* gr, int from_lane, int lane, int src) {
  SimThread* me = &g.threads[from_lane];
  if (!(gr->mask >> src & 1u) || !(gr->arrived >> src & 1u)) {
    g.cur = me;
    set_error(E_SYNC, "%s (line %d): lane %d of warp %d reads lane %d, which %s (mask 0x%08x)", kCollName[gr->kind],
              gr->line, lane, me->warp, src, (gr->mask >> src & 1u) ? "has exited" : "is outside the mask", gr->mask);
    abort_fiber();
  }
  (void)w;
  return g.threads[me->warp * 32 + src].value;
}

static void finish_warp_op(Warp* w, Group* gr);

CUPAGED_SIM_TRUSTED static void finish_group(Warp* w, Group* gr) {
  if (gr->kind == WARP_OP) { finish_warp_op(w, gr); return; }
  int base = int(w - g.warps) * 32;
  unsigned long long acc = 0;
  unsigned ballot = 0;
  bool first = true;
  for (int l = 0; l < 32; ++l) {
    if (!(gr->arrived >> l & 1u)) continue;
    SimThread* t = &g.threads[base + l];
    unsigned long long v = t->value;
    if (t->out_pred) ballot |= 1u << l;
    switch (gr->kind) {
      case RED_ADD: acc = first ? v : (unsigned)(acc + v); break;
      case RED_MIN: acc = first ? v : (unsigned)((int)v < (int)acc ? v : acc); break;
      case RED_MAX: acc = first ? v : (unsigned)((int)v > (int)acc ? v : acc); break;
      case RED_UMIN: acc = first ? v : ((unsigned)v < (unsigned)acc ? v : acc); break;
      case RED_UMAX: acc = first ? v : ((unsigned)v > (unsigned)acc ? v : acc); break;
      case RED_AND: acc = first ? v : (acc & v); break;
      case RED_OR: acc = first ? v : (acc | v); break;
      case RED_XOR: acc = first ? v : (acc ^ v); break;
      default: break;
    }
    first = false;
  }
  unsigned segmask = unsigned(32 - gr->width) & 31u;
  for (int l = 0; l < 32; ++l) {
    if (!(gr->arrived >> l & 1u)) continue;
    SimThread* t = &g.threads[base + l];
    unsigned long long r = 0;
    int pred = 0;
    unsigned b = unsigned(t->arg) & 31u;
    unsigned maxlane = (unsigned(l) & segmask) | (31u & ~segmask);
    unsigned minlane = unsigned(l) & segmask;
    int j = l;
    bool ok = true;
    switch (gr->kind) {
      case SHFL_IDX: j = int(minlane | (b & ~segmask)); ok = unsigned(j) <= maxlane; break;
      case SHFL_UP: j = l - int(b); ok = j >= int(minlane); break;
      case SHFL_DOWN: j = l + int(b); ok = unsigned(j) <= maxlane; break;
      case SHFL_XOR: j = int(unsigned(l) ^ b); ok = unsigned(j) <= maxlane; break;
      case VOTE_ALL: r = (ballot & gr->arrived) == gr->arrived; break;
      case VOTE_ANY: r = ballot != 0; break;
      case BALLOT: r = ballot; break;
      case SYNCWARP: break;
      case MATCH_ANY:
      case MATCH_ALL: {
        unsigned m = 0;
        for (int k = 0; k < 32; ++k)
          if ((gr->arrived >> k & 1u) && g.threads[base + k].value == t->value) m |= 1u << k;
        if (gr->kind == MATCH_ANY) r = m;
        else { pred = m == gr->arrived; r = pred ? m : 0; }
        break;
      }
      default: r = acc; break;
    }
    if (gr->kind <= SHFL_XOR) r = lane_value(w, gr, base + l, l, ok ? j : l);
    t->result = r;
    t->out_pred = pred;
  }
  gr->active = false;
  release_lanes(base, gr->arrived);
}

CUPAGED_SIM_TRUSTED static bool group_complete(Warp* w, Group* gr) { return (gr->mask & w->live & ~gr->arrived) == 0; }

CUPAGED_SIM_TRUSTED __attribute__((noinline)) static unsigned long long collective(int kind, unsigned mask, unsigned long long value,
                                                               int arg, int width, int line, int* pred_out = nullptr) {
  SimThread* t = g.cur;
  Warp* w = &g.warps[t->warp];
  if (!(mask >> t->lane & 1u)) {
    set_error(E_SYNC, "%s (line %d): lane %d of warp %d calls it with mask 0x%08x, which excludes the lane itself",
              kCollName[kind], line, t->lane, t->warp, mask);
    abort_fiber();
  }
  if (width < 1 || width > 32 || (width & (width - 1))) {
    set_error(E_SYNC, "%s (line %d): width %d is not a power of two in 1..32", kCollName[kind], line, width);
    abort_fiber();
  }
  Group* gr = nullptr;
  for (auto& c : w->groups)
    if (c.active && c.mask == mask) { gr = &c; break; }
  if (gr && (gr->kind != kind || gr->width != width)) {
    set_error(E_SYNC, "lanes of warp %d with mask 0x%08x meet at different warp collectives: %s (line %d) and %s (line %d)",
              t->warp, mask, gr->name, gr->line, kCollName[kind], line);
    abort_fiber();
  }
  if (!gr) {
    for (auto& c : w->groups)
      if (!c.active) { gr = &c; break; }
    *gr = Group{true, kind, width, line, mask, 0u, kCollName[kind], nullptr, nullptr};
  }
  gr->arrived |= 1u << t->lane;
  t->value = value; t->arg = arg; t->line = line; t->group = int(gr - w->groups);
  t->out_pred = pred_out ? *pred_out : 0;
  t->state = WAIT_WARP;
  CUPAGED_SIM_PROF(prof_sched_point(t));
  if (group_complete(w, gr)) finish_group(w, gr);
  else { settle_activemask(w); block_wait(); }
  if (pred_out) *pred_out = t->out_pred;
  return t->result;
}

// A warp-wide `.sync.aligned` instruction (mma.sync, ldmatrix, stmatrix): every lane of the warp
// executes the same instruction (the same inline-PTX statement); the last to arrive computes all.
CUPAGED_SIM_TRUSTED __attribute__((noinline)) static void warp_op(const char* name, void (*compute)(int), const void* site, int line) {
  SimThread* t = g.cur;
  Warp* w = &g.warps[t->warp];
  Group* gr = nullptr;
  for (auto& c : w->groups)
    if (c.active && c.mask == 0xFFFFFFFFu) { gr = &c; break; }
  if (gr && (gr->kind != WARP_OP || gr->site != site)) {
    set_error(E_SYNC, "lanes of warp %d meet at different warp collectives: %s (line %d) and %s (line %d)",
              t->warp, gr->name, gr->line, name, line);
    abort_fiber();
  }
  if (!gr) {
    for (auto& c : w->groups)
      if (!c.active) { gr = &c; break; }
    *gr = Group{true, WARP_OP, 32, line, 0xFFFFFFFFu, 0u, name, site, compute};
  }
  gr->arrived |= 1u << t->lane;
  t->line = line; t->group = int(gr - w->groups);
  t->state = WAIT_WARP;
  CUPAGED_SIM_PROF(prof_sched_point(t));
  if (group_complete(w, gr)) finish_group(w, gr);
  else { settle_activemask(w); block_wait(); }
}

CUPAGED_SIM_TRUSTED static void finish_warp_op(Warp* w, Group* gr) {
  int base = int(w - g.warps) * 32;
  if (gr->arrived != 0xFFFFFFFFu) {
    unsigned missing = ~gr->arrived;
    set_error(E_SYNC, "%s (line %d) is a warp-wide .sync.aligned instruction: all 32 lanes of warp %d must execute it, "
              "but lanes 0x%08x %s", gr->name, gr->line, int(w - g.warps), missing,
              (missing & ~w->live) == missing && base + 32 > g.nthreads ? "do not exist or have exited" : "have exited");
    abort_fiber();
  }
  gr->compute(base);
  gr->active = false;
  release_lanes(base, 0xFFFFFFFFu);
}

#include "cupaged_sim_async.h"

CUPAGED_SIM_TRUSTED static void thread_exit() {
  SimThread* t = g.cur;
  async_thread_exit(t);
  t->state = DONE;
  ++g.exited;
  if (g.bar_arrived) {
    SimThread* w = nullptr;
    for (int i = 0; i < g.nthreads && !w; ++i)
      if (g.threads[i].state == WAIT_BAR) w = &g.threads[i];
    set_error(E_SYNC, "thread exited while %d thread(s) wait at %s (line %d), e.g. thread (%u,%u,%u): every thread of the block must reach it",
              g.bar_arrived, kBarName[w->bar_kind], w->bar_line, w->tid.x, w->tid.y, w->tid.z);
    abort_fiber();
  }
  Warp* w = &g.warps[t->warp];
  w->live &= ~(1u << t->lane);
  for (auto& c : w->groups)
    if (c.active && group_complete(w, &c)) finish_group(w, &c);
  settle_activemask(w);
}

// ---------------------------------------------------------------- deadlock report
CUPAGED_SIM_TRUSTED static void report_deadlock() {
  g.cur = nullptr;
  set_error(E_SYNC, "deadlock in block (%u,%u,%u): no thread can proceed.", g.block_idx.x, g.block_idx.y, g.block_idx.z);
  for (int wi = 0; wi < g.nwarps; ++wi) {
    for (int i = wi * 32; i < g.nthreads && i < wi * 32 + 32;) {
      SimThread* t = &g.threads[i];
      int j = i + 1;
      auto same = [&](SimThread* u) {
        return u->state == t->state && (t->state != WAIT_BAR || u->bar_line == t->bar_line) &&
               (t->state < WAIT_NAMED || (u->wait_id == t->wait_id && u->line == t->line)) &&
               (t->state != WAIT_WARP || (u->group == t->group && u->line == t->line));
      };
      while (j < g.nthreads && j < wi * 32 + 32 && same(&g.threads[j])) ++j;
      if (async_describe(t, wi, t->lane + j - i - 1)) {
      } else if (t->state == WAIT_BAR)
        append_error(" warp %d lanes %d-%d wait at %s (line %d);", wi, t->lane, t->lane + j - i - 1, kBarName[t->bar_kind], t->bar_line);
      else if (t->state == WAIT_WARP) {
        Group* gr = &g.warps[wi].groups[t->group];
        append_error(" warp %d lanes %d-%d wait at %s (line %d) for lanes 0x%08x;", wi, t->lane, t->lane + j - i - 1,
                     gr->name, t->line, gr->mask & g.warps[wi].live & ~gr->arrived);
      } else if (t->state == DONE)
        append_error(" warp %d lanes %d-%d exited;", wi, t->lane, t->lane + j - i - 1);
      i = j;
    }
  }
}

// ---------------------------------------------------------------- shared memory
// ---------------------------------------------------------------- instrumentation
// A fault found by instrumentation (alignment, bounds) at address a, after set_error: Python adds
// whose memory a is (fault_decoded 3).
[[noreturn]] CUPAGED_SIM_TRUSTED static void instrumented_fault(unsigned long long a, bool write) {
  g.err.fault_addr = a;
  g.err.fault_write = write;
  g.err.fault_decoded = 3;
  abort_fiber();
}
#include "cupaged_sim_bounds.h"

// The module is compiled with -fsanitize=alignment: g++ checks the alignment of every typed access
// and calls this UBSan entry point on a violation (no UBSan runtime is linked: the sim is it). x86
// tolerates misaligned loads the GPU faults on (a float4 load from a 4-byte-aligned address).
struct UbsanLocation { const char* file; unsigned line, column; };
struct UbsanTypeMismatch { UbsanLocation loc; const void* type; unsigned char log_alignment, kind; };
extern "C" __attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1(UbsanTypeMismatch* d, uintptr_t p) {
  unsigned long long align = 1ull << d->log_alignment;
  if (!g.cur || !p || p % align == 0) return;  // host code outside a launch, or a null check we did not ask for
  set_error(E_MEMORY, "misaligned %s of a %llu-byte-aligned type (line %u)", d->kind == 1 ? "store" : "access", align,
            d->loc.line);
  instrumented_fault(p, d->kind == 1);
}
extern "C" __attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1_abort(UbsanTypeMismatch* d, uintptr_t p) {
  __ubsan_handle_type_mismatch_v1(d, p);
}

// ---------------------------------------------------------------- signals
static const int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGVTALRM};

// A general-protection fault (a non-canonical address; SI_KERNEL) comes with si_addr 0: the real
// address is decoded from the faulting instruction (cupaged_sim_fault.h), as are, for any memory
// fault, the registers it was computed from.
CUPAGED_SIM_TRUSTED static void record_fault(siginfo_t* si, void* uctx) {
  g.err.fault_addr = reinterpret_cast<uintptr_t>(si->si_addr);
#if defined(__x86_64__)
  const greg_t* r = static_cast<ucontext_t*>(uctx)->uc_mcontext.gregs;
  g.err.fault_write = (r[REG_ERR] & 2) != 0;
  for (int i = 0; i < 16; ++i) g.err.regs[i] = (unsigned long long)r[i];  // REG_R8 .. REG_RSP
  MemOperand op;
  // a general-protection fault (non-canonical address): SIGSEGV or, depending on the faulting
  // instruction's form, SIGBUS, with si_code SI_KERNEL either way
  bool gp = (si->si_signo == SIGSEGV || si->si_signo == SIGBUS) && si->si_code == SI_KERNEL;
  if (!gp && g.err.fault_addr == (unsigned long long)r[REG_RIP]) return;  // a jump to a bad address: no code to read
  if (decode_mem_operand(reinterpret_cast<const unsigned char*>(r[REG_RIP]), r, &op)) {
    g.err.fault_base = op.base;
    g.err.fault_index = op.index;
    if (gp) { g.err.fault_addr = op.addr; g.err.fault_decoded = 1; }
  } else if (gp) {
    g.err.fault_decoded = 2;
  }
  // The access was checked just before (bounds instrumentation) and matched no array: the caller's
  // registers as they were then still hold the base and index the address was computed from.
  if (g_hook_addr && g.err.fault_addr == g_hook_addr)
    for (int i = 0; i < 16; ++i) g.err.regs[i] = cupaged_sim_hook_regs[i];
#else
  (void)uctx;
#endif
}

CUPAGED_SIM_TRUSTED static void on_signal(int sig, siginfo_t* si, void* uctx) {
  g.err.signo = sig;
  if (sig == SIGSEGV || sig == SIGBUS) record_fault(si, uctx);
  int code = sig == SIGSEGV || sig == SIGBUS ? E_MEMORY : sig == SIGVTALRM ? E_TIMEOUT : sig == SIGFPE ? E_TRAP : E_OTHER;
  const char* what = sig == SIGFPE ? (si->si_code == FPE_INTDIV ? "integer division by zero" : "arithmetic exception")
                     : sig == SIGILL ? "illegal instruction"
                     : sig == SIGVTALRM ? "time limit exceeded (CPU time; a spin-wait or an endless loop?)"
                     : "invalid memory access";
  g.err.code = OK;
  set_error(code, "%s", what);
  if (code == E_MEMORY && g.cur) {
    char* lo = g.cur->fiber.stack;
    if (g.err.fault_addr >= reinterpret_cast<uintptr_t>(lo) && g.err.fault_addr < reinterpret_cast<uintptr_t>(lo + 4096))
      append_error(": stack overflow (the sim gives each CUDA thread %zu KiB of stack)", kStackSize / 1024);
  }
  siglongjmp(g.jmp, 1);
}

// ---------------------------------------------------------------- launch
CUPAGED_SIM_TRUSTED static int run_block(unsigned bx, unsigned by, unsigned bz, char* tls, size_t fill) {
  g.block_idx = uint3{bx, by, bz};
  memset(tls, g.poison, fill);
  g.qhead = g.qtail = 0;
  g.bar_arrived = 0;
  g.exited = 0;
  for (int w = 0; w < g.nwarps; ++w) {
    int lanes = g.nthreads - w * 32 < 32 ? g.nthreads - w * 32 : 32;
    g.warps[w].live = lanes == 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1u);
    g.warps[w].am_waiting = 0;
    for (auto& c : g.warps[w].groups) c.active = false;
  }
  async_block_start();
  int ids[kMaxThreads];
  for (int i = 0; i < g.nthreads; ++i) {
    SimThread* t = &g.threads[i];
    t->linear = i; t->warp = i / 32; t->lane = i % 32;
    g_async[i].clear();
    g_async_committed[i] = 0;
    t->tid = uint3{unsigned(i % g.block.x), unsigned(i / g.block.x % g.block.y), unsigned(i / (g.block.x * g.block.y))};
    if (!init_fiber(t)) { set_error(E_OTHER, "cannot protect a fiber stack's guard page"); return E_OTHER; }
    ids[i] = i;
  }
  CUPAGED_SIM_PROF(prof_block_start(g.nthreads));
  release(ids, g.nthreads);
  int done = 0;
  while (done < g.nthreads) {
    if (g.qhead == g.qtail) { report_deadlock(); return E_SYNC; }
    SimThread* t = &g.threads[g.queue[g.qhead]];
    g.qhead = (g.qhead + 1) % (kMaxThreads * 2);
    if (t->state != RUNNABLE) continue;
    g.cur = t;
    switch_to(&g.sched, &t->fiber);
    if (g.failed) return g.err.code;
    if (t->state == DONE) ++done;
  }
  g.cur = nullptr;
  CUPAGED_SIM_PROF(prof_block_end());
  return OK;
}

CUPAGED_SIM_TRUSTED static int run_grid(const LaunchConfig* cfg) {
  memset(&g.err, 0, sizeof g.err);
  g.cur = nullptr;
  g.failed = false;
  g.grid = dim3(cfg->grid[0], cfg->grid[1], cfg->grid[2]);
  g.block = dim3(cfg->block[0], cfg->block[1], cfg->block[2]);
  g.nthreads = int(cfg->block[0] * cfg->block[1] * cfg->block[2]);
  g.nwarps = (g.nthreads + 31) / 32;
  g.order = cfg->order;
  g.poison = cfg->poison;
  g_prof = static_cast<ProfLaunch*>(cfg->profile);
  CUPAGED_SIM_PROF(prof_launch_start());
  g_regions = static_cast<const Region*>(cfg->regions);
  g_nregions = cfg->nregions;
  cupaged_sim_gap_lo = 1;  // no unguarded access yet: an empty range
  cupaged_sim_gap_hi = 0;
  g_hook_addr = 0;
  g.rng = cfg->seed;
  if (g.nthreads < 1 || g.nthreads > kMaxThreads) { set_error(E_CONFIG, "bad block size"); return E_CONFIG; }
  // The module's TLS block in this OS thread is [static __shared__ ...][pad][dynamic buffer].
  char* dyn = __cupaged_dyn_smem;
  char* tls = dyn - cfg->tls_dyn_offset;
  g.err.dyn_smem = reinterpret_cast<uintptr_t>(dyn);
  g.smem_base = tls;
  g.smem_size = cfg->tls_dyn_offset + cfg->shared_mem;
  if (!map_stacks()) { set_error(E_OTHER, "cannot map fiber stacks"); return E_OTHER; }
  build_tables(g_stack_area, kStackSize * kMaxThreads);
  size_t page = 4096, smem = cfg->shared_mem;
  size_t protect_from = (smem + page - 1) / page * page;
  size_t fill = size_t(dyn - tls) + protect_from;
  if (!g.altstack) g.altstack = static_cast<char*>(mmap(nullptr, 1 << 16, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  stack_t ss{}, old_ss{};
  ss.ss_sp = g.altstack; ss.ss_size = 1 << 16;
  sigaltstack(&ss, &old_ss);
  struct sigaction sa{}, old_sa[5];
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < 5; ++i) sigaction(kSignals[i], &sa, &old_sa[i]);
  itimerval timer{}, old_timer{};
  timer.it_value.tv_sec = time_t(cfg->timeout_s);
  timer.it_value.tv_usec = suseconds_t((cfg->timeout_s - double(time_t(cfg->timeout_s))) * 1e6);
  if (timer.it_value.tv_sec == 0 && timer.it_value.tv_usec == 0) timer.it_value.tv_usec = 1;
  if (protect_from < kDynSmemCapacity) mprotect(dyn + protect_from, kDynSmemCapacity - protect_from, PROT_NONE);
  int rc = OK;
  if (sigsetjmp(g.jmp, 1) == 0) {
    setitimer(ITIMER_VIRTUAL, &timer, &old_timer);
    unsigned long long nblocks = (unsigned long long)cfg->grid[0] * cfg->grid[1] * cfg->grid[2];
    // random order: b = (a * i + c) mod nblocks with gcd(a, nblocks) = 1 is a permutation
    unsigned long long a = 1, c = 0;
    if (g.order == 2 && nblocks > 1) {
      a = next_random() % nblocks | 1u;
      auto gcd = [](unsigned long long x, unsigned long long y) { while (y) { unsigned long long r = x % y; x = y; y = r; } return x; };
      while (gcd(a, nblocks) != 1) ++a;
      c = next_random() % nblocks;
    }
    for (unsigned long long i = 0; i < nblocks && rc == OK; ++i) {
      unsigned long long b = g.order == 1 ? nblocks - 1 - i
                           : g.order == 2 ? (unsigned long long)(((unsigned __int128)a * i + c) % nblocks) : i;
      CUPAGED_SIM_PROF(if (!prof_sampled(b, cfg->grid)) continue;)  // sim.profile(block_stride=...)
      rc = run_block(unsigned(b % cfg->grid[0]), unsigned(b / cfg->grid[0] % cfg->grid[1]),
                     unsigned(b / ((unsigned long long)cfg->grid[0] * cfg->grid[1])), tls, fill);
      if (rc == OK && smem < protect_from) {
        for (size_t o = smem; o < protect_from; ++o)
          if (static_cast<unsigned char>(dyn[o]) != (unsigned char)g.poison) {
            set_error(E_MEMORY, "write to dynamic shared memory at byte offset %zu, past the launch's %zu bytes", o, smem);
            rc = E_MEMORY;
            break;
          }
      }
    }
  } else {
    rc = g.err.code;
  }
  itimerval zero{};
  setitimer(ITIMER_VIRTUAL, &zero, nullptr);
  setitimer(ITIMER_VIRTUAL, &old_timer, nullptr);
  if (protect_from < kDynSmemCapacity) mprotect(dyn + protect_from, kDynSmemCapacity - protect_from, PROT_READ | PROT_WRITE);
  for (int i = 0; i < 5; ++i) sigaction(kSignals[i], &old_sa[i], nullptr);
  sigaltstack(&old_ss, nullptr);
  return rc;
}

// Every pointer the launch lent (the profiler's record, the table of guarded arrays: Python frees
// them when the call returns; the wrapper's context on its stack) is forgotten on every path out.
CUPAGED_SIM_TRUSTED static void end_launch() {
  CUPAGED_SIM_PROF(prof_launch_end());
  g_prof = nullptr;
  g_regions = nullptr;
  g_nregions = 0;
  g.smem_size = 0;
  g.thunk = nullptr;
  g.thunk_ctx = nullptr;
  g.cur = nullptr;
}

CUPAGED_SIM_TRUSTED static int run_launch(const LaunchConfig* cfg) {
  int rc = run_grid(cfg);
  end_launch();
  return rc;
}

}  // namespace cupaged_sim

extern "C" __attribute__((visibility("default"))) cupaged_sim::ErrorInfo* cupaged_sim_error() { return &cupaged_sim::g.err; }
