"""PTX translation of Hopper's instructions (sm_90a): wgmma, mbarrier, cp.async.bulk(.tensor),
cp.async.mbarrier.arrive, named barriers, elect.sync, setmaxnreg, fence.proxy.async and the hints
and no-ops around them (griddepcontrol, createpolicy, prefetch.tensormap). Their semantics are in
``cupaged_sim_async.h``, ``cupaged_sim_hopper.h`` and ``cupaged_sim_wgmma.h``; forms these do not
handle fall through to ``_memory_ops.py`` or are a SimCompileError.
"""

from __future__ import annotations

import re

from cupaged.sim.ptx._base import P
from cupaged.sim.ptx import _memory_ops

E = "::cupaged_sim::"
_TYPES = {"f16": 0, "bf16": 1, "e4m3": 2, "e5m2": 3}
_SEM = {"release", "relaxed", "acquire", "cta", "cluster", "shared", "shared::cta", "shared::cluster", "b64", "sync",
        "aligned"}


def _shared(st, parts, tok):
    """A shared address operand: the register holds a shared address, or a generic one without a state space."""
    a = st.addr(tok)
    space = any(p.startswith("shared") for p in parts)
    return a if space else f"{P}to_shared((const void*)(uintptr_t)({a}), {st.line})"


def _site(body):
    return "static const char _site = 0; " + body


def wgmma(st, parts, ops):
    if parts[1:] == ["fence", "sync", "aligned"] and not ops:
        return f"{P}wgmma_fence();"
    if parts[1:] == ["commit_group", "sync", "aligned"] and not ops:
        return f"{P}wgmma_commit();"
    if parts[1:] == ["wait_group", "sync", "aligned"] and len(ops) == 1:
        return f"{P}wgmma_wait({st.val(ops[0])}, {st.line});"
    if parts[1:4] != ["mma_async", "sync", "aligned"] or len(parts) != 8:
        return None
    shape, d, a, b = parts[4:]
    m = re.fullmatch(r"m64n(\d+)k(16|32)", shape)
    if not m or a not in _TYPES or b not in _TYPES or d not in ("f32", "f16"):
        return None
    n, k, fp8 = int(m.group(1)), int(m.group(2)), a in ("e4m3", "e5m2")
    ok = (k == 16 and a == b and not fp8 and (d == "f32" or a == "f16")) or (k == 32 and fp8 and b in ("e4m3", "e5m2"))
    if not ok or n % 8 or not 8 <= n <= 256:
        return None
    a_regs = ops[1].strip().startswith("{") if len(ops) > 1 else False
    want = 6 if fp8 else 7 if a_regs else 8
    if len(ops) != want:
        raise st.error(f"{st.opcode}: expected {want} operands, got {len(ops)}")
    nd = n // 4 if d == "f16" else n // 2
    dv = st.vec(ops[0], nd)
    addrs = []
    for x in dv:
        lv = st.lvalues.get(x.strip())
        if lv is None:
            raise st.error(f"{st.opcode}: accumulator {x.strip()} must be an output operand of the asm statement "
                           "(\"+f\" / \"+r\"): the sim lands the result through it at wgmma.wait_group")
        addrs.append(f"(void*)&{lv}")
    pred = ops[3].strip()
    scale_d = st.lv(pred) if st.locals.get(pred) in st.preds else f"({st.val(pred)} != 0)"
    imm = [st.val(x) for x in ops[4:]]
    trans_a, trans_b = (("0", "0") if fp8 else ("0", imm[2]) if a_regs else (imm[2], imm[3]))
    ains = "void* const _ar[4] = {nullptr, nullptr, nullptr, nullptr}; "
    if a_regs:  # A's registers, and the variables they came from (poisoned while the wgmma reads them)
        av = [x.strip() for x in st.vec(ops[1], 4)]
        where = [f"{P}lvalue_address(({st.exprs[x]}))" if st.exprs.get(x) else "nullptr" for x in av]
        ains = (f"unsigned _a[4] = {{{', '.join(f'(unsigned){st.val(x)}' for x in av)}}}; "
                f"void* const _ar[4] = {{{', '.join(where)}}}; ")
    desc_a = "0ull" if a_regs else st.val(ops[1])
    sets = " ".join(st.set(x, f"_d[{i}]") for i, x in enumerate(dv))
    return _site(f"unsigned _d[{nd}] = {{{', '.join(f'(unsigned){st.val(x)}' for x in dv)}}}; "
                 f"void* const _r[{nd}] = {{{', '.join(addrs)}}}; {ains}"
                 f"{P}WgmmaArgs _w{{{n}, {_TYPES[a]}, {_TYPES[b]}, {int(d == 'f16')}, "
                 f"{P}imm01({trans_a}, {st.line}), {P}imm01({trans_b}, {st.line}), {P}neg({imm[0]}, {st.line}), "
                 f"{P}neg({imm[1]}, {st.line}), {desc_a}, {st.val(ops[2])}, (int)({scale_d}), "
                 f"{'_a' if a_regs else 'nullptr'}, _d}}; {P}wgmma(&_site, {st.line}, _w, _r, _ar); {sets}")


