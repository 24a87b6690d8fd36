// cache_gather.cu: read the paged KV cache back into dense rows, and copy whole blocks inside a cache.
//
// Maths: dst[cu_seq_lens[b] + i] = dequantize(cache[block_table[b, p / block_size], p % block_size], scale)
// for token i of sequence b at logical position p = i (+ seq_starts[b]); dequantize is the identity
// for kv_cache_dtype "auto" and float(code) * scale for fp8 e4m3/e5m2. copy_blocks: cache[d] = cache[s]
// for every (s, d) pair of block_mapping.
//
// Layouts (docs/conventions.md §4), strides in elements unless said otherwise:
//   src_cache       [num_blocks, block_size, entry...]   e.g. the MLA cache [.., kv_lora_rank + rope_dim]
//   dst             [total_tokens, entry...]             any row stride
//   block_table     int32 [batch, max_blocks_per_seq]    entries past a sequence's last block never read
//   cu_seq_lens     int32 [batch + 1];  seq_starts int32 [batch] or none;  token_to_seq int32 [num_tokens]
//   block_mapping   int64 [num_pairs, 2] (src, dst)
// Offsets are 64-bit: num_blocks * block stride passes 2^31 elements in production caches.
//
// Versions (all memory-bound copies: every byte read once, written once):
//   v1 gather_and_maybe_dequant_cache_kernel: one CTA per gathered token (vLLM's op; tokens past
//      their sequence or past its block-table row are skipped); fp8 rows dequantized into dst's dtype.
//   v1 cp_gather_cache_kernel: (sequence, split) CTAs walking a sequence, raw 16-byte words (bytes
//      when a row, stride or address is not 16-byte aligned).
//   v1 copy_blocks_kernel: one CTA per (src, dst) pair, the block moved as raw 16-byte words (or bytes).
//
// Used by:   cupaged/cache_gather.py (gather_and_maybe_dequant_cache, cp_gather_cache, copy_blocks; its
//            swap_blocks is a host copy), cupaged/mla.py (mla_chunked_prefill's context gather),
//            cupaged/selftest.py; reference: cupaged/reference/cache_gather.py
// Test:      pytest tests/test_cache_gather.py      (sim; cuda too when a GPU is present; -m slow: the
//            full grid and 64-bit offsets); also tests/test_mla.py, test_kv_cache.py, test_api_fuzz.py,
//            test_bad_input.py; as every family, test_compile_gate.py, sim/test_params.py, test_runtime.py
// Benchmark: python profiling/bench_cache_gather.py
#include "common.cuh"

namespace cupaged {

constexpr int CACHE_GATHER_THREADS = 256;  // per CTA (the launcher reads it from here)

// One cache row [entry_size] dequantized into dst's type.
template <int KV, class OutT, class CacheT>
__device__ __forceinline__ void gather_row(OutT* dst, const CacheT* src, int entry_size, float scale) {
  for (int i = threadIdx.x; i < entry_size; i += blockDim.x) dst[i] = dequantize<KV, OutT>(src[i], scale);
}

template <class OutT, int KV>
__global__ void __launch_bounds__(CACHE_GATHER_THREADS) gather_and_maybe_dequant_cache_kernel(
    const typename CacheType<KV, OutT>::type* __restrict__ src_cache,  // [num_blocks, block_size, entry_size]
    OutT* __restrict__ dst,                 // [>= num_tokens, entry_size]
    const int* __restrict__ block_table,    // [batch, max_blocks_per_seq]
    const int* __restrict__ cu_seq_lens,    // [batch + 1]
    const int* __restrict__ token_to_seq,   // [>= num_tokens]
    const int* __restrict__ seq_starts,     // [batch] or nullptr
    const float* __restrict__ scale, float scale_value,
    long long block_stride, long long entry_stride, long long dst_stride, long long table_stride,
    int entry_size, int block_size, int batch, int table_width) {
  const int token = blockIdx.x;
  const int b = token_to_seq[token];
  if (b < 0 || b >= batch || token >= cu_seq_lens[b + 1]) return;  // a bad sequence index, or past its tokens
  const long long pos = token - (long long)cu_seq_lens[b] + (seq_starts ? seq_starts[b] : 0);
  // vLLM's guard: a chunk whose seq_starts offset runs past the block-table row is valid input whose
  // tokens are skipped (their dst rows untouched), never a read past the row.
  if (pos < 0 || pos / block_size >= table_width) return;
  const long long block = block_table[b * table_stride + pos / block_size];
  gather_row<KV>(dst + token * dst_stride, src_cache + block * block_stride + pos % block_size * entry_stride,
                 entry_size, read_scale(scale, scale_value, 0, 0));
}

// Raw copies move WORD-byte words (16 when every block, row and address allows it, else 1):
// the element type does not matter, so void pointers keep one instantiation per word size.
template <int WORD>
__global__ void __launch_bounds__(CACHE_GATHER_THREADS) cp_gather_cache_kernel(
    const void* __restrict__ src_cache,     // [num_blocks, block_size, entry...]
    void* __restrict__ dst,                 // [total_tokens, entry...]
    const int* __restrict__ block_table,    // [batch, max_blocks_per_seq]
    const int* __restrict__ cu_seq_lens,    // [batch + 1]
    const int* __restrict__ seq_starts,     // [batch] or nullptr
    long long block_stride, long long entry_stride, long long dst_stride, long long table_stride,
    int entry_words, int block_size) {      // strides in words
  typedef Vec<unsigned char, WORD> Word;
  const Word* src_words = static_cast<const Word*>(src_cache);
  Word* dst_words = static_cast<Word*>(dst);
  const int b = blockIdx.x;
  const int begin = cu_seq_lens[b], len = cu_seq_lens[b + 1] - begin;
  const int per_split = (len + int(gridDim.y) - 1) / int(gridDim.y);
  const int lo = int(blockIdx.y) * per_split, hi = min(len, lo + per_split);
  const long long start = seq_starts ? seq_starts[b] : 0;
  for (int t = lo; t < hi; ++t) {
    const long long pos = start + t;
    const long long block = block_table[b * table_stride + pos / block_size];
    const Word* src = src_words + block * block_stride + pos % block_size * entry_stride;
    for (int i = threadIdx.x; i < entry_words; i += blockDim.x) dst_words[(begin + t) * dst_stride + i] = src[i];
  }
}

template <int WORD>
__global__ void __launch_bounds__(CACHE_GATHER_THREADS) copy_blocks_kernel(
    void* __restrict__ cache,               // [num_blocks, ...]: each block block_words contiguous words
    const long long* __restrict__ block_mapping,  // [num_pairs, 2] (src, dst)
    long long block_stride, long long block_words) {  // in words
  typedef Vec<unsigned char, WORD> Word;
  Word* words = static_cast<Word*>(cache);
  const long long src = block_mapping[2 * blockIdx.x], dst = block_mapping[2 * blockIdx.x + 1];
  for (long long i = threadIdx.x; i < block_words; i += blockDim.x)
    words[dst * block_stride + i] = words[src * block_stride + i];
}

}  // namespace cupaged
