// cupaged_sim_mbarrier.h: mbarrier objects and the bulk copies that complete on them, and the bulk
// stores out of shared memory in flight (see cupaged_sim_async.h for the semantics). Included by
// cupaged_sim_async.h in namespace cupaged_sim.
#pragma once

// ---------------------------------------------------------------- mbarriers
struct MBar {
  unsigned long long addr;  // its shared address
  bool live;
  int expected, pending, line;
  long long tx;
  unsigned long long phase;  // completed phases
};
// A bulk copy into shared memory that completes on an mbarrier: it lands when the phase completes.
struct Landing {
  unsigned long long dst;
  size_t size;
  unsigned char* data;
  int mbar, issuer;
};
static const int kMBars = 64;
static MBar g_mbar[kMBars];
static int g_nmbar;
static Landing* g_land;
static size_t g_nland, g_land_cap;

CUPAGED_SIM_ASYNC_FN static int mbar_find(unsigned long long a, int line, const char* op) {
  for (int i = 0; i < g_nmbar; ++i)
    if (g_mbar[i].live && g_mbar[i].addr == a) return i;
  set_error(E_SYNC, "inline PTX (line %d): %s on shared address 0x%llx, which holds no mbarrier (mbarrier.init first)", line,
            op, a);
  abort_fiber();
}

CUPAGED_SIM_ASYNC_FN static bool mbar_done(int i, int parity, unsigned long long v) {
  return parity ? (g_mbar[i].phase & 1u) != (v & 1u) : g_mbar[i].phase != v;
}

static void mbar_copies_done(int i, int line);

CUPAGED_SIM_ASYNC_FN static bool mbar_waited(int i) {  // a thread waits on mbarrier i
  for (int j = 0; j < g.nthreads; ++j)
    if (g.threads[j].state == WAIT_MBAR && g.threads[j].wait_id == i) return true;
  return false;
}

CUPAGED_SIM_ASYNC_FN static void mbar_check(int i, int line) {
  MBar& m = g_mbar[i];
  if (m.tx > (1 << 20) - 1 || m.tx < -((1 << 20) - 1)) {
    set_error(E_SYNC, "inline PTX (line %d): the mbarrier at shared 0x%llx has a transaction count of %lld, outside "
              "the ISA's range of +-(2^20 - 1)", line, m.addr, m.tx);
    abort_fiber();
  }
  if (!m.pending && m.tx && mbar_waited(i)) {  // the arrivals are in: copies in flight complete for a waiter
    mbar_copies_done(i, line);
    return;
  }
  if (m.pending || m.tx) return;
  ++m.phase;
  m.pending = m.expected;
  async_progress();
  int ids[kMaxThreads], n = 0;
  for (int j = 0; j < g.nthreads; ++j) {
    SimThread* t = &g.threads[j];
    if (t->state == WAIT_MBAR && t->wait_id == i && mbar_done(i, t->wait_kind, t->wait_value)) ids[n++] = j;
  }
  if (n) release(ids, n);
}

// The bulk copies in flight on mbarrier i complete (land, in issue order, and count their bytes on its
// transaction count). The sim completes them as late as it may: once every arrival of the phase is in
// and a thread waits on that mbarrier.
CUPAGED_SIM_ASYNC_FN static void mbar_copies_done(int i, int line) {
  if (g_mbar[i].pending) return;  // the phase lacks arrivals: the copies may stay in flight
  size_t k = 0;
  long long bytes = 0;
  for (size_t j = 0; j < g_nland; ++j) {
    Landing& l = g_land[j];
    if (l.mbar != i) { g_land[k++] = l; continue; }
    proxy_write(l.dst, l.data, l.size);
    CUPAGED_SIM_PROF(if (g_prof) g_pt[l.issuer].async -= l.size);
    free(l.data);
    bytes += (long long)l.size;
  }
  g_nland = k;
  if (!bytes) return;
  g_mbar[i].tx -= bytes;
  mbar_check(i, line);
}

CUPAGED_SIM_ASYNC_FN static void mbar_init(unsigned long long a, long long count, int line) {
  if (count < 1 || count > (1 << 20) - 1) {
    set_error(E_SYNC, "inline PTX (line %d): mbarrier.init: count %lld is outside 1..2^20-1", line, count);
    abort_fiber();
  }
  int i = 0, free_slot = -1;  // re-initialising one reuses its slot
  while (i < g_nmbar && g_mbar[i].addr != a) {
    if (!g_mbar[i].live && free_slot < 0) free_slot = i;
    ++i;
  }
  if (i == g_nmbar && free_slot >= 0) i = free_slot;
  else if (i == g_nmbar && g_nmbar++ == kMBars) {
    set_error(E_SYNC, "inline PTX (line %d): more than %d live mbarriers in one block", line, kMBars);
    abort_fiber();
  }
  g_mbar[i] = MBar{a, true, int(count), int(count), line, 0, 0};
}

// arrive (with count), expect_tx (tx > 0 before the arrival), arrive_drop (the expected count drops
// by count for this and later phases); returns the state token: the phase the arrival belongs to.
CUPAGED_SIM_ASYNC_FN static unsigned long long mbar_arrive(unsigned long long a, long long count, long long tx, bool drop,
                                                         int line, const char* op) {
  int i = mbar_find(a, line, op);
  MBar& m = g_mbar[i];
  unsigned long long token = m.phase;
  m.tx += tx;
  if (drop) m.expected -= int(count);
  m.pending -= int(count);
  if (m.pending < 0 || m.expected < 0) {
    set_error(E_SYNC, "inline PTX (line %d): %s: more arrivals on the mbarrier at shared 0x%llx than its expected count "
              "(mbarrier.init at line %d)", line, op, a, m.line);
    abort_fiber();
  }
  mbar_check(i, line);
  return token;
}

