"""The sim's profiler: ``cupaged.sim.profile()`` and what it measures of each launch.

A profiled launch runs a second build of its module, instrumented so that every memory access and
every basic block calls the profiler's own hooks (``include/cupaged_sim_profile.h``, which the engine
includes); from those counts:

- ``_profile.py``: ``profile()``, the ``Launch`` record (bytes, sectors, shared-memory wavefronts,
  ``cp.async`` bytes, ``mma`` FLOPs, bytes in flight) and what an op declares around its launch;
  ``_probe.py``: the counters' memory shared with the engine;
- ``_lines.py`` and ``_host_blocks.py``: source lines of instruction sites and of g++'s basic blocks;
- ``_sass.py``, ``_block_fit.py``, ``_instructions.py``: the warp instructions a launch issues on
  sm_90 (SASS: the GPU's machine code, from the kernel's cubin), weighed by the blocks' counts;
- ``_launch_model.py``: ``launch.model`` and ``prof.table()``, a launch put through the H200 model
  (``cupaged/sim/model.py``, the formulas and constants, public).
"""

import os

INCLUDE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")
