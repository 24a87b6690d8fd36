// paged_attention.cu: attention of varlen queries over a paged KV cache, split-KV with an LSE merge.
//
// Maths, per query row (token t of sequence s at position p = seq_len - q_len + i, head h):
//   s_j = softcap(scale * q . k_j) - slope_h * |j - p|      for visible keys j
//   out = sum_j e^{s_j - M} v_j / (sum_j e^{s_j - M} + e^{sink_h - M}),  LSE = M + log(denominator)
// visible: j < seq_len and p - window_left <= j <= p + window_right (-1: unbounded; causal: window_right 0), and with
// a custom (tree) mask its bit (query i, key j) set: FlashInfer's packed masks (logits.cuh pa_row_sees). fp32
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
// row tiles (rows past the max_query_len hint). Head tiles of one split are adjacent in the grid, so the CTAs
// reading the same cache bytes run together and share them in L2. K/V tiles stay in their storage dtype in shared
// memory (kv_pipeline), only the union of the rows' visible keys is loaded, and masking is selection, never a zero
// weight times a loaded value. A sequence whose context fits one split finishes out/LSE itself; otherwise each
// split writes float32 partials (max, exp-sum relative to it, normalized output) for the merge. The plan routes
// each sequence by its q_len: runs of up to PD_MAX_Q (decode, speculative decoding) take a decode kernel, longer
// ones the prefill kernel; float32 q, vLLM's layout and MLA take their decode kernel for every run.
//   attention/decode.cuh       paged_decode_kernel<T, KV, HD, VT>: 4 query rows a CTA on CUDA cores, every dtype
//   attention/decode_mma.cuh   paged_decode_mma_kernel<T, KV, HD, VT, TREE>: 8 rows on tensor cores (16-bit q, d <= 128;
//                              TREE: launches with a custom mask)
//   attention/prefill.cuh      paged_prefill_kernel<T, KV, HD, VHD>: FlashAttention-2 on tensor cores
//   attention/mla_decode.cuh   mla_decode_kernel<T, KV, MT>: MLA over the latent cache on tensor cores
//   attention/merge.cuh        paged_attention_reduce_kernel<T>: the split merge, the sink added once
// and what they share: attention/params.cuh (PaParams, the occupancy budgets, a sequence's keys and splits, the
// partials' format), attention/kv_pipeline.cuh (the cp.async stage pipeline and the stage layout it reads),
// attention/logits.cuh (the keys a row sees, the logit step and the online-softmax rescale, written once).
//
// Versions (the code in attention/ is the last):
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
//   v7: hot loops that issue less (H200 model v2, bench_paged_attention.py --model; issue_report.py): a tile's keys'
//       row offsets placed once in shared memory (KvRows), so a 16-byte copy is a shared load, a 64-bit add, a
//       compare and the cp.async with its ignore-src predicate (8 SASS instructions with ptxas's 3 pads; the
//       pipeline's dynamic count 163 -> 20-30 a copy); a base-2 online softmax (log2 e in the score scale, one FFMA
//       and one MUFU.EX2 a weight; softcap, ALiBi and masks only where on); o rescaled only when a warp's maxima
//       moved; every 16-bit decode with head size <= 128 on tensor cores. Decode 64 x 4096, 32/8 fp16: 822.5 ->
//       254.0 us (issue 820.5 -> 88.9 us); fp8 701.3 -> 133.3 us; 1 x 32768 116.2 -> 38.8 us; prefill 8 x 2048
//       1692.6 -> 605.2 us; varlen 192/128 30573 -> 12976 us; MLA 16 heads 122.2 -> 99.2 us, 128 heads 521.1 ->
//       288.1 us.
//   v8: the merge a warp per (token, head, 128 columns), no barrier or shared memory, 8 splits' loads in flight a
//       lane; splits: the fewest that fill 90% of a wave (each split more is one more partial row to write and
//       merge). H200 model v2: MLA 64 x 4096, 16 heads 99.2 -> 80.7 us (4 splits, not 12; merge 17.5 -> 5.2 us);
//       mixed batch 684.5 -> 654.4 us; 1 x 32768 38.8 -> 40.5 us (one wave of 45 splits, not two of 99).
//   v9: custom (tree) masks in every kernel, tested on the masked tiles only; cascade's schedules (cupaged/cascade.py):
//       partials_only levels writing every split slot (pa_mark_empty), the merge folding in a prior state
//       (prior_lse), and the decode kernels folding a level's partials into their rows' finish (prior_splits,
//       pd_prior). H200 model, 64 requests x (4096 shared + 256 own), 32/8, d128, fp16: 47.8 us in 5 launches
//       (merge_attn_states after two paged_attention calls) -> 33.0 us in 2; the merge's 1/L is MUFU.RCP and a
//       Newton step (no slow-path call) and its __launch_bounds__ give ptxas a budget: no spills.
//
// Uses:      common.cuh, softmax.cuh, tensor_core.cuh (ldmatrix / mma.sync as inline PTX), attention/*.cuh
// Used by:   cupaged/attention.py (the family; plan_attention / run_attention launch the kernels, reading
//            PA_* and PaParams from these files through cupaged/_mirror.py), paged_attention.py,
//            paged_attention_vllm.py (v1/v2), varlen_attention.py, mla.py (mla_decode, mla_chunked_prefill),
//            _attention_args.py (the cache strides), selftest.py; oracle: cupaged/reference/attention.py
// Test:      pytest tests/test_paged_attention.py tests/test_paged_attention_vllm.py tests/test_varlen_attention.py
//            tests/test_mla.py tests/test_decode_accuracy.py tests/test_attention_hints.py
//            tests/test_attention_plan.py tests/test_mirror.py; also test_decode_traffic.py,
//            test_prefill_traffic.py, test_compile_gate.py, test_source_layout.py (the files' line caps)
// Benchmark: python profiling/bench_paged_attention.py; python profiling/bench_mla.py (MLA decode)
#include "attention/decode.cuh"
#include "attention/decode_mma.cuh"
#include "attention/prefill.cuh"
#include "attention/mla_decode.cuh"
#include "attention/merge.cuh"