CUPAGED_SIM_ASYNC_FN static void mbar_tx(unsigned long long a, long long delta, int line, const char* op) {
  int i = mbar_find(a, line, op);
  g_mbar[i].tx += delta;
  mbar_check(i, line);
}

// try_wait (blocking) and test_wait: whether the phase (parity: of that parity; else: of the token)
// has completed.
CUPAGED_SIM_ASYNC_FN __attribute__((noinline)) static bool mbar_wait(unsigned long long a, int parity, unsigned long long v,
                                                                   bool blocking, int line, const char* op) {
  int i = mbar_find(a, line, op);
  SimThread* t = g.cur;
  CUPAGED_SIM_PROF(prof_sched_point(t));
  mbar_copies_done(i, line);
  if (mbar_done(i, parity, v)) return true;
  t->wait_id = i;
  t->wait_kind = parity;
  t->wait_value = v;
  t->line = line;
  if (blocking) {
    t->state = WAIT_MBAR;
    settle_activemask(&g.warps[t->warp]);
    block_wait();
    return true;
  }
  if (++g_spins > kSpinLimit) {
    set_error(E_SYNC, "inline PTX (line %d): %s spins on the mbarrier at shared 0x%llx (phase %llu, %d arrival(s) and "
              "%lld transaction byte(s) pending) while no barrier moves: the phase can never complete", line, op, a,
              g_mbar[i].phase, g_mbar[i].pending, g_mbar[i].tx);
    abort_fiber();
  }
  make_runnable(t);  // to the back of the queue: the others run first
  settle_activemask(&g.warps[t->warp]);
  block_wait();
  return false;
}

CUPAGED_SIM_ASYNC_FN static void mbar_inval(unsigned long long a, int line) {
  int i = mbar_find(a, line, "mbarrier.inval");
  for (int j = 0; j < g.nthreads; ++j)
    if (g.threads[j].state == WAIT_MBAR && g.threads[j].wait_id == i) {
      set_error(E_SYNC, "inline PTX (line %d): mbarrier.inval on shared 0x%llx while thread %d waits on it", line, a, j);
      abort_fiber();
    }
  for (size_t j = 0; j < g_nland; ++j)
    if (g_land[j].mbar == i) {
      set_error(E_SYNC, "inline PTX (line %d): mbarrier.inval on shared 0x%llx while a bulk copy completing on it is in "
                "flight", line, a);
      abort_fiber();
    }
  g_mbar[i].live = false;
}

CUPAGED_SIM_ASYNC_FN static void land_later(unsigned long long dst, size_t size, unsigned char* data, int mbar) {
  if (g_nland == g_land_cap) {
    g_land_cap = g_land_cap ? 2 * g_land_cap : 64;
    g_land = static_cast<Landing*>(realloc(g_land, g_land_cap * sizeof(Landing)));
  }
  g_land[g_nland++] = Landing{dst, size, data, mbar, g.cur->linear};
  CUPAGED_SIM_PROF(if (g_prof) { g_pt[g.cur->linear].async += size; prof_inflight_peak(g_pt[g.cur->linear]); });
  if (mbar_waited(mbar)) mbar_copies_done(mbar, g.cur->line);  // a thread already waits: the copy completes now
}

// ---------------------------------------------------------------- bulk stores (shared -> global) in flight
// A store out of shared memory reads its source (through the async proxy) and writes global memory when
// a cp.async.bulk.wait_group(.read) covers its bulk group, or when its thread exits: the latest a GPU
// may, so shared memory overwritten before the wait is what the store writes.
struct BulkStore {
  unsigned long long dst, src;  // a plain copy: global dst, shared src; a tensor copy (rank > 0): src only
  size_t size;
  unsigned group;
  int line, rank;
  long long c[5];
  unsigned char map[128];  // the tensor map's image
};
struct StoreQueue {
  BulkStore* q;
  size_t n, cap;
  unsigned committed;
};
static StoreQueue g_stores[kMaxThreads];
namespace ptx { static void bulk_store_run(const BulkStore& s); }  // cupaged_sim_hopper.h

CUPAGED_SIM_ASYNC_FN static void bulk_stores_wait(int linear, unsigned long long pending) {
  StoreQueue& q = g_stores[linear];
  const unsigned done = pending >= q.committed ? 0u : q.committed - unsigned(pending);
  size_t k = 0;
  for (size_t j = 0; j < q.n; ++j) {
    if (q.q[j].group >= done) { q.q[k++] = q.q[j]; continue; }
    BulkStore s = q.q[j];
    ptx::bulk_store_run(s);
  }
  q.n = k;
}

CUPAGED_SIM_ASYNC_FN static void bulk_store_push(const BulkStore& s) {
  StoreQueue& q = g_stores[g.cur->linear];
  if (q.n == q.cap) {
    q.cap = q.cap ? 2 * q.cap : 16;
    q.q = static_cast<BulkStore*>(realloc(q.q, q.cap * sizeof(BulkStore)));
  }
  q.q[q.n] = s;
  q.q[q.n++].group = q.committed;
}
