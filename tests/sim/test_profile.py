"""The sim's memory-traffic profiler (``cupaged.sim.profile()``) on kernels whose counts follow by hand.

Counted per launch (``prof.launches``, in order) and per pointer parameter (by its C++ name): bytes
requested by the lanes' loads / stores (repeats included) and distinct bytes touched; ``sectors_*``:
per *warp-level instruction* (one executed occurrence of one instruction site by a warp's lanes;
loop iterations are separate instructions even where a lane's addresses continue, a float4 access is
one) the distinct 32-byte sectors its lanes' bytes fall in, summed; ``sector_efficiency`` = bytes /
(32 * sectors), <= 1 (a byte several lanes of one instruction read counts once). Shared memory: 32
banks of 4 bytes; an access of <= 4 bytes per lane costs the largest number of distinct words one
bank is asked for (a word shared by lanes is a broadcast), 16-byte accesses go in 4 phases of 8
lanes; ideal 1 per access (phase), conflicts = wavefronts - ideal; ``ldmatrix`` costs 1 per 8x8
matrix whose 8 rows (16 bytes = 4 banks) fall in distinct bank groups. ``cp_async_bytes``: bytes
copied by cp.async; ``mma_flops``: 2*M*N*K per warp-level mma.sync. ``shared.by_line``: the
wavefronts per source line of the instructions (an int: a line of the module's code; an emulated
PTX instruction: its asm statement's line; an access inside a sim helper: the calling line).
``block_stride``: only CTAs at multiples of it run. A by-value struct's field that points into a
guarded array is an argument named ``param.field``.

Expected numbers are derived in the comments from these definitions, not read off the profiler.
Arrays are multiples of 128 bytes (the sim ends each at a page boundary, so it starts 128-byte
aligned); loads the compiler could hoist out of a loop use a run-time stride of 0. Each kernel also
compiles under NVRTC (sm_80) and checks its results, unprofiled and profiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
import pytest

from cupaged import sim

SRC = r"""
extern "C" __global__ void copy_f32(const float* src, float* dst, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i];
}
extern "C" __global__ void read_stride2(const float* src, float* dst, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[2 * i];
}

// One block of 32 x 32 threads; warp w = the threads with threadIdx.y == w. Rows of ld = 32 or 33 words.
__device__ void transpose_via(float* tile, int ld, const float* in, float* out) {
  const int x = threadIdx.x, y = threadIdx.y;
  tile[y * ld + x] = in[32 * y + x];  // row-wise
  __syncthreads();
  out[32 * y + x] = tile[x * ld + y];  // column-wise
}
extern "C" __global__ void transpose_naive(const float* in, float* out) {
  __shared__ float tile[32][32];
  transpose_via(&tile[0][0], 32, in, out);
}
extern "C" __global__ void transpose_padded(const float* in, float* out) {
  __shared__ float tile[32][33];
  transpose_via(&tile[0][0], 33, in, out);
}
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// 64 threads, tiles of 256 floats: thread t copies floats 4t..4t+3 of tile kt+1 (16 bytes) into one
// stage while it sums those of tile kt from the other; each thread reads only its own copies.
__device__ __forceinline__ void cp_async16_commit(float* dst, const float* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
extern "C" __global__ void cp_async_sum(const float* src, float* dst, int tiles) {
  alignas(16) __shared__ float stage[2][256];
  const int t = threadIdx.x;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  cp_async16_commit(&stage[0][4 * t], src + 4 * t);
  for (int kt = 0; kt < tiles; ++kt) {
    if (kt + 1 < tiles) {
      cp_async16_commit(&stage[(kt + 1) & 1][4 * t], src + 256 * (kt + 1) + 4 * t);
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // tile kt landed, kt + 1 may be in flight
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    }
    const float4 v = *reinterpret_cast<const float4*>(&stage[kt & 1][4 * t]);
    acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
  }
  reinterpret_cast<float4*>(dst)[t] = acc;  // one 16-byte store per thread
}
// One warp re-reads src[0..31] `reps` times (step is 0 at run time: the load stays in the loop).
extern "C" __global__ void reread_row(const float* src, float* dst, int reps, int step) {
  const int lane = threadIdx.x;
  float acc = 0.f;
  for (int r = 0; r < reps; ++r) acc += src[lane + r * step];
  dst[lane] = acc;
}
// Thread t sums its own row src[len t ..] (len <= 4), one float per loop iteration, then writes j to
// word len t + j of shared, one per iteration (separate loops: each lane's accesses are contiguous).
extern "C" __global__ void row_per_thread(const float* src, float* dst, int len) {
  __shared__ float rows[32 * 4];
  float acc = 0.f;
  for (int j = 0; j < len; ++j) acc += src[len * threadIdx.x + j];
  for (int j = 0; j < len; ++j) rows[len * threadIdx.x + j] = float(j);
  __syncwarp();
  dst[threadIdx.x] = acc + rows[threadIdx.x];
}
extern "C" __global__ void broadcast(const float* src, float* dst) { dst[threadIdx.x] = src[0]; }
// Lane l of warp w: A fragment a[4i..4i+3], B fragment b[2i..2i+1], D d[4i..4i+3], i = 32w + l.
extern "C" __global__ void mma_once(const unsigned* a, const unsigned* b, float* d) {
  const int i = threadIdx.x;
  float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
               : "r"(a[4 * i]), "r"(a[4 * i + 1]), "r"(a[4 * i + 2]), "r"(a[4 * i + 3]),
                 "r"(b[2 * i]), "r"(b[2 * i + 1]));
  d[4 * i] = d0; d[4 * i + 1] = d1; d[4 * i + 2] = d2; d[4 * i + 3] = d3;
}
// One warp: fills 256 shared words (word k = k), then one ldmatrix.x1 whose row r starts at word
// r * stride (lanes 8..31 repeat lanes 0..7's addresses; .x1 reads only those).
extern "C" __global__ void ldmatrix_rows(unsigned* out, int stride) {
  alignas(16) __shared__ unsigned buf[256];
  const int lane = threadIdx.x;
  for (int j = 0; j < 8; ++j) buf[lane + 32 * j] = lane + 32 * j;
  __syncwarp();
  unsigned r;
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
               : "=r"(r) : "r"(smem_addr(&buf[(lane % 8) * stride])) : "memory");
  out[lane] = r;
}
"""
# 300 load sites in one loop body with no scheduling point (as in a big fully unrolled kernel)
SRC += (
    'extern "C" __global__ void many_sites(const float* src, float* dst, int reps, int step) {\n'
    "  const int lane = threadIdx.x;\n  float acc = 0.f;\n  for (int r = 0; r < reps; ++r) {\n"
    + "".join(f"    acc += src[lane + {32 * j} + r * step];\n" for j in range(300))
    + "  }\n  dst[lane] = acc;\n}\n")


@functools.lru_cache(maxsize=None)
def kernel(name):
    return sim.RawModule(code=SRC, options=("-std=c++17",)).get_function(name)


def f32(n, start=0):
    return sim.asarray(np.arange(start, start + n, dtype=np.float32))


def profiled(name, grid, block, args, out, want):
    """Launches plain, then profiled, checking ``out == want`` after each; the profiled launch's record."""
    for ctx in (contextlib.nullcontext(), sim.profile()):
        out[...] = 0
        with ctx as prof:
            kernel(name)(grid, block, args)
        np.testing.assert_array_equal(out, want)
    assert len(prof.launches) == 1
    return prof.launches[0]


def test_sources_compile_under_nvrtc():
    from cupaged._nvrtc import compile_cubin

    assert compile_cubin(SRC, arch="sm_80", options=("-std=c++17",)).cubin


def test_coalesced_copy():
    src, dst = f32(4096), sim.zeros(4096, np.float32)
    rec = profiled("copy_f32", (32,), (128,), (src, dst, np.int32(4096)), dst, src)
    assert set(rec.args) == {"src", "dst"}  # pointer parameters only, not n
    src, dst = rec.args["src"], rec.args["dst"]
    # 4096 threads x 4 bytes = 16384 bytes, each once; 128 warps x 128 contiguous aligned bytes = 4 sectors
    assert (src.bytes_read, src.unique_bytes_read, src.sectors_read) == (16384, 16384, 512)
    assert (src.bytes_written, src.unique_bytes_written, src.sectors_written) == (0, 0, 0)
    assert (dst.bytes_written, dst.unique_bytes_written, dst.sectors_written) == (16384, 16384, 512)
    assert (dst.bytes_read, dst.unique_bytes_read, dst.sectors_read) == (0, 0, 0)
    assert src.sector_efficiency == 1.0 and dst.sector_efficiency == 1.0  # 16384 / (32 * 512)
    assert (rec.shared.wavefronts, rec.shared.ideal_wavefronts, rec.shared.bank_conflicts) == (0, 0, 0)
    assert rec.cp_async_bytes == 0 and rec.mma_flops == 0


