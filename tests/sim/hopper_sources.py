"""CUDA sources of tests/sim/test_ptx_hopper.py: Hopper's mbarriers, bulk and tensor copies, named barriers,
elect.sync, setmaxnreg and cluster registers as inline PTX. Each string is one module (one compile per sim
build and one NVRTC compile for sm_90a); kernels take run-time parameters so that many cases share a compile.
BARRIER0 and CLUSTER are modules of their own so that a form the sim rejects fails only its own test."""

from __future__ import annotations

PRELUDE = r"""
#ifndef __cuda_cuda_h__
struct alignas(64) CUtensorMap { unsigned long long opaque[16]; };
#endif
typedef unsigned long long u64;
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mb_init(u64* b, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(sa(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mb_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ u64 mb_arrive(u64* b) {
  u64 s;
  asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];" : "=l"(s) : "r"(sa(b)) : "memory");
  return s;
}
__device__ __forceinline__ u64 mb_arrive_n(u64* b, unsigned n) {
  u64 s;
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 %0, [%1], %2;" : "=l"(s) : "r"(sa(b)), "r"(n) : "memory");
  return s;
}
__device__ __forceinline__ void mb_arrive_tx(u64* b, unsigned tx) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(b)), "r"(tx) : "memory");
}
__device__ __forceinline__ void mb_drop(u64* b) {
  asm volatile("mbarrier.arrive_drop.shared::cta.b64 _, [%0];" :: "r"(sa(b)) : "memory");
}
__device__ __forceinline__ void mb_expect(u64* b, unsigned tx) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" :: "r"(sa(b)), "r"(tx) : "memory");
}
__device__ __forceinline__ void mb_complete(u64* b, unsigned tx) {
  asm volatile("mbarrier.complete_tx.relaxed.cta.shared::cta.b64 [%0], %1;" :: "r"(sa(b)), "r"(tx) : "memory");
}
// The four waits: test_wait (never blocks) or try_wait, on a phase parity or an arrival's state token.
#define MB_WAIT(name, form, T, con)                                                                         \
  __device__ __forceinline__ int name(u64* b, T v) {                                                        \
    unsigned r;                                                                                             \
    asm volatile("{\n.reg .pred p;\nmbarrier." form ".shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}" \
                 : "=r"(r) : "r"(sa(b)), con(v) : "memory");                                              \
    return r;                                                                                               \
  }
MB_WAIT(mb_test_parity, "test_wait.parity", unsigned, "r")
MB_WAIT(mb_try_parity, "try_wait.parity", unsigned, "r")
MB_WAIT(mb_test, "test_wait", u64, "l")
MB_WAIT(mb_try, "try_wait", u64, "l")
__device__ __forceinline__ void mb_wait(u64* b, unsigned parity) {
  while (!mb_try_parity(b, parity)) {}
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned n, u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(sa(dst)), "l"(src), "r"(n), "r"(sa(bar)) : "memory");
}
__device__ __forceinline__ void fence_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
"""

