"""RawModule / kernel objects of the sim backend, mirroring CuPy's call convention.

``kernel(grid, block, args, shared_mem=0)``: numpy arrays are passed as device pointers (without a
copy when they live in guarded memory, else through a guarded copy that is written back), numpy
scalars by value. Python ``int`` / ``float`` become int64 / float64, as CuPy passes them; unlike
CuPy, every argument is checked against the kernel's C++ parameter type, so a float32 array for
``const __half*`` or a Python float for a ``float`` parameter is a TypeError, not garbage.
"""

from __future__ import annotations

import ctypes
import re
import threading

import numpy as np

from cupaged._source import strip_comments
from cupaged.sim import _compile, _env
from cupaged.sim._errors import SimError, SimMemoryError, SimSyncError, SimTimeoutError, SimTrapError
from cupaged.sim._memory import poison_byte, regions
from cupaged.sim._params import param_names
from cupaged.sim._smem import launch_bounds
from cupaged.sim._staging import Staging, fault_message
from cupaged.sim.profiler import _profile
from cupaged.sim.profiler._probe import pointer_fields

__all__ = ["RawModule", "RawKernel"]

DEFAULT_SMEM = 48 * 1024
_LAUNCH_LOCK = threading.Lock()  # the engine's state and signal handlers are process-wide

_DTYPES = {  # C++ element code -> numpy dtype names accepted for a pointer to it
    "f32": ("float32",), "f64": ("float64",), "f16": ("float16",), "bf16": ("bfloat16",),
    "e4m3": ("uint8", "float8_e4m3fn"), "e5m2": ("uint8", "float8_e5m2"), "b8": ("bool",),
    "i8": ("int8",), "u8": ("uint8",), "i16": ("int16",), "u16": ("uint16",), "i32": ("int32",),
    "u32": ("uint32",), "i64": ("int64",), "u64": ("uint64",),
}
_SCALARS = {  # C++ scalar code -> (ctypes type, numpy dtype name)
    "f32": (ctypes.c_float, "float32"), "f64": (ctypes.c_double, "float64"), "b8": (ctypes.c_bool, "bool"),
    "i8": (ctypes.c_int8, "int8"), "u8": (ctypes.c_uint8, "uint8"), "i16": (ctypes.c_int16, "int16"),
    "u16": (ctypes.c_uint16, "uint16"), "i32": (ctypes.c_int32, "int32"), "u32": (ctypes.c_uint32, "uint32"),
    "i64": (ctypes.c_int64, "int64"), "u64": (ctypes.c_uint64, "uint64"),
    "f16": (ctypes.c_uint16, "float16"), "bf16": (ctypes.c_uint16, "bfloat16"),
}


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_ulonglong),
                ("order", ctypes.c_int), ("seed", ctypes.c_ulonglong), ("timeout_s", ctypes.c_double),
                ("tls_dyn_offset", ctypes.c_ulonglong), ("poison", ctypes.c_int), ("regions", ctypes.c_void_p),
                ("nregions", ctypes.c_int), ("profile", ctypes.c_void_p)]


class _ErrorInfo(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("has_thread", ctypes.c_int), ("thread", ctypes.c_uint * 3),
                ("block", ctypes.c_uint * 3), ("fault_addr", ctypes.c_ulonglong), ("fault_write", ctypes.c_int),
                ("signo", ctypes.c_int), ("dyn_smem", ctypes.c_ulonglong), ("fault_base", ctypes.c_ulonglong),
                ("fault_index", ctypes.c_ulonglong), ("fault_decoded", ctypes.c_int),
                ("regs", ctypes.c_ulonglong * 16), ("msg", ctypes.c_char * 8192)]


_ERRORS = {1: SimMemoryError, 2: SimSyncError, 3: SimTrapError, 4: SimTimeoutError}


def _dim3(v, what):
    t = (v,) if np.ndim(v) == 0 else tuple(v)
    if not 1 <= len(t) <= 3 or any(int(x) < 1 for x in t):
        raise ValueError(f"{what} must be a positive int or a tuple of 1 to 3 positive ints, got {v!r}")
    return tuple(int(x) for x in t) + (1,) * (3 - len(t))


