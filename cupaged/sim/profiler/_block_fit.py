"""The linear program behind the issued-instruction count (``_instructions.py``): how often a warp runs
each SASS basic block, per warp that started, fitted to the sim's run.

Unknowns: each block's executions ``x``, each edge's traversals ``e``, and the misfits. Hard rules (a
warp's path through the control-flow graph, SIMT):
- the entry runs once per warp; a block runs once per traversal of an edge into it, except where a
  diverged warp reconverges (a ``BSSY`` target): there the paths that arrive run it once together
  (at most the traversals, at least as often as the block whose ``BSSY`` set it up);
- an edge is traversed at most once per execution of its source, and a warp leaving a block that it
  cannot exit in takes at least one edge (a warp that diverges takes both);
- a warp leaves a loop (a natural loop of the graph) no more often than it enters it, however
  its lanes' trip counts differ, and a loop never entered does not run.
Soft rules, each miss costing the block's instructions of the line per copy: a line's principal block
(of its instances that look like a host block holding it, the most deeply looped, then the one with
most of its instructions: ``_principal``) runs its copies at least as often as those host blocks ran,
and no block runs its copies of a line more often than the line ran (``N``: the most of the host blocks
holding it). Ties go to fewer instructions, and a loop's iteration costs more than any block entered
once.

Anchors: counts of the run that fix how often some instructions issue (``_ANCHORS``, ``_anchors``).
Each warp-level issue of such an instruction does at most a known amount of the count, so the issues
do at least the count (a deficit costs more than all the instructions together: all but hard):
- cp.async: the sim adds each lane's copy size to ``Launch.cp_async_bytes`` (zero-filled copies
  included), and an LDGSTS of s bytes a lane (``.128``: 16) moves at most 32 x s. They do no more where
  every warp that copies copies with all its lanes, as the attention kernels' 16-byte tiles do: an
  excess costs, per warp-wide copy, the most instructions a copying block has per copy (more than a
  line's miss in that block). Copies of some lanes only (MLA's 72-chunk rows, a last round of 8
  lanes) may exceed the bytes' count, paid for.
- wgmma: a warpgroup's wgmma is issued by its 4 warps, each a GMMA doing a quarter of its 2 M N K
  FLOPs (M N K from the opcode, HGMMA.64x128x16): ``gmma_flops`` (HGMMA) and ``gmma_fp8_flops``
  (QGMMA) fix them exactly (an excess costs like a deficit).
Without them the copies followed lines alone, and those say little: an LDGSTS's own line (one line
of its asm statement) is not the host build's (another line of it), and a pipeline's issue is one
host function, run for every tile, that ptxas copies into the prologue and the loop, each SASS copy
bounded by the total of all. The fit was off by up to 2x either way (64 x 4096 decode, sampled CTAs:
fp8 8,064 LDGSTS for 4,096 copied, fp16 4,224 for 8,192), and 18x on tests/hopper_gemm.cu's HGMMA
(a helper's lines inside a loop that ptxas alone unrolls: one copy each).
"""

from __future__ import annotations

import collections
import re

__all__ = ["fit"]

_EPSILON = 1e-5  # the tie-break's weight per instruction, against at least 1 per unit of misfit


class _Rows:
    """The rows of a sparse constraint matrix, built one at a time."""

    def __init__(self):
        self.rows, self.cols, self.vals, self.rhs = [], [], [], []

    def add(self, terms, rhs) -> None:
        for col, val in terms:
            self.rows.append(len(self.rhs))
            self.cols.append(col)
            self.vals.append(val)
        self.rhs.append(rhs)

    def matrix(self, width):
        from scipy.sparse import csr_matrix

        return csr_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.rhs), width))


def _dominators(n: int, succs, preds) -> list[int]:
    """Immediate dominator of each node reachable from node 0 (Cooper, Harvey and Kennedy), -1 else."""
    order, seen, stack = [], {0}, [(0, iter(succs[0]))]
    while stack:  # reverse postorder
        node, it = stack[-1]
        nxt = next((s for s in it if s not in seen), None)
        if nxt is None:
            order.append(node)
            stack.pop()
        else:
            seen.add(nxt)
            stack.append((nxt, iter(succs[nxt])))
    order.reverse()
    rank = {v: i for i, v in enumerate(order)}
    idom = [-1] * n
    idom[0] = 0
    changed = True
    while changed:
        changed = False
        for v in order[1:]:
            new = -1
            for p in preds[v]:
                if idom[p] < 0:
                    continue
                if new < 0:
                    new = p
                    continue
                a, b = p, new
                while a != b:
                    while rank[a] > rank[b]:
                        a = idom[a]
                    while rank[b] > rank[a]:
                        b = idom[b]
                new = a
            if new != idom[v]:
                idom[v], changed = new, True
    return idom


