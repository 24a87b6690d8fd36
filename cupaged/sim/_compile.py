"""Compile a CUDA source into a sim shared object with g++, and cache it per user.

One translation unit: the unmodified source, force-included behind ``cupaged_sim.h``, followed by
generated ``extern "C"`` wrappers that take ``&NAME_EXPRESSION`` (so templated kernels work like
CuPy's name expressions). Every ``extern __shared__`` array is an undefined TLS symbol after
compiling; a generated assembly file defines each as an alias of one page-aligned TLS buffer, so
they share one base address as on the GPU. A source that may hold inline PTX (an ``asm`` keyword,
a quoted ``#include`` or a ``-I`` option) is preprocessed first and its asm statements rewritten
into emulations (the PTX layer, ``ptx/``); the result is compiled as preprocessed C++.

Objects live in the ``sim`` directory of the per-user cache (see ``_cache.py``), keyed by the
shim, the source, the options, the names and the compiler's identity; an object is cached only
after it has loaded, so a broken one is never served again.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile

from cupaged._cuda_paths import CudaNotFoundError, cuda_include_dirs
from cupaged._notice import compile_notice
from cupaged.sim import profiler, ptx
from cupaged.sim._cache import cache_dir, usable
from cupaged.sim._errors import SimCompileError
from cupaged.sim._smem import static_per_kernel
from cupaged.sim.ptx import _asm

INCLUDE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")
# The engine's headers first: its cooperative_groups.h, and the PTX layer's
# cuda_pipeline_primitives.h, are found ahead of NVIDIA's, which follow.
INCLUDE_DIRS = (INCLUDE_DIR, ptx.INCLUDE_DIR, profiler.INCLUDE_DIR)
DYN_SMEM_CAPACITY = 233472  # 228 KiB: above sm_90's 227 KiB opt-in maximum, a whole number of pages
CXXFLAGS = (
    "-std=c++17", "-O2", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off", "-fno-extern-tls-init",
    "-ftrivial-auto-var-init=pattern", "-fstack-clash-protection", "-fvisibility=hidden", "-w",
    "-fsanitize=alignment",  # every typed access checked; the handler is the engine's (no UBSan runtime)
)
# Every store calls the engine's check first (cupaged_sim_bounds.h; no ASan runtime is linked): a
# kernel writes only its arguments' arrays, shared memory, its stack and the module's own data.
# CUPAGED_SIM_BOUNDS=1 checks every load too, byte-exact: kernels run ~5x slower, a mode CI runs once.
BOUNDS_FLAGS = ("-fsanitize=address", "-fsanitize-recover=address", "--param=asan-instrumentation-with-call-threshold=0",
                "--param=asan-stack=0", "--param=asan-globals=0", "--param=asan-use-after-return=0",
                "-fno-sanitize-address-use-after-scope")
STORE_FLAGS = BOUNDS_FLAGS + ("--param=asan-instrument-reads=0",)
MIN_GCC = 12
# CUPAGED_SIM_FMA=1: contract a*b+c into hardware FMA, as the GPU's compiler does (436 fma.rn.f32 in
# one attention instantiation); the default keeps every product rounded (-ffp-contract=off).
FMA_FLAGS = ("-ffp-contract=fast", "-mfma")


def _switch(name: str) -> bool:
    value = os.environ.get(name, "0")
    if value not in ("0", "1"):
        raise SimCompileError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def bounds_checked() -> bool:
    """Whether CUPAGED_SIM_BOUNDS=1 asks for byte-exact bounds checks on every access."""
    return _switch("CUPAGED_SIM_BOUNDS")


# The profiler's build (cupaged.sim.profile()): every access calls the sim's __tsan_* entry points
# (not function entries and exits: nothing uses them), every basic block __sanitizer_cov_trace_pc
# (the blocks' warp-level executions weigh the cubin's: cupaged/sim/profiler/_instructions.py); -g1
# adds only the line tables, which map an instruction site or a block to its source line.
PROFILE_FLAGS = ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0", "-fsanitize-coverage=trace-pc",
                 "-g1", "-DCUPAGED_SIM_PROFILE=1")


_UNROLL = re.compile(r"^([ \t]*)#[ \t]*pragma[ \t]+unroll\b[ \t]*(\d*)[ \t]*$", re.M)


def profile_source(code: str) -> str:
    """The profiled build's source: each ``#pragma unroll`` that g++ can follow becomes GCC's, so the
    host unrolls the loops ptxas unrolls (the issued-instruction count weighs the cubin's blocks with
    the host's, cupaged/sim/profiler/_instructions.py). Counts that are expressions (``S::UNROLL``:
    GCC 12 takes only literals) stay as they are; lines keep their numbers."""
    return _UNROLL.sub(lambda m: f"{m.group(1)}#pragma GCC unroll {m.group(2) or 65534}", code)


def cxxflags(profile: bool = False) -> tuple[str, ...]:
    """The g++ flags of this process's sim builds (CUPAGED_SIM_FMA chooses the contraction,
    CUPAGED_SIM_BOUNDS the bounds instrumentation; ``profile``: the profiler's build instead)."""
    flags = CXXFLAGS + (PROFILE_FLAGS if profile else BOUNDS_FLAGS if bounds_checked() else STORE_FLAGS)
    if not _switch("CUPAGED_SIM_FMA"):
        return flags
    if not _cpu_has_fma():
        raise SimCompileError("CUPAGED_SIM_FMA=1 needs a CPU with FMA3 (x86-64 'fma' in /proc/cpuinfo); this one has none")
    return tuple(f for f in flags if not f.startswith("-ffp-contract")) + FMA_FLAGS