# Single-thread and whole-block mbarrier semantics; out[k] are the observations the test lists.
MBAR = PRELUDE + r"""
extern "C" __global__ void phases(int* out) {
  __shared__ u64 bar[6];
  const int t = threadIdx.x;
  if (t == 0) {
    mb_init(&bar[0], 64); mb_init(&bar[1], 4); mb_init(&bar[2], 1); mb_init(&bar[3], 2); mb_init(&bar[4], 1);
    mb_init(&bar[5], 32);
    mb_fence_init();
  }
  __syncthreads();
  u64 tok = 0;
  if (t == 0) {
    out[0] = mb_try_parity(&bar[0], 1);   // phase 0: parity 1 is the preceding phase's, complete
    out[1] = mb_test_parity(&bar[0], 0);  // phase 0 itself: incomplete
  } else {
    tok = mb_arrive(&bar[0]);
  }
  __syncthreads();
  if (t == 0) {
    out[2] = mb_test_parity(&bar[0], 0);  // 63 of 64 arrivals
    tok = mb_arrive(&bar[0]);
    out[3] = mb_test_parity(&bar[0], 0);  // 64 of 64: complete
    out[4] = mb_test_parity(&bar[0], 1);  // phase 1: incomplete
  }
  while (!mb_try(&bar[0], tok)) {}  // every thread's token (phase 0): blocks until thread 0's arrival
  out[64 + t] = 1 + 2 * mb_test(&bar[0], tok);
  __syncthreads();
  if (t == 0) {
    u64 s0 = mb_arrive_n(&bar[1], 3);      // count 4: 3 + 1
    out[5] = mb_test(&bar[1], s0);
    u64 s1 = mb_arrive(&bar[1]);
    out[6] = mb_test(&bar[1], s0) + 2 * mb_test(&bar[1], s1);
    u64 s2 = mb_arrive_n(&bar[1], 2);      // phase 1: 2 of 4
    out[7] = mb_test(&bar[1], s2) + 2 * mb_test_parity(&bar[1], 0) + 4 * mb_test_parity(&bar[1], 1);
    mb_arrive_n(&bar[1], 2);
    out[8] = mb_test(&bar[1], s2) + 2 * mb_test_parity(&bar[1], 1) + 4 * mb_test_parity(&bar[1], 0);
    // arrive.expect_tx + complete_tx (count 1)
    mb_arrive_tx(&bar[2], 32);
    out[9] = mb_test_parity(&bar[2], 0);
    mb_complete(&bar[2], 16);
    out[10] = mb_test_parity(&bar[2], 0);
    mb_complete(&bar[2], 16);
    out[11] = mb_test_parity(&bar[2], 0);
    // expect_tx, then the arrival (phase 1)
    mb_expect(&bar[2], 48);
    mb_complete(&bar[2], 48);
    out[12] = mb_test_parity(&bar[2], 1);  // no arrival yet
    mb_arrive(&bar[2]);
    out[13] = mb_test_parity(&bar[2], 1);
    // arrive_drop (count 2): phase 0 takes the drop and one arrival; later phases expect one
    mb_drop(&bar[3]);
    out[14] = mb_test_parity(&bar[3], 0);
    mb_arrive(&bar[3]);
    out[15] = mb_test_parity(&bar[3], 0);
    mb_arrive(&bar[3]);
    out[16] = mb_test_parity(&bar[3], 1);
    mb_arrive(&bar[3]);
    out[17] = mb_test_parity(&bar[3], 0) + 2 * mb_test_parity(&bar[3], 1);
    // inval; the 8 bytes are ordinary memory; re-init (generic addressing) starts at phase 0 again
    asm volatile("mbarrier.inval.b64 [%0];" :: "l"(&bar[1]) : "memory");
    bar[1] = 0x1234567890ull;
    out[18] = bar[1] == 0x1234567890ull;
    asm volatile("mbarrier.init.b64 [%0], %1;" :: "l"(&bar[1]), "r"(1u) : "memory");
    out[19] = mb_test_parity(&bar[1], 0);
    asm volatile("mbarrier.arrive.b64 _, [%0];" :: "l"(&bar[1]) : "memory");
    out[20] = mb_test_parity(&bar[1], 0) + 2 * mb_test_parity(&bar[1], 1);
    // test_wait in a loop: false while warp 1 waits for the go (bar[4]), then true once its 32 arrivals land
    out[21] = mb_test_parity(&bar[5], 0);
    mb_arrive(&bar[4]);
    int spins = 0;
    while (!mb_test_parity(&bar[5], 0)) ++spins;
    out[22] = 1;
    out[23] = spins;
  } else if (t >= 32) {
    mb_wait(&bar[4], 0);
    mb_arrive(&bar[5]);
  }
}

// CUTLASS's spellings: cute::elect_one_sync (%%-named registers, a guarded mov), ClusterBarrier::wait (a label
// loop, try_wait with a suspend-time hint), complete_tx with .shared::cluster.relaxed.cluster. out[t]: elected,
// out[32 + t]: past the wait.
extern "C" __global__ void cutlass_forms(int* out) {
  __shared__ u64 bar;
  const int t = threadIdx.x;
  if (t == 0) { mb_init(&bar, 1); mb_fence_init(); }
  __syncthreads();
  unsigned pred = 0, laneid = 0;
  asm volatile("{\n.reg .b32 %%rx;\n.reg .pred %%px;\n     elect.sync %%rx|%%px, %2;\n@%%px mov.s32 %1, 1;\n"
               "    mov.s32 %0, %%rx;\n}\n" : "+r"(laneid), "+r"(pred) : "r"(0xFFFFFFFF));
  out[t] = pred + 2 * laneid;
  if (pred) {
    mb_arrive_tx(&bar, 32);
    asm volatile("mbarrier.complete_tx.shared::cluster.relaxed.cluster.b64   [%1], %0;" :: "r"(32u), "r"(sa(&bar)));
  }
  asm volatile("{\n\t.reg .pred       P1; \n\tLAB_WAIT: \n\tmbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1, %2; "
               "\n\t@P1 bra DONE; \n\tbra     LAB_WAIT; \n\tDONE: \n\t}" :: "r"(sa(&bar)), "r"(0), "r"(0x989680));
  out[32 + t] = 1;
}

// A ring of 3 stages over `iters` tiles of 32 floats: warp 0 produces (mode 0: generic stores of 2 x, 32 arrivals;
// mode 1: one cp.async.bulk of x, arrive.expect_tx), warp 1 consumes; full/empty mbarriers, parity (i / 3) & 1.
extern "C" __global__ void ring(const float* in, float* out, int iters, int mode) {
  __shared__ alignas(128) float buf[3][32];
  __shared__ u64 full[3], empty[3];
  const int t = threadIdx.x, lane = t % 32;
  if (t == 0) {
    for (int s = 0; s < 3; ++s) { mb_init(&full[s], mode ? 1 : 32); mb_init(&empty[s], 32); }
    mb_fence_init();
  }
  __syncthreads();
  for (int i = 0; i < iters; ++i) {
    const int s = i % 3;
    const unsigned ph = (i / 3) & 1;
    if (t < 32) {
      mb_wait(&empty[s], ph ^ 1);
      if (mode == 0) {
        buf[s][lane] = 2.0f * in[32 * i + lane];
        mb_arrive(&full[s]);
      } else if (lane == 0) {
        mb_arrive_tx(&full[s], 128);
        bulk_g2s(buf[s], in + 32 * i, 128, &full[s]);
      }
    } else {
      mb_wait(&full[s], ph);
      out[32 * i + lane] = buf[s][lane];
      mb_arrive(&empty[s]);
    }
  }
}

// cp.async (16 bytes per lane of warp 0) completing on an mbarrier that warp 1 waits on. noinc: the mbarrier
// counts the 32 cp.async arrivals; otherwise they leave the pending count unchanged and 32 mbarrier.arrive count.
extern "C" __global__ void cp_arrive(const int4* in, int4* out, int noinc) {
  __shared__ int4 buf[32];
  __shared__ u64 bar;
  const int t = threadIdx.x;
  if (t == 0) { mb_init(&bar, 32); mb_fence_init(); }
  __syncthreads();
  if (t < 32) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(sa(&buf[t])), "l"(in + t) : "memory");
    if (noinc) {
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(sa(&bar)) : "memory");
    } else {
      asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" :: "r"(sa(&bar)) : "memory");
      mb_arrive(&bar);
    }
  } else {
    mb_wait(&bar, 0);
    out[t - 32] = buf[t - 32];
  }
}
"""

