"""A minimal ctypes binding to NVRTC: source string -> cubin (and its PTX), without a GPU or a driver.

CuPy's compile paths want a device and its ``getCUBIN`` returns the cubin one byte short, so the
compile gate and the resource report call NVRTC directly. Only a real architecture (``sm_80``,
``sm_90``, the arch-specific ``sm_90a``, ...) is accepted: the point is to run ptxas and get machine
code; the PTX ptxas assembled comes back beside it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import os
import re

from cupaged._cuda_paths import cuda_include_dirs, nvrtc_library

__all__ = ["NvrtcError", "CompiledProgram", "compile_cubin", "version"]

_REAL_ARCH = re.compile(r"sm_\d+[af]?")


class NvrtcError(RuntimeError):
    """NVRTC failed; ``log`` holds the compiler's program log (empty when there was none)."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message, log)  # both in args, so the error pickles across processes
        self.message, self.log = message, log

    def __str__(self) -> str:
        return f"{self.message}\n{self.log}".rstrip()


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One NVRTC compile: the cubin, name expression -> mangled name, and the program log."""

    cubin: bytes
    lowered_names: dict[str, str]
    log: str
    ptx: str = ""  # what ptxas assembled: setmaxnreg's immediates are read from it (_resource_cache.py)


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    """Load libnvrtc, preloading its builtins library from the same directory.

    libnvrtc dlopen()s ``libnvrtc-builtins.so.<major>.<minor>`` by soname at compile time; the pip
    wheel's directory is not on the loader path, so load it first, globally, by full path.
    """
    path = nvrtc_library()
    major = os.path.basename(path).partition(".so.")[2].split(".")[0]
    pattern = f"libnvrtc-builtins.so.{major}*" if major else "libnvrtc-builtins.so*"
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), pattern)))[:1]:
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(path)
    p, pp, cp, sz = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t
    cpp = ctypes.POINTER(ctypes.c_char_p)
    signatures = {
        "nvrtcVersion": [ctypes.POINTER(ctypes.c_int)] * 2,
        "nvrtcCreateProgram": [pp, cp, cp, ctypes.c_int, cpp, cpp],
        "nvrtcDestroyProgram": [pp],
        "nvrtcAddNameExpression": [p, cp],
        "nvrtcCompileProgram": [p, ctypes.c_int, cpp],
        "nvrtcGetProgramLogSize": [p, ctypes.POINTER(sz)],
        "nvrtcGetProgramLog": [p, ctypes.c_char_p],
        "nvrtcGetCUBINSize": [p, ctypes.POINTER(sz)],
        "nvrtcGetCUBIN": [p, ctypes.c_char_p],
        "nvrtcGetPTXSize": [p, ctypes.POINTER(sz)],
        "nvrtcGetPTX": [p, ctypes.c_char_p],
        "nvrtcGetLoweredName": [p, cp, cpp],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [ctypes.c_int], cp
    return lib


def _check(result: int, what: str, log: str = "") -> None:
    if result != 0:
        reason = _lib().nvrtcGetErrorString(result).decode()
        raise NvrtcError(f"{what}: {reason}", log)


def version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_lib().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _log(prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    _check(_lib().nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
    buf = ctypes.create_string_buffer(size.value)
    _check(_lib().nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return buf.value.decode(errors="replace")


def compile_cubin(source: str, *, arch: str = "sm_90", options=(), name_expressions=(),
                  filename: str = "kernel.cu") -> CompiledProgram:
    """Compile ``source`` for the real architecture ``arch`` and return its cubin.

    ``-arch`` and ``-I`` for the CUDA headers (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h and CCCL) are
    added here; ``options`` are passed through (e.g. ``-std=c++17``, ``-Xptxas=-v``). Each name
    expression (``ns::kernel<__half, 128>``) is instantiated and its mangled name returned.
    Raises :class:`NvrtcError` carrying the log when compilation fails.
    """
    if not _REAL_ARCH.fullmatch(arch):
        raise ValueError(f"arch must be a real architecture like 'sm_90', got {arch!r}")
    name_expressions, options = tuple(name_expressions), tuple(options)
    lib = _lib()
    argv = [f"-arch={arch}", *options, *(f"-I{d}" for d in cuda_include_dirs())]
    c_argv = (ctypes.c_char_p * len(argv))(*(a.encode() for a in argv))
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        for name in name_expressions:
            _check(lib.nvrtcAddNameExpression(prog, name.encode()), f"nvrtcAddNameExpression({name})")
        result = lib.nvrtcCompileProgram(prog, len(argv), c_argv)
        log = _log(prog)
        _check(result, f"{filename} for {arch} (options: {' '.join(options)})", log)
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize", log)
        buf = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN", log)
        ptx_size = ctypes.c_size_t()
        _check(lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size)), "nvrtcGetPTXSize", log)
        ptx = ctypes.create_string_buffer(ptx_size.value)
        _check(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX", log)
        lowered = {}
        for name in name_expressions:
            mangled = ctypes.c_char_p()
            _check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(mangled)),
                   f"nvrtcGetLoweredName({name})", log)
            lowered[name] = mangled.value.decode()
        return CompiledProgram(cubin=buf.raw[: size.value], lowered_names=lowered, log=log,
                               ptx=ptx.value.decode(errors="replace"))
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
