// paged_attention.cu: attention of varlen queries over a paged KV cache, split-KV with an LSE merge.
//
// Maths, per query row (token t of sequence s at position p = seq_len - q_len + i, head h):
//   s_j = softcap(scale * q . k_j) - slope_h * |j - p|      for visible keys j
//   out = sum_j e^{s_j - M} v_j / (sum_j e^{s_j - M} + e^{sink_h - M}),  LSE = M + log(denominator)
// visible: j < seq_len and p - window_left <= j <= p + window_right (-1: unbounded; causal: window_right 0). fp32
// online softmax.
//
// Layouts (docs/conventions.md §4), strides in elements; the key cache is addressed as
//   block * k_block_stride + head * k_head_stride + (d / X) * k_chunk_stride + pos * k_page_stride + d % X
// with X = 16 / sizeof(cache element), which covers flash NHD/HND (k_chunk_stride = X) and vLLM's
// [num_blocks, num_kv_heads, head_size / X, block_size, X]; values are
//   block * v_block_stride + head * v_head_stride + pos * v_page_stride + d * v_dim_stride
// (flash: v_dim_stride = 1; vLLM [num_blocks, num_kv_heads, head_size, block_size]: v_page_stride = 1).
//   q            [num_tokens, num_heads, head_size]  (any token stride)
//   out          [num_tokens, num_heads, v_head_size] (v_head_size = head_size except MLA / varlen 192-128)
//   lse          [num_heads, num_tokens] float32, natural log
//   max_logits, exp_sums [num_tokens, num_heads, max_splits] float32; tmp_output [..., v_head_size] float32
//                (out's type for vLLM v2)
// Dense varlen mode (block_tables == nullptr): key j of sequence b is row cu_seqlens_k[b] + j of a
// [total_k, num_kv_heads, head_size] array (k_page_stride = its token stride) and the context length
// is seqused_k[b] when given, else cu_seqlens_k[b + 1] - cu_seqlens_k[b]. MLA: the value of a key is the first
// v_head_size entries of its latent row, so one shared-memory tile serves as both K and V.
//
// Kernels: one CTA per (kv head, sequence, KV split, tile of query rows), the rows (token, head) pairs of one
// GQA group, so every K/V byte a CTA reads serves all of its query heads; a CTA also takes its sequence's later
// row tiles (rows past the max_query_len hint). K/V tiles stay in their storage dtype in shared memory, filled
// by one cp.async pipeline (pd_pipeline: 2-4 stages, block ids fetched a tile ahead; rows that are not 16-byte
// aligned are copied element by element), and only the union of the rows' visible keys is loaded: masking is
// selection, never a zero weight times a loaded value. A sequence whose context fits one split finishes out/LSE
// itself (softmax_finish, softmax.cuh); otherwise each split writes float32 partials (max, exp-sum relative to
// it, normalized output) and
//   paged_attention_reduce_kernel merges the splits of one (token, head) and 128 columns, adding the sink once
//      (softmax_merge): each split's weight once into shared memory, then the partial rows read coalesced (4
//      columns a lane), the 4 warps' loads in flight together (each takes every fourth split), their sums added
//      in a fixed order.
// The plan routes each sequence by its q_len: runs of up to PD_MAX_Q (decode, speculative decoding) take a
// decode kernel, longer ones the prefill kernel; float32 q, vLLM's layout and MLA take their decode kernel for
// every run.
//   paged_decode_kernel<T, KV, HD, VT>: tiles of PD_ROWS = 4 query rows on CUDA cores, every dtype (the float32
//      path for every run length). A lane owns 8 dimensions of a key row (LPR = HD / 8 lanes a row), so a
//      whole-row vector load from shared memory feeds all the rows, whose q and output accumulators live in
//      registers; fp8 converts in pairs in registers, its scales folded into q and the output; vLLM's values (VT)
//      arrive as V^T tiles read down a column. Each slot of LPR lanes keeps its own online softmax over the keys
//      it took; slots merge by shuffles, warps through shared memory, once at the end.
//   paged_decode_mma_kernel<T, KV, HD, VT>: the same on tensor cores for tiles of 8 query rows: GQA groups over
//      4, or any group over vLLM's layout (VT: its V^T tiles are the A operand as they lie); 16-bit q, head
//      sizes up to 128. S^T = K Q^T and O^T += V^T P^T by mma.sync m16n8k16, 16 keys a warp, P in 16-bit parts:
//      fp32-P accuracy; see its section below.
//   paged_prefill_kernel<T, KV, HD, VHD>: FlashAttention-2 on tensor cores for the longer runs of 16-bit q over
//      K/V rows (flash NHD / HND, dense varlen rows, QK 192 / V 128 included): 128 query rows a CTA (64 above
//      V 128), Q K^T and P V by mma.sync m16n8k16 from XOR-swizzled shared tiles, P rounded to 16 bits; see its
//      section below.
//   mla_decode_kernel<T, KV, MT>: MLA over a paged latent cache (16-bit q; every run, a CTA one query at a time)
//      on tensor cores: 16 MT query heads a CTA (MT 1: 16 heads, 128 threads; MT 2: 32 heads, 256 threads), S =
//      Q K^T by mma.sync m16n8k16 (q in registers, K by ldmatrix), P V by m16n8k8 with P split into 16-bit parts
//      (V by ldmatrix.trans), so P V keeps fp32-P accuracy; see its section below.
//   Head tiles of one split are adjacent in the grid, so the CTAs reading the same cache bytes run together and
//   share them in L2.
//
// Versions (the code below is the last):
//   v1: partials in out's type, one row tile per CTA, splits from kv_split_size alone, q . k in one sum.
//   v2: float32 partials (v1's bf16 decode was off by up to ~3,800 ulps); a CTA loops over its sequence's
//       row tiles and splits clamp to the partial buffers, so understated host hints stay correct; q . k in
//       four sums.
//   v3: paged_decode_kernel for short query runs (H200 model, bench_paged_attention.py --model): decode
//       64 x 4096, 32/8 heads, d128 fp16 1036.7 -> 226.8 us (21.6% -> 98.7% of HBM peak); fp8_e4m3 1321.0 ->
//       115.0 us (0.51x fp16, 97.5%); 64/8 bf16 1635.6 -> 227.8 us (98.4%); 1 x 32768 split 156.0 -> 36.1 us
//       (77.6%; the merge now reads each split's weight once: 24.6 -> 5.5 us). q kept in its own type: 128
//       registers for 16-bit ROWS 4, 130-153 for float32, 222-255 for ROWS 8; no spills.
//   v4: mla_decode_kernel (H200 model, bench_mla.py --model, 64 x 4096, 576/512, bf16): 16 heads 1383.2 ->
//       71.8 us (4.6% -> 88.3% of HBM peak), 128 heads 11014.8 -> 246.4 us (296 TFLOP/s; mma term 221.5 us with
//       bf16 P in three parts, shared memory 229.2 us: 3282 wavefronts a 32-key tile at 64 heads, no bank
//       conflicts); 128 registers, no spills.
//   v5: paged_decode_mma_kernel for GQA over 4 and vLLM's layout (H200 model, 64 x 4096, 64/8 heads, d128: bf16
//       227.8 -> 226.8 us, 98.8% of HBM peak; fp8_e4m3 114.7 us) within 128 registers (8 rows on CUDA cores took
//       222-255); paged_decode_kernel keeps 4 rows (float32 now within 128); one cp.async pipeline for the three
//       decode kernels; splits from the decode kernel's occupancy (a grid under 90% of a wave of resident CTAs
//       splits into >= 2 full waves: 1 x 32768 in 99 splits, not 32: 36.1 -> 36.4 us, 76.9%); the merge reads 4
//       columns a lane, 4 warps' loads in flight. MLA (bench_mla.py --model): 128 heads no longer split, 246.4 ->
//       231.0 us; 16 heads now split into 2 waves, 71.8 -> 81.4 us (77.9%; the partials of 12 splits).
//   v6: paged_prefill_kernel for query runs over 16 (H200 model, bench_paged_attention.py --model): prefill 8 x 2048
//       causal, 32/8 heads, d128, bf16 ~30 ms -> 871.8 us (315 TFLOP/s); varlen 4 x 4096 192/128 non-causal, 128
//       heads: 433 TFLOP/s (66% of the mma.sync peak); a mixed batch of 4 chunks of 512 and 256 decode tokens
//       613.9 us = 1.00x its halves alone. paged_attention_kernel (fp32 FMAs from shared memory, 16 rows a CTA)
//       deleted: float32 takes paged_decode_kernel for every run, vLLM's values as V^T tiles there too, and
//       mla_decode_kernel every MLA run, in CTAs of 16 or 32 heads within 255 registers (64-head CTAs of 512
//       threads spilled at 128 once it looped over queries; MLA 64 x 4096, 128 heads: 231.0 -> 260.9 us, two
//       waves of 32-head CTAs re-reading the latent rows). FlashAttention's window_size (both sides, causal or
//       not) and seqused_k.
//
// Uses:      common.cuh, softmax.cuh, tensor_core.cuh (ldmatrix / mma.sync as inline PTX)
// Used by:   cupaged/attention.py (the family; plan_attention / run_attention launch both kernels, reading
//            PA_* and PaParams from this file through cupaged/_mirror.py), paged_attention.py,
//            paged_attention_vllm.py (v1/v2), varlen_attention.py, mla.py (mla_decode, mla_chunked_prefill),
//            _attention_args.py (the cache strides), selftest.py; oracle: cupaged/reference/attention.py
// Test:      pytest tests/test_paged_attention.py tests/test_paged_attention_vllm.py tests/test_varlen_attention.py
//            tests/test_mla.py tests/test_decode_accuracy.py tests/test_attention_hints.py
//            tests/test_attention_plan.py tests/test_mirror.py; also test_bad_input.py, test_api_fuzz.py,
//            test_kv_cache.py, test_cost.py, test_sim_alignment.py, test_sim_model.py, test_sim_launch.py,
//            test_compile_gate.py, test_decode_traffic.py (the decode kernel's exact traffic counts)
// Benchmark: python profiling/bench_paged_attention.py; python profiling/bench_mla.py (MLA decode)
#include "common.cuh"
#include "softmax.cuh"
#include "tensor_core.cuh"

