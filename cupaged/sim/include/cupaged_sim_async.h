// cupaged_sim_async.h: the CTA-level synchronisation Hopper kernels use, on the sim.
//
//  * Named barriers (`bar.sync / bar.arrive id, count`, `barrier.cta.*`): 16 per CTA. A barrier
//    completes when `count` threads have arrived (count a multiple of 32; none = the whole CTA);
//    `bar.sync` waits for it, `bar.arrive` does not.
//  * Warpgroup-wide `.sync.aligned` instructions (wgmma.mma_async, setmaxnreg): the 128 threads of
//    warps 4i..4i+3 all execute the same statement; the last to arrive computes every thread's result.
//  * mbarrier objects (`mbarrier.*` on a shared b64): a phase completes when its pending arrival
//    count and its transaction count both reach 0; then the phase number advances and the pending count
//    is reset to the expected count. A bulk copy completing on an mbarrier is in flight (its destination
//    holds poison) until a thread waits on that mbarrier: then it lands and counts its bytes on the
//    transaction count -- the latest a GPU could complete it. The state lives in a table of the engine,
//    keyed by the shared address, not in the 8 bytes (whose encoding on a GPU is not documented).
//    `try_wait` suspends the thread until the phase completes and then returns true (a legal outcome
//    of a potentially blocking test); `test_wait` never blocks: when the phase is incomplete it
//    yields to the other threads and returns false.
//  * The async proxy's view of shared memory: wgmma and bulk copies read shared memory through the
//    async proxy, which sees generic stores only after a `fence.proxy.async`. The sim keeps a second
//    image of shared memory that async-proxy writes update and a fence refreshes (a copy of the whole
//    of shared memory); an async-proxy read of bytes on which the two images differ is a SimSyncError:
//    a generic store that no fence ordered before the read.
//    (One thread's fence publishes every thread's earlier stores here: a missing fence is caught
//    when no thread fenced, not when another thread's fence happened to come later.)
// A wait that can never complete -- every thread blocked, or test_wait spinning while nothing else
// moves -- is a SimSyncError naming the barrier and the waiting warps. (The mbarriers and bulk stores
// are in cupaged_sim_mbarrier.h.) Included by
// cupaged_sim_engine.h in namespace cupaged_sim, after the warp collectives.
#pragma once

#define CUPAGED_SIM_ASYNC_FN CUPAGED_SIM_TRUSTED CUPAGED_SIM_PROF(__attribute__((no_sanitize_thread)))

// ---------------------------------------------------------------- named barriers
static const int kNamedBars = 16;
struct NamedBar { int expected, arrived, line; };
static NamedBar g_named[kNamedBars];
static unsigned long long g_spins;  // test_wait yields since an mbarrier or named barrier last moved
static const unsigned long long kSpinLimit = 1ull << 22;

CUPAGED_SIM_ASYNC_FN static void async_progress() { g_spins = 0; }

CUPAGED_SIM_ASYNC_FN __attribute__((noinline)) static void named_barrier(int id, int count, bool wait, int line) {
  SimThread* t = g.cur;
  const char* op = wait ? "bar.sync" : "bar.arrive";
  if (id < 0 || id >= kNamedBars) { set_error(E_SYNC, "%s (line %d): barrier id %d is outside 0..15", op, line, id); abort_fiber(); }
  const bool all = count < 0;  // no count: every thread of the CTA
  if (all) count = g.nthreads;
  if (count == 0 || (count % 32 && !all) || count > g.nthreads) {
    set_error(E_SYNC, "%s %d, %d (line %d): the thread count must be a multiple of 32 in 32..%d (the block's threads)",
              op, id, count, line, g.nthreads);
    abort_fiber();
  }
  NamedBar& b = g_named[id];
  if (b.arrived == 0) { b.expected = count; b.line = line; }
  else if (b.expected != count) {
    set_error(E_SYNC, "barrier %d: threads arrive with counts %d (line %d) and %d (line %d)", id, b.expected, b.line,
              count, line);
    abort_fiber();
  }
  CUPAGED_SIM_PROF(prof_sched_point(t));
  if (++b.arrived < b.expected) {
    if (!wait) return;
    t->state = WAIT_NAMED;
    t->wait_id = id;
    t->line = line;
    settle_activemask(&g.warps[t->warp]);
    block_wait();
    return;
  }
  b.arrived = 0;
  async_progress();
  int ids[kMaxThreads], n = 0;
  for (int i = 0; i < g.nthreads; ++i)
    if (g.threads[i].state == WAIT_NAMED && g.threads[i].wait_id == id) ids[n++] = i;
  release(ids, n);
}

