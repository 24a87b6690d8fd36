// cupaged_sim_profile.h: the memory-traffic profiler of the sim (cupaged.sim.profile()).
//
// A profiled launch runs a second build of the module, compiled with -fsanitize=thread and
// -DCUPAGED_SIM_PROFILE: every load and store calls __tsan_{read,write}N(address) first, whose
// return address identifies the instruction site. No TSan runtime is linked: these entry points
// are the profiler's. Each access of a CUDA thread to a pointer argument's memory or to shared
// memory is appended to the block's log with its warp, lane, site and occurrence; at the end of
// the block the log is grouped into warp-level instructions (one executed occurrence of one site by
// the lanes of a warp: the lanes' occurrence counts of that site since their last scheduling
// point), which give the 32-byte sectors touched and the shared-memory wavefronts. Emulated PTX
// (cp.async, ldmatrix) is accounted by the emulation itself. Included inside namespace cupaged_sim.
#pragma once

struct ProfArg {  // mirrored by ctypes in cupaged/sim/_profile.py
  unsigned long long lo, hi;          // the argument's memory
  unsigned long long bytes_read, bytes_written, sectors_read, sectors_written;
  unsigned long long useful_read, useful_written;  // distinct bytes per warp-level instruction, summed
  unsigned char* seen_read;           // one byte per byte of [lo, hi): touched by a read / write
  unsigned char* seen_written;
};
struct ProfLaunch {  // mirrored by ctypes in cupaged/sim/_profile.py
  int nargs;
  ProfArg* args;
  unsigned long long wavefronts, ideal_wavefronts, cp_async_bytes, mma_flops, max_inflight_bytes_per_cta;
};

static ProfLaunch* g_prof;  // the profiled launch, or null

#if defined(CUPAGED_SIM_PROFILE)
struct ProfAccess {
  const void* site;
  const void* tail;  // the site of the last access merged into this one
  unsigned long long addr;
  unsigned warp, epoch, occ;
  unsigned char lane, size, write;
  signed char arg;  // -1: shared memory
};
static std::vector<ProfAccess> g_prof_log;
static unsigned g_prof_epoch[kMaxThreads];  // scheduling points each thread has passed in this block
// per thread: occurrences of each site since its last scheduling point (cleared at each one)
static std::unordered_map<const void*, unsigned> g_prof_occ[kMaxThreads];

// Bytes in flight (a documented approximation): a thread's plain global loads count from issue to
// its next scheduling point (at most 8 loads), its cp.async groups from commit until a wait covers
// them. The threads of a CTA run concurrently on a GPU, one after another on the sim: a CTA's
// figure is the sum of its threads' peaks, which does not depend on the sim's scheduling order.
static unsigned long long g_prof_plain[kMaxThreads], g_prof_async[kMaxThreads], g_prof_peak[kMaxThreads];
static unsigned g_prof_loads[kMaxThreads];
static unsigned long long g_prof_open_group[kMaxThreads];           // cp.async bytes not yet committed
static std::vector<unsigned long long> g_prof_groups[kMaxThreads];  // committed groups' bytes, oldest first

static void prof_inflight_peak(int t) {
  g_prof_peak[t] = std::max(g_prof_peak[t], g_prof_plain[t] + g_prof_async[t]);
}
static void prof_async_issue(unsigned bytes) { g_prof_open_group[g.cur->linear] += bytes; }
static void prof_async_commit() {
  int t = g.cur->linear;
  g_prof_groups[t].push_back(g_prof_open_group[t]);
  g_prof_async[t] += g_prof_open_group[t];
  g_prof_open_group[t] = 0;
  prof_inflight_peak(t);
}
static void prof_async_wait(unsigned long long pending) {
  int t = g.cur->linear;
  auto& q = g_prof_groups[t];
  while (q.size() > pending) {
    g_prof_async[t] -= q.front();
    q.erase(q.begin());
  }
}

