"""What the ops tell the tools around them: NVTX ranges (``CUPAGED_NVTX=1``) and, under
``cupaged.sim.profile()``, each main kernel launch's declared minimum traffic and FLOPs.

Both cost nothing when off: a range's label and a declaration's cost are built by callables that
run only when NVTX is on or a sim profile is recording, so the default call path stays as cheap
as before (and never reads device arrays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from cupaged._backend import on_sim
from cupaged.sim.profiler import _profile

__all__ = ["Declared", "op_range", "declare_launch", "op_launch", "nvtx_enabled"]


@dataclasses.dataclass(frozen=True)
class Declared:
    """The op a profiled launch belongs to, with what it must at least move and compute."""

    op: str
    label: str
    min_bytes: int
    flops: int


def nvtx_enabled() -> bool:
    return os.environ.get("CUPAGED_NVTX", "0") == "1"


_OFF = contextlib.nullcontext()


def op_range(op: str, label):
    """An NVTX range ``cupaged.<op> <label()>`` around an op's launches when CUPAGED_NVTX=1 (a
    missing nvtx package turns it into a no-op, as some GPU images lack it)."""
    if not nvtx_enabled():
        return _OFF
    try:
        import nvtx
    except ImportError:
        return _OFF
    return nvtx.annotate(f"cupaged.{op} {label()}")


def declare_launch(xp, op: str, label, cost):
    """A context around an op's main launch: under a sim profile, the launch records
    ``Declared(op, label(), cost().min_bytes, cost().flops)``; otherwise a no-op."""
    if not on_sim(xp) or not _profile.active():
        return _OFF
    c = cost()
    return _profile.declare(Declared(op, label(), int(c.min_bytes), int(c.flops)))


def op_launch(xp, op: str, label, cost):
    """An op of one launch: its NVTX range and its declaration together (the shared no-op context
    when neither is on: the default path builds no generator)."""
    if not nvtx_enabled() and (not on_sim(xp) or not _profile.active()):
        return _OFF
    return _both(op_range(op, label), declare_launch(xp, op, label, cost))


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield
