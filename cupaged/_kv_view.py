"""``KvView``: a K/V source of the attention engine (cupaged/attention.py): the arrays, heads, sizes,
address strides (the PaParams fields k_block_stride ... v_dim_stride, in elements; see
kernels_cu/paged_attention.cu's header) and whether 16-byte loads are allowed."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from cupaged._attention_args import MAX_HEAD_SIZE, _aligned, check_caches
from cupaged._cache_args import cache_dtype
from cupaged._checks import FLOAT_DTYPES, address, check_dtype, check_int, check_last_contiguous, check_ndim, \
    element_strides
from cupaged._interop import accepts_foreign_arrays, passes_as_is

__all__ = ["KvView", "kv_key"]


# What check_caches found for a paged cache's layout, by everything it looks at (shapes, strides,
# dtypes, 16-byte alignment, q's head size and dtype, cache dtype, layout): the layers of a model
# share a few layouts, and the checks cost ~15 µs a call. Never mutated once stored.
_PAGED: dict = {}


def kv_key(kind: str, kv_cache_dtype: str, block_size: int) -> str:
    """``KvView.key_id`` and ``AttentionPlan.kv``: what a plan depends on of its K/V."""
    return f"{kind}:{kv_cache_dtype}:{block_size}"


@passes_as_is
@dataclasses.dataclass(frozen=True, eq=False)
class KvView:
    """A K/V source for the attention kernel: its arrays, heads, sizes and address strides
    (elements; see paged_attention.cu's header), and whether 16-byte loads are allowed."""

    kind: str                  # "paged", "dense" (varlen rows) or "mla" (latent rows: value = a prefix)
    key: object
    value: object
    kv_cache_dtype: str
    num_kv_heads: int
    head_size: int
    v_head_size: int
    block_size: int            # 1 for dense rows
    strides: dict              # k_block_stride ... v_dim_stride, the PaParams fields
    vec_k: bool
    vec_v: bool

    @functools.cached_property
    def decode_layout(self) -> str:
        """How the decode kernels read these K/V: "rows" (K and V rows: flash NHD / HND caches, dense rows, MLA's
        latent rows) or "vllm" (vLLM's values [.., head_size, block_size], copied as V^T tiles). Rows 16-byte aligned
        (vec_k / vec_v) are copied by cp.async, others element by element."""
        return "rows" if self.strides["v_dim_stride"] == 1 else "vllm"

    @functools.cached_property
    def prefill_rows(self) -> bool:
        """The tensor-core prefill kernel reads these K/V: K and V rows (flash NHD / HND caches, dense varlen rows)."""
        return self.kind != "mla" and self.strides["v_dim_stride"] == 1

    @functools.cached_property
    def key_id(self) -> str:
        """What a plan made for this K/V depends on: its kind, cache dtype and block size."""
        return kv_key(self.kind, self.kv_cache_dtype, self.block_size)

    @classmethod
    @accepts_foreign_arrays
    def paged(cls, key_cache, value_cache, q, kv_cache_dtype="auto", layout="NHD"):
        """A paged cache in the flash NHD / HND or the vLLM layout (shapes and dtypes checked against q)."""
        try:
            key = (key_cache.shape, key_cache.strides, key_cache.dtype, address(key_cache) % 16 == 0,
                   value_cache.shape, value_cache.strides, value_cache.dtype, address(value_cache) % 16 == 0,
                   q.shape[2], q.dtype, kv_cache_dtype, layout)
            geometry = _PAGED.get(key)
        except (AttributeError, TypeError, IndexError):  # not arrays, or an unhashable choice: the checks name it
            key = geometry = None
        if geometry is None:
            c = check_caches(key_cache, value_cache, q, kv_cache_dtype, layout,
                             layouts=("vllm",) if layout == "vllm" else ("NHD", "HND"))
            strides = {k: v for k, v in c.items() if k.startswith(("k_", "v_"))}
            geometry = c["kv_heads"], c["block_size"], strides, bool(c["vec_k"]), bool(c["vec_v"])
            if key is not None:
                if len(_PAGED) >= 4096:
                    _PAGED.clear()
                _PAGED[key] = geometry
        heads, block_size, strides, vec_k, vec_v = geometry
        return cls("paged", key_cache, value_cache, kv_cache_dtype, heads, q.shape[2], q.shape[2], block_size, strides,
                   vec_k, vec_v)

    @classmethod
    @accepts_foreign_arrays
    def dense(cls, k, v):
        """Varlen token rows: k ``[total_k, num_kv_heads, head_size]``, v ``[..., v_head_size]``."""
        check_ndim("k", k, 3, "[total_k, num_kv_heads, head_size]")
        check_ndim("v", v, 3, "[total_k, num_kv_heads, v_head_size]")
        check_dtype("k", k, FLOAT_DTYPES)
        if v.dtype != k.dtype:
            raise TypeError(f"v must have k's dtype {k.dtype}, got {v.dtype}")
        if v.shape[:2] != k.shape[:2]:
            raise ValueError(f"v must be [{k.shape[0]}, {k.shape[1]}, v_head_size] like k, got {tuple(v.shape)}")
        if 0 in k.shape[1:] or v.shape[2] == 0:
            raise ValueError(f"k and v must have num_kv_heads >= 1 and head sizes >= 1, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        for arg, name, size in (("k", "head_size", k.shape[2]), ("v", "v_head_size", v.shape[2])):
            if size > MAX_HEAD_SIZE:
                raise NotImplementedError(f"{name}={size} ({arg}'s last dimension): at most {MAX_HEAD_SIZE} is "
                                          f"supported")
        check_last_contiguous("k", k)
        check_last_contiguous("v", v)
        ks, vs = element_strides("k", k), element_strides("v", v)
        x = 16 // k.itemsize
        vec_k, vec_v = _aligned(k, ks[:2], x), _aligned(v, vs[:2], x)
        strides = dict(k_block_stride=0, k_head_stride=ks[1], k_chunk_stride=x, k_page_stride=ks[0],
                       v_block_stride=0, v_head_stride=vs[1], v_page_stride=vs[0], v_dim_stride=1)
        return cls("dense", k, v, "auto", k.shape[1], k.shape[2], v.shape[2], 1, strides, vec_k, vec_v)

    @classmethod
    @accepts_foreign_arrays
    def mla(cls, kv_cache, kv_lora_rank, kv_cache_dtype="auto"):
        """A latent cache ``[num_blocks, block_size, kv_lora_rank + rope_dim]``: the key is the whole row,
        the value its first ``kv_lora_rank`` entries (one head shared by every query head)."""
        check_ndim("kv_cache", kv_cache, 3, "[num_blocks, block_size, kv_lora_rank + rope_dim]")
        fp8 = cache_dtype(kv_cache_dtype, np.float16) == np.uint8  # and kv_cache_dtype one of the choices
        check_dtype("kv_cache", kv_cache, (np.uint8,) if fp8 else FLOAT_DTYPES)
        if kv_cache.shape[1] == 0:
            raise ValueError(f"kv_cache must have block_size >= 1, got shape {tuple(kv_cache.shape)}")
        kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank, 1, kv_cache.shape[2])
        check_last_contiguous("kv_cache", kv_cache)
        s = element_strides("kv_cache", kv_cache)
        x = 16 // kv_cache.itemsize
        vec = _aligned(kv_cache, s[:2], x)
        strides = dict(k_block_stride=s[0], k_head_stride=0, k_chunk_stride=x, k_page_stride=s[1],
                       v_block_stride=s[0], v_head_stride=0, v_page_stride=s[1], v_dim_stride=1)
        return cls("mla", kv_cache, kv_cache, kv_cache_dtype, 1, kv_cache.shape[2], kv_lora_rank, kv_cache.shape[1],
                   strides, vec, False)
