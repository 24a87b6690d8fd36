"""A launched kernel's SASS as basic blocks, for the issued-instruction count (``_instructions.py``).

The truth is the kernel's own cubin for the H200 model's sm_90a (for code without wgmma the same as
sm_90's): NVRTC compiles the launch's source with its options plus
``-lineinfo`` (line tables only: the code is the same) and ``nvdisasm -c -g`` disassembles it, each
instruction with its source line. The blocks are the kernel's control-flow graph as a warp can run it:
- ``BRA.DIV`` (a collective's test for a diverged warp) never branches: the sim's warps reach every
  collective converged, so ptxas's fallback for a partial warp (``WARPSYNC.COLLECTIVE`` ...) never runs;
- a call of one of CUDA's ``*_slowpath`` subroutines (fp32 division and reciprocal with operands out of
  the fast path's range: denormals, infinities) never happens, and the subroutines never run;
- a call of another of CUDA's internal subroutines (64-bit integer division) runs a copy of it made
  for that call, which returns to the call (its blocks carry no kernel line: the fit runs them along
  their cheapest path);
- blocks no path from the entry reaches (the padding after the last ``EXIT``) never run.
A kernel that calls a function of its own is not supported (:class:`SassError`).

``nvdisasm`` comes from NVIDIA's wheel ``nvidia-cuda-nvdisasm`` (the ``profiling`` extra, pinned to the
NVRTC wheel's CUDA major), else from ``$CUDA_HOME``/``PATH``. The parsed blocks are cached in the
per-user cache per (source, options, kernel, arch, NVRTC, nvdisasm, this module).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess

from cupaged import _nvrtc
from cupaged._cuda_paths import _nvidia_dirs, _toolkit_roots, cuda_include_dirs
from cupaged.sim._cache import cache_dir, usable, write_private

__all__ = ["SassBlock", "SassError", "nvdisasm", "kernel_blocks", "opcode_class", "CLASSES"]

CLASSES = ("mma", "fp32", "mufu", "memory", "int_control")
_MMA = ("HMMA", "IMMA", "DMMA", "BMMA", "HGMMA", "QGMMA", "IGMMA", "BGMMA", "OMMA", "QMMA", "UTCHMMA", "UTCQMMA")
_FP32 = ("FFMA", "FADD", "FMUL", "FMNMX", "FSETP", "FSET", "FSEL", "FCHK", "FRND", "FSWZADD", "FMNMX3", "FADD2",
         "FFMA2", "FMUL2", "HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "HSET2")
_MEMORY = ("LDG", "STG", "LDS", "STS", "LD", "ST", "LDL", "STL", "LDC", "ULDC", "LDGSTS", "LDSM", "STSM", "ATOM",
           "ATOMS", "ATOMG", "RED", "REDG", "REDAS", "UBLKCP", "UBLKRED", "UBLKPF", "UTMALDG", "UTMASTG", "UTMAPF",
           "UTMAREDG", "UTMACCTL", "CCTL", "LDTRAM", "SUST", "SULD", "SUATOM", "TLD", "TEX", "TLD4", "TXQ", "SYNCS",
           "ARRIVES")


def opcode_class(opcode: str) -> str:
    """mma (HMMA and the wgmma GMMA family: HGMMA for 16-bit inputs, QGMMA for fp8, IGMMA, BGMMA), fp32 (FP
    arithmetic and compares, half2 included), mufu, memory (loads, stores, async copies, the bulk and tensor
    copies UBLKCP / UTMALDG / UTMASTG / UTMAPF / UTMACCTL, atomics, and the mbarrier operations SYNCS.* and
    ARRIVES.*, which live in shared memory), or int_control (the rest: WARPGROUP.ARRIVE / DEPBAR, which order
    GMMA work as BAR and DEPBAR do, among them). Each is one warp instruction: the model's issue term prices all
    alike, its mma and byte terms the work behind them."""
    base = opcode.split(".")[0]
    if base in _MMA:
        return "mma"
    if base == "MUFU":
        return "mufu"
    if base in _FP32:
        return "fp32"
    return "memory" if base in _MEMORY else "int_control"


class SassError(RuntimeError):
    """The kernel's SASS has a construct the count does not support."""


