"""Strategy-selection ILP of the sharding planner (pure search; no torch).

Problem
-------
A graph with nodes v = 0..N-1. Node v has k_v candidate strategies with cost
c_v[i] (i = 0..k_v-1; c_v[i] = inf means strategy i is forbidden). A directed
edge e = (u, v, R_e) carries a k_u x k_v matrix of resharding costs
(R_e[i, j] = inf means the pair (u=i, v=j) is forbidden). Optionally every
strategy has a memory m_v[i] (bytes) and there is a budget M. Find

    minimise    sum_v c_v[x_v]  +  sum_e R_e[x_u, x_v]  +  sum_g S_g(x)
    subject to  sum_v m_v[x_v] <= M                    (only if a budget is given)
                every chosen term finite.

A shared group g = (u, members, T_g) prices a value that is moved once for all
the consumers that want it the same way (a producer feeding q, k and v
projections gathers its output once, not three times). Each member (v, key_v)
names, for every strategy j of v, the form key_v[j] it asks u's output in; the
group costs each distinct form once:

    S_g(x) = sum_{d in {key_v[x_v] : (v, key_v) in g}} T_g[x_u, d]     (T_g >= 0)

Edge weights (e.g. how many times a repeated block occurs) are already folded
into the matrices and tables by the caller.

Preprocessing (exact, cheap)
----------------------------
1. Self-loops (u == v, the "loop-back" edge of repeated transformer blocks):
   both ends take the same strategy, so only the diagonal is ever charged:
       c_v[i] += R_e[i, i]            (inf on the diagonal forbids i).
2. Parallel edges between the same unordered pair {a, b} (a < b) are summed
   into one matrix oriented a -> b (an edge b -> a contributes R^T).
3. Arc consistency (AC-3): strategy i of a is dropped if no surviving
   strategy j of b has R_ab[i, j] finite (and symmetrically). A node whose
   domain becomes empty makes the problem infeasible.
4. Nodes with a single surviving strategy are fixed. An edge with both ends
   fixed adds the constant R[s_a, s_b]; an edge with one end fixed at s_a
   adds the row R[s_a, :] to the free end's costs (arc consistency guarantees
   these entries are finite on surviving strategies). Fixed memory is
   subtracted from the budget.

Variables (for the remaining free nodes and pair edges)
-------------------------------------------------------
    x_{v,i} in {0,1}     for each free node v and surviving strategy i
    y_{e,i,j} in [0,1]   for each pair edge e = (a, b) and each pair (i, j)
                         with i, j surviving and R_e[i, j] finite.
Forbidden node strategies and forbidden pairs get no variable at all, i.e.
they are fixed to 0 by omission.

Objective
---------
    min  sum_{v,i} c_v[i] x_{v,i}  +  sum_{e,i,j} R_e[i,j] y_{e,i,j}  (+ constant)

    +  sum_{g,i,d} T_g[i,d] z_{g,i,d}

(divided by the largest finite |cost| before solving so HiGHS's absolute
tolerances mean the same thing at any cost scale; the reported objective is
recomputed from the original inputs.)

Constraints
-----------
    sum_i x_{v,i} = 1                              for each free node v
    sum_j y_{e,i,j} = x_{a,i}                      for each edge e=(a,b), i   (*)
    sum_i y_{e,i,j} = x_{b,j}                      for each edge e=(a,b), j   (*)
    sum_{v,i} m_v[i] x_{v,i} <= M - (memory of fixed nodes)   (if budgeted)

Edge linearisation
------------------
(*) are the marginal ("local polytope") constraints: y_e is a joint
distribution over pairs whose marginals are x_a and x_b. With x integral,
x_a = e_i and x_b = e_j force every row other than i and every column other
than j of y_e to zero, so y_{e,i,j} = 1: y may be continuous and the model is
still exact. If R_e[i, j] is infinite the variable y_{e,i,j} does not exist
and the pair (i, j) is infeasible. The LP relaxation of this formulation is
exact on trees/chains and much tighter than the textbook
y >= x_a + x_b - 1 linearisation in general.

Shared groups
-------------
    z_{g,i,d} in [0,1]   for each group g, alive strategy i of u and form d with
                         T_g[i,d] > 0
    z_{g,i,d} >= x_{u,i} + sum_{j: key_v[j] = d} x_{v,j} - 1     for each member v

With x integral the right side is 1 exactly when u takes i and some member asks
for d, else <= 0; T_g >= 0 pushes z down to that bound, so z is integral and
S_g is charged exactly (a fixed node's x is a constant, moved to the bound).

Infeasibility
-------------
InfeasibleError (a ValueError) is raised with a sentence naming the cause: a
node whose every strategy is forbidden, a node with no strategy compatible with
its neighbours, no assignment avoiding forbidden pairs, or a memory budget that
is too small; in the last case the min-memory problem (same constraints,
objective sum m_v[x_v], no budget) is solved to report "needs at least X
bytes, budget is Y".
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["Solution", "InfeasibleError", "SolverError", "solve_strategies", "brute_force",
           "evaluate"]


class InfeasibleError(ValueError):
    """No assignment satisfies the forbidden entries and the memory budget."""


class SolverError(RuntimeError):
    """The solver stopped (e.g. time limit) without any feasible assignment."""


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]   # strategy index per node
    objective: float          # recomputed cost of `choice` from the original inputs
    solve_seconds: float
    status: str               # "optimal", or "time_limit" (feasible, optimality not proven)
    memory: float | None = None   # sum_v m_v[choice_v] when node_memory was given


# --------------------------------------------------------------------------- input checks

def _validate_costs(node_costs) -> list:
    costs = []
    for v, c in enumerate(node_costs):
        a = np.array(c, dtype=float)
        if a.ndim != 1 or a.size == 0:
            raise ValueError(f"node {v}: costs must be a non-empty 1-D array, got shape {a.shape}")
        if np.isnan(a).any() or (a == -np.inf).any():
            raise ValueError(f"node {v}: costs contain NaN or -inf")
        costs.append(a)
    return costs


def _validate(node_costs, edges, node_memory, memory_budget):
    costs = _validate_costs(node_costs)
    n = len(costs)
    elist = []
    for k, e in enumerate(edges):
        try:
            u, v, r = e
        except (TypeError, ValueError):
            raise ValueError(f"edge {k}: expected (u, v, matrix), got {e!r}") from None
        u, v = int(u), int(v)
        if not (0 <= u < n and 0 <= v < n):
            raise ValueError(f"edge {k}: node index out of range ({u}, {v}) for {n} nodes")
        r = np.array(r, dtype=float)
        if r.shape != (costs[u].size, costs[v].size):
            raise ValueError(f"edge {k} ({u}->{v}): matrix shape {r.shape} does not match "
                             f"({costs[u].size}, {costs[v].size}) strategies")
        if np.isnan(r).any() or (r == -np.inf).any():
            raise ValueError(f"edge {k} ({u}->{v}): matrix contains NaN or -inf")
        elist.append((u, v, r))
    mem = None
    if node_memory is not None:
        if len(node_memory) != n:
            raise ValueError(f"node_memory has {len(node_memory)} entries for {n} nodes")
        mem = []
        for v, m in enumerate(node_memory):
            a = np.array(m, dtype=float).reshape(-1)
            if a.shape != costs[v].shape:
                raise ValueError(f"node {v}: memory has {a.size} entries for "
                                 f"{costs[v].size} strategies")
            if not np.isfinite(a).all():
                raise ValueError(f"node {v}: memory must be finite")
            mem.append(a)
    if memory_budget is not None:
        if mem is None:
            raise ValueError("memory_budget given without node_memory")
        memory_budget = float(memory_budget)
        if math.isnan(memory_budget):
            raise ValueError("memory_budget is NaN")
    return costs, elist, mem, memory_budget


def _validate_shared(shared, costs) -> list:
    n = len(costs)
    out = []
    for k, g in enumerate(shared):
        try:
            u, members, table = g
        except (TypeError, ValueError):
            raise ValueError(f"shared group {k}: expected (u, members, table), got {g!r}") from None
        u = int(u)
        if not 0 <= u < n:
            raise ValueError(f"shared group {k}: node index {u} out of range for {n} nodes")
        t = np.array(table, dtype=float)
        if t.ndim != 2 or t.shape[0] != costs[u].size:
            raise ValueError(f"shared group {k}: table shape {t.shape} does not have "
                             f"{costs[u].size} rows (node {u}'s strategies)")
        if not np.isfinite(t).all() or (t < 0).any():
            # a negative entry would pay the solver to claim a form nobody asked for
            raise ValueError(f"shared group {k}: table entries must be finite and >= 0")
        mlist = []
        for v, keys in members:
            v = int(v)
            if not 0 <= v < n:
                raise ValueError(f"shared group {k}: member {v} out of range for {n} nodes")
            keys = np.array(keys, dtype=np.int64).reshape(-1)
            if keys.size != costs[v].size or (keys < 0).any() or (keys >= t.shape[1]).any():
                raise ValueError(f"shared group {k}: member {v} needs one form in "
                                 f"[0, {t.shape[1]}) per strategy ({costs[v].size})")
            mlist.append((v, keys))
        out.append((u, mlist, t))
    return out


def _shared_cost(shared, choice) -> float:
    return float(sum(sum(t[choice[u], d] for d in {int(keys[choice[v]]) for v, keys in members})
                     for u, members, t in shared))


def evaluate(node_costs, edges, choice, node_memory=None, shared=()) -> tuple[float, float | None]:
    """(cost, memory) of an assignment, from the raw inputs; cost may be inf."""
    total = _shared_cost(_validate_shared(shared, [np.asarray(c, dtype=float).reshape(-1) for c in node_costs]),
                         choice)
    for v, c in enumerate(node_costs):
        total += float(np.asarray(c, dtype=float).reshape(-1)[choice[v]])
    for u, v, r in edges:
        total += float(np.asarray(r, dtype=float)[choice[int(u)], choice[int(v)]])
    memory = None
    if node_memory is not None:
        memory = float(sum(float(np.asarray(m, dtype=float).reshape(-1)[choice[v]])
                           for v, m in enumerate(node_memory)))
    return total, memory


def _fmt_bytes(b: float) -> str:
    for unit, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= s:
            return f"{b:.0f} bytes ({b / s:.3g} {unit})"
    return f"{b:.0f} bytes"


def _budget_error(min_mem: float, budget: float) -> InfeasibleError:
    return InfeasibleError(f"memory budget too small: the plan needs at least "
                           f"{_fmt_bytes(min_mem)}, budget is {_fmt_bytes(budget)}")


# --------------------------------------------------------------------------- preprocessing

@dataclass
class _Reduced:
    n: int
    cost: list            # effective cost per node (self-loops and fixed neighbours folded in)
    alive: list           # bool mask of surviving strategies per node
    fixed: dict           # node -> strategy
    pairs: list           # (a, b, R) free-free edges, a < b, parallel edges summed
    constant: float       # cost from edges between fixed nodes


@dataclass
class _Structure:
    """What the reduction derives from which entries are forbidden (infinite) alone: the self-loops'
    diagonals and the rows folded in from fixed neighbours (each added to a node's costs, in order),
    the surviving strategies, the fixed nodes, the free pair edges and the constant. Costs with the
    same forbidden entries on the same edges share it; ``_fold`` prices them."""
    n: int
    loops: list           # (v, diagonal added to v's costs), in edge order
    alive: list
    fixed: dict
    folds: list           # (v, row added to v's costs), in pair order
    pairs: list
    constant: float


def _reduce(costs, elist) -> _Reduced:
    st = _structure(costs, elist)
    return _Reduced(st.n, _fold(costs, st), st.alive, st.fixed, st.pairs, st.constant)


def _fold(costs, st: _Structure) -> list:
    """Each node's effective costs: its own with the loops' diagonals, inf where it is dead, and the
    rows of its fixed neighbours, added in the order the reduction found them."""
    cost = [c.copy() for c in costs]
    for v, diagonal in st.loops:
        cost[v] = cost[v] + diagonal
    for v in range(st.n):
        cost[v] = np.where(st.alive[v], cost[v], np.inf)
    for v, row in st.folds:
        cost[v] = cost[v] + row
    return cost


def _finite(costs, loops) -> tuple:
    """Where each node's costs are finite with its self-loops' diagonals added as ``_structure`` adds
    them: all of the costs that the structure depends on."""
    cost = list(costs)
    for v, diagonal in loops:
        cost[v] = cost[v] + diagonal
    return tuple(np.isfinite(c).tobytes() for c in cost)


def _structure(costs, elist) -> _Structure:
    n = len(costs)
    cost = [c.copy() for c in costs]
    loops = []
    for v, c in enumerate(costs):
        if not np.isfinite(c).any():
            raise InfeasibleError(f"node {v}: every strategy is forbidden (infinite cost)")
    pair_mats: dict[tuple[int, int], np.ndarray] = {}
    for u, v, r in elist:
        if u == v:
            loops.append((v, np.diag(r)))
            cost[v] = cost[v] + loops[-1][1]
            if not np.isfinite(cost[v]).any():
                raise InfeasibleError(f"node {v}: its loop-back edge forbids every strategy "
                                      f"(infinite diagonal)")
            continue
        key, m = ((u, v), r) if u < v else ((v, u), r.T)
        pair_mats[key] = pair_mats[key] + m if key in pair_mats else m.copy()

    alive = [np.isfinite(c) for c in cost]
    pairs = [(a, b, m, np.isfinite(m)) for (a, b), m in pair_mats.items()]
    _arc_consistency(alive, pairs, n)
    fixed = {v: int(np.flatnonzero(alive[v])[0]) for v in range(n) if alive[v].sum() == 1}
    constant = 0.0
    free_pairs, folds = [], []
    for a, b, m, _ in pairs:
        fa, fb = a in fixed, b in fixed
        if fa and fb:
            constant += float(m[fixed[a], fixed[b]])
        elif fa:
            folds.append((b, np.where(alive[b], m[fixed[a], :], 0.0)))
        elif fb:
            folds.append((a, np.where(alive[a], m[:, fixed[b]], 0.0)))
        else:
            free_pairs.append((a, b, m))
    return _Structure(n, loops, alive, fixed, folds, free_pairs, constant)


def _arc_consistency(alive: list, pairs: list, n: int) -> None:
    """AC-3 over the pair edges: each node's ``alive`` strategies narrowed, in place, to those with a
    finite partner in every neighbour's; InfeasibleError where a node is left with none."""
    incident: list[list[int]] = [[] for _ in range(n)]
    for k, (a, b, _, _) in enumerate(pairs):
        incident[a].append(k)
        incident[b].append(k)
    queue = deque(range(len(pairs)))
    queued = [True] * len(pairs)

    def shrink(node, new, via):
        if not new.any():
            raise InfeasibleError(
                f"node {node}: no strategy is compatible with its neighbours (every pair "
                f"along its edges, e.g. with node {via}, is forbidden)")
        alive[node] = new
        for k2 in incident[node]:
            if not queued[k2]:
                queued[k2] = True
                queue.append(k2)

    while queue:
        k = queue.popleft()
        queued[k] = False
        a, b, _, fin = pairs[k]
        sup_a = fin[:, alive[b]].any(axis=1) & alive[a]
        if (sup_a != alive[a]).any():
            shrink(a, sup_a, b)
        sup_b = fin[alive[a], :].any(axis=0) & alive[b]
        if (sup_b != alive[b]).any():
            shrink(b, sup_b, a)


# --------------------------------------------------------------------------- the MILP

class _Model:
    """Sparse MILP over the reduced problem; objective vector chosen per solve."""

    def __init__(self, red: _Reduced, mem, shared=()):
        self.red = red
        free = [v for v in range(red.n) if v not in red.fixed]
        self.free = free
        xmem = self._x_columns(mem)
        col = self.nx
        rows, cols, vals = [], [], []
        for r, v in enumerate(free):
            c = self.xcol[v][self.xcol[v] >= 0]
            rows.append(np.full(c.size, r)); cols.append(c); vals.append(np.ones(c.size))
        r, col, ycost = self._pair_columns(len(free), col, rows, cols, vals)
        zcost, zrows = self._shared_columns(shared, col)
        col += len(zcost)
        self.ncols = col
        self.neq = r
        # scipy is imported where an ILP is built: ranks that are handed a plan never build one
        import scipy.sparse as sp
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0)  # noqa: E731
        self.A_eq = sp.csr_array((cat(vals), (cat(rows).astype(np.int64), cat(cols).astype(np.int64))),
                                 shape=(r, col))
        self.b_eq = np.zeros(r)
        self.b_eq[:len(free)] = 1.0
        self.ycost, self.zcost = cat(ycost), np.array(zcost)
        self.cost = self.objective(red.cost)
        self.A_ub = None
        if zrows:
            ur, uc, uv, ub = [], [], [], []
            for k, (terms, rhs) in enumerate(zrows):
                ur += [k] * len(terms)
                uc += [c for c, _ in terms]
                uv += [w for _, w in terms]
                ub.append(rhs)
            self.A_ub = sp.csr_array((np.array(uv, dtype=float), (np.array(ur), np.array(uc))),
                                     shape=(len(zrows), col))
            self.b_ub = np.array(ub, dtype=float)
        self.xmem = cat(xmem)
        self.integrality = np.zeros(col)
        self.integrality[:self.nx] = 1

    def _x_columns(self, mem) -> list:
        """Number the free nodes' alive strategies (``xcol``, ``xsel``, ``nx``); their memory per column."""
        red, col = self.red, 0
        self.xcol = {}          # v -> array: strategy -> column (-1 if dead)
        xmem = []
        self.xsel = []          # (v, its alive strategies): the x columns, in order
        for v in self.free:
            idx = np.full(red.alive[v].size, -1, dtype=np.int64)
            s = np.flatnonzero(red.alive[v])
            idx[s] = np.arange(col, col + s.size)
            col += s.size
            self.xcol[v] = idx
            self.xsel.append((v, s))
            xmem.append(mem[v][s] if mem is not None else np.zeros(s.size))
        self.nx = col
        return xmem

    def _pair_columns(self, r: int, col: int, rows: list, cols: list, vals: list):
        """y columns of the free pair edges from column ``col``, their equality rows from row ``r``
        (appended to ``rows``, ``cols``, ``vals``): (next row, next column, the y costs)."""
        red, ycost = self.red, []
        for a, b, m in red.pairs:
            ok = red.alive[a][:, None] & red.alive[b][None, :] & np.isfinite(m)
            ii, jj = np.nonzero(ok)
            ny = ii.size
            ycols = np.arange(col, col + ny)
            col += ny
            ycost.append(m[ii, jj])
            # row constraints: sum_j y_ij - x_a,i = 0 for each alive i of a
            sa = np.flatnonzero(red.alive[a])
            rowmap = np.full(red.alive[a].size, -1, dtype=np.int64)
            rowmap[sa] = np.arange(r, r + sa.size)
            rows += [rowmap[ii], rowmap[sa]]
            cols += [ycols, self.xcol[a][sa]]
            vals += [np.ones(ny), -np.ones(sa.size)]
            r += sa.size
            sb = np.flatnonzero(red.alive[b])
            colmap = np.full(red.alive[b].size, -1, dtype=np.int64)
            colmap[sb] = np.arange(r, r + sb.size)
            rows += [colmap[jj], colmap[sb]]
            cols += [ycols, self.xcol[b][sb]]
            vals += [np.ones(ny), -np.ones(sb.size)]
            r += sb.size
        return r, col, ycost

    def objective(self, cost) -> np.ndarray:
        """The objective vector for the reduced costs ``cost`` (``_fold``'s): the x columns' costs, then
        the pair and shared-group columns', which do not depend on them."""
        if not self.ncols:
            return np.zeros(0)
        xcost = [cost[v][s] for v, s in self.xsel]
        return np.concatenate([np.concatenate(xcost) if xcost else np.zeros(0), self.ycost, self.zcost])

    def solve(self, objective, mem_rhs, time_limit, mip_rel_gap):
        import scipy.sparse as sp
        from scipy.optimize import Bounds, LinearConstraint, milp
        cons = [LinearConstraint(self.A_eq, self.b_eq, self.b_eq)]
        if self.A_ub is not None:
            cons.append(LinearConstraint(self.A_ub, -np.inf, self.b_ub))
        if mem_rhs is not None:
            scale = float(np.max(np.abs(self.xmem))) if self.xmem.size else 0.0
            scale = scale if scale > 0 else 1.0
            row = sp.csr_array(np.concatenate([self.xmem, np.zeros(self.ncols - self.nx)])[None, :]
                               / scale)
            cons.append(LinearConstraint(row, -np.inf, mem_rhs / scale))
        scale = float(np.max(np.abs(objective))) if objective.size else 0.0
        scale = scale if scale > 0 else 1.0
        return milp(objective / scale, constraints=cons, integrality=self.integrality,
                    bounds=Bounds(0.0, 1.0),
                    options={"time_limit": float(time_limit), "mip_rel_gap": mip_rel_gap})

    def _x(self, v: int, j: int):
        """x_{v,j} as (column, None), or (None, its constant value) for a fixed or dead strategy."""
        if v in self.red.fixed:
            return None, float(self.red.fixed[v] == j)
        c = int(self.xcol[v][j])
        return (c, None) if c >= 0 else (None, 0.0)

    def _shared_columns(self, shared, col0: int):
        """z columns (their costs) and rows ``sum(w * col) <= rhs`` pricing each shared group."""
        zcost, rows = [], []
        for u, members, t in shared:
            if u in self.red.fixed and all(v in self.red.fixed for v, _ in members):
                continue   # nothing to choose; ``evaluate`` charges it
            for i in np.flatnonzero(self.red.alive[u]):
                xu, cu = self._x(u, int(i))
                for d in np.flatnonzero(t[i] > 0):
                    z = col0 + len(zcost)
                    made = False
                    for v, keys in members:
                        terms, const = [(z, -1.0)], 1.0 - (cu or 0.0)
                        asks = [j for j in np.flatnonzero(keys == d) if self.red.alive[v][j]]
                        if not asks or (xu is None and cu == 0.0):
                            continue   # the row could never bind
                        if xu is not None:
                            terms.append((xu, 1.0))
                        for j in asks:
                            xv, cv = self._x(v, int(j))
                            if xv is None:
                                const -= cv
                            else:
                                terms.append((xv, 1.0))
                        rows.append((terms, const))
                        made = True
                    if made:
                        zcost.append(float(t[i, d]))
        return zcost, rows

    def decode(self, xvals) -> list[int]:
        choice = [0] * self.red.n
        for v, s in self.red.fixed.items():
            choice[v] = s
        for v in self.free:
            idx = self.xcol[v]
            s = np.flatnonzero(idx >= 0)
            choice[v] = int(s[np.argmax(xvals[idx[s]])])
        return choice


def solve_strategies(node_costs: Sequence, edges: Sequence, *, node_memory=None,
                     memory_budget=None, time_limit: float = 60.0,
                     mip_rel_gap: float = 1e-9, shared: Sequence = (), reuse: dict | None = None) -> Solution:
    """Choose one strategy per node minimising node + edge + shared-group costs (see module docstring).

    Raises InfeasibleError when no assignment exists (forbidden entries or memory budget),
    SolverError when the time limit passes before any feasible assignment is found.
    A time-limited but feasible result comes back with status "time_limit".

    ``reuse``: a dict the caller keeps with ``edges`` and ``shared``, passing those same objects on
    every call, that holds the reduction's structure and the MILP's constraints between calls without
    ``node_memory``: costs forbidding the same entries as the last call's get the model built for
    those, with only its objective priced again, the very model (and so the answer) a fresh build gives.
    """
    t0 = time.perf_counter()
    use = reuse is not None and node_memory is None and memory_budget is None
    if use and reuse.get("inputs") == (id(edges), id(shared)):   # held below: the ids are of those objects
        costs, mem, budget = _validate_costs(node_costs), None, None
        elist, groups = reuse["validated"]
    else:
        costs, elist, mem, budget = _validate(node_costs, edges, node_memory, memory_budget)
        groups = _validate_shared(shared, costs)
        if use:
            reuse.clear()
            reuse.update(inputs=(id(edges), id(shared)), held=(edges, shared), validated=(elist, groups))
    # the reduction reads the costs only through where they are finite once the loops are added
    if use and "model" in reuse and _finite(costs, reuse["model"][0].loops) == reuse["finite"]:
        st, model = reuse["model"]
        red = _Reduced(st.n, _fold(costs, st), st.alive, st.fixed, st.pairs, st.constant)
        objective = model.objective(red.cost)
    else:
        st = _structure(costs, elist)
        red = _Reduced(st.n, _fold(costs, st), st.alive, st.fixed, st.pairs, st.constant)
        model = _Model(red, mem, groups)
        objective = model.cost
        if use:
            reuse.update(finite=_finite(costs, st.loops), model=(st, model))
    fixed_mem = sum(float(mem[v][s]) for v, s in red.fixed.items()) if mem is not None else 0.0
    status = "optimal"
    if model.ncols == 0:
        choice = model.decode(np.zeros(0))
        if budget is not None and fixed_mem > budget:
            raise _budget_error(fixed_mem, budget)
    else:
        mem_rhs = None if budget is None else budget - fixed_mem
        res = model.solve(objective, mem_rhs, time_limit, mip_rel_gap)
        if res.status == 2:
            raise _diagnose(model, mem, budget, time_limit)
        if res.x is None and res.status != 1:
            raise SolverError(f"HiGHS failed: {res.message}")
        if res.x is None:
            raise SolverError(f"no feasible assignment found within time_limit={time_limit} s "
                              f"({res.message})")
        if res.status != 0:
            status = "time_limit"
        choice = model.decode(res.x)
    obj, used = evaluate(costs, elist, choice, mem, groups)
    if not math.isfinite(obj):  # cannot happen: forbidden entries have no variables
        raise SolverError(f"internal error: chosen assignment has infinite cost {choice}")
    return Solution(tuple(choice), float(obj), time.perf_counter() - t0, status, used)


