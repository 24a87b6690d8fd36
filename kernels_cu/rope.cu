// rope.cu: rotary position embeddings (RoPE) in place, and fused with the paged-cache write of k and v.
//
// Maths: a token at position p rotates the first rotary_dim dimensions of every q and k head in pairs: pair i
// (i < rotary_dim / 2) is dims (i, i + rotary_dim / 2) in GPT-NeoX style, (2i, 2i + 1) in GPT-J style, and
//   (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),  cos, sin of p * inv_freq[i] times attention_factor,
// computed in float32 and rounded to the data's type once. cos and sin come from a cos_sin_cache row (float32
// [max_position, rotary_dim]: the rotary_dim / 2 cosines, then the sines, as vLLM lays it out, the attention factor
// already in) or, without one, from inv_freq in float64 (sincos of p * inv_freq[i], times attention_factor in
// float64, rounded to float32: the cache's own values). attention_factor is YaRN's / LongRoPE's scaling of cos and
// sin (Hugging Face's attention_scaling), 1 otherwise.
//
// Layouts (docs/conventions.md §4), strides in elements, last dimension contiguous:
//   q              [num_tokens, num_heads, head_size]      any token / head stride (views of a fused QKV buffer)
//   k, v           [num_tokens, num_kv_heads, head_size]
//   positions      int64 or int32 [num_tokens]
//   cos_sin_cache  float32 [max_position, rotary_dim], or inv_freq float64 [rotary_dim / 2]
//   key_cache, value_cache  flash NHD [num_blocks, block_size, num_kv_heads, head_size] or HND
//                  [num_blocks, num_kv_heads, block_size, head_size] (uint8 for fp8), (block, slot, head) strides
//   slot_mapping   int64 or int32 [num_tokens]; < 0 = padding: rotated, not written
//
// Versions (memory-bound: every q / k / v byte read once and written once):
//   v1 rope_kernel / rope_and_cache_kernel: one CTA per token, a thread per (head, pair), then per k / v element
//      of the cache write (fp8: saturate(x / scale), as reshape_and_cache_flash). H200 model (bench_rope.py
//      --model, 16k tokens, 32/8 heads, d128): fp16 176.8 us (51.4% of HBM peak), fp8 169.8 us (latency-bound:
//      2-byte accesses keep too few bytes in flight).
//   v2: the token's cos / sin row read (or computed) once into shared memory for all its heads (v1 read it again
//      for every head: 335 of the 839 MB requested); VEC (16-byte aligned rows, rotary_dim / 2 and head_size
//      multiples of 16 / sizeof(T)): a thread takes 16 bytes of each of a unit's two runs of pairs, and 16-byte
//      chunks of the cache write (quantize_chunk).
//   v3: k's rotated runs written to the cache from the registers that rotated them (v2 read the 2 KB of a token's
//      k back after a barrier: 33.5 of the 512 MB requested); only the threads computing the cos / sin row read
//      the position. H200 model (16k tokens): fp16 121.0 -> 111.2 us, fp8 113.2 -> 103.6 us (both latency-bound:
//      the bytes requested over the bytes in flight).
//
// Used by:   cupaged/rope.py (RotaryEmbedding, rope_and_cache), cupaged/selftest.py
// Reference: cupaged/reference/rope.py
// Frequencies: cupaged/_rope_scaling.py (Hugging Face's rope scalings, and their attention factors)
// Test:      pytest tests/test_rope.py (sim; cuda too when a GPU is present); as every family,
//            test_compile_gate.py and sim/test_params.py
// Benchmark: python profiling/bench_rope.py
#include "common.cuh"

