"""The sim backend: CUDA kernels compiled by g++ and run on the CPU, one fiber per CUDA thread.

A drop-in for the part of CuPy that cupaged uses::

    mod = cupaged.sim.RawModule(code=src, options=("-std=c++17",), name_expressions=("k<float>",))
    kernel = mod.get_function("k<float>")
    kernel((blocks,), (threads,), (x, y, np.int32(n)), shared_mem=0)

Data arrays are numpy arrays; ``empty/zeros/asarray`` allocate them in guarded memory (PROT_NONE
pages around every buffer) so they are passed without a copy. docs/sim.md is the manual.

This package is the engine: compiling (``_compile.py``, ``_smem.py``, ``_cache.py``), modules and
launches (``_module.py``, ``_params.py``, ``_staging.py``, ``_env.py``), guarded memory
(``_memory.py``), errors (``_errors.py``) and the C++ runtime every kernel is compiled against
(``include/``: fibers, barriers, warp collectives, bounds checks, faults). Two layers sit beside it:
``ptx/`` emulates inline PTX and ``profiler/`` is ``profile()``; ``model.py`` is the H200 model the
profiler applies, public for the benches and the report.

Environment: ``CUPAGED_SIM_ORDER=natural|reverse|random[:seed]`` (block and thread scheduling
order), ``CUPAGED_SIM_TIMEOUT`` (CPU seconds per launch, default 300), ``CUPAGED_SIM_ARCH``
(``sm_80`` or ``sm_90``, the shared-memory limit enforced; default ``sm_90``),
``CUPAGED_CACHE_DIR`` (compiled objects; default ``$XDG_CACHE_HOME/cupaged``), ``CXX`` (a g++
>= 12 driver; the default is ``g++``), ``CUPAGED_QUIET=1`` (no compile notice on stderr).
"""

from cupaged.sim._errors import (
    SimCompileError,
    SimError,
    SimMemoryError,
    SimSyncError,
    SimTimeoutError,
    SimTrapError,
)
from cupaged.sim._memory import asarray, empty, empty_like, zeros, zeros_like
from cupaged.sim._module import RawKernel, RawModule
from cupaged.sim.profiler._profile import profile

__all__ = [
    "RawModule", "RawKernel", "SimError", "SimCompileError", "SimMemoryError", "SimSyncError",
    "SimTrapError", "SimTimeoutError", "empty", "zeros", "empty_like", "zeros_like", "asarray", "profile",
]

for _public in (RawModule, RawKernel, SimError, SimCompileError, SimMemoryError, SimSyncError, SimTrapError,
                SimTimeoutError):
    _public.__module__ = __name__  # tracebacks name cupaged.sim.X, where users import it from
del _public
