"""ptxas's statistics of a kernel (registers, spills, static shared memory, stack) and their
per-user cache: the compile gate's records (cupaged/resources.py) and the occupancy of the sim's
H200 model (cupaged/sim/profiler/_launch_model.py).

The numbers are ptxas's own: NVRTC 13 passes ``-Xptxas=-v`` through and ptxas's verbose report
lands in the program log. (The cubin's ``.nv.info.<kernel>`` sections carry the register count but
no spill counts, so the log is the only real source for those.) ptxas lists, after each entry
function, the non-inlined device functions it calls; their spills are charged to that kernel.
A Hopper kernel's ``setmaxnreg.dec/.inc`` immediates, the registers per thread each warpgroup role
keeps after it, come from the PTX ptxas assembled (its own and those of the functions it calls),
beside ptxas's count at launch. ptxas ignores setmaxnreg where it cannot tell the register count at
entry (no ``__launch_bounds__`` / ``__maxnreg__``, or setmaxnreg in a called function; always under
``-G``) and says so only in the log, unattributed: such a kernel is marked ``setmaxnreg_ignored``.

Results are cached per (family, arch) in the ``resources`` directory of the per-user cache
(``cupaged/sim/_cache.py``), keyed by the source, options, name expressions, arch, the NVRTC
version, its header directories and the text of the modules that compile and parse (_nvrtc.py,
this one). It imports neither the compile gate nor the kernel runtime, so the sim's profiler uses
it without an import cycle.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re

from cupaged import _nvrtc
from cupaged._cuda_paths import cuda_include_dirs
from cupaged.sim._cache import cache_dir, usable, write_private

__all__ = ["KernelResources", "compile_resources", "cached_resources", "cache_path", "load", "store"]


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """ptxas's statistics for one kernel compiled for one architecture (sizes in bytes)."""

    family: str
    name_expression: str  # as launched; the mangled name for a kernel no name expression names
    arch: str
    registers: int        # per thread
    spill_stores: int     # the kernel and the device functions it calls
    spill_loads: int
    shared_bytes: int     # static __shared__ only; dynamic shared memory is a launch parameter
    stack_bytes: int      # local memory per thread, callees included: local arrays and spills
    mangled_name: str
    setmaxnreg: tuple = ()         # ("dec 40", "inc 232"): registers per thread after each setmaxnreg, in order
    setmaxnreg_ignored: bool = False  # ptxas dropped them (the log's C7505 / C7508): no register split

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


_ENTRY = re.compile(r"^ptxas info\s*: Compiling entry function '([^']+)' for '(\w+)'", re.M)
_PROPERTIES = re.compile(r"Function properties for (\S+)\s*\n\s*ptxas\s*\.\s*(\d+) bytes stack frame, "
                         r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")
_CUMULATIVE_STACK = re.compile(r"(\d+) bytes cumulative stack size")


def _parse_ptxas_log(log: str, arch: str) -> dict[str, tuple[int, int, int, int, int]]:
    """mangled kernel name -> (registers, spill stores, spill loads, static smem, stack)."""
    parts = _ENTRY.split(log)
    stats = {}
    for name, entry_arch, block in zip(parts[1::3], parts[2::3], parts[3::3]):
        if entry_arch != arch:
            raise RuntimeError(f"ptxas compiled {name} for {entry_arch}, expected {arch}")
        functions = {fn: tuple(map(int, rest)) for fn, *rest in _PROPERTIES.findall(block)}
        registers = _REGISTERS.search(block)
        if name not in functions or registers is None:
            raise RuntimeError(f"cannot parse the ptxas report for {name} ({arch}):\n{block}")
        shared = _SHARED.search(block)
        stack = _CUMULATIVE_STACK.search(block)
        stats[name] = (
            int(registers.group(1)),
            sum(f[1] for f in functions.values()),
            sum(f[2] for f in functions.values()),
            int(shared.group(1)) if shared else 0,  # sm_90's report omits a zero smem
            int(stack.group(1)) if stack else functions[name][0],
        )
    return stats


_PTX_FUNCTION = re.compile(r"^[ \t]*(?:\.(?:visible|weak|extern)\s+)*\.(entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)",
                           re.M)
_SETMAXNREG = re.compile(r"\bsetmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")
_CALL = re.compile(r"\bcall(?:\.uni)?\s+(?:\([^)]*\)\s*,\s*)?([\w$]+)")
_BOUNDS = re.compile(r"^\s*\.(?:maxntid|maxnreg)\b", re.M)


def _setmaxnreg(ptx: str, log: str) -> dict[str, tuple[tuple, bool]]:
    """kernel (mangled) -> (its setmaxnreg immediates in PTX order, ignored by ptxas), for kernels that
    have any. Ignored: where ptxas said so, a kernel it cannot have known the entry count of (no
    .maxntid / .maxnreg, or setmaxnreg in a callee); every such kernel when none of them is that."""
    parts = _PTX_FUNCTION.split(ptx)
    bodies: dict[str, str] = {}
    entries = []
    for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3]):  # a declaration, then the definition
        bodies[name] = bodies.get(name, "") + body
        entries += [name] if kind == "entry" else []
    found, suspects = {}, set()
    for name in dict.fromkeys(entries):
        body = bodies[name]
        own, seen, todo, called = _SETMAXNREG.findall(body), {name}, _CALL.findall(body), []
        while todo:
            callee = todo.pop()
            if callee not in seen and callee in bodies:
                seen.add(callee)
                called += _SETMAXNREG.findall(bodies[callee])
                todo += _CALL.findall(bodies[callee])
        if own or called:
            found[name] = tuple(dict.fromkeys(f"{op} {n}" for op, n in own + called))
            if called or not _BOUNDS.search(body.partition("{")[0]):
                suspects.add(name)
    ignored = "'setmaxnreg' ignored" in log
    return {name: (values, ignored and (name in suspects or not suspects)) for name, values in found.items()}