namespace cupaged {

constexpr int ROPE_THREADS = 128;  // per CTA (the launcher reads it from here)
constexpr int ROPE_MAX_DIM = 512;  // the largest rotary_dim (a token's cos / sin row lives in shared memory)

struct RopeParams {
  long long q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride;
  long long block_stride, page_stride, head_stride;  // the caches' (rope_and_cache_kernel)
  double attention_factor;  // cos and sin computed from inv_freq are multiplied by it (rope_kernel)
  float k_scale_value, v_scale_value;
  int scale_per_head, num_heads, num_kv_heads, head_size, rotary_dim, neox, block_size;
};

// cos and sin of pair i at position pos: the cache's row, or sincos in float64 of pos * inv_freq[i] times the
// attention factor (in float64, so that the one rounding matches RotaryEmbedding.cos_sin_cache's).
__device__ __forceinline__ float2 rope_cos_sin(const float* cos_sin_cache, const double* inv_freq, long long pos,
                                               int i, const RopeParams& p) {
  if (cos_sin_cache) {
    const float* row = cos_sin_cache + pos * p.rotary_dim;
    return make_float2(row[i], row[p.rotary_dim / 2 + i]);
  }
  double s, c;
  sincos(double(pos) * inv_freq[i], &s, &c);
  return make_float2(float(c * p.attention_factor), float(s * p.attention_factor));
}

// Rotate N pairs of one head x in place, pairs i0 .. i0 + N - 1 (N = 16 / sizeof(T) with VEC: each run of N
// elements one 16-byte load and store; 1 without), and hand each rotated run to out(offset in the head, its N
// elements). NeoX: x1 = x[i0 ..], x2 = x[half + i0 ..]; GPT-J: x[2 i0 ..] holds the N pairs interleaved.
template <class T, bool VEC, class Out>
__device__ __forceinline__ void rope_pairs(T* x, int i0, const float* cs, const RopeParams& p, Out out) {
  constexpr int N = VEC ? 16 / int(sizeof(T)) : 1;
  const int half = p.rotary_dim / 2;
  T* lo = p.neox ? x + i0 : x + 2 * i0;
  T* hi = p.neox ? x + half + i0 : x + 2 * i0 + N;
  Vec<T, N> a = load_vec<T, N>(lo), b = load_vec<T, N>(hi);
  float c[N], sn[N];  // cos and sin of the N pairs, from the token's row in shared memory
  if constexpr (VEC) {
#pragma unroll
    for (int e = 0; e < N; e += 4) {
      const Vec<float, 4> x = load_vec<float, 4>(cs + i0 + e), y = load_vec<float, 4>(cs + half + i0 + e);
#pragma unroll
      for (int j = 0; j < 4; ++j) { c[e + j] = x.v[j]; sn[e + j] = y.v[j]; }
    }
  } else {
    c[0] = cs[i0];
    sn[0] = cs[half + i0];
  }
#pragma unroll
  for (int e = 0; e < N; ++e) {
    // element e of pair i0 + e: NeoX (a[e], b[e]); GPT-J (a or b)[2e mod N], the next one
    T& x1 = p.neox ? a.v[e] : (2 * e < N ? a.v[2 * e] : b.v[2 * e - N]);
    T& x2 = p.neox ? b.v[e] : (2 * e + 1 < N ? a.v[2 * e + 1] : b.v[2 * e + 1 - N]);
    const float f1 = to_float(x1), f2 = to_float(x2);
    x1 = from_float<T>(f1 * c[e] - f2 * sn[e]);
    x2 = from_float<T>(f2 * c[e] + f1 * sn[e]);
  }
  store_vec<T, N>(lo, a);
  store_vec<T, N>(hi, b);
  out(int(lo - x), a.v);
  out(int(hi - x), b.v);
}

// Rotate every head of q (heads 0 .. num_heads - 1) and of k (the next num_kv_heads) of this CTA's token, the
// token's cos / sin row computed or read once into shared memory for all its heads (by the threads of its first
// rotary_dim / 2 pairs, which alone read the position); k_out(kv head, offset, N elements) gets k's rotated runs.
template <class T, bool VEC, class PosT, class KOut>
__device__ __forceinline__ void rope_token(T* q, T* k, long long token, const PosT* positions,
                                           const float* cos_sin_cache, const double* inv_freq, const RopeParams& p,
                                           KOut k_out) {
  constexpr int N = VEC ? 16 / int(sizeof(T)) : 1;
  __shared__ __align__(16) float cs[ROPE_MAX_DIM];  // the cosines, then the sines
  const int half = p.rotary_dim / 2;
  if (threadIdx.x < half) {
    const long long pos = static_cast<long long>(positions[token]);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      const float2 v = rope_cos_sin(cos_sin_cache, inv_freq, pos, i, p);
      cs[i] = v.x;
      cs[half + i] = v.y;
    }
  }
  __syncthreads();
  const int units = half / N;  // a head's units of N pairs
  for (int n = threadIdx.x; n < p.num_heads * units; n += blockDim.x) {
    const int h = n / units;
    rope_pairs<T, VEC>(q + token * p.q_token_stride + h * p.q_head_stride, (n - h * units) * N, cs, p,
                       [](int, const T (&)[N]) {});
  }
  for (int n = threadIdx.x; n < p.num_kv_heads * units; n += blockDim.x) {
    const int h = n / units;
    rope_pairs<T, VEC>(k + token * p.k_token_stride + h * p.k_head_stride, (n - h * units) * N, cs, p,
                       [&](int d, const T (&x)[N]) { k_out(h, d, x); });
  }
}

