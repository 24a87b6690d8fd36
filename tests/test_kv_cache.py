"""KVCache shapes and sizing; the pool, the cache and the cache ops together (copy-on-write end to
end); BatchPlan.to_device's pinned double-buffered upload (a stand-in cupy checks the event
guard without a GPU; the real one runs when a GPU is present)."""

from __future__ import annotations

import ctypes
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference, sim
from cupaged import BlockPool, KVCache
from cupaged.sim._memory import guarded_buffer
from tests.conftest import assert_close, gpu_available

FIELDS = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "positions")


# -- shapes, dtypes, sizing -------------------------------------------------------------------

@pytest.mark.parametrize("layout,key_shape,value_shape", [
    ("NHD", (10, 16, 4, 64), (10, 16, 4, 64)),
    ("HND", (10, 4, 16, 64), (10, 4, 16, 64)),
    ("vllm", (10, 4, 8, 16, 8), (10, 4, 64, 16)),  # x = 16 bytes / 2
])
def test_layouts(layout, key_shape, value_shape):
    cache = KVCache(3, 10, 16, 4, 64, np.float16, layout=layout, xp=sim)
    for layer in range(3):
        k, v = cache.key(layer), cache.value(layer)
        assert k.shape == key_shape and v.shape == value_shape and k.dtype == v.dtype == np.float16
        assert guarded_buffer(k) is not None and guarded_buffer(v) is not None
        assert guarded_buffer(k) is not guarded_buffer(v)  # separate guard pages
        assert np.isnan(k).all() and np.isnan(v).all()  # unwritten slots read as NaN
    assert cache.nbytes == 3 * 2 * 10 * 16 * 4 * 64 * 2
    assert cache.key_caches[1] is cache.key(1) and len(cache.value_caches) == 3


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_caches_are_uint8(kv_cache_dtype):
    cache = KVCache(1, 4, 16, 2, 64, ml_dtypes.bfloat16, layout="vllm", kv_cache_dtype=kv_cache_dtype, xp=np)
    assert cache.key(0).dtype == np.uint8 and cache.key(0).shape == (4, 2, 4, 16, 16)
    assert cache.nbytes == 2 * 4 * 16 * 2 * 64 and (cache.key(0) == 0xFF).all()


def test_num_blocks_for_a_memory_budget():
    per_block = 32 * 2 * 16 * 8 * 128 * 2  # layers x (K, V) x block_size x heads x head_size x fp16
    assert KVCache.num_blocks_for(1000 * per_block + per_block - 1, 32, 16, 8, 128, np.float16) == 1000
    assert KVCache.num_blocks_for(1000 * per_block, 32, 16, 8, 128, np.float16, kv_cache_dtype="fp8") == 2000
    assert KVCache.num_blocks_for(0, 1, 16, 8, 128, np.float32) == 0
    cache = KVCache(2, KVCache.num_blocks_for(1 << 20, 2, 16, 2, 64, np.float32), 16, 2, 64, np.float32, xp=sim)
    assert cache.nbytes <= 1 << 20 < cache.nbytes + KVCache.bytes_per_block(16, 2, 64, np.float32) * 2


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(head_size=120, kv_cache_dtype="fp8", layout="vllm"), ValueError, "head_size=120 must be a multiple of x=16"),
    (dict(head_size=60, layout="vllm"), ValueError, "multiple of x=8"),
    (dict(layout="NCHW"), ValueError, "layout must be one of"),
    (dict(kv_cache_dtype="int8"), ValueError, "kv_cache_dtype must be one of"),
    (dict(dtype=np.int32), TypeError, "dtype must be float32, float16 or bfloat16"),
    (dict(num_blocks=0), ValueError, "num_blocks must be >= 1"),
    (dict(block_size=2.0), TypeError, "block_size must be an int"),
    (dict(xp=object()), TypeError, "xp must be None, numpy, cupaged.sim or cupy"),
])
def test_bad_arguments(kwargs, exc, message):
    args = dict(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_size=64, dtype=np.float16, xp=sim)
    args.update(kwargs)
    with pytest.raises(exc, match=message):
        KVCache(args.pop("num_layers"), args.pop("num_blocks"), args.pop("block_size"), args.pop("num_kv_heads"),
                args.pop("head_size"), args.pop("dtype"), **args)


def test_a_cache_larger_than_memory_names_num_blocks_and_what_it_needs():
    """The sim fills every byte of its caches (poison), so a cache past the host's memory is refused before
    anything is allocated (before: a bare OSError from mmap, or the process killed while filling)."""
    with pytest.raises(MemoryError, match=r"^KVCache: num_blocks=1099511627776 needs 64.0 PiB \(2 layers x 2 caches "
                                          r"x 16.0 PiB\), more than the host's .* of memory the sim's caches live in; "
                                          r"lower num_blocks \(KVCache.num_blocks_for\)") as e:
        KVCache(2, 2**40, 16, 8, 64, np.float16, xp=sim)
    assert isinstance(e.value, ValueError)  # num_blocks is the argument to change


def test_a_failed_allocation_names_num_blocks(monkeypatch):
    """An allocation that fails anyway (mmap refused, cupy out of GPU memory) says which cache and how much."""
    def refuse(shape, dtype):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(sim, "empty", refuse)
    with pytest.raises(MemoryError, match=r"^KVCache: num_blocks=4 needs 128.0 KiB \(2 layers x 2 caches x 32.0 KiB\); "
                                          r"allocating them failed \(OSError: \[Errno 12\] Cannot allocate memory\); "
                                          r"lower num_blocks \(KVCache.num_blocks_for\)"):
        KVCache(2, 4, 16, 2, 64, np.float32, xp=sim)


def test_layer_index_and_sizing_errors():
    cache = KVCache(2, 4, 16, 2, 64, np.float32, xp=sim)
    with pytest.raises(IndexError, match=r"layer must be in 0..1, got 2"):
        cache.key(2)
    with pytest.raises(TypeError, match="layer must be an int"):
        cache.value("0")
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        KVCache.num_blocks_for(-1, 2, 16, 2, 64, np.float32)


def test_default_backend_without_a_gpu_is_the_sim():
    if gpu_available():
        assert KVCache(1, 2, 16, 2, 64, np.float16).xp.__name__ == "cupy"
    else:
        cache = KVCache(1, 2, 16, 2, 64, np.float16)
        assert cache.xp is sim and guarded_buffer(cache.key(0)) is not None


# -- copy-on-write, end to end ----------------------------------------------------------------

def read_sequence(backend, cache, layer, table, length, layout):
    """[length, heads, head_size] keys and values of one sequence, gathered through its block
    table in numpy (the kernels are not the oracle of their own inputs)."""
    k, v = backend.to_numpy(cache.key(layer)), backend.to_numpy(cache.value(layer))
    bs = cache.block_size
    rows = [(table[p // bs], p % bs) for p in range(length)]
    if layout == "NHD":
        return np.stack([k[b, o] for b, o in rows]), np.stack([v[b, o] for b, o in rows])
    return np.stack([k[b, :, o] for b, o in rows]), np.stack([v[b, :, o] for b, o in rows])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_copy_on_write_end_to_end(backend, layout):
    """Parallel sampling: a prompt, three samples forked from it, steps of decode and of multi-token
    appends on each (one sample dropped, one forked again); every step runs the pool's pending
    copies through copy_blocks before writing its tokens with reshape_and_cache_flash, and every
    sequence must read back exactly its own tokens."""
    rng = np.random.default_rng(11)
    num_layers, block_size, heads, head_size, dtype = 2, 4, 2, 32, np.float16
    cache = KVCache(num_layers, 24, block_size, heads, head_size, dtype, layout=layout, xp=backend.xp)
    pool = BlockPool(24, block_size)
    truth: dict[str, list[np.ndarray]] = {}  # per sequence: [layer][K or V] tokens

    def step(plan, seqs):
        copies = pool.take_pending_copies()
        cupaged.copy_blocks(cache.key_caches, cache.value_caches, copies)
        device = plan.to_device(backend.xp)
        q_lens = np.diff(plan.query_start_loc)
        for layer in range(num_layers):
            new = rng.standard_normal((2, plan.num_tokens, heads, head_size)).astype(dtype)
            cupaged.reshape_and_cache_flash(backend.asarray(new[0]), backend.asarray(new[1]), cache.key(layer),
                                            cache.value(layer), device.slot_mapping, layout=layout)
            for seq, lo, n in zip(seqs, plan.query_start_loc, q_lens):
                truth.setdefault(seq, [[[], []] for _ in range(num_layers)])
                truth[seq][layer][0].extend(new[0, lo:lo + n])
                truth[seq][layer][1].extend(new[1, lo:lo + n])
        return len(copies)

    def fork(parent, child):
        pool.fork(parent, child)
        truth[child] = [[list(k), list(v)] for k, v in truth[parent]]

    step(pool.plan([("prompt", 6)]), ["prompt"])
    for child in ("s1", "s2", "s3"):
        fork("prompt", child)
    pool.free("prompt")
    del truth["prompt"]
    copies = step(pool.plan_decode(["s1", "s2", "s3"]), ["s1", "s2", "s3"])
    assert copies == 2  # the last of three sharers of the partial block writes in place
    for _ in range(3):
        step(pool.plan_decode(["s1", "s2", "s3"]), ["s1", "s2", "s3"])
    pool.free("s1")
    del truth["s1"]
    fork("s2", "s4")
    assert step(pool.plan([("s4", 3), ("s2", 2), ("s3", 1)]), ["s4", "s2", "s3"]) == 1
    pool.check()
    for seq, layers in truth.items():
        for layer, (keys, values) in enumerate(layers):
            k, v = read_sequence(backend, cache, layer, pool.block_table(seq), pool.seq_len(seq), layout)
            assert np.array_equal(k.view(np.uint16), np.stack(keys).view(np.uint16)), f"{seq} keys, layer {layer}"
            assert np.array_equal(v.view(np.uint16), np.stack(values).view(np.uint16)), f"{seq} values, layer {layer}"


# -- to_device ----------------------------------------------------------------------------------

class FakeCupy(types.ModuleType):
    """Just enough cupy for PinnedStaging, with asynchronous copies made observable: a host to
    device copy reads the pinned buffer only when the event recorded after it is synchronized
    (or the test lets the 'GPU' catch up), so a buffer refilled too early corrupts the result."""

    def __init__(self):
        super().__init__("cupy")
        fake = self
        self.pending, self.copies, self.pinned_allocations = [], 0, 0

        class Device(np.ndarray):
            @property
            def data(self):
                return types.SimpleNamespace(copy_from_host_async=lambda ptr, n, stream: fake.copy(self, ptr, n))

        class Event:
            def __init__(self, disable_timing=False):
                self.work = []

            def record(self, stream):
                self.work, fake.pending = fake.pending, []

            def synchronize(self):
                for run in self.work:
                    run()
                self.work = []

        def alloc_pinned_memory(n):
            fake.pinned_allocations += 1
            return bytearray(n)

        self.uint8 = np.uint8
        self.empty = lambda n, dtype: np.zeros(n, dtype).view(Device)
        self.cuda = types.SimpleNamespace(alloc_pinned_memory=alloc_pinned_memory, Event=Event,
                                          get_current_stream=lambda: "stream")

    def copy(self, dst, ptr, n):
        self.copies += 1
        self.pending.append(lambda: ctypes.memmove(dst.ctypes.data, ptr, n))


def test_to_device_waits_for_the_copy_still_reading_a_staging_buffer(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    pool = BlockPool(64, 4)
    plans = [pool.plan([("a", 3), ("b", 5)])] + [pool.plan_decode(["a", "b"]) for _ in range(4)]
    plans.append(pool.plan([("c", 40), ("a", 2)]))  # a bigger plan: the staging buffer grows
    uploaded = []
    for plan in plans:
        uploaded.append(plan.to_device(fake))
        assert fake.copies == len(uploaded)  # one host-to-device copy per plan
    assert fake.pinned_allocations <= 4  # two buffers, reused; each grown at most once here
    assert not fake.pending  # every copy is followed by its event
    for event in plans[0]._staging._events:  # let the 'GPU' finish what is still in flight
        event.synchronize()
    for plan, dev in zip(plans, uploaded):
        for field in FIELDS:
            got, want = np.asarray(getattr(dev, field)), getattr(plan, field)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(got, want), field


@pytest.mark.skipif(not gpu_available(), reason="no GPU")
def test_to_device_on_the_gpu():
    import cupy

    pool = BlockPool(64, 4)
    plans = [pool.plan([("a", 3), ("b", 5)])] + [pool.plan_decode(["a", "b"]) for _ in range(5)]
    uploaded = [p.to_device() for p in plans]
    cupy.cuda.get_current_stream().synchronize()
    for plan, dev in zip(plans, uploaded):
        for field in FIELDS:
            got = getattr(dev, field)
            assert isinstance(got, cupy.ndarray) and np.array_equal(got.get(), getattr(plan, field))


def test_mla_layout_end_to_end(backend):
    """layout="mla": one latent cache per layer that concat_and_cache_mla writes and mla_decode reads;
    no value cache; half the bytes of a key/value pair of the same width."""
    xp = sim if backend.name == "sim" else backend.xp
    kv = KVCache(2, 8, 16, 1, 576, np.float16, layout="mla", xp=xp)
    assert kv.key(1).shape == (8, 16, 576) and kv.value_caches is None
    assert kv.nbytes == 2 * 8 * 16 * 576 * 2 == KVCache.bytes_per_block(16, 1, 576, np.float16, layout="mla") * 16
    assert KVCache.num_blocks_for(kv.nbytes, 2, 16, 1, 576, np.float16, layout="mla") == 8
    with pytest.raises(ValueError, match="no value cache"):
        kv.value(0)
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        KVCache(1, 8, 16, 2, 576, np.float16, layout="mla")
    rng = np.random.default_rng(0)
    pool = BlockPool(8, 16)
    slots = pool.append("a", 40)
    kv_c, k_pe = rng.standard_normal((40, 512)).astype(np.float16), rng.standard_normal((40, 64)).astype(np.float16)
    cupaged.concat_and_cache_mla(backend.asarray(kv_c), backend.asarray(k_pe), kv.key(0), backend.asarray(slots))
    q = rng.standard_normal((1, 16, 576)).astype(np.float16)
    table, lens = np.array([pool.block_table("a")], np.int32), np.array([40], np.int32)
    out = cupaged.mla_decode(backend.asarray(q), kv.key(0), backend.asarray(table), backend.asarray(lens), scale=0.05)
    ref, _ = reference.mla_decode(q, backend.to_numpy(kv.key(0)), table, lens, scale=0.05)
    assert_close(backend.to_numpy(out), ref, np.float16)
    latent = np.concatenate([kv_c, k_pe], axis=1)
    assert np.array_equal(backend.to_numpy(kv.key(0))[table[0, 1], 3], latent[19]), "token 19 not in its slot"