def _loops(n: int, succs, preds) -> dict[int, set]:
    """header -> the body (header included) of the graph's natural loop of that header."""
    idom = _dominators(n, succs, preds)

    def dominates(a, b):
        while b != a and b != idom[b] and b >= 0:
            b = idom[b]
        return b == a

    bodies = collections.defaultdict(set)
    for u in range(n):
        for h in succs[u]:
            if idom[u] >= 0 and dominates(h, u):  # a back edge u -> h
                body, stack = bodies[h], [u]
                body.add(h)
                while stack:
                    v = stack.pop()
                    if v not in body:
                        body.add(v)
                        stack += preds[v]
    return dict(bodies)


def _principal(line, candidates, blocks, sass_lines: set, host_blocks, fallback) -> tuple[int, float]:
    """(the principal block of ``line``, the executions it must reach): the first of ``candidates`` (its
    blocks, most deeply looped first) that looks like a host block holding the line — more than half of
    that host block's lines the SASS has at all are the block's (the guard before a loop holds a piece
    of the loop's condition, but it is not the loop's body; a helper inlined at several places has an
    instance at each) — with the most executions of such host blocks; else the first, at ``fallback``."""
    for k in candidates:
        mine = set(blocks[k].lines)
        found = [count for lines, count in host_blocks
                 if line in lines and 2 * len(lines & mine) > len(lines & sass_lines)]
        if found:
            return k, max(found)
    return candidates[0], fallback


def _copy_bytes(opcode: str) -> int:
    """The bytes one lane of an LDGSTS copies: 16 (``.128``), 8 (``.64``) or 4."""
    parts = opcode.split(".")
    return 16 if "128" in parts else 8 if "64" in parts else 4


def _gmma_flops(opcode: str) -> int | None:
    """The FLOPs one warp's issue of a GMMA does (a quarter of its warpgroup's 2 M N K), or None."""
    shape = re.search(r"\.(\d+)x(\d+)x(\d+)", opcode)
    return None if shape is None else 2 * int(shape[1]) * int(shape[2]) * int(shape[3]) // 4


# (opcode, the run's count of what it does, what one warp's issue of it does at most, exact: every issue
# does all of it, as a warpgroup-wide wgmma does; a cp.async's lanes may be partly inactive)
_ANCHORS = (("LDGSTS", "cp_async_bytes", lambda op: 32 * _copy_bytes(op), False),
            ("HGMMA", "gmma_flops", _gmma_flops, True), ("QGMMA", "gmma_fp8_flops", _gmma_flops, True))


def _anchors(blocks, running, run: dict, warps: int) -> list:
    """(terms: (block column, its instructions' share of the count per execution), the run's count per
    warp, the deficit's cost per unit, the excess's) of each count in ``run`` that anchors instructions
    of running blocks; a unit is the least one instruction does."""
    out, total = [], sum(len(blocks[k].opcodes) for k in running)
    for name, key, each, exact in _ANCHORS:
        found = [(v, [each(op) for op in blocks[k].opcodes if op.split(".")[0] == name])
                 for v, k in enumerate(running)]
        found = [(v, does) for v, does in found if does]
        if (run or {}).get(key) is None or not found or None in {d for _, does in found for d in does}:
            continue
        unit = min(d for _, does in found for d in does)
        terms = [(v, sum(does) / unit) for v, does in found]
        worst = max(len(blocks[running[v]].opcodes) / share for v, share in terms)
        out.append((terms, run[key] / unit / warps, total, total if exact else worst))
    return out


