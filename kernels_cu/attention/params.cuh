// attention/params.cuh: what every attention kernel of paged_attention.cu reads first: the parameter struct, the
// occupancy budgets, a sequence's keys and splits, and the split partials' format.
//
// Used by:   every kernel file under attention/; PaParams and the constants are mirrored by cupaged/attention.py
//            and cupaged/_attention_kernels.py through cupaged/_mirror.py (tests/test_mirror.py checks them)
// Test:      pytest tests/test_mirror.py tests/test_paged_attention.py tests/test_attention_plan.py
#pragma once
#include "../common.cuh"

namespace cupaged {

constexpr int PA_THREADS = 128;  // 4 warps
constexpr int PD_THREADS = 128;  // the decode and prefill CTAs: 4 warps; a warp consumes its own slice of each stage
constexpr int PD_TILE = 32;      // keys per pipeline stage of paged_decode_kernel (16 for float32 head 256) and MLA's
constexpr int PD_MAX_Q = 16;     // the longest query run the decode kernels take
constexpr int PA_PRIOR_SPLITS = 32;  // a shared level's splits a decode kernel folds in at most (a lane each)
// Occupancy budgets, read by the host's plan (cupaged/_attention_kernels.py) through cupaged/_mirror.py.
constexpr int SM_REGISTERS = 65536;  // 32-bit registers of an SM (sm_80, sm_90)
constexpr int PD_REGISTERS = 128;    // a thread's registers in paged_decode_kernel: 4 CTAs of PD_THREADS an SM
constexpr int PM_REGISTERS = 168;    // and in paged_decode_mma_kernel: 3 CTAs an SM, which its stages allow at most
constexpr int PF_REGISTERS = 255;    // a thread's registers in the prefill kernel (ptxas's most): 2 CTAs an SM
constexpr int MD_REGISTERS = 255;    // a thread's registers in the MLA decode kernel: 2 CTAs of 128, 1 of 256
constexpr int PD_SMEM_FOR_4 = 65536;   // paged_decode_kernel: 4 stages where they fit in these bytes,
constexpr int PD_SMEM_FOR_3 = 98304;   // else 3 in these, else 2
constexpr int PM_SMEM_FOR_3 = 65536;   // paged_decode_mma_kernel: 3 stages where they fit in these bytes, else 2
constexpr int PF_SMEM_FOR_3 = 101376;  // paged_prefill_kernel: 3 stages where they and its q tile fit in 99 KB
                                       // (sm_86 / sm_89's most a block), else 2
constexpr int MD_STAGES_16 = 2;  // mla_decode_kernel's stages with 16 heads a CTA (2 CTAs an SM)
constexpr int MD_STAGES_32 = 3;  // and with 32 heads (1 CTA an SM)

struct PaParams {
  long long q_token_stride, q_head_stride, out_token_stride, out_head_stride;
  long long k_block_stride, k_head_stride, k_chunk_stride, k_page_stride;
  long long v_block_stride, v_head_stride, v_page_stride, v_dim_stride;
  long long table_stride;
  float scale, softcap, k_scale_value, v_scale_value;
  int scale_per_head, always_partials, partials_in_out_type;
  int partials_only;  // cascade's shared levels: every split slot of every row gets partials (an idle split, or a
                      // sequence without keys: exp_sum 0, empty), never out / LSE; a merge or a later launch finishes
  int prior_splits;   // cascade, the own level's decode: max_logits / exp_sums / tmp_output hold a shared level's
                      // partials, prior_splits slots a row, folded into each row's finish (0: none)
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

// partials_only: a CTA whose split is past its sequence's last marks that split empty (exp_sum 0) in each of the
// sequence's rows, so a reader of every slot (pa_fold_prior) skips it; the CTA of row tile 0 marks them all.
__device__ __forceinline__ void pa_mark_empty(int q_start, int q_len, int split, int tile, int kv_head, int group,
                                              float* exp_sums, const PaParams& p) {
  if (!p.partials_only || tile != 0) return;
  for (int r = threadIdx.x; r < q_len * group; r += blockDim.x) {
    const long long th = (long long)(q_start + r / group) * p.num_heads + kv_head * group + r % group;
    exp_sums[th * p.max_splits + split] = 0.0f;
  }
}

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

// Sequence seq's keys and their splits, read here alone, so the kernels (pa_seq) and the split merge agree:
// seq_lens[seq] over a paged cache; over dense rows (seq_lens = cu_seqlens_k) seqused_k[seq] when given, else
// the sequence's run of rows.
struct PaKeys {
  int seq_len;
  PaSplits splits;
};

__device__ __forceinline__ PaKeys pa_keys(int seq, bool dense, const int* seq_lens, const int* seqused_k,
                                          const PaParams& p) {
  const int seq_len = !dense ? seq_lens[seq] : seqused_k ? seqused_k[seq] : seq_lens[seq + 1] - seq_lens[seq];
  return {seq_len, pa_splits(seq_len, p)};
}

// A CTA's sequence and split: where its keys are, its query run, and the keys split_lo..split_hi it covers.
struct PaSeq {
  long long key_row0;  // dense rows: the first key's row
  int seq_len, q_start, q_len;
  PaSplits splits;
  int split_lo, split_hi;
  int mask0;  // the first bit of the sequence's custom mask (mask_indptr[seq] bytes in), 0 without one
};

__device__ __forceinline__ PaSeq pa_seq(int seq, int split, const int* block_tables, const int* seq_lens,
                                        const int* query_start_loc, const int* seqused_k, const int* mask_indptr,
                                        const PaParams& p) {
  PaSeq s;
  const bool dense = block_tables == nullptr;
  s.key_row0 = dense ? seq_lens[seq] : 0;
  const PaKeys keys = pa_keys(seq, dense, seq_lens, seqused_k, p);
  s.seq_len = keys.seq_len;
  s.q_start = query_start_loc ? query_start_loc[seq] : seq;
  s.q_len = query_start_loc ? query_start_loc[seq + 1] - s.q_start : 1;
  s.splits = keys.splits;
  s.split_lo = split * s.splits.size;
  s.split_hi = min(s.seq_len, s.split_lo + s.splits.size) - 1;
  s.mask0 = mask_indptr ? mask_indptr[seq] * 8 : 0;  // int: the wrapper caps a packed mask at 2^28 bytes
  return s;
}

// A K or V scale for kv head `kv_head`: 1 for a cache of q's own type (scales ignored).
template <int KV>
__device__ __forceinline__ float pa_cache_scale(const float* ptr, float value, int kv_head, const PaParams& p) {
  return KV == KV_AUTO ? 1.0f : read_scale(ptr, value, p.scale_per_head, kv_head);
}

}  // namespace cupaged
