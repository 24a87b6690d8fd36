"""PTX translation of the warp-wide, memory and synchronizing instructions: mma.sync, ldmatrix,
stmatrix, cp.async, ld / st, mov, cvta, shfl.sync, bar and fence (see ``_translate.py``)."""

from __future__ import annotations

import re

from cupaged.sim.ptx._base import INT_TYPES, P, size_of

_MMA_TYPES = {"f16": 0, "bf16": 1, "e4m3": 2, "e5m2": 3}


def mma(st, parts, ops):
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


def matrix(st, parts, ops):
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


def cp(st, parts, ops):
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


def ldst(st, parts, ops):
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
    if t not in INT_TYPES and t not in ("f16", "bf16", "f32", "f64", "f16x2", "bf16x2", "b128") or len(ops) != 2:
        return None
    size = size_of(t)
    load = parts[0] == "ld"
    regs = st.vec(ops[0 if load else 1], vec) if vec > 1 else [ops[0 if load else 1]]
    head = (f"char* _p = {P}address({space}, {st.addr(ops[1 if load else 0])}, {size * vec}, {st.line}, "
            f"\"{st.opcode}\", {'false' if load else 'true'});")
    sign = str(t.startswith("s")).lower()
    body = [st.set(r, f"{P}load(_p + {i * size}, {size}, {sign})") if load
            else f"{P}store(_p + {i * size}, {size}, {st.val(r)});" for i, r in enumerate(regs)]
    return " ".join([head, *body])


def mov(st, parts, ops):
    if len(parts) != 2 or len(ops) != 2:
        return None
    if parts[1] == "pred":
        return f"{st.lv(ops[0])} = ({st.val(ops[1])}) != 0;"
    size = size_of(parts[1])
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


def cvta(st, parts, ops):
    if len(ops) != 2 or parts[-1] not in ("u32", "u64"):
        return None
    if parts[1:3] == ["to", "shared"] or parts[1:3] == ["to", "shared::cta"]:
        return st.set(ops[0], f"{P}to_shared((const void*)(uintptr_t){st.val(ops[1])}, {st.line})")
    if parts[1] in ("shared", "shared::cta"):
        return st.set(ops[0], f"(unsigned long long)(uintptr_t)(::cupaged_sim::g.smem_base + {st.val(ops[1])})")
    if parts[1:3] == ["to", "global"] or parts[1] == "global":
        return st.set(ops[0], st.val(ops[1]))
    return None


def sync(st, parts, ops):
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


