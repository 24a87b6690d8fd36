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
and no
block runs its copies of a line more often than the line ran (``N``: the most of the host blocks
holding it). Ties go to fewer instructions, and a loop's iteration costs more than any block entered
once.

The run's cp.async copies anchor the LDGSTS (``_copy_anchor``): the sim counts every copy's bytes
(``Launch.cp_async_bytes``: each lane's copy adds its size, a zero-filled one included), and a warp's
LDGSTS of ``size`` bytes moves at most 32 lanes x size. So the LDGSTS issued hold at least those bytes
(a deficit costs more than any other miss: the rule is all but hard), and they hold no more when every
warp that copies copies with all its lanes, as the kernels' 16-byte tiles do (an excess costs, per
warp-wide copy, the most instructions a copying block has per copy: more than any line's miss in that
block). Without it, a helper's lines (an LDGSTS's own line is the asm statement's, which the host
build gives another line) that g++ keeps in one function called from several places, while ptxas
copies them into each (a cp.async pipeline's prologue and its loop), bound each SASS copy by the
total of all, not their sum: the fp8 decode kernel was fitted at twice its copies, and prefill's
head-256 tiles at half.
"""

from __future__ import annotations

import collections

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


def _copy_anchor(blocks, running, copy_bytes, warps):
    """(terms: (block column, warp-wide bytes its LDGSTS move per execution / 512), the run's copy bytes
    per warp / 512, the excess's cost per unit), or None when no running block copies or the count is
    unknown."""
    terms, worst = [], 0.0
    for v, k in enumerate(running):
        cap = sum(32 * _copy_bytes(op) for op in blocks[k].opcodes if op.startswith("LDGSTS")) / 512
        if cap:
            terms.append((v, cap))
            worst = max(worst, len(blocks[k].opcodes) / cap)
    if copy_bytes is None or not terms:
        return None
    return terms, copy_bytes / 512 / warps, worst


def fit(blocks, running, copies: dict, line_executions: dict, warps: int, host_blocks=(), copy_bytes=None):
    """(executions per warp of each running block, (misfit, the weighed line counts)) or (None, the
    solver's message). ``copy_bytes``: the run's cp.async bytes (None: no anchor)."""
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
    anchor = _copy_anchor(blocks, running, copy_bytes, warps)
    short0 = n + len(edges) + (2 if anchor else 0)  # the anchor's deficit and excess before the lines' misses
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
    # iterations per entry, at most: 4 x the most any line ran (or the warp-wide copies) per warp, + 1
    most = 4 * max(max(line_executions.values(), default=0) / warps, anchor[1] if anchor else 0) + 1
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
    if anchor:
        terms, bytes_per_warp, worst = anchor
        deficit, excess = n + len(edges), n + len(edges) + 1
        ub.add([(v, -c) for v, c in terms] + [(deficit, -1.0)], -bytes_per_warp)
        ub.add(terms + [(excess, -1.0)], bytes_per_warp)
        cost[deficit] = sum(len(blocks[k].opcodes) for k in running)
        cost[excess] = worst
    result = linprog(cost, A_ub=ub.matrix(width) if ub.rhs else None, b_ub=ub.rhs or None, A_eq=eq.matrix(width),
                     b_eq=eq.rhs, bounds=(0, None), method="highs")
    if result.status != 0:
        return None, result.message
    misfit = float(np.dot(cost[short0:], result.x[short0:]))
    weighed = float(np.dot(cost[short0:excess0], [line_executions[line] / warps for line in observed]))
    return result.x[:n], (misfit, weighed)
