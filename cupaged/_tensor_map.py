"""``make_tensor_map``: a TMA tensor map (CUDA's ``CUtensorMap``) of a numpy or cupy array, for kernels that take
it as a by-value ``const __grid_constant__ CUtensorMap`` argument.

A map is a ``numpy.void`` of 128 bytes (``bytes(m)`` is its image), backed by 128-byte-aligned memory (CUDA 13's
``alignof(CUtensorMap)``; 12's is 64) that also keeps the mapped array alive. Both launchers take it as it is:
CuPy >= 14.1 packs a numpy scalar kernel argument by copying its ``itemsize`` bytes (``CScalar`` in
cupy/_core/_scalar.pyx), and the sim's RawKernel takes a numpy scalar of a struct parameter's size.

- cupy array: the driver's own encoding, from ``cuTensorMapEncodeTiled`` through cuda-bindings (the cuda12 /
  cuda13 extras), imported only here; dtype ``[("opaque", "<u8", (16,))]``, as cuda.h declares the struct.
- numpy array (sim): the sim's encoding of the same fields, dtype ``SIM_DTYPE`` (little-endian; the sim's TMA
  decodes it): magic, rank, the global address, dims and strides innermost first, box, element strides, element
  size, swizzle, out-of-bounds fill (0: zeros) and CUDA's ``CUtensorMapDataType`` value. The array must live in
  the sim's guarded memory (``cupaged.sim.empty / zeros / asarray``): the sim hands kernels a guarded copy of a
  plain numpy array at each launch, so a map of the original would bypass its guard pages and bounds checks.

Every field is checked against cuTensorMapEncodeTiled's documented requirements before any driver call, with the
same ValueError / TypeError for numpy and cupy arrays. Interleave is none and out-of-bounds elements read as
zeros; the GPU map asks for 128-byte L2 promotion (a cache hint only: it changes no result).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import ml_dtypes
import numpy as np

from cupaged._backend import is_host_array, module_of
from cupaged._checks import address, check_array, check_choice
from cupaged._interop import accepts_foreign_arrays

__all__ = ["make_tensor_map"]

MAP_BYTES, MAP_ALIGN = 128, 128
MAX_RANK, MAX_BOX, MAX_ELEMENT_STRIDE = 5, 256, 8
MAX_DIM, STRIDE_LIMIT = 2**32, 2**40
SIM_MAGIC = 0x4D545043  # "CPTM" as little-endian bytes
SWIZZLES = {"none": (0, None), "32B": (1, 32), "64B": (2, 64), "128B": (3, 128)}  # name -> (CUtensorMapSwizzle, span)

CUDA_DTYPE = np.dtype([("opaque", "<u8", (16,))])
SIM_DTYPE = np.dtype({
    "names": ["magic", "rank", "address", "dims", "strides", "box", "element_strides", "element_size", "swizzle",
              "oob_fill", "data_type", "reserved"],
    "formats": ["<u4", "<u4", "<u8", ("<u8", (5,)), ("<u8", (4,)), ("<u4", (5,)), ("u1", (5,)), "u1", "u1", "u1",
                "u1", ("u1", (11,))],
    "offsets": [0, 4, 8, 16, 56, 88, 108, 113, 114, 115, 116, 117],
    "itemsize": MAP_BYTES,
})

# CUtensorMapDataType (cuda.h; cuda.bindings.driver.CUtensorMapDataType, 12.x and 13.x alike). TMA copies bits:
# signed 8/16-bit integers and fp8 travel as the unsigned type of their size (there is no INT8 / INT16 value).
UINT8, UINT16, UINT32, INT32, UINT64, INT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = range(10)
_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
        "float8_e3m4", "float8_e8m0fnu")
DATA_TYPES = {
    np.dtype(np.uint8): UINT8, np.dtype(np.int8): UINT8,
    **{np.dtype(getattr(ml_dtypes, n)): UINT8 for n in _FP8 if hasattr(ml_dtypes, n)},
    np.dtype(np.uint16): UINT16, np.dtype(np.int16): UINT16, np.dtype(np.float16): FLOAT16,
    np.dtype(ml_dtypes.bfloat16): BFLOAT16,
    np.dtype(np.uint32): UINT32, np.dtype(np.int32): INT32, np.dtype(np.float32): FLOAT32,
    np.dtype(np.uint64): UINT64, np.dtype(np.int64): INT64, np.dtype(np.float64): FLOAT64,
}
_DTYPE_NAMES = ", ".join(sorted({str(d) for d in DATA_TYPES}))


class Fields(NamedTuple):
    """What a map encodes; every sequence innermost dimension first (cuTensorMapEncodeTiled's order)."""
    rank: int
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]  # bytes, of dims 1..rank-1 (dim 0 is contiguous)
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    element_size: int
    swizzle: int  # CUtensorMapSwizzle
    data_type: int  # CUtensorMapDataType


