"""numpy references: the oracle of every test (docs/conventions.md §3), one module per kernel family.

Written as a different algorithm from the kernels (whole-array fancy indexing and reshapes instead
of per-thread index arithmetic, float64 where arithmetic happens) and never calling a kernel.
Inputs are numpy arrays; results are new arrays. Quantization follows docs/conventions.md §4
exactly: x / scale in float32, clipped to the format's finite range, rounded to nearest even.

    fp8.py                the fp8 codes (shared)
    cache_ops.py          cache writes and the whole-array fp8 conversion
    cache_gather.py       gathers, block copies and swaps
    attention.py          paged (flash and vLLM layouts), varlen and MLA attention
    merge_attn_states.py  the merge of two partial attention states
    rope.py               rotary embeddings and the fused RoPE + cache write
"""

from __future__ import annotations

from cupaged.reference.attention import (attention_rows, cascade_attention, dense_kv, mla_decode, paged_attention,
                                         paged_attention_v1, paged_attention_v2_partitions, varlen_attention)
from cupaged.reference.cache_gather import copy_blocks, cp_gather_cache, gather_and_maybe_dequant_cache, swap_blocks
from cupaged.reference.cache_ops import concat_and_cache_mla, convert_fp8, reshape_and_cache, reshape_and_cache_flash
from cupaged.reference.fp8 import FP8, dequantize_fp8, quantize_fp8
from cupaged.reference.merge_attn_states import merge_attn_states
from cupaged.reference import rope

__all__ = ["FP8", "quantize_fp8", "dequantize_fp8", "reshape_and_cache_flash", "reshape_and_cache",
           "concat_and_cache_mla", "convert_fp8", "gather_and_maybe_dequant_cache", "cp_gather_cache", "copy_blocks",
           "swap_blocks", "dense_kv", "attention_rows", "paged_attention", "cascade_attention", "paged_attention_v1",
           "paged_attention_v2_partitions", "merge_attn_states", "varlen_attention", "mla_decode", "rope"]