# Bulk copies both ways: three loads (16 + 48 + 192 bytes, the last with an L2 cache hint) on one mbarrier,
# issued before the arrive.expect_tx; seen[0:256] is shared memory before the phase completes (and before any
# thread waits), seen[256:512] after; then dst = (those bytes ^ 0x5A) through two bulk stores (after
# fence.proxy.async when `fence`).
BULK = PRELUDE + r"""
extern "C" __global__ void bulk(const unsigned char* src, unsigned char* dst, unsigned char* seen, int fence) {
  extern __shared__ unsigned char dyn[];
  __shared__ u64 bar;
  const unsigned base = sa(dyn), pad = (128u - base % 128u) % 128u;
  unsigned char* sm = dyn + pad;
  const int t = threadIdx.x;
  if (t == 0) { mb_init(&bar, 1); mb_fence_init(); }
  __syncthreads();
  if (t == 0) {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    bulk_g2s(sm, src, 16, &bar);
    bulk_g2s(sm + 16, src + 16, 48, &bar);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
                 "[%0], [%1], %2, [%3], %4;"
                 :: "r"(sa(sm + 64)), "l"(src + 64), "r"(192u), "r"(sa(&bar)), "l"(policy) : "memory");
    for (int i = 0; i < 256; ++i) seen[i] = sm[i];  // a race on a GPU; poison on the sim (no thread waits yet)
  }
  __syncthreads();
  if (t == 0) mb_arrive_tx(&bar, 256);
  mb_wait(&bar, 0);
  for (int i = t; i < 256; i += blockDim.x) seen[256 + i] = sm[i];
  __syncthreads();
  for (int i = t; i < 256; i += blockDim.x) sm[256 + i] = (unsigned char)(sm[i] ^ 0x5A);
  if (fence) fence_async();
  __syncthreads();
  if (t == 0) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(sa(sm + 256)), "r"(128u)
                 : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst + 128), "r"(sa(sm + 384)),
                 "r"(128u) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}
"""


def _tensor_asm(rank: int, load: bool) -> str:
    c = ", ".join(f"%{i + 2}" for i in range(rank))
    coords = ", ".join(f'"r"(c[{i}])' for i in range(rank))
    if load:
        return (f'asm volatile("cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes '
                f'[%0], [%1, {{{c}}}], [%{rank + 2}];" :: "r"(d), "l"(&map), {coords}, "r"(sa(&bar)) : "memory");')
    return (f'asm volatile("cp.async.bulk.tensor.{rank}d.global.shared::cta.tile.bulk_group [%1, {{{c}}}], [%0];" '
            f':: "r"(d), "l"(&map), {coords} : "memory");')


# Tile-mode tensor copies through a map: tma_load writes the box's shared-memory bytes (from a 1024-aligned
# destination) to out; tma_store copies image into shared memory and stores the box. c: innermost first.
TENSOR = PRELUDE + r"""
extern "C" __global__ void tma_load(const __grid_constant__ CUtensorMap map, int rank, int c0, int c1, int c2, int c3,
                                    int c4, int bytes, unsigned char* out) {
  extern __shared__ unsigned char dyn[];
  __shared__ u64 bar;
  const unsigned base = sa(dyn), pad = (1024u - base % 1024u) % 1024u, d = base + pad;
  const int c[5] = {c0, c1, c2, c3, c4};
  if (threadIdx.x == 0) { mb_init(&bar, 1); mb_fence_init(); }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(&map) : "memory");
    mb_arrive_tx(&bar, bytes);
    switch (rank) {
      case 1: LOAD1 break;
      case 2: LOAD2 break;
      case 3: LOAD3 break;
      case 4: LOAD4 break;
      default: LOAD5 break;
    }
  }
  mb_wait(&bar, 0);
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = dyn[pad + i];
}

extern "C" __global__ void tma_store(const __grid_constant__ CUtensorMap map, int rank, int c0, int c1, int c2, int c3,
                                     int c4, int bytes, const unsigned char* image) {
  extern __shared__ unsigned char dyn[];
  const unsigned base = sa(dyn), pad = (1024u - base % 1024u) % 1024u, d = base + pad;
  const int c[5] = {c0, c1, c2, c3, c4};
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) dyn[pad + i] = image[i];
  fence_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    switch (rank) {
      case 1: STORE1 break;
      case 2: STORE2 break;
      case 3: STORE3 break;
      case 4: STORE4 break;
      default: STORE5 break;
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
}

// A 2-stage ring of 128B-swizzled 8 x 64 u16 tiles (rows 8 i..8 i + 7): thread 0 produces with tensor loads,
// warps 1 and 2 consume (empty: 64 arrivals) and copy each stage's 1024 bytes to out[1024 i ...].
extern "C" __global__ void tma_ring(const __grid_constant__ CUtensorMap map, unsigned char* out, int iters) {
  extern __shared__ unsigned char dyn[];
  __shared__ u64 full[2], empty[2];
  const unsigned base = sa(dyn), pad = (1024u - base % 1024u) % 1024u;
  const int t = threadIdx.x;
  if (t == 0) {
    for (int s = 0; s < 2; ++s) { mb_init(&full[s], 1); mb_init(&empty[s], 64); }
    mb_fence_init();
  }
  __syncthreads();
  for (int i = 0; i < iters; ++i) {
    const int s = i % 2;
    const unsigned ph = (i / 2) & 1;
    if (t == 0) {
      mb_wait(&empty[s], ph ^ 1);
      mb_arrive_tx(&full[s], 1024);
      asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                   "[%0], [%1, {%2, %3}], [%4];"
                   :: "r"(base + pad + 1024 * s), "l"(&map), "r"(0), "r"(8 * i), "r"(sa(&full[s])) : "memory");
    } else if (t >= 32) {
      mb_wait(&full[s], ph);
      for (int b = t - 32; b < 1024; b += 64) out[1024 * i + b] = dyn[pad + 1024 * s + b];
      mb_arrive(&empty[s]);
    }
  }
}
"""
for _r in range(1, 6):
    TENSOR = TENSOR.replace(f"LOAD{_r} ", _tensor_asm(_r, True) + " ")
    TENSOR = TENSOR.replace(f"STORE{_r} ", _tensor_asm(_r, False) + " ")