namespace cupaged {

constexpr int PA_THREADS = 128;  // 4 warps
constexpr int PA_MERGE_COLS = 128;  // the reduce kernel's output columns a CTA: 4 a lane
// Occupancy budgets, read by the host's plan (cupaged/_attention_kernels.py) through cupaged/_mirror.py.
constexpr int SM_REGISTERS = 65536;  // 32-bit registers of an SM (sm_80, sm_90)
constexpr int PD_REGISTERS = 128;    // a thread's registers in the decode kernels: 4 CTAs of PD_THREADS an SM
constexpr int PF_REGISTERS = 255;    // a thread's registers in the prefill kernel (ptxas's most): 2 CTAs an SM
constexpr int MD_REGISTERS = 255;    // a thread's registers in the MLA decode kernel: 2 CTAs of 128, 1 of 256
constexpr int PD_SMEM_FOR_4 = 65536;   // paged_decode_kernel: 4 stages where they fit in these bytes,
constexpr int PD_SMEM_FOR_3 = 98304;   // else 3 in these, else 2
constexpr int PM_SMEM_FOR_3 = 65536;   // paged_decode_mma_kernel: 3 stages where they fit in these bytes, else 2
constexpr int PF_SMEM_FOR_3 = 101376;  // paged_prefill_kernel: 3 stages where they and its q tile fit in 99 KB
                                       // (sm_86 / sm_89's most a block), else 2
constexpr int MD_STAGES_16 = 2;  // mla_decode_kernel's stages with 16 heads a CTA (2 CTAs an SM)
constexpr int MD_STAGES_32 = 3;  // and with 32 heads (1 CTA an SM)


// One query row of a CTA.
struct PaRow {
  int token, head, lo, hi;  // keys lo..hi (inclusive) are visible within this split
  float slope, sink;
  int pos;                  // the query's position (the decode kernel's ALiBi distance)
};

struct PaParams {
  long long q_token_stride, q_head_stride, out_token_stride, out_head_stride;
  long long k_block_stride, k_head_stride, k_chunk_stride, k_page_stride;
  long long v_block_stride, v_head_stride, v_page_stride, v_dim_stride;
  long long table_stride;
  float scale, softcap, k_scale_value, v_scale_value;
  int scale_per_head, always_partials, partials_in_out_type;
  int window_left, window_right;  // a query at position pos sees keys pos - window_left .. pos + window_right (-1: no
                                  // bound; causal: window_right 0; sliding_window W: window_left W - 1)
  int num_tokens, num_heads, num_kv_heads, head_size, v_head_size, block_size, kv_split_size, max_splits;
  int tiles;         // paged_prefill_kernel's grid: row tiles of its ROWS
  int vec_k, vec_v;  // 16-byte copies allowed (alignment checked by the wrapper; V: of rows, or of vLLM's V^T runs of
                     // 16 bytes within a block)
  int decode_tiles;  // the decode kernel's grid: row tiles of its ROWS (MLA: head tiles x queries)
  int decode_max_q;  // sequences with q_len <= decode_max_q are the decode kernel's, the rest paged_prefill_kernel's
  int block_shift;   // log2(block_size) when it is a power of two (shifts, not a division per copy), else -1
};

// Split partial outputs are float32, so the merge sees them unrounded; vLLM v2's tmp_output has the
// output's type (p.partials_in_out_type), as vLLM's does.
template <class T>
__device__ __forceinline__ void pa_store_partial(void* tmp, long long i, float x, int in_out_type) {
  if (in_out_type) static_cast<T*>(tmp)[i] = from_float<T>(x);
  else static_cast<float*>(tmp)[i] = x;
}

// Partials i .. i + 3 (i a multiple of 4): one 16-byte load of float32 (8 of 16-bit) when the address allows it.
template <class T>
__device__ __forceinline__ float4 pa_load_partial4(const void* tmp, long long i, int in_out_type) {
  if (in_out_type) {
    const T* x = static_cast<const T*>(tmp) + i;
    if (reinterpret_cast<unsigned long long>(x) % 8 == 0) {
      const Vec<T, 4> v = load_vec<T, 4>(x);
      return make_float4(to_float(v.v[0]), to_float(v.v[1]), to_float(v.v[2]), to_float(v.v[3]));
    }
    return make_float4(to_float(x[0]), to_float(x[1]), to_float(x[2]), to_float(x[3]));
  }
  const float* x = static_cast<const float*>(tmp) + i;
  if (reinterpret_cast<unsigned long long>(x) % 16 == 0) return *reinterpret_cast<const float4*>(x);
  return make_float4(x[0], x[1], x[2], x[3]);
}

// The splits of one sequence: ceil(seq_len / kv_split_size) of kv_split_size keys, but never more than
// max_splits, the depth of the partial buffers (sized from the host's max_seq_len hint): a context longer
// than the hint said gets fewer, larger splits instead of writing into another row's partials.
struct PaSplits {
  int count, size;
};

__device__ __forceinline__ PaSplits pa_splits(int seq_len, const PaParams& p) {
  if (p.kv_split_size <= 0) return {1, max(seq_len, 1)};
  const int count = max(1, (seq_len + p.kv_split_size - 1) / p.kv_split_size);
  if (count <= p.max_splits) return {count, p.kv_split_size};
  const int size = (seq_len + p.max_splits - 1) / p.max_splits;
  return {(seq_len + size - 1) / size, size};
}

// A CTA's sequence and split: where its keys are, its query run, and the keys split_lo..split_hi it covers.
struct PaSeq {
  long long key_row0;  // dense rows: the first key's row
  int seq_len, q_start, q_len;
  PaSplits splits;
  int split_lo, split_hi;
};

__device__ __forceinline__ PaSeq pa_seq(int seq, int split, const int* block_tables, const int* seq_lens,
                                        const int* query_start_loc, const int* seqused_k, const PaParams& p) {
  PaSeq s;
  const bool dense = block_tables == nullptr;
  s.key_row0 = dense ? seq_lens[seq] : 0;
  s.seq_len = !dense ? seq_lens[seq] : seqused_k ? seqused_k[seq] : seq_lens[seq + 1] - seq_lens[seq];
  s.q_start = query_start_loc ? query_start_loc[seq] : seq;
  s.q_len = query_start_loc ? query_start_loc[seq + 1] - s.q_start : 1;
  s.splits = pa_splits(s.seq_len, p);
  s.split_lo = split * s.splits.size;
  s.split_hi = min(s.seq_len, s.split_lo + s.splits.size) - 1;
  return s;
}

// The keys 0 .. seq_len - 1 a query at position pos sees: pos - window_left .. pos + window_right, each side
// unbounded at -1 (an empty range when lo > hi, e.g. a causal query before the first key).
struct PaRange {
  int lo, hi;
};

__device__ __forceinline__ PaRange pa_visible(int pos, int seq_len, const PaParams& p) {
  const int lo = p.window_left >= 0 && p.window_left < pos ? pos - p.window_left : 0;
  const int hi = p.window_right >= 0 && p.window_right < seq_len - 1 - pos ? pos + p.window_right : seq_len - 1;
  return {lo, hi};
}

// ---- The decode kernels: sequences whose query run is short (q_len <= PD_MAX_Q; every run for float32 q and
// vLLM's layout), any layout (rows that are not 16-byte aligned are copied element by element). K/V stay in their
// storage dtype in shared memory, filled by a 2-4 stage cp.async pipeline whose block ids are fetched a stage
// ahead (pd_pipeline). paged_decode_kernel takes up to PD_ROWS = 4 query rows a CTA on CUDA cores: a lane owns 8
// dimensions of a key row, so the LPR = HD / 8 lanes of a slot read one row with conflict-free vector loads
// and that row serves all the CTA's rows, whose q and output accumulators live in registers; every slot keeps
// its own online softmax over the keys it consumed, the slots of a warp and then the warps merge once at the
// end. paged_decode_mma_kernel takes 8 rows a CTA on tensor cores, for GQA groups over 4 (its section below).
constexpr int PD_THREADS = 128;  // 4 warps; a warp consumes its own slice of the keys of every stage
constexpr int PD_TILE = 32;      // keys per pipeline stage of paged_decode_kernel (16 for float32 head 256) and MLA's
constexpr int PD_MAX_Q = 16;     // the longest query run the decode kernels take
constexpr int PD_ROWS = 4;       // query rows per paged_decode_kernel CTA (8 would need ~230 registers)

template <class CacheT, int HD, bool V_TRANSPOSED>
struct PdSmem {
  static constexpr int TILE = sizeof(CacheT) == 4 && HD == 256 ? 16 : PD_TILE;  // keys a stage (16: 3 stages < 99 KB)
  static constexpr int PITCH = HD * int(sizeof(CacheT));                  // K (and V) rows' bytes
  static constexpr int K_DIMS = HD, V_DIMS = HD;
  static constexpr bool PREFETCH = true;                                  // block ids a tile ahead (pd_pipeline)
  static constexpr bool VT = V_TRANSPOSED;  // vLLM's values: V^T rows of TILE keys (+16 bytes), read down a column
  static constexpr int VT_PITCH = TILE * int(sizeof(CacheT)) + 16;
  static constexpr int UNROLL = sizeof(CacheT) == 4 ? 1 : 0;  // pd_issue's loop (0: the compiler's choice); float32
                                                              // not unrolled: its copies' addresses would spill
  static constexpr int STAGE = TILE * PITCH + (VT ? HD * VT_PITCH : TILE * PITCH);  // K tile then V tile, bytes
  static constexpr int STAGES = 4 * STAGE <= PD_SMEM_FOR_4 ? 4 : 3 * STAGE <= PD_SMEM_FOR_3 ? 3 : 2;
  static constexpr int MERGE = 4 * PD_ROWS * (HD + 2) * 4;                // per warp: m, l, o of each row
  static constexpr int BYTES = STAGES * STAGE > MERGE ? STAGES * STAGE : MERGE;
  static __device__ __forceinline__ int k_at(int j, int c) { return j * PITCH + c * 16; }  // pd_issue's placement
  static __device__ __forceinline__ int v_at(int j, int c) { return (TILE + j) * PITCH + c * 16; }
  static __device__ __forceinline__ int vt_at(int run, int dim) { return TILE * PITCH + dim * VT_PITCH + run * 16; }
};

// 16 bytes global -> shared, of which `bytes` are read (the rest zero-filled: the row's tail past head_size).
__device__ __forceinline__ void pd_copy16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(unsigned(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(bytes) : "memory");
}

// X elements into shared memory at dst without cp.async (any alignment): element e from *src(e) for e < n, zero
// after; plain stores, which the pipeline's barrier publishes as it does the copies.
template <class CacheT, int X, class Src>
__device__ __forceinline__ void pd_copy_elems(unsigned char* dst, int n, Src&& src) {
  CacheT* d = reinterpret_cast<CacheT*>(dst);
#pragma unroll 1
  for (int e = 0; e < X; ++e) d[e] = e < n ? *src(e) : CacheT();
}

// A decode kernel's K or V scale for kv head `kv_head`: 1 for a cache of q's own type (scales ignored).
template <int KV>
__device__ __forceinline__ float pd_scale(const float* ptr, float value, int kv_head, const PaParams& p) {
  return KV == KV_AUTO ? 1.0f : read_scale(ptr, value, p.scale_per_head, kv_head);
}

// Tile u of a CTA's keys lo..hi: its first key, its key count and the block-table entries it spans.
struct PdTile {
  int base, n, first_block, blocks;
};

template <int TILE>
__device__ __forceinline__ PdTile pd_tile(int lo, int hi, int u, int block_size) {
  const int base = lo + u * TILE, n = min(TILE, hi - base + 1);
  const int first = base / block_size;
  return {base, n, first, (base + n - 1) / block_size - first + 1};
}

// The block-table entry holding key `pos`: a shift when the block size is a power of two, else a division.
__device__ __forceinline__ int pd_block_of(int pos, const PaParams& p) {
  return p.block_shift >= 0 ? pos >> p.block_shift : pos / p.block_size;
}

// Byte offset of the 16-byte run `run` in V^T row `dim`: an fp8 row holds the 4 runs of a 64-key tile unpadded,
// XOR-swizzled by dim / 2, so a quarter warp's copies (two rows) and ldmatrix's 8 rows at one run are both
// conflict-free; 16-bit rows (8 runs) are padded instead.
template <int X>
__device__ __forceinline__ int pd_vt_col(int run, int dim) {
  return X == 16 ? ((run ^ dim >> 1) & 3) * 16 : run * 16;
}

// Issue the copies of tile `tile` into one stage laid out by S (PdSmem, PmSmem, PfSmem): TILE K rows of S::K_DIMS
// (every 16-byte chunk c of key j at S::k_at(j, c)), then the V tile: TILE V rows of S::V_DIMS like K's (at
// S::v_at(j, c)) or, for vLLM's [.., head_size, block_size] values (S::VT), V^T: V_DIMS rows of TILE keys, 16 bytes
// (X keys of one dimension) a copy at S::vt_at(run, dim), from a tile base that is a multiple of X in blocks of whole
// X-key runs. `ids`: the tile's block ids (ids[b] = block of table entry first_block + b), nullptr for dense rows.
// Keys past the tile's last and dimensions past head_size / v_head_size are zero-filled (src-size 0: not read), so
// a 0 weight never meets garbage and the tensor cores sum zeros over a bucket's padding.
template <class CacheT, class S>
__device__ __forceinline__ void pd_issue(unsigned char* stage, const CacheT* key_cache, const CacheT* value_cache,
                                         const int* ids, PdTile tile, long long key_row0, int kv_head,
                                         const PaParams& p) {
  constexpr int X = 16 / int(sizeof(CacheT)), TILE = S::TILE, KC = S::K_DIMS / X;
  constexpr int COPIES = TILE * KC + TILE * S::V_DIMS / X;  // K's, then V's (V_DIMS rows of TILE / X runs for V^T)
  auto at = [&](bool is_v, int j, int c) {  // element c of key j's K row (X-element chunk c), V row or V^T column
    const int pos = tile.base + j, b = pd_block_of(pos, p);
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
      pd_copy16(dst, n ? at(is_v, j, vt ? c : c * X) : key_cache, n * int(sizeof(CacheT)));
    } else {  // element by element: a view at an odd offset, fp8 rows of 72 bytes, V^T runs across blocks
      pd_copy_elems<CacheT, X>(dst, n, [&](int e) { return vt ? at(true, j + e, c) : at(is_v, j, c * X + e); });
    }
  };
  if constexpr (S::UNROLL > 0) {  // the copies' addresses live at once while q and o are: a register budget
#pragma unroll S::UNROLL
    for (int i = threadIdx.x; i < COPIES; i += PD_THREADS) copy(i);
  } else {
    for (int i = threadIdx.x; i < COPIES; i += PD_THREADS) copy(i);
  }
}

