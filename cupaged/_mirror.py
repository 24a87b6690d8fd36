"""The Python side of a kernel's compile-time constants and by-value structs, read from its CUDA source.

The ``.cu`` file is the one owner: ``constexpr int NAME = value;`` constants and plain structs of
``long long`` / ``int`` / ``unsigned`` / ``float`` / ``double`` fields are parsed from the family's
source, so Python cannot drift from them (tests/test_mirror.py compiles a kernel that reports every
field's ``offsetof`` and the ``sizeof`` and compares them with the numpy dtype).
"""

from __future__ import annotations

import functools
import re

import numpy as np

from cupaged._source import strip_comments

__all__ = ["constants", "struct_dtype"]

_TYPES = {"long long": np.int64, "unsigned long long": np.uint64, "int": np.int32, "unsigned": np.uint32,
          "unsigned int": np.uint32, "float": np.float32, "double": np.float64}


@functools.lru_cache(maxsize=None)
def constants(source: str, *names: str) -> dict[str, int]:
    """``constexpr int NAME = <integer>;`` of each name (a missing one is a KeyError naming it);
    memoized, so a launcher may ask on every call. Treat the result as read-only."""
    out = {}
    for name in names:
        m = re.search(r"\bconstexpr\s+int\s+" + re.escape(name) + r"\s*=\s*(\d+)\s*;", source)
        if m is None:
            raise KeyError(f"no `constexpr int {name} = <integer>;` in the kernel source")
        out[name] = int(m.group(1))
    return out


def struct_dtype(source: str, name: str) -> np.dtype:
    """The numpy dtype (``align=True``: C's layout) of ``struct name { ... };`` in ``source``."""
    m = re.search(r"\bstruct\s+" + re.escape(name) + r"\s*\{(.*?)\};", strip_comments(source), re.S)
    if m is None:
        raise KeyError(f"no `struct {name}` in the kernel source")
    fields = []
    for decl in filter(None, (d.strip() for d in m.group(1).split(";"))):
        words = re.match(r"((?:unsigned\s+)?(?:long\s+long|int|unsigned|float|double))\s+(.*)$", decl, re.S)
        if words is None:
            raise ValueError(f"struct {name}: cannot mirror the field declaration {decl!r}")
        ctype = " ".join(words.group(1).split())
        fields += [(field.strip(), _TYPES[ctype]) for field in words.group(2).split(",")]
    return np.dtype(fields, align=True)
