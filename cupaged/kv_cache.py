"""The paged KV cache itself: per-layer key and value block arrays in a docs/conventions.md §4 layout.

Sized in blocks so one :class:`cupaged.pool.BlockPool` of the same ``num_blocks`` and
``block_size`` names slots in every layer; ``num_blocks_for`` turns a memory budget into that
count. Keys and values of a layer are separate allocations: on the sim each gets its own guard
pages, so a kernel running past one cache faults instead of silently reading the other.
"""

from __future__ import annotations

import numpy as np

from cupaged._backend import on_sim, resolve_array_module
from cupaged._cache_args import cache_dtype
from cupaged._checks import check_choice, check_int, float_dtype
from cupaged.sim._memory import physical_memory

__all__ = ["KVCache", "KVCacheTooLarge"]

LAYOUTS = ("NHD", "HND", "vllm", "mla")


class KVCacheTooLarge(MemoryError, ValueError):
    """The caches a KVCache asks for do not fit: a MemoryError (the memory is not there) that is also a
    ValueError (num_blocks is the argument to lower)."""


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} PiB"


def _positive(name: str, value) -> int:
    return check_int(name, value, 1)


def _cache_dtype(dtype, kv_cache_dtype) -> np.dtype:
    return cache_dtype(kv_cache_dtype, float_dtype("dtype", dtype))