// The cp.async pipeline of a decode CTA over its keys lo..hi: S::STAGES stages of S::TILE keys, STAGES - 1 tiles
// in flight, each tile's block ids fetched while the tile before it is consumed; issue(stage, ids, tile) starts a
// tile's copies (ids: its block ids, nullptr for dense rows), consume(stage, first key) runs on every tile once
// all of its copies have landed. The barriers wait only for copies issued stages ago.
template <class S, class Issue, class Consume>
__device__ __forceinline__ void pd_pipeline(unsigned char* smem, int (*ids)[S::TILE + 1], const int* table, int lo,
                                            int hi, const PaParams& p, Issue&& issue, Consume&& consume) {
  const int ntiles = hi >= lo ? (hi - lo) / S::TILE + 1 : 0;
  for (int u = 0; table && u < S::STAGES - 1 && u < ntiles; ++u) {  // the first tiles' block ids
    const PdTile tile = pd_tile<S::TILE>(lo, hi, u, p.block_size);
    if (threadIdx.x < tile.blocks) ids[u][threadIdx.x] = table[tile.first_block + threadIdx.x];
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < S::STAGES - 1; ++u) {  // the prologue: STAGES - 1 tiles in flight
    if (u < ntiles) issue(smem + u * S::STAGE, table ? ids[u] : nullptr, pd_tile<S::TILE>(lo, hi, u, p.block_size));
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  int next_id = 0;  // a block id of tile STAGES - 1 + t, fetched while tile t - 1 is consumed (S::PREFETCH)
  const PdTile first_next = pd_tile<S::TILE>(lo, hi, S::STAGES - 1, p.block_size);
  if (S::PREFETCH && table && S::STAGES - 1 < ntiles && threadIdx.x < first_next.blocks)
    next_id = table[first_next.first_block + threadIdx.x];
  for (int t = 0; t < ntiles; ++t) {
    const int next = t + S::STAGES - 1;
    const PdTile tile = pd_tile<S::TILE>(lo, hi, next, p.block_size);
    if (table && next < ntiles && threadIdx.x < tile.blocks)
      ids[next % S::STAGES][threadIdx.x] = S::PREFETCH ? next_id : table[tile.first_block + threadIdx.x];
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S::STAGES - 2) : "memory");  // tile t's copies landed
    __syncthreads();  // everyone's landed (and the ids above are visible); tile t - 1's stage is free again
    if (next < ntiles) issue(smem + next % S::STAGES * S::STAGE, table ? ids[next % S::STAGES] : nullptr, tile);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    const PdTile after = pd_tile<S::TILE>(lo, hi, next + 1, p.block_size);
    if (S::PREFETCH && table && next + 1 < ntiles && threadIdx.x < after.blocks)
      next_id = table[after.first_block + threadIdx.x];
    consume(smem + t % S::STAGES * S::STAGE, lo + t * S::TILE);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// Query row r of a decode CTA's tile at row0 ((token, head) pairs of the sequence's GQA group, token-major): its
// keys lo..hi within this split (lo > hi: none, as for rows past nrows).
__device__ __forceinline__ PaRow pd_row(int r, int row0, int nrows, int group, int kv_head, const PaSeq& sq,
                                        const float* sinks, const float* alibi_slopes, const PaParams& p) {
  PaRow row{0, 0, 0, -1, 0.0f, neg_inf(), 0};
  if (r < nrows) {
    const int i = (row0 + r) / group;
    row.pos = sq.seq_len - sq.q_len + i;
    row.token = sq.q_start + i;
    row.head = kv_head * group + (row0 + r) % group;
    const PaRange vis = pa_visible(row.pos, sq.seq_len, p);
    row.lo = max(vis.lo, sq.split_lo);
    row.hi = min(vis.hi, sq.split_hi);
    row.slope = alibi_slopes ? alibi_slopes[row.head] : 0.0f;
    row.sink = sinks ? sinks[row.head] : neg_inf();
  }
  return row;
}

// A lane's 8 elements of a shared K/V row, loaded whole (one conflict-free 16-byte load for 16-bit types, 8
// bytes for fp8, two 16-byte loads for float32), and element pair e, e + 1 of them as float32, unscaled (the
// caller folds an fp8 scale into q or the output): fp8 codes convert as a pair in registers.
template <class CacheT>
struct PdRow8 {
  Vec<CacheT, 8> v;
};

template <class CacheT, int STRIDE = 1>
__device__ __forceinline__ PdRow8<CacheT> pd_load8(const CacheT* row) {
  PdRow8<CacheT> r;
  if constexpr (STRIDE > 1) {  // a column of a V^T tile: elements STRIDE apart
#pragma unroll
    for (int e = 0; e < 8; ++e) r.v.v[e] = row[e * STRIDE];
  } else if constexpr (sizeof(CacheT) == 4) {
    const Vec<CacheT, 4> a = load_vec<CacheT, 4>(row), b = load_vec<CacheT, 4>(row + 4);
#pragma unroll
    for (int e = 0; e < 4; ++e) { r.v.v[e] = a.v[e]; r.v.v[e + 4] = b.v[e]; }
  } else {
    r.v = load_vec<CacheT, 8>(row);
  }
  return r;
}

template <int KV, class CacheT>
__device__ __forceinline__ float2 pd_pair(const PdRow8<CacheT>& r, int e) {
  if constexpr (KV != KV_AUTO) {
    const unsigned short codes = (unsigned short)(r.v.v[e] | (r.v.v[e + 1] << 8));
    return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(codes, KV == KV_E4M3 ? __NV_E4M3 : __NV_E5M2)));
  } else {
    return make_float2(to_float(r.v.v[e]), to_float(r.v.v[e + 1]));
  }
}

// The end of a decode CTA's row tile, once every warp has written its (m, l, o) of each of the ROWS rows to `smem`
// as [4][ROWS] maxima, [4][ROWS] sums, [4][ROWS][HD] outputs (o with the V scale): merge the warps and write the
// partials of a split or the finished output and LSE (the layouts every kernel here shares).
template <class T, int HD, int ROWS>
__device__ __forceinline__ void pd_store(const unsigned char* smem, const PaRow* rows, int nrows, int split,
                                         int num_splits, int seq_len, T* out, float* lse, float* max_logits,
                                         float* exp_sums, void* tmp_output, const PaParams& p) {
  const float* wm = reinterpret_cast<const float*>(smem);
  const float* wl = wm + 4 * ROWS;
  const float* wo = wl + 4 * ROWS;
  __syncthreads();
  const bool partial = (num_splits > 1 || p.always_partials) && seq_len > 0;  // vLLM v2 leaves empty ones unwritten
  for (int i = threadIdx.x; i < nrows * HD; i += PD_THREADS) {
    const int r = i / HD, d = i % HD;
    if (d >= p.v_head_size) continue;
    float mx = neg_inf(), sum = 0.0f, acc = 0.0f;
    for (int w = 0; w < 4; ++w) mx = fmaxf(mx, wm[w * ROWS + r]);
    for (int w = 0; w < 4; ++w)
      if (wm[w * ROWS + r] != neg_inf()) {
        const float f = expf(wm[w * ROWS + r] - mx);
        sum += wl[w * ROWS + r] * f;
        acc += wo[(w * ROWS + r) * HD + d] * f;
      }
    const PaRow row = rows[r];
    const long long th = (long long)row.token * p.num_heads + row.head;
    if (partial) {
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      pa_store_partial<T>(tmp_output, (th * p.max_splits + split) * p.v_head_size + d, acc * inv,
                          p.partials_in_out_type);
      if (d == 0) { max_logits[th * p.max_splits + split] = mx; exp_sums[th * p.max_splits + split] = sum; }
    }
    if (num_splits == 1) {  // the whole context was this CTA's: finish the row here
      const SoftmaxFinish fin = softmax_finish(mx, sum, row.sink);
      out[row.token * p.out_token_stride + row.head * p.out_head_stride + d] = from_float<T>(acc * fin.scale);
      if (lse && d == 0) lse[(long long)row.head * p.num_tokens + row.token] = fin.lse;
    }
  }
  __syncthreads();  // the next row tile rewrites rows and the stages
}

// The end of a paged_decode_kernel row tile: merge the slots of each warp (shuffles), hand the warps' states to
// pd_store through shared memory.
template <int HD>
__device__ __forceinline__ void pd_finish(unsigned char* smem, float (&m)[PD_ROWS], float (&l)[PD_ROWS],
                                          float (&o)[PD_ROWS][8], float oscale) {
  constexpr int LPR = HD / 8, ROWS = PD_ROWS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int off = LPR; off < 32; off <<= 1)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[r], off), l2 = __shfl_xor_sync(0xffffffffu, l[r], off);
      const float mx = fmaxf(m[r], m2);
      const float a = m[r] == neg_inf() ? 0.0f : expf(m[r] - mx), b = m2 == neg_inf() ? 0.0f : expf(m2 - mx);
      l[r] = l[r] * a + l2 * b;
#pragma unroll
      for (int d = 0; d < 8; ++d) o[r][d] = o[r][d] * a + __shfl_xor_sync(0xffffffffu, o[r][d], off) * b;
      m[r] = mx;
    }
  float* wm = reinterpret_cast<float*>(smem);  // pd_store's layout
  float* wl = wm + 4 * ROWS;
  float* wo = wl + 4 * ROWS;
  __syncthreads();  // every warp is done with the last stage: its bytes become the merge area
  if (lane < LPR)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {  // two 16-byte stores per lane: contiguous across lanes, conflict-free
      float* dst = wo + (warp * ROWS + r) * HD + lane * 8;
      *reinterpret_cast<float4*>(dst) = make_float4(o[r][0] * oscale, o[r][1] * oscale, o[r][2] * oscale,
                                                    o[r][3] * oscale);  // with the V scale
      *reinterpret_cast<float4*>(dst + 4) = make_float4(o[r][4] * oscale, o[r][5] * oscale, o[r][6] * oscale,
                                                        o[r][7] * oscale);
      if (lane == 0) { wm[warp * ROWS + r] = m[r]; wl[warp * ROWS + r] = l[r]; }
    }
}

// One key (row j of the stage) for the slot's lanes: q . k over the slot's lanes (a tree per row, interleaved
// with its softmax step: fewer live registers), then, for each row that sees the key, the online-softmax step
// o = o * alpha + w v. Masking by selection: v is never weighted by 0. `all_see`: every row sees the whole tile
// (the rows' bounds need not be read); `alibi`: slopes are given. q stays in its own type (16-bit pairs take half
// the registers; exact), scaled after the dot product.
template <int KV, int LPR, int VSTRIDE, class T, class CacheT>
__device__ __forceinline__ void pd_consume(const CacheT* krow_ptr, const CacheT* vrow_ptr, int key, const PaRow* rows,
                                           int nrows, bool all_see, bool alibi, const Vec<T, 8> (&qv)[PD_ROWS],
                                           float qscale, float (&o)[PD_ROWS][8], float (&m)[PD_ROWS],
                                           float (&l)[PD_ROWS], float softcap) {
  constexpr int ROWS = PD_ROWS;
  const PdRow8<CacheT> krow = pd_load8(krow_ptr);
  float s[ROWS], alpha[ROWS], w[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) s[r] = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; e += 2) {  // 8 dimensions per lane, converted a pair at a time
    const float2 k = pd_pair<KV>(krow, e);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) s[r] = s[r] + to_float(qv[r].v[e]) * k.x + to_float(qv[r].v[e + 1]) * k.y;
  }
  int seen = 0;  // rows that see this key
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int off = LPR / 2; off > 0; off >>= 1) s[r] += __shfl_xor_sync(0xffffffffu, s[r], off);
    alpha[r] = 1.0f;
    w[r] = 0.0f;
    if (r >= nrows || (!all_see && (key < rows[r].lo || key > rows[r].hi))) continue;
    float x = s[r] * qscale;
    if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
    if (alibi) x -= rows[r].slope * fabsf(float(key - rows[r].pos));
    const float mx = fmaxf(m[r], x);
    alpha[r] = m[r] == neg_inf() ? 0.0f : expf(m[r] - mx);
    w[r] = expf(x - mx);
    l[r] = l[r] * alpha[r] + w[r];
    m[r] = mx;
    seen |= 1 << r;
  }
  const PdRow8<CacheT> vrow = pd_load8<CacheT, VSTRIDE>(vrow_ptr);  // loaded after the scores: k is dead
#pragma unroll
  for (int e = 0; e < 8; e += 2) {
    const float2 v = pd_pair<KV>(vrow, e);
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      if (seen >> r & 1) {
        o[r][e] = o[r][e] * alpha[r] + w[r] * v.x;
        o[r][e + 1] = o[r][e + 1] * alpha[r] + w[r] * v.y;
      }
  }
}