@functools.lru_cache(maxsize=None)
def _cpu_has_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " fma " in line + " " for line in f)
    except OSError:
        return False
_PASS_OPTION = re.compile(r"^(-D|-U|-I|-std=)")


def _output(cmd) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.stdout + r.stderr


@functools.lru_cache(maxsize=None)
def compiler() -> tuple[str, str]:
    """(path, identity) of the C++ compiler ($CXX or g++), which must be a g++ driver of GCC >= 12.

    The identity (resolved path, target triple, full ``--version`` text) keys the compile cache, so
    objects of two compilers never mix.
    """
    name = os.environ.get("CXX") or "g++"
    what = f"CXX={name}" if os.environ.get("CXX") else "g++"
    cxx = shutil.which(name)
    if cxx is None:
        raise SimCompileError(f"the sim backend needs g++ >= {MIN_GCC}: {what} is not on PATH "
                              "(e.g. apt-get install g++, or set CXX to a g++)")
    macros = dict(re.findall(r"^#define (\w+) (.*)$", _output([cxx, "-dM", "-E", "-x", "c++", os.devnull]), re.M))
    gnuc = int(macros.get("__GNUC__", "0"))
    if "__clang__" in macros or gnuc < MIN_GCC:
        found = "clang" if "__clang__" in macros else f"GCC {gnuc}" if gnuc else "not GCC"
        raise SimCompileError(f"the sim backend needs g++ >= {MIN_GCC}; {what} ({cxx}) is {found}")
    if "-lstdc++" not in _output([cxx, "-###", "-x", "c++", "-shared", os.devnull, "-o", os.devnull]):
        raise SimCompileError(f"{what} ({cxx}) is a C compiler driver: it does not link the C++ runtime, so the "
                              f"sim's modules would not load; set CXX to g++ (>= {MIN_GCC}) or unset it")
    identity = "\n".join([os.path.realpath(cxx), _output([cxx, "-dumpmachine"]), _output([cxx, "--version"])])
    return cxx, identity


