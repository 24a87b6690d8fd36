"""Host <-> device copies through pinned memory: ``PinnedStaging`` (plan uploads, swap staging) and
the GPU paths of ``cupaged.swap_blocks``.

A copy between device and page-locked (pinned) host memory is a DMA the stream runs on its own;
from pageable memory the driver stages it through a pinned buffer of its own while the host waits.
So host data is gathered into pinned memory once and every move is a cudaMemcpyAsync on CuPy's
current stream.
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np

from cupaged._backend import is_device_array, module_of
from cupaged._checks import address

__all__ = ["PinnedStaging", "is_pinned", "swap_blocks_gpu"]


class PinnedStaging:
    """Pinned host buffers used in turn.

    A copy from or into pinned memory is asynchronous: the host may not refill (or read) a buffer
    until the copies using it have finished. Each buffer carries the event recorded after its last
    copies and is handed out again only after that event has completed; with ``depth`` buffers in
    rotation the host waits only when it runs ``depth`` uses ahead of the GPU. Buffers grow to the
    largest use and are kept.
    """

    def __init__(self, depth: int = 2):
        self._buffers = [None] * depth  # pinned uint8 memory per slot
        self._events = [None] * depth  # event recorded after the slot's last copies
        self._next = 0

    def take(self, cp, nbytes: int) -> tuple[int, np.ndarray]:
        """(slot, its pinned uint8 buffer of >= nbytes), once every copy that used it has finished.
        Enqueue the copies that use the buffer, then call :meth:`done`."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        if self._events[slot] is not None:
            self._events[slot].synchronize()
        buf = self._buffers[slot]
        if buf is None or len(buf) < nbytes:
            mem = cp.cuda.alloc_pinned_memory(max(nbytes, 2 * len(buf) if buf is not None else 4096))
            buf = self._buffers[slot] = np.frombuffer(mem, np.uint8)
        return slot, buf

    def done(self, cp, slot: int, stream) -> None:
        """The copies using ``slot``'s buffer are enqueued on ``stream``: its next use waits for them."""
        # a new event each time: an event records only on a stream of its own device, and the
        # staging is shared by every device
        self._events[slot] = cp.cuda.Event(disable_timing=True)
        self._events[slot].record(stream)

    def upload(self, cp, arrays: dict) -> dict:
        """Small host arrays as cupy arrays: packed into one buffer, one copy on the current stream."""
        offsets, nbytes = {}, 0
        for name, a in arrays.items():  # int64 arrays first: every offset stays 8-byte aligned
            offsets[name] = nbytes
            nbytes += -(-a.nbytes // 8) * 8
        slot, buf = self.take(cp, nbytes)
        for name, a in arrays.items():
            buf[offsets[name]:offsets[name] + a.nbytes] = a.reshape(-1).view(np.uint8)
        stream = cp.cuda.get_current_stream()
        device = cp.empty(max(nbytes, 8), cp.uint8)
        device.data.copy_from_host_async(ctypes.c_void_p(buf.ctypes.data), nbytes, stream)  # (old CuPy: no int)
        self.done(cp, slot, stream)
        return {name: device[offsets[name]:offsets[name] + a.nbytes].view(a.dtype).reshape(a.shape)
                for name, a in arrays.items()}


@functools.cache
def _swap_staging() -> PinnedStaging:
    """swap_blocks' staging: one for the process, as it must outlive the copies reading it, and
    apart from the pools' (a swap's buffers are blocks, not index arrays)."""
    return PinnedStaging()


def is_pinned(cp, a: np.ndarray) -> bool:
    """Whether host array ``a`` lies in page-locked memory (``cupyx.empty_pinned``, cudaHostRegister)."""
    return cp.cuda.runtime.pointerGetAttributes(address(a)).type == cp.cuda.runtime.cudaMemoryTypeHost


def _blocks_contiguous(a) -> bool:
    """Every block ``a[i]`` is one C-contiguous range of bytes (a memcpy moves it whole)."""
    return a[0].flags.c_contiguous


def _packed(buf: np.ndarray, n: int, like) -> np.ndarray:
    """The first n blocks of ``like``'s shape and dtype in ``buf``, back to back."""
    block = like.shape[1:]
    return buf[:n * like.itemsize * math.prod(block)].view(like.dtype).reshape(n, *block)


def _runs(src_ids: np.ndarray, dst_ids: np.ndarray, merge: bool):
    """(first pair, number of pairs) per copy, in mapping order: consecutive pairs whose source and
    destination ids both advance by 1 make one run (``merge`` False: blocks are not adjacent in
    memory, one copy per pair)."""
    n = len(src_ids)
    joins = (np.diff(src_ids) == 1) & (np.diff(dst_ids) == 1) if merge else np.zeros(n - 1, bool)
    firsts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return zip(firsts.tolist(), np.diff(np.append(firsts, n)).tolist())


def swap_blocks_gpu(src, dst, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """``dst[dst_ids] = src[src_ids]`` with a cupy array on at least one side, arguments checked
    (the semantics are those of :func:`cupaged.swap_blocks`)."""
    on_device = is_device_array(src), is_device_array(dst)
    cp = module_of(src if on_device[0] else dst)
    n, block_bytes = len(src_ids), src.itemsize * math.prod(src.shape[1:])
    if block_bytes == 0:
        return
    stream, staging = cp.cuda.get_current_stream(), _swap_staging()
    slot = scattered = None
    packed = np.arange(n)
    # Each side is (address of block 0, bytes from one block to the next, the block ids copied).
    # A side that cannot be copied in place goes through a packed buffer in mapping order. Packed
    # device buffers are freed on return: CuPy's pool hands them out again on this stream only,
    # after the copies enqueued here.
    if on_device[0]:
        if _blocks_contiguous(src) and not (on_device[1] and cp.may_share_memory(src, dst)):
            src_side = address(src), src.strides[0], src_ids
        else:  # also when dst overlaps src: every block is read before any is written, as by the reference
            gathered = cp.ascontiguousarray(src[cp.asarray(src_ids)])
            src_side = address(gathered), block_bytes, packed
    elif _blocks_contiguous(src) and is_pinned(cp, src):
        src_side = address(src), src.strides[0], src_ids  # asynchronous: src is read after the return
    else:
        slot, buf = staging.take(cp, n * block_bytes)
        np.take(src, src_ids, axis=0, out=_packed(buf, n, src), mode="clip")  # ids checked: no bounds pass
        src_side = buf.ctypes.data, block_bytes, packed
    if on_device[1]:
        if _blocks_contiguous(dst):
            dst_side = address(dst), dst.strides[0], dst_ids
        else:  # scattered by a kernel after the copies
            scattered = cp.empty((n, *dst.shape[1:]), dst.dtype)
            dst_side = address(scattered), block_bytes, packed
    elif _blocks_contiguous(dst) and is_pinned(cp, dst):
        dst_side = address(dst), dst.strides[0], dst_ids
    else:  # scattered on the host after the synchronize
        slot, buf = staging.take(cp, n * block_bytes)
        scattered = _packed(buf, n, dst)
        dst_side = buf.ctypes.data, block_bytes, packed
    rt = cp.cuda.runtime
    kind = {(False, True): rt.memcpyHostToDevice, (True, False): rt.memcpyDeviceToHost,
            (True, True): rt.memcpyDeviceToDevice}[on_device]
    (src_at, src_step, src_run_ids), (dst_at, dst_step, dst_run_ids) = src_side, dst_side
    for first, count in _runs(src_run_ids, dst_run_ids, src_step == block_bytes == dst_step):
        rt.memcpyAsync(dst_at + int(dst_run_ids[first]) * dst_step, src_at + int(src_run_ids[first]) * src_step,
                       count * block_bytes, kind, stream.ptr)
    if slot is not None:
        staging.done(cp, slot, stream)
    if not on_device[1]:
        stream.synchronize()  # dst is a host array: ready when swap_blocks returns
    if scattered is not None:
        dst[cp.asarray(dst_ids) if on_device[1] else dst_ids] = scattered