class RawModule:
    """``cupaged.sim.RawModule(code=..., options=(), name_expressions=())``, like cupy.RawModule.

    ``label`` names the source in the notice printed while g++ compiles it (a cache miss)."""

    def __init__(self, code: str, options=(), name_expressions=(), *, label: str | None = None):
        self.code = code
        self.options = tuple(options)
        self.name_expressions = tuple(name_expressions)
        names = list(self.name_expressions)
        # __launch_bounds__(...) may stand before or after `void` (CUTLASS puts it before): drop it
        # first, else its name was taken for the kernel's and the generated wrappers did not compile.
        text = strip_comments(code)
        scan = re.sub(r"__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)", " ", text)
        for m in re.finditer(r'extern\s+"C"\s+__global__\s+(?:\w+\s+)*?(\w+)\s*\(', scan):
            if m.group(1) not in names:
                names.append(m.group(1))
        self._names = names
        self._lib, static, self.tls_dyn_offset = _compile.build(code, self.options, names, label)
        self.static_shared_bytes = static  # per kernel name: what the GPU charges each kernel
        self._bounds = launch_bounds(text)
        self._lib.cupaged_sim_error.restype = ctypes.POINTER(_ErrorInfo)
        self._kernels = {}
        self._label, self._profiled, self._launchers = label, {}, {}

    def _variant(self, index: int, profiled: bool):
        """(library, launch function, dynamic shared offset) of kernel ``index`` in the plain build
        or in the profiler's (compiled on first use); looked up once per (kernel, build)."""
        key = (index, profiled)
        if key not in self._launchers:
            self._launchers[key] = self._lookup(index, profiled)
        return self._launchers[key]

    def _lookup(self, index: int, profiled: bool):
        if not profiled:
            lib, offset, entry = self._lib, self.tls_dyn_offset, index
        else:  # the profiler's build holds the one kernel: it unrolls loops as ptxas does (slow to compile)
            if index not in self._profiled:
                lib, _, offset = _compile.build(self.code, self.options, [self._names[index]],
                                                f"{self._label or 'a CUDA source'}: {self._names[index]}", profile=True)
                lib.cupaged_sim_error.restype = ctypes.POINTER(_ErrorInfo)
                self._profiled[index] = lib, offset
            (lib, offset), entry = self._profiled[index], 0
        launch = getattr(lib, f"cupaged_sim_launch_{entry}")
        launch.argtypes = (ctypes.POINTER(_LaunchConfig), ctypes.POINTER(ctypes.c_void_p))
        return lib, launch, offset

    def get_function(self, name: str) -> "RawKernel":
        if name not in self._kernels:
            if name not in self._names:
                raise KeyError(f"no kernel {name!r} in this module (name expressions and extern \"C\" kernels: "
                               f"{', '.join(self._names) or 'none'})")
            self._kernels[name] = RawKernel(self, name, self._names.index(name))
        return self._kernels[name]