# Named barriers, elect.sync, setmaxnreg and the hints; 256 threads (two warpgroups) unless said otherwise.
SYNC = PRELUDE + r"""
// WG1 produces `iters` rounds of 128 ints into smem (bar.sync 2 waits for the buffer, bar.arrive 1 hands it
// over); WG0 consumes (bar.sync 1, bar.arrive 2). Then inside each warpgroup: warp 0 writes, bar.arrive with
// count 128, warps 1-3 bar.sync (WG0: bar.*; WG1: barrier.cta.*.aligned spellings) and read it.
extern "C" __global__ void named(const int* in, int* out, int iters) {
  __shared__ int buf[128];
  __shared__ int note[2][32];
  const int t = threadIdx.x, wg = t / 128, k = t % 128;
  for (int i = 0; i < iters; ++i) {
    if (wg == 1) {
      if (i > 0) asm volatile("bar.sync 2, 256;" ::: "memory");
      buf[k] = in[128 * i + k] + 1;
      asm volatile("bar.arrive 1, 256;" ::: "memory");
    } else {
      asm volatile("bar.sync 1, 256;" ::: "memory");
      out[128 * i + k] = buf[k];
      if (i + 1 < iters) asm volatile("bar.arrive 2, 256;" ::: "memory");
    }
  }
  asm volatile("bar.sync 3;" ::: "memory");  // no count: the whole CTA
  if (k < 32) note[wg][k] = 1000 * (wg + 1) + k;
  if (wg == 0) {
    if (k < 32) asm volatile("bar.arrive 4, 128;" ::: "memory");
    else asm volatile("bar.sync 4, 128;" ::: "memory");
  } else {
    if (k < 32) asm volatile("barrier.cta.arrive.aligned 5, 128;" ::: "memory");
    else asm volatile("barrier.cta.sync.aligned 5, %0;" :: "r"(128) : "memory");
  }
  if (k >= 32) out[128 * iters + 96 * wg + k - 32] = note[wg][k % 32];
}

// elect.sync over `mask` (lanes outside it do not execute it): leader[lane] = the elected lane, pred[lane] = p.
extern "C" __global__ void elect(unsigned mask, int* leader, int* pred) {
  const unsigned lane = threadIdx.x % 32;
  if (!((mask >> lane) & 1u)) return;
  unsigned who, p1, p2;
  asm volatile("{\n.reg .pred p;\nelect.sync %0|p, %2;\nselp.u32 %1, 1, 0, p;\n}" : "=r"(who), "=r"(p1) : "r"(mask));
  asm volatile("{\n.reg .pred q;\nelect.sync _|q, %1;\nselp.u32 %0, 1, 0, q;\n}" : "=r"(p2) : "r"(mask));
  leader[threadIdx.x] = who;
  pred[threadIdx.x] = p1 + 2 * p2;
}

// setmaxnreg per warpgroup (dec in WG0, inc in WG1; `split`: two values inside WG0 -- undefined on a GPU, a
// SimSyncError on the sim), griddepcontrol; out[t] = t + 1. (ptxas ignores these setmaxnreg, C7508: without a
// minimum-blocks launch bound it cannot tell the count at entry; so the kernel is safe on any GPU.)
extern "C" __global__ void __launch_bounds__(256) regs(int* out, int split) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int t = threadIdx.x;
  if (t >= 128) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  else if (split && t >= 64) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
  out[t] = t + 1;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
"""

