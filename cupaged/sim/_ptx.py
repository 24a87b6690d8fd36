"""Translate the PTX text of one inline-asm statement into C++ calls of ``cupaged_sim_ptx.h``.

One C++ statement per PTX instruction, with PTX ISA semantics; the operand references ``%n`` have
already been replaced by the bound C++ locals (see ``_asm.py``). Registers are handled as raw bits
(``ptx::bits`` / ``ptx::set``), so a ``.f32`` instruction may take an ``r`` operand as PTX allows
``.b32`` registers there. ``{ }`` scopes, ``.reg`` declarations, ``@p`` / ``@!p`` guards and the
special registers ``%laneid``, ``%warpid``, ``%tid``, ``%ntid``, ``%ctaid``, ``%nctaid`` and
``%lanemask_*`` are understood. Anything else is a SimCompileError naming the opcode.
"""

from __future__ import annotations

import dataclasses
import re

from cupaged.sim._errors import SimCompileError

__all__ = ["Operand", "translate", "EMULATED"]

P = "::cupaged_sim::ptx::"
EMULATED = ("mma.sync.aligned.m16n8k{8,16,32}.row.col (f16/bf16/e4m3/e5m2 inputs, f32 or f16 accumulators)",
            "ldmatrix / stmatrix .sync.aligned.m8n8.x{1,2,4}{,.trans}.shared.b16",
            "cp.async.{ca,cg}.shared.global (+ src-size / ignore-src), cp.async.commit_group / wait_group / wait_all",
            "ld / st (.global .shared generic, .nc, cache hints, .v2 .v4), mov (incl. packing), cvta, cvt",
            "prmt, lop3, setp, selp, integer and f32 add/sub/mul/mad/fma/min/max/and/or/xor/not/shl/shr",
            "ex2 / lg2 / rcp / sqrt / rsqrt / tanh / sin / cos .approx, shfl.sync, bar.sync 0, bar.warp.sync, "
            "fence / membar")


@dataclasses.dataclass(frozen=True)
class Operand:
    index: int
    name: str | None
    var: str
    ctype: str
    letter: str


_SIZE = {"8": 1, "16": 2, "32": 4, "64": 8, "128": 16}
_INT = {"u8": "unsigned char", "s8": "signed char", "b8": "unsigned char", "u16": "unsigned short", "s16": "short",
        "b16": "unsigned short", "u32": "unsigned", "s32": "int", "b32": "unsigned", "u64": "unsigned long long",
        "s64": "long long", "b64": "unsigned long long", "pred": "bool"}
_REG_CTYPE = {1: "unsigned char", 2: "unsigned short", 4: "unsigned", 8: "unsigned long long"}
_SPECIAL = {"%laneid": f"{P}laneid()", "%warpid": f"{P}warpid()", "%lanemask_eq": f"(1u << {P}laneid())",
            "%lanemask_lt": f"((1u << {P}laneid()) - 1u)", "%lanemask_le": f"((2u << {P}laneid()) - 1u)",
            "%lanemask_gt": f"(~((2u << {P}laneid()) - 1u))", "%lanemask_ge": f"(~((1u << {P}laneid()) - 1u))",
            **{f"%{r}.{a}": f"{v}.{a}" for r, v in (("tid", "threadIdx"), ("ntid", "blockDim"), ("ctaid", "blockIdx"),
                                                     ("nctaid", "gridDim")) for a in "xyz"}}
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "lo": "<", "ls": "<=", "hi": ">",
        "hs": ">="}
_MATH = {"ex2": "exp2f(x)", "lg2": "log2f(x)", "rcp": "1.0f / x", "sqrt": "sqrtf(x)", "rsqrt": "1.0f / sqrtf(x)",
         "tanh": "tanhf(x)", "sin": "sinf(x)", "cos": "cosf(x)"}
_ALU = {"add": "a + b", "sub": "a - b", "mul": "a * b", "and": "a & b", "or": "a | b", "xor": "a ^ b",
        "shl": "(b >= W ? 0 : a << b)", "shr": "(b >= W ? (a < 0 ? -1 : 0) : a >> b)", "min": "(b < a ? b : a)",
        "max": "(a < b ? b : a)"}
_MMA_TYPES = {"f16": 0, "bf16": 1, "e4m3": 2, "e5m2": 3}


def _size(t: str) -> int:
    return _SIZE[re.sub(r"^[a-z]+|x2$", "", t)] * (2 if t.endswith("x2") else 1)


def _as(t: str, e: str) -> str:
    return f"{P}f32({e})" if t == "f32" else f"::cupaged_sim::from_bits<double>({e})" if t == "f64" else f"({_INT[t]})({e})"


def _from(t: str, e: str) -> str:
    if t == "f32":
        return f"{P}of((float)({e}))"
    return f"::cupaged_sim::to_bits((double)({e}))" if t == "f64" else f"(unsigned long long)({_INT[t]})({e})"


class _Statement:
    """Translation state of one asm statement: its PTX locals and where it came from."""

    def __init__(self, operands, line, where):
        self.vars = {o.var for o in operands}
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
        if tok in _SPECIAL:
            return f"(unsigned long long)({_SPECIAL[tok]})"
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


def _split_operands(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for c in s:
        depth += c in "{["
        depth -= c in "}]"
        if c == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += c
    return out + [cur] if cur.strip() else out


def translate(ptx: str, operands, line: int, where: str) -> str:
    """C++ for the PTX text ``ptx`` of one asm statement."""
    st = _Statement(operands, line, where)
    ptx = re.sub(r"/\*.*?\*/", " ", re.sub(r"//[^\n]*", " ", ptx), flags=re.S)
    code = []
    for raw in ptx.split(";"):
        s = raw.strip()
        while s[:1] in ("{", "}"):
            code.append(s[0])
            s = s[1:].strip()
        if not s:
            continue
        tail = ""
        while s.endswith("}") and s.count("}") > s.count("{"):  # a block's end, not a vector's
            tail += "}"
            s = s[:-1].strip()
        code.append(_instruction(st, s) + tail)
    return " ".join(code)


def _instruction(st: _Statement, s: str) -> str:
    m = re.match(r"\.reg\s+\.(\w+)\s+(.+)$", s, re.S)
    if m:
        t, decls = m.group(1), []
        ctype = "bool" if t == "pred" else _REG_CTYPE[_size(t)] if t in _INT or t[0] in "fb" else None
        for name in (x.strip() for x in m.group(2).split(",")):
            r = re.fullmatch(r"([%\w$]+)<(\d+)>", name)
            for n in ([f"{r.group(1)}{i}" for i in range(int(r.group(2)))] if r else [name]):
                st.locals[n] = "_cpr_" + re.sub(r"\W", "_", n)
                if t == "pred":
                    st.preds.add(st.locals[n])
                decls.append(f"{ctype} {st.locals[n]} = 0;")
        return " ".join(decls)
    guard = ""
    m = re.match(r"@(!?)\s*([%\w$]+)\s+(.*)$", s, re.S)
    if m:
        guard = f"if ({'!' if m.group(1) else ''}{st.lv(m.group(2))}) "
        s = m.group(3)
    opcode, _, rest = s.partition(" ")
    opcode = opcode.strip()
    st.opcode = opcode
    ops = _split_operands(rest.strip())
    parts = opcode.split(".")
    handler = _HANDLERS.get(parts[0])
    body = handler(st, parts, ops) if handler else None
    if body is None:
        raise st.error(f"the sim does not emulate the PTX instruction `{opcode}` (see README: what the sim emulates)")
    return guard + "{ " + body + " }"


def _mma(st, parts, ops):
    if len(parts) != 10 or parts[1:3] != ["sync", "aligned"] or parts[4:6] != ["row", "col"] or len(ops) != 4:
        return None
    m = re.fullmatch(r"m16n8k(8|16|32)", parts[3])
    d, a, b, c = parts[6:10]
    if not m or d != c:
        return None
    k, fp8 = int(m.group(1)), a in ("e4m3", "e5m2")
    ok = (k in (8, 16) and a == b and a in ("f16", "bf16") and d == "f32") or (k == 16 and a == b == d == "f16") \
        or (k == 32 and fp8 and b in ("e4m3", "e5m2") and d == "f32")
    if not ok:
        return None
    per = 4 if fp8 else 2
    na, nb, nc = 16 * k // 32 // per, 8 * k // 32 // per, 2 if d == "f16" else 4
    dv, av, bv, cv = st.vec(ops[0], nc), st.vec(ops[1], na), st.vec(ops[2], nb), st.vec(ops[3], nc)
    ins = ", ".join(f"(unsigned){st.val(x)}" for x in av + bv + cv)
    sets = " ".join(st.set(x, f"_out[{i}]") for i, x in enumerate(dv))
    return (f"static const char _site = 0; const unsigned _in[] = {{{ins}}}; unsigned _out[{nc}]; "
            f"{P}mma<{k}, {_MMA_TYPES[a]}, {_MMA_TYPES[b]}, {str(d == 'f16').lower()}>(&_site, {st.line}, _in, _out); {sets}")


def _matrix(st, parts, ops):
    store = parts[0] == "stmatrix"
    mods = [p for p in parts[1:] if p not in ("sync", "aligned", "m8n8", "b16", "trans", "shared", "shared::cta")]
    if parts[1:3] != ["sync", "aligned"] or "m8n8" not in parts or "b16" not in parts or len(mods) != 1 \
            or mods[0] not in ("x1", "x2", "x4") or len(ops) != 2:
        return None
    n, trans = int(mods[0][1]), str("trans" in parts).lower()
    if store:
        ins = ", ".join(f"(unsigned){st.val(x)}" for x in st.vec(ops[1], n))
        return (f"static const char _site = 0; const unsigned _in[] = {{{ins}}}; "
                f"{P}stmatrix<{n}, {trans}>(&_site, {st.line}, {st.addr(ops[0])}, _in);")
    sets = " ".join(st.set(x, f"_out[{i}]") for i, x in enumerate(st.vec(ops[0], n)))
    return f"static const char _site = 0; unsigned _out[{n}]; {P}ldmatrix<{n}, {trans}>(&_site, {st.line}, {st.addr(ops[1])}, _out); {sets}"


def _cp(st, parts, ops):
    if parts[1] != "async" or len(parts) < 3:
        return None
    if parts[2:] == ["commit_group"]:
        return f"{P}cp_async_commit();"
    if parts[2:] == ["wait_group"] and len(ops) == 1:
        return f"{P}cp_async_wait({st.val(ops[0])});"
    if parts[2:] == ["wait_all"]:
        return f"{P}cp_async_wait_all();"
    hints = [p for p in parts[5:] if "::" in p]
    if parts[2] not in ("ca", "cg") or parts[3] not in ("shared", "shared::cta") or parts[4] != "global" \
            or len(hints) != len(parts) - 5 or not 3 <= len(ops) <= 5:
        return None
    if "L2::cache_hint" in hints:
        ops = ops[:-1]  # the cache policy operand: a hint only
    size = st.val(ops[2])
    if len(ops) < 4:
        src_size = size
    elif st.locals.get(ops[3].strip().lstrip("!")) in st.preds:
        neg = "!" if ops[3].strip().startswith("!") else ""
        src_size = f"({neg}{st.lv(ops[3].strip().lstrip('!'))} ? 0ull : {size})"  # ignore-src predicate
    else:
        src_size = st.val(ops[3])
    if parts[2] == "cg" and not re.fullmatch(r"(0x10|16)", ops[2].strip()):
        if ops[2].strip() not in st.vars:
            raise st.error(f"{st.opcode}: .cg copies 16 bytes (cp-size must be 16)")
    return (f"{P}cp_async({st.addr(ops[0])}, {st.addr(ops[1])}, (unsigned){size}, (long long){src_size}, "
            f"{st.line}, \"{st.opcode}\");")


_SKIP = {"weak", "volatile", "relaxed", "acquire", "release", "sys", "gpu", "cta", "nc", "ca", "cg", "cs", "lu",
         "cv", "wb", "wt"}


def _ldst(st, parts, ops):
    space, vec, t = 0, 1, parts[-1]
    for p in parts[1:-1]:
        if p in ("global",):
            space = 1
        elif p in ("shared", "shared::cta"):
            space = 2
        elif re.fullmatch(r"v[248]", p):
            vec = int(p[1])
        elif p not in _SKIP and "::" not in p:
            return None
    if t not in _INT and t not in ("f16", "bf16", "f32", "f64", "f16x2", "bf16x2", "b128") or len(ops) != 2:
        return None
    size = _size(t)
    load = parts[0] == "ld"
    regs = st.vec(ops[0 if load else 1], vec) if vec > 1 else [ops[0 if load else 1]]
    head = f"char* _p = {P}address({space}, {st.addr(ops[1 if load else 0])}, {size * vec}, {st.line}, \"{st.opcode}\");"
    sign = str(t.startswith("s")).lower()
    body = [st.set(r, f"{P}load(_p + {i * size}, {size}, {sign})") if load
            else f"{P}store(_p + {i * size}, {size}, {st.val(r)});" for i, r in enumerate(regs)]
    return " ".join([head, *body])


def _mov(st, parts, ops):
    if len(parts) != 2 or len(ops) != 2:
        return None
    size = _size(parts[1])
    d, a = ops[0].strip(), ops[1].strip()
    if a.startswith("{"):
        items = st.vec(a)
        w = 8 * size // len(items)
        e = " | ".join(f"(({st.val(x)} & {hex((1 << w) - 1)}ull) << {w * i})" for i, x in enumerate(items))
        return st.set(d, f"({e})")
    if d.startswith("{"):
        items = st.vec(d)
        w = 8 * size // len(items)
        return " ".join(st.set(x, f"({st.val(a)} >> {w * i}) & {hex((1 << w) - 1)}ull") for i, x in enumerate(items))
    return st.set(d, st.val(a))


def _cvt(st, parts, ops):
    mods = set(parts[1:-2])
    dt, at = parts[-2], parts[-1]
    relu = str("relu" in mods).lower()
    f8 = {"e4m3x2": "false", "e5m2x2": "true"}
    if mods - {"rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi", "ftz", "sat", "satfinite", "relu"}:
        return None
    if dt in ("f16x2", "bf16x2") and at == "f32" and len(ops) == 3 and "rn" in mods:
        return st.set(ops[0], f"{P}cvt_x2_f32({P}f32({st.val(ops[1])}), {P}f32({st.val(ops[2])}), "
                              f"{str(dt == 'bf16x2').lower()}, {relu}, {str('satfinite' in mods).lower()})")
    if dt in f8 and "satfinite" in mods and "rn" in mods:
        if at == "f32" and len(ops) == 3:
            return st.set(ops[0], f"{P}cvt_fp8x2_f32({P}f32({st.val(ops[1])}), {P}f32({st.val(ops[2])}), {f8[dt]}, {relu})")
        if at == "f16x2" and len(ops) == 2:
            return st.set(ops[0], f"{P}cvt_fp8x2_f16x2((unsigned){st.val(ops[1])}, {f8[dt]}, {relu})")
    if dt == "f16x2" and at in f8 and len(ops) == 2 and "rn" in mods:
        return st.set(ops[0], f"{P}cvt_f16x2_fp8x2((unsigned short){st.val(ops[1])}, {f8[at]}, {relu})")
    if len(ops) != 2 or mods - {"rn", "rzi", "ftz", "sat"} or "relu" in mods:
        return None
    x = st.val(ops[1])
    if at in ("f16", "bf16"):
        x = f"{P}{at}_value((unsigned short){x})"
    elif at in ("f32", "f64"):
        x = _as(at, x)
    elif at in _INT:
        x = f"({_INT[at]})({x})"
    else:
        return None
    if "ftz" in mods:
        x = f"{P}ftz({x})"
    if dt in ("f16", "bf16") and "rn" in mods:
        return st.set(ops[0], f"{P}{dt}_bits((float)({x}))")
    if dt in ("f32", "f64"):
        return st.set(ops[0], _from(dt, x))
    if dt in _INT and (at in _INT or "rzi" in mods):  # integer widths; float -> int truncates
        return st.set(ops[0], _from(dt, x))
    return None


def _cvta(st, parts, ops):
    if len(ops) != 2 or parts[-1] not in ("u32", "u64"):
        return None
    if parts[1:3] == ["to", "shared"] or parts[1:3] == ["to", "shared::cta"]:
        return st.set(ops[0], f"{P}to_shared((const void*)(uintptr_t){st.val(ops[1])}, {st.line})")
    if parts[1] in ("shared", "shared::cta"):
        return st.set(ops[0], f"(unsigned long long)(uintptr_t)(::cupaged_sim::g.smem_base + {st.val(ops[1])})")
    if parts[1:3] == ["to", "global"] or parts[1] == "global":
        return st.set(ops[0], st.val(ops[1]))
    return None


def _simple(st, parts, ops):
    """prmt, lop3, setp, selp, ALU ops and approximate math."""
    op, t = parts[0], parts[-1]
    if op == "prmt" and t == "b32" and len(ops) == 4:
        modes = ["f4e", "b4e", "rc8", "ecl", "ecr", "rc16"]
        mode = modes.index(parts[1]) if len(parts) == 3 and parts[1] in modes else -1 if len(parts) == 2 else None
        if mode is None:
            return None
        a, b, c = (f"(unsigned){st.val(x)}" for x in ops[1:])
        return st.set(ops[0], f"{P}prmt({a}, {b}, {c}, {mode})")
    if op == "lop3" and parts[1:] == ["b32"] and len(ops) == 5:
        return st.set(ops[0], f"{P}lop3({', '.join(f'(unsigned){st.val(x)}' for x in ops[1:])})")
    if op == "setp" and len(parts) == 3 and len(ops) == 3:
        cmp, a, b = parts[1], _as(t, st.val(ops[1])), _as(t, st.val(ops[2]))
        if t in ("f32", "f64") and cmp.endswith("u") and cmp[:-1] in _CMP:
            e = f"(({a}) != ({a}) || ({b}) != ({b}) || ({a}) {_CMP[cmp[:-1]]} ({b}))"
        elif cmp in ("num", "nan") and t in ("f32", "f64"):
            e = f"{'!' if cmp == 'num' else ''}(({a}) != ({a}) || ({b}) != ({b}))"
        elif cmp in _CMP:
            e = f"(({a}) {_CMP[cmp]} ({b}))"
        else:
            return None
        return f"{st.lv(ops[0])} = {e};"
    if op == "selp" and len(ops) == 4:
        return st.set(ops[0], f"({st.val(ops[3])} ? {st.val(ops[1])} : {st.val(ops[2])})")
    if op in _MATH and len(ops) == 2 and t == "f32" and set(parts[1:-1]) <= {"approx", "ftz", "rn"}:
        flush = "ftz" in parts
        x = f"{P}ftz({P}f32({st.val(ops[1])}))" if flush else f"{P}f32({st.val(ops[1])})"
        e = f"[](float x) {{ return {_MATH[op]}; }}({x})"
        return st.set(ops[0], f"{P}of({P}ftz({e}))" if flush else f"{P}of({e})")
    if op in _ALU or op in ("mad", "fma", "not"):
        mods = parts[1:-1]
        if t not in _INT and t not in ("f32", "f64") or t == "pred" or any(m not in ("lo", "rn", "wide") for m in mods):
            return None
        if "wide" in mods:
            wt = t[0] + str(2 * int(t[1:]))
            a, b = (f"({_INT[wt]}){_as(t, st.val(x))}" for x in ops[1:3])
            return st.set(ops[0], _from(wt, f"{a} * {b}"))
        v = [_as(t, st.val(x)) for x in ops[1:]]
        if op == "not":
            return st.set(ops[0], _from(t, f"~{v[0]}"))
        if op in ("mad", "fma"):
            e = f"{v[0]} * {v[1]} + {v[2]}" if t in _INT else f"fma({v[0]}, {v[1]}, {v[2]})"
            return st.set(ops[0], _from(t, e))
        e = "a * b" if op == "mul" else _ALU[op]
        return st.set(ops[0], _from(t, e.replace("a", f"({v[0]})", 1).replace("b", f"({v[1]})", 1)
                                    if op != "min" and op != "max" else
                                    f"[](auto a, auto b) {{ return {e}; }}({v[0]}, {v[1]})"))
    return None


def _sync(st, parts, ops):
    if parts[0] in ("fence", "membar"):
        return ";"
    if parts[0] == "shfl" and parts[1] == "sync" and len(parts) == 4 and parts[3] == "b32" and len(ops) == 5:
        kinds = {"idx": "SHFL_IDX", "up": "SHFL_UP", "down": "SHFL_DOWN", "bfly": "SHFL_XOR"}
        if parts[2] not in kinds:
            return None
        a, b, c, mask = (st.val(x) for x in ops[1:])
        return st.set(ops[0], f"::cupaged_sim::collective(::cupaged_sim::{kinds[parts[2]]}, (unsigned){mask}, "
                              f"(unsigned){a}, (int){b}, 32 - int(({c} >> 8) & 31u), {st.line})")
    if parts[0] in ("bar", "barrier") and parts[1:] in (["sync"], ["cta", "sync"]) and len(ops) == 1 \
            and ops[0].strip() == "0":
        return f"static const char _site = 0; ::cupaged_sim::barrier(0, 0, {st.line}, &_site);"
    if parts[0] == "bar" and parts[1:] == ["warp", "sync"] and len(ops) == 1:
        return f"::cupaged_sim::collective(::cupaged_sim::SYNCWARP, (unsigned){st.val(ops[0])}, 0, 0, 32, {st.line});"
    return None


_HANDLERS = {"mma": _mma, "ldmatrix": _matrix, "stmatrix": _matrix, "cp": _cp, "ld": _ldst, "st": _ldst,
             "mov": _mov, "cvt": _cvt, "cvta": _cvta, "fence": _sync, "membar": _sync, "shfl": _sync, "bar": _sync,
             "barrier": _sync, **{k: _simple for k in ("prmt", "lop3", "setp", "selp", "not", "mul", "mad", "fma",
                                                       *_MATH, *_ALU)}}