template <class T, int KV, int HD, bool VT>
__global__ void __launch_bounds__(PD_THREADS, SM_REGISTERS / (PD_THREADS * PD_REGISTERS)) paged_decode_kernel(
    const T* __restrict__ q,                 // [num_tokens, num_heads, head_size]
    const typename CacheType<KV, T>::type* __restrict__ key_cache,    // flash NHD / HND, dense rows, or vLLM's
    const typename CacheType<KV, T>::type* __restrict__ value_cache,  // (VT: values [.., head_size, block_size])
    const int* __restrict__ block_tables,    // [num_seqs, max_blocks_per_seq], or nullptr: dense varlen keys
    const int* __restrict__ seq_lens,        // [num_seqs], or cu_seqlens_k [num_seqs + 1] when dense
    const int* __restrict__ query_start_loc, // [num_seqs + 1], or nullptr: one query per sequence
    const int* __restrict__ seqused_k,       // dense: [num_seqs] or nullptr
    const float* __restrict__ sinks, const float* __restrict__ alibi_slopes,  // [num_heads] or nullptr
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,     // [1] / [num_kv_heads] or nullptr
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    void* __restrict__ tmp_output, PaParams p) {  // as paged_decode_kernel's
  typedef typename CacheType<KV, T>::type CacheT;
  typedef PdSmem<CacheT, HD, VT> S;
  constexpr int LPR = HD / 8, SLOTS = 32 / LPR, ROWS = PD_ROWS, TILE = S::TILE;
  extern __shared__ __align__(16) unsigned char pd_smem[];
  __shared__ PaRow rows[ROWS];
  __shared__ int ids[S::STAGES][S::TILE + 1];  // block ids of the tile in each stage
  const int kv_head = blockIdx.y, seq = blockIdx.z, split = blockIdx.x / p.decode_tiles;
  const PaSeq sq = pa_seq(seq, split, block_tables, seq_lens, query_start_loc, seqused_k, p);
  const int group = p.num_heads / p.num_kv_heads;
  if (sq.q_len > p.decode_max_q || split >= sq.splits.count) return;  // a longer run is paged_prefill_kernel's
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, slot = lane / LPR, d0 = lane % LPR * 8;
  const float qscale = p.scale * pd_scale<KV>(k_scale, p.k_scale_value, kv_head, p);
  const float oscale = pd_scale<KV>(v_scale, p.v_scale_value, kv_head, p);
  const int* table = block_tables ? block_tables + seq * p.table_stride : nullptr;
  for (int row0 = (blockIdx.x % p.decode_tiles) * ROWS; row0 < sq.q_len * group; row0 += p.decode_tiles * ROWS) {
    const int nrows = min(ROWS, sq.q_len * group - row0);
    Vec<T, 8> qv[ROWS];
    float o[ROWS][8], m[ROWS], l[ROWS];
    int lo = 0x7fffffff, hi = -1;             // the union of the rows' visible keys: the only ones loaded
    int lo_all = 0, hi_all = 0x7fffffff;      // their intersection: keys every row sees
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const PaRow row = pd_row(r, row0, nrows, group, kv_head, sq, sinks, alibi_slopes, p);
      if (row.lo <= row.hi) { lo = min(lo, row.lo); hi = max(hi, row.hi); }
      if (r < nrows) { lo_all = max(lo_all, row.lo); hi_all = min(hi_all, row.hi); }
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        qv[r].v[e] = r < nrows && d0 + e < p.head_size
                         ? q[row.token * p.q_token_stride + row.head * p.q_head_stride + d0 + e] : from_float<T>(0.0f);
        o[r][e] = 0.0f;
      }
      m[r] = neg_inf();
      l[r] = 0.0f;
      if (threadIdx.x == 0) rows[r] = row;
    }
    const int first = VT ? lo & -(16 / int(sizeof(CacheT))) : lo;  // V^T: tiles start at whole 16-byte runs
    pd_pipeline<S>(pd_smem, ids, table, first, hi, p, [&](unsigned char* stage, const int* tile_ids, PdTile tile) {
      pd_issue<CacheT, S>(stage, key_cache, value_cache, tile_ids, tile, sq.key_row0, kv_head, p);
    }, [&](const unsigned char* stage, int base) {
      const bool all_see = base >= lo_all && base + TILE - 1 <= hi_all;
      for (int j = warp * (TILE / 4) + slot; j < (warp + 1) * (TILE / 4); j += SLOTS)
        pd_consume<KV, LPR, VT ? S::VT_PITCH / int(sizeof(CacheT)) : 1>(
            reinterpret_cast<const CacheT*>(stage + j * S::PITCH) + d0,
            reinterpret_cast<const CacheT*>(stage + (VT ? S::vt_at(0, d0) + j * int(sizeof(CacheT))
                                                        : (TILE + j) * S::PITCH + d0 * int(sizeof(CacheT)))),
            base + j, rows, nrows, all_see, alibi_slopes != nullptr, qv, qscale, o, m, l, p.softcap);
    });
    pd_finish<HD>(pd_smem, m, l, o, oscale);
    pd_store<T, HD, ROWS>(pd_smem, rows, nrows, split, sq.splits.count, sq.seq_len, out, lse, max_logits, exp_sums,
                          tmp_output, p);
  }
}

// ---- The tensor-core decode kernel: 8 query rows a CTA, 16-bit q, head sizes up to 128, for GQA groups over 4
// or any group over vLLM's layout (VT); the plan sends float32, head size 256 and the other groups of <= 4 to
// paged_decode_kernel: a choice from the model's shape and cache, never the batch's, so a sequence takes the
// same kernel in every batch. The GEMMs are transposed so the 8 rows are the n8 side of mma.sync m16n8k16 and
// 16 keys its m side: warp w takes keys 16 w .. 16 w + 15 of every 64-key stage, with its own online softmax:
//   S^T = K Q^T: A = K rows by ldmatrix (fp8: 4 codes a lane converted in registers, q's columns permuted to
//     match), B = Q^T by ldmatrix from the shared q tile (no register held across the tiles);
//   O^T += V^T P^T: A = V rows by ldmatrix.trans (fp8: byte pairs of two keys regrouped) or, for vLLM's values,
//     the V^T tile by plain ldmatrix (fp8: 4 keys' codes a lane, P^T's keys permuted to match); B = P^T, which
//     a lane gets from the S^T fragments through a per-warp shared array (a transposition), split in registers
//     into 16-bit parts (fp16 and fp8 caches: 2 half parts, bf16: 3) so P V keeps fp32-P accuracy; O^T is
//     HD / 4 fp32 a lane.
// A lane's S^T and O^T fragments hold the same two rows (2t, 2t + 1): the softmax needs no shuffle beyond each
// row's max over the 8 lanes of its keys. Every key a stage holds is visible to some row of the tile (or, for
// V^T, a key of the same block before the first: real data) or zero-filled past the last, so a row's 0 weight
// only ever meets real values.
constexpr int PM_TILE = 64;  // keys per stage: 16 per warp, the m16 side of the mma
constexpr int PM_ROWS = 8;   // query rows per CTA: the n8 side

template <class CacheT, int HD, bool V_TRANSPOSED>
struct PmSmem {
  static constexpr int TILE = PM_TILE, PITCH = HD * int(sizeof(CacheT)) + 16;  // +16 bytes: ldmatrix conflict-free
  static constexpr bool VT = V_TRANSPOSED;
  static constexpr int VT_PITCH = !VT ? 0 : sizeof(CacheT) == 1 ? TILE : TILE * 2 + 16;  // V^T rows (pd_vt_col)
  static constexpr int K_DIMS = HD, V_DIMS = HD;
  static constexpr bool PREFETCH = true;
  static constexpr int UNROLL = 0;  // pd_issue's loop: the compiler's choice
  static constexpr int STAGE = TILE * PITCH + (VT ? HD * VT_PITCH : TILE * PITCH);
  static constexpr int STAGES = 3 * STAGE <= PM_SMEM_FOR_3 ? 3 : 2;
  static constexpr int MERGE = 4 * PM_ROWS * (HD + 2) * 4;
  static constexpr int BYTES = STAGES * STAGE > MERGE ? STAGES * STAGE : MERGE;
  static __device__ __forceinline__ int k_at(int j, int c) { return j * PITCH + c * 16; }  // pd_issue's placement
  static __device__ __forceinline__ int v_at(int j, int c) { return (TILE + j) * PITCH + c * 16; }
  static __device__ __forceinline__ int vt_at(int run, int dim) {
    return TILE * PITCH + dim * VT_PITCH + pd_vt_col<16 / int(sizeof(CacheT))>(run, dim);
  }
};

// The dimension of q held in column k of the shared q tile: 16-bit caches in order; an fp8 ldmatrix row gives a
// lane 4 consecutive codes, dims 4t .. 4t + 3, used as k 2t, 2t + 1, 2t + 8, 2t + 9 of a k16 step, so q's columns
// are permuted the same way (pi(k) = 4 ((k & 7) >> 1) + (k & 1) + 2 (k >> 3) within each 16).
template <int KV>
__device__ __forceinline__ int pm_qdim(int k) {
  return KV == KV_AUTO ? k : (k & ~15) + 4 * ((k & 7) >> 1) + (k & 1) + 2 * (k >> 3 & 1);
}

// The dimension of O^T row g (+ 8 h) of m tile mt: fp8 V rows' fragments pair dims 2g, 2g + 1 of one ldmatrix row.
template <int KV, bool VT>
__device__ __forceinline__ int pm_odim(int mt, int g, int h) {
  return 16 * mt + (KV == KV_AUTO || VT ? g + 8 * h : 2 * g + h);
}

// The key (of the warp's 16) of element i of a lane's P^T B fragment (k 2t, 2t + 1, 2t + 8, 2t + 9): fp8 V^T rows
// give a lane 4 consecutive keys' codes, 4t .. 4t + 3, used as those four k.
template <int KV, bool VT>
__device__ __forceinline__ int pm_pkey(int t, int i) {
  return KV != KV_AUTO && VT ? 4 * t + i : 2 * t + (i & 1) + 8 * (i >> 1);
}

// S^T (16 keys x 8 rows) of the warp's keys, whose K rows start at kt; Q^T's B fragments by ldmatrix from the q
// tile qs ([8 rows][HD + 8], columns pm_qdim), two k16 steps a load, so q holds no register across the tiles.
template <class T, int KV, int HD, int PITCH>
__device__ __forceinline__ void pm_scores(float (&s)[4], const unsigned char* kt, const T* qs, int lane) {
  const unsigned char* at = kt + (lane & 15) * PITCH + (lane >> 4) * 16;  // key l % 16, bytes 16 (l / 16) ..
  const T* qat = qs + (lane & 7) * (HD + 8) + (lane >> 3) * 8;              // row l % 8, columns 8 (l / 8) ..
#pragma unroll
  for (int kp = 0; kp < HD / 32; ++kp) {  // k16 steps 2 kp, 2 kp + 1
    unsigned b[4], r[4];
    tc_ldmatrix_x4(b, qat + 32 * kp);
    if constexpr (KV == KV_AUTO) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tc_ldmatrix_x4(r, at + 64 * kp + 32 * h);
        tc_mma<T>(s, r, b[2 * h], b[2 * h + 1]);
      }
    } else {  // 32 codes a row: both steps from one load
      tc_ldmatrix_x4(r, at + 32 * kp);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned a[4] = {tc_fp8x2<KV, T>(r[2 * h]), tc_fp8x2<KV, T>(r[2 * h + 1]),
                               tc_fp8x2<KV, T>(r[2 * h] >> 16), tc_fp8x2<KV, T>(r[2 * h + 1] >> 16)};
        tc_mma<T>(s, a, b[2 * h], b[2 * h + 1]);
      }
    }
  }
}

// O^T += V^T P^T over warp `warp`'s 16 keys (its V rows from vt, or V^T at vt), one mma per part of P, the
// smallest first. PV: the product's 16-bit type, q's for 16-bit caches; __half for fp8 ones (every fp8 value is a
// half, and P in two half parts keeps fp32-P accuracy as in fp16 decode: fewer conversions and mmas than three
// bf16 parts).
template <int KV, class T> struct PmPv { typedef __half type; };
template <class T> struct PmPv<KV_AUTO, T> { typedef T type; };

template <class PV, int KV, int HD, int PITCH, int VT_PITCH, int PARTS>
__device__ __forceinline__ void pm_values(float (&o)[HD / 16][4], const unsigned char* vt,
                                          const unsigned (&pf)[PARTS][2], int warp, int lane) {
  if constexpr (VT_PITCH > 0 && KV == KV_AUTO) {  // V^T rows (dims) are A rows: ldmatrix, dim l % 16, keys 8 (l / 16)
    const unsigned char* at = vt + (lane & 15) * VT_PITCH + 32 * warp + (lane >> 4) * 16;
#pragma unroll
    for (int mt = 0; mt < HD / 16; ++mt) {
      unsigned a[4];
      tc_ldmatrix_x4(a, at + 16 * mt * VT_PITCH);
#pragma unroll
      for (int k = PARTS - 1; k >= 0; --k) tc_mma<PV>(o[mt], a, pf[k][0], pf[k][1]);
    }
  } else if constexpr (VT_PITCH > 0) {  // fp8 V^T: dim l of 32, the warp's run; keys 4t .. 4t + 3 a lane (pm_pkey)
#pragma unroll
    for (int mp = 0; mp < HD / 32; ++mp) {
      unsigned r[4];
      tc_ldmatrix_x4(r, vt + (32 * mp + lane) * VT_PITCH + pd_vt_col<16>(warp, lane));  // (32 mp + l) / 2: l / 2
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned a[4] = {tc_fp8x2<KV, PV>(r[2 * h]), tc_fp8x2<KV, PV>(r[2 * h + 1]),
                               tc_fp8x2<KV, PV>(r[2 * h] >> 16), tc_fp8x2<KV, PV>(r[2 * h + 1] >> 16)};
#pragma unroll
        for (int k = PARTS - 1; k >= 0; --k) tc_mma<PV>(o[2 * mp + h], a, pf[k][0], pf[k][1]);
      }
    }
  } else if constexpr (KV == KV_AUTO) {  // .trans of key rows (l & 7) + 8 (l >> 4), dims 8 (l >> 3 & 1) ..: a0 .. a3
    const unsigned char* at = vt + ((lane & 7) + 8 * (lane >> 4)) * PITCH + (lane >> 3 & 1) * 16;
#pragma unroll
    for (int mt = 0; mt < HD / 16; ++mt) {
      unsigned a[4];
      tc_ldmatrix_x4_trans(a, at + 32 * mt);
#pragma unroll
      for (int k = PARTS - 1; k >= 0; --k) tc_mma<PV>(o[mt], a, pf[k][0], pf[k][1]);
    }
  } else {  // .trans of byte pairs: keys 2t, 2t + 1 of dims 2g, 2g + 1, regrouped into one pair a dimension
    const unsigned char* at = vt + ((lane & 7) + 8 * (lane >> 3 & 1)) * PITCH + (lane >> 4) * 16;
#pragma unroll
    for (int mp = 0; mp < HD / 32; ++mp) {
      unsigned r[4];
      tc_ldmatrix_x4_trans(r, at + 32 * mp);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned x = r[2 * h], y = r[2 * h + 1];  // keys 0-7, keys 8-15
        const unsigned a[4] = {tc_fp8x2<KV, PV>((x & 0xffu) | (x >> 8 & 0xff00u)),
                               tc_fp8x2<KV, PV>((x >> 8 & 0xffu) | (x >> 16 & 0xff00u)),
                               tc_fp8x2<KV, PV>((y & 0xffu) | (y >> 8 & 0xff00u)),
                               tc_fp8x2<KV, PV>((y >> 8 & 0xffu) | (y >> 16 & 0xff00u))};
#pragma unroll
        for (int k = PARTS - 1; k >= 0; --k) tc_mma<PV>(o[2 * mp + h], a, pf[k][0], pf[k][1]);
      }
    }
  }
}