@accepts_foreign_arrays
def make_tensor_map(array, box, *, element_strides=None, swizzle="none"):
    """A tiled TMA tensor map of ``array`` (numpy in the sim's guarded memory, or cupy; 1 to 5 dimensions,
    the last contiguous), for a kernel parameter ``const __grid_constant__ CUtensorMap``.

    ``box``: the tile one TMA copy moves, one entry per dimension of ``array`` in numpy order (outermost first),
    each 1 to 256; the innermost entry times the itemsize must be a multiple of 16 bytes. ``element_strides``
    (default all 1): the traversal step per dimension, 1 to 8, numpy order. ``swizzle``: "none", "32B", "64B" or
    "128B", the shared-memory swizzle; with one, the box's innermost extent must not pass its span in bytes.
    dtypes: 1-byte (uint8, int8, fp8), 2-byte (uint16, int16, float16, bfloat16), 4-byte (uint32, int32,
    float32) and 8-byte (uint64, int64, float64). The array's address must be 16-byte aligned and its outer
    strides positive multiples of 16 bytes below 2^40. Out-of-bounds elements read as zeros.

    Returns a 128-byte ``numpy.void`` (read-only; ``bytes(m)`` is the map) that keeps ``array`` alive. On a GPU
    (compute capability 9.0 or newer) it is the driver's encoding; a driver refusal is a RuntimeError.
    """
    fields = encoded_fields(array, box, element_strides, swizzle)
    if is_host_array(array):
        return _sim_map(array, fields)
    return _cuda_map(array, fields)


def encoded_fields(array, box, element_strides=None, swizzle="none") -> Fields:
    """The map's fields, each checked as cuTensorMapEncodeTiled documents (a ValueError / TypeError naming
    ``array``, ``box``, ``element_strides`` or ``swizzle``); reads no array contents."""
    check_array("array", array)
    shape, strides = tuple(int(d) for d in array.shape), tuple(int(s) for s in array.strides)
    rank = len(shape)
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"array must have 1 to {MAX_RANK} dimensions (a tensor map's rank), got shape {shape}")
    data_type = DATA_TYPES.get(array.dtype)
    if data_type is None:
        raise TypeError(f"array must have one of the dtypes {_DTYPE_NAMES}, got {array.dtype}")
    itemsize = array.dtype.itemsize
    if not all(1 <= d <= MAX_DIM for d in shape):
        raise ValueError(f"array's dimensions must each be 1 to 2^32 (globalDim), got shape {shape}")
    if shape[-1] > 1 and strides[-1] != itemsize:
        raise ValueError(f"array must be contiguous in its last dimension (a tensor map's dimension 0), got strides "
                         f"{strides} for itemsize {itemsize}")
    for axis, s in enumerate(strides[:-1]):
        if s <= 0 or s % 16 or s >= STRIDE_LIMIT:
            raise ValueError(f"array's stride of dimension {axis} must be a positive multiple of 16 bytes below 2^40 "
                             f"(globalStrides), got strides {strides}")
    base = address(array)
    if base % 16:
        raise ValueError(f"array's data must be 16-byte aligned (globalAddress), got address {base:#x} "
                         f"({base % 16} bytes past a 16-byte boundary)")
    box = _ints("box", box, rank, 1, MAX_BOX, "boxDim")
    inner = box[-1] * itemsize
    if inner % 16:
        raise ValueError(f"box's innermost entry times the itemsize must be a multiple of 16 bytes, got {box[-1]} x "
                         f"{itemsize} = {inner} bytes (box {box})")
    steps = (1,) * rank if element_strides is None else \
        _ints("element_strides", element_strides, rank, 1, MAX_ELEMENT_STRIDE, "elementStrides")
    check_choice("swizzle", swizzle, tuple(SWIZZLES))
    code, span = SWIZZLES[swizzle]
    if span is not None and inner > span:
        raise ValueError(f"box's innermost extent must not pass the swizzle span: swizzle={swizzle!r} allows "
                         f"{span} bytes, got {box[-1]} x {itemsize} = {inner} bytes (box {box})")
    return Fields(rank, base, shape[::-1], strides[-2::-1], box[::-1], steps[::-1], itemsize, code, data_type)


