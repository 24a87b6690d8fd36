// cupaged_sim_profile.h: the memory-traffic profiler of the sim (cupaged.sim.profile()).
//
// A profiled launch runs a second build of the module, compiled with -fsanitize=thread and
// -DCUPAGED_SIM_PROFILE: every load and store calls __tsan_{read,write}N(address) first, whose
// return address identifies the instruction site. No TSan runtime is linked: these entry points
// are the profiler's. The build also has -fsanitize-coverage=trace-pc: every basic block of the
// kernel's code calls __sanitizer_cov_trace_pc, counted per warp (the SASS instruction count,
// cupaged/sim/profiler/_instructions.py, weighs the cubin's basic blocks with these counts). Each
// access of a CUDA thread to a pointer argument's memory or to shared memory joins a warp-level
// instruction (one executed occurrence of one site by the lanes of a warp: the lanes' occurrence
// counts of that site since their last scheduling point); at the end of the block each
// instruction's lanes give its 32-byte sectors or its shared-memory wavefronts.
// Emulated PTX (cp.async, ldmatrix) is accounted by the emulation itself. Included inside
// namespace cupaged_sim.
#pragma once

struct ProfArg {  // mirrored by ctypes in cupaged/sim/profiler/_probe.py
  unsigned long long lo, hi;          // the argument's memory
  unsigned long long bytes_read, bytes_written, sectors_read, sectors_written;
  unsigned long long useful_read, useful_written;  // distinct bytes per warp-level instruction, summed
  unsigned long long* seen_read;      // bitmaps, one bit per byte of [lo, hi): touched by a read / write
  unsigned long long* seen_written;
};
struct ProfSite {  // mirrored by ctypes in cupaged/sim/profiler/_probe.py
  const void* site;  // a return address in the code, or 2^63 + line (emulated PTX); null: an empty slot
  unsigned long long wavefronts, ideal_wavefronts;
};
struct ProfBlock {  // mirrored by ctypes in cupaged/sim/profiler/_probe.py
  const void* pc;  // a basic block of the kernel's code (the return address of its coverage hook); null: empty
  unsigned long long count;  // its warp-level executions (see __sanitizer_cov_trace_pc)
};
struct ProfLaunch {  // mirrored by ctypes in cupaged/sim/profiler/_probe.py
  int nargs;
  ProfArg* args;
  unsigned long long wavefronts, ideal_wavefronts, cp_async_bytes, mma_flops, max_inflight_bytes_per_cta;
  unsigned block_stride[3];  // only the blocks whose index is a multiple of these run
  unsigned long long ctas_profiled;
  const ProfSite* sites;     // shared memory per instruction site: a hash table of site_capacity slots,
  unsigned long long site_capacity;  // the engine's until the next launch
  const ProfBlock* blocks;   // basic blocks executed: a hash table of block_capacity slots, the
  unsigned long long block_capacity;  // engine's until the next launch
  // Hopper: wgmma flops (16-bit inputs; 8-bit inputs) and bytes moved by cp.async.bulk (tensor or not)
  unsigned long long gmma_flops, gmma_fp8_flops, bulk_copy_bytes;
};

static ProfLaunch* g_prof;  // the profiled launch, or null

#if defined(CUPAGED_SIM_PROFILE)
#include <cstdlib>
// The profiler's own code is neither instrumented nor alignment-checked, and calls nothing that is:
// GCC does not inline an instrumented function into one that is not, so a std::vector or std::max
// here is a real call whose own accesses re-enter the hooks (that was most of a profiled launch).
#define PROF_FN __attribute__((no_sanitize_thread, no_sanitize("alignment"), no_sanitize_coverage))

template <class T>
struct ProfVec {  // a growable array of trivially copyable T
  T* data = nullptr;
  size_t size = 0, cap = 0;
  PROF_FN T& push() {
    if (size == cap) reserve(cap ? 2 * cap : 1024);
    return data[size++];
  }
  PROF_FN void reserve(size_t n) {
    if (n <= cap) return;
    data = static_cast<T*>(realloc(data, n * sizeof(T)));
    cap = n;
  }
};

PROF_FN static inline size_t prof_hash(unsigned long long x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  return size_t(x ^ x >> 29);
}

// Emulated instructions (cp.async, ldmatrix) log with their asm statement's line as the site, with
// the top bit set: no user-space address has it. (A low-bit tag failed: return addresses are often odd.)
static const uintptr_t kLineSite = uintptr_t(1) << 63;
PROF_FN static inline bool site_is_code(const void* site) { return !(reinterpret_cast<uintptr_t>(site) & kLineSite); }
PROF_FN static inline const void* prof_line_site(int line) { return reinterpret_cast<const void*>(kLineSite | unsigned(line)); }

struct ProfOcc {  // a site's occurrences in its thread's current epoch
  const void* site;
  unsigned epoch;  // the thread's epoch + 1 when written: an entry of an older epoch is a free slot
  unsigned count;
};
struct ProfThread {
  unsigned epoch;            // scheduling points passed in this block
  unsigned occ_used;         // entries of this epoch
  size_t occ_mask;           // capacity - 1
  ProfOcc* occ;
  // Bytes in flight (a documented approximation): a thread's plain global loads count from issue to
  // its next scheduling point (at most 8 loads), its cp.async groups from commit until a wait covers
  // them. The threads of a CTA run concurrently on a GPU, one after another on the sim: a CTA's
  // figure is the sum of its threads' peaks, which does not depend on the sim's scheduling order.
  unsigned long long plain, async, peak, open_group;
  unsigned loads;
  ProfVec<unsigned long long> groups;  // committed groups' bytes, oldest first from groups_head
  size_t groups_head;
};
static ProfThread g_pt[kMaxThreads];

// One lane's access. A warp's accesses are logged until its instructions are complete (every lane
// that has not exited has passed a scheduling point since), then grouped by a counting sort: the
// log stays small, and so do the tables it is grouped with.
struct ProfEntry {
  unsigned long long addr;
  unsigned inst;
  unsigned size_lane;  // size << 5 | lane
};
struct ProfInst {  // a warp-level instruction
  const void* site;
  unsigned epoch, occ;
  unsigned char write;
  signed char arg;  // -1: shared memory
  unsigned slot;    // its slot in the warp's hash table
  unsigned count, start;  // its entries: count, then their offset in the grouped log
};
struct ProfWarp {
  ProfVec<ProfEntry> log;
  ProfVec<ProfInst> insts;
  unsigned* slots;  // hash table of insts: index + 1, 0 empty
  size_t mask;
  unsigned last_epoch;  // the latest epoch in the log (lanes run ahead past cp.async waits)
};
static ProfWarp g_pw[kMaxThreads / 32];
static ProfVec<ProfEntry> g_grouped;
// The last access logged, which the next access of the same thread may continue (see prof_log).
static struct { int thread; unsigned epoch; const void* site; const void* tail; bool write; int arg; bool inflight; } g_last;
static ProfSite* g_sites;  // shared memory per site, for the launch
static size_t g_site_mask, g_site_used;
struct ProfRange { unsigned long long lo, hi; int arg; };
static ProfVec<ProfRange> g_ranges;  // the arguments' non-empty ranges, sorted by lo
static bool g_ranges_disjoint = true;
static unsigned long long g_args_lo, g_args_span;  // the hull of the ranges: a quick test for the stack

// Basic blocks. A warp executes a block once for all its active lanes: between two scheduling
// points (an epoch) its executions of a block are the most any of its lanes made, as a memory
// instruction above; a block's count for the launch is that summed over the warps and epochs.
struct ProfBlockEpoch {  // per warp: the most executions of a block by one lane in one epoch
  const void* pc;  // null: an empty slot
  unsigned epoch, most;
};
struct ProfWarpBlocks {
  ProfBlockEpoch* slots;
  size_t mask, used;
};
static ProfWarpBlocks g_wb[kMaxThreads / 32];
static ProfBlock* g_blocks;  // the launch's blocks
static size_t g_block_mask, g_block_used;

PROF_FN static void prof_blocks_grow() {
  ProfBlock* old = g_blocks;
  size_t old_mask = g_block_mask;
  g_block_mask = old ? 2 * old_mask + 1 : 1023;
  g_blocks = static_cast<ProfBlock*>(calloc(g_block_mask + 1, sizeof(ProfBlock)));
  for (size_t i = 0; old && i <= old_mask; ++i) {
    if (!old[i].pc) continue;
    size_t h = prof_hash(reinterpret_cast<uintptr_t>(old[i].pc)) & g_block_mask;
    while (g_blocks[h].pc) h = (h + 1) & g_block_mask;
    g_blocks[h] = old[i];
  }
  free(old);
  g_prof->blocks = g_blocks;
  g_prof->block_capacity = g_block_mask + 1;
}

PROF_FN static void prof_block_count(const void* pc) {
  if (2 * (g_block_used + 1) > g_block_mask + 1) prof_blocks_grow();
  size_t h = prof_hash(reinterpret_cast<uintptr_t>(pc)) & g_block_mask;
  while (g_blocks[h].pc && g_blocks[h].pc != pc) h = (h + 1) & g_block_mask;
  if (!g_blocks[h].pc) {
    g_blocks[h].pc = pc;
    ++g_block_used;
  }
  ++g_blocks[h].count;
}

PROF_FN static inline size_t prof_epoch_hash(const void* pc, unsigned epoch) {
  return prof_hash(reinterpret_cast<uintptr_t>(pc) ^ prof_hash(epoch + 1ull));
}
PROF_FN static void prof_warp_blocks_grow(ProfWarpBlocks& w) {
  ProfBlockEpoch* old = w.slots;
  size_t old_mask = w.mask;
  w.mask = old ? 2 * old_mask + 1 : 1023;
  w.slots = static_cast<ProfBlockEpoch*>(calloc(w.mask + 1, sizeof(ProfBlockEpoch)));
  for (size_t i = 0; old && i <= old_mask; ++i) {
    if (!old[i].pc) continue;
    size_t h = prof_epoch_hash(old[i].pc, old[i].epoch) & w.mask;
    while (w.slots[h].pc) h = (h + 1) & w.mask;
    w.slots[h] = old[i];
  }
  free(old);
}

// A lane's `occ`-th execution (1-based) of the block at pc in its epoch: a new warp-level execution
// when no other lane of its warp has made that many there.
PROF_FN static void prof_block_exec(ProfWarpBlocks& w, const void* pc, unsigned epoch, unsigned occ) {
  if (2 * (w.used + 1) > w.mask + 1) prof_warp_blocks_grow(w);
  size_t h = prof_epoch_hash(pc, epoch) & w.mask;
  for (;; h = (h + 1) & w.mask) {
    ProfBlockEpoch& e = w.slots[h];
    if (!e.pc) {
      e = ProfBlockEpoch{pc, epoch, 0};
      ++w.used;
    } else if (e.pc != pc || e.epoch != epoch) {
      continue;
    }
    if (occ > e.most) {
      e.most = occ;
      prof_block_count(pc);
    }
    return;
  }
}

PROF_FN static void prof_launch_start() {
  if (!g_prof) return;
  g_ranges.size = 0;
  for (int i = 0; i < g_prof->nargs; ++i)
    if (g_prof->args[i].lo < g_prof->args[i].hi) g_ranges.push() = ProfRange{g_prof->args[i].lo, g_prof->args[i].hi, i};
  for (size_t i = 1; i < g_ranges.size; ++i)  // insertion sort: a handful of arguments
    for (size_t j = i; j > 0 && g_ranges.data[j - 1].lo > g_ranges.data[j].lo; --j) {
      ProfRange r = g_ranges.data[j];
      g_ranges.data[j] = g_ranges.data[j - 1];
      g_ranges.data[j - 1] = r;
    }
  g_ranges_disjoint = true;
  for (size_t i = 1; i < g_ranges.size; ++i) g_ranges_disjoint &= g_ranges.data[i - 1].hi <= g_ranges.data[i].lo;
  unsigned long long hi = 0;
  g_args_lo = g_ranges.size ? g_ranges.data[0].lo : 0;
  for (size_t i = 0; i < g_ranges.size; ++i) hi = g_ranges.data[i].hi > hi ? g_ranges.data[i].hi : hi;
  g_args_span = hi - g_args_lo;
  if (!g_sites) {
    g_site_mask = 255;
    g_sites = static_cast<ProfSite*>(calloc(g_site_mask + 1, sizeof(ProfSite)));
  }
  memset(g_sites, 0, (g_site_mask + 1) * sizeof(ProfSite));
  g_site_used = 0;
  g_prof->sites = g_sites;
  g_prof->site_capacity = g_site_mask + 1;
  if (!g_blocks) prof_blocks_grow();
  memset(g_blocks, 0, (g_block_mask + 1) * sizeof(ProfBlock));
  g_block_used = 0;
  g_prof->blocks = g_blocks;
  g_prof->block_capacity = g_block_mask + 1;
}

// The first argument (in parameter order) whose memory holds [a, a + n), or -2. Reads only the
// engine's copy of the ranges: the launch's record belongs to Python.
PROF_FN static int prof_find_arg(uintptr_t a, unsigned n) {
  if (!g_ranges_disjoint) {
    int first = -2;
    for (size_t i = 0; i < g_ranges.size; ++i) {
      const ProfRange& r = g_ranges.data[i];
      if (a >= r.lo && a + n <= r.hi && (first < 0 || r.arg < first)) first = r.arg;
    }
    return first;
  }
  size_t lo = 0, hi = g_ranges.size;  // the last range starting at or before a
  while (hi - lo > 1) {
    size_t mid = (lo + hi) / 2;
    if (g_ranges.data[mid].lo <= a) lo = mid; else hi = mid;
  }
  const ProfRange& r = g_ranges.data[lo];
  return a >= r.lo && a + n <= r.hi ? r.arg : -2;
}

PROF_FN static void prof_inflight_peak(ProfThread& t) {
  if (t.plain + t.async > t.peak) t.peak = t.plain + t.async;
}
PROF_FN static void prof_async_issue(unsigned bytes) { g_pt[g.cur->linear].open_group += bytes; }
PROF_FN static void prof_async_commit() {
  ProfThread& t = g_pt[g.cur->linear];
  t.groups.push() = t.open_group;
  t.async += t.open_group;
  t.open_group = 0;
  prof_inflight_peak(t);
}
PROF_FN static void prof_async_wait(unsigned long long pending) {
  ProfThread& t = g_pt[g.cur->linear];
  while (t.groups.size - t.groups_head > pending) t.async -= t.groups.data[t.groups_head++];
  if (t.groups_head == t.groups.size) t.groups.size = t.groups_head = 0;
}

PROF_FN static void prof_occ_grow(ProfThread& t) {
  size_t old_mask = t.occ_mask;
  ProfOcc* old = t.occ;
  t.occ_mask = old ? 2 * old_mask + 1 : 63;
  t.occ = static_cast<ProfOcc*>(calloc(t.occ_mask + 1, sizeof(ProfOcc)));
  for (size_t i = 0; old && i <= old_mask; ++i) {
    if (old[i].epoch != t.epoch + 1) continue;
    size_t h = prof_hash(reinterpret_cast<uintptr_t>(old[i].site)) & t.occ_mask;
    while (t.occ[h].epoch == t.epoch + 1) h = (h + 1) & t.occ_mask;
    t.occ[h] = old[i];
  }
  free(old);
}

// Occurrences of `site` in thread t since its last scheduling point, before this one.
PROF_FN static unsigned prof_occurrence(ProfThread& t, const void* site) {
  if (2 * (t.occ_used + 1) > t.occ_mask + 1) prof_occ_grow(t);
  size_t h = prof_hash(reinterpret_cast<uintptr_t>(site)) & t.occ_mask;
  for (;; h = (h + 1) & t.occ_mask) {
    ProfOcc& e = t.occ[h];
    if (e.epoch != t.epoch + 1) {
      e = ProfOcc{site, t.epoch + 1, 1};
      ++t.occ_used;
      return 0;
    }
    if (e.site == site) return e.count++;
  }
}

PROF_FN static inline size_t prof_inst_hash(const void* site, unsigned epoch, unsigned occ, bool write, int arg) {
  return prof_hash(reinterpret_cast<uintptr_t>(site) ^ prof_hash((unsigned long long)epoch << 32 ^ occ) ^
                   (unsigned long long)write << 8 ^ (unsigned char)arg);
}
PROF_FN static void prof_inst_rehash(ProfWarp& w, size_t capacity) {
  free(w.slots);
  w.mask = capacity - 1;
  w.slots = static_cast<unsigned*>(calloc(capacity, sizeof(unsigned)));
  for (size_t i = 0; i < w.insts.size; ++i) {
    ProfInst& x = w.insts.data[i];
    size_t h = prof_inst_hash(x.site, x.epoch, x.occ, x.write, x.arg) & w.mask;
    while (w.slots[h]) h = (h + 1) & w.mask;
    w.slots[h] = unsigned(i + 1);
    x.slot = unsigned(h);
  }
}
// The warp's instruction of this key, added if new. (Scalars, not a key struct: its byte fields
// read back as one word stalled store forwarding, a fifth of a profiled launch.)
PROF_FN static unsigned prof_instruction(ProfWarp& w, const void* site, unsigned epoch, unsigned occ, bool write, int arg) {
  if (2 * (w.insts.size + 1) > w.mask + 1) prof_inst_rehash(w, w.slots ? 2 * (w.mask + 1) : 1024);
  size_t h = prof_inst_hash(site, epoch, occ, write, arg) & w.mask;
  for (;; h = (h + 1) & w.mask) {
    unsigned k = w.slots[h];
    if (!k) break;
    const ProfInst& x = w.insts.data[k - 1];
    if (x.site == site && x.occ == occ && x.epoch == epoch && x.write == write && x.arg == arg) return k - 1;
  }
  w.insts.push() = ProfInst{site, epoch, occ, (unsigned char)write, (signed char)arg, unsigned(h), 0, 0};
  w.slots[h] = unsigned(w.insts.size);
  return unsigned(w.insts.size - 1);
}

PROF_FN static void prof_mark(unsigned long long* bits, unsigned long long offset, unsigned long long n) {
  while (n) {
    unsigned b = unsigned(offset & 63);
    unsigned long long k = 64 - b < n ? 64 - b : n;
    bits[offset >> 6] |= (k == 64 ? ~0ull : ((1ull << k) - 1) << b);
    offset += k;
    n -= k;
  }
}

__attribute__((noinline)) PROF_FN static void prof_log(uintptr_t a, unsigned n, bool write, const void* site, int arg) {
  SimThread* t = g.cur;
  if (!t) return;  // the engine itself, between fibers
  ProfThread& pt = g_pt[t->linear];
  if (arg >= 0) {
    ProfArg& p = g_prof->args[arg];
    (write ? p.bytes_written : p.bytes_read) += n;
    prof_mark(write ? p.seen_written : p.seen_read, a - p.lo, n);
  }
  // A load is in flight from its issue: one per instruction (the pieces g++ split a vector load
  // into, merged below, are one load), at most 8 per thread.
  const bool inflight = arg >= 0 && !write && site_is_code(site);
  // g++ splits a 16-byte vector access (float4, uint4) into narrower ones at consecutive sites,
  // which the GPU does in one instruction: a lane's access at another site that continues its
  // previous one within one aligned 16-byte block is merged into it (a fiber runs alone between
  // scheduling points, so its previous access is the last one logged). The same site again is a
  // loop's next iteration: a separate instruction, as on the GPU.
  ProfWarp& w = g_pw[t->warp];
  if (g_last.thread == t->linear && g_last.epoch == pt.epoch && g_last.site != site && g_last.tail != site &&
      g_last.write == write && g_last.arg == arg) {
    ProfEntry& last = w.log.data[w.log.size - 1];
    unsigned size = last.size_lane >> 5;
    if (last.addr + size == a && size + n <= 16 && (a & ~15ull) == (last.addr & ~15ull)) {
      last.size_lane += n << 5;
      g_last.tail = site;
      if (inflight && g_last.inflight) {
        pt.plain += n;
        prof_inflight_peak(pt);
      }
      return;
    }
  }
  const bool counted = inflight && pt.loads < 8;
  if (counted) {
    ++pt.loads;
    pt.plain += n;
    prof_inflight_peak(pt);
  }
  unsigned inst = prof_instruction(w, site, pt.epoch, prof_occurrence(pt, site), write, arg);
  ++w.insts.data[inst].count;
  w.log.push() = ProfEntry{a, inst, n << 5 | unsigned(t->lane)};
  if (pt.epoch > w.last_epoch) w.last_epoch = pt.epoch;
  g_last = {t->linear, pt.epoch, site, site, write, arg, counted};
}

__attribute__((noinline)) PROF_FN static void prof_log_global(uintptr_t a, unsigned n, bool write, const void* site) {
  int arg = prof_find_arg(a, n);
  if (arg >= 0) prof_log(a, n, write, site, arg);
}

// Every instrumented access: shared memory and the arguments are logged, the rest (the stack, the
// sim's own state) leaves after two comparisons.
PROF_FN static inline __attribute__((always_inline)) void prof_record(uintptr_t a, unsigned n, bool write, const void* site) {
  if (a - reinterpret_cast<uintptr_t>(g.smem_base) < g.smem_size) prof_log(a, n, write, site, -1);
  else if (a - g_args_lo < g_args_span) prof_log_global(a, n, write, site);
}

PROF_FN static void prof_wavefronts(const void* site, unsigned long long wavefronts) {
  g_prof->wavefronts += wavefronts;
  g_prof->ideal_wavefronts += 1;
  if (2 * (g_site_used + 1) > g_site_mask + 1) {
    ProfSite* old = g_sites;
    size_t old_mask = g_site_mask;
    g_site_mask = 2 * g_site_mask + 1;
    g_sites = static_cast<ProfSite*>(calloc(g_site_mask + 1, sizeof(ProfSite)));
    for (size_t i = 0; i <= old_mask; ++i) {
      if (!old[i].site) continue;
      size_t h = prof_hash(reinterpret_cast<uintptr_t>(old[i].site)) & g_site_mask;
      while (g_sites[h].site) h = (h + 1) & g_site_mask;
      g_sites[h] = old[i];
    }
    free(old);
    g_prof->sites = g_sites;
    g_prof->site_capacity = g_site_mask + 1;
  }
  size_t h = prof_hash(reinterpret_cast<uintptr_t>(site)) & g_site_mask;
  while (g_sites[h].site && g_sites[h].site != site) h = (h + 1) & g_site_mask;
  if (!g_sites[h].site) {
    g_sites[h].site = site;
    ++g_site_used;
  }
  g_sites[h].wavefronts += wavefronts;
  g_sites[h].ideal_wavefronts += 1;
}

// Shared memory: 32 banks of 4 bytes; a phase of lanes costs the largest number of distinct words
// one bank is asked for (a word read by several lanes is a broadcast). Accesses of 8 bytes go in 2
// phases of 16 lanes, of 16 bytes in 4 phases of 8 (the widest lane's access decides).
PROF_FN static void prof_shared(const ProfInst& inst, const ProfEntry* a, size_t n) {
  unsigned size = 0;
  for (size_t i = 0; i < n; ++i) size = (a[i].size_lane >> 5) > size ? (a[i].size_lane >> 5) : size;
  unsigned lanes_per_phase = size <= 4 ? 32 : size == 8 ? 16 : 8;
  unsigned phases = 32 / lanes_per_phase;
  // per phase and bank: the distinct words asked for (not pattern-filled: 32 KiB per instruction)
  __attribute__((uninitialized)) unsigned long long words[4][32][32];
  __attribute__((uninitialized)) int count[4][32];
  int worst[4] = {};
  bool any[4] = {};
  for (unsigned p = 0; p < phases; ++p)
    for (int b = 0; b < 32; ++b) count[p][b] = 0;
  for (size_t i = 0; i < n; ++i) {
    unsigned phase = (a[i].size_lane & 31u) / lanes_per_phase;
    any[phase] = true;
    unsigned long long end = a[i].addr + (a[i].size_lane >> 5) - 1;
    for (unsigned long long w = a[i].addr >> 2; w <= end >> 2; ++w) {
      int bank = int(w & 31u), k = 0, &c = count[phase][bank];
      while (k < c && words[phase][bank][k] != w) ++k;
      if (k == c && k < 32) words[phase][bank][c++] = w;
      if (c > worst[phase]) worst[phase] = c;
    }
  }
  for (unsigned phase = 0; phase < phases; ++phase)
    if (any[phase]) prof_wavefronts(inst.site, unsigned(worst[phase]));
}

// A global instruction: the distinct 32-byte sectors and bytes its lanes touch.
PROF_FN static void prof_global(const ProfInst& inst, ProfEntry* a, size_t n) {
  for (size_t i = 1; i < n; ++i)  // insertion sort by address: at most 32 lanes, mostly in order
    for (size_t j = i; j > 0 && a[j - 1].addr > a[j].addr; --j) {
      ProfEntry e = a[j];
      a[j] = a[j - 1];
      a[j - 1] = e;
    }
  unsigned long long sectors = 0, useful = 0, covered = 0, next_sector = 0;  // bytes and sectors below these are counted
  for (size_t i = 0; i < n; ++i) {
    unsigned long long lo = a[i].addr, hi = lo + (a[i].size_lane >> 5);
    if (hi > covered) useful += hi - (lo > covered ? lo : covered), covered = hi;
    unsigned long long s0 = lo >> 5, s1 = ((hi - 1) >> 5) + 1;
    if (s1 > next_sector) sectors += s1 - (s0 > next_sector ? s0 : next_sector), next_sector = s1;
  }
  ProfArg& p = g_prof->args[inst.arg];
  (inst.write ? p.sectors_written : p.sectors_read) += sectors;
  (inst.write ? p.useful_written : p.useful_read) += useful;
}

// Cost a warp's logged instructions (grouped by a counting sort) and start its log afresh.
PROF_FN static void prof_flush(ProfWarp& w) {
  unsigned start = 0;
  for (size_t i = 0; i < w.insts.size; ++i) {
    ProfInst& x = w.insts.data[i];
    x.start = start;
    start += x.count;
    x.count = 0;
    w.slots[x.slot] = 0;
  }
  g_grouped.reserve(w.log.size);
  for (size_t i = 0; i < w.log.size; ++i) {
    ProfInst& x = w.insts.data[w.log.data[i].inst];
    g_grouped.data[x.start + x.count++] = w.log.data[i];
  }
  for (size_t i = 0; i < w.insts.size; ++i) {
    const ProfInst& x = w.insts.data[i];
    if (x.arg < 0) prof_shared(x, g_grouped.data + x.start, x.count);
    else prof_global(x, g_grouped.data + x.start, x.count);
  }
  w.log.size = w.insts.size = 0;
  w.last_epoch = 0;
  g_last.thread = -1;
}

// A scheduling point of thread t: its next accesses are new instructions. When every lane of its
// warp that has not exited is past the log's latest epoch, the warp's instructions are complete.
PROF_FN static void prof_sched_point(SimThread* t) {
  ProfThread& pt = g_pt[t->linear];
  ++pt.epoch;
  pt.occ_used = 0;
  pt.plain = 0;  // its loads have been used by now
  pt.loads = 0;
  ProfWarp& w = g_pw[t->warp];
  if (!w.log.size || pt.epoch <= w.last_epoch) return;
  for (int l = t->warp * 32; l < t->warp * 32 + 32 && l < g.nthreads; ++l)
    if (g.threads[l].state != DONE && g_pt[l].epoch <= w.last_epoch) return;
  prof_flush(w);
}

// At the end of a block: the rest of every warp's log.
PROF_FN static void prof_block_end() {
  if (!g_prof) return;
  unsigned long long cta = 0;
  for (int i = 0; i < g.nthreads; ++i) cta += g_pt[i].peak;
  if (cta > g_prof->max_inflight_bytes_per_cta) g_prof->max_inflight_bytes_per_cta = cta;
  for (int i = 0; i < g.nwarps; ++i) prof_flush(g_pw[i]);
}

PROF_FN static void prof_block_start(int nthreads) {
  ++g_prof->ctas_profiled;
  for (int i = 0; i < (nthreads + 31) / 32; ++i) {
    ProfWarpBlocks& w = g_wb[i];
    if (w.used) memset(w.slots, 0, (w.mask + 1) * sizeof(ProfBlockEpoch));
    w.used = 0;
  }
  for (int i = 0; i < nthreads; ++i) {
    ProfThread& t = g_pt[i];
    t.epoch = t.occ_used = 0;
    if (t.occ) memset(t.occ, 0, (t.occ_mask + 1) * sizeof(ProfOcc));
    t.plain = t.async = t.peak = t.open_group = 0;
    t.loads = 0;
    t.groups.size = t.groups_head = 0;
  }
  g_last.thread = -1;
}

