"""A stand-in ``cupy`` module for tests of the cuda launcher's plumbing without a GPU: its RawModule
records the options it was built with and the compiles it ran; ``asarray`` / ``from_dlpack`` record
what they were handed and return a fake device array (an ``ndarray`` holding it)."""

from __future__ import annotations

import sys
import types


def install(monkeypatch, cudart_version: int = 13000) -> types.ModuleType:
    """Put a fake ``cupy`` in sys.modules; ``cupy.options_seen`` and ``cupy.compiled`` record the
    RawModules built and compiled (``get_function`` returns ``("kernel", name)``)."""
    cupy = types.ModuleType("cupy")
    cupy.options_seen, cupy.compiled = [], []

    class Device:
        compute_capability = "90"

        def __init__(self, device=None):
            self.id = device or 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class RawModule:
        def __init__(self, code, options, name_expressions):
            self.name_expressions = name_expressions
            cupy.options_seen.append(options)

        def compile(self):
            cupy.compiled.append(self.name_expressions)

        def get_function(self, name):
            return ("kernel", name)

    class ndarray:  # noqa: N801 (cupy's name)
        def __init__(self, source, via):
            self.source, self.via = source, via

        def get(self):
            return self.source

    class Stream:  # CuPy's current stream; ``cupy.capturing`` says whether it captures a CUDA graph
        @staticmethod
        def is_capturing():
            return cupy.capturing

    cupy.RawModule, cupy.ndarray, cupy.capturing = RawModule, ndarray, False
    cupy.asarray = lambda a: ndarray(a, "asarray")
    cupy.from_dlpack = lambda a: ndarray(a, "from_dlpack")
    cupy.cuda = types.SimpleNamespace(Device=Device, get_current_stream=Stream,
                                      runtime=types.SimpleNamespace(runtimeGetVersion=lambda: cudart_version))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy
