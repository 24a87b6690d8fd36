"""``cupaged.sim.profile()``: the memory traffic of every sim launch, as Nsight Compute would count it.

Inside ``with sim.profile() as prof:`` each launch runs a second, instrumented build of its module
(g++ ``-fsanitize=thread`` whose entry points are the sim's own: cupaged_sim_profile.h) and appends
a :class:`Launch` to ``prof.launches``. Per pointer argument: bytes requested, distinct bytes and
32-byte sectors touched per warp-level instruction; shared-memory wavefronts against the ideal, in
total and per source line (``shared.by_line``); ``cp.async`` bytes and ``mma.sync`` FLOPs counted
by the emulations. A pointer held in a field of a struct passed by value counts as an argument
named ``param.field`` when it points into a live guarded sim array.

``max_inflight_bytes_per_cta``: the bytes a CTA keeps in flight, a documented approximation: a
plain global load counts until its thread's next scheduling point (at most 8 loads per lane), a
``cp.async`` group from its commit until a wait covers it; a CTA's figure is the sum of its
threads' peaks (they run concurrently on a GPU), the largest over the grid's CTAs.

``sim.profile(block_stride=(sx, sy, sz))`` runs only the CTAs whose blockIdx is a multiple of the
stride in every dimension (the others are skipped: their outputs are not written), for a quick
projection of a big grid; ``ctas`` and ``ctas_profiled`` of each launch say how many were sampled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np

from cupaged.sim.profiler import _host_blocks, _lines
from cupaged.sim.profiler._probe import LaunchStructs, pointer_fields

__all__ = ["profile", "Profile", "Launch", "ArgTraffic", "SharedTraffic", "declare", "declared"]


@dataclasses.dataclass(frozen=True)
class ArgTraffic:
    """Global-memory traffic of one pointer argument in one launch."""

    bytes_read: int
    bytes_written: int
    unique_bytes_read: int
    unique_bytes_written: int
    sectors_read: int
    sectors_written: int
    useful_bytes: int = dataclasses.field(default=0, repr=False)  # distinct bytes per warp-level instruction
    size: int = dataclasses.field(default=0, repr=False)  # bytes of the argument's array

    @property
    def sector_efficiency(self) -> float:
        """Bytes requested / bytes of the 32-byte sectors touched, ≤ 1 (1.0: perfectly coalesced);
        bytes several lanes of one instruction read (a broadcast) count once."""
        sectors = self.sectors_read + self.sectors_written
        return self.useful_bytes / (32 * sectors) if sectors else 1.0


@dataclasses.dataclass(frozen=True)
class SharedTraffic:
    """Shared-memory wavefronts (32 banks of 4 bytes) of one launch or of one source line.

    ``by_line`` (a launch's only): per source location of the instructions, a SharedTraffic of its
    own; the key is the 1-based line in the module's code (an int) or ``"path:line"`` in a header."""

    wavefronts: int
    ideal_wavefronts: int
    by_line: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def bank_conflicts(self) -> int:
        return self.wavefronts - self.ideal_wavefronts


@dataclasses.dataclass(frozen=True)
class Launch:
    """One profiled launch."""

    kernel: str
    grid: tuple
    block: tuple
    shared_mem: int
    args: dict
    shared: SharedTraffic
    cp_async_bytes: int
    mma_flops: int
    max_inflight_bytes_per_cta: int
    ctas: int  # the grid's CTAs
    ctas_profiled: int  # the CTAs that ran (all but with a block_stride)
    declared: object = None  # the innermost declare() around the launch, e.g. the op's minimum traffic
    source: str = dataclasses.field(default="", repr=False, compare=False)  # the module's code
    options: tuple = dataclasses.field(default=(), repr=False, compare=False)  # and its compile options
    # per source line (shared.by_line's keys): the most warp-level executions of a host block holding it
    line_executions: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # the host build's basic blocks of the kernel's code: (their source lines, warp-level executions)
    host_blocks: tuple = dataclasses.field(default=(), repr=False, compare=False)
    gmma_flops: int = 0  # wgmma.mma_async with 16-bit inputs
    gmma_fp8_flops: int = 0  # and with 8-bit inputs
    bulk_copy_bytes: int = 0  # moved by cp.async.bulk (plain and tensor), both directions

    @functools.cached_property
    def instructions(self):
        """The warp-level SASS instructions this launch issues on sm_90 over its profiled CTAs
        (cupaged/sim/profiler/_instructions.py)."""
        from cupaged.sim.profiler import _instructions

        return _instructions.launch_instructions(self)

    @property
    def warp_instructions(self) -> int | None:
        """Warp-level SASS instructions issued on sm_90 by the profiled CTAs (None: see instructions_note)."""
        return self.instructions.warp_instructions

    @property
    def instruction_mix(self) -> dict | None:
        """warp_instructions by kind: total, mma, fp32, mufu, memory, int_control."""
        return self.instructions.instruction_mix

    @property
    def instructions_by_line(self) -> dict:
        """Per source line (shared.by_line's keys): the warp instructions attributed to it."""
        return self.instructions.instructions_by_line

    @property
    def instructions_note(self) -> str:
        """Why warp_instructions is None, or ""."""
        return self.instructions.note

    @functools.cached_property
    def model(self):
        """The H200 time model of this launch (cupaged/sim/profiler/_launch_model.py)."""
        from cupaged.sim.profiler import _launch_model

        return _launch_model.model_of(self)


class Profile:
    """The launches recorded inside one ``with sim.profile()`` block."""

    def __init__(self, block_stride=(1, 1, 1)):
        self.block_stride = tuple(int(s) for s in block_stride)
        if len(self.block_stride) != 3 or min(self.block_stride) < 1:
            raise ValueError(f"block_stride must be 3 positive ints, got {block_stride!r}")
        self.launches: list[Launch] = []

    def table(self) -> str:
        """The launches' H200 model as a table (cupaged/sim/profiler/_launch_model.py)."""
        from cupaged.sim.profiler import _launch_model

        return _launch_model.table(self.launches)


_ACTIVE: list[Profile] = []
_DECLARED: list = []


@contextlib.contextmanager
def profile(block_stride=(1, 1, 1)):
    """Record every sim launch made inside the block: ``with sim.profile() as prof: ...``.

    ``block_stride``: run only the CTAs whose blockIdx.{x,y,z} are multiples of it (the innermost
    active profile's stride applies; the skipped CTAs write nothing)."""
    prof = Profile(block_stride)
    _ACTIVE.append(prof)
    try:
        yield prof
    finally:
        _ACTIVE.remove(prof)


def active() -> bool:
    return bool(_ACTIVE)


@contextlib.contextmanager
def declare(obj):
    """Launches made inside ``with declare(obj):`` record ``obj`` as their ``declared``."""
    _DECLARED.append(obj)
    try:
        yield obj
    finally:
        _DECLARED.pop()


def declared():
    """The innermost :func:`declare`'s object, or None."""
    return _DECLARED[-1] if _DECLARED else None


class LaunchProbe:
    """The counters of one launch of ``kernel``: built before it, read into a :class:`Launch` after."""

    def __init__(self, kernel, args, staged):
        self.kernel, self.declared = kernel, declared()
        ranges = [(kernel.param_names[i], *buf.valid) for i, buf in sorted(staged.buffers.items())]
        ranges += [(label, *buf.valid) for label, buf in pointer_fields(kernel.param_names, kernel.param_types, args)]
        self.names = [name for name, _, _ in ranges]
        self.sizes = [hi - lo for _, lo, hi in ranges]
        self.structs = LaunchStructs([(lo, hi) for _, lo, hi in ranges], _ACTIVE[-1].block_stride)
        self.sites, self.blocks = [], []

    def take_sites(self) -> None:
        """Copies the engine's per-site shared-memory counts and per-block executions (call before the
        next launch)."""
        self.sites = self.structs.sites()
        self.blocks = self.structs.blocks()

    def record(self, lib, grid, block, shared_mem) -> None:
        args = {}
        for k, name in enumerate(self.names):
            a, (read, written) = self.structs.args[k], self.structs.seen[k]
            args[name] = ArgTraffic(a.bytes_read, a.bytes_written, int(np.bitwise_count(read).sum()),
                                    int(np.bitwise_count(written).sum()), a.sectors_read, a.sectors_written,
                                    a.useful_read + a.useful_written, self.sizes[k])
        where = _lines.locations(lib, [site for site, _, _ in self.sites])
        by_line = {}
        for site, wavefronts, ideal in self.sites:
            old = by_line.get(where[site], SharedTraffic(0, 0))
            by_line[where[site]] = SharedTraffic(old.wavefronts + wavefronts, old.ideal_wavefronts + ideal)
        blocks = _host_blocks.host_blocks(lib, dict(self.blocks))
        executions = {}
        for lines, count in blocks:
            for line in lines:
                executions[line] = max(executions.get(line, 0), count)
        # a line no host block ran says little (its host code may sit in a block of the sim's own)
        executions = {line: n for line, n in executions.items() if n}
        s = self.structs.launch
        module = self.kernel.module
        launch = Launch(self.kernel.name, tuple(grid), tuple(block), int(shared_mem), args,
                        SharedTraffic(s.wavefronts, s.ideal_wavefronts, by_line), s.cp_async_bytes, s.mma_flops,
                        s.max_inflight_bytes_per_cta, int(np.prod(grid)), s.ctas_profiled, self.declared,
                        module.code, module.options, executions, tuple(blocks), s.gmma_flops, s.gmma_fp8_flops,
                        s.bulk_copy_bytes)
        for prof in _ACTIVE:
            prof.launches.append(launch)
