// attention/kv_pipeline.cuh: the cp.async pipeline that brings a CTA's K/V tiles into shared memory, shared by
// paged_decode_kernel, paged_decode_mma_kernel, paged_prefill_kernel and mla_decode_kernel.
//
// Tiles stay in their storage dtype (fp8 codes included): 2-4 stages of S::TILE keys, STAGES - 1 tiles in flight,
// each tile's block-table entries read a tile ahead and turned into its keys' row offsets once (KvRows), so
// the 16-byte copies cost a handful of instructions each: a shared load, a 64-bit add, the copy. Rows that are not
// 16-byte aligned are copied element by element; keys past a tile's last and dimensions past the head size are
// zero-filled (src-size 0: never read), so a 0 weight never meets garbage and the tensor cores sum zeros over a
// head-size bucket's padding.
//
// The stage layout concept. A kernel describes its stages by a struct S of static members (PdSmem, PmSmem,
// PfSmem, MdSmem):
//   kv_pipeline reads  TILE      keys a stage (the kernel holds KvRows[STAGES], each stage's row offsets)
//                      STAGES    stages (STAGES - 1 tiles in flight while one is consumed)
//                      STAGE     a stage's bytes: stage i starts at smem + i * STAGE
//                      PREFETCH  read the next tile's block ids into a register while this one is consumed
//                                (false: at the barrier, no register held across a tile)
//   kv_issue reads     K_DIMS, V_DIMS     the K and V row capacities in elements (the head-size buckets)
//                      VT        values arrive as vLLM's V^T ([.., head_size, block_size]): runs of X keys of
//                                one dimension, X = 16 / sizeof(element)
//                      k_at(j, c), v_at(j, c)  byte offsets in a stage of 16-byte chunk c of key j's K, V row
//                      vt_at(run, dim)         byte offset of X-key run `run` of V^T row `dim`
// (MdSmem's latent rows go through kv_issue_rows alone, md_issue; it provides only kv_pipeline's members.)
//
// Used by:   decode.cuh, decode_mma.cuh, prefill.cuh, mla_decode.cuh
// Test:      pytest tests/test_decode_traffic.py tests/test_prefill_traffic.py (each visible byte read once, in
//            whole sectors; >= 32 KB in flight an SM), tests/test_paged_attention.py (unaligned rows, block sizes)
#pragma once
#include "params.cuh"

namespace cupaged {

// 16 bytes global -> shared, of which `bytes` are read (the rest zero-filled: a row's tail past head_size, a run
// past a tile's last key). A run-time src-size costs ptxas 5 instructions around the copy, so only tails take this
// form; whole chunks take kv_copy16.
__device__ __forceinline__ void kv_copy16_part(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(unsigned(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(bytes) : "memory");
}

// 16 bytes global -> shared, or 16 zeros when `zero` (the source ignored: never read): one instruction.
__device__ __forceinline__ void kv_copy16(void* dst, const void* src, bool zero) {
  asm volatile("{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, z;\n}\n"
               ::"r"(unsigned(__cvta_generic_to_shared(dst))), "l"(src), "r"(int(zero)) : "memory");
}

// `bytes` of 16 (0 < bytes < 16: a tail), or 16 zeros when `zero`.
__device__ __forceinline__ void kv_copy(void* dst, const void* src, int bytes, bool zero) {
  if (bytes == 16) kv_copy16(dst, src, zero);
  else kv_copy16_part(dst, src, zero ? 0 : bytes);
}

// X elements into shared memory at dst without cp.async (any alignment): element e from *src(e) for e < n, zero
// after; plain stores, which the pipeline's barrier publishes as it does the copies.
template <class CacheT, int X, class Src>
__device__ __forceinline__ void kv_copy_elems(unsigned char* dst, int n, Src&& src) {
  CacheT* d = reinterpret_cast<CacheT*>(dst);
#pragma unroll 1
  for (int e = 0; e < X; ++e) d[e] = e < n ? *src(e) : CacheT();
}

// Tile u of a CTA's keys lo..hi: its first key and its key count.
struct KvTile {
  int base, n;
};

template <int TILE>
__device__ __forceinline__ KvTile kv_tile(int lo, int hi, int u) {
  const int base = lo + u * TILE;
  return {base, min(TILE, hi - base + 1)};
}

// A stage's rows: for each key j of its tile, the byte offsets (ELEM bytes an element) of the key's K and V rows
// from key_cache and value_cache at kv head 0 (its block's base plus its place in the block; 0 past the tile's
// last key, a real row that the zero-filling copies never read). Written once per tile by the tile's key threads,
// so a copy costs a shared load and a 64-bit add: no block-table lookup, no division by block_size, no product per
// copy. V's are skewed by one every 8 keys, so the V^T runs' first keys (8 or 16 apart: the same bank unskewed)
// are read by a warp's lanes without conflicts.
template <int TILE, int ELEM, bool V = true>  // V false: MLA's latent rows, K and V one row
struct KvRows {
  static constexpr bool HAS_V = V;
  static constexpr int BYTES = ELEM;
  long long k[TILE], v[V ? TILE + TILE / 8 : 1];
  __device__ __forceinline__ long long& v_at(int j) { return v[j + (j >> 3)]; }
  __device__ __forceinline__ long long v_at(int j) const { return v[j + (j >> 3)]; }
};

// The block-table entry that holds key `pos`: a shift when the block size is a power of two, else a division.
__device__ __forceinline__ int kv_block_of(int pos, const PaParams& p) {
  return p.block_shift >= 0 ? pos >> p.block_shift : pos / p.block_size;
}

// Key `pos`'s rows into rows.k[j], rows.v[j]: in block `block` (its table entry) of a paged cache, or row
// key_row0 + pos of dense rows (table nullptr); 0 past hi.
template <class Rows>
__device__ __forceinline__ void kv_place(Rows& rows, int j, int pos, int hi, int block, bool paged, long long key_row0,
                                         const PaParams& p) {
  long long k = 0, v = 0;
  if (pos <= hi) {
    const long long row = paged ? pos - kv_block_of(pos, p) * p.block_size : key_row0 + pos;
    k = (paged ? block * p.k_block_stride : 0) + row * p.k_page_stride;
    v = (paged ? block * p.v_block_stride : 0) + row * p.v_page_stride;
  }
  rows.k[j] = k * Rows::BYTES;
  if constexpr (Rows::HAS_V) rows.v_at(j) = v * Rows::BYTES;
}

// Byte offset of the 16-byte run `run` in V^T row `dim`: an fp8 row holds the 4 runs of a 64-key tile unpadded,
// XOR-swizzled by dim / 2, so a quarter warp's copies (two rows) and ldmatrix's 8 rows at one run are both
// conflict-free; 16-bit rows (8 runs) are padded instead.
template <int X>
__device__ __forceinline__ int kv_vt_col(int run, int dim) {
  return X == 16 ? ((run ^ dim >> 1) & 3) * 16 : run * 16;
}

// The element `bytes` bytes past p (a KvRows offset).
template <class CacheT>
__device__ __forceinline__ const CacheT* kv_at(const CacheT* p, long long bytes) {
  return reinterpret_cast<const CacheT*>(reinterpret_cast<const unsigned char*>(p) + bytes);
}

// The copies of one operand's rows (K, V, or MLA's latent rows) of a tile of n keys: chunk c (X elements) of key
// j's row goes to stage + at(j, c) from src + c * cs elements + row(j) bytes (element e of it e * es further on);
// DIMS elements a row
// of which the first `dims` are real (the rest zero-filled). THREADS threads share the TILE x DIMS / X copies.
// The 16-byte path is branch-free: a thread's chunk is the same in every row it copies when THREADS is a
// multiple of the chunks a row (its rows THREADS / chunks apart), so its byte count and source column are fixed.
template <class CacheT, int TILE, int DIMS, int THREADS, class Row, class At>
__device__ __forceinline__ void kv_issue_rows(unsigned char* stage, const CacheT* src, Row&& row, long long cs,
                                              long long es, int dims, bool vec, int n, At&& at) {
  constexpr int X = 16 / int(sizeof(CacheT)), CHUNKS = DIMS / X, COPIES = TILE * CHUNKS;
  constexpr int PER = (COPIES + THREADS - 1) / THREADS, STEP = THREADS % CHUNKS == 0 ? THREADS / CHUNKS : 0;
  if (vec && STEP) {
    const int c = threadIdx.x % CHUNKS, j0 = threadIdx.x / CHUNKS;
    const int bytes = min(max(dims - c * X, 0), X) * int(sizeof(CacheT));
    const unsigned char* from = reinterpret_cast<const unsigned char*>(bytes ? src + c * cs : src);
    unsigned char* dst = stage + at(j0, c);  // row j0 + s STEP at dst + at(j0 + s STEP, c) - at(j0, c): a constant
    const int left = n - j0;                 // row j0 + s STEP is past the tile's last key when s STEP >= left
    if (bytes == 16 || bytes == 0) {  // whole chunks (every 16-bit head size): a predicate zero-fills
#pragma unroll
      for (int s = 0; s < PER; ++s) {
        const int j = j0 + s * STEP;
        if (COPIES % THREADS == 0 || j < TILE)
          kv_copy16(dst + (at(j, c) - at(j0, c)), from + row(j), s * STEP >= left || !bytes);
      }
    } else {
#pragma unroll
      for (int s = 0; s < PER; ++s) {
        const int j = j0 + s * STEP;
        if (COPIES % THREADS == 0 || j < TILE)
          kv_copy16_part(dst + (at(j, c) - at(j0, c)), from + row(j), s * STEP < left ? bytes : 0);
      }
    }
  } else if (vec) {  // chunks that do not divide the threads (head 192, MLA's 576): a warp a row, a lane a chunk
    constexpr int ROUNDS = (CHUNKS + 31) / 32;
    const int lane = threadIdx.x % 32;
    if (dims >= DIMS) {  // every chunk whole: one predicated copy each
#pragma unroll 1
      for (int j = threadIdx.x / 32; j < TILE; j += THREADS / 32) {
        const CacheT* from = kv_at(src, row(j));
#pragma unroll
        for (int k = 0; k < ROUNDS; ++k)
          if (CHUNKS % 32 == 0 || lane + 32 * k < CHUNKS)
            kv_copy16(stage + at(j, lane + 32 * k), from + (lane + 32 * k) * cs, j >= n);
      }
      return;
    }
#pragma unroll 1
    for (int j = threadIdx.x / 32; j < TILE; j += THREADS / 32) {
      const CacheT* from = kv_at(src, row(j));
#pragma unroll
      for (int k = 0; k < ROUNDS; ++k) {
        const int c = lane + 32 * k, bytes = min(max(dims - c * X, 0), X) * int(sizeof(CacheT));
        if (CHUNKS % 32 == 0 || c < CHUNKS)
          kv_copy(stage + at(j, c), bytes ? from + c * cs : src, bytes, j >= n || !bytes);
      }
    }
  } else {  // element by element: a view at an odd offset, fp8 rows of 72 bytes
    for (int i = threadIdx.x; i < COPIES; i += THREADS) {
      const int j = i / CHUNKS, c = i % CHUNKS;
      const CacheT* from = kv_at(src + c * cs, row(j));
      kv_copy_elems<CacheT, X>(stage + at(j, c), j < n ? min(max(dims - c * X, 0), X) : 0,
                               [&](int e) { return from + e * es; });
    }
  }
}

// vLLM's values as V^T: V_DIMS rows of TILE keys, 16 bytes (a run of X keys of one dimension) a copy at
// S::vt_at(run, dim), from a tile base that is a multiple of X. With 16-byte runs (runs within a block) a thread
// keeps one run, so its run's row offset and byte count are read once a tile; else element by element (runs
// across blocks: each key's own row).
template <class CacheT, class S, class Rows>
__device__ __forceinline__ void kv_issue_vt(unsigned char* stage, const CacheT* src, const Rows& rows, int n,
                                            const PaParams& p) {
  constexpr int X = 16 / int(sizeof(CacheT)), RUNS = S::TILE / X, COPIES = S::V_DIMS * RUNS;
  static_assert(PD_THREADS % RUNS == 0 && COPIES % PD_THREADS == 0, "a thread keeps one run of every tile");
  const int run = threadIdx.x % RUNS, dim0 = threadIdx.x / RUNS, keys = min(max(n - run * X, 0), X);
  if (p.vec_v) {
    const CacheT* from = kv_at(src, rows.v_at(run * X)) + dim0 * p.v_dim_stride;
#pragma unroll
    for (int s = 0; s < COPIES / PD_THREADS; ++s) {
      const int dim = dim0 + s * (PD_THREADS / RUNS);
      kv_copy(stage + S::vt_at(run, dim), from, keys * int(sizeof(CacheT)), !keys || dim >= p.v_head_size);
      from += PD_THREADS / RUNS * p.v_dim_stride;
    }
  } else {
    for (int dim = dim0; dim < S::V_DIMS; dim += PD_THREADS / RUNS)
      kv_copy_elems<CacheT, X>(stage + S::vt_at(run, dim), dim < p.v_head_size ? keys : 0,
                               [&](int e) { return kv_at(src, rows.v_at(run * X + e)) + dim * p.v_dim_stride; });
  }
}

// Issue the copies of a tile of n keys into one stage laid out by S: TILE K rows of S::K_DIMS (chunk c of key j at
// S::k_at(j, c)), then the V tile: TILE V rows of S::V_DIMS like K's (at S::v_at(j, c)) or, for S::VT, V^T
// (kv_issue_vt). `rows`: the stage's KvRows. The CTA's PD_THREADS threads share the copies.
template <class CacheT, class S, class Rows>
__device__ __forceinline__ void kv_issue(unsigned char* stage, const CacheT* key_cache, const CacheT* value_cache,
                                         const Rows& rows, KvTile tile, int kv_head, const PaParams& p) {
  constexpr int X = 16 / int(sizeof(CacheT));
  kv_issue_rows<CacheT, S::TILE, S::K_DIMS, PD_THREADS>(
      stage, key_cache + kv_head * p.k_head_stride, [&](int j) { return rows.k[j]; }, p.k_chunk_stride, 1,
      p.head_size, p.vec_k, tile.n, [](int j, int c) { return S::k_at(j, c); });
  if constexpr (S::VT) {
    kv_issue_vt<CacheT, S>(stage, value_cache + kv_head * p.v_head_stride, rows, tile.n, p);
  } else {
    kv_issue_rows<CacheT, S::TILE, S::V_DIMS, PD_THREADS>(
        stage, value_cache + kv_head * p.v_head_stride, [&](int j) { return rows.v_at(j); }, X * p.v_dim_stride,
        p.v_dim_stride, p.v_head_size, p.vec_v, tile.n, [](int j, int c) { return S::v_at(j, c); });
  }
}

// The pipeline over a CTA's keys lo..hi: issue(stage, rows, tile) starts a tile's copies, consume(stage, first
// key) runs on every tile once all of its copies have landed. A tile's KvRows are placed before the barrier that
// precedes its issue (its table entries read a tile ahead with S::PREFETCH). The barriers wait only for copies
// issued stages ago. `table`: the sequence's block-table row, nullptr for dense rows (from key_row0).
template <class S, class Rows, class Issue, class Consume>
__device__ __forceinline__ void kv_pipeline(unsigned char* smem, Rows* rows, const int* table,
                                            long long key_row0, int lo, int hi, const PaParams& p, Issue&& issue,
                                            Consume&& consume) {
  constexpr int TILE = S::TILE;
  const int ntiles = hi >= lo ? (hi - lo) / TILE + 1 : 0, j = threadIdx.x;
  auto entry = [&](int u) {  // the table entry of this thread's key of tile u (0 past hi, or for dense rows)
    const int pos = lo + u * TILE + j;
    return table && j < TILE && u < ntiles && pos <= hi ? table[kv_block_of(pos, p)] : 0;
  };
  auto place = [&](int u, int block) {
    if (j < TILE) kv_place(rows[u % S::STAGES], j, lo + u * TILE + j, hi, block, table != nullptr, key_row0, p);
  };
  for (int u = 0; u < S::STAGES - 1 && u < ntiles; ++u) place(u, entry(u));  // the first tiles' rows
  __syncthreads();
#pragma unroll
  for (int u = 0; u < S::STAGES - 1; ++u) {  // the prologue: STAGES - 1 tiles in flight
    if (u < ntiles) issue(smem + u * S::STAGE, rows[u], kv_tile<TILE>(lo, hi, u));
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  int next_entry = S::PREFETCH ? entry(S::STAGES - 1) : 0;  // tile STAGES - 1 + t's, read while t - 1 is consumed
  for (int t = 0; t < ntiles; ++t) {
    const int next = t + S::STAGES - 1;
    if (next < ntiles) place(next, S::PREFETCH ? next_entry : entry(next));
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S::STAGES - 2) : "memory");  // tile t's copies landed
    __syncthreads();  // everyone's landed (and the rows above are visible); tile t - 1's stage is free again
    if (next < ntiles) issue(smem + next % S::STAGES * S::STAGE, rows[next % S::STAGES], kv_tile<TILE>(lo, hi, next));
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    if (S::PREFETCH) next_entry = entry(next + 1);
    consume(smem + t % S::STAGES * S::STAGE, lo + t * TILE);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

}  // namespace cupaged