def _ints(name: str, values, rank: int, lo: int, hi: int, field: str) -> tuple[int, ...]:
    """``values``: one int in [lo, hi] per dimension of ``array`` (numpy order)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a sequence of {rank} ints (one per dimension of array, outermost first), "
                        f"got {type(values).__name__} {values!r}")
    got = tuple(values)
    if len(got) != rank:
        raise ValueError(f"{name} must have {rank} entries (one per dimension of array, outermost first), got "
                         f"{len(got)}: {got!r}")
    for v in got:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} entries must be ints, got {type(v).__name__} {v!r} in {got!r}")
    got = tuple(int(v) for v in got)
    if not all(lo <= v <= hi for v in got):
        raise ValueError(f"{name} entries must each be {lo} to {hi} ({field}), got {got}")
    return got


def _storage(dtype: np.dtype, array) -> np.ndarray:
    """A zeroed 0-d array of ``dtype`` at a MAP_ALIGN-aligned address, whose memory holds ``array`` alive."""
    raw = _Storage(MAP_BYTES + MAP_ALIGN)
    raw.array = array
    buf = np.frombuffer(raw, np.uint8)
    start = -buf.ctypes.data % MAP_ALIGN
    return buf[start:start + MAP_BYTES].view(dtype).reshape(())


class _Storage(bytearray):
    """The bytes behind a map, and the array the map describes (kept alive as long as the map)."""


def _finish(m: np.ndarray) -> np.void:
    m.flags.writeable = False
    return m[()]


def _sim_map(array, f: Fields) -> np.void:
    from cupaged.sim._memory import live_buffers  # the sim backend's own memory

    lo, hi = np.lib.array_utils.byte_bounds(array)
    if not any(b.valid[0] <= lo and hi <= b.valid[1] for b in live_buffers()):  # any view of one, by address
        raise ValueError("array must live in the sim's guarded memory: make it with cupaged.sim.asarray (or "
                         "cupaged.sim.empty / zeros). The sim hands kernels a guarded copy of a plain numpy array at "
                         "each launch, so a map of the original would bypass its guard pages and bounds checks")
    m = _storage(SIM_DTYPE, array)
    m["magic"], m["rank"], m["address"] = SIM_MAGIC, f.rank, f.address
    m["dims"][:f.rank] = f.dims
    m["strides"][:f.rank - 1] = f.strides
    m["box"][:f.rank] = f.box
    m["element_strides"][:f.rank] = f.element_strides
    m["element_size"], m["swizzle"], m["oob_fill"], m["data_type"] = f.element_size, f.swizzle, 0, f.data_type
    return _finish(m)


def _cuda_map(array, f: Fields) -> np.void:
    device = array.device
    cc = int(device.compute_capability)
    if cc < 90:
        raise NotImplementedError(f"array is on device {device.id} of compute capability {cc // 10}.{cc % 10}: "
                                  "tensor maps (TMA) need 9.0 or newer")
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ImportError(f"make_tensor_map of a cupy array calls the CUDA driver through cuda-bindings, which "
                          f"cannot be imported ({type(e).__name__}: {e}): install cupaged[cuda12] or cupaged[cuda13]"
                          ) from e
    with device:
        module_of(array).cuda.runtime.setDevice(device.id)  # makes the device's primary context current here
        res, tmap = driver.cuTensorMapEncodeTiled(
            driver.CUtensorMapDataType(f.data_type), driver.cuuint32_t(f.rank), f.address,
            [driver.cuuint64_t(d) for d in f.dims], [driver.cuuint64_t(s) for s in f.strides],
            [driver.cuuint32_t(b) for b in f.box], [driver.cuuint32_t(e) for e in f.element_strides],
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, driver.CUtensorMapSwizzle(f.swizzle),
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if int(res) != 0:
        name = driver.cuGetErrorName(res)[1]
        raise RuntimeError(f"cuTensorMapEncodeTiled refused the map: {name.decode() if name else int(res)} "
                           f"(fields, innermost first: {f})")
    m = _storage(CUDA_DTYPE, array)
    m["opaque"][...] = [int(q) for q in tmap.opaque]
    return _finish(m)
