"""Static shared memory per kernel, and each kernel's ``__launch_bounds__``, as the GPU counts them.

On the sim every ``__shared__`` variable of a module is a TLS symbol. A function-local one is
named after its function (``_ZZ<function>E<name>``): demangled, that attributes it to a kernel
(or, when the function is a device helper, to every kernel, as a helper may be called by any).
Namespace-scope ``__shared__`` variables count for every kernel too.

``__launch_bounds__(N, ...)``: the block size a launch may not exceed. Read from the source text;
N must be an integer expression of literals and object-like macros defined in the source (else
the bound is not checked on the sim).
"""

from __future__ import annotations

import re
import shutil
import subprocess

__all__ = ["static_per_kernel", "launch_bounds"]


def _normalized(name: str) -> str:
    return re.sub(r"\s+", "", name).lstrip(":")


def _owner(demangled: str) -> str | None:
    """What a static's name is scoped to: its function for a local (``f<int, 3>(int*)::s`` ->
    ``f<int,3>``; an extern "C" function has no parameter list: ``k::s`` -> ``k``), its namespace
    (or None) for a namespace-scope variable."""
    head, sep, _ = demangled.rpartition("::")
    if not sep:
        return None
    if not head.endswith(")"):
        return _normalized(head)
    depth = 0
    for i in range(len(head) - 1, -1, -1):  # strip the parameter list (it may contain parentheses)
        depth += head[i] == ")"
        depth -= head[i] == "("
        if depth == 0:
            return _normalized(head[:i])
    return None


_ENUM = re.compile(r"\benum\s+(?:class\s+|struct\s+)?\w*\s*(?::\s*[\w\s]+)?\{([^{}]*)\}")


def _enumerators(code: str) -> dict[str, int]:
    """Enumerator -> value of the source's plain enums (a name expression may name a template
    argument ``cupaged::KV_E4M3``; the demangler prints the int parameter's value, 1)."""
    values = {}
    for m in _ENUM.finditer(code):
        nxt = 0
        for item in filter(None, (i.strip() for i in m.group(1).split(","))):
            name, _, value = (p.strip() for p in item.partition("="))
            nxt = int(value, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", value) else nxt
            values[name] = nxt
            nxt += 1
    return values


def _with_values(name: str, enums: dict[str, int]) -> str:
    return re.sub(r"(?:\b[A-Za-z_]\w*::)*\b([A-Za-z_]\w*)\b(?![\w:<(])",
                  lambda m: str(enums[m.group(1)]) if m.group(1) in enums and "::" in m.group(0) or
                  m.group(0) in enums else m.group(0), name)


def static_per_kernel(symbols: dict[str, int], names, code: str = "") -> dict[str, int]:
    """Bytes of static shared memory each kernel (name expression or extern "C" name) is charged;
    ``code``: the source, whose enumerators a name expression may use as template arguments."""
    if not symbols:
        return {n: 0 for n in names}
    tool = shutil.which("c++filt")
    demangled = list(symbols)
    if tool:
        out = subprocess.run([tool], input="\n".join(symbols), capture_output=True, text=True).stdout.splitlines()
        demangled = out if len(out) == len(symbols) else demangled
    enums = _enumerators(code)
    wanted = {_normalized(_with_values(n, enums)): n for n in names}
    everyone, own = 0, {n: 0 for n in names}
    for sym, text in zip(symbols, demangled):
        owner = _owner(text) if tool else None
        if owner in wanted:
            own[wanted[owner]] += symbols[sym]
        else:  # a global, a device helper's local, or not demangled: any kernel may use it
            everyone += symbols[sym]
    return {n: everyone + own[n] for n in names}


_BOUNDS = re.compile(r"__launch_bounds__\s*\(((?:[^()]|\([^()]*\))*)\)\s*(?:void\s+)?(\w+)\s*[(<]")
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+([^\n]*)$", re.M)


def _evaluate(expr: str, macros: dict[str, str], depth: int = 0) -> int | None:
    if depth > 8:
        return None
    text = re.sub(r"\b([A-Za-z_]\w*)\b", lambda m: f"({macros[m.group(1)]})" if m.group(1) in macros else m.group(1),
                  expr)
    if text != expr:
        return _evaluate(text, macros, depth + 1)
    text = re.sub(r"(\d+)[uUlL]+\b", r"\1", text)
    if not re.fullmatch(r"[\d\s()+\-*/%<>]*", text) or not text.strip():
        return None
    try:
        return int(eval(text.replace("/", "//"), {"__builtins__": {}}))  # digits and operators only
    except (SyntaxError, ZeroDivisionError, TypeError):
        return None


def launch_bounds(code: str) -> dict[str, int]:
    """Kernel base name -> the maximum block size its ``__launch_bounds__`` allows (when evaluable)."""
    macros = {m.group(1): m.group(2).split("//")[0].strip() for m in _DEFINE.finditer(code)}
    out = {}
    for m in _BOUNDS.finditer(code):
        value = _evaluate(m.group(1).split(",")[0], macros)
        if value is not None:
            out[m.group(2)] = value
    return out
