// cupaged_sim_hopper.h: Hopper's copy and synchronisation instructions on the sim (sm_90a):
// mbarrier.*, cp.async.bulk (global <-> shared), cp.async.bulk.tensor (tile mode, 1D-5D, through a
// tensor map), cp.async.mbarrier.arrive, elect.sync and setmaxnreg. The state they share (mbarriers,
// named barriers, warpgroups, the async proxy's view of shared memory) is cupaged_sim_async.h's.
//
// Bulk and tensor copies into shared memory read their source when issued (bounds-checked then) and
// complete (land, and signal complete_tx on their mbarrier) once the phase's arrivals are in and a thread
// waits on that mbarrier -- the latest moment a GPU may complete them; until then the destination holds
// poison, as a racing read sees.
// Copies out of shared memory are checked when issued and run -- read shared memory through the async
// proxy, write global memory -- when `cp.async.bulk.wait_group(.read)` covers their bulk group or their
// thread exits: the latest moment, so a stage overwritten before the wait is what gets written.
//
// Tensor maps are the sim's own 128-byte encoding written by cupaged.make_tensor_map (the fields of
// cuTensorMapEncodeTiled; see cupaged/_tensor_map.py). A tile load of a box at coordinates c reads, for
// each dimension d, ceil(box[d] / element_strides[d]) elements at c[d] + j * element_strides[d] (the
// innermost dimension's stride is ignored, as the driver documents: it reads box[0] elements);
// coordinates outside the tensor read zeros; the box is written densely (innermost dimension first)
// and, with a swizzle of 2^B 16-byte chunks (B = 1, 2, 3 for 32B, 64B, 128B), each chunk address's
// bits [4, 4+B) are XOR-ed with its bits [7, 7+B), as the wgmma descriptors' canonical layouts expect.
#pragma once

