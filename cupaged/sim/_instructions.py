"""The warp-level SASS instructions a profiled sim launch issues on sm_90 (``Launch.warp_instructions``).

Two facts are combined. The SASS: the kernel's own cubin as basic blocks (``_sass.py``), each
instruction with its source line. The run: the profiled build (``-fsanitize-coverage=trace-pc``) counts
how often each warp ran each of g++'s basic blocks, under SIMT rules (cupaged_sim_profile.h): a warp
runs a block once for all its lanes; between two scheduling points its executions are the most any
lane made, so both sides of a branch that diverges inside a warp count. A host block's line (its first
statement, in the kernel's own code) gives each source line's warp-level executions ``N(line)``: the
most of its host blocks' counts.

The SASS blocks' executions ``x`` are then fitted by a linear program (HiGHS, through scipy): the
entry block runs once per warp; a block runs at most as often as its predecessors together and, unless
a warp may exit in it, at most as often as its successors together (a warp goes on somewhere; a
diverged warp may go both ways); and for every line with a count, the executions of its copies match
``N(line)`` as closely as possible (least absolute error, weighed by the line's instructions per copy).
A block's copies of a line are found from the SASS alone: the instance of the line with the fewest
instructions is one copy, and a block holding k times its instructions opcode by opcode (the median
ratio) holds k copies, as an unrolled loop's body does. The fit never multiplies a line's count by the
instructions of every copy: a loop that ptxas unrolled and g++ did not (or the reverse) is counted by
how often its SASS blocks run. Ties are broken toward fewer instructions (a runtime-unrolled loop runs
its widest version), and blocks that never run (``_sass.py``: slow paths) count 0.

Assumptions and error (profiling/README.md): lanes of a warp run in step between scheduling points;
a host block's first line stands for the block; the copies of one line inside one SASS block run
equally often. The fit's residual (``InstructionCount.residual``: the share of the weighed line
counts the fitted blocks do not explain) says how well the SASS and the run agree.
"""

from __future__ import annotations

import collections
import dataclasses

from cupaged.sim import _block_fit, _sass

__all__ = ["InstructionCount", "count_instructions", "launch_instructions"]

@dataclasses.dataclass(frozen=True)
class InstructionCount:
    """Warp-level SASS instructions of one launch's profiled CTAs (None: not counted, ``note`` says why)."""

    warp_instructions: int | None
    instruction_mix: dict | None
    instructions_by_line: dict
    residual: float | None = None
    note: str = ""


def _copies(blocks, running) -> dict:
    """line -> {block index: copies of the line in that block}."""
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
            copies[line][k] = max(1, int(ratios[len(ratios) // 2]))
    return copies


def count_instructions(blocks, line_executions: dict, warps: int) -> InstructionCount:
    """The warp instructions of ``blocks`` (``_sass.SassBlock``) run by ``warps`` warps whose
    warp-level executions per source line were ``line_executions`` (see above)."""
    running = [k for k, b in enumerate(blocks) if not b.never]
    if warps <= 0 or not running:
        return InstructionCount(0, dict.fromkeys(("total", *_sass.CLASSES), 0), {}, 0.0)
    per_warp, detail = _block_fit.fit(blocks, running, _copies(blocks, running), line_executions, warps)
    if per_warp is None:
        return InstructionCount(None, None, {}, None, f"the block fit failed: {detail}")
    mix = dict.fromkeys(_sass.CLASSES, 0.0)
    by_line = collections.defaultdict(float)
    for k, x in zip(running, per_warp * warps):
        for op, line in zip(blocks[k].opcodes, blocks[k].lines):
            mix[_sass.opcode_class(op)] += x
            if line is not None:
                by_line[line] += x
    total = round(sum(mix.values()))
    mix = {"total": total, **{c: round(v) for c, v in mix.items()}}
    mix["int_control"] += total - sum(mix[c] for c in _sass.CLASSES)  # the total's rounding
    misfit, weighed = detail
    by_line = {k: round(v) for k, v in by_line.items() if round(v)}  # a line that issued nothing is not listed
    return InstructionCount(total, mix, by_line, misfit / weighed if weighed else 0.0)


def launch_instructions(launch, arch: str = "sm_90") -> InstructionCount:
    """The count of a profiled launch (``_profile.Launch``), or why there is none."""
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
    return count_instructions(blocks, launch.line_executions, launch.ctas_profiled * -(-threads // 32))