// ---------------------------------------------------------------- warpgroup-wide instructions
struct WgOp {
  bool active;
  const void* site;
  const char* name;
  int line;
  unsigned arrived[4];
  void (*compute)(int base);
};
static WgOp g_wg[kMaxThreads / 128];

CUPAGED_SIM_ASYNC_FN __attribute__((noinline)) static void warpgroup_op(const char* name, void (*compute)(int), const void* site,
                                                                      int line) {
  SimThread* t = g.cur;
  int wg = t->linear / 128, k = t->linear % 128;
  if (128 * (wg + 1) > g.nthreads) {
    set_error(E_SYNC, "%s (line %d) is a warpgroup-wide .sync.aligned instruction: thread %d's warpgroup (threads %d..%d) "
              "is incomplete in a block of %d threads", name, line, t->linear, 128 * wg, 128 * wg + 127, g.nthreads);
    abort_fiber();
  }
  WgOp& w = g_wg[wg];
  if (w.active && w.site != site) {
    set_error(E_SYNC, "warps of warpgroup %d meet at different warpgroup instructions: %s (line %d) and %s (line %d)", wg,
              w.name, w.line, name, line);
    abort_fiber();
  }
  if (!w.active) w = WgOp{true, site, name, line, {0u, 0u, 0u, 0u}, compute};
  w.arrived[k / 32] |= 1u << (k % 32);
  t->line = line;
  t->state = WAIT_WG;
  CUPAGED_SIM_PROF(prof_sched_point(t));
  if ((w.arrived[0] & w.arrived[1] & w.arrived[2] & w.arrived[3]) != 0xFFFFFFFFu) {
    settle_activemask(&g.warps[t->warp]);
    block_wait();
    return;
  }
  w.active = false;
  compute(128 * wg);
  int ids[128], n = 0;
  for (int i = 128 * wg; i < 128 * wg + 128; ++i)
    if (&g.threads[i] != t) ids[n++] = i;
  t->state = RUNNABLE;
  release(ids, n, true);
}

// ---------------------------------------------------------------- the async proxy's view of shared memory
static unsigned char* g_proxy;  // the second image, g_proxy_cap bytes
static size_t g_proxy_cap;
static bool g_proxy_init;  // false: the image is the block's initial shared memory (poison)

CUPAGED_SIM_ASYNC_FN static void proxy_image(bool from_smem) {
  if (g_proxy_cap < g.smem_size) {
    free(g_proxy);
    g_proxy_cap = size_t(g.smem_size);
    g_proxy = static_cast<unsigned char*>(malloc(g_proxy_cap));
  }
  if (from_smem) memcpy(g_proxy, g.smem_base, size_t(g.smem_size));
  else memset(g_proxy, g.poison, size_t(g.smem_size));
  g_proxy_init = true;
}
CUPAGED_SIM_ASYNC_FN static void proxy_sync() { if (!g_proxy_init) proxy_image(false); }
// fence.proxy.async: the async proxy sees every generic store made so far.
CUPAGED_SIM_ASYNC_FN static void proxy_fence() { proxy_image(true); }

// An async-proxy read of shared [a, a + n): every byte must be what the async proxy sees.
CUPAGED_SIM_ASYNC_FN static void proxy_read(unsigned long long a, size_t n, const char* op, int line) {
  proxy_sync();
  if (memcmp(g_proxy + a, g.smem_base + a, n) == 0) return;
  size_t i = 0;
  while (g_proxy[a + i] == static_cast<unsigned char>(g.smem_base[a + i])) ++i;
  set_error(E_SYNC, "inline PTX (line %d): %s reads shared memory at 0x%llx, written by generic stores (C++, st.shared, "
            "stmatrix, cp.async) that no fence.proxy.async ordered before this async-proxy read", line, op, a + i);
  abort_fiber();
}

