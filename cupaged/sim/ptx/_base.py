"""Shared pieces of the PTX translation: operand kinds, type helpers, one statement's state.

Registers are handled as raw bits (``ptx::bits`` / ``ptx::set``), so a ``.f32`` instruction may take
an ``r`` operand, as PTX allows ``.b32`` registers there.
"""

from __future__ import annotations

import dataclasses
import re

from cupaged.sim._errors import SimCompileError

P = "::cupaged_sim::ptx::"


@dataclasses.dataclass(frozen=True)
class Operand:
    index: int
    name: str | None
    var: str
    ctype: str
    letter: str
    output: bool = False  # an output (its C++ lvalue is bound as _cpo<index>)
    expr: str = ""  # the C++ expression it binds


BITS_SIZE = {"8": 1, "16": 2, "32": 4, "64": 8, "128": 16}
INT_TYPES = {"u8": "unsigned char", "s8": "signed char", "b8": "unsigned char", "u16": "unsigned short", "s16": "short",
        "b16": "unsigned short", "u32": "unsigned", "s32": "int", "b32": "unsigned", "u64": "unsigned long long",
        "s64": "long long", "b64": "unsigned long long", "pred": "bool"}
REG_CTYPE = {1: "unsigned char", 2: "unsigned short", 4: "unsigned", 8: "unsigned long long"}
SPECIAL = {"%laneid": f"{P}laneid()", "%warpid": f"{P}warpid()", "%lanemask_eq": f"(1u << {P}laneid())",
            "%lanemask_lt": f"((1u << {P}laneid()) - 1u)", "%lanemask_le": f"((2u << {P}laneid()) - 1u)",
            "%lanemask_gt": f"(~((2u << {P}laneid()) - 1u))", "%lanemask_ge": f"(~((1u << {P}laneid()) - 1u))",
            # the source was preprocessed before the rewrite: threadIdx & co. are spelled as their macros expand
            **{f"%{r}.{a}": f"::cupaged_sim::{v}.{a}" for r, v in (("tid", "g.cur->tid"), ("ntid", "g.block"),
                                                                   ("ctaid", "g.block_idx"), ("nctaid", "g.grid"))
               for a in "xyz"},
            # a launch is one cluster of one CTA per cluster (the sim runs no clusters)
            "%cluster_ctarank": "0u", "%cluster_nctarank": "1u", "%is_explicit_cluster": "0u",
            **{f"%cluster_ctaid.{a}": "0u" for a in "xyz"}, **{f"%cluster_nctaid.{a}": "1u" for a in "xyz"},
            **{f"%clusterid.{a}": f"::cupaged_sim::g.block_idx.{a}" for a in "xyz"},
            **{f"%nclusterid.{a}": f"::cupaged_sim::g.grid.{a}" for a in "xyz"}}

def size_of(t: str) -> int:
    return BITS_SIZE[re.sub(r"^[a-z]+|x2$", "", t)] * (2 if t.endswith("x2") else 1)


def as_type(t: str, e: str) -> str:
    return f"{P}f32({e})" if t == "f32" else f"::cupaged_sim::from_bits<double>({e})" if t == "f64" else f"({INT_TYPES[t]})({e})"


def from_type(t: str, e: str) -> str:
    if t == "f32":
        return f"{P}of((float)({e}))"
    return f"::cupaged_sim::to_bits((double)({e}))" if t == "f64" else f"(unsigned long long)({INT_TYPES[t]})({e})"


class Statement:
    """Translation state of one asm statement: its PTX locals and where it came from."""

    def __init__(self, operands, line, where):
        self.vars = {o.var for o in operands}
        self.lvalues = {o.var: f"_cpo{o.index}" for o in operands if o.output}  # output var -> its C++ lvalue
        self.exprs = {o.var: o.expr for o in operands if not o.output}  # input var -> its C++ expression
        self.letters = {o.var: o.letter for o in operands}  # var -> its constraint letter
        self.locals: dict[str, str] = {}  # PTX name -> C++ name
        self.preds: set[str] = set()  # C++ names of .pred locals
        self.line, self.where = line, where
        self.opcode = ""

    def error(self, what: str):
        return SimCompileError(f"{self.where}: {what}")

    def val(self, tok: str) -> str:
        tok = tok.strip()
        if tok in self.vars:
            return f"{P}bits({tok})"
        if tok in self.locals:
            return f"{P}bits({self.locals[tok]})"
        if tok in SPECIAL:
            return f"(unsigned long long)({SPECIAL[tok]})"
        if re.fullmatch(r"0[fF][0-9a-fA-F]{8}|0[dD][0-9a-fA-F]{16}", tok):
            return f"0x{tok[2:]}ull"
        if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|0[bB][01]+|\d+)[uU]?", tok):
            return f"(unsigned long long)(long long)({tok.rstrip('uU')})"
        raise self.error(f"{self.opcode}: the sim cannot read the operand {tok!r}")

    def lv(self, tok: str) -> str:
        tok = tok.strip()
        if tok in self.vars or tok in self.locals.values():
            return tok
        if tok in self.locals:
            return self.locals[tok]
        raise self.error(f"{self.opcode}: {tok!r} is not a register it can write")

    def set(self, tok: str, e: str) -> str:
        return f"{P}set({self.lv(tok)}, {e});"

    def addr(self, tok: str) -> str:
        m = re.fullmatch(r"\[\s*([^\]+-]+?)\s*(?:([+-])\s*(\w+)\s*)?\]", tok.strip())
        if not m:
            raise self.error(f"{self.opcode}: expected a memory operand [reg] or [reg+imm], got {tok.strip()!r}")
        base = self.val(m.group(1))
        return f"({base} + (unsigned long long)(long long)({m.group(2)}{m.group(3)}))" if m.group(2) else base

    def vec(self, tok: str, n: int | None = None) -> list[str]:
        tok = tok.strip()
        if not (tok.startswith("{") and tok.endswith("}")):
            raise self.error(f"{self.opcode}: expected a vector operand {{...}}, got {tok!r}")
        items = [x.strip() for x in tok[1:-1].split(",")]
        if n is not None and len(items) != n:
            raise self.error(f"{self.opcode}: expected {n} registers in {tok}, got {len(items)}")
        return items


def literal_end(s: str, i: int) -> int:
    """The index after the string or character literal that starts at ``s[i]``."""
    quote, j = s[i], i + 1
    while s[j] != quote:
        j += 2 if s[j] == "\\" else 1
    return j + 1


def split_top(s: str, sep: str, start: int = 0) -> tuple[list[str], int]:
    """``s[start:]`` split at ``sep`` outside brackets and literals, up to the first unmatched
    closing bracket or the end: (the parts, the index where the scan stopped)."""
    parts, depth, i, mark = [], 0, start, start
    while i < len(s):
        c = s[i]
        if c in "\"'":
            i = literal_end(s, i)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(s[mark:i])
            mark = i + 1
        i += 1
    parts.append(s[mark:i])
    return parts, i


def split_commas(s: str) -> list[str]:
    """Comma-separated items of ``s`` (asm operands, PTX operands); an empty or blank ``s`` has none."""
    parts = split_top(s, ",")[0]
    return parts[:-1] if not parts[-1].strip() else parts