def test_stride2_read_uses_half_of_each_sector():
    src, dst = f32(8192), sim.zeros(4096, np.float32)
    a = profiled("read_stride2", (32,), (128,), (src, dst, np.int32(4096)), dst, src[::2]).args["src"]
    # 4096 x 4 bytes; a warp's lanes read every other float of 256 bytes: 8 sectors, x 128 warps
    assert (a.bytes_read, a.unique_bytes_read, a.sectors_read) == (16384, 16384, 1024)
    assert a.sector_efficiency == 0.5  # 16384 / (32 * 1024)


def test_transpose_bank_conflicts_and_padding():
    a, out = f32(1024).reshape(32, 32), sim.zeros((32, 32), np.float32)
    naive, padded = (profiled(k, (1,), (32, 32), (a, out), out, a.T) for k in ("transpose_naive", "transpose_padded"))
    # Writes tile[y][x]: a warp (fixed y) writes 32 consecutive words, banks 0..31: 1 wavefront x 32 warps.
    # Reads tile[x][y] unpadded: word 32x + y, every lane in bank y, 32 distinct words: 32 wavefronts
    # x 32 warps = 1024. Total 32 + 1024 = 1056, ideal 32 + 32 = 64, conflicts 992 (31 per column read).
    assert (naive.shared.wavefronts, naive.shared.ideal_wavefronts, naive.shared.bank_conflicts) == (1056, 64, 992)
    # Padded: word 33x + y, bank (x + y) % 32, distinct over the lanes: 1 per read, 1 per write.
    assert (padded.shared.wavefronts, padded.shared.ideal_wavefronts, padded.shared.bank_conflicts) == (64, 64, 0)
    for rec in (naive, padded):  # global side: 32 warps x 4 sectors, both ways
        assert (rec.args["in"].bytes_read, rec.args["in"].sectors_read) == (4096, 128)
        assert (rec.args["out"].bytes_written, rec.args["out"].sectors_written) == (4096, 128)


def test_cp_async_double_buffer():
    src, dst = f32(1024), sim.zeros(256, np.float32)
    rec = profiled("cp_async_sum", (1,), (64,), (src, dst, np.int32(4)), dst, src.reshape(4, 256).sum(axis=0))
    assert rec.cp_async_bytes == 4096  # 4 tiles x 64 threads x 16 bytes
    a = rec.args["src"]  # cp.async reads global memory: each float once, 2 warps x 512 bytes = 16 sectors per tile
    assert (a.bytes_read, a.unique_bytes_read, a.sectors_read) == (4096, 4096, 128)
    # one float4 store per thread: 64 x 16 bytes; a warp's 512 contiguous bytes are 16 sectors, x 2 warps
    assert (rec.args["dst"].bytes_written, rec.args["dst"].sectors_written) == (1024, 32)
    assert rec.shared.bank_conflicts == 0  # 16-byte lanes: each phase of 8 lanes covers 128 contiguous bytes


def test_rereading_one_row():
    src, dst = f32(32, start=1), sim.zeros(32, np.float32)
    a = profiled("reread_row", (1,), (32,), (src, dst, np.int32(10), np.int32(0)), dst, 10 * src).args["src"]
    # 10 warp-level loads of the same 128 aligned bytes: 1280 bytes, 128 unique, 10 x 4 sectors
    assert (a.bytes_read, a.unique_bytes_read, a.sectors_read) == (1280, 128, 40)
    assert a.bytes_read == 10 * a.unique_bytes_read and a.sector_efficiency <= 1.0
    assert a.sector_efficiency == 1.0  # 1280 / (32 * 40): every load uses its 4 sectors fully


def test_many_load_sites_in_a_loop():
    src, dst = sim.asarray(np.ones(300 * 32, np.float32)), sim.zeros(32, np.float32)
    a = profiled("many_sites", (1,), (32,), (src, dst, np.int32(2), np.int32(0)), dst, np.full(32, 600)).args["src"]
    # 2 iterations x 300 sites = 600 warp-level loads of 128 aligned bytes (4 sectors) each
    assert (a.bytes_read, a.unique_bytes_read, a.sectors_read) == (2 * 300 * 128, 300 * 128, 2 * 300 * 4)


def test_row_per_thread_loop_is_uncoalesced_and_conflicted():
    src, dst = f32(128), sim.zeros(32, np.float32)
    want = src.reshape(32, 4).sum(axis=1) + np.arange(32) % 4
    rec = profiled("row_per_thread", (1,), (32,), (src, dst, np.int32(4)), dst, want)
    a = rec.args["src"]
    # 4 loop iterations = 4 warp-level loads; in each the lanes read 4 bytes 16 bytes apart, spanning
    # 512 bytes: 16 sectors. 4 x 16 = 64 sectors for 512 bytes: efficiency 512 / (32 * 64) = 0.25.
    assert (a.bytes_read, a.unique_bytes_read, a.sectors_read) == (512, 512, 64)
    assert a.sector_efficiency == 0.25
    # 4 warp-level 4-byte stores to word 4t + j: lanes t, t+8, t+16, t+24 share a bank with 4 distinct
    # words: 4 wavefronts each (16, ideal 4); then rows[t], words 0..31: 1. Conflicts 12.
    assert (rec.shared.wavefronts, rec.shared.ideal_wavefronts, rec.shared.bank_conflicts) == (17, 5, 12)


def test_broadcast_read():
    src, dst = f32(32, start=7), sim.zeros(128, np.float32)
    a = profiled("broadcast", (1,), (128,), (src, dst), dst, np.full(128, 7)).args["src"]
    # 128 threads x 4 bytes requested, all of src[0]; each of the 4 warps' loads touches 1 sector
    assert (a.bytes_read, a.unique_bytes_read, a.sectors_read) == (512, 4, 4)
    assert a.unique_bytes_read < a.bytes_read
    assert a.sector_efficiency <= 1.0  # the documented bound, also for a broadcast: it holds only if a
    assert a.sector_efficiency == 0.125  # byte read by several lanes of one load counts once: 4 x 4 / (32 x 4)


def test_mma_flops():
    one, two = 0x3C003C00, 0x40004000  # two fp16 1.0 / 2.0 per register
    a = sim.asarray(np.full(64 * 4, one, np.uint32))
    b = sim.asarray(np.repeat(np.array([one, two], np.uint32), 32 * 2))  # warp 0: B = 1, warp 1: B = 2
    d = sim.zeros(64 * 4, np.float32)
    rec = profiled("mma_once", (1,), (64,), (a, b, d), d, np.repeat([16, 32], 128))  # sums of 16 products
    assert rec.mma_flops == 2 * 4096  # 2 warps x 2 * 16 * 8 * 16
    assert rec.args["a"].bytes_read == 1024 and rec.args["b"].bytes_read == 512  # 64 lanes x 4 / 2 registers
    assert rec.args["d"].bytes_written == 1024 and rec.cp_async_bytes == 0


def test_ldmatrix_wavefronts():
    out, lane = sim.zeros(32, np.uint32), np.arange(32)
    for stride, ldm_wavefronts in ((4, 1), (32, 8)):
        # lane l holds row l / 4, halves 2(l % 4), 2(l % 4) + 1: word stride * (l / 4) + l % 4
        want = stride * (lane // 4) + lane % 4
        sh = profiled("ldmatrix_rows", (1,), (32,), (out, np.int32(stride)), out, want).shared
        # fill: 8 stores of 32 consecutive words, 1 wavefront each. ldmatrix: rows 16 bytes apart
        # (stride 4 words) cover bank groups 0..7: 1; rows 128 bytes apart all sit in banks 0..3,
        # 8 distinct words each: 8.
        assert (sh.wavefronts, sh.ideal_wavefronts) == (8 + ldm_wavefronts, 8 + 1)
        assert sh.bank_conflicts == ldm_wavefronts - 1


def test_launch_records():
    src, dst = f32(4096), sim.zeros(4096, np.float32)
    a, out = f32(1024).reshape(32, 32), sim.zeros((32, 32), np.float32)
    copy = functools.partial(kernel("copy_f32"), (32,), (128,), (src, dst, np.int32(4096)))
    copy()  # before the block: not recorded
    with sim.profile() as empty:
        pass
    assert list(empty.launches) == []
    with sim.profile() as prof:
        copy(shared_mem=512)
        kernel("broadcast")((1,), (128,), (src, dst))
        kernel("transpose_padded")((1,), (32, 32), (a, out))
    copy()  # after the block: not recorded
    assert len(prof.launches) == 3 and list(empty.launches) == []
    first, second, third = prof.launches
    assert (first.kernel, first.grid, first.block, first.shared_mem) == ("copy_f32", (32, 1, 1), (128, 1, 1), 512)
    assert (second.kernel, second.grid, second.block, second.shared_mem) == ("broadcast", (1, 1, 1), (128, 1, 1), 0)
    assert (third.kernel, third.grid, third.block) == ("transpose_padded", (1, 1, 1), (32, 32, 1))
    assert first.args["src"].bytes_read == 16384 and second.args["src"].bytes_read == 512


INFLIGHT = r"""
#include <cuda_fp16.h>
// Each thread issues `loads` independent float loads before the barrier that consumes them.
extern "C" __global__ void loads_before_barrier(const float* src, float* dst, int loads, int step) {
  float acc = 0.f;
  for (int k = 0; k < loads; ++k) acc += src[threadIdx.x + k * step];
  __syncthreads();
  dst[threadIdx.x] = acc;
}
// The same with 16-byte loads of a struct of eight halves (as kernels_cu/common.cuh's Vec), which
// g++ copies in pieces: each is still one load in flight, of 16 bytes.
template <class T, int N>
struct alignas(sizeof(T) * N) Halves { T h[N]; };
template <class T, int N>
__device__ __forceinline__ Halves<T, N> load_halves(const T* p) { return *reinterpret_cast<const Halves<T, N>*>(p); }
extern "C" __global__ void vector_loads_before_barrier(const __half* src, float* dst, int loads, int step) {
  float acc = 0.f;
  for (int k = 0; k < loads; ++k) {
    const Halves<__half, 8> v = load_halves<__half, 8>(src + 8 * (threadIdx.x + k * step));
    for (int e = 0; e < 8; ++e) acc += __half2float(v.h[e]);
  }
  __syncthreads();
  dst[threadIdx.x] = acc;
}
"""


@pytest.mark.parametrize("loads, per_thread", [(3, 48), (12, 128)])
def test_bytes_in_flight_of_vector_loads(loads, per_thread):
    """128 threads x 3 (or 8, capped) loads x 16 B: a vector load counts once, whole (the pieces g++
    split it into were counted as separate loads, so 8 pieces of 2 bytes filled the cap)."""
    src, dst = sim.asarray(np.ones((128 * 12, 8), np.float16)), sim.zeros(128, np.float32)
    with sim.profile() as prof:
        sim.RawModule(code=INFLIGHT).get_function("vector_loads_before_barrier")(
            (1,), (128,), (src, dst, np.int32(loads), np.int32(128)))
    np.testing.assert_array_equal(dst, 8 * loads)
    assert prof.launches[0].max_inflight_bytes_per_cta == 128 * per_thread


@pytest.mark.parametrize("loads, per_thread", [(4, 16), (12, 32)])
def test_bytes_in_flight(loads, per_thread):
    """Plain loads count from issue to the thread's next scheduling point, at most 8 per lane; a
    CTA's figure sums its threads' peaks: 128 threads x 4 x 4 B, or x 8 (capped) x 4 B."""
    src, dst = f32(128 * 12), sim.zeros(128, np.float32)
    with sim.profile() as prof:
        sim.RawModule(code=INFLIGHT).get_function("loads_before_barrier")((2,), (128,), (src, dst, np.int32(loads),
                                                                                        np.int32(128)))
    assert prof.launches[0].max_inflight_bytes_per_cta == 128 * per_thread


def test_cp_async_double_buffer_keeps_a_stage_in_flight():
    src, dst = f32(1024), sim.zeros(256, np.float32)
    rec = profiled("cp_async_sum", (1,), (64,), (src, dst, np.int32(4)), dst, src.reshape(4, 256).sum(axis=0))
    # two committed groups of 16 bytes per thread before the first wait: 64 x 32 B, two stages
    assert rec.max_inflight_bytes_per_cta == 64 * 32 >= 64 * 16


def line_of(text, marker):
    """1-based line of the only line of ``text`` that contains ``marker``."""
    (index,) = [i for i, row in enumerate(text.splitlines()) if marker in row]
    return index + 1


def test_shared_by_line_transpose():
    a, out = f32(1024).reshape(32, 32), sim.zeros((32, 32), np.float32)
    naive, padded = (profiled(k, (1,), (32, 32), (a, out), out, a.T).shared for k in ("transpose_naive", "transpose_padded"))
    rows, columns = line_of(SRC, "// row-wise"), line_of(SRC, "// column-wise")
    # (keys: lines of the module's code) Naive: the row-wise store costs 1 wavefront per warp; the
    # column-wise load 32, all 31 x 32 extra wavefronts of the launch.
    assert set(naive.by_line) == {rows, columns}
    assert (naive.by_line[rows].wavefronts, naive.by_line[rows].bank_conflicts) == (32, 0)
    assert (naive.by_line[columns].wavefronts, naive.by_line[columns].ideal_wavefronts) == (1024, 32)
    assert naive.by_line[columns].bank_conflicts == 31 * 32 == naive.bank_conflicts
    assert set(padded.by_line) == {rows, columns}
    assert all((r.wavefronts, r.bank_conflicts) == (32, 0) for r in padded.by_line.values())
    for sh in (naive, padded):  # the lines sum to the launch
        assert sum(r.wavefronts for r in sh.by_line.values()) == sh.wavefronts
        assert sum(r.ideal_wavefronts for r in sh.by_line.values()) == sh.ideal_wavefronts


def test_shared_by_line_of_emulated_ptx():
    out, lane = sim.zeros(32, np.uint32), np.arange(32)
    sh = profiled("ldmatrix_rows", (1,), (32,), (out, np.int32(32)), out, 32 * (lane // 4) + lane % 4).shared
    # the fill loop: 8 stores of 1 wavefront; the ldmatrix (keyed by its asm statement's line): 8 (see above)
    fill, ldmatrix = line_of(SRC, "buf[lane + 32 * j] ="), line_of(SRC, "ldmatrix.sync.aligned.m8n8.x1")
    assert {k: (r.wavefronts, r.ideal_wavefronts) for k, r in sh.by_line.items()} == {fill: (8, 8), ldmatrix: (8, 1)}
    src, dst = f32(1024), sim.zeros(256, np.float32)
    sh = profiled("cp_async_sum", (1,), (64,), (src, dst, np.int32(4)), dst, src.reshape(4, 256).sum(axis=0)).shared
    # cp.async writes 16 bytes per lane: 4 phases per warp, 2 warps, 4 tiles; the float4 reads the same
    copy, read = line_of(SRC, '"cp.async.cg.shared.global'), line_of(SRC, "const float4 v =")
    assert {k: (r.wavefronts, r.ideal_wavefronts) for k, r in sh.by_line.items()} == {copy: (32, 32), read: (32, 32)}


EXTRA = r"""
// One float per thread over a 3-D grid of 1-D blocks.
extern "C" __global__ void copy_grid(const float* src, float* dst) {
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int i = block * blockDim.x + threadIdx.x;
  dst[i] = src[i];
}
// Eight independent loads at eight sites before the barrier that consumes them.
extern "C" __global__ void eight_loads(const float* src, float* dst) {
  const float* p = src + threadIdx.x;
  const float acc = p[0] + p[128] + p[256] + p[384] + p[512] + p[640] + p[768] + p[896];
  __syncthreads();
  dst[threadIdx.x] = acc;
}
// Each warp adds 1 to the 32 words of s (atomicAdd is a function of the sim's headers).
extern "C" __global__ void shared_atomics(float* out) {
  __shared__ float s[32];
  s[threadIdx.x % 32] = 0.f;
  __syncthreads();
  atomicAdd(&s[threadIdx.x % 32], 1.f);
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x % 32];
}
// A struct passed by value whose fields point to the arrays.
struct P {
  const float* src;  // [n]
  float* dst;        // [n]
  int n;
};
extern "C" __global__ void copy_struct(P p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) p.dst[i] = p.src[i];
}
"""


def test_extra_sources_compile_under_nvrtc():
    from cupaged._nvrtc import compile_cubin

    for source in (EXTRA, INFLIGHT):
        assert compile_cubin(source, arch="sm_80", options=("-std=c++17",)).cubin


def extra(name):
    return sim.RawModule(code=EXTRA, options=("-std=c++17",)).get_function(name)


def test_shared_by_line_inside_a_sim_helper():
    out = sim.zeros(64, np.float32)
    with sim.profile() as prof:
        extra("shared_atomics")((1,), (64,), (out,))
    np.testing.assert_array_equal(out, np.full(64, 2))
    # the accesses inside atomicAdd (a read and a write per warp) belong to the line that calls it
    lines = {line_of(EXTRA, marker): n for marker, n in (("= 0.f;", 2), ("atomicAdd(&s", 4), ("out[threadIdx.x] = s", 2))}
    assert {k: (r.wavefronts, r.ideal_wavefronts) for k, r in prof.launches[0].shared.by_line.items()} == {
        line: (n, n) for line, n in lines.items()}


def test_block_stride_samples_ctas():
    grid, n = (8, 3, 2), 48 * 64
    src, dst = f32(n), sim.zeros(n, np.float32)
    with sim.profile() as full:
        extra("copy_grid")(grid, (64,), (src, dst))
    dst[...] = 0
    with sim.profile(block_stride=(2, 2, 2)) as sampled:
        extra("copy_grid")(grid, (64,), (src, dst))
    f, s = full.launches[0], sampled.launches[0]
    assert (f.ctas, f.ctas_profiled) == (48, 48)
    assert (s.ctas, s.ctas_profiled) == (48, 4 * 2 * 1)  # x in {0,2,4,6}, y in {0,2}, z = 0
    for name in ("src", "dst"):  # every CTA moves the same bytes: a sixth of the grid, a sixth of the counts
        counts = [fl.name for fl in dataclasses.fields(f.args[name]) if fl.name != "size"]  # size: the array's
        assert [getattr(f.args[name], c) for c in counts] == [6 * getattr(s.args[name], c) for c in counts]
        assert f.args[name].size == s.args[name].size
    assert s.args["dst"].bytes_written == 8 * 64 * 4 and s.args["dst"].sectors_written == 8 * 2 * 4
    ran = np.zeros(grid[::-1], bool)  # [z, y, x]
    ran[0, ::2, ::2] = True
    want = np.where(np.repeat(ran.reshape(-1), 64), src, 0)  # skipped CTAs write nothing
    np.testing.assert_array_equal(dst, want)


def test_bytes_in_flight_of_every_load_site():
    """All eight loads count, wherever their code lies (sites at odd addresses were taken for emulated
    instructions and left out): 128 threads x 8 x 4 B."""
    src, dst = f32(1024), sim.zeros(128, np.float32)
    with sim.profile() as prof:
        extra("eight_loads")((1,), (128,), (src, dst))
    np.testing.assert_array_equal(dst, src.reshape(8, 128).sum(axis=0))
    assert prof.launches[0].max_inflight_bytes_per_cta == 128 * 8 * 4


def test_pointers_inside_a_struct_argument():
    n = 1000
    src, dst = f32(1024), sim.zeros(1024, np.float32)
    struct = np.dtype([("src", np.uint64), ("dst", np.uint64), ("n", np.int32)], align=True)
    p = np.array((src.ctypes.data, dst.ctypes.data, n), dtype=struct)[()]
    for ctx in (contextlib.nullcontext(), sim.profile()):
        dst[...] = 0
        with ctx as prof:
            extra("copy_struct")((8,), (128,), (p,))
        np.testing.assert_array_equal(dst[:n], src[:n])
        assert not dst[n:].any()
    rec = prof.launches[0]
    assert set(rec.args) == {"p.src", "p.dst"}  # param.field, for fields that point into guarded arrays
    a, b = rec.args["p.src"], rec.args["p.dst"]
    # 1000 floats each way; warps 0..30 touch 4 sectors, warp 31 (floats 992..999) one
    assert (a.bytes_read, a.unique_bytes_read, a.sectors_read, a.bytes_written) == (4000, 4000, 125, 0)
    assert (b.bytes_written, b.unique_bytes_written, b.sectors_written, b.bytes_read) == (4000, 4000, 125, 0)