# Kernels that must fail on the sim (mode picks the fault); they compile for sm_90a like the others.
FAULTS = PRELUDE + r"""
extern "C" __global__ void faults(int mode, int* out) {  // out: blockDim.x ints (mode 8: + 4)
  __shared__ u64 bar[2];
  const int t = threadIdx.x;
  if (mode != 4 && t == 0) { mb_init(&bar[0], 2); mb_fence_init(); }
  __syncthreads();
  if (mode == 0) {  // one of two arrivals: every thread waits forever
    if (t == 0) mb_arrive(&bar[0]);
    mb_wait(&bar[0], 0);
  } else if (mode == 1) {  // test_wait spinning on a phase nobody completes
    if (t == 0) while (!mb_test_parity(&bar[0], 0)) {}
  } else if (mode == 2) {  // a named barrier for more threads than the block has
    asm volatile("bar.sync 1, 256;" ::: "memory");
  } else if (mode == 3) {  // 64 threads at a 128-thread barrier, the other 64 at __syncthreads
    if (t < 64) asm volatile("bar.sync 1, 128;" ::: "memory");
    __syncthreads();
  } else if (mode == 4) {  // no mbarrier.init
    if (t == 0) mb_arrive(&bar[1]);
  } else if (mode == 5) {  // a generic store after the last fence.proxy.async, read by a bulk store
    __shared__ alignas(16) unsigned char st[32];
    if (t == 0) {
      for (int i = 0; i < 16; ++i) st[i] = 1;
      fence_async();
      for (int i = 16; i < 32; ++i) st[i] = 2;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(out), "r"(sa(st)), "r"(32u)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
  } else if (mode == 6) {  // a thread count that is not a multiple of the warp size (the whole 48-thread block)
    asm volatile("bar.sync 1, %0;" :: "r"(blockDim.x) : "memory");
  } else if (mode == 7) {  // mbarrier.inval while a bulk copy completing on it is in flight
    __shared__ alignas(16) unsigned char d7[16];
    if (t == 0) {
      bulk_g2s(d7, reinterpret_cast<const unsigned char*>(out), 16, &bar[0]);
      asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(sa(&bar[0])) : "memory");
    }
  } else if (mode == 8) {  // the stage is rewritten before cp.async.bulk.wait_group.read: the store reads it then
    __shared__ alignas(16) int st8[4];
    if (t == 0) {
      for (int i = 0; i < 4; ++i) st8[i] = 1;
      fence_async();
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 16;" :: "l"(out + blockDim.x), "r"(sa(st8))
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      for (int i = 0; i < 4; ++i) st8[i] = 3;
      fence_async();
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
  }
  out[t] = 1;
}
"""

# __syncthreads spelled as the PTX ISA's aligned barrier 0: s[t] = t, then out[t] = 2 t through two swaps.
BARRIER0 = r"""
extern "C" __global__ void bar0(int* out) {
  __shared__ int s[64];
  const int t = threadIdx.x;
  s[t] = t;
  asm volatile("barrier.sync.aligned 0;" ::: "memory");
  const int a = s[63 - t];
  asm volatile("barrier.cta.sync.aligned 0;" ::: "memory");
  s[t] = 2 * a;
  asm volatile("barrier.cta.sync.aligned 0;" ::: "memory");
  out[t] = s[63 - t];
}
"""

