"""The warp-level SASS instructions a profiled sim launch issues on an H200 (``Launch.warp_instructions``):
its sm_90a code (the model GPU's ``arch``; wgmma needs sm_90a, and a kernel without it has sm_90's SASS).

Two facts are combined. The SASS: the kernel's own cubin as basic blocks (``_sass.py``), each
instruction with its source line. The run: the profiled build (``-fsanitize-coverage=trace-pc``) counts
how often each warp ran each of g++'s basic blocks, under SIMT rules (cupaged_sim_profile.h), and each
host block's source lines are read from the line tables (``_host_blocks.py``); a line's ``N`` is the
most of its host blocks' counts. The profiled build unrolls the loops under ``#pragma unroll`` as
ptxas does.

The SASS blocks' executions are fitted to the run by a linear program (``_block_fit.py``: the
control-flow rules of a warp, and the lines' counts as soft bounds). Here: the copies of a line each
block holds, from the SASS and the source (``_copies``), and the count's totals, mix and lines.
profiling/README.md ("Issued instructions") has the method, its assumptions and its error.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from cupaged.sim.profiler import _block_fit, _sass

__all__ = ["InstructionCount", "count_instructions", "launch_instructions"]

@dataclasses.dataclass(frozen=True)
class InstructionCount:
    """Warp-level SASS instructions of one launch's profiled CTAs (None: not counted, ``note`` says why)."""

    warp_instructions: int | None
    instruction_mix: dict | None
    instructions_by_line: dict
    residual: float | None = None
    note: str = ""
    by_opcode: dict = dataclasses.field(default_factory=dict)  # warp instructions per SASS opcode (no modifiers)


_PRAGMA = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+unroll\b[ \t]*(\d*)[ \t]*$", re.M)


def _statement_end(code: str, i: int) -> int:
    """The index just past the statement starting at or after ``i`` (a block, a for / while / if with
    its body, or an expression statement), in code whose comments and strings do not matter here."""
    while code[i].isspace():
        i += 1
    if code[i] == "{":
        depth = 0
        for j in range(i, len(code)):
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            if depth == 0:
                return j + 1
    head = re.match(r"(for|while|if)\b\s*\(", code[i:])
    if head:
        depth, j = 0, i + head.end() - 1
        for j in range(j, len(code)):
            depth += {"(": 1, ")": -1}.get(code[j], 0)
            if depth == 0:
                break
        end = _statement_end(code, j + 1)
        rest = re.match(r"\s*else\b", code[end:]) if head.group(1) == "if" else None
        return _statement_end(code, end + rest.end()) if rest else end
    depth = 0
    for j in range(i, len(code)):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(code[j], 0)
        if code[j] == ";" and depth == 0:
            return j + 1
    return len(code)


def _loop_lines(code: str) -> tuple[frozenset, frozenset]:
    """(lines of loops under ``#pragma unroll`` or ``#pragma unroll <literal>``, lines of the other loops).
    The profiled host build unrolls the first as ptxas does (cupaged/sim/_compile.py, profile_source):
    their SASS and host blocks hold the same copies. ptxas may unroll the others alone."""
    mirrored, other = set(), set()
    pragmas = {code.count("\n", 0, m.start()) + 1 for m in _PRAGMA.finditer(code)}
    for m in re.finditer(r"\b(for|while)\s*\(", code):
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, _statement_end(code, m.start())) + 1
        (mirrored if first - 1 in pragmas else other).update(range(first, last + 1))
    return frozenset(mirrored), frozenset(other - mirrored)


def _copies(blocks, running, unrolled_alone=None) -> dict:
    """line -> {block index: copies of the line in that block}: k where the block holds k times the
    line's smallest instance, for a line of a loop only ptxas may unroll (``unrolled_alone``; None: any
    line), else 1 (a loop both compilers unroll alike, or a helper's line, whose instances follow their
    call sites' loops)."""
    opcodes = collections.defaultdict(dict)  # line -> block -> Counter of opcodes
    for k in running:
        for op, line in zip(blocks[k].opcodes, blocks[k].lines):
            if line is not None:
                opcodes[line].setdefault(k, collections.Counter())[op] += 1
    copies = {}
    for line, per_block in opcodes.items():
        one = min(per_block.values(), key=lambda c: sum(c.values()))
        copies[line] = {}
        for k, have in per_block.items():
            ratios = sorted(have[op] / n for op, n in one.items() for _ in range(n))
            alone = unrolled_alone is None or line in unrolled_alone
            copies[line][k] = max(1, int(ratios[len(ratios) // 2])) if alone else 1
    return copies


def count_instructions(blocks, line_executions: dict, warps: int, host_blocks=(),
                       unrolled_alone=None, run=None) -> InstructionCount:
    """The warp instructions of ``blocks`` (``_sass.SassBlock``) run by ``warps`` warps whose
    warp-level executions per source line were ``line_executions`` (see above); ``run``: the launch's
    counts that anchor instructions (cp.async bytes, wgmma FLOPs: ``_block_fit._ANCHORS``)."""
    running = [k for k, b in enumerate(blocks) if not b.never]
    if warps <= 0 or not running:
        return InstructionCount(0, dict.fromkeys(("total", *_sass.CLASSES), 0), {}, 0.0)
    copies = _copies(blocks, running, unrolled_alone)
    per_warp, detail = _block_fit.fit(blocks, running, copies, line_executions, warps, host_blocks, run)
    if per_warp is None:
        return InstructionCount(None, None, {}, None, f"the block fit failed: {detail}")
    mix = dict.fromkeys(_sass.CLASSES, 0.0)
    by_line, by_opcode = collections.defaultdict(float), collections.defaultdict(float)
    for k, x in zip(running, per_warp * warps):
        for op, line in zip(blocks[k].opcodes, blocks[k].lines):
            mix[_sass.opcode_class(op)] += x
            by_opcode[op.split(".")[0]] += x
            if line is not None:
                by_line[line] += x
    total = round(sum(mix.values()))
    mix = {"total": total, **{c: round(v) for c, v in mix.items()}}
    mix["int_control"] += total - sum(mix[c] for c in _sass.CLASSES)  # the total's rounding
    misfit, weighed = detail
    by_line = {k: round(v) for k, v in by_line.items() if round(v)}  # a line that issued nothing is not listed
    by_opcode = {k: round(v) for k, v in by_opcode.items() if round(v)}
    return InstructionCount(total, mix, by_line, misfit / weighed if weighed else 0.0, by_opcode=by_opcode)


def launch_instructions(launch, arch: str | None = None) -> InstructionCount:
    """The count of a profiled launch (``_profile.Launch``) for ``arch`` (default: the H200 model's), or why
    there is none."""
    from cupaged.sim import model

    arch = arch or model.H200.arch
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return InstructionCount(None, None, {}, None, "scipy is not installed: install cupaged[profiling]")
    if _sass.nvdisasm() is None:
        return InstructionCount(None, None, {}, None,
                                "nvdisasm not found: install cupaged[profiling] (nvidia-cuda-nvdisasm)")
    try:
        blocks = _sass.kernel_blocks(launch.source, launch.options, launch.kernel, arch)
    except _sass.SassError as e:
        return InstructionCount(None, None, {}, None, str(e))
    threads = launch.block[0] * launch.block[1] * launch.block[2]
    return count_instructions(blocks, launch.line_executions, launch.ctas_profiled * -(-threads // 32),
                              launch.host_blocks, _loop_lines(launch.source)[1],
                              {key: getattr(launch, key, None) for _, key, _, _ in _block_fit._ANCHORS})
