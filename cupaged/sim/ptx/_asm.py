"""Rewrite the inline-PTX ``asm`` statements of a preprocessed kernel source into sim C++.

The source is preprocessed first (``g++ -E``), so macros and adjacent string literals are resolved
and the line markers tell where each statement came from. Only statements of the kernel source and
of project headers are rewritten; NVIDIA's headers, the C++ library and the sim's own headers keep
their host code paths. Each statement becomes one C++ block on the same line (the line count is
kept): its operands are bound in order by constraint (``r`` uint32_t, ``h`` uint16_t, ``l`` uint64_t,
``f`` float, ``d`` double, ``n``/``i`` an immediate; ``=`` output, ``+`` in-out, a digit ties an
input to that output), then :mod:`cupaged.sim.ptx._translate` translates the PTX text into calls of
``cupaged_sim_ptx.h``. An instruction the sim does not emulate is a :class:`SimCompileError`
naming the opcode and the 1-based line of the statement in the source passed to ``RawModule``.
"""

from __future__ import annotations

import bisect
import os
import re

from cupaged.sim._errors import SimCompileError
from cupaged.sim.ptx._base import split_commas, split_top
from cupaged.sim.ptx._translate import Operand, translate

__all__ = ["has_asm", "rewrite"]

# `asm` and `__asm__` are inline PTX. GCC's third spelling, `__asm`, is left alone: the way for a
# sim-only test to run host (x86) assembly, e.g. to provoke a fault the sim must report.
_KEYWORD = re.compile(r"\b(?:__asm__|asm)\b")
_QUALIFIERS = {"volatile", "__volatile__", "__volatile", "inline", "goto"}
_MARKER = re.compile(r'^# (\d+) "((?:[^"\\]|\\.)*)"((?: \d+)*)$', re.M)
_OPERAND = re.compile(r'^\s*(?:\[\s*(\w+)\s*\])?\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\((.*)\)\s*$', re.S)
_CTYPES = {"r": "unsigned", "h": "unsigned short", "l": "unsigned long long", "f": "float", "d": "double",
           "n": "long long", "i": "long long"}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0", "a": "\a", "v": "\v"}


def has_asm(code: str, options=()) -> bool:
    """Whether the rewrite pass is needed: ``code`` (or a macro in it) may hold an asm statement, or
    it includes project headers (``#include "..."`` or a ``-I`` option), which may."""
    return _KEYWORD.search(code) is not None or '#include "' in code or any(o.startswith("-I") for o in options)


class _Lines:
    """Maps an offset of the preprocessed text to (file, line, system header?) via its line markers."""

    def __init__(self, text: str):
        self.text = text
        self.starts, self.info = [], []
        for m in _MARKER.finditer(text):
            self.starts.append(m.end() + 1)
            self.info.append((m.group(2), int(m.group(1)), " 3" in m.group(3)))

    def at(self, pos: int) -> tuple[str, int, bool]:
        k = bisect.bisect_right(self.starts, pos) - 1
        if k < 0:
            return "", 0, True
        name, line, system = self.info[k]
        return name, line + self.text.count("\n", self.starts[k], pos), system


def _string(s: str, i: int) -> tuple[str, int]:
    """The C string literal at s[i] == '"': (decoded value, index after it)."""
    out, i = [], i + 1
    while s[i] != '"':
        c = s[i]
        if c == "\\":
            e = s[i + 1]
            if e == "x":
                m = re.match(r"[0-9a-fA-F]+", s[i + 2:])
                out.append(chr(int(m.group(), 16)))
                i += 2 + len(m.group())
                continue
            if e in "01234567":
                m = re.match(r"[0-7]{1,3}", s[i + 1:])
                out.append(chr(int(m.group(), 8)))
                i += 1 + len(m.group())
                continue
            out.append(_ESCAPES.get(e, e))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out), i + 1


def _strings(s: str) -> str:
    """Concatenated value of adjacent string literals (the only thing in ``s``)."""
    out, i = [], 0
    while True:
        while i < len(s) and s[i].isspace():
            i += 1
        if i >= len(s):
            return "".join(out)
        if s[i] != '"':
            raise ValueError(f"expected a string literal, found {s[i:i + 20]!r}")
        v, i = _string(s, i)
        out.append(v)