def fit(blocks, running, copies: dict, line_executions: dict, warps: int, host_blocks=(), run=None):
    """(executions per warp of each running block, (misfit, the weighed line counts)) or (None, the
    solver's message). ``run``: the launch's counts that anchor instructions (``_ANCHORS``: cp_async_bytes,
    gmma_flops, gmma_fp8_flops; a count missing or None anchors nothing)."""
    import numpy as np
    from scipy.optimize import linprog

    var = {k: i for i, k in enumerate(running)}
    n = len(running)
    succs = [[var[s] for s in blocks[k].succs if s in var] for k in running]
    preds = [[] for _ in range(n)]
    for u in range(n):
        for s in succs[u]:
            preds[s].append(u)
    edges = [(u, s) for u in range(n) for s in succs[u]]
    edge = {pair: n + i for i, pair in enumerate(edges)}
    observed = [line for line in copies if line in line_executions]
    pairs = [(line, var[k], c) for line in observed for k, c in copies[line].items()]
    anchors = _anchors(blocks, running, run, warps)
    short0 = n + len(edges) + 2 * len(anchors)  # the anchors' deficits and excesses before the lines' misses
    excess0 = short0 + len(observed)
    width = excess0 + len(pairs)
    cost = np.zeros(width)
    cost[:n] = [_EPSILON * len(blocks[k].opcodes) for k in running]
    ub, eq = _Rows(), _Rows()
    eq.add([(0, 1.0)] + [(edge[p, 0], -1.0) for p in preds[0]], 1.0)
    for v in range(1, n):
        into = [(edge[p, v], -1.0) for p in preds[v]]
        if blocks[running[v]].reconverges:
            ub.add([(v, 1.0)] + into, 0.0)
            for k in blocks[running[v]].reconverges:  # the warp that set the point up reaches it once
                if k in var:
                    ub.add([(var[k], 1.0), (v, -1.0)], 0.0)
        else:
            eq.add([(v, 1.0)] + into, 0.0)
    for u in range(n):
        for s in succs[u]:
            ub.add([(edge[u, s], 1.0), (u, -1.0)], 0.0)
        if succs[u] and not blocks[running[u]].exits:
            ub.add([(u, 1.0)] + [(edge[u, s], -1.0) for s in succs[u]], 0.0)
    depth = [0] * n
    # iterations per entry, at most: 4 x the most any line ran (or an anchor's count) per warp, + 1
    most = 4 * max([v / warps for v in line_executions.values()] + [a[1] for a in anchors], default=0) + 1
    loops = _loops(n, succs, preds)
    for header, body in loops.items():
        for v in body:
            depth[v] += 1
        leave = [(edge[u, s], 1.0) for u in body for s in succs[u] if s not in body]
        enter = [(edge[p, header], -1.0) for p in preds[header] if p not in body]
        if leave and enter:
            ub.add(leave + enter, 0.0)
        for v in body:  # a loop not entered does not run (no circulation without an entry)
            ub.add([(v, 1.0)] + [(col, most * val) for col, val in enter], 0.0)
        for p in preds[header]:  # an iteration costs more than any block entered once: a loop
            if p in body:  # entered once per warp is not fitted as a fraction of an entry going round
                cost[edge[p, header]] = _EPSILON * sum(len(blocks[k].opcodes) for k in running)
    sass_lines = {line for k in running for line in blocks[k].lines if line is not None}
    for j, line in enumerate(observed):
        # its principal block (the most deeply looped, then the most of its instructions) runs its
        # copies at least as often as the host block that looks like it ran
        candidates = sorted(copies[line], key=lambda k: (-depth[var[k]], -blocks[k].lines.count(line), k))
        k, count = _principal(line, candidates, blocks, sass_lines, host_blocks, line_executions[line])
        ub.add([(var[k], -float(copies[line][k])), (short0 + j, -1.0)], -count / warps)
        cost[short0 + j] = blocks[k].lines.count(line) / copies[line][k]
    for j, (line, v, c) in enumerate(pairs):
        ub.add([(v, float(c)), (excess0 + j, -1.0)], line_executions[line] / warps)
        cost[excess0 + j] = blocks[running[v]].lines.count(line) / c
    for j, (terms, count, below, above) in enumerate(anchors):
        deficit, excess = n + len(edges) + 2 * j, n + len(edges) + 2 * j + 1
        ub.add([(v, -c) for v, c in terms] + [(deficit, -1.0)], -count)
        ub.add(terms + [(excess, -1.0)], count)
        cost[deficit], cost[excess] = below, above
    result = linprog(cost, A_ub=ub.matrix(width) if ub.rhs else None, b_ub=ub.rhs or None, A_eq=eq.matrix(width),
                     b_eq=eq.rhs, bounds=(0, None), method="highs")
    if result.status != 0:
        return None, result.message
    misfit = float(np.dot(cost[short0:], result.x[short0:]))
    weighed = float(np.dot(cost[short0:excess0], [line_executions[line] / warps for line in observed]))
    return result.x[:n], (misfit, weighed)