@functools.lru_cache(maxsize=None)
def _shim_text() -> str:
    """For the cache key: every file of the sim's include directories (subdirectories too), the PTX
    layer's modules, whose translation is compiled into the objects, and _smem.py, whose per-kernel
    static shared memory is cached beside them."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.join(root, name) for d in INCLUDE_DIRS for root, dirs, files in sorted(os.walk(d))
             for name in sorted(files)]
    ptx_dir = os.path.dirname(ptx.__file__)
    paths += [os.path.join(ptx_dir, name) for name in sorted(os.listdir(ptx_dir)) if name.endswith(".py")]
    paths.append(os.path.join(here, "_smem.py"))
    parts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            parts.append(os.path.relpath(path, here) + "\n" + f.read())
    return "\n".join(parts)


def _wrappers(names) -> str:
    out = []
    for i, name in enumerate(names):
        out.append(
            f'extern "C" __attribute__((visibility("default"))) int cupaged_sim_launch_{i}('
            f"const cupaged_sim::LaunchConfig* c, void** a) {{ return cupaged_sim::launch(&{name}, c, a); }}\n"
            f'extern "C" __attribute__((visibility("default"))) const char* cupaged_sim_params_{i}() '
            f"{{ return cupaged_sim::param_codes(&{name}); }}\n")
    return "".join(out)


def _tls_symbols(cxx: str, obj: str) -> tuple[list[str], dict[str, int]]:
    """Undefined TLS symbols (extern __shared__ arrays) and the sizes of defined ones (static smem)."""
    readelf = shutil.which("readelf") or os.path.join(os.path.dirname(cxx), "readelf")
    out = subprocess.run([readelf, "-sW", obj], capture_output=True, text=True, check=True).stdout
    undefined, static = [], {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 8 and f[3] == "TLS":
            if f[6] == "UND":
                if f[7] != "__cupaged_dyn_smem":
                    undefined.append(f[7])
            else:
                static[f[7]] = int(f[2], 0)
    return undefined, static


def _smem_asm(aliases) -> str:
    lines = ['\t.section .tbss,"awT",@nobits', "\t.balign 4096",
             "\t.globl __cupaged_dyn_smem", "\t.hidden __cupaged_dyn_smem",
             "\t.type __cupaged_dyn_smem, @tls_object", f"\t.size __cupaged_dyn_smem, {DYN_SMEM_CAPACITY}",
             "__cupaged_dyn_smem:", f"\t.zero {DYN_SMEM_CAPACITY}"]
    for sym in aliases:
        lines += [f"\t.globl {sym}", f"\t.hidden {sym}", f"\t.type {sym}, @tls_object", f"\t.set {sym}, __cupaged_dyn_smem"]
    return "\n".join(lines) + '\n\t.section .note.GNU-stack,"",@progbits\n'


def _run(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SimCompileError(f"{what} failed ({' '.join(cmd[:1])} exit {r.returncode}):\n{r.stderr}{r.stdout}")


def build(code: str, options, names, label: str | None = None, profile: bool = False) -> tuple[ctypes.CDLL, dict[str, int], int]:
    """The loaded shared object for (code, options, names), from the cache or compiled now:
    (library, static shared bytes per kernel name, offset of the dynamic shared buffer in the
    module's TLS segment).

    A compile prints a notice on stderr naming ``label`` (default: the source's line count)."""
    cxx, identity = compiler()
    try:
        cuda_inc = list(cuda_include_dirs())
    except CudaNotFoundError as e:
        raise SimCompileError(str(e)) from None
    passed = [o for o in options if _PASS_OPTION.match(o)]
    code = profile_source(code) if profile else code
    key = hashlib.sha256("\0".join(
        [_shim_text(), code, *passed, "|", *names, "|", identity, *cxxflags(profile), *cuda_inc]).encode()).hexdigest()[:32]
    d = cache_dir("sim")
    so = os.path.join(d, key + ".so")
    meta = os.path.join(d, key + ".smem")
    if usable(so) and usable(meta):
        try:
            lib = _load(so)
        except OSError:  # e.g. a system library it needs changed since: build it again
            os.unlink(so)
        else:
            with open(meta) as f:
                saved = json.load(f)
            return lib, saved["static"], saved["dyn_offset"]
    label = label or f"a {len(code.splitlines())}-line CUDA source"
    with compile_notice(label, "the sim", os.path.basename(cxx), len(names)):
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            lib, static_smem, dyn_offset = _compile(cxx, tmp, code, passed, names, cuda_inc, profile)
            os.replace(os.path.join(tmp, "module.so"), so)
            os.replace(os.path.join(tmp, "smem"), meta)
    return lib, static_smem, dyn_offset


def _compile(cxx, tmp, code, passed, names, cuda_inc, profile=False):
    """Compile and link into ``tmp`` (module.so and smem) and load the object from there."""
    src = os.path.join(tmp, "kernel.cu")
    with open(src, "w", encoding="utf-8") as f:
        f.write(code + "\n\n// ---- generated launch wrappers\n" + _wrappers(names))
    flags = [*cxxflags(profile), *passed, f"-DCUPAGED_SIM_DYN_SMEM={DYN_SMEM_CAPACITY}ull",
             *(f"-I{i}" for i in (*INCLUDE_DIRS, *cuda_inc)), "-include", "cupaged_sim.h"]
    obj = os.path.join(tmp, "kernel.o")
    if _asm.has_asm(code, passed):  # inline PTX: preprocess, rewrite each asm statement, compile the result
        pre = os.path.join(tmp, "kernel.ii")
        _run([cxx, *flags, "-x", "c++", "-E", src, "-o", pre], "preprocessing the kernel source for the sim")
        with open(pre, encoding="utf-8") as f:
            text = _asm.rewrite(f.read(), src, [*INCLUDE_DIRS, *cuda_inc])
        src = os.path.join(tmp, "kernel.sim.ii")
        with open(src, "w", encoding="utf-8") as f:
            f.write(text)
        flags = flags[:-2]  # the shim is already in the preprocessed text
        _run([cxx, *flags, "-x", "c++-cpp-output", "-c", src, "-o", obj], "compiling the kernel source for the sim")
    else:
        _run([cxx, *flags, "-x", "c++", "-c", src, "-o", obj], "compiling the kernel source for the sim")
    aliases, symbols = _tls_symbols(cxx, obj)
    static_smem = {} if profile else static_per_kernel(symbols, names, code)  # the plain build's serve both
    asm = os.path.join(tmp, "smem.s")
    with open(asm, "w") as f:
        f.write(_smem_asm(aliases))
    out = os.path.join(tmp, "module.so")
    _run([cxx, "-shared", "-o", out, obj, asm, "-ldl"], "linking the sim module")
    dyn_offset = _dyn_offset(out)
    with open(os.path.join(tmp, "smem"), "w") as f:
        json.dump({"static": static_smem, "dyn_offset": dyn_offset}, f)
    # The linker and open() honour the umask; a group-writable object would be deleted by
    # usable() at the next lookup (under umask 002 the cache never hit): set the modes here.
    os.chmod(out, 0o700)
    os.chmod(os.path.join(tmp, "smem"), 0o600)
    try:
        lib = _load(out)
    except OSError as e:
        raise SimCompileError(f"the sim module linked by {cxx} does not load, so it was not cached: {e}") from None
    return lib, static_smem, dyn_offset


def _load(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path, mode=os.RTLD_LOCAL)


def _dyn_offset(so: str) -> int:
    """st_value of a TLS symbol is its offset in the module's TLS segment."""
    out = subprocess.run([shutil.which("readelf") or "readelf", "-sW", so], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        f = line.split()
        if len(f) >= 8 and f[3] == "TLS" and f[7] == "__cupaged_dyn_smem":
            return int(f[1], 16)
    raise SimCompileError(f"{so}: the dynamic shared memory symbol is missing")