def _statement(text: str, start: int) -> tuple[int, list[str]] | None:
    """The asm statement at ``start``: (end offset after ';', its ':'-separated sections), or None
    when the keyword is not an asm statement (e.g. inside a string)."""
    i = start + len(_KEYWORD.match(text, start).group())
    while True:
        m = re.compile(r"\s*(\w+)").match(text, i)
        if not m or m.group(1) not in _QUALIFIERS:
            break
        i = m.end()
    m = re.compile(r"\s*\(").match(text, i)
    if not m:
        return None
    sections, close = split_top(text, ":", m.end())  # up to the statement's closing parenthesis
    m = re.compile(r"\s*;").match(text, close + 1)
    return (m.end() if m else close + 1), sections


def _bind(sections, where) -> tuple[list[Operand], list[str], list[str]]:
    """Operands of an extended asm, with the C++ before and after the instructions."""
    outs = split_commas(sections[1]) if len(sections) > 1 else []
    ins = split_commas(sections[2]) if len(sections) > 2 else []
    operands, pre, post = [], [], []
    for k, raw in enumerate(outs + ins):
        m = _OPERAND.match(raw)
        if not m:
            raise SimCompileError(f"{where}: cannot read the asm operand {raw.strip()!r}")
        name, constraint, expr = m.group(1), _strings(m.group(2)), m.group(3)
        letters = constraint.lstrip("=+&%")
        var = f"_cps{k}"
        if letters.isdigit():
            tied = operands[int(letters)]
            pre.append(f"{tied.var} = ::cupaged_sim::ptx::in<{tied.ctype}>(({expr}));")
            operands.append(Operand(k, name, tied.var, tied.ctype, tied.letter))
            continue
        letter = letters[:1]
        if letter not in _CTYPES or len(letters) != 1:
            raise SimCompileError(f"{where}: the sim binds asm operands with constraints r, h, l, f, d, n, i; "
                                  f"got {constraint!r}")
        ctype = _CTYPES[letter]
        if k < len(outs):
            pre.append(f"auto& _cpo{k} = ({expr});")
            init = f" = ::cupaged_sim::ptx::in<{ctype}>(_cpo{k})" if constraint.startswith("+") else ""
            pre.append(f"{ctype} {var}{init};")
            post.append(f"::cupaged_sim::ptx::out(_cpo{k}, {var});")
        elif letter in "ni":
            pre.append(f"const long long {var} = (long long)({expr});")
        else:
            pre.append(f"const {ctype} {var} = ::cupaged_sim::ptx::in<{ctype}>(({expr}));")
        operands.append(Operand(k, name, var, ctype, letter, k < len(outs), expr))
    return operands, pre, post


def _substitute(template: str, operands, extended: bool, where: str) -> str:
    if not extended:
        return template
    by_name = {o.name: o for o in operands if o.name}

    def repl(m):
        t = m.group(1)
        if t == "%":
            return "%"
        if t == "=":
            return "0"
        o = by_name.get(t[1:-1]) if t.startswith("[") else (operands[int(t)] if int(t) < len(operands) else None)
        if o is None:
            raise SimCompileError(f"{where}: asm operand %{t} does not exist")
        return o.var
    return re.sub(r"%(%|=|\d+|\[\w+\])", repl, template)


def rewrite(text: str, main_file: str, foreign_dirs) -> str:
    """``text`` (g++ -E output of ``main_file``, the source passed to RawModule) with every
    kernel/project asm statement replaced by sim C++."""
    lines = _Lines(text)
    foreign = tuple(os.path.join(os.path.realpath(d), "") for d in foreign_dirs)
    out, last = [], 0
    for m in _KEYWORD.finditer(text):
        if m.start() < last:
            continue
        name, line, system = lines.at(m.start())
        if system or name.startswith("<") or os.path.realpath(name).startswith(foreign):
            continue
        found = _statement(text, m.start())
        if found is None:
            continue
        end, sections = found
        where = f"inline PTX at line {line}" + ("" if name == main_file else f" of {name}")
        try:
            template = _strings(sections[0])
        except ValueError as e:
            raise SimCompileError(f"{where}: {e}") from None
        extended = len(sections) > 1
        operands, pre, post = _bind(sections, where) if extended else ([], [], [])
        body = translate(_substitute(template, operands, extended, where), operands, line, where)
        block = "{ " + " ".join(pre + [body] + post) + " }"
        out.append(text[last:m.start()] + block + "\n" * text.count("\n", m.start(), end))
        last = end
    out.append(text[last:])
    return "".join(out)