__attribute__((no_sanitize_thread)) static unsigned prof_occurrence(int t, const void* site) {
  return g_prof_occ[t][site]++;
}

// Emulated instructions (cp.async) log with their asm statement's line as the site: odd values.
static bool site_is_code(const void* site) { return !(reinterpret_cast<uintptr_t>(site) & 1u); }

__attribute__((no_sanitize_thread)) static void prof_record(uintptr_t a, unsigned n, bool write, const void* site) {
  if (!g_prof || !g.cur) return;
  int arg = -2;
  if (a - reinterpret_cast<uintptr_t>(g.smem_base) < g.smem_size) arg = -1;
  else
    for (int i = 0; i < g_prof->nargs && arg == -2; ++i)
      if (a >= g_prof->args[i].lo && a + n <= g_prof->args[i].hi) arg = i;
  if (arg == -2) return;  // the stack, the sim's own state
  SimThread* t = g.cur;
  if (arg >= 0) {
    ProfArg& p = g_prof->args[arg];
    (write ? p.bytes_written : p.bytes_read) += n;
    memset((write ? p.seen_written : p.seen_read) + (a - p.lo), 1, n);
    if (!write && site_is_code(site) && g_prof_loads[t->linear] < 8) {
      ++g_prof_loads[t->linear];
      g_prof_plain[t->linear] += n;
      prof_inflight_peak(t->linear);
    }
  }
  // g++ splits a 16-byte vector access (float4, uint4) into narrower ones at consecutive sites,
  // which the GPU does in one instruction: a lane's access at another site that continues its
  // previous one within one aligned 16-byte block is merged into it (a fiber runs alone between
  // scheduling points, so its previous access is the log's last entry). The same site again is a
  // loop's next iteration: a separate instruction, as on the GPU.
  if (!g_prof_log.empty()) {
    ProfAccess& last = g_prof_log.back();
    if (last.lane == t->lane && last.warp == unsigned(t->warp) && last.epoch == g_prof_epoch[t->linear] &&
        last.site != site && last.tail != site &&
        last.write == write && last.arg == arg && last.addr + last.size == a && last.size + n <= 16 &&
        (a & ~15ull) == (last.addr & ~15ull)) {
      last.size = (unsigned char)(last.size + n);
      last.tail = site;
      return;
    }
  }
  g_prof_log.push_back(ProfAccess{site, site, a, unsigned(t->warp), g_prof_epoch[t->linear], prof_occurrence(t->linear, site),
                                  (unsigned char)t->lane, (unsigned char)n, (unsigned char)write, (signed char)arg});
}

static void prof_sched_point(SimThread* t) {
  ++g_prof_epoch[t->linear];
  g_prof_occ[t->linear].clear();
  g_prof_plain[t->linear] = 0;  // its loads have been used by now
  g_prof_loads[t->linear] = 0;
}

// Shared memory: 32 banks of 4 bytes; a phase of lanes costs the largest number of distinct words
// one bank is asked for (a word read by several lanes is a broadcast). Accesses of 8 bytes go in 2
// phases of 16 lanes, of 16 bytes in 4 phases of 8.
__attribute__((no_sanitize_thread)) static void prof_shared(const ProfAccess* a, size_t n) {
  unsigned size = a[0].size, lanes_per_phase = size <= 4 ? 32 : size == 8 ? 16 : 8;
  for (unsigned phase = 0; phase < 32 / lanes_per_phase; ++phase) {
    unsigned long long words[32][32];
    int count[32] = {0}, worst = 0;
    bool any = false;
    for (size_t i = 0; i < n; ++i) {
      if (a[i].lane / lanes_per_phase != phase) continue;
      any = true;
      for (unsigned long long w = a[i].addr >> 2; w <= (a[i].addr + a[i].size - 1) >> 2; ++w) {
        int bank = int(w & 31u), k = 0;
        while (k < count[bank] && words[bank][k] != w) ++k;
        if (k == count[bank] && k < 32) words[bank][count[bank]++] = w;
        if (count[bank] > worst) worst = count[bank];
      }
    }
    if (any) { g_prof->wavefronts += unsigned(worst); g_prof->ideal_wavefronts += 1; }
  }
}