// The per-warp P^T array: key k's 8 rows at (k + k / 4) * 8, so the fragments' float2 writes (key g, rows 2t ..)
// and scalar reads (keys 2t .., row g) are both conflict-free.
__device__ __forceinline__ int pm_at(int key) { return (key + (key >> 2)) * 8; }

// The end of a paged_decode_mma_kernel row tile: each row's sum over the lanes of its keys, then the warp's
// (m, l, o with the V scale) of its 8 rows into shared memory in pd_store's layout.
template <int KV, bool VT, int HD>
__device__ __forceinline__ void pm_finish(unsigned char* smem, const float (&o)[HD / 16][4], const float (&m)[2],
                                          float (&l)[2], float oscale) {
  const int warp = threadIdx.x / 32, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l[e] += __shfl_xor_sync(0xffffffffu, l[e], off);
  float* wm = reinterpret_cast<float*>(smem);
  float* wo = wm + 8 * PM_ROWS;
  __syncthreads();  // every warp is done with the last stage: its bytes become the merge area
#pragma unroll
  for (int mt = 0; mt < HD / 16; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i)  // c0, c1: rows 2t, 2t + 1 of one dimension; c2, c3: of the other
      wo[(warp * PM_ROWS + 2 * t + (i & 1)) * HD + pm_odim<KV, VT>(mt, g, i >> 1)] = o[mt][i] * oscale;
  if (g == 0)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      wm[warp * PM_ROWS + 2 * t + e] = m[e];
      wm[(4 + warp) * PM_ROWS + 2 * t + e] = l[e];
    }
}

template <class T, int KV, int HD, bool VT>
__global__ void __launch_bounds__(PD_THREADS, SM_REGISTERS / (PD_THREADS * PD_REGISTERS)) paged_decode_mma_kernel(
    const T* __restrict__ q,                 // [num_tokens, num_heads, head_size <= 128]
    const typename CacheType<KV, T>::type* __restrict__ key_cache,    // as paged_decode_kernel's
    const typename CacheType<KV, T>::type* __restrict__ value_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
    const int* __restrict__ seqused_k, const float* __restrict__ sinks, const float* __restrict__ alibi_slopes,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    void* __restrict__ tmp_output, PaParams p) {
  typedef typename CacheType<KV, T>::type CacheT;
  typedef PmSmem<CacheT, HD, VT> S;
  typedef typename PmPv<KV, T>::type PV;
  constexpr int MT = HD / 16, ROWS = PM_ROWS, PARTS = TcHalf<PV>::value ? 2 : 3;
  extern __shared__ __align__(16) unsigned char pd_smem[];
  __shared__ PaRow rows[ROWS];
  __shared__ int ids[S::STAGES][S::TILE + 1];
  __shared__ __align__(8) float pt[4][160];  // each warp's P^T (pm_at)
  __shared__ __align__(16) T qs[PM_ROWS][HD + 8];  // the tile's q rows (+8: ldmatrix conflict-free)
  const int kv_head = blockIdx.y, seq = blockIdx.z, split = blockIdx.x / p.decode_tiles;
  const PaSeq sq = pa_seq(seq, split, block_tables, seq_lens, query_start_loc, seqused_k, p);
  const int group = p.num_heads / p.num_kv_heads;
  if (sq.q_len > p.decode_max_q || split >= sq.splits.count) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const float qscale = p.scale * pd_scale<KV>(k_scale, p.k_scale_value, kv_head, p);
  const int* table = block_tables ? block_tables + seq * p.table_stride : nullptr;
  for (int row0 = (blockIdx.x % p.decode_tiles) * ROWS; row0 < sq.q_len * group; row0 += p.decode_tiles * ROWS) {
    const int nrows = min(ROWS, sq.q_len * group - row0);
    int lo = 0x7fffffff, hi = -1;  // the union of the rows' visible keys: the only ones loaded
    for (int r = 0; r < ROWS; ++r) {
      const PaRow row = pd_row(r, row0, nrows, group, kv_head, sq, sinks, alibi_slopes, p);
      if (row.lo <= row.hi) { lo = min(lo, row.lo); hi = max(hi, row.hi); }
      if (threadIdx.x == 0) rows[r] = row;
    }
    for (int i = threadIdx.x; i < ROWS * HD; i += PD_THREADS) {  // the q tile (pd_pipeline's barrier publishes it)
      const int r = i / HD, k = i % HD, d = pm_qdim<KV>(k), rr = row0 + r;
      const T* qrow =
          q + (sq.q_start + rr / group) * p.q_token_stride + (kv_head * group + rr % group) * p.q_head_stride;
      qs[r][k] = r < nrows && d < p.head_size ? qrow[d] : from_float<T>(0.0f);
    }
    float o[MT][4], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};  // rows 2t, 2t + 1
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    const int first = VT ? lo & -(16 / int(sizeof(CacheT))) : lo;  // V^T: tiles start at whole 16-byte runs
    pd_pipeline<S>(pd_smem, ids, table, first, hi, p, [&](unsigned char* stage, const int* tile_ids, PdTile tile) {
      pd_issue<CacheT, S>(stage, key_cache, value_cache, tile_ids, tile, sq.key_row0, kv_head, p);
    }, [&](const unsigned char* stage, int base) {
      const int key0 = base + 16 * warp;
      if (key0 > hi) return;  // the warp's keys are all past the last (warp-uniform)
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // S^T: keys key0 + g (+ 8), rows 2t, 2t + 1
      pm_scores<T, KV, HD, S::PITCH>(s, stage + 16 * warp * S::PITCH, &qs[0][0], lane);
      float alpha[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // row 2t + e: the online-softmax step over the warp's 16 keys
        const PaRow row = rows[2 * t + e];
        float x[2], mx = neg_inf();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = key0 + g + 8 * h;
          float v = s[2 * h + e] * qscale;
          if (p.softcap > 0.0f) v = p.softcap * tanhf(v / p.softcap);
          v -= row.slope * fabsf(float(key - row.pos));
          x[h] = key >= row.lo && key <= row.hi ? v : neg_inf();  // masking by selection
          mx = fmaxf(mx, x[h]);
        }
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float mn = fmaxf(m[e], mx);
        alpha[e] = m[e] == neg_inf() ? 0.0f : expf(m[e] - mn);
#pragma unroll
        for (int h = 0; h < 2; ++h) s[2 * h + e] = x[h] == neg_inf() ? 0.0f : expf(x[h] - mn);
        l[e] = l[e] * alpha[e] + s[e] + s[2 + e];
        m[e] = mn;
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        o[mt][0] *= alpha[0]; o[mt][1] *= alpha[1]; o[mt][2] *= alpha[0]; o[mt][3] *= alpha[1];
      }
      float* pw = pt[warp];  // P^T to B fragments: (keys 2t, 2t + 1 | 2t + 8, 2t + 9; row g)
      *reinterpret_cast<float2*>(pw + pm_at(g) + 2 * t) = make_float2(s[0], s[1]);
      *reinterpret_cast<float2*>(pw + pm_at(g + 8) + 2 * t) = make_float2(s[2], s[3]);
      __syncwarp();
      float2 b0 = make_float2(pw[pm_at(pm_pkey<KV, VT>(t, 0)) + g], pw[pm_at(pm_pkey<KV, VT>(t, 1)) + g]);
      float2 b1 = make_float2(pw[pm_at(pm_pkey<KV, VT>(t, 2)) + g], pw[pm_at(pm_pkey<KV, VT>(t, 3)) + g]);
      __syncwarp();  // read before the next tile's writes
      unsigned pf[PARTS][2];
#pragma unroll
      for (int k = 0; k < PARTS; ++k) { pf[k][0] = tc_part<PV>(b0); pf[k][1] = tc_part<PV>(b1); }
      pm_values<PV, KV, HD, S::PITCH, S::VT_PITCH, PARTS>(  // the warp's V rows, or V^T (the warp's 16 columns)
          o, stage + S::TILE * S::PITCH + (VT ? 0 : 16 * warp * S::PITCH), pf, warp, lane);
    });
    // the V scale read here, not held in a register across the tiles
    pm_finish<KV, VT, HD>(pd_smem, o, m, l, pd_scale<KV>(v_scale, p.v_scale_value, kv_head, p));
    pd_store<T, HD, ROWS>(pd_smem, rows, nrows, split, sq.splits.count, sq.seq_len, out, lse, max_logits, exp_sums,
                          tmp_output, p);
  }
}

// ---- Prefill on tensor cores (FlashAttention-2's design): the query runs longer than the decode kernels take,
// 16-bit q over flash NHD / HND caches or dense rows. A CTA takes S::ROWS = 128 query rows ((token, head) pairs of
// one GQA group, token-major, so K/V are read once for the group; 64 when V's head size is over 128), MW = 2 m16
// tiles a warp (1 above 128), so every K / V fragment a warp loads serves 2 tiles of rows, and walks their keys in
// stages of S::TILE through the decode kernels' cp.async pipeline (pd_pipeline):
//   S = Q K^T by mma.sync m16n8k16: Q's A and K's B fragments by ldmatrix from shared tiles whose 16-byte chunks are
//     XOR-swizzled by row (pf_at): conflict-free without padding;
//   the online softmax in registers: a lane holds rows g, g + 8 of each of its warp's m tiles, row maxima and sums
//     over its quad by shuffles; masks (causal, windows, the split's ends, keys past the last) only on tiles not
//     wholly visible to the warp's rows, and a warp skips the tiles none of its rows sees;
//   O += P V: the C fragments of S rounded to q's type are P's A fragments as they lie, V's B fragments come by
//     ldmatrix.trans: FlashAttention-2's accuracy (P in 16 bits; the tolerance table, not the decode ulp rule).
// fp8 caches land as codes and are converted to q's type in shared memory (exact; .b16 ldmatrix of fp8 pairs would
// not give 16-bit fragments), their scales folded into the scores' scale and the output. Head sizes below the
// bucket are zero-filled by the copies (src-size), so the mma sums zeros. Row tiles run heaviest first: the last
// rows of a causal run see the most keys. Every key a stage holds is visible to some row of the CTA or zero-filled
// past the last, so a masked row's 0 weight only ever meets real values. 255 registers (2 CTAs an SM at most).

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of ROW-byte rows (ROW a multiple of 128): the chunk's
// low 3 bits XOR the row's, so ldmatrix's 8 rows at one chunk hit 8 different 16-byte bank groups.
template <int ROW>
__device__ __forceinline__ int pf_at(int row, int chunk) { return row * ROW + ((chunk ^ (row & 7)) << 4); }

template <class CacheT, int HD, int VHD>
struct PfSmem {
  static constexpr int MW = VHD > 128 ? 1 : 2;     // m16 tiles a warp: K / V fragments serve MW tiles of rows
  static constexpr int ROWS = 64 * MW;             // query rows a CTA
  static constexpr int TILE = HD > 64 ? 32 : 64;   // keys per stage: S is MW x TILE / 8 fragments a lane
  static constexpr int K_DIMS = HD, V_DIMS = VHD;
  static constexpr bool PREFETCH = true, VT = false, CONVERT = sizeof(CacheT) == 1;
  static constexpr int UNROLL = 0;
  static constexpr int KROW = HD * int(sizeof(CacheT)), VROW = VHD * int(sizeof(CacheT));  // a stage's rows, bytes
  static constexpr int STAGE = TILE * (KROW + VROW);
  static constexpr int FIXED = ROWS * HD * 2 + (CONVERT ? TILE * (HD + VHD) * 2 : 0);  // the q and converted tiles
  static constexpr int STAGES = 3 * STAGE + FIXED <= PF_SMEM_FOR_3 ? 3 : 2;
  static constexpr int Q = STAGES * STAGE;                  // [ROWS][HD] of q's type (pf_at)
  static constexpr int CK = Q + ROWS * HD * 2;              // fp8: the stage's K [TILE][HD] and V [TILE][VHD] in q's
  static constexpr int CV = CK + (CONVERT ? TILE * HD * 2 : 0);  // type (pf_at)
  static constexpr int BYTES = CV + (CONVERT ? TILE * VHD * 2 : 0);
  // pd_issue's placement: 16-bit rows swizzled as the mma reads them; fp8 codes plain (pf_convert reads them)
  static __device__ __forceinline__ int k_at(int j, int c) { return CONVERT ? j * KROW + c * 16 : pf_at<KROW>(j, c); }
  static __device__ __forceinline__ int v_at(int j, int c) {
    return TILE * KROW + (CONVERT ? j * VROW + c * 16 : pf_at<VROW>(j, c));
  }
  static __device__ __forceinline__ int vt_at(int, int) { return 0; }
};

