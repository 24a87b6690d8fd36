"""Translate the PTX text of one inline-asm statement into C++ calls of ``cupaged_sim_ptx.h``.

One C++ statement per PTX instruction, with PTX ISA semantics; the operand references ``%n`` have
already been replaced by the bound C++ locals (see ``_asm.py``). Registers are handled as raw bits
(``ptx::bits`` / ``ptx::set``), so a ``.f32`` instruction may take an ``r`` operand as PTX allows
``.b32`` registers there. ``{ }`` scopes, ``.reg`` declarations, ``@p`` / ``@!p`` guards and the
special registers ``%laneid``, ``%warpid``, ``%tid``, ``%ntid``, ``%ctaid``, ``%nctaid`` and
``%lanemask_*`` are understood. Anything else is a SimCompileError naming the opcode. The
warp-wide, memory and synchronizing instructions are in ``_memory_ops.py``; shared pieces in
``_base.py``.
"""

from __future__ import annotations

import re

from cupaged.sim.ptx._base import INT_TYPES, REG_CTYPE, Operand, P, Statement, as_type, from_type, size_of, split_commas
from cupaged.sim.ptx._hopper_ops import HANDLERS as HOPPER
from cupaged.sim.ptx._memory_ops import cp, cvta, ldst, matrix, mma, mov, sync

__all__ = ["Operand", "translate", "EMULATED"]

EMULATED = ("mma.sync.aligned.m16n8k{8,16,32}.row.col (f16/bf16/e4m3/e5m2 inputs, f32 or f16 accumulators)",
            "ldmatrix / stmatrix .sync.aligned.m8n8.x{1,2,4}{,.trans}.shared.b16",
            "cp.async.{ca,cg}.shared.global (+ src-size / ignore-src), cp.async.commit_group / wait_group / wait_all",
            "ld / st (.global .shared generic, .nc, cache hints, .v2 .v4), mov (incl. packing), cvta, cvt",
            "prmt, lop3, setp, selp, integer and f32 add/sub/mul/mad/fma/min/max/and/or/xor/not/shl/shr",
            "ex2 / lg2 / rcp / sqrt / rsqrt / tanh / sin / cos .approx, shfl.sync, bar.sync 0, bar.warp.sync, "
            "fence / membar",
            "wgmma.mma_async m64nNk16 (f16/bf16) / m64nNk32 (e4m3/e5m2), A from registers or a descriptor; "
            "wgmma.fence / commit_group / wait_group",
            "mbarrier.init / arrive(.expect_tx) / arrive_drop / expect_tx / complete_tx / try_wait / test_wait "
            "(.parity) / inval, cp.async.mbarrier.arrive(.noinc)",
            "cp.async.bulk global <-> shared, cp.async.bulk.tensor 1d-5d .tile (tensor maps), commit_group / "
            "wait_group",
            "bar.sync / bar.arrive id, count (named barriers), elect.sync, setmaxnreg, fence.proxy.async, "
            "griddepcontrol, createpolicy, prefetch, mapa (one-CTA clusters), labels and bra")


_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "lo": "<", "ls": "<=", "hi": ">",
        "hs": ">="}
_MATH = {"ex2": "exp2f(x)", "lg2": "log2f(x)", "rcp": "1.0f / x", "sqrt": "sqrtf(x)", "rsqrt": "1.0f / sqrtf(x)",
         "tanh": "tanhf(x)", "sin": "sinf(x)", "cos": "cosf(x)"}
_ALU = {"add": "a + b", "sub": "a - b", "mul": "a * b", "and": "a & b", "or": "a | b", "xor": "a ^ b",
        "shl": "(b >= W ? 0 : a << b)", "shr": "(b >= W ? (a < 0 ? -1 : 0) : a >> b)", "min": "(b < a ? b : a)",
        "max": "(a < b ? b : a)"}

def translate(ptx: str, operands, line: int, where: str) -> str:
    """C++ for the PTX text ``ptx`` of one asm statement."""
    st = Statement(operands, line, where)
    ptx = re.sub(r"/\*.*?\*/", " ", re.sub(r"//[^\n]*", " ", ptx), flags=re.S)
    code, labels = [], []
    for raw in ptx.split(";"):
        s = raw.strip()
        while True:
            while s[:1] in ("{", "}"):
                code.append(s[0])
                s = s[1:].strip()
            m = re.match(r"([A-Za-z_$][\w$]*)\s*:(?!:)\s*", s)
            if not m:
                break
            labels.append(_label(m.group(1)))
            code.append(f"{labels[-1]}: ;")
            s = s[m.end():]
        if not s:
            continue
        tail = ""
        while s.endswith("}") and s.count("}") > s.count("{"):  # a block's end, not a vector's
            tail += "}"
            s = s[:-1].strip()
        code.append(_instruction(st, s) + tail)
    if labels:  # block-scoped labels (GCC's __label__): an asm statement inlined twice declares them twice
        return "{ __label__ " + ", ".join(labels) + "; " + " ".join(code) + " }"
    return " ".join(code)


def _label(name: str) -> str:
    return "_cpl_" + re.sub(r"\W", "_", name)


def _branch(st, parts, ops):
    if parts[1:] not in ([], ["uni"]) or len(ops) != 1:
        return None
    return f"goto {_label(ops[0].strip())};"


def _instruction(st: Statement, s: str) -> str:
    m = re.match(r"\.reg\s+\.(\w+)\s+(.+)$", s, re.S)
    if m:
        t, decls = m.group(1), []
        ctype = "bool" if t == "pred" else REG_CTYPE[size_of(t)] if t in INT_TYPES or t[0] in "fb" else None
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
    ops = split_commas(rest.strip())
    parts = opcode.split(".")
    handler = _HANDLERS.get(parts[0])
    body = handler(st, parts, ops) if handler else None
    if body is None:
        raise st.error(f"the sim does not emulate the PTX instruction `{opcode}` (see docs/sim.md: what the sim emulates)")
    return guard + "{ " + body + " }"


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
        x = as_type(at, x)
    elif at in INT_TYPES:
        x = f"({INT_TYPES[at]})({x})"
    else:
        return None
    if "ftz" in mods:
        x = f"{P}ftz({x})"
    if dt in ("f16", "bf16") and "rn" in mods:
        return st.set(ops[0], f"{P}{dt}_bits((float)({x}))")
    if dt in ("f32", "f64"):
        return st.set(ops[0], from_type(dt, x))
    if dt in INT_TYPES and (at in INT_TYPES or "rzi" in mods):  # integer widths; float -> int truncates
        return st.set(ops[0], from_type(dt, x))
    return None


def _simple(st, parts, ops):
    """prmt, lop3, setp, selp, ALU ops and approximate math."""
    op, t = parts[0], parts[-1]
    if op == "prmt" and parts[1:2] == ["b32"] and len(ops) == 4:  # prmt.b32{.mode}
        modes = ["f4e", "b4e", "rc8", "ecl", "ecr", "rc16"]
        mode = modes.index(parts[2]) if len(parts) == 3 and parts[2] in modes else -1 if len(parts) == 2 else None
        if mode is None:
            return None
        a, b, c = (f"(unsigned){st.val(x)}" for x in ops[1:])
        return st.set(ops[0], f"{P}prmt({a}, {b}, {c}, {mode})")
    if op == "lop3" and parts[1:] == ["b32"] and len(ops) == 5:
        return st.set(ops[0], f"{P}lop3({', '.join(f'(unsigned){st.val(x)}' for x in ops[1:])})")
    if op == "setp" and len(parts) == 3 and len(ops) == 3:
        cmp, a, b = parts[1], as_type(t, st.val(ops[1])), as_type(t, st.val(ops[2]))
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
        if t not in INT_TYPES and t not in ("f32", "f64") or t == "pred" or any(m not in ("lo", "rn", "wide") for m in mods):
            return None
        if "wide" in mods:
            wt = t[0] + str(2 * int(t[1:]))
            a, b = (f"({INT_TYPES[wt]}){as_type(t, st.val(x))}" for x in ops[1:3])
            return st.set(ops[0], from_type(wt, f"{a} * {b}"))
        # integer arithmetic wraps: compute it unsigned (signed overflow is undefined in C++)
        ct = t if t in ("f32", "f64") or op in ("shr", "min", "max") else "u" + t[1:]
        v = [as_type(ct, st.val(x)) for x in ops[1:]]
        if op == "not":
            return st.set(ops[0], from_type(ct, f"~{v[0]}"))
        if op in ("mad", "fma"):
            e = f"{v[0]} * {v[1]} + {v[2]}" if t in INT_TYPES else f"fma({v[0]}, {v[1]}, {v[2]})"
            return st.set(ops[0], from_type(ct, e))
        if op in ("shl", "shr"):
            v[1] = f"(unsigned){st.val(ops[2])}"
        e = _ALU[op].replace("W", str(8 * size_of(t)))
        return st.set(ops[0], from_type(ct, f"[](auto a, auto b) {{ return {e}; }}({v[0]}, {v[1]})"))
    return None


_HANDLERS = {"mma": mma, "ldmatrix": matrix, "stmatrix": matrix, "cp": cp, "ld": ldst, "st": ldst,
             "mov": mov, "cvt": _cvt, "cvta": cvta, "fence": sync, "membar": sync, "shfl": sync, "bar": sync,
             "barrier": sync, **{k: _simple for k in ("prmt", "lop3", "setp", "selp", "not", "mul", "mad", "fma",
                                                       *_MATH, *_ALU)}, **HOPPER, "bra": _branch}