// At the end of a block: group the log into warp-level instructions.
__attribute__((no_sanitize_thread)) static void prof_block_end() {
  if (!g_prof) return;
  unsigned long long cta = 0;
  for (int i = 0; i < g.nthreads; ++i) cta += g_prof_peak[i];
  g_prof->max_inflight_bytes_per_cta = std::max(g_prof->max_inflight_bytes_per_cta, cta);
  auto& log = g_prof_log;
  std::sort(log.begin(), log.end(), [](const ProfAccess& x, const ProfAccess& y) {
    if (x.warp != y.warp) return x.warp < y.warp;
    if (x.epoch != y.epoch) return x.epoch < y.epoch;
    if (x.site != y.site) return x.site < y.site;
    if (x.occ != y.occ) return x.occ < y.occ;
    if (x.write != y.write) return x.write < y.write;
    return x.arg < y.arg;
  });
  for (size_t i = 0; i < log.size();) {
    size_t j = i + 1;
    while (j < log.size() && log[j].warp == log[i].warp && log[j].epoch == log[i].epoch && log[j].site == log[i].site &&
           log[j].occ == log[i].occ && log[j].write == log[i].write && log[j].arg == log[i].arg)
      ++j;
    if (log[i].arg < 0) {
      prof_shared(&log[i], j - i);
    } else {
      std::vector<unsigned long long> sectors, bytes;
      for (size_t k = i; k < j; ++k) {
        for (unsigned long long s = log[k].addr >> 5; s <= (log[k].addr + log[k].size - 1) >> 5; ++s) sectors.push_back(s);
        for (unsigned b = 0; b < log[k].size; ++b) bytes.push_back(log[k].addr + b);
      }
      std::sort(sectors.begin(), sectors.end());
      std::sort(bytes.begin(), bytes.end());
      unsigned long long distinct = std::unique(sectors.begin(), sectors.end()) - sectors.begin();
      unsigned long long useful = std::unique(bytes.begin(), bytes.end()) - bytes.begin();
      ProfArg& p = g_prof->args[log[i].arg];
      (log[i].write ? p.sectors_written : p.sectors_read) += distinct;
      (log[i].write ? p.useful_written : p.useful_read) += useful;
    }
    i = j;
  }
  log.clear();
}

static void prof_block_start(int nthreads) {
  for (int i = 0; i < nthreads; ++i) {
    g_prof_epoch[i] = 0;
    g_prof_occ[i].clear();
    g_prof_plain[i] = g_prof_async[i] = g_prof_peak[i] = g_prof_open_group[i] = 0;
    g_prof_loads[i] = 0;
    g_prof_groups[i].clear();
  }
}

#define CUPAGED_SIM_TSAN(n)                                                                                  \
  extern "C" __attribute__((visibility("hidden"), no_sanitize_thread, noinline)) void __tsan_read##n(void* a) { \
    prof_record(reinterpret_cast<uintptr_t>(a), n, false, __builtin_return_address(0));                      \
  }                                                                                                          \
  extern "C" __attribute__((visibility("hidden"), no_sanitize_thread, noinline)) void __tsan_write##n(void* a) { \
    prof_record(reinterpret_cast<uintptr_t>(a), n, true, __builtin_return_address(0));                       \
  }                                                                                                          \
  extern "C" __attribute__((visibility("hidden"), no_sanitize_thread, noinline)) void __tsan_unaligned_read##n(void* a) { \
    prof_record(reinterpret_cast<uintptr_t>(a), n, false, __builtin_return_address(0));                      \
  }                                                                                                          \
  extern "C" __attribute__((visibility("hidden"), no_sanitize_thread, noinline)) void __tsan_unaligned_write##n(void* a) { \
    prof_record(reinterpret_cast<uintptr_t>(a), n, true, __builtin_return_address(0));                       \
  }
