"""Exceptions raised by the sim backend (all derive from SimError)."""

__all__ = ["SimError", "SimCompileError", "SimMemoryError", "SimSyncError", "SimTrapError", "SimTimeoutError"]


class SimError(RuntimeError):
    """Any failure of the CPU simulator."""


class SimCompileError(SimError):
    """g++ (or the toolchain around it) rejected the source, or is missing."""


class SimMemoryError(SimError):
    """Out-of-bounds global access or dynamic shared memory beyond the launch's size."""


class SimSyncError(SimError):
    """Divergent __syncthreads, a warp collective outside its mask, or a deadlock."""


class SimTrapError(SimError):
    """Device assert, __trap, or an arithmetic trap such as integer division by zero."""


class SimTimeoutError(SimError):
    """The launch used more CPU time than CUPAGED_SIM_TIMEOUT seconds."""