// An async-proxy write (a bulk copy landing): both images.
CUPAGED_SIM_ASYNC_FN static void proxy_write(unsigned long long a, const void* data, size_t n) {
  proxy_sync();
  if (data) { memcpy(g.smem_base + a, data, n); memcpy(g_proxy + a, data, n); }
  else { memset(g.smem_base + a, g.poison, n); memset(g_proxy + a, g.poison, n); }
}

#include "cupaged_sim_mbarrier.h"

// ---------------------------------------------------------------- a thread's wgmma registers in flight
struct WgReg {
  void* reg;       // the C++ variable the asm statement bound the accumulator register to
  unsigned value;  // what the wgmma will write there
  unsigned group;  // its wgmma-group (commit groups closed before it was issued)
  bool a_fragment; // a register of A (restored by the landing), not an accumulator
};
struct WgThread {
  WgReg* regs;  // in flight, oldest first
  size_t n, cap;
  unsigned committed;  // wgmma-groups closed so far
  bool fenced;   // a wgmma.fence since the last landing
  bool issued;   // a wgmma.mma_async so far
  bool landed;   // a wait landed registers since the last fence
  WgReg* log;    // what the landings since the last fence wrote
  size_t nlog, logcap;
};
static WgThread g_wgt[kMaxThreads];

CUPAGED_SIM_ASYNC_FN static void wg_push(WgReg*& a, size_t& n, size_t& cap, WgReg r) {
  if (n == cap) {
    cap = cap ? 2 * cap : 256;
    a = static_cast<WgReg*>(realloc(a, cap * sizeof(WgReg)));
  }
  a[n++] = r;
}

// ---------------------------------------------------------------- block start, thread exit, deadlock report
CUPAGED_SIM_ASYNC_FN static void async_block_start() {
  for (int i = 0; i < g.nthreads; ++i) {
    g_stores[i].n = 0;
    g_stores[i].committed = 0;
    WgThread& w = g_wgt[i];
    w.n = w.nlog = 0;
    w.committed = 0;
    w.fenced = w.issued = w.landed = false;
  }
  memset(g_named, 0, sizeof g_named);
  for (auto& w : g_wg) w.active = false;
  g_nmbar = 0;
  for (size_t j = 0; j < g_nland; ++j) free(g_land[j].data);
  g_nland = 0;
  g_spins = 0;
  g_proxy_init = false;
}

CUPAGED_SIM_ASYNC_FN static void async_thread_exit(SimThread* t) {
  ++g_stores[t->linear].committed;  // its stores complete as it exits
  bulk_stores_wait(t->linear, 0);
  if (128 * (t->linear / 128 + 1) <= g.nthreads && g_wg[t->linear / 128].active) {
    WgOp& w = g_wg[t->linear / 128];
    set_error(E_SYNC, "%s (line %d) is a warpgroup-wide .sync.aligned instruction: thread %d exited while its warpgroup "
              "waits there", w.name, w.line, t->linear);
    abort_fiber();
  }
}

// One run of lanes of a warp in the same wait, for the deadlock report (false: not one of these waits).
CUPAGED_SIM_ASYNC_FN static bool async_describe(SimThread* t, int wi, int last_lane) {
  if (t->state == WAIT_NAMED) {
    NamedBar& b = g_named[t->wait_id];
    append_error(" warp %d lanes %d-%d wait at named barrier %d (line %d), %d of its %d threads arrived;", wi, t->lane,
                 last_lane, t->wait_id, t->line, b.arrived, b.expected);
  } else if (t->state == WAIT_MBAR) {
    MBar& m = g_mbar[t->wait_id];
    append_error(" warp %d lanes %d-%d wait (line %d) on the mbarrier at shared 0x%llx for the phase %s %llu, which "
                 "lacks %d arrival(s) and %lld transaction byte(s);", wi, t->lane, last_lane, t->line, m.addr,
                 t->wait_kind ? "of parity" : "after", t->wait_kind ? t->wait_value & 1u : t->wait_value, m.pending, m.tx);
  } else if (t->state == WAIT_WG) {
    append_error(" warp %d lanes %d-%d wait at the warpgroup instruction %s (line %d) for the other warps of warpgroup %d;",
                 wi, t->lane, last_lane, g_wg[t->linear / 128].name, t->line, t->linear / 128);
  } else {
    return false;
  }
  return true;
}
