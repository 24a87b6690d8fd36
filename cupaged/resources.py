"""Compile gate and static resource report: registers, spills, shared and local memory per kernel.

``python -m cupaged.resources [stem ...] [--arch sm_90] [--source FILE.cu [--name EXPR]] [--jobs N]
[--no-cache]`` compiles every name expression of every kernel family with NVRTC for sm_80 and sm_90
(no GPU or driver needed), prints one table, and exits with status 1 on any compile error or
register spill: every kernel must compile for both architectures without spills. A Hopper family
(``KernelFamily(..., arch="sm_90a")``) is compiled for sm_90a instead, and only where the archs asked
for hold sm_90 or sm_90a: never for sm_80 / sm_86 / sm_89. Kernels that use ``setmaxnreg`` show the
registers per thread after each ``setmaxnreg.dec/.inc`` beside ptxas's count at launch; one whose
setmaxnreg ptxas ignored fails the gate too. ``--source`` gates a standalone .cu file (own headers
inlined; every kernel in it, plus the ``--name`` expressions) for the ``--arch`` given, e.g.
``--source tests/hopper_gemm.cu --arch sm_90a``. Progress goes to stderr as each (family, arch)
finishes: a bar on a terminal, one line each otherwise.

Results are cached per (family, arch) in the per-user cache (``cupaged/_resource_cache.py``: keyed
by the source, options, name expressions, arch, NVRTC and its headers, and the compile flags, log
parser and record format); ``--no-cache`` recompiles and stores fresh results.
Compile errors are never cached.

The numbers are ptxas's own, read from its verbose report (``cupaged/_resource_cache.py``
says how; a kernel's spills include those of the non-inlined device functions it calls).

NVRTC serializes compiles inside one process, so (family, arch) pairs run in worker processes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time
import types

from cupaged._notice import quiet
from cupaged._nvrtc import NvrtcError
from cupaged._resource_cache import KernelResources, cache_path, compile_resources, load, store

__all__ = ["ARCHS", "KernelResources", "compile_resources", "compile_families", "family_archs",
           "kernel_resources", "run_gate", "source_family", "main"]

ARCHS = ("sm_80", "sm_90")


def family_archs(family, archs) -> tuple:
    """The archs ``family`` is compiled for out of ``archs``: all of them; for an arch-specific family
    (``family.arch``, e.g. sm_90a) its own arch where ``archs`` hold it or its base (sm_90), else none."""
    own = getattr(family, "arch", None)
    if own is None:
        return tuple(archs)
    return (own,) if any(a in (own, own.rstrip("af")) for a in archs) else ()


def source_family(path, name_expressions=(), options=("-std=c++17",)):
    """A standalone .cu file as a family for the gate: stem = its name, its own headers inlined, every
    kernel in it reported (``name_expressions`` for templates); compiled for the archs asked for."""
    from cupaged import _runtime

    stem = os.path.splitext(os.path.basename(path))[0]
    return types.SimpleNamespace(stem=stem, source=_runtime._inline(path, {os.path.realpath(path)}),
                                 name_expressions=tuple(name_expressions), options=tuple(options), arch=None)


def _task(stem, source, names, options, arch):
    """One (family, arch) compile in a worker: (records or the compile error, seconds)."""
    start = time.perf_counter()
    try:
        outcome = compile_resources(source, names, arch, options, stem)
    except NvrtcError as err:
        outcome = err
    return outcome, time.perf_counter() - start


class _Progress:
    """``[3/8] paged_attention sm_90 done in 41.2 s`` per finished (family, arch) on ``file``; on a
    terminal one bar, redrawn in place. Silent when ``file`` is None or under CUPAGED_QUIET."""

    def __init__(self, total, file):
        self.total, self.done = total, 0
        self.file = None if quiet() else file
        self.bar = self.file is not None and self.file.isatty()

    def start(self, compiles, jobs):
        if self.file is not None and compiles:
            print(f"compiling {compiles} of {self.total} family x arch with NVRTC in {jobs} process(es)",
                  file=self.file, flush=True)

    def step(self, stem, arch, what):
        self.done += 1
        if self.file is not None and self.bar:
            filled = 30 * self.done // self.total
            print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {stem} {arch} {what}\x1b[K",
                  end="\n" if self.done == self.total else "", file=self.file, flush=True)
        elif self.file is not None:
            print(f"[{self.done}/{self.total}] {stem} {arch} {what}", file=self.file, flush=True)


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


def compile_families(families=None, archs=ARCHS, jobs=None, *, cache=True, progress=None) -> dict:
    """Compile kernel families for each arch; {(stem, arch): [KernelResources] or NvrtcError}.

    ``families``: KernelFamily objects (anything with ``stem``, ``source``, ``name_expressions``,
    ``options``) or stems; None means all of :func:`cupaged._runtime.families`. ``jobs`` worker
    processes (default: one per available CPU); with one job everything runs in this process.
    Workers are spawned, so a calling script needs the usual ``if __name__ == "__main__"`` guard.
    ``cache``: reuse and store results in the per-user cache (False: recompile, then store);
    ``progress``: a file for progress lines (None: silent).
    """
    return _compile(families, archs, jobs, cache, progress)[0]


def _compile(families, archs, jobs, cache, progress):
    """compile_families, and how many results came from the cache."""
    tasks = [(f.stem, f.source, tuple(f.name_expressions), tuple(f.options), arch)
             for f in _select(families) for arch in family_archs(f, archs)]
    tasks.sort(key=lambda t: -len(t[2]))  # big families first, for load balance
    paths = {t: cache_path(*t) for t in tasks}
    cached = {t: hit for t in tasks if cache and (hit := load(paths[t])) is not None}
    todo = [t for t in tasks if t not in cached]
    jobs = max(1, min(jobs or _cpu_count(), len(todo)))
    report = _Progress(len(tasks), progress)
    report.start(len(todo), jobs)
    outcomes = {}
    for t, hit in cached.items():
        outcomes[(t[0], t[4])] = hit
        report.step(t[0], t[4], "cached")

    def finished(t, outcome, seconds):
        outcomes[(t[0], t[4])] = outcome
        failed = isinstance(outcome, NvrtcError)
        if not failed:
            store(paths[t], outcome)
        report.step(t[0], t[4], f"{'FAILED' if failed else 'done'} in {seconds:.1f} s")

    if jobs == 1:
        for t in todo:
            finished(t, *_task(*t))
    else:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded parent
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = {pool.submit(_task, *t): t for t in todo}
            for future in concurrent.futures.as_completed(futures):
                finished(futures[future], *future.result())
    return outcomes, len(cached)


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


def _marks(rec) -> str:
    return ("  SPILLS" if rec.spills else "") + ("  SETMAXNREG IGNORED" if rec.setmaxnreg_ignored else "")


def _table(records) -> str:
    header = ("family", "name expression", "arch", "registers", "spill stores", "spill loads",
              "static smem", "local/stack")
    rows = [(r.family, r.name_expression, r.arch, r.registers, r.spill_stores, r.spill_loads,
             r.shared_bytes, r.stack_bytes) for r in records]
    if any(r.setmaxnreg for r in records):  # registers per thread after each setmaxnreg (Hopper)
        header += ("after setmaxnreg",)
        rows = [(*row, " / ".join(r.setmaxnreg)) for row, r in zip(rows, records)]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row, mark=""):
        cells = [str(c).rjust(w) if isinstance(c, int) else str(c).ljust(w) for c, w in zip(row, widths)]
        return (" | ".join(cells) + mark).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(header), rule] + [line(row, _marks(rec)) for row, rec in zip(rows, records)])


def run_gate(families=None, archs=ARCHS, jobs=None, file=None, *, cache=True, progress=None) -> int:
    """Print the resource table and any compile errors; 0 when all compile without spills, else 1.
    ``cache`` and ``progress`` as for :func:`compile_families`."""
    file = file or sys.stdout
    start = time.perf_counter()
    outcomes, hits = _compile(families, archs, jobs, cache, progress)
    elapsed = time.perf_counter() - start
    records = [r for key in sorted(outcomes) if not isinstance(outcomes[key], NvrtcError)
               for r in outcomes[key]]
    failed = {k: o for k, o in sorted(outcomes.items()) if isinstance(o, NvrtcError)}
    if records:
        print(_table(records), file=file)
    for (stem, arch), err in failed.items():
        print(f"\nCOMPILE ERROR in {stem} ({arch}): {err}", file=file)
    spilling = sum(r.spills for r in records)
    ignored = sum(r.setmaxnreg_ignored for r in records)
    families_done = len({stem for stem, _ in outcomes})
    cached = f" ({hits} of {len(outcomes)} family x arch results cached; --no-cache recompiles)" if hits else ""
    print(f"\n{families_done} families, {len(records)} kernels x arch in {elapsed:.1f} s{cached}: "
          f"{spilling} with spills, {len(failed)} compile errors"
          + (f", {ignored} with setmaxnreg ignored by ptxas" if ignored else ""), file=file)
    return 1 if spilling or failed or ignored else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupaged.resources", description=__doc__.split("\n")[0])
    parser.add_argument("stems", nargs="*", help="kernel families to compile (default: all)")
    parser.add_argument("--arch", action="append",
                        help="real architecture, repeatable (default: sm_80 and sm_90; Hopper families: sm_90a)")
    parser.add_argument("--source", action="append", default=[], metavar="FILE.cu",
                        help="gate a standalone .cu file too (repeatable): every kernel in it, for the --arch given")
    parser.add_argument("--name", action="append", default=[], metavar="EXPR",
                        help="a name expression (template instantiation) to compile in each --source")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per CPU)")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompile every family and arch instead of reusing cached results (then cache them)")
    args = parser.parse_args(argv)
    if args.name and not args.source:
        parser.error("--name applies to a --source file")
    try:
        sources = [source_family(path, args.name) for path in args.source]
    except OSError as err:  # a --source that cannot be read
        parser.error(str(err))
    try:
        return run_gate([*args.stems, *sources] or None, tuple(args.arch or ARCHS), args.jobs,
                        cache=not args.no_cache, progress=sys.stderr)
    except ValueError as err:  # an unknown stem or a virtual architecture
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
