"""``Launch``: one kernel launch as a plan holds it, a value a launcher passes on unchanged to the kernel of its
family (``KernelFamily.function(launch.kernel, xp)(launch.grid, launch.block, args, shared_mem=...)``)."""

from __future__ import annotations

import dataclasses

__all__ = ["Launch"]


@dataclasses.dataclass(frozen=True)
class Launch:
    """A kernel by its name expression, its grid and block as CUDA's dim3 (x, y, z) and its dynamic shared
    bytes (what the kernel is opted in for before its first launch)."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0