// fp8 codes of a stage -> q's type in the swizzled K and V tiles, 8 codes a thread a step (8-byte reads, 16-byte
// writes: both conflict-free); exact.
template <int KV, class T, class S>
__device__ __forceinline__ void pf_convert(unsigned char* ck, unsigned char* cv, const unsigned char* stage) {
  constexpr int KC = S::K_DIMS / 8, VC = S::V_DIMS / 8;  // 8-element chunks of a row
  for (int i = threadIdx.x; i < S::TILE * (KC + VC); i += PD_THREADS) {
    const bool is_v = i >= S::TILE * KC;
    const int k = i - is_v * S::TILE * KC, j = is_v ? k / VC : k / KC, c = is_v ? k % VC : k % KC;
    const uint2 codes =
        *reinterpret_cast<const uint2*>(stage + (is_v ? S::TILE * S::KROW + j * S::VROW : j * S::KROW) + c * 8);
    const uint4 w = make_uint4(tc_fp8x2<KV, T>(codes.x), tc_fp8x2<KV, T>(codes.x >> 16), tc_fp8x2<KV, T>(codes.y),
                               tc_fp8x2<KV, T>(codes.y >> 16));
    *reinterpret_cast<uint4*>(is_v ? cv + pf_at<S::V_DIMS * 2>(j, c) : ck + pf_at<S::K_DIMS * 2>(j, c)) = w;
  }
}

