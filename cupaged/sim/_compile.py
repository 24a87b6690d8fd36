"""Compile a CUDA source into a sim shared object with g++, and cache it per user.

One translation unit: the unmodified source, force-included behind ``cupaged_sim.h``, followed by
generated ``extern "C"`` wrappers that take ``&NAME_EXPRESSION`` (so templated kernels work like
CuPy's name expressions). Every ``extern __shared__`` array is an undefined TLS symbol after
compiling; a generated assembly file defines each as an alias of one page-aligned TLS buffer, so
they share one base address as on the GPU.

The cache (``$CUPAGED_CACHE_DIR``, else ``$XDG_CACHE_HOME/cupaged``, else ``~/.cache/cupaged``)
holds code this process will load: the directory is created 0700, must be owned by the current
user and not writable by others, objects are written to a temp file and renamed into place, and a
file not owned by the current user is never loaded.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

from cupaged._cuda_paths import CudaNotFoundError, cuda_include_dirs
from cupaged.sim._errors import SimCompileError

INCLUDE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")
DYN_SMEM_CAPACITY = 233472  # 228 KiB: above sm_90's 227 KiB opt-in maximum, a whole number of pages
CXXFLAGS = (
    "-std=c++17", "-O2", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off", "-fno-extern-tls-init",
    "-ftrivial-auto-var-init=pattern", "-fstack-clash-protection", "-fvisibility=hidden", "-w",
)
_PASS_OPTION = re.compile(r"^(-D|-U|-I|-std=)")


def cache_dir() -> str:
    root = os.environ.get("CUPAGED_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "cupaged")
    path = os.path.join(root, "sim")
    # os.makedirs applies `mode` to the leaf only: the root it creates got 0777 & ~umask, which under
    # a umask of 002 is group-writable, and the check below then refused the cache it had just made.
    os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
    for d in (root, path):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    for d in (root, path):
        st = os.stat(d)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise SimCompileError(
                f"refusing to use the compile cache {d}: it must be owned by uid {os.getuid()} and "
                "not writable by group or others (set CUPAGED_CACHE_DIR to a private directory)")
    return path


@functools.lru_cache(maxsize=None)
def compiler() -> tuple[str, str]:
    """(path, version) of the C++ compiler ($CXX or g++), which must be g++ >= 12."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise SimCompileError("the sim backend needs g++ >= 12 on PATH (e.g. apt-get install g++)")
    version = subprocess.run([cxx, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < 12:
        raise SimCompileError(f"the sim backend needs g++ >= 12; {cxx} is version {version or 'unknown'}")
    return cxx, version


@functools.lru_cache(maxsize=None)
def _shim_text() -> str:
    parts = []
    for name in sorted(os.listdir(INCLUDE_DIR)):
        with open(os.path.join(INCLUDE_DIR, name), encoding="utf-8") as f:
            parts.append(name + "\n" + f.read())
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


def _tls_symbols(cxx: str, obj: str) -> tuple[list[str], int]:
    """Undefined TLS symbols (extern __shared__ arrays) and total size of defined ones (static smem)."""
    readelf = shutil.which("readelf") or os.path.join(os.path.dirname(cxx), "readelf")
    out = subprocess.run([readelf, "-sW", obj], capture_output=True, text=True, check=True).stdout
    undefined, static = [], 0
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 8 and f[3] == "TLS":
            if f[6] == "UND":
                if f[7] != "__cupaged_dyn_smem":
                    undefined.append(f[7])
            else:
                static += int(f[2], 0)
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


def build(code: str, options, names) -> tuple[str, int, int]:
    """Cached shared object for (code, options, names): (path, static shared bytes, offset of the
    dynamic shared buffer in the module's TLS segment)."""
    cxx, version = compiler()
    try:
        cuda_inc = list(cuda_include_dirs())
    except CudaNotFoundError as e:
        raise SimCompileError(str(e)) from None
    passed = [o for o in options if _PASS_OPTION.match(o)]
    key = hashlib.sha256("\0".join(
        [_shim_text(), code, *passed, "|", *names, "|", version, *CXXFLAGS, *cuda_inc]).encode()).hexdigest()[:32]
    d = cache_dir()
    so = os.path.join(d, key + ".so")
    meta = os.path.join(d, key + ".smem")
    if _usable(so) and _usable(meta):
        with open(meta) as f:
            static_smem, dyn_offset = (int(x) for x in f.read().split())
        return so, static_smem, dyn_offset
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        src = os.path.join(tmp, "kernel.cu")
        with open(src, "w", encoding="utf-8") as f:
            f.write(code + "\n\n// ---- generated launch wrappers\n" + _wrappers(names))
        flags = [*CXXFLAGS, *passed, f"-DCUPAGED_SIM_DYN_SMEM={DYN_SMEM_CAPACITY}ull", f"-I{INCLUDE_DIR}",
                 *(f"-I{i}" for i in cuda_inc), "-include", "cupaged_sim.h"]
        obj = os.path.join(tmp, "kernel.o")
        _run([cxx, *flags, "-x", "c++", "-c", src, "-o", obj], "compiling the kernel source for the sim")
        aliases, static_smem = _tls_symbols(cxx, obj)
        asm = os.path.join(tmp, "smem.s")
        with open(asm, "w") as f:
            f.write(_smem_asm(aliases))
        out = os.path.join(tmp, "module.so")
        _run([cxx, "-shared", "-o", out, obj, asm, "-ldl"], "linking the sim module")
        dyn_offset = _dyn_offset(out)
        with open(os.path.join(tmp, "smem"), "w") as f:
            f.write(f"{static_smem} {dyn_offset}")
        # The linker and open() honour the umask; a group-writable object would be deleted by
        # _usable() at the next lookup (under umask 002 the cache never hit): set the modes here.
        os.chmod(out, 0o700)
        os.chmod(os.path.join(tmp, "smem"), 0o600)
        os.replace(out, so)
        os.replace(os.path.join(tmp, "smem"), meta)
    return so, static_smem, dyn_offset


def _dyn_offset(so: str) -> int:
    """st_value of a TLS symbol is its offset in the module's TLS segment."""
    out = subprocess.run([shutil.which("readelf") or "readelf", "-sW", so], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        f = line.split()
        if len(f) >= 8 and f[3] == "TLS" and f[7] == "__cupaged_dyn_smem":
            return int(f[1], 16)
    raise SimCompileError(f"{so}: the dynamic shared memory symbol is missing")


def _usable(path: str) -> bool:
    """Exists and is ours; a file of another user is deleted (it lives in our 0700 directory)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        os.unlink(path)
        return False
    return True
