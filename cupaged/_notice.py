"""What cupaged prints on stderr while it works: compile notices, and the switch that silences them.

A leaf, imported by the kernel runtime (NVRTC compiles), the sim (g++ compiles) and the compile
gate (its progress lines) alike. ``CUPAGED_QUIET=1`` silences all of them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

__all__ = ["quiet", "compile_notice"]


def quiet() -> bool:
    """True when ``CUPAGED_QUIET`` is set (to anything but 0): no notices or progress on stderr."""
    return os.environ.get("CUPAGED_QUIET", "0") not in ("", "0")


@contextlib.contextmanager
def compile_notice(label: str, target: str, tool: str, count: int, min_seconds: float = 0.0):
    """Announce a compile on stderr: ``cupaged: compiling LABEL for TARGET (TOOL, N kernels) ... 12.3 s``
    (finished with ``failed after 3.1 s`` when it raises). With ``min_seconds`` (a compile that may
    be a fast cache hit, like CuPy's) one line afterwards, and only when it took that long."""
    what = f"{label} for {target} ({tool}, {count} kernel{'' if count == 1 else 's'})"
    start = time.perf_counter()
    if quiet() or min_seconds:
        yield
        took = time.perf_counter() - start
        if min_seconds and took >= min_seconds and not quiet():
            print(f"cupaged: compiled {what} in {took:.1f} s", file=sys.stderr, flush=True)
        return
    print(f"cupaged: compiling {what} ...", end="", file=sys.stderr, flush=True)
    try:
        yield
    except BaseException:
        print(f" failed after {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        raise
    print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