namespace cupaged_sim {
namespace ptx {

// ---- mbarrier
inline unsigned long long mbar_addr(unsigned long long a, int line, const char* op) {
  shared_ptr(a, 8, 8, line, op);  // an 8-byte object inside the block's shared memory
  return a;
}
inline void mbarrier_init(unsigned long long a, unsigned long long count, int line) {
  mbar_init(mbar_addr(a, line, "mbarrier.init"), (long long)count, line);
}
inline unsigned long long mbarrier_arrive(unsigned long long a, long long count, long long tx, bool drop, int line,
                                          const char* op) {
  if (count < 1 || count > (1 << 20) - 1) fail(E_SYNC, line, "%s: count %lld is outside 1..2^20-1", op, count);
  return mbar_arrive(mbar_addr(a, line, op), count, tx, drop, line, op);
}
inline void mbarrier_tx(unsigned long long a, long long delta, int line, const char* op) {
  mbar_tx(mbar_addr(a, line, op), delta, line, op);
}
inline bool mbarrier_wait(unsigned long long a, bool parity, unsigned long long v, bool blocking, int line, const char* op) {
  return mbar_wait(mbar_addr(a, line, op), parity, v, blocking, line, op);
}
inline void mbarrier_inval(unsigned long long a, int line) { mbar_inval(mbar_addr(a, line, "mbarrier.inval"), line); }

// cp.async.mbarrier.arrive{.noinc}: the arrival fires when the thread's earlier cp.async copies are
// done; on the sim they land now (any moment after their issue is one a GPU may choose) and the
// arrival follows. Without .noinc the pending count is raised by one first, so the phase does not
// count the arrival.
inline void cp_async_mbarrier_arrive(unsigned long long a, bool noinc, int line) {
  AsyncQueue& q = g_async[g.cur->linear];
  for (; q.head < q.size; ++q.head) memcpy(q.data[q.head].dst, q.data[q.head].data, size_t(q.data[q.head].size));
  if (noinc) mbar_arrive(mbar_addr(a, line, "cp.async.mbarrier.arrive"), 1, 0, false, line, "cp.async.mbarrier.arrive");
  else mbar_find(mbar_addr(a, line, "cp.async.mbarrier.arrive"), line, "cp.async.mbarrier.arrive");
}

// ---- bulk copies
// The profiler's build checks no access (it has no table of the launch's arrays): see docs/sim.md.
#if defined(CUPAGED_SIM_PROFILE)
#define CUPAGED_SIM_UNPROF(...)
#else
#define CUPAGED_SIM_UNPROF(...) __VA_ARGS__
#endif
inline void bulk_count(size_t bytes) { CUPAGED_SIM_PROF(if (g_prof) g_prof->bulk_copy_bytes += bytes); }

CUPAGED_SIM_ASYNC_FN inline void bulk_read_global(unsigned char* to, unsigned long long src, size_t n) {
  CUPAGED_SIM_UNPROF(cupaged_sim_check_slow(uintptr_t(src), n, 0));  // a read past an array is reported, naming it
  memcpy(to, reinterpret_cast<const void*>(uintptr_t(src)), n);
  CUPAGED_SIM_PROF(if (g_prof) prof_record(uintptr_t(src), unsigned(n), false, prof_line_site(g.cur->line)));
}
CUPAGED_SIM_ASYNC_FN inline void bulk_write_global(unsigned long long dst, const unsigned char* from, size_t n) {
  CUPAGED_SIM_UNPROF(cupaged_sim_check_slow(uintptr_t(dst), n, 1));  // only into the launch's arrays
  memcpy(reinterpret_cast<void*>(uintptr_t(dst)), from, n);
  CUPAGED_SIM_PROF(if (g_prof) prof_record(uintptr_t(dst), unsigned(n), true, prof_line_site(g.cur->line)));
}

// A copy into shared [dst, +size) whose bytes (read at issue) complete on the mbarrier at shared mbar.
inline void copy_in_flight(unsigned long long dst, size_t size, unsigned char* data, unsigned long long mbar, int line,
                           const char* op) {
  int i = mbar_find(mbar_addr(mbar, line, op), line, op);
  bulk_count(size);
  proxy_write(dst, nullptr, size);  // poison until the copy completes
  land_later(dst, size, data, i);
}

// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], size, [mbar]
inline void bulk_load(unsigned long long dst, unsigned long long src, unsigned long long size, unsigned long long mbar,
                      int line, const char* op) {
  g.cur->line = line;
  if (size == 0 || size % 16) fail(E_MEMORY, line, "%s: size %llu is not a positive multiple of 16", op, size);
  if (src % 16) fail(E_MEMORY, line, "%s: global source 0x%llx is not 16-byte aligned", op, src);
  shared_ptr(dst, unsigned(size), 16, line, op);
  auto* data = static_cast<unsigned char*>(malloc(size));
  bulk_read_global(data, src, size);
  copy_in_flight(dst, size, data, mbar, line, op);
}

// cp.async.bulk.global.shared::cta.bulk_group [dst], [src], size: checked now, run at its wait
inline void bulk_store(unsigned long long dst, unsigned long long src, unsigned long long size, int line, const char* op) {
  if (size == 0 || size % 16) fail(E_MEMORY, line, "%s: size %llu is not a positive multiple of 16", op, size);
  if (dst % 16) fail(E_MEMORY, line, "%s: global destination 0x%llx is not 16-byte aligned", op, dst);
  shared_ptr(src, unsigned(size), 16, line, op);
  BulkStore s{};
  s.dst = dst; s.src = src; s.size = size; s.line = line;
  bulk_store_push(s);
}
inline void bulk_commit() { ++g_stores[g.cur->linear].committed; }
inline void bulk_wait(unsigned long long pending) { bulk_stores_wait(g.cur->linear, pending); }

// ---- tensor maps (the layout cupaged/_tensor_map.py writes)
struct TensorMap {
  unsigned magic, rank;
  unsigned long long addr, dims[5], strides[4];
  unsigned box[5];
  unsigned char estride[5], esize, swizzle, oob, dtype, pad[11];
};
static_assert(sizeof(TensorMap) == 128, "the sim's tensor map image is 128 bytes");
static const unsigned kTensorMapMagic = 0x4D545043u;

inline TensorMap tensor_map(unsigned long long p, int rank, int line, const char* op) {
  TensorMap m;
  if (p % 64) fail(E_MEMORY, line, "%s: the tensor map's address 0x%llx is not 64-byte aligned", op, p);
  memcpy(&m, reinterpret_cast<const void*>(uintptr_t(p)), sizeof m);
  if (m.magic != kTensorMapMagic)
    fail(E_MEMORY, line, "%s: the operand is not a tensor map made by cupaged.make_tensor_map for the sim", op);
  if (int(m.rank) != rank) fail(E_MEMORY, line, "%s: a %dD copy through a tensor map of rank %u", op, rank, m.rank);
  return m;
}

inline unsigned long long swizzled(unsigned long long a, int mode) {  // mode: 0 none, 1 32B, 2 64B, 3 128B
  return mode ? a ^ (((a >> 7) & ((1u << mode) - 1u)) << 4) : a;
}

// The box's bytes in shared order (swizzled relative to the shared address dst), gathered from global
// memory (load) or scattered to it (store); out-of-bounds elements read as zeros and are not written.
CUPAGED_SIM_ASYNC_FN inline void tensor_box(const TensorMap& m, const long long* c, unsigned long long dst, unsigned char* box,
                                          bool store) {
  long long n[5] = {1, 1, 1, 1, 1}, s[5] = {1, 1, 1, 1, 1};
  for (unsigned d = 0; d < m.rank; ++d) s[d] = d ? m.estride[d] : 1;
  for (unsigned d = 0; d < m.rank; ++d) n[d] = (m.box[d] + s[d] - 1) / s[d];
  size_t o = 0;
  for (long long j4 = 0; j4 < n[4]; ++j4)
    for (long long j3 = 0; j3 < n[3]; ++j3)
      for (long long j2 = 0; j2 < n[2]; ++j2)
        for (long long j1 = 0; j1 < n[1]; ++j1)
          for (long long j0 = 0; j0 < n[0]; ++j0, o += m.esize) {
            long long j[5] = {j0, j1, j2, j3, j4};
            unsigned long long src = m.addr;
            bool in = true;
            for (unsigned d = 0; d < m.rank; ++d) {
              long long x = c[d] + j[d] * s[d];
              in = in && x >= 0 && (unsigned long long)x < m.dims[d];
              src += (unsigned long long)x * (d ? m.strides[d - 1] : m.esize);
            }
            unsigned char* at = box + (swizzled(dst + o, m.swizzle) - dst);
            if (!in) { if (!store) memset(at, 0, m.esize); }
            else if (store) bulk_write_global(src, at, m.esize);
            else bulk_read_global(at, src, m.esize);
          }
}

inline size_t tensor_bytes(const TensorMap& m) {
  size_t b = size_t(m.esize) * m.box[0];
  for (unsigned d = 1; d < m.rank; ++d) b *= (m.box[d] + m.estride[d] - 1) / m.estride[d];
  return b;
}

inline void check_tensor_smem(const TensorMap& m, unsigned long long a, size_t bytes, int line, const char* op) {
  shared_ptr(a, unsigned(bytes), 128, line, op);
  if (m.swizzle && bytes % (16u << m.swizzle))
    fail(E_MEMORY, line, "%s: a swizzled box must fill whole %u-byte swizzle rows, got %zu bytes", op, 16u << m.swizzle, bytes);
}

// cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes [dst], [map, {c}], [mbar]
inline void tensor_load(unsigned long long dst, unsigned long long map, const long long* c, int rank, unsigned long long mbar,
                        int line, const char* op) {
  g.cur->line = line;
  TensorMap m = tensor_map(map, rank, line, op);
  size_t bytes = tensor_bytes(m);
  check_tensor_smem(m, dst, bytes, line, op);
  auto* data = static_cast<unsigned char*>(malloc(bytes));
  tensor_box(m, c, dst, data, false);
  copy_in_flight(dst, bytes, data, mbar, line, op);
}

// cp.async.bulk.tensor.Nd.global.shared::cta.tile.bulk_group [map, {c}], [src]: checked now, run at its wait
inline void tensor_store(unsigned long long map, const long long* c, int rank, unsigned long long src, int line, const char* op) {
  TensorMap m = tensor_map(map, rank, line, op);
  check_tensor_smem(m, src, tensor_bytes(m), line, op);
  BulkStore s{};
  s.src = src; s.size = tensor_bytes(m); s.line = line; s.rank = rank;
  for (int d = 0; d < rank; ++d) s.c[d] = c[d];
  memcpy(s.map, &m, sizeof m);
  bulk_store_push(s);
}

CUPAGED_SIM_ASYNC_FN static void bulk_store_run(const BulkStore& s) {
  const char* op = s.rank ? "cp.async.bulk.tensor (a store)" : "cp.async.bulk (a store)";
  g.cur->line = s.line;
  proxy_read(s.src, s.size, op, s.line);
  bulk_count(s.size);
  if (!s.rank) {
    bulk_write_global(s.dst, reinterpret_cast<unsigned char*>(g.smem_base + s.src), s.size);
    return;
  }
  TensorMap m;
  memcpy(&m, s.map, sizeof m);
  tensor_box(m, s.c, s.src, reinterpret_cast<unsigned char*>(g.smem_base + s.src), true);
}

// ---- elect.sync, setmaxnreg
inline unsigned elect(unsigned mask, int line) {
  collective(SYNCWARP, mask, 0, 0, 32, line);
  return unsigned(__builtin_ctz(mask));  // the lowest lane of the mask leads
}

CUPAGED_SIM_TRUSTED inline void setmaxnreg_compute(int base) {
  unsigned want = *static_cast<const unsigned*>(g.threads[base].xop);
  for (int i = base; i < base + 128; ++i)
    if (*static_cast<const unsigned*>(g.threads[i].xop) != want) {
      g.cur = &g.threads[i];
      fail(E_SYNC, g.threads[i].line, "setmaxnreg: thread %d asks for %u registers, thread %d for %u: the count must "
           "be the same across the warpgroup", base, want, i, *static_cast<const unsigned*>(g.threads[i].xop));
    }
}
inline unsigned long long mapa(unsigned long long a, unsigned rank, int line) {
  if (rank != 0) fail(E_SYNC, line, "mapa: CTA rank %u of the cluster: the sim runs clusters of one CTA", rank);
  return a;
}
inline void setmaxnreg(const void* site, unsigned count, int line) {
  if (count % 8 || count < 24 || count > 256)
    fail(E_SYNC, line, "setmaxnreg: the register count must be a multiple of 8 in 24..256, got %u", count);
  g.cur->xop = &count;
  warpgroup_op("setmaxnreg", &setmaxnreg_compute, site, line);
}

}  // namespace ptx
}  // namespace cupaged_sim