// The end of a launch, on every path (errors included): nothing may refer to the launch's record,
// which Python frees when the call returns, and the hooks that run before the next launch sets
// its own ranges (the engine's code is instrumented too) must find none. A warp's log left by an
// aborted block is dropped with its hash slots, which would otherwise name instructions past the
// log's end.
PROF_FN static void prof_launch_end() {
  g_prof = nullptr;
  g_ranges.size = 0;
  g_ranges_disjoint = true;
  g_args_lo = g_args_span = 0;
  for (ProfWarp& w : g_pw) {
    for (size_t i = 0; i < w.insts.size; ++i) w.slots[w.insts.data[i].slot] = 0;
    w.log.size = w.insts.size = 0;
    w.last_epoch = 0;
  }
  g_last.thread = -1;
}

// Whether block b (in the grid's linear order) runs: its index is a multiple of block_stride.
PROF_FN static bool prof_sampled(unsigned long long b, const unsigned* grid) {
  if (!g_prof) return true;
  const unsigned* s = g_prof->block_stride;
  return b % grid[0] % s[0] == 0 && b / grid[0] % grid[1] % s[1] == 0 &&
         b / ((unsigned long long)grid[0] * grid[1]) % s[2] == 0;
}

#define CUPAGED_SIM_TSAN(n)                                                                                  \
  extern "C" __attribute__((visibility("hidden"), noinline)) PROF_FN void __tsan_read##n(void* a) {          \
    prof_record(reinterpret_cast<uintptr_t>(a), n, false, __builtin_return_address(0));                      \
  }                                                                                                          \
  extern "C" __attribute__((visibility("hidden"), noinline)) PROF_FN void __tsan_write##n(void* a) {         \
    prof_record(reinterpret_cast<uintptr_t>(a), n, true, __builtin_return_address(0));                       \
  }                                                                                                          \
  extern "C" __attribute__((visibility("hidden"), noinline)) PROF_FN void __tsan_unaligned_read##n(void* a) { \
    prof_record(reinterpret_cast<uintptr_t>(a), n, false, __builtin_return_address(0));                      \
  }                                                                                                          \
  extern "C" __attribute__((visibility("hidden"), noinline)) PROF_FN void __tsan_unaligned_write##n(void* a) { \
    prof_record(reinterpret_cast<uintptr_t>(a), n, true, __builtin_return_address(0));                       \
  }
CUPAGED_SIM_TSAN(1)
CUPAGED_SIM_TSAN(2)
CUPAGED_SIM_TSAN(4)
CUPAGED_SIM_TSAN(8)
CUPAGED_SIM_TSAN(16)
#undef CUPAGED_SIM_TSAN
// -fsanitize-coverage=trace-pc: called at the start of every basic block of the instrumented code
// (the engine's and the profiler's own are not); blocks run by a CUDA thread are counted.
extern "C" __attribute__((visibility("hidden"), noinline)) PROF_FN void __sanitizer_cov_trace_pc() {
  SimThread* t = g.cur;
  if (!t || !g_prof) return;
  const void* pc = __builtin_return_address(0);
  ProfThread& pt = g_pt[t->linear];
  prof_block_exec(g_wb[t->warp], pc, pt.epoch, prof_occurrence(pt, pc) + 1);
}
extern "C" __attribute__((visibility("hidden"), noinline)) PROF_FN void __tsan_read_range(void* a, size_t n) {
  prof_record(reinterpret_cast<uintptr_t>(a), unsigned(n), false, __builtin_return_address(0));
}
extern "C" __attribute__((visibility("hidden"), noinline)) PROF_FN void __tsan_write_range(void* a, size_t n) {
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
extern "C" __attribute__((visibility("hidden"))) void __tsan_init() {}
#define CUPAGED_SIM_PROF(...) __VA_ARGS__
#else
#define CUPAGED_SIM_PROF(...)
#endif
