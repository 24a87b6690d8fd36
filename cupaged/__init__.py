"""cupaged: hand-written CUDA kernels for attention over a paged KV cache.

Kernels are CUDA source in ``kernels_cu/``, compiled at run time by CuPy (NVRTC) for cupy arrays,
or by g++ through the CPU simulator :mod:`cupaged.sim` for numpy arrays. The backend follows the
data arrays. See README.md for the API tour.
"""

from cupaged.attention import AttentionPlan, KvView, plan_attention, run_attention, workspace_bytes
from cupaged.cascade import CascadeLevel, cascade_attention
from cupaged.cache_gather import copy_blocks, cp_gather_cache, gather_and_maybe_dequant_cache, swap_blocks
from cupaged.cache_ops import concat_and_cache_mla, reshape_and_cache, reshape_and_cache_flash
from cupaged.convert_fp8 import convert_fp8
from cupaged.kv_cache import KVCache, KVCacheTooLarge
from cupaged.merge_attn_states import merge_attn_states
from cupaged.mla import mla_chunked_prefill, mla_decode
from cupaged.paged_attention import paged_attention
from cupaged._custom_mask import pack_custom_mask
from cupaged._tensor_map import make_tensor_map
from cupaged.paged_attention_vllm import paged_attention_v1, paged_attention_v2
from cupaged.pool import BatchPlan, BlockPool, OutOfBlocks, PoolUsage
from cupaged.rope import RotaryEmbedding, rope_and_cache
from cupaged.varlen_attention import varlen_attention
from cupaged import layers

__version__ = "0.1.0"

for _public in (AttentionPlan, KvView, KVCache, KVCacheTooLarge, BatchPlan, BlockPool, OutOfBlocks, PoolUsage,
                RotaryEmbedding):
    _public.__module__ = __name__  # tracebacks and reprs name cupaged.X, where users import it from
del _public

__all__ = [
    "reshape_and_cache_flash", "reshape_and_cache", "concat_and_cache_mla", "gather_and_maybe_dequant_cache",
    "convert_fp8", "cp_gather_cache", "copy_blocks", "swap_blocks", "paged_attention", "paged_attention_v1",
    "paged_attention_v2", "pack_custom_mask", "make_tensor_map", "cascade_attention", "CascadeLevel",
    "varlen_attention", "mla_decode", "AttentionPlan", "KvView", "plan_attention", "run_attention", "workspace_bytes",
    "merge_attn_states", "mla_chunked_prefill", "BlockPool", "BatchPlan", "OutOfBlocks", "PoolUsage", "KVCache",
    "KVCacheTooLarge", "RotaryEmbedding", "rope_and_cache", "layers", "__version__",
]
