"""The sim's launch-time environment variables, each parsed with a message naming the variable, and
the breadcrumbs a crash report reads."""

from __future__ import annotations

import math
import os

__all__ = ["ARCH_SMEM_LIMIT", "arch", "breadcrumb", "order", "timeout"]

# the opt-in maximum of shared memory per block on each architecture the kernels target (sm_80+)
ARCH_SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024,
                   "sm_90a": 227 * 1024}
ORDERS = ("natural", "reverse", "random")


def order() -> tuple[int, int]:
    """CUPAGED_SIM_ORDER = natural | reverse | random[:seed]: (index in ORDERS, seed)."""
    spec = os.environ.get("CUPAGED_SIM_ORDER", "natural")
    name, colon, seed = spec.partition(":")
    if name not in ORDERS or (colon and name != "random"):
        raise ValueError(f"CUPAGED_SIM_ORDER must be natural, reverse or random[:seed], got {spec!r}")
    try:
        value = int(seed or 0)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise ValueError(f"CUPAGED_SIM_ORDER: the seed of random:seed must be an integer in 0..2^64-1, got {seed!r}")
    return ORDERS.index(name), value


def timeout() -> float:
    """CUPAGED_SIM_TIMEOUT: the CPU seconds one launch may take (default 300), a finite number > 0."""
    spec = os.environ.get("CUPAGED_SIM_TIMEOUT", "300")
    try:
        value = float(spec)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"CUPAGED_SIM_TIMEOUT must be a number of CPU seconds > 0, got {spec!r}")
    return value


def arch() -> str:
    """CUPAGED_SIM_ARCH: the architecture whose shared-memory limit launches are held to (default sm_90)."""
    name = os.environ.get("CUPAGED_SIM_ARCH", "sm_90")
    if name not in ARCH_SMEM_LIMIT:
        raise ValueError(f"CUPAGED_SIM_ARCH must be one of {', '.join(ARCH_SMEM_LIMIT)} (the kernels need sm_80 or "
                         f"newer), got {name!r}")
    return name


_TRACE_FILES: dict[str, int] = {}


def breadcrumb(variable: str, text: str) -> None:
    """Writes ``text`` over the file the environment variable names, if it is set: what a process
    was doing when it died (``.ci/run`` prints CUPAGED_TEST_TRACE's last test and CUPAGED_SIM_TRACE's
    last launch after a crash). The file stays open; each call rewrites it (two system calls)."""
    path = os.environ.get(variable)
    if not path:
        return
    fd = _TRACE_FILES.get(path)
    if fd is None:
        fd = _TRACE_FILES[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    data = text.encode(errors="replace") + b"\n"
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