# Cluster special registers (%is_explicit_cluster is a .pred, read with mov.pred).
CLUSTER = r"""
// Cluster special registers of a launch without clusters (each CTA its own one-CTA cluster), per CTA x.
extern "C" __global__ void clusters(int* out) {
  unsigned v[8];
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(v[0]));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(v[1]));
  asm volatile("{\n.reg .pred p;\nmov.pred p, %%is_explicit_cluster;\nselp.u32 %0, 1, 0, p;\n}" : "=r"(v[2]));
  asm volatile("mov.u32 %0, %%cluster_ctaid.x;" : "=r"(v[3]));
  asm volatile("mov.u32 %0, %%cluster_nctaid.y;" : "=r"(v[4]));
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(v[5]));
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(v[6]));
  asm volatile("mov.u32 %0, %%clusterid.y;" : "=r"(v[7]));
  if (threadIdx.x < 8) out[8 * (blockIdx.y * gridDim.x + blockIdx.x) + threadIdx.x] = v[threadIdx.x];
}
"""

# Forms the sim must reject at compile time (not emulated, or invalid PTX), each a statement in `bad`.
BAD_FORM = PRELUDE + r"""
extern "C" __global__ void bad(const __grid_constant__ CUtensorMap map, int x) {
  __shared__ alignas(1024) unsigned char sm[1024];
  __shared__ u64 bar;
  STATEMENT
}
"""
BAD_STATEMENTS = {
    "multicast": ('asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes'
                  '.multicast::cluster [%0], [%1, {%2, %2}], [%3], %4;" :: "r"(sa(sm)), "l"(&map), "r"(x), '
                  '"r"(sa(&bar)), "h"((unsigned short)1) : "memory");', "cp.async.bulk.tensor"),
    "im2col": ('asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes'
               ' [%0], [%1, {%2, %2, %2}], [%3], {%4};" :: "r"(sa(sm)), "l"(&map), "r"(x), "r"(sa(&bar)), '
               '"h"((unsigned short)0) : "memory");', "cp.async.bulk.tensor"),
    "setmaxnreg20": ('asm volatile("setmaxnreg.inc.sync.aligned.u32 20;");', "setmaxnreg"),
    "setmaxnreg25": ('asm volatile("setmaxnreg.dec.sync.aligned.u32 25;");', "setmaxnreg"),
    # ptxas: "value '20' out of range" / "Arguments mismatch" (the count is an immediate) / "Argument vector size
    # mismatch" (a .2d copy takes two coordinates)
    "setmaxnreg-n20": ('asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(20));', "setmaxnreg"),
    "mapa-u16": ('unsigned short h = 1; asm volatile("mapa.shared::cluster.u16 %0, %0, 0;" : "+h"(h));', "mapa"),
    "setmaxnreg-reg": ('asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "r"(x));', "setmaxnreg"),
    "tensor-2d-one-coord": ('asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx'
                            '::bytes [%0], [%1, {%2}], [%3];" :: "r"(sa(sm)), "l"(&map), "r"(x), "r"(sa(&bar)) '
                            ': "memory");', "cp.async.bulk.tensor"),
}

# CUTLASS's spellings with template parameters: warpgroup_reg_dealloc<R> / warpgroup_reg_alloc<R> ("n"(R): the
# count is known only when the template is instantiated) and ClusterBarrier::arrive(cta_id) through mapa.
TEMPLATED = PRELUDE + r"""
template <int R>
__global__ void regs(int* out, unsigned rank) {
  __shared__ u64 bar;
  const int t = threadIdx.x;
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(R));
  if (t == 0) { mb_init(&bar, 1); mb_fence_init(); }
  __syncthreads();
  if (t == 0) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(sa(&bar)), "r"(rank));
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(remote) : "memory");
  }
  mb_wait(&bar, 0);
  out[t] = t + R;
}
"""