class KVCache:
    """``num_layers`` pairs of key/value caches of ``num_blocks`` blocks of ``block_size`` tokens.

    ``layout``: "NHD" ``[num_blocks, block_size, num_kv_heads, head_size]`` (flash kernels),
    "HND" ``[num_blocks, num_kv_heads, block_size, head_size]``, "vllm" (paged-attention
    v1/v2): K ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``, V ``[num_blocks,
    num_kv_heads, head_size, block_size]`` with x = 16 // itemsize, so a thread's 16-byte load
    holds x consecutive elements of one key; or "mla": one latent cache per layer, ``key(layer)``
    ``[num_blocks, block_size, head_size]`` with ``head_size = kv_lora_rank + rope_dim`` and
    ``num_kv_heads = 1`` (``concat_and_cache_mla`` writes it, ``mla_decode`` reads it); there is no
    value cache (``value(layer)`` raises, ``value_caches`` is None). ``kv_cache_dtype`` "auto" stores ``dtype``; the fp8
    kinds store uint8. ``xp``: None (cupy when a GPU is usable, else the sim), numpy or
    ``cupaged.sim`` (guarded numpy), or cupy. New caches hold 0xFF bytes (NaN), so a kernel that
    reads a slot nobody wrote produces NaN rather than a plausible number. Caches that do not fit raise
    :class:`KVCacheTooLarge` naming ``num_blocks`` and the bytes needed, before anything is allocated where
    that is known (the sim's caches live in host memory) or once the allocation fails.
    """

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, *,
                 layout="NHD", kv_cache_dtype="auto", xp=None):
        self.num_layers = _positive("num_layers", num_layers)
        self.num_blocks = _positive("num_blocks", num_blocks)
        self.block_size = _positive("block_size", block_size)
        self.num_kv_heads = _positive("num_kv_heads", num_kv_heads)
        self.head_size = _positive("head_size", head_size)
        self.cache_dtype = _cache_dtype(dtype, kv_cache_dtype)
        self.dtype, self.kv_cache_dtype = np.dtype(dtype), kv_cache_dtype
        check_choice("layout", layout, LAYOUTS)
        self.layout = layout
        if layout == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"layout='mla' holds one latent head: num_kv_heads must be 1, got {num_kv_heads}")
        self.key_shape, self.value_shape = self._shapes()
        self.xp = resolve_array_module(xp)
        # The sim maps its caches lazily but poisons every byte at once: past the host's memory that would
        # thrash, or get the process killed, rather than fail
        if on_sim(self.xp) and self.nbytes > physical_memory():
            raise KVCacheTooLarge(f"{self._needs()}, more than the host's {_size(physical_memory())} of memory the "
                                  "sim's caches live in; lower num_blocks (KVCache.num_blocks_for)")
        try:
            self.key_caches = [self._allocate(self.key_shape) for _ in range(self.num_layers)]
            self.value_caches = None if layout == "mla" else [self._allocate(self.value_shape)
                                                              for _ in range(self.num_layers)]
        except (MemoryError, OSError) as e:  # cupy's OutOfMemoryError; the sim's mmap
            raise KVCacheTooLarge(f"{self._needs()}; allocating them failed ({type(e).__name__}: {e}); lower "
                                  "num_blocks (KVCache.num_blocks_for)") from e

    def _needs(self) -> str:
        caches = self.num_layers * (1 if self.layout == "mla" else 2)
        return (f"KVCache: num_blocks={self.num_blocks} needs {_size(self.nbytes)} ({self.num_layers} layers x "
                f"{caches // self.num_layers} caches x {_size(self.nbytes / caches)})")

    def _shapes(self):
        n, bs, h, d = self.num_blocks, self.block_size, self.num_kv_heads, self.head_size
        if self.layout == "mla":
            return (n, bs, d), None
        if self.layout == "NHD":
            return (n, bs, h, d), (n, bs, h, d)
        if self.layout == "HND":
            return (n, h, bs, d), (n, h, bs, d)
        x = 16 // self.cache_dtype.itemsize
        if d % x:
            raise ValueError(f"head_size={d} must be a multiple of x={x} (16 bytes of "
                             f"{self.cache_dtype}) for layout='vllm'")
        return (n, h, d // x, bs, x), (n, h, d, bs)

    def _allocate(self, shape):
        a = self.xp.empty(shape, self.cache_dtype)
        if not on_sim(self.xp):
            a.view(self.xp.uint8).fill(0xFF)  # the sim's guarded memory starts this way
        return a

    def key(self, layer: int):
        return self.key_caches[self._layer(layer)]

    def value(self, layer: int):
        if self.value_caches is None:
            raise ValueError("layout='mla' has no value cache: the value is the first kv_lora_rank entries of each "
                             "latent row of key(layer)")
        return self.value_caches[self._layer(layer)]

    def _layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be in 0..{self.num_layers - 1}, got {layer}")
        return int(layer)

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_blocks * self.bytes_per_block(
            self.block_size, self.num_kv_heads, self.head_size, self.dtype, kv_cache_dtype=self.kv_cache_dtype,
            layout=self.layout)

    @staticmethod
    def bytes_per_block(block_size, num_kv_heads, head_size, dtype, *, kv_cache_dtype="auto", layout="NHD") -> int:
        """Bytes of one block of one layer, keys and values (the same in every layout but "mla", which
        holds one latent row per token and no values)."""
        itemsize = _cache_dtype(dtype, kv_cache_dtype).itemsize
        check_choice("layout", layout, LAYOUTS)
        return (1 if layout == "mla" else 2) * _positive("block_size", block_size) * \
            _positive("num_kv_heads", num_kv_heads) * _positive("head_size", head_size) * itemsize

    @classmethod
    def num_blocks_for(cls, nbytes, num_layers, block_size, num_kv_heads, head_size, dtype, *,
                       kv_cache_dtype="auto", layout="NHD") -> int:
        """The most blocks whose caches fit in ``nbytes`` (e.g. free GPU memory less the
        activations' headroom): size the BlockPool and the KVCache with it."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        per_block = _positive("num_layers", num_layers) * cls.bytes_per_block(
            block_size, num_kv_heads, head_size, dtype, kv_cache_dtype=kv_cache_dtype, layout=layout)
        return int(nbytes) // per_block

    def __repr__(self):
        return (f"KVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"dtype={self.dtype}, layout={self.layout!r}, kv_cache_dtype={self.kv_cache_dtype!r}, "
                f"backend={'sim' if on_sim(self.xp) else 'cuda'}, {self.nbytes / 2**20:.1f} MiB)")

