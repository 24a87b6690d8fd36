"""A stand-in ``cupy`` module for tests of the cuda launcher's plumbing without a GPU: its RawModule
records the options it was built with and the compiles it ran."""

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

    cupy.RawModule = RawModule
    cupy.cuda = types.SimpleNamespace(Device=Device, runtime=types.SimpleNamespace(runtimeGetVersion=lambda: cudart_version))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy
