"""The linear program behind the issued-instruction count (``_instructions.py``): how often a warp runs
each SASS basic block, per warp that started, fitted to the sim's run.

Unknowns: each block's executions ``x``, each edge's traversals ``e``, and the misfits. Hard rules (a
warp's path through the control-flow graph, SIMT):
- the entry runs once per warp; a block runs once per traversal of an edge into it, except where a
  diverged warp reconverges (a ``BSSY`` target): there the paths that arrive run it once together
  (at most the traversals);
- an edge is traversed at most once per execution of its source, and a warp leaving a block that it
  cannot exit in takes at least one edge (a warp that diverges takes both);
- a warp leaves a loop (a natural loop of the graph) no more often than it enters it, however
  its lanes' trip counts differ, and a loop never entered does not run.
Soft rules, each miss costing the block's instructions of the line per copy: the copies of a line in its principal block
(the block of its instances most deeply inside loops, then the one holding most of its instructions)
run at least as often as the line ran (``N``: the most of the host blocks holding it), and no block's
copies of a line run more often. A tie goes to fewer instructions.
"""

from __future__ import annotations

import collections

__all__ = ["fit"]

_EPSILON = 1e-4  # the tie-break's weight per instruction, against 1 per instruction of misfit


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


def _loops(n: int, succs, preds) -> list[set]:
    """The bodies of the graph's natural loops, one per header."""
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
    return list(bodies.values())


def fit(blocks, running, copies: dict, line_executions: dict, warps: int):
    """(executions per warp of each running block, misfit, the weighed line counts) or None (no
    solution: the message instead)."""
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
    short0 = n + len(edges)
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
        else:
            eq.add([(v, 1.0)] + into, 0.0)
    for u in range(n):
        for s in succs[u]:
            ub.add([(edge[u, s], 1.0), (u, -1.0)], 0.0)
        if succs[u] and not blocks[running[u]].exits:
            ub.add([(u, 1.0)] + [(edge[u, s], -1.0) for s in succs[u]], 0.0)
    depth = [0] * n
    most = 4 * max(line_executions.values(), default=0) / warps + 1  # iterations per entry, at most
    for body in _loops(n, succs, preds):
        for v in body:
            depth[v] += 1
        leave = [(edge[u, s], 1.0) for u in body for s in succs[u] if s not in body]
        enter = [(edge[p, h], -1.0) for h in body for p in preds[h] if p not in body]
        if leave and enter:
            ub.add(leave + enter, 0.0)
        for v in body:  # a loop not entered does not run (no circulation without an entry)
            ub.add([(v, 1.0)] + [(col, most * val) for col, val in enter], 0.0)
    for j, line in enumerate(observed):
        # its principal block (the most deeply looped, then the most of its instructions: a loop's
        # condition has a piece in the guard before the loop too) runs its copies at least as often
        k = max(copies[line], key=lambda k: (depth[var[k]], blocks[k].lines.count(line), -k))
        ub.add([(var[k], -float(copies[line][k])), (short0 + j, -1.0)], -line_executions[line] / warps)
        cost[short0 + j] = blocks[k].lines.count(line) / copies[line][k]
    for j, (line, v, c) in enumerate(pairs):
        ub.add([(v, float(c)), (excess0 + j, -1.0)], line_executions[line] / warps)
        cost[excess0 + j] = blocks[running[v]].lines.count(line) / c
    result = linprog(cost, A_ub=ub.matrix(width) if ub.rhs else None, b_ub=ub.rhs or None, A_eq=eq.matrix(width),
                     b_eq=eq.rhs, bounds=(0, None), method="highs")
    if result.status != 0:
        return None, result.message
    misfit = float(np.dot(cost[short0:], result.x[short0:]))
    weighed = float(np.dot(cost[short0:excess0], [line_executions[line] / warps for line in observed]))
    return result.x[:n], (misfit, weighed)