@dataclasses.dataclass(frozen=True)
class SassBlock:
    """One basic block: its instructions' opcodes and source lines (an int: a line of the module's
    code; ``"path:line"``: another file; None: no line table entry), the blocks a warp may go to next
    (indices), whether a warp may leave the kernel in it, whether it never runs (see above), and whether
    it is a point where a diverged warp reconverges (a ``BSSY`` target: ``reconverges`` lists the blocks
    whose ``BSSY`` names it)."""

    start: int
    opcodes: tuple
    lines: tuple
    succs: tuple
    exits: bool
    never: bool
    reconverges: tuple = ()


@functools.lru_cache(maxsize=None)
def nvdisasm() -> str | None:
    """The nvdisasm executable, or None."""
    for base in _nvidia_dirs():
        found = sorted(glob.glob(os.path.join(base, "cu1[0-9]", "bin", "nvdisasm")), reverse=True)
        found += glob.glob(os.path.join(base, "cuda_nvdisasm", "bin", "nvdisasm"))
        if found:
            return found[0]
    for root in _toolkit_roots():
        if os.access(os.path.join(root, "bin", "nvdisasm"), os.X_OK):
            return os.path.join(root, "bin", "nvdisasm")
    return shutil.which("nvdisasm")


_SECTION = re.compile(r"^//-+ \.text\.(\S+)")
_FILE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^([.$\w]+):\s*$")
_FUNCTION = re.compile(r"^\s*\.type\s+([^,\s]+),@function")
# an opcode is capitals, digits and dots, but for a GMMA's shape: HGMMA.64x128x16.F32.BF16
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?"
                          r"([A-Z][A-Z0-9_.]*(?:x[0-9]+)*[A-Z0-9_.]*)\s*(.*?)\s*;")
_TARGET = re.compile(r"`\(([^)]+)\)")


def _line_key(path: str, line: int):
    return line if os.path.basename(path) == "kernel.cu" else f"{path}:{line}"


def _parse(text: str, mangled: str) -> tuple[list, dict, dict]:
    """(instructions, label -> index, function name -> first index) of the kernel's section: each
    instruction (offset, predicated, opcode, operands, line)."""
    ins, labels, functions, inside, line = [], {}, {}, False, None
    for row in text.splitlines():
        if (m := _SECTION.match(row)) is not None:
            inside = m.group(1) == mangled
            continue
        if not inside:
            continue
        if (m := _FILE.match(row)) is not None:
            line = _line_key(m.group(1), int(m.group(2)))
        elif (m := _FUNCTION.match(row)) is not None:
            functions[m.group(1)] = len(ins)
            line = None  # a subroutine's code has no line of the kernel's until one is printed
        elif (m := _LABEL.match(row.strip())) is not None:
            labels[m.group(1)] = len(ins)
        elif (m := _INSTRUCTION.match(row)) is not None:
            ins.append((int(m.group(1), 16), m.group(2) is not None, m.group(3), m.group(4), line))
    if not ins:
        raise SassError(f"nvdisasm printed no code for {mangled}")
    return ins, labels, functions


_ENDS = ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL", "KILL", "BPT")


def _inline_call(raw, rets, calls, entry: int, back: tuple) -> int:
    """Append a copy of the subroutine whose entry block is ``entry`` (its RET blocks going on to
    ``back``, the call's next block) to ``raw``; the copy's entry."""
    body, stack = [], [entry]
    while stack:
        k = stack.pop()
        if k in body:
            continue
        if k in calls:
            raise SassError("a subroutine that calls another is not supported")
        body.append(k)
        stack += raw[k][2]
    new = {k: len(raw) + i for i, k in enumerate(body)}
    for k in body:
        s, e, succs, exits, _ = raw[k]
        raw.append([s, e, back if k in rets else tuple(new[t] for t in succs), exits, False])
    return new[entry]