class RawKernel:
    """A launchable kernel: ``kernel(grid, block, args, shared_mem=0)``."""

    def __init__(self, module: RawModule, name: str, index: int):
        self.module, self.name, self.index = module, name, index
        params = getattr(module._lib, f"cupaged_sim_params_{index}")
        params.restype = ctypes.c_char_p
        self.param_types = tuple(c for c in params().decode().split(",") if c)
        names = param_names(module.code, name, len(self.param_types))
        self.param_names = tuple(names or (f"argument {i}" for i in range(len(self.param_types))))
        self.max_dynamic_shared_size_bytes = DEFAULT_SMEM
        base = re.sub(r"<.*", "", name).rpartition("::")[2].strip()
        self.max_threads_per_block = min(1024, module._bounds.get(base, 1024))  # as CuPy reports it

    # --------------------------------------------------------------- marshaling
    def _scalar(self, i, code, a):
        pname = self.param_names[i]
        if code.startswith("struct:"):
            size = int(code[7:])
            if not (isinstance(a, np.generic) and a.dtype.itemsize == size):
                raise TypeError(f"{self.name}: {pname} is a {size}-byte struct: pass a numpy scalar of that size")
            # aligned as strictly as any C++ struct (a CUtensorMap is alignas(64), or 128 in CUDA 13)
            buf = ctypes.create_string_buffer(size + 256)
            view = (ctypes.c_char * size).from_buffer(buf, -ctypes.addressof(buf) % 256)
            ctypes.memmove(view, a.tobytes(), size)
            return view
        ctype, want = _SCALARS[code]
        if isinstance(a, (bool, np.bool_)) and want != "bool":
            raise TypeError(f"{self.name}: {pname} expects {want}, got bool")
        if isinstance(a, np.generic):
            got = a.dtype.name
        elif isinstance(a, bool):
            got = "bool"
        elif isinstance(a, int):
            got = "int64"  # CuPy passes a Python int as int64
        elif isinstance(a, float):
            got = "float64"  # and a Python float as float64
        else:
            raise TypeError(f"{self.name}: {pname} expects a {want} scalar, got {type(a).__name__}")
        if got != want and not (want == "uint64" and got == "int64"):
            raise TypeError(f"{self.name}: {pname} expects {want}, got {got} "
                            f"(pass numpy.{want}(...): CuPy would pass a {got} and the kernel would read garbage)")
        if code in ("f16", "bf16"):
            return ctype(int(np.asarray(a).view(np.uint16)))
        return ctype(a.item() if isinstance(a, np.generic) else a)

    def _check_array(self, i, code, a):
        pname = self.param_names[i]
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{self.name}: {pname} is a pointer ({code[4:]}): pass a numpy array, got {type(a).__name__}")
        want = _DTYPES.get(code[4:])
        if want is not None and a.dtype.name not in want:
            raise TypeError(f"{self.name}: {pname} points to {code[4:]}: expected a {' or '.join(want)} array, got {a.dtype}")

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        args = tuple(args)
        if len(args) != len(self.param_types):
            raise TypeError(f"{self.name}({', '.join(self.param_names)}) takes {len(self.param_types)} arguments, "
                            f"got {len(args)}")
        grid, block = _dim3(grid, "grid"), _dim3(block, "block")
        nthreads = block[0] * block[1] * block[2]
        if nthreads > 1024 or block[2] > 64 or grid[0] >= 2**31 or grid[1] > 65535 or grid[2] > 65535:
            raise ValueError(f"{self.name}: launch configuration grid={grid} block={block} exceeds the GPU's limits "
                             "(≤ 1024 threads per block, block.z ≤ 64, grid.x < 2^31, grid.y/z ≤ 65535)")
        shared_mem = int(shared_mem)
        (order, seed), timeout, arch = _env.order(), _env.timeout(), _env.arch()  # checked before anything is staged
        poison, bounds = poison_byte(), _compile.bounds_checked()
        limit = _env.ARCH_SMEM_LIMIT[arch]
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise ValueError(f"{self.name}: shared_mem={shared_mem} exceeds the kernel's "
                             f"max_dynamic_shared_size_bytes={self.max_dynamic_shared_size_bytes} (opt in first)")
        if self.max_threads_per_block < nthreads:
            raise ValueError(f"{self.name}: a block of {nthreads} threads exceeds its __launch_bounds__"
                             f"({self.max_threads_per_block}) (the GPU refuses such a launch)")
        static = self.module.static_shared_bytes[self.name]
        if shared_mem + static > limit or self.max_dynamic_shared_size_bytes > limit:
            raise ValueError(f"{self.name}: {shared_mem} bytes of dynamic + {static} of static "
                             f"shared memory exceed {arch}'s {limit} bytes per block")
        cvals, views = [None] * len(args), []
        for i, (code, a) in enumerate(zip(self.param_types, args)):
            if code.startswith("ptr:") and a is None:
                cvals[i] = ctypes.c_void_p(0)  # a null pointer, as CuPy passes None
            elif code.startswith("ptr:"):
                self._check_array(i, code, a)
                views.append((i, a))
            else:
                cvals[i] = self._scalar(i, code, a)
        staged = Staging(views, self.param_names)
        ptrs = (ctypes.c_void_p * max(1, len(args)))()
        for i in range(len(args)):
            if cvals[i] is None:
                cvals[i] = ctypes.c_void_p(staged.ptr[i])
            ptrs[i] = ctypes.addressof(cvals[i])
        probe = _profile.LaunchProbe(self, args, staged) if _profile.active() else None
        lib, launch, dyn_offset = self.module._variant(self.index, probe is not None)
        cfg = _LaunchConfig(grid, block, shared_mem, order, seed, timeout, dyn_offset, poison)
        if probe is not None:
            cfg.profile = probe.structs.address
        else:  # the instrumented build looks stores (and, under CUPAGED_SIM_BOUNDS=1, loads) up in this table
            targets = [*staged.buffers.values(),
                       *(buf for _, buf in pointer_fields(self.param_names, self.param_types, args))]
            table = regions(targets, every_live=bounds)  # [n, 5], alive until the launch ends
            cfg.regions, cfg.nregions = table.ctypes.data, len(table)
        _env.breadcrumb("CUPAGED_SIM_TRACE", self._describe(grid, block, shared_mem, staged, probe is not None))
        try:
            with _LAUNCH_LOCK:
                rc = launch(ctypes.byref(cfg), ptrs)
                err = lib.cupaged_sim_error().contents if rc else None
                if rc:
                    staged.repair()
                    raise self._error(rc, err, staged, shared_mem)
                if probe is not None:
                    probe.take_sites()  # the engine's table, which the next launch reuses
            staged.check_slack()
            if probe is not None:
                probe.record(lib, grid, block, shared_mem)
        finally:
            staged.finish()

    def _describe(self, grid, block, shared_mem, staged, profiled) -> str:
        """The launch in one line, for a crash report: what ran, and where its arrays were."""
        arrays = " ".join(f"{self.param_names[i]}=[{buf.valid[0]:#x},{buf.valid[1]:#x})"
                          for i, buf in sorted(staged.buffers.items()))
        return (f"{self.name} grid={grid} block={block} shared_mem={shared_mem} "
                f"build={'profiled' if profiled else 'plain'} module={self.module._label or 'inline source'} {arrays}")

    def _error(self, rc, err, staged, shared_mem):
        msg = err.msg.decode(errors="replace")
        where = ""
        if err.has_thread:
            where = f" in thread ({err.thread[0]},{err.thread[1]},{err.thread[2]})"
        where += f" of block ({err.block[0]},{err.block[1]},{err.block[2]})"
        if rc == 1 and (err.signo or err.fault_decoded == 3):
            msg = fault_message(err, staged, shared_mem)
        return _ERRORS.get(rc, SimError)(f"{self.name}: {msg}{where}")