def compile_resources(source: str, name_expressions, arch: str, options=("-std=c++17",),
                      family: str = "source") -> list[KernelResources]:
    """Compile ``source`` for ``arch`` and return ptxas's statistics for every kernel in it.

    Kernels named by ``name_expressions`` come first, in that order. Raises
    :class:`~cupaged._nvrtc.NvrtcError` (with the log) when the source does not compile.
    """
    names = tuple(name_expressions)
    program = _nvrtc.compile_cubin(source, arch=arch, options=(*options, "-Xptxas=-v"),
                                   name_expressions=names, filename=f"{family}.cu")
    stats = _parse_ptxas_log(program.log, arch)
    missing = [n for n, m in program.lowered_names.items() if m not in stats]
    if missing:
        raise RuntimeError(f"ptxas reported nothing for {missing} ({arch}); log:\n{program.log}")
    by_mangled = {m: n for n, m in program.lowered_names.items()}
    order = {n: i for i, n in enumerate(names)}
    regs = _setmaxnreg(program.ptx, program.log)
    records = [KernelResources(family, by_mangled.get(m, m), arch, *s, mangled_name=m,
                               setmaxnreg=regs.get(m, ((), False))[0], setmaxnreg_ignored=regs.get(m, ((), False))[1])
               for m, s in stats.items()]
    return sorted(records, key=lambda r: (order.get(r.name_expression, len(order)), r.name_expression))


@functools.lru_cache(maxsize=None)
def _code_version() -> str:
    paths = (_nvrtc.__file__, __file__)
    text = "".join(open(path, encoding="utf-8").read() for path in paths)
    return hashlib.sha256(text.encode()).hexdigest()


def cache_path(stem, source, names, options, arch) -> str:
    key = "\0".join([source, *options, "|", *names, "|", arch, repr(_nvrtc.version()), *cuda_include_dirs(),
                     _code_version()])
    return os.path.join(cache_dir("resources"), f"{stem}-{arch}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json")


def load(path):
    """Cached records, or None (missing, not ours, or unreadable: then recompiled and replaced)."""
    if not usable(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return [KernelResources(**{**r, "setmaxnreg": tuple(r.get("setmaxnreg", ()))}) for r in json.load(f)]
    except (ValueError, TypeError, AttributeError):
        return None


def store(path, records) -> None:
    write_private(path, json.dumps([dataclasses.asdict(r) for r in records]).encode())


def cached_resources(stem, source, names, options, arch) -> list[KernelResources]:
    """compile_resources, from the cache when it holds the result (stored there when it did not)."""
    path = cache_path(stem, source, tuple(names), tuple(options), arch)
    records = load(path)
    if records is None:
        records = compile_resources(source, names, arch, tuple(options), stem)
        store(path, records)
    return records
