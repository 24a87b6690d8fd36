"""Kernel parameter names read from the CUDA source, so sim errors name ``block_tables``, not
``argument 3``.

The source is not parsed as C++; the parameter list of a ``__global__`` function is split at its
top-level commas after comments are removed (the kernels' shape comments hold commas and angle
brackets), and each parameter's name is the identifier that ends its declarator, after template
arguments, attributes, array bounds and a default value are dropped. Which overload a name
expression means is decided by the parameter count the compiled kernel reports.
"""

from __future__ import annotations

import re

from cupaged._source import strip_comments

__all__ = ["param_names"]

_ATTRIBUTES = re.compile(r"\[\[.*?\]\]|\b(?:__attribute__|__declspec|alignas|__align__)\s*\(")
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict", "struct", "class", "typename",
               "enum", "union", "register", "__grid_constant__"}
_BUILTIN_TYPES = {"void", "bool", "char", "short", "int", "long", "float", "double", "signed", "unsigned",
                  "auto", "wchar_t", "char16_t", "char32_t"}


def _balanced_end(text: str, i: int) -> int:
    """Index just past the bracket that closes the one opened right before ``i`` (angle brackets
    do not count: ``<`` may be an operator in a default value)."""
    depth = 1
    while i < len(text) and depth:
        depth += (text[i] in "([{") - (text[i] in ")]}")
        i += 1
    return i


def _split_params(text: str) -> list[str]:
    """Split a parameter list at its top-level commas. Angle brackets nest only in a parameter's
    type (``Pair<T, N>``; a ``>>`` closes two): in a default value ``<`` is an operator."""
    parts, depth, angles, start, default = [], 0, 0, 0, False
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "<" and not default:
            angles += 1
        elif ch == ">" and not default:
            angles = max(0, angles - 1)
        elif ch == "=" and depth == angles == 0 and text[i - 1] not in "=!<>" and text[i + 1:i + 2] != "=":
            default = True
        elif ch == "," and depth == angles == 0:
            parts.append(text[start:i])
            start, default = i + 1, False
    return parts + [text[start:]]


def _without_attributes(p: str) -> str:
    while m := _ATTRIBUTES.search(p):
        end = m.end() if m.group(0).startswith("[[") else _balanced_end(p, m.end())
        p = p[:m.start()] + " " + p[end:]
    return p


def _declared_name(param: str) -> str | None:
    """The name a parameter declares; None for an unnamed one (``const float*``, ``int``)."""
    p = _without_attributes(param)
    p = re.split(r"(?<![=!<>])=(?!=)", p, maxsplit=1)[0]  # a default value
    p = re.sub(r"\[[^\]]*\]", " ", p)  # array bounds: the parameter is a pointer
    while (q := re.sub(r"<[^<>]*>", " ", p)) != p:  # template arguments, innermost first
        p = q
    p = re.sub(r"\s*::\s*", "::", p)
    words = [w for w in re.findall(r"[A-Za-z_][\w:]*", p) if w not in _QUALIFIERS]
    # a lone word is a type (``T``, ``PaParams``); so is a trailing builtin (``unsigned int``)
    if len(words) < 2 or words[-1] in _BUILTIN_TYPES or "::" in words[-1]:
        return None
    return words[-1]


def param_names(code: str, name: str, count: int) -> list[str] | None:
    """Names of the ``count`` parameters of kernel ``name`` (a name expression such as
    ``ns::kernel<float, 128>``), read from ``code``; an unnamed parameter is ``argument i``.
    None when no ``__global__`` function of that name has ``count`` parameters. Of several
    declarations the one naming the most parameters wins (a definition over a declaration)."""
    base = re.sub(r"<.*", "", name, flags=re.S).split("::")[-1].strip()
    text = strip_comments(code)
    best = None
    for m in re.finditer(r"\b__global__\b[^;{}]*?\b" + re.escape(base) + r"\s*\(", text):
        inner = text[m.end():_balanced_end(text, m.end()) - 1].strip()
        params = [] if inner in ("", "void") else _split_params(inner)
        if len(params) == count:
            names = [_declared_name(p) for p in params]
            if best is None or sum(map(bool, names)) > sum(map(bool, best)):
                best = names
    return None if best is None else [n or f"argument {i}" for i, n in enumerate(best)]