template <class T, class PosT, bool VEC>
__global__ void __launch_bounds__(ROPE_THREADS) rope_kernel(
    const PosT* __restrict__ positions,      // [num_tokens]
    T* __restrict__ q,                       // [num_tokens, num_heads, head_size], rotated in place
    T* __restrict__ k,                       // [num_tokens, num_kv_heads, head_size], rotated in place
    const float* __restrict__ cos_sin_cache, // [max_position, rotary_dim], or nullptr: inv_freq
    const double* __restrict__ inv_freq,     // [rotary_dim / 2]
    RopeParams p) {
  constexpr int N = VEC ? 16 / int(sizeof(T)) : 1;
  rope_token<T, VEC>(q, k, blockIdx.x, positions, cos_sin_cache, inv_freq, p, [](int, int, const T (&)[N]) {});
}

template <class T, int KV, class PosT, class SlotT, bool VEC>
__global__ void __launch_bounds__(ROPE_THREADS) rope_and_cache_kernel(
    const PosT* __restrict__ positions,      // [num_tokens]
    T* __restrict__ q,                       // [num_tokens, num_heads, head_size], rotated in place
    T* __restrict__ k,                       // [num_tokens, num_kv_heads, head_size], rotated in place
    const T* __restrict__ v,                 // [num_tokens, num_kv_heads, head_size]
    const float* __restrict__ cos_sin_cache, // [max_position, rotary_dim]
    typename CacheType<KV, T>::type* __restrict__ key_cache,    // NHD or HND, see p's strides
    typename CacheType<KV, T>::type* __restrict__ value_cache,  // same shape and strides as key_cache
    const SlotT* __restrict__ slot_mapping,  // [num_tokens]; < 0 = padding (rotated, not written)
    const float* __restrict__ k_scale,       // [1] or [num_kv_heads], or nullptr: p.k_scale_value
    const float* __restrict__ v_scale,
    RopeParams p) {
  constexpr int N = VEC ? 16 / int(sizeof(T)) : 1;
  const long long token = blockIdx.x, slot = static_cast<long long>(slot_mapping[token]);
  const long long base = slot < 0 ? 0 : slot / p.block_size * p.block_stride + slot % p.block_size * p.page_stride;
  // k's rotated runs go to the cache from the registers that rotated them: k is not read back
  rope_token<T, VEC>(q, k, token, positions, cos_sin_cache, nullptr, p, [&](int h, int d, const T (&x)[N]) {
    if (slot >= 0)
      quantize_store<KV, N, VEC>(key_cache + base + h * p.head_stride + d, x,
                                 KV == KV_AUTO ? 1.0f : read_scale(k_scale, p.k_scale_value, p.scale_per_head, h));
  });
  if (slot < 0) return;
  const int units = p.head_size / N;  // a head's chunks of N elements: v's, and k's past rotary_dim (never rotated)
  for (int n = threadIdx.x; n < p.num_kv_heads * units; n += blockDim.x) {
    const int h = n / units, d = (n - h * units) * N;
    const long long dst = base + h * p.head_stride + d;
    if (d >= p.rotary_dim)
      quantize_chunk<KV, N, VEC>(key_cache + dst, k + token * p.k_token_stride + h * p.k_head_stride + d,
                                 read_scale(k_scale, p.k_scale_value, p.scale_per_head, h));
    quantize_chunk<KV, N, VEC>(value_cache + dst, v + token * p.v_token_stride + h * p.v_head_stride + d,
                               read_scale(v_scale, p.v_scale_value, p.scale_per_head, h));
  }
}

}  // namespace cupaged
