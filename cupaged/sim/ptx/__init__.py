"""The sim's PTX layer: inline ``asm`` statements of a kernel rewritten into C++ that emulates each
instruction with the PTX ISA's semantics (PTX: NVIDIA's virtual instruction set, what CUDA's
``asm volatile("mma.sync...")`` spells).

- ``_asm.py``: finds each ``asm`` statement of the preprocessed source (the kernel's and project
  headers', not NVIDIA's) and binds its operands by constraint;
- ``_translate.py``: one statement's PTX text into calls of the emulations, arithmetic and ``cvt``
  here; ``_memory_ops.py``: the warp-wide, memory and synchronizing instructions (``mma.sync``,
  ``ldmatrix``, ``cp.async``, ``ld`` / ``st``, ``shfl.sync``, ``bar``); ``_base.py``: operands,
  types and one statement's state, shared by both;
- ``include/``: the emulations in C++ (``cupaged_sim_ptx.h``, ``cupaged_sim_mma.h`` for the
  warp-wide matrix instructions) and the sim's ``cuda_pipeline_primitives.h``, CUDA's C++ form of
  ``cp.async``, found ahead of NVIDIA's.

The engine (``cupaged/sim``) runs ``_asm.rewrite`` between preprocessing and compiling a source that
may hold inline PTX; nothing here imports the engine but its errors.
"""

import os

INCLUDE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")
