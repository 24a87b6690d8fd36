// attention/kv_pipeline.cuh: the cp.async pipeline that brings a CTA's K/V tiles into shared memory, shared by
// paged_decode_kernel, paged_decode_mma_kernel, paged_prefill_kernel and mla_decode_kernel.
//
// Tiles stay in their storage dtype (fp8 codes included): 2-4 stages of S::TILE keys, STAGES - 1 tiles in flight,
// each tile's block-table entries read a tile ahead. Rows that are not 16-byte aligned are copied element by
// element; keys past a tile's last and dimensions past the head size are zero-filled (src-size 0: never read), so
// a 0 weight never meets garbage and the tensor cores sum zeros over a head-size bucket's padding.
//
// The stage layout concept. A kernel describes its stages by a struct S of static members (PdSmem, PmSmem,
// PfSmem, MdSmem):
//   kv_pipeline reads  TILE      keys a stage (ids: int[STAGES][TILE + 1], a tile's block-table entries)
//                      STAGES    stages (STAGES - 1 tiles in flight while one is consumed)
//                      STAGE     a stage's bytes: stage i starts at smem + i * STAGE
//                      PREFETCH  read the next tile's block ids into a register while this one is consumed
//                                (false: at the barrier, no register held across a tile)
//   kv_issue reads     K_DIMS, V_DIMS     the K and V row capacities in elements (the head-size buckets)
//                      VT        values arrive as vLLM's V^T ([.., head_size, block_size]): runs of X keys of
//                                one dimension, X = 16 / sizeof(element)
//                      UNROLL    its copy loop's unroll (0: the compiler's choice)
//                      k_at(j, c), v_at(j, c)  byte offsets in a stage of 16-byte chunk c of key j's K, V row
//                      vt_at(run, dim)         byte offset of X-key run `run` of V^T row `dim`
// (MdSmem issues its latent rows itself, md_issue, and provides only kv_pipeline's members.)
//
// Used by:   decode.cuh, decode_mma.cuh, prefill.cuh, mla_decode.cuh
// Test:      pytest tests/test_decode_traffic.py tests/test_prefill_traffic.py (each visible byte read once, in
//            whole sectors; >= 32 KB in flight an SM), tests/test_paged_attention.py (unaligned rows, block sizes)
#pragma once
#include "params.cuh"

namespace cupaged {

// 16 bytes global -> shared, of which `bytes` are read (the rest zero-filled: the row's tail past head_size).
__device__ __forceinline__ void kv_copy16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(unsigned(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(bytes) : "memory");
}

// X elements into shared memory at dst without cp.async (any alignment): element e from *src(e) for e < n, zero
// after; plain stores, which the pipeline's barrier publishes as it does the copies.
template <class CacheT, int X, class Src>
__device__ __forceinline__ void kv_copy_elems(unsigned char* dst, int n, Src&& src) {
  CacheT* d = reinterpret_cast<CacheT*>(dst);
#pragma unroll 1
  for (int e = 0; e < X; ++e) d[e] = e < n ? *src(e) : CacheT();
}

// Tile u of a CTA's keys lo..hi: its first key, its key count and the block-table entries it spans.
struct KvTile {
  int base, n, first_block, blocks;
};

template <int TILE>
__device__ __forceinline__ KvTile kv_tile(int lo, int hi, int u, int block_size) {
  const int base = lo + u * TILE, n = min(TILE, hi - base + 1);
  const int first = base / block_size;
  return {base, n, first, (base + n - 1) / block_size - first + 1};
}

// The block-table entry holding key `pos`: a shift when the block size is a power of two, else a division.
__device__ __forceinline__ int kv_block_of(int pos, const PaParams& p) {
  return p.block_shift >= 0 ? pos >> p.block_shift : pos / p.block_size;
}

// Byte offset of the 16-byte run `run` in V^T row `dim`: an fp8 row holds the 4 runs of a 64-key tile unpadded,
// XOR-swizzled by dim / 2, so a quarter warp's copies (two rows) and ldmatrix's 8 rows at one run are both
// conflict-free; 16-bit rows (8 runs) are padded instead.
template <int X>
__device__ __forceinline__ int kv_vt_col(int run, int dim) {
  return X == 16 ? ((run ^ dim >> 1) & 3) * 16 : run * 16;
}

// Issue the copies of tile `tile` into one stage laid out by S: TILE K rows of S::K_DIMS (every 16-byte chunk c of
// key j at S::k_at(j, c)), then the V tile: TILE V rows of S::V_DIMS like K's (at S::v_at(j, c)) or, for S::VT,
// V^T: V_DIMS rows of TILE keys, 16 bytes (X keys of one dimension) a copy at S::vt_at(run, dim), from a tile base
// that is a multiple of X in blocks of whole X-key runs. `ids`: the tile's block ids (ids[b] = block of table
// entry first_block + b), nullptr for dense rows. The CTA's PD_THREADS threads share the copies.
template <class CacheT, class S>
__device__ __forceinline__ void kv_issue(unsigned char* stage, const CacheT* key_cache, const CacheT* value_cache,
                                         const int* ids, KvTile tile, long long key_row0, int kv_head,
                                         const PaParams& p) {
  constexpr int X = 16 / int(sizeof(CacheT)), TILE = S::TILE, KC = S::K_DIMS / X;
  constexpr int COPIES = TILE * KC + TILE * S::V_DIMS / X;  // K's, then V's (V_DIMS rows of TILE / X runs for V^T)
  auto at = [&](bool is_v, int j, int c) {  // element c of key j's K row (X-element chunk c), V row or V^T column
    const int pos = tile.base + j, b = kv_block_of(pos, p);
    const long long block = ids ? ids[b - tile.first_block] : 0;
    const long long off = ids ? pos - b * p.block_size : key_row0 + pos;
    return !is_v ? key_cache + block * p.k_block_stride + kv_head * p.k_head_stride + c / X * p.k_chunk_stride +
                       off * p.k_page_stride + c % X
                 : value_cache + block * p.v_block_stride + kv_head * p.v_head_stride + off * p.v_page_stride +
                       c * p.v_dim_stride;
  };
  auto copy = [&](int i) {
    const bool is_v = i >= TILE * KC, vt = S::VT && is_v;
    const int k = i - is_v * TILE * KC, vc = S::V_DIMS / X;
    const int j = vt ? k % (TILE / X) * X : is_v ? k / vc : k / KC;  // key
    const int c = vt ? k / (TILE / X) : is_v ? k % vc : k % KC;      // chunk, or V^T's dimension
    const int dims = is_v ? p.v_head_size : p.head_size;
    const int n = j >= tile.n ? 0 : vt ? (c < dims ? min(X, tile.n - j) : 0) : min(max(dims - c * X, 0), X);
    unsigned char* dst = stage + (vt ? S::vt_at(j / X, c) : is_v ? S::v_at(j, c) : S::k_at(j, c));
    if (is_v ? p.vec_v : p.vec_k) {  // one cp.async: 16-byte aligned rows, V^T runs of X keys within a block
      kv_copy16(dst, n ? at(is_v, j, vt ? c : c * X) : key_cache, n * int(sizeof(CacheT)));
    } else {  // element by element: a view at an odd offset, fp8 rows of 72 bytes, V^T runs across blocks
      kv_copy_elems<CacheT, X>(dst, n, [&](int e) { return vt ? at(true, j + e, c) : at(is_v, j, c * X + e); });
    }
  };
  if constexpr (S::UNROLL > 0) {  // the copies' addresses live at once while q and o are: a register budget
#pragma unroll S::UNROLL
    for (int i = threadIdx.x; i < COPIES; i += PD_THREADS) copy(i);
  } else {
    for (int i = threadIdx.x; i < COPIES; i += PD_THREADS) copy(i);
  }
}

// The pipeline over a CTA's keys lo..hi: issue(stage, ids, tile) starts a tile's copies (ids: its block ids,
// nullptr for dense rows), consume(stage, first key) runs on every tile once all of its copies have landed. The
// barriers wait only for copies issued stages ago.
template <class S, class Issue, class Consume>
__device__ __forceinline__ void kv_pipeline(unsigned char* smem, int (*ids)[S::TILE + 1], const int* table, int lo,
                                            int hi, const PaParams& p, Issue&& issue, Consume&& consume) {
  const int ntiles = hi >= lo ? (hi - lo) / S::TILE + 1 : 0;
  for (int u = 0; table && u < S::STAGES - 1 && u < ntiles; ++u) {  // the first tiles' block ids
    const KvTile tile = kv_tile<S::TILE>(lo, hi, u, p.block_size);
    if (threadIdx.x < tile.blocks) ids[u][threadIdx.x] = table[tile.first_block + threadIdx.x];
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < S::STAGES - 1; ++u) {  // the prologue: STAGES - 1 tiles in flight
    if (u < ntiles) issue(smem + u * S::STAGE, table ? ids[u] : nullptr, kv_tile<S::TILE>(lo, hi, u, p.block_size));
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  int next_id = 0;  // a block id of tile STAGES - 1 + t, fetched while tile t - 1 is consumed (S::PREFETCH)
  const KvTile first_next = kv_tile<S::TILE>(lo, hi, S::STAGES - 1, p.block_size);
  if (S::PREFETCH && table && S::STAGES - 1 < ntiles && threadIdx.x < first_next.blocks)
    next_id = table[first_next.first_block + threadIdx.x];
  for (int t = 0; t < ntiles; ++t) {
    const int next = t + S::STAGES - 1;
    const KvTile tile = kv_tile<S::TILE>(lo, hi, next, p.block_size);
    if (table && next < ntiles && threadIdx.x < tile.blocks)
      ids[next % S::STAGES][threadIdx.x] = S::PREFETCH ? next_id : table[tile.first_block + threadIdx.x];
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S::STAGES - 2) : "memory");  // tile t's copies landed
    __syncthreads();  // everyone's landed (and the ids above are visible); tile t - 1's stage is free again
    if (next < ntiles) issue(smem + next % S::STAGES * S::STAGE, table ? ids[next % S::STAGES] : nullptr, tile);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    const KvTile after = kv_tile<S::TILE>(lo, hi, next + 1, p.block_size);
    if (S::PREFETCH && table && next + 1 < ntiles && threadIdx.x < after.blocks)
      next_id = table[after.first_block + threadIdx.x];
    consume(smem + t % S::STAGES * S::STAGE, lo + t * S::TILE);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

}  // namespace cupaged
