"""swap_blocks' GPU paths without a GPU: a fake ``cupy`` whose device arrays are numpy-backed and
whose stream really is asynchronous. Every memcpyAsync and kernel is queued and runs only when a
synchronize (stream or event) reaches it, so a host array read before its copies finish, or a
staging buffer refilled while a copy still reads it, shows up as wrong bytes. memcpyAsync also
checks what CUDA requires of it: pinned host memory on the host side, device memory on the device
side, no overlap. The reference is cupaged.reference.swap_blocks."""

from __future__ import annotations

import ctypes
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import _host_transfer, reference
from cupaged.testing import poisoned
from tests.test_cache_ops import assert_bytes_equal

H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind
PINNED, DEVICE = 1, 2  # cudaMemoryType
BLOCK = (4, 2, 8)
# runs in both ids: 0-2 -> 3-5, 7-8 -> 1-2, then single pairs; 5 -> 6 follows 4 -> 9 in src ids only
MAPPING = np.array([[0, 3], [1, 4], [2, 5], [7, 1], [8, 2], [4, 9], [5, 6], [6, 0]], np.int64)


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class FakeGpu(types.ModuleType):
    """The parts of cupy swap_blocks uses. ``copies``: (dst, src, nbytes, kind, stream) of every
    memcpyAsync; ``stream_syncs``, ``event_waits``: synchronizes of the stream and of events."""

    def __init__(self):
        super().__init__("cupy")
        fake = self
        self.queue, self.ran = [], 0  # enqueued work; how much of it has run
        self.copies, self.stream_syncs, self.event_waits, self.kernels = [], 0, 0, 0
        self.memory = {PINNED: [], DEVICE: []}  # (start, end, buffer) per memory type

        class Stream:
            ptr = 0x5EED

            def is_capturing(self):
                return False

            def synchronize(self):
                fake.stream_syncs += 1
                fake.run_until(len(fake.queue))

        class Event:
            def __init__(self, disable_timing=False):
                self.mark = 0

            def record(self, stream):
                assert stream is fake.stream
                self.mark = len(fake.queue)

            def synchronize(self):
                fake.event_waits += 1
                fake.run_until(self.mark)

        class ndarray:  # noqa: N801 (cupy's name)
            def __init__(self, host):
                self.host = host

            shape = property(lambda self: self.host.shape)
            dtype = property(lambda self: self.host.dtype)
            ndim = property(lambda self: self.host.ndim)
            strides = property(lambda self: self.host.strides)
            itemsize = property(lambda self: self.host.itemsize)
            nbytes = property(lambda self: self.host.nbytes)
            flags = property(lambda self: self.host.flags)
            data = property(lambda self: types.SimpleNamespace(ptr=_ptr(self.host)))

            def __getitem__(self, index):
                if not isinstance(index, ndarray):
                    return ndarray(self.host[index])  # a view
                out = fake.empty(index.shape + self.shape[1:], self.dtype)  # a gather kernel
                fake.launch(lambda: out.host.__setitem__(Ellipsis, self.host[index.host]))
                return out

            def __setitem__(self, index, value):
                assert isinstance(index, ndarray) and isinstance(value, ndarray)
                fake.launch(lambda: self.host.__setitem__(index.host, value.host))  # a scatter kernel

            def get(self):
                fake.stream.synchronize()
                return self.host.copy()

        self.ndarray, self.stream = ndarray, Stream()
        self.cuda = types.SimpleNamespace(
            get_current_stream=lambda: self.stream, Event=Event, alloc_pinned_memory=self.alloc_pinned_memory,
            runtime=types.SimpleNamespace(memcpyAsync=self.memcpy_async, pointerGetAttributes=self.attributes,
                                          cudaMemoryTypeHost=PINNED, memcpyHostToDevice=H2D,
                                          memcpyDeviceToHost=D2H, memcpyDeviceToDevice=D2D))

    # -- memory ------------------------------------------------------------------------------------
    def _register(self, kind, buffer: np.ndarray) -> np.ndarray:
        self.memory[kind].append((_ptr(buffer), _ptr(buffer) + buffer.nbytes, buffer))
        return buffer

    def _kind_of(self, start: int, nbytes: int):
        for kind, ranges in self.memory.items():
            if any(lo <= start and start + nbytes <= hi for lo, hi, _ in ranges):
                return kind
        return None

    def alloc_pinned_memory(self, nbytes):
        return self._register(PINNED, np.zeros(nbytes, np.uint8)).data

    def pinned(self, host: np.ndarray) -> np.ndarray:
        """A copy of ``host`` in pinned memory (cupyx.empty_pinned)."""
        out = np.frombuffer(self.alloc_pinned_memory(host.nbytes), host.dtype).reshape(host.shape)
        out[...] = host
        return out

    def empty(self, shape, dtype):
        return self.ndarray(self._register(DEVICE, np.zeros(shape, dtype)))

    def asarray(self, host):
        out = self.empty(np.shape(host), np.asarray(host).dtype)
        out.host[...] = host  # a synchronous upload, as from pageable memory
        return out

    def ascontiguousarray(self, a):
        return a if a.flags.c_contiguous else self.asarray(a.host)

    def may_share_memory(self, a, b):
        return np.may_share_memory(a.host, b.host)

    def attributes(self, ptr):
        return types.SimpleNamespace(type=self._kind_of(ptr, 1) or 0)

    # -- the stream --------------------------------------------------------------------------------
    def run_until(self, mark):
        while self.ran < mark:
            self.queue[self.ran]()
            self.ran += 1

    def launch(self, work):
        self.kernels += 1
        self.queue.append(work)

    def memcpy_async(self, dst, src, nbytes, kind, stream):
        host_side, device_side = {H2D: ((src,), (dst,)), D2H: ((dst,), (src,)), D2D: ((), (src, dst))}[kind]
        assert all(self._kind_of(p, nbytes) == PINNED for p in host_side), "async copy from or to pageable memory"
        assert all(self._kind_of(p, nbytes) == DEVICE for p in device_side), "device side not in device memory"
        assert src + nbytes <= dst or dst + nbytes <= src, "overlapping copy"
        assert stream == self.stream.ptr
        self.copies.append((dst, src, nbytes, kind, stream))
        self.queue.append(lambda: ctypes.memmove(dst, src, nbytes))


@pytest.fixture
def fake(monkeypatch):
    fake = FakeGpu()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    _host_transfer._swap_staging.cache_clear()  # buffers and events of this fake only
    yield fake
    _host_transfer._swap_staging.cache_clear()


def runs(src_ids, dst_ids) -> int:
    """Copies of a mapping: one per run of pairs whose ids both advance by 1."""
    src_ids, dst_ids = np.asarray(src_ids), np.asarray(dst_ids)
    return 1 + int(np.sum((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)))


def inside(ptr, nbytes, a: np.ndarray) -> bool:
    return _ptr(a) <= ptr and ptr + nbytes <= _ptr(a) + a.nbytes


DIRECTIONS = ["host_to_device", "pinned_to_device", "device_to_host", "device_to_pinned", "device_to_device"]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_each_direction_is_the_reference_in_one_async_copy_per_run(fake, direction):
    rng = np.random.default_rng(1)
    src0 = rng.standard_normal((9, *BLOCK)).astype(ml_dtypes.bfloat16)
    dst0 = poisoned((11, *BLOCK), ml_dtypes.bfloat16)
    source, target = direction.split("_to_")
    src = {"host": src0.copy(), "pinned": fake.pinned(src0), "device": fake.asarray(src0)}[source]
    dst = {"host": dst0.copy(), "pinned": fake.pinned(dst0), "device": fake.asarray(dst0)}[target]
    cupaged.swap_blocks(src, dst, MAPPING)
    want = reference.swap_blocks(src0, dst0, MAPPING)
    kind = {"device": D2D, "host": D2H, "pinned": D2H}[target] if source == "device" else H2D
    assert {c[3] for c in fake.copies} == {kind}
    if target == "device":
        assert fake.stream_syncs == 0, "a copy to the device synchronized"
        if source == "host":
            src[...] = 0  # staged: the caller may reuse its array on return
        assert_bytes_equal(dst.get(), want, "dst")
    else:  # read at once: swap_blocks synchronized, or the queued copies have not run
        assert fake.stream_syncs == 1
        assert_bytes_equal(dst, want, "dst")
    staged = "host" in (source, target)
    ids = np.arange(len(MAPPING))
    want_runs = runs(ids if source == "host" else MAPPING[:, 0], ids if target == "host" else MAPPING[:, 1])
    assert len(fake.copies) == want_runs < len(MAPPING)
    user_host = src if source in ("host", "pinned") else dst if target in ("host", "pinned") else None
    if user_host is not None:
        pointers = [(c[1] if source != "device" else c[0], c[2]) for c in fake.copies]
        assert all(inside(p, n, user_host) != staged for p, n in pointers), "pinned arrays are copied in place, " \
                                                                           "pageable ones through staging"
    assert fake.kernels == 0