def _diagnose(model: _Model, mem, budget, time_limit) -> InfeasibleError:
    if budget is None:
        return InfeasibleError("no assignment avoids every forbidden (infinite) node strategy "
                               "and edge pair")
    objective = np.concatenate([model.xmem, np.zeros(model.ncols - model.nx)])
    res = model.solve(objective, None, time_limit, 1e-9)
    if res.x is None:
        return InfeasibleError("no assignment avoids every forbidden (infinite) node strategy "
                               "and edge pair (independently of the memory budget)")
    choice = model.decode(res.x)
    min_mem = sum(float(mem[v][s]) for v, s in enumerate(choice))
    return _budget_error(min_mem, budget)


# --------------------------------------------------------------------------- reference

def brute_force(node_costs, edges, node_memory=None, memory_budget=None,
                max_states: int = 20_000_000, shared: Sequence = ()) -> Solution:
    """Exhaustive search over all assignments (small instances only; same semantics)."""
    t0 = time.perf_counter()
    costs, elist, mem, budget = _validate(node_costs, edges, node_memory, memory_budget)
    groups = _validate_shared(shared, costs)
    n = len(costs)
    for v, c in enumerate(costs):
        if not np.isfinite(c).any():
            raise InfeasibleError(f"node {v}: every strategy is forbidden (infinite cost)")
    shape = tuple(c.size for c in costs)
    if math.prod(shape) > max_states:
        raise ValueError(f"brute_force: {math.prod(shape)} assignments exceed max_states")

    def axis_view(v, arr):
        s = [1] * n
        s[v] = arr.size
        return arr.reshape(s)

    total = np.zeros(shape)
    for v, c in enumerate(costs):
        total = total + axis_view(v, c)
    for u, v, r in elist:
        if u == v:
            total = total + axis_view(v, np.diag(r).copy())
        else:
            s = [1] * n
            s[u], s[v] = r.shape[0], r.shape[1]
            total = total + (r if u < v else r.T).reshape(s)
    for u, members, t in groups:
        for d in range(t.shape[1]):
            asked = np.zeros(shape, dtype=bool)
            for v, keys in members:
                asked = asked | axis_view(v, keys == d)
            total = total + np.where(asked, axis_view(u, t[:, d]), 0.0)
    memory = None
    if mem is not None:
        memory = np.zeros(shape)
        for v, m in enumerate(mem):
            memory = memory + axis_view(v, m)
    finite = np.isfinite(total)
    if not finite.any():
        raise InfeasibleError("no assignment avoids every forbidden (infinite) node strategy "
                              "and edge pair")
    ok = finite
    if budget is not None:
        ok = finite & (memory <= budget)
        if not ok.any():
            raise _budget_error(float(memory[finite].min()), budget)
    flat = np.where(ok, total, np.inf).ravel()
    best = int(np.argmin(flat))
    choice = tuple(int(i) for i in np.unravel_index(best, shape))
    obj, used = evaluate(costs, elist, choice, mem, groups)
    return Solution(choice, float(obj), time.perf_counter() - t0, "optimal", used)