def _blocks(ins, labels, functions, mangled) -> list[SassBlock]:
    kernel_end = min([i for name, i in functions.items() if name != mangled] + [len(ins)])
    leaders = {0} | {i for i in labels.values() if i < len(ins)}
    for i, (_, _, op, _, _) in enumerate(ins):
        if op.split(".")[0] in _ENDS and i + 1 < len(ins):
            leaders.add(i + 1)
    starts = sorted(leaders)
    index = {s: k for k, s in enumerate(starts)}
    raw, rets, calls = [], set(), {}
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else len(ins)
        _, predicated, op, operands, _ = ins[e - 1]
        base, succs, exits, never = op.split(".")[0], [], False, s >= kernel_end
        targets = [labels[t] for t in _TARGET.findall(operands) + re.findall(r"\.L_x_\d+", operands) if t in labels]
        falls = e < len(ins)
        if base in ("BRA", "BRX", "JMP", "JMX"):
            if op.startswith("BRA.DIV"):
                succs = [e] if falls else []
            else:
                succs = sorted(set(targets)) + ([e] if (predicated or base in ("BRX", "JMX")) and falls else [])
        elif base in ("EXIT", "KILL"):
            exits = True
            succs = [e] if predicated and falls else []
        elif base in ("RET", "BPT"):
            succs = []
            if base == "RET":
                rets.add(k)
        elif base == "CALL":
            callee = _TARGET.search(operands)
            name = callee.group(1) if callee else ""
            if name.endswith("_slowpath"):
                never = True
            elif name in functions and not never:
                calls[k] = index[functions[name]]
            elif not never:
                raise SassError(f"{mangled} calls {operands}: only CUDA's internal subroutines are supported")
            succs = [e] if falls else []
        elif falls:
            succs = [e]
        raw.append([s, e, tuple(index[t] for t in succs if t in index), exits, never])
    for k, entry in calls.items():  # each call runs its own copy of the subroutine, which returns to it
        raw[k][2] = (_inline_call(raw, rets, calls, entry, raw[k][2]),)
    block_of = {}
    for k, (s, e, *_) in enumerate(raw[:len(starts)]):
        block_of.update(dict.fromkeys(range(s, e), k))
    bssy = collections.defaultdict(list)  # target's first instruction -> blocks whose BSSY names it
    for i, (_, _, op, operands, _) in enumerate(ins):
        for t in _TARGET.findall(operands) if op.startswith("BSSY") else ():
            if t in labels:
                bssy[labels[t]].append(block_of[i])
    reach, stack = set(), [0]
    while stack:  # blocks reachable from the entry through blocks that run
        k = stack.pop()
        if k in reach or raw[k][4]:
            continue
        reach.add(k)
        stack += raw[k][2]
    return [SassBlock(ins[s][0], tuple(x[2] for x in ins[s:e]), tuple(x[4] for x in ins[s:e]), tuple(succs), exits,
                      never or k not in reach, tuple(bssy.get(s, ()) if k < len(starts) else ()))
            for k, (s, e, succs, exits, never) in enumerate(raw)]


def _cache_path(source, options, kernel, arch, tool) -> str:
    with open(__file__, encoding="utf-8") as f:
        code = f.read()
    stat = os.stat(tool)
    key = "\0".join([source, *options, "|", kernel, arch, repr(_nvrtc.version()), *cuda_include_dirs(), tool,
                     str(stat.st_size), str(stat.st_mtime_ns), code])
    return os.path.join(cache_dir("sass"), hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def kernel_blocks(source: str, options, kernel: str, arch: str = "sm_90") -> list[SassBlock]:
    """The basic blocks of kernel ``kernel`` (a name expression) compiled from ``source`` with ``options``
    for ``arch``. Raises RuntimeError when nvdisasm is missing, SassError on unsupported code."""
    tool = nvdisasm()
    if tool is None:
        raise RuntimeError("nvdisasm not found: install cupaged[profiling] (nvidia-cuda-nvdisasm)")
    options = tuple(options) + (() if "-lineinfo" in options else ("-lineinfo",))
    path = _cache_path(source, options, kernel, arch, tool)
    if usable(path):
        try:
            with open(path, encoding="utf-8") as f:
                return [SassBlock(b[0], tuple(b[1]), tuple(b[2]), tuple(b[3]), b[4], b[5], tuple(b[6]))
                        for b in json.load(f)]
        except (ValueError, TypeError, IndexError):
            pass
    program = _nvrtc.compile_cubin(source, arch=arch, options=options, name_expressions=(kernel,))
    mangled = program.lowered_names[kernel]
    work = cache_dir("sass")
    cubin = os.path.join(work, f"{os.getpid()}.cubin")
    with open(cubin, "wb") as f:
        f.write(program.cubin)
    try:
        text = subprocess.run([tool, "-c", "-g", cubin], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(cubin)
    blocks = _blocks(*_parse(text, mangled), mangled)
    write_private(path, json.dumps([dataclasses.astuple(b) for b in blocks]).encode())
    return blocks