def test_staging_is_not_refilled_while_a_copy_still_reads_it(fake):
    """Five host-to-device swaps in a row, the 'GPU' never catching up on its own: the third reuses
    the first staging buffer only after waiting for the first copies (events); nothing synchronizes
    the stream."""
    rng = np.random.default_rng(2)
    mapping = np.array([[1, 0], [0, 1]], np.int64)  # staged in mapping order: one run into blocks 0-1
    hosts = [rng.standard_normal((2, *BLOCK)).astype(np.float32) for _ in range(5)]
    devices = [fake.asarray(poisoned((2, *BLOCK), np.float32)) for _ in hosts]
    for host, device in zip(hosts, devices):
        cupaged.swap_blocks(host, device, mapping)
    assert fake.stream_syncs == 0 and fake.event_waits == 3 and len(fake.copies) == 5
    assert fake.ran < len(fake.queue), "the last copies are still in flight"
    for host, device in zip(hosts, devices):
        assert_bytes_equal(device.get(), host[::-1], "device")


@pytest.mark.parametrize("case", ["host_blocks_strided", "pinned_blocks_strided", "device_blocks_strided",
                                  "device_dim0_strided", "device_dst_blocks_strided"])
def test_non_contiguous_caches(fake, case):
    """Blocks that are not one contiguous range go through a packed buffer (staging on the host, a
    gather or scatter kernel on the device); blocks contiguous but not adjacent (kv[:, 0]) are
    copied in place one pair at a time."""
    rng = np.random.default_rng(3)
    src0 = rng.standard_normal((9, *BLOCK)).astype(np.float16)
    dst0 = poisoned((11, *BLOCK), np.float16)
    wide = np.zeros((11, *BLOCK[:-1], 2 * BLOCK[-1]), np.float16)  # [..., :8] of it: blocks not contiguous
    pairs = np.zeros((11, 2, *BLOCK), np.float16)  # [:, 0] of it: blocks 2 blocks apart
    src, dst = fake.asarray(src0), fake.asarray(dst0)
    if case in ("host_blocks_strided", "pinned_blocks_strided"):
        host = (fake.pinned(wide) if case.startswith("pinned") else wide)[:9, ..., :BLOCK[-1]]
        host[...] = src0
        src = host
    elif case == "device_blocks_strided":
        src = fake.asarray(wide)[:9, ..., :BLOCK[-1]]
        src.host[...] = src0
    elif case == "device_dim0_strided":
        src = fake.asarray(pairs)[:9, 0]
        src.host[...] = src0
    else:
        dst = fake.asarray(wide)[..., :BLOCK[-1]]
        dst.host[...] = dst0
    cupaged.swap_blocks(src, dst, MAPPING)
    assert_bytes_equal(dst.get(), reference.swap_blocks(src0, dst0, MAPPING), "dst")
    per_pair = case == "device_dim0_strided"
    ids = np.arange(len(MAPPING))
    packed_src = case != "device_dst_blocks_strided" and not per_pair
    want_runs = len(MAPPING) if per_pair else runs(ids if packed_src else MAPPING[:, 0],
                                                    ids if case == "device_dst_blocks_strided" else MAPPING[:, 1])
    assert len(fake.copies) == want_runs
    assert fake.kernels == (case in ("device_blocks_strided", "device_dst_blocks_strided"))


def test_device_to_device_within_one_cache_reads_before_writing(fake):
    """src and dst the same cache, a chain 0 -> 1 -> 2 -> 3: each block is copied from its value
    before the call (the reference's), through a gathered copy, never by an overlapping memcpy."""
    cache0 = np.random.default_rng(4).standard_normal((6, *BLOCK)).astype(np.float32)
    cache = fake.asarray(cache0)
    mapping = np.array([[0, 1], [1, 2], [2, 3], [5, 0]], np.int64)
    cupaged.swap_blocks(cache, cache, mapping)
    assert_bytes_equal(cache.get(), reference.swap_blocks(cache0, cache0, mapping), "cache")
    assert fake.kernels == 1 and len(fake.copies) == runs(np.arange(4), mapping[:, 1]) == 2


def test_device_mapping_and_rejected_calls(fake):
    src0 = np.arange(np.prod((3, *BLOCK)), dtype=np.float32).reshape(3, *BLOCK)
    dst = fake.asarray(np.zeros((4, *BLOCK), np.float32))
    cupaged.swap_blocks(src0, dst, fake.asarray(np.array([[2, 3]], np.int64)))
    assert_bytes_equal(dst.get()[3], src0[2], "dst[3]")
    before, copies = dst.get(), len(fake.copies)
    for mapping, exc, match in ((np.array([[0, 4]], np.int64), ValueError, "destination block 4"),
                                (np.array([[3, 0]], np.int64), ValueError, "source block 3"),
                                (np.array([[0, 1]], np.int32), TypeError, "block_mapping")):
        with pytest.raises(exc, match=match):
            cupaged.swap_blocks(src0, dst, mapping)
    with pytest.raises(ValueError, match="blocks differ"):
        cupaged.swap_blocks(src0[:, :2], dst, np.array([[0, 1]], np.int64))
    assert len(fake.copies) == copies and fake.kernels == 0
    assert_bytes_equal(dst.get(), before, "dst after rejected calls")