def mbarrier(st, parts, ops):
    op, mods = parts[1], set(parts[2:])
    name = f'"{st.opcode}"'
    if op == "init" and mods <= _SEM and len(ops) == 2:
        return f"{P}mbarrier_init({_shared(st, parts, ops[0])}, {st.val(ops[1])}, {st.line});"
    if op == "inval" and mods <= _SEM and len(ops) == 1:
        return f"{P}mbarrier_inval({_shared(st, parts, ops[0])}, {st.line});"
    if op in ("expect_tx", "complete_tx") and mods <= _SEM and len(ops) == 2:
        sign = "" if op == "expect_tx" else "-"
        return f"{P}mbarrier_tx({_shared(st, parts, ops[0])}, {sign}(long long){st.val(ops[1])}, {st.line}, {name});"
    if op in ("arrive", "arrive_drop") and mods - {"expect_tx"} <= _SEM and len(ops) in (2, 3):
        tx = "expect_tx" in mods
        if tx and len(ops) != 3:
            return None
        count = "1" if tx or len(ops) == 2 else f"(long long){st.val(ops[2])}"
        txv = f"(long long){st.val(ops[2])}" if tx else "0"
        call = (f"{P}mbarrier_arrive({_shared(st, parts, ops[1])}, {count}, {txv}, {str(op == 'arrive_drop').lower()}, "
                f"{st.line}, {name})")
        return f"{call};" if ops[0].strip() == "_" else st.set(ops[0], call)
    if op in ("try_wait", "test_wait") and mods - {"parity"} <= _SEM and len(ops) in (3, 4):
        if len(ops) == 4 and op == "test_wait":
            return None  # a suspend-time hint: try_wait only
        call = (f"{P}mbarrier_wait({_shared(st, parts, ops[1])}, {str('parity' in mods).lower()}, {st.val(ops[2])}, "
                f"{str(op == 'try_wait').lower()}, {st.line}, {name})")
        return f"{st.lv(ops[0])} = {call};"
    return None


def _tensor_operand(st, tok, rank):
    m = re.fullmatch(r"\[\s*([^,\]]+?)\s*,\s*\{(.*)\}\s*\]", tok.strip(), re.S)
    if not m:
        raise st.error(f"{st.opcode}: expected [tensor-map, {{coordinates}}], got {tok.strip()!r}")
    coords = [c for c in (x.strip() for x in m.group(2).split(",")) if c]
    if len(coords) != rank:
        raise st.error(f"{st.opcode}: a {rank}d copy takes {rank} coordinates, got {len(coords)}")
    # the map's address, and C++ declaring the coordinates as _c (signed 32-bit in the ISA)
    values = ", ".join(f"(long long)(int){st.val(c)}" for c in coords)
    return st.val(m.group(1)), f"const long long _c[{rank}] = {{{values}}};"


def cp(st, parts, ops):
    if parts[1:3] == ["async", "mbarrier"] and parts[3] == "arrive" and set(parts[4:]) - {"noinc"} <= _SEM \
            and len(ops) == 1:
        return f"{P}cp_async_mbarrier_arrive({_shared(st, parts, ops[0])}, {str('noinc' in parts).lower()}, {st.line});"
    if parts[1:3] != ["async", "bulk"]:
        return _memory_ops.cp(st, parts, ops)
    rest, name = parts[3:], f'"{st.opcode}"'
    if rest == ["commit_group"] and not ops:
        return f"{P}bulk_commit();"
    if rest in (["wait_group"], ["wait_group", "read"]) and len(ops) == 1:
        return f"{P}bulk_wait({st.val(ops[0])});"  # the sim's stores read and write at once
    hint = "L2::cache_hint" in rest
    rest = [p for p in rest if p != "L2::cache_hint"]
    if hint:
        ops = ops[:-1]  # the cache policy: a hint the sim ignores
    if rest and rest[0] == "prefetch":
        return ";"
    if rest and rest[0] == "tensor":
        m = re.fullmatch(r"([1-5])d", rest[1]) if len(rest) > 1 else None
        mode = [p for p in rest[2:] if p not in ("tile",)]
        if not m:
            return None
        rank = int(m.group(1))
        if mode in (["shared::cluster", "global", "mbarrier::complete_tx::bytes"],
                    ["shared::cta", "global", "mbarrier::complete_tx::bytes"]) and len(ops) == 3:
            tmap, decl = _tensor_operand(st, ops[1], rank)
            return (f"{decl} "
                    f"{P}tensor_load({st.addr(ops[0])}, {tmap}, _c, {rank}, {st.addr(ops[2])}, {st.line}, "
                    f"{name});")
        if mode in (["global", "shared::cta", "bulk_group"],) and len(ops) == 2:
            tmap, decl = _tensor_operand(st, ops[0], rank)
            return (f"{decl} "
                    f"{P}tensor_store({tmap}, _c, {rank}, {st.addr(ops[1])}, {st.line}, {name});")
        return None
    if rest in (["shared::cluster", "global", "mbarrier::complete_tx::bytes"],
                ["shared::cta", "global", "mbarrier::complete_tx::bytes"]) and len(ops) == 4:
        return (f"{P}bulk_load({st.addr(ops[0])}, {st.addr(ops[1])}, {st.val(ops[2])}, {st.addr(ops[3])}, {st.line}, "
                f"{name});")
    if rest == ["global", "shared::cta", "bulk_group"] and len(ops) == 3:
        return f"{P}bulk_store({st.addr(ops[0])}, {st.addr(ops[1])}, {st.val(ops[2])}, {st.line}, {name});"
    return None


def sync(st, parts, ops):
    if parts[0] == "fence" and parts[1:3] == ["proxy", "async"] and len(parts) <= 4:
        return f"{E}proxy_fence();"
    if parts[0] == "fence" and parts[1:] == ["mbarrier_init", "release", "cluster"]:
        return ";"  # a one-CTA cluster: mbarrier.init is visible to the CTA already
    named = parts[0] in ("bar", "barrier") and len(ops) in (1, 2) and \
        [p for p in parts[1:] if p not in ("cta", "aligned")] in (["sync"], ["arrive"])
    if named and len(ops) == 1 and ops[0].strip() == "0" and "sync" in parts:  # __syncthreads, in any spelling
        return f"static const char _site = 0; {E}barrier(0, 0, {st.line}, &_site);"
    if named:
        count = f"(int){st.val(ops[1])}" if len(ops) == 2 else "-1"
        if "arrive" in parts and len(ops) != 2:
            return None
        return f"{E}named_barrier((int){st.val(ops[0])}, {count}, {str('sync' in parts).lower()}, {st.line});"
    return _memory_ops.sync(st, parts, ops)


def elect(st, parts, ops):
    if parts[1:] != ["sync"] or len(ops) != 2 or "|" not in ops[0]:
        return None
    d, p = (x.strip() for x in ops[0].split("|"))
    body = f"const unsigned _e = {P}elect((unsigned){st.val(ops[1])}, {st.line}); "
    if d != "_":
        body += st.set(d, "_e") + " "
    return body + f"{st.lv(p)} = {P}laneid() == _e;"


def setmaxnreg(st, parts, ops):
    if len(parts) != 5 or parts[1] not in ("inc", "dec") or parts[2:] != ["sync", "aligned", "u32"] or len(ops) != 1:
        return None
    tok = ops[0].strip()
    value = st.exprs.get(tok, "").strip() if st.letters.get(tok) in ("n", "i") else tok
    if st.letters.get(tok) not in ("n", "i") and not re.fullmatch(r"\d+", tok):
        raise st.error(f"{st.opcode}: the register count must be an immediate, got {tok}")
    if re.fullmatch(r"\d+", value) and (int(value) % 8 or not 24 <= int(value) <= 256):
        raise st.error(f"{st.opcode}: the register count must be a multiple of 8 in 24..256, got {value}")
    # an "n" operand of a template parameter (CUTLASS's warpgroup_reg_alloc<N>) is checked when it runs
    return _site(f"{P}setmaxnreg(&_site, (unsigned){st.val(ops[0])}, {st.line});")


def mapa(st, parts, ops):
    """mapa: a shared address of this CTA mapped into CTA rank b of the cluster -- a one-CTA cluster here."""
    if parts[-1] not in ("u32", "u64") or set(parts[1:-1]) - {"shared::cluster"} or len(ops) != 3:
        return None
    return st.set(ops[0], f"{P}mapa({st.val(ops[1])}, (unsigned){st.val(ops[2])}, {st.line})")


def hint(st, parts, ops):
    """Instructions that order or hint, with nothing for the sim to do."""
    if parts[0] == "griddepcontrol" and parts[1:] in (["wait"], ["launch_dependents"]) and not ops:
        return ";"  # the sim runs launches one after another: the previous grid has completed
    if parts[0] == "createpolicy" and parts[1] in ("fractional", "range") and parts[-1] == "b64" and ops:
        return st.set(ops[0], "0ull")  # a cache policy: a hint the sim ignores
    if parts[0] == "prefetch" and len(ops) == 1:
        return ";"
    return None


HANDLERS = {"wgmma": wgmma, "mbarrier": mbarrier, "cp": cp, "fence": sync, "bar": sync, "barrier": sync,
            "elect": elect, "setmaxnreg": setmaxnreg, "mapa": mapa, "griddepcontrol": hint, "createpolicy": hint,
            "prefetch": hint}