// The row tile's q rows into the swizzled q tile, 8 elements a chunk (zero past head_size and past the last row).
template <class T, int HD, int ROWS>
__device__ __forceinline__ void pf_load_q(unsigned char* qs, const T* q, int row0, int nrows, int group, int kv_head,
                                          int q_start, const PaParams& p) {
  for (int i = threadIdx.x; i < ROWS * HD / 8; i += PD_THREADS) {
    const int r = i / (HD / 8), c = i % (HD / 8), rr = row0 + r;
    const T* qrow = q + (q_start + rr / group) * p.q_token_stride + (kv_head * group + rr % group) * p.q_head_stride;
    unsigned w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = 8 * c + 2 * e;
      const T zero = from_float<T>(0.0f);
      w[e] = tc_pack<T>(r < nrows && d < p.head_size ? qrow[d] : zero, r < nrows && d + 1 < p.head_size ? qrow[d + 1]
                                                                                                           : zero);
    }
    *reinterpret_cast<uint4*>(qs + pf_at<HD * 2>(r, c)) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// S (the warp's MW m16 tiles of rows x TILE keys) = Q K^T: Q's A fragments by ldmatrix (row l % 16 of m tile mi,
// chunk 2 kk + l / 16), K's B fragments by ldmatrix of its rows (key 16 j + 8 (l / 16) + l % 8, chunk
// 2 kk + l / 8 % 2: n tiles 2 j, 2 j + 1), each serving the MW m tiles.
template <class T, int HD, int TILE, int MW>
__device__ __forceinline__ void pf_scores(float (&s)[MW][TILE / 8][4], const unsigned char* qs,
                                          const unsigned char* kt, int warp, int lane) {
  const int qr = 16 * MW * warp + (lane & 15), kr = 8 * (lane >> 4) + (lane & 7);
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    unsigned a[MW][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) tc_ldmatrix_x4(a[mi], qs + pf_at<HD * 2>(qr + 16 * mi, 2 * kk + (lane >> 4)));
#pragma unroll
    for (int j = 0; j < TILE / 16; ++j) {
      unsigned b[4];
      tc_ldmatrix_x4(b, kt + pf_at<HD * 2>(16 * j + kr, 2 * kk + (lane >> 3 & 1)));
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        tc_mma<T>(s[mi][2 * j], a[mi], b[0], b[1]);
        tc_mma<T>(s[mi][2 * j + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// Row g + 8 e of one m tile of scores (keys key0 + 8 n + h, key0 = the tile's first + 2t): scale, softcap, ALiBi
// and, when `masked`, the row's visible range; then the online-softmax step: the scores become P = e^{s - m} (0
// where masked: selection), (m, l) move on (l over this lane's keys), and the factor that rescales o is returned.
template <int NT>
__device__ __forceinline__ float pf_softmax(float (&s)[NT][4], int e, float& m, float& l, const PaRow& row, int key0,
                                            bool masked, float qscale, float softcap) {
  float mx = neg_inf();
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = key0 + 8 * n + h;
      float x = s[n][2 * e + h] * qscale;
      if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
      x -= row.slope * fabsf(float(key - row.pos));
      if (masked && (key < row.lo || key > row.hi)) x = neg_inf();
      s[n][2 * e + h] = x;
      mx = fmaxf(mx, x);
    }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mn = fmaxf(m, mx), alpha = m == neg_inf() ? 0.0f : expf(m - mn);
  float sum = 0.0f;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float x = s[n][2 * e + h];
      s[n][2 * e + h] = x == neg_inf() ? 0.0f : expf(x - mn);
      sum += s[n][2 * e + h];
    }
  l = l * alpha + sum;
  m = mn;
  return alpha;
}

// O += P V over the tile's keys: k step kk of P is S's n tiles 2 kk, 2 kk + 1 rounded to T (the C fragments are the
// A fragments), V's B fragments by ldmatrix.trans of its rows (key 16 kk + l % 16, chunk 2 j + l / 16: n tiles 2 j,
// 2 j + 1), each serving the MW m tiles.
template <class T, int VHD, int TILE, int MW>
__device__ __forceinline__ void pf_values(float (&o)[MW][VHD / 8][4], const float (&s)[MW][TILE / 8][4],
                                          const unsigned char* vt, int lane) {
#pragma unroll
  for (int kk = 0; kk < TILE / 16; ++kk) {
    unsigned a[MW][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
      const float* x = s[mi][2 * kk];
      const float* y = s[mi][2 * kk + 1];
      a[mi][0] = tc_pack<T>(from_float<T>(x[0]), from_float<T>(x[1]));
      a[mi][1] = tc_pack<T>(from_float<T>(x[2]), from_float<T>(x[3]));
      a[mi][2] = tc_pack<T>(from_float<T>(y[0]), from_float<T>(y[1]));
      a[mi][3] = tc_pack<T>(from_float<T>(y[2]), from_float<T>(y[3]));
    }
#pragma unroll
    for (int j = 0; j < VHD / 16; ++j) {
      unsigned b[4];
      tc_ldmatrix_x4_trans(b, vt + pf_at<VHD * 2>(16 * kk + (lane & 15), 2 * j + (lane >> 4)));
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        tc_mma<T>(o[mi][2 * j], a[mi], b[0], b[1]);
        tc_mma<T>(o[mi][2 * j + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// The end of a prefill row tile: each lane's 2 MW rows (their sums over the quad first), written as a split's
// partials or finished with the sink and the LSE, as pd_store does; o carries the V scale `oscale` still.
template <class T, int VHD, int MW>
__device__ __forceinline__ void pf_store(const float (&o)[MW][VHD / 8][4], const float (&m)[MW][2],
                                         float (&l)[MW][2], const PaRow* rows, int nrows, int split, int num_splits,
                                         int seq_len, float oscale, T* out, float* lse, float* max_logits,
                                         float* exp_sums, void* tmp_output, const PaParams& p) {
  const int warp = threadIdx.x / 32, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const bool partial = (num_splits > 1 || p.always_partials) && seq_len > 0;  // vLLM v2 leaves empty ones unwritten
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      l[mi][e] += __shfl_xor_sync(0xffffffffu, l[mi][e], 1);
      l[mi][e] += __shfl_xor_sync(0xffffffffu, l[mi][e], 2);
    }
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 16 * (MW * warp + mi) + g + 8 * e;
      if (r >= nrows) continue;
      const PaRow row = rows[r];
      const long long th = (long long)row.token * p.num_heads + row.head;
      const float lv = l[mi][e];
      const SoftmaxFinish fin = softmax_finish(m[mi][e], lv, row.sink);
      const float fp = oscale * (lv > 0.0f ? 1.0f / lv : 0.0f), fo = oscale * fin.scale;
#pragma unroll
      for (int n = 0; n < VHD / 8; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int d = 8 * n + 2 * t + h;
          const float x = o[mi][n][2 * e + h];
          if (d >= p.v_head_size) continue;
          if (partial)
            pa_store_partial<T>(tmp_output, (th * p.max_splits + split) * p.v_head_size + d, x * fp,
                                p.partials_in_out_type);
          if (num_splits == 1) out[row.token * p.out_token_stride + row.head * p.out_head_stride + d] =
                                   from_float<T>(x * fo);
        }
      if (t == 0 && partial) {
        max_logits[th * p.max_splits + split] = m[mi][e];
        exp_sums[th * p.max_splits + split] = lv;
      }
      if (t == 0 && num_splits == 1 && lse) lse[(long long)row.head * p.num_tokens + row.token] = fin.lse;
    }
}

template <class T, int KV, int HD, int VHD>
__global__ void __launch_bounds__(PD_THREADS, SM_REGISTERS / (PD_THREADS * PF_REGISTERS)) paged_prefill_kernel(
    const T* __restrict__ q,                 // [num_tokens, num_heads, head_size]
    const typename CacheType<KV, T>::type* __restrict__ key_cache,    // flash NHD / HND, or dense rows
    const typename CacheType<KV, T>::type* __restrict__ value_cache,  // (v_dim_stride == 1, rows 16-byte aligned)
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
    const int* __restrict__ seqused_k, const float* __restrict__ sinks, const float* __restrict__ alibi_slopes,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    void* __restrict__ tmp_output, PaParams p) {  // as paged_decode_kernel's
  typedef typename CacheType<KV, T>::type CacheT;
  typedef PfSmem<CacheT, HD, VHD> S;
  constexpr int TILE = S::TILE, MW = S::MW, ROWS = S::ROWS;
  extern __shared__ __align__(128) unsigned char pf_smem[];
  __shared__ PaRow rows[ROWS];
  __shared__ int ids[S::STAGES][TILE + 1];
  const int kv_head = blockIdx.y, seq = blockIdx.z, split = blockIdx.x / p.tiles;
  const PaSeq sq = pa_seq(seq, split, block_tables, seq_lens, query_start_loc, seqused_k, p);
  const int group = p.num_heads / p.num_kv_heads, all_rows = sq.q_len * group;
  if (sq.q_len <= p.decode_max_q || split >= sq.splits.count) return;  // a decode kernel's, or idle
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2;
  const float qscale = p.scale * pd_scale<KV>(k_scale, p.k_scale_value, kv_head, p);
  const int* table = block_tables ? block_tables + seq * p.table_stride : nullptr;
  const int ntiles = (all_rows + ROWS - 1) / ROWS;
  for (int it = blockIdx.x % p.tiles; it < ntiles; it += p.tiles) {  // p.tiles apart: rows past the hint too
    const int row0 = (ntiles - 1 - it) * ROWS, nrows = min(ROWS, all_rows - row0);  // heaviest first
    for (int r = threadIdx.x; r < ROWS; r += PD_THREADS)
      rows[r] = pd_row(r, row0, nrows, group, kv_head, sq, sinks, alibi_slopes, p);
    pf_load_q<T, HD, ROWS>(pf_smem + S::Q, q, row0, nrows, group, kv_head, sq.q_start, p);  // pd_pipeline publishes
    __syncthreads();
    int lo = 0x7fffffff, hi = -1;                // the union of the rows' visible keys: the only ones loaded
    int wlo = 0x7fffffff, whi = -1;              // the union of this warp's rows'
    int all_lo = 0, all_hi = 0x7fffffff;         // keys every row of this warp sees
    for (int r = 0; r < nrows; ++r) {
      const PaRow& row = rows[r];
      const bool mine = r / (16 * MW) == warp;
      if (row.lo <= row.hi) {
        lo = min(lo, row.lo);
        hi = max(hi, row.hi);
        if (mine) { wlo = min(wlo, row.lo); whi = max(whi, row.hi); }
      }
      if (mine) { all_lo = max(all_lo, row.lo); all_hi = min(all_hi, row.hi); }
    }
    float o[MW][VHD / 8][4], m[MW][2], l[MW][2];  // rows g, g + 8 of the warp's m tiles
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
      m[mi][0] = m[mi][1] = neg_inf();
      l[mi][0] = l[mi][1] = 0.0f;
#pragma unroll
      for (int n = 0; n < VHD / 8; ++n) o[mi][n][0] = o[mi][n][1] = o[mi][n][2] = o[mi][n][3] = 0.0f;
    }
    pd_pipeline<S>(pf_smem, ids, table, lo, hi, p, [&](unsigned char* stage, const int* tile_ids, PdTile tile) {
      pd_issue<CacheT, S>(stage, key_cache, value_cache, tile_ids, tile, sq.key_row0, kv_head, p);
    }, [&](const unsigned char* stage, int base) {
      const unsigned char *kt = stage, *vt = stage + TILE * S::KROW;
      if constexpr (S::CONVERT) {
        pf_convert<KV, T, S>(pf_smem + S::CK, pf_smem + S::CV, stage);
        __syncthreads();  // the converted tiles are in (the pipeline's next barrier precedes the next conversion)
        kt = pf_smem + S::CK;
        vt = pf_smem + S::CV;
      }
      if (base > whi || base + TILE - 1 < wlo) return;  // none of the warp's rows sees these keys (warp-uniform)
      float s[MW][TILE / 8][4];
#pragma unroll
      for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int n = 0; n < TILE / 8; ++n) s[mi][n][0] = s[mi][n][1] = s[mi][n][2] = s[mi][n][3] = 0.0f;
      pf_scores<T, HD, TILE, MW>(s, pf_smem + S::Q, kt, warp, lane);
      const bool masked = base < all_lo || base + TILE - 1 > all_hi;  // the diagonal, window edges, the last tile
      const int key0 = base + 2 * (lane & 3);
#pragma unroll
      for (int mi = 0; mi < MW; ++mi) {
        const PaRow* wr = rows + 16 * (MW * warp + mi) + g;
        const float a0 = pf_softmax(s[mi], 0, m[mi][0], l[mi][0], wr[0], key0, masked, qscale, p.softcap);
        const float a1 = pf_softmax(s[mi], 1, m[mi][1], l[mi][1], wr[8], key0, masked, qscale, p.softcap);
#pragma unroll
        for (int n = 0; n < VHD / 8; ++n) { o[mi][n][0] *= a0; o[mi][n][1] *= a0; o[mi][n][2] *= a1; o[mi][n][3] *= a1; }
      }
      pf_values<T, VHD, TILE, MW>(o, s, vt, lane);
    });
    pf_store<T, VHD, MW>(o, m, l, rows, nrows, split, sq.splits.count, sq.seq_len,
                         pd_scale<KV>(v_scale, p.v_scale_value, kv_head, p), out, lse, max_logits, exp_sums,
                         tmp_output, p);
    __syncthreads();  // the next row tile rewrites rows and the q tile
  }
}

// ---- MLA on tensor cores over the latent cache, 16-bit q: every query run, a CTA one query of it at a time (one
// position for all its heads). A CTA takes ROWS = 16 MT query heads of one sequence and split; the latent rows (key = the row, value = its first v_head_size
// entries) arrive in stages of PD_TILE keys through a cp.async pipeline, stay in shared memory in their own
// type (fp8 is converted to q's type once per tile, exactly) and feed both products:
//   scores S = Q K^T: warp w takes m tile w / 4 over the k16 steps of quarter w % 4 (q in registers, 36 per
//     lane), K fragments by ldmatrix; the four partial sums go through shared memory;
//   softmax: warp w owns rows 4w..4w+3 (8 lanes a row): the partials summed in a fixed order, scale, softcap,
//     ALiBi, the online (m, l) step, P = e^{s - m} in float32;
//   P V: warp w takes MW m tiles and a slice of the 512 columns (64 fp32 accumulators a lane); its P fragments
//     are split in registers into 16-bit parts whose sum keeps P to ~22 bits (fp16: hi + lo, bf16: three
//     parts; two bf16 parts gave up to 8.5 ulps on cancelling outputs), one mma per part, V fragments by
//     ldmatrix.trans: P V at the fp32-P accuracy of the decode accuracy rule.
// The score partials and P are [rows][32] float32 rows with their 8-float groups XOR-swizzled by row % 4
// (md_at), so the mma fragments' float2 stores and loads and the softmax's float4 rows are conflict-free.
// Every (head, key) pair a CTA sees is visible (one query position): the tile's rows past the split's last
// key are zero-filled, never loaded, so a masked weight never meets a loaded value.
constexpr int MD_HD = 576;  // the latent row's capacity (attention.py MLA_BUCKET; values: its first 512)

// Element (row, col) of a swizzled [rows][32] float32 array.
__device__ __forceinline__ int md_at(int row, int col) { return row * PD_TILE + (col ^ (row & 3) << 3); }

template <class CacheT, int MT>
struct MdSmem {
  static constexpr int ROWS = 16 * MT, TILE = PD_TILE;
  static constexpr bool PREFETCH = false;  // block ids read at the barrier: no register held across a tile
  static constexpr int ROW = MD_HD * int(sizeof(CacheT)) + 16;  // a stage's row, bytes (+16: conflict-free)
  static constexpr int TROW = MD_HD * 2 + 16;                   // a 16-bit row, the mma operands' tile
  static constexpr int STAGE = PD_TILE * ROW;
  static constexpr int STAGES = MT == 1 ? MD_STAGES_16 : MD_STAGES_32;
  static constexpr int CONV = STAGES * STAGE;                   // fp8: the converted tile
  static constexpr int SPART = CONV + (sizeof(CacheT) == 1 ? PD_TILE * TROW : 0);  // [4][ROWS][32] floats
  static constexpr int P = SPART + 4 * ROWS * PD_TILE * 4;       // [ROWS][32] floats
  static constexpr int ALPHA = P + ROWS * PD_TILE * 4;           // [ROWS] this tile's rescale factors
  static constexpr int STATE = ALPHA + ROWS * 4;                 // [3][ROWS] each row's m, l and ALiBi slope
  static constexpr int BYTES = STATE + 3 * ROWS * 4;
};

// Issue tile `tile`'s latent rows into a stage; rows past tile.n and bytes past head_size are zero-filled.
template <class CacheT, int ROW>
__device__ __forceinline__ void md_issue(unsigned char* stage, const CacheT* kv_cache, const int* ids, PdTile tile,
                                         const PaParams& p) {
  constexpr int X = 16 / int(sizeof(CacheT)), CHUNKS = MD_HD / X;
  for (int i = threadIdx.x; i < PD_TILE * CHUNKS; i += blockDim.x) {
    const int j = i / CHUNKS, c = i - j * CHUNKS;
    const CacheT* src = kv_cache;
    int bytes = 0;
    if (j < tile.n) {
      const int pos = tile.base + j;
      const int b = pd_block_of(pos, p);
      src += (long long)ids[b - tile.first_block] * p.k_block_stride + (pos - b * p.block_size) * p.k_page_stride +
             c * X;
      bytes = min(max(p.head_size - c * X, 0), X) * int(sizeof(CacheT));
    }
    if (p.vec_k) {
      pd_copy16(stage + j * ROW + c * 16, bytes ? src : kv_cache, bytes);
    } else {  // rows not 16-byte aligned: element by element
      pd_copy_elems<CacheT, X>(stage + j * ROW + c * 16, bytes / int(sizeof(CacheT)), [&](int e) { return src + e; });
    }
  }
}

// fp8 stage -> the 16-bit tile, 8 codes a thread (8-byte reads, 16-byte writes: conflict-free); exact.
template <int KV, class T, int ROW, int TROW>
__device__ __forceinline__ void md_convert(unsigned char* dst, const unsigned char* src) {
  constexpr int CHUNKS = MD_HD / 8;
  for (int i = threadIdx.x; i < PD_TILE * CHUNKS; i += blockDim.x) {
    const int j = i / CHUNKS, c = i - j * CHUNKS;
    const uint2 codes = *reinterpret_cast<const uint2*>(src + j * ROW + c * 8);
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = tc_fp8x2<KV, T>((k < 2 ? codes.x : codes.y) >> (16 * (k % 2)));
    }
    *reinterpret_cast<uint4*>(dst + j * TROW + c * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Warp w's partial scores: m tile w / 4 (16 heads) x the tile's 32 keys over k16 steps 9 (w % 4) .. + 8, 16
// keys at a time (q stays in registers; 8 accumulators live, not 16).
template <class T, int ROWS, int TROW>
__device__ __forceinline__ void md_scores(float* spart, const unsigned char* kt, const unsigned (&qa)[9][4], int warp,
                                          int lane) {
  const int kq = warp & 3, i = lane >> 3, row = kq * ROWS + (warp >> 2) * 16 + (lane >> 2), col = 2 * (lane & 3);
#pragma unroll 1
  for (int np = 0; np < 2; ++np) {  // keys 16 np .. 16 np + 15: b0, b1 of two n tiles
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int k = 0; k < 9; ++k) {
      unsigned b[4];
      tc_ldmatrix_x4(b, kt + (np * 16 + (i >> 1) * 8 + (lane & 7)) * TROW + ((kq * 9 + k) * 16 + (i & 1) * 8) * 2);
      tc_mma<T>(s[0], qa[k], b[0], b[1]);
      tc_mma<T>(s[1], qa[k], b[2], b[3]);
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      *reinterpret_cast<float2*>(spart + md_at(row, col + 16 * np + 8 * n)) = make_float2(s[n][0], s[n][1]);
      *reinterpret_cast<float2*>(spart + md_at(row + 8, col + 16 * np + 8 * n)) = make_float2(s[n][2], s[n][3]);
    }
  }
}

// Row r = 4 warp + lane / 8, keys 4 (lane % 8) .. + 3 of a tile with n keys from `base`: the online-softmax
// step of the row's (m, l, slope) in `state` (shared memory: registers are q's and o's), P and the row's
// rescale factor.
template <int ROWS>
__device__ __forceinline__ void md_softmax(const float* spart, float* ps, float* alpha_s, float* state, int r, int j0,
                                           int n, int base, int pos, float qscale, float softcap) {
  const float m = state[r], l = state[ROWS + r], slope = state[2 * ROWS + r];
  float4 acc = *reinterpret_cast<const float4*>(spart + md_at(r, j0));
#pragma unroll
  for (int kq = 1; kq < 4; ++kq) {  // row kq ROWS + r has r's swizzle: ROWS is a multiple of 4
    const float4 x = *reinterpret_cast<const float4*>(spart + md_at(kq * ROWS + r, j0));
    acc = make_float4(acc.x + x.x, acc.y + x.y, acc.z + x.z, acc.w + x.w);
  }
  float x[4] = {acc.x, acc.y, acc.z, acc.w}, mx = neg_inf();
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float s = x[e] * qscale;
    if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
    s -= slope * fabsf(float(base + j0 + e - pos));
    x[e] = j0 + e < n ? s : neg_inf();
    mx = fmaxf(mx, x[e]);
  }
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float m_new = fmaxf(m, mx);
  const float alpha = m == neg_inf() ? 0.0f : expf(m - m_new);
  float sum = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    x[e] = x[e] == neg_inf() ? 0.0f : expf(x[e] - m_new);  // masking by selection
    sum += x[e];
  }
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (j0 == 0) {  // every lane of the row has read the state (the shuffles above converged them)
    alpha_s[r] = alpha;
    state[r] = m_new;
    state[ROWS + r] = l * alpha + sum;
  }
  *reinterpret_cast<float4*>(ps + md_at(r, j0)) = make_float4(x[0], x[1], x[2], x[3]);
}

// o = o * alpha + P V for warp w's MW m tiles (rows row0 ..) and NC n8 tiles of columns c0 .., over k8 steps
// of keys (m16n8k8: half the fragment registers of k16, so q, o and the fragments fit 128 registers); one mma
// per part of P, the smallest first.
template <class T, int MW, int NC, int TROW>
__device__ __forceinline__ void md_values(float (&o)[MW][NC][4], const unsigned char* kt, const float* ps,
                                          const float* alpha_s, int row0, int c0, int lane) {
  constexpr int PARTS = TcHalf<T>::value ? 2 : 3;
#pragma unroll
  for (int mi = 0; mi < MW; ++mi) {
    const float a0 = alpha_s[row0 + 16 * mi + (lane >> 2)], a1 = alpha_s[row0 + 16 * mi + (lane >> 2) + 8];
#pragma unroll
    for (int n = 0; n < NC; ++n) { o[mi][n][0] *= a0; o[mi][n][1] *= a0; o[mi][n][2] *= a1; o[mi][n][3] *= a1; }
  }
  // A fragments: (g, 2t..2t+1) and (g + 8, 2t..2t+1) of keys 8 kk .., rows row0 + 16 mi ..: every row of this
  // lane has the swizzle of row g (md_at), so one base address and constant offsets.
  const float* pa = ps + md_at(row0 + (lane >> 2), 2 * (lane & 3)) - 8 * (lane >> 2 & 3);
#pragma unroll 1
  for (int kk = 0; kk < PD_TILE / 8; ++kk) {  // not unrolled: fragments hoisted across steps would spill
    unsigned pf[MW][PARTS][2];
    const float* at = pa + 8 * (kk ^ (lane >> 2 & 3));
#pragma unroll
    for (int mi = 0; mi < MW; ++mi) {
      float2 x0 = *reinterpret_cast<const float2*>(at + 16 * mi * PD_TILE);
      float2 x1 = *reinterpret_cast<const float2*>(at + (16 * mi + 8) * PD_TILE);
#pragma unroll
      for (int k = 0; k < PARTS; ++k) { pf[mi][k][0] = tc_part<T>(x0); pf[mi][k][1] = tc_part<T>(x1); }
    }
#pragma unroll
    for (int nq = 0; nq < NC / 4; ++nq) {  // columns c0 + 32 nq .. + 31: b0 of four n tiles (.trans of [key][col])
      unsigned b[4];
      tc_ldmatrix_x4_trans(b, kt + (8 * kk + (lane & 7)) * TROW + (c0 + 32 * nq + (lane >> 3) * 8) * 2);
#pragma unroll
      for (int mi = 0; mi < MW; ++mi)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int k = PARTS - 1; k >= 0; --k) tc_mma_k8<T>(o[mi][4 * nq + i], pf[mi][k], b[i]);
    }
  }
}

// The end of a CTA: each lane's (row, column pair) of o, finished (sink, LSE) or written as a split's partials.
template <class T, int MW, int NC>
__device__ __forceinline__ void md_finish(const float (&o)[MW][NC][4], const float* state, int rows, int row0,
                                          int c0, int head0, int token, int split, int num_splits, int seq_len,
                                          float oscale, const float* sinks, T* out, float* lse, float* max_logits,
                                          float* exp_sums, void* tmp_output, const PaParams& p) {
  const int lane = threadIdx.x & 31;
  const bool partial = (num_splits > 1 || p.always_partials) && seq_len > 0;
#pragma unroll
  for (int mi = 0; mi < MW; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + 16 * mi + (lane >> 2) + 8 * h, head = head0 + r;
      if (head >= p.num_heads) continue;
      const float m = state[r], l = state[rows + r];
      const long long th = (long long)token * p.num_heads + head;
      const SoftmaxFinish fin = softmax_finish(m, l, sinks ? sinks[head] : neg_inf());
      const float fp = oscale * (l > 0.0f ? 1.0f / l : 0.0f), fo = oscale * fin.scale;
#pragma unroll
      for (int n = 0; n < NC; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int d = c0 + 8 * n + 2 * (lane & 3) + e;
          if (d >= p.v_head_size) continue;
          if (partial)
            pa_store_partial<T>(tmp_output, (th * p.max_splits + split) * p.v_head_size + d, o[mi][n][2 * h + e] * fp,
                                p.partials_in_out_type);
          if (num_splits == 1)
            out[token * p.out_token_stride + head * p.out_head_stride + d] = from_float<T>(o[mi][n][2 * h + e] * fo);
        }
      if (c0 == 0 && (lane & 3) == 0) {
        if (partial) { max_logits[th * p.max_splits + split] = m; exp_sums[th * p.max_splits + split] = l; }
        if (num_splits == 1 && lse) lse[(long long)head * p.num_tokens + token] = fin.lse;
      }
    }
}

template <class T, int KV, int MT>
__global__ void __launch_bounds__(128 * MT, SM_REGISTERS / (128 * MT * MD_REGISTERS)) mla_decode_kernel(
    const T* __restrict__ q,                 // [num_tokens, num_heads, head_size <= 576]
    const typename CacheType<KV, T>::type* __restrict__ key_cache,    // [num_blocks, block_size, head_size] latent
    const typename CacheType<KV, T>::type* __restrict__ value_cache,  // the same array (rows 16-byte aligned)
    const int* __restrict__ block_tables,    // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,        // [num_seqs]
    const int* __restrict__ query_start_loc, // [num_seqs + 1], or nullptr: one query per sequence
    const int* __restrict__ seqused_k,       // dense: [num_seqs] or nullptr
    const float* __restrict__ sinks, const float* __restrict__ alibi_slopes,  // [num_heads] or nullptr
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,     // [1] or nullptr
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    void* __restrict__ tmp_output, PaParams p) {  // as paged_decode_kernel's
  typedef typename CacheType<KV, T>::type CacheT;
  typedef MdSmem<CacheT, MT> S;
  constexpr int MW = MT == 1 ? 1 : 2, NC = 16 / MW;  // P V: m tiles and n8 column tiles of a warp
  extern __shared__ __align__(16) unsigned char md_smem[];
  __shared__ int ids[S::STAGES][S::TILE + 1];  // block ids of the tile in each stage
  const int seq = blockIdx.z, split = blockIdx.x / p.decode_tiles, tile = blockIdx.x % p.decode_tiles;
  const int head_tiles = (p.num_heads + S::ROWS - 1) / S::ROWS, head0 = tile % head_tiles * S::ROWS;
  const PaSeq sq = pa_seq(seq, split, block_tables, seq_lens, query_start_loc, seqused_k, p);
  if (sq.q_len > p.decode_max_q || split >= sq.splits.count) return;  // another kernel's
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float qscale = p.scale * (KV == KV_AUTO ? 1.0f : read_scale(k_scale, p.k_scale_value, 0, 0));
  const float oscale = KV == KV_AUTO ? 1.0f : read_scale(v_scale, p.v_scale_value, 0, 0);
  const int r = 4 * warp + (lane >> 3), j0 = (lane & 7) * 4;  // the softmax lane's row and keys
  const int row0 = 16 * MW * (warp / (4 * MW)), c0 = 8 * NC * (warp % (4 * MW));  // the P V slice
  float* state = reinterpret_cast<float*>(md_smem + S::STATE);
  float* ps = reinterpret_cast<float*>(md_smem + S::P);
  float* alpha_s = reinterpret_cast<float*>(md_smem + S::ALPHA);
  const int* table = block_tables + seq * p.table_stride;
  // The run's queries in turn (speculative decoding: q_len > 1), each at one position for all the CTA's heads:
  // query tile / head_tiles, then every p.decode_tiles / head_tiles further (a run longer than the hint said).
  for (int i = tile / head_tiles; i < sq.q_len; i += p.decode_tiles / head_tiles) {
    const int token = sq.q_start + i, pos = sq.seq_len - sq.q_len + i;
    const PaRange vis = pa_visible(pos, sq.seq_len, p);
    const int lo = max(vis.lo, sq.split_lo), hi = min(vis.hi, sq.split_hi);
    unsigned qa[9][4];  // A fragments of m tile warp / 4 over k16 steps 9 (warp % 4) .. + 8
#pragma unroll
    for (int k = 0; k < 9; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int head = head0 + (warp >> 2) * 16 + (lane >> 2) + (e & 1) * 8;
        const int d = ((warp & 3) * 9 + k) * 16 + 2 * (lane & 3) + (e >> 1) * 8;
        const T* row = q + token * p.q_token_stride + head * p.q_head_stride;
        const bool live = head < p.num_heads;
        qa[k][e] = tc_pack<T>(live && d < p.head_size ? row[d] : from_float<T>(0.0f),
                              live && d + 1 < p.head_size ? row[d + 1] : from_float<T>(0.0f));
      }
    if (j0 == 0) {
      state[r] = neg_inf();
      state[S::ROWS + r] = 0.0f;
      state[2 * S::ROWS + r] = alibi_slopes && head0 + r < p.num_heads ? alibi_slopes[head0 + r] : 0.0f;
    }
    float o[MW][NC][4];
#pragma unroll
    for (int mi = 0; mi < MW; ++mi)
#pragma unroll
      for (int n = 0; n < NC; ++n) o[mi][n][0] = o[mi][n][1] = o[mi][n][2] = o[mi][n][3] = 0.0f;
    pd_pipeline<S>(md_smem, ids, table, lo, hi, p, [&](unsigned char* stage, const int* tile_ids, PdTile t) {
      md_issue<CacheT, S::ROW>(stage, key_cache, tile_ids, t, p);
    }, [&](const unsigned char* stage, int base) {
      const unsigned char* kt = stage;
      if constexpr (KV != KV_AUTO) {
        md_convert<KV, T, S::ROW, S::TROW>(md_smem + S::CONV, kt);
        kt = md_smem + S::CONV;
        __syncthreads();
      }
      md_scores<T, S::ROWS, S::TROW>(reinterpret_cast<float*>(md_smem + S::SPART), kt, qa, warp, lane);
      __syncthreads();  // the four partial sums of every score are in
      md_softmax<S::ROWS>(reinterpret_cast<const float*>(md_smem + S::SPART), ps, alpha_s, state, r, j0,
                          min(PD_TILE, hi - base + 1), base, pos, qscale, p.softcap);
      __syncthreads();  // P and the rescale factors are in
      md_values<T, MW, NC, S::TROW>(o, kt, ps, alpha_s, row0, c0, lane);
    });
    __syncthreads();  // the last tile's (m, l) are in
    md_finish<T, MW, NC>(o, state, S::ROWS, row0, c0, head0, token, split, sq.splits.count, sq.seq_len, oscale,
                         sinks, out, lse, max_logits, exp_sums, tmp_output, p);
    __syncthreads();  // the next query rewrites the rows' state and the stages
  }
}

template <class T>
__global__ void __launch_bounds__(PA_THREADS) paged_attention_reduce_kernel(
    T* __restrict__ out,                     // [num_tokens, num_heads, v_head_size]
    float* __restrict__ lse,                 // [num_heads, num_tokens] or nullptr
    const float* __restrict__ max_logits,    // [num_tokens, num_heads, max_splits]
    const float* __restrict__ exp_sums,      // [num_tokens, num_heads, max_splits]
    const void* __restrict__ tmp_output,     // [num_tokens, num_heads, max_splits, v_head_size] float32 or T
    const int* __restrict__ seq_lens,        // [num_seqs], or cu_seqlens_k [num_seqs + 1] (dense)
    int dense,
    const int* __restrict__ query_start_loc, // [num_seqs + 1] or nullptr
    const int* __restrict__ seqused_k,       // dense: [num_seqs] or nullptr
    const float* __restrict__ sinks,         // [num_heads] or nullptr
    PaParams p, int num_seqs) {
  const int token = blockIdx.x, head = blockIdx.y;
  int seq = token;
  if (query_start_loc) {  // the sequence holding this token: last s with query_start_loc[s] <= token
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
    }
    seq = lo;
    if (token >= query_start_loc[num_seqs]) return;
  }
  const int seq_len = !dense ? seq_lens[seq] : seqused_k ? seqused_k[seq] : seq_lens[seq + 1] - seq_lens[seq];
  const int num_splits = pa_splits(seq_len, p).count;
  if (num_splits <= 1) return;  // finished by the main kernel
  const long long th = (long long)token * p.num_heads + head;
  const float* m = max_logits + th * p.max_splits;
  const float* l = exp_sums + th * p.max_splits;
  __shared__ SoftmaxMerge mg;
  __shared__ float share[PA_THREADS];  // w_s l_s of a chunk of splits, -1 for an empty one (skipped by selection)
  __shared__ __align__(16) float part[4][PA_MERGE_COLS];  // each warp's sums over its splits
  if (threadIdx.x == 0) mg = softmax_merge(m, l, num_splits, sinks ? sinks[head] : neg_inf());
  __syncthreads();
  // Lane l takes columns PA_MERGE_COLS blockIdx.z + 4 l .. + 3 (one vector load), warp w the splits w, w + 4, ...:
  // the 4 warps' loads in flight together. v_head_size is a multiple of 8: a lane's 4 columns are all in or out.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d0 = blockIdx.z * PA_MERGE_COLS + 4 * lane;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int s0 = 0; s0 < num_splits; s0 += PA_THREADS) {  // every split's weight once, then coalesced partial rows
    const int s = s0 + threadIdx.x;
    share[threadIdx.x] = s < num_splits && l[s] > 0.0f ? softmax_share(m[s], l[s], mg.mx) : -1.0f;
    __syncthreads();
    for (int i = warp; i < PA_THREADS && s0 + i < num_splits; i += 4) {
      const float w = share[i];
      if (w < 0.0f || d0 >= p.v_head_size) continue;
      const float4 x = pa_load_partial4<T>(tmp_output, (th * p.max_splits + s0 + i) * p.v_head_size + d0,
                                           p.partials_in_out_type);
      acc[0] += w * x.x; acc[1] += w * x.y; acc[2] += w * x.z; acc[3] += w * x.w;
    }
    __syncthreads();
  }
  *reinterpret_cast<float4*>(&part[warp][4 * lane]) = make_float4(acc[0], acc[1], acc[2], acc[3]);  // conflict-free
  __syncthreads();
  const int c = threadIdx.x, d = blockIdx.z * PA_MERGE_COLS + c;  // a column a thread: the warps' sums in a fixed order
  if (d < p.v_head_size)
    out[token * p.out_token_stride + head * p.out_head_stride + d] =
        from_float<T>((((part[0][c] + part[1][c]) + part[2][c]) + part[3][c]) * mg.inv);
  if (lse && threadIdx.x == 0 && blockIdx.z == 0) lse[(long long)head * p.num_tokens + token] = mg.lse;
}

}  // namespace cupaged
