"""Compile gate and static resource report: registers, spills, shared and local memory per kernel.

``python -m cupaged.resources [stem ...] [--arch sm_90] [--jobs N]`` compiles every name
expression of every kernel family with NVRTC for sm_80 and sm_90 (no GPU or driver needed),
prints one table, and exits with status 1 on any compile error or register spill: DESIGN §6
requires every kernel to compile for both architectures without spills.

The numbers are ptxas's own: NVRTC 13 passes ``-Xptxas=-v`` through and ptxas's verbose report
lands in the program log. (The cubin's ``.nv.info.<kernel>`` sections carry the register count but
no spill counts, so the log is the only real source for those.) ptxas lists, after each entry
function, the non-inlined device functions it calls; their spills are charged to that kernel.

NVRTC serializes compiles inside one process, so (family, arch) pairs run in worker processes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import os
import re
import sys
import time

from cupaged._nvrtc import NvrtcError, compile_cubin

__all__ = ["ARCHS", "KernelResources", "compile_resources", "compile_families",
           "kernel_resources", "run_gate", "main"]

ARCHS = ("sm_80", "sm_90")

_ENTRY = re.compile(r"^ptxas info\s*: Compiling entry function '([^']+)' for '(\w+)'", re.M)
_PROPERTIES = re.compile(r"Function properties for (\S+)\s*\n\s*ptxas\s*\.\s*(\d+) bytes stack frame, "
                         r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")
_CUMULATIVE_STACK = re.compile(r"(\d+) bytes cumulative stack size")


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

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


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


def compile_resources(source: str, name_expressions, arch: str, options=("-std=c++17",),
                      family: str = "source") -> list[KernelResources]:
    """Compile ``source`` for ``arch`` and return ptxas's statistics for every kernel in it.

    Kernels named by ``name_expressions`` come first, in that order. Raises
    :class:`~cupaged._nvrtc.NvrtcError` (with the log) when the source does not compile.
    """
    names = tuple(name_expressions)
    program = compile_cubin(source, arch=arch, options=(*options, "-Xptxas=-v"),
                            name_expressions=names, filename=f"{family}.cu")
    stats = _parse_ptxas_log(program.log, arch)
    missing = [n for n, m in program.lowered_names.items() if m not in stats]
    if missing:
        raise RuntimeError(f"ptxas reported nothing for {missing} ({arch}); log:\n{program.log}")
    by_mangled = {m: n for n, m in program.lowered_names.items()}
    order = {n: i for i, n in enumerate(names)}
    records = [KernelResources(family, by_mangled.get(m, m), arch, *s, mangled_name=m)
               for m, s in stats.items()]
    return sorted(records, key=lambda r: (order.get(r.name_expression, len(order)), r.name_expression))


def _task(stem, source, names, options, arch):
    """One (family, arch) compile in a worker: a compile error is returned, not raised."""
    try:
        return compile_resources(source, names, arch, options, stem)
    except NvrtcError as err:
        return err


def _select(families):
    from cupaged import _runtime

    if families is None:
        return _runtime.families()
    known = None
    chosen = []
    for fam in families:
        if isinstance(fam, str):
            known = known or {f.stem: f for f in _runtime.families()}
            if fam not in known:
                raise ValueError(f"unknown kernel family {fam!r}; known: {', '.join(sorted(known)) or 'none'}")
            fam = known[fam]
        chosen.append(fam)
    return chosen


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compile_families(families=None, archs=ARCHS, jobs=None) -> dict:
    """Compile kernel families for each arch; {(stem, arch): [KernelResources] or NvrtcError}.

    ``families``: KernelFamily objects (anything with ``stem``, ``source``, ``name_expressions``,
    ``options``) or stems; None means all of :func:`cupaged._runtime.families`. ``jobs`` worker
    processes (default: one per available CPU); with one job everything runs in this process.
    Workers are spawned, so a calling script needs the usual ``if __name__ == "__main__"`` guard.
    """
    tasks = [(f.stem, f.source, tuple(f.name_expressions), tuple(f.options), arch)
             for f in _select(families) for arch in archs]
    tasks.sort(key=lambda t: -len(t[2]))  # big families first, for load balance
    jobs = min(jobs or _cpu_count(), len(tasks))
    if jobs <= 1:
        outcomes = [_task(*t) for t in tasks]
    else:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded parent
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            outcomes = list(pool.map(_task, *zip(*tasks)))
    return {(t[0], t[4]): o for t, o in zip(tasks, outcomes)}


def kernel_resources(families=None, archs=ARCHS, jobs=None) -> list[KernelResources]:
    """Resource records of every kernel in ``families`` for every arch (see compile_families).

    Raises :class:`~cupaged._nvrtc.NvrtcError` naming every (family, arch) that failed to compile.
    """
    outcomes = compile_families(families, archs, jobs)
    failed = {k: o for k, o in outcomes.items() if isinstance(o, NvrtcError)}
    if failed:
        raise NvrtcError(f"{len(failed)} compile error(s): " + ", ".join(f"{s} ({a})" for s, a in failed),
                         "\n".join(str(e) for e in failed.values()))
    return [r for key in sorted(outcomes) for r in outcomes[key]]


def _table(records) -> str:
    header = ("family", "name expression", "arch", "registers", "spill stores", "spill loads",
              "static smem", "local/stack")
    rows = [(r.family, r.name_expression, r.arch, r.registers, r.spill_stores, r.spill_loads,
             r.shared_bytes, r.stack_bytes) for r in records]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row, mark=""):
        cells = [str(c).rjust(w) if isinstance(c, int) else str(c).ljust(w) for c, w in zip(row, widths)]
        return (" | ".join(cells) + mark).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(header), rule] + [line(row, "  SPILLS" if rec.spills else "")
                                             for row, rec in zip(rows, records)])


def run_gate(families=None, archs=ARCHS, jobs=None, file=None) -> int:
    """Print the resource table and any compile errors; 0 when all compile without spills, else 1."""
    file = file or sys.stdout
    start = time.perf_counter()
    outcomes = compile_families(families, archs, jobs)
    elapsed = time.perf_counter() - start
    records = [r for key in sorted(outcomes) if not isinstance(outcomes[key], NvrtcError)
               for r in outcomes[key]]
    failed = {k: o for k, o in sorted(outcomes.items()) if isinstance(o, NvrtcError)}
    if records:
        print(_table(records), file=file)
    for (stem, arch), err in failed.items():
        print(f"\nCOMPILE ERROR in {stem} ({arch}): {err}", file=file)
    spilling = sum(r.spills for r in records)
    families_done = len({stem for stem, _ in outcomes})
    print(f"\n{families_done} families, {len(records)} kernels x arch in {elapsed:.1f} s: "
          f"{spilling} with spills, {len(failed)} compile errors", file=file)
    return 1 if spilling or failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupaged.resources", description=__doc__.split("\n")[0])
    parser.add_argument("stems", nargs="*", help="kernel families to compile (default: all)")
    parser.add_argument("--arch", action="append", help="real architecture, repeatable (default: sm_80 and sm_90)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per CPU)")
    args = parser.parse_args(argv)
    try:
        return run_gate(args.stems or None, tuple(args.arch or ARCHS), args.jobs)
    except ValueError as err:  # an unknown stem or a virtual architecture
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