CUPAGED_SIM_TSAN(1)
CUPAGED_SIM_TSAN(2)
CUPAGED_SIM_TSAN(4)
CUPAGED_SIM_TSAN(8)
CUPAGED_SIM_TSAN(16)
#undef CUPAGED_SIM_TSAN
extern "C" __attribute__((visibility("hidden"), no_sanitize_thread, noinline)) void __tsan_read_range(void* a, size_t n) {
  prof_record(reinterpret_cast<uintptr_t>(a), unsigned(n), false, __builtin_return_address(0));
}
extern "C" __attribute__((visibility("hidden"), no_sanitize_thread, noinline)) void __tsan_write_range(void* a, size_t n) {
  prof_record(reinterpret_cast<uintptr_t>(a), unsigned(n), true, __builtin_return_address(0));
}
// Atomics (the C++ runtime's, e.g. guards of function-local statics): done, not counted.
#define CUPAGED_SIM_TSAN_FN(ret, name) extern "C" __attribute__((visibility("hidden"), no_sanitize_thread)) ret name
#define CUPAGED_SIM_TSAN_RMW(n, T, op, builtin)                                        \
  CUPAGED_SIM_TSAN_FN(T, __tsan_atomic##n##_##op)(volatile T * a, T v, int) {          \
    return __atomic_##builtin(a, v, __ATOMIC_SEQ_CST);                                 \
  }
#define CUPAGED_SIM_TSAN_CAS(n, T, kind)                                               \
  CUPAGED_SIM_TSAN_FN(int, __tsan_atomic##n##_compare_exchange_##kind)(volatile T * a, T * c, T v, int, int) { \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }
#define CUPAGED_SIM_TSAN_ATOMIC(n, T)                                                  \
  CUPAGED_SIM_TSAN_FN(T, __tsan_atomic##n##_load)(const volatile T* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); } \
  CUPAGED_SIM_TSAN_FN(void, __tsan_atomic##n##_store)(volatile T * a, T v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); } \
  CUPAGED_SIM_TSAN_RMW(n, T, exchange, exchange_n) CUPAGED_SIM_TSAN_RMW(n, T, fetch_add, fetch_add) \
  CUPAGED_SIM_TSAN_RMW(n, T, fetch_sub, fetch_sub) CUPAGED_SIM_TSAN_RMW(n, T, fetch_and, fetch_and) \
  CUPAGED_SIM_TSAN_RMW(n, T, fetch_or, fetch_or) CUPAGED_SIM_TSAN_RMW(n, T, fetch_xor, fetch_xor) \
  CUPAGED_SIM_TSAN_CAS(n, T, strong) CUPAGED_SIM_TSAN_CAS(n, T, weak)                 \
  CUPAGED_SIM_TSAN_FN(T, __tsan_atomic##n##_compare_exchange_val)(volatile T * a, T c, T v, int, int) { \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);  \
    return c;                                                                          \
  }
CUPAGED_SIM_TSAN_ATOMIC(8, unsigned char)
CUPAGED_SIM_TSAN_ATOMIC(16, unsigned short)
CUPAGED_SIM_TSAN_ATOMIC(32, unsigned)
CUPAGED_SIM_TSAN_ATOMIC(64, unsigned long long)
#undef CUPAGED_SIM_TSAN_ATOMIC
#undef CUPAGED_SIM_TSAN_CAS
#undef CUPAGED_SIM_TSAN_RMW
extern "C" __attribute__((visibility("hidden"))) void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
extern "C" __attribute__((visibility("hidden"))) void __tsan_atomic_signal_fence(int) {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_func_entry(void*) {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_func_exit() {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_init() {}
#define CUPAGED_SIM_PROF(...) __VA_ARGS__
#else
#define CUPAGED_SIM_PROF(...)
#endif
