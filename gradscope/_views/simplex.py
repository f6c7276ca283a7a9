"""The network simplex method for integer ranks under difference constraints, as Graphviz's
``dot`` uses it (Gansner, Koutsofios, North and Vo, "A Technique for Drawing Directed Graphs",
1993): given edges ``tail -> head`` with a minimum length and a weight, find ranks that keep
``rank[head] - rank[tail] >= minlen`` on every edge and make the weighted sum of the edges'
lengths least. :mod:`gradscope._views.layered` uses it twice: for the layers (weighted edge lengths
in layers) and for x coordinates (on dot's auxiliary graph, where a length is the horizontal
distance between an edge's ends and the minimum lengths keep boxes apart).

NOTE [ network simplex, iteratively ]: the method keeps a spanning tree of *tight* edges (length
equal to the minimum), each tree edge's *cut value* (the weight of the graph's edges that cross
the cut it makes, counted by direction), and while a tree edge's cut value is negative swaps it
for the non-tree edge of least slack across the same cut, moving one side's ranks. As in dot, the
nodes carry ``low``/``lim`` numbers of a post-order walk, so "is x below v in the tree" is two
comparisons, a swap updates the cut values only along the cycle it closes, and the leaving edge is
searched from where the last search stopped among a few candidates. Every walk here is iterative
(a 5,000-node chain would overflow Python's recursion). The ranks are feasible after every swap,
so stopping after ``max_iter`` swaps gives a valid, if less even, result.

Example:
    >>> # a -> c two ranks long, b -> c one: the least lengths put a right above c, beside b
    >>> network_simplex(3, [0, 1], [2, 2], [1, 1], [1, 1], [0, 1, 2])
    [0, 0, 1]
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["network_simplex"]

_SEARCH = 30  # negative cut values compared per search for the leaving edge (dot's Search_size)


class _Simplex:
    def __init__(self, n: int, tail: Sequence[int], head: Sequence[int], minlen: Sequence[int],
                 weight: Sequence[int], rank: Sequence[int]) -> None:
        self.n = n
        self.tail = list(tail)
        self.head = list(head)
        self.minlen = list(minlen)
        self.weight = list(weight)
        self.rank = list(rank)
        self.out: list[list[int]] = [[] for _ in range(n)]
        self.inc: list[list[int]] = [[] for _ in range(n)]
        for e, (t, h) in enumerate(zip(self.tail, self.head, strict=True)):
            self.out[t].append(e)
            self.inc[h].append(e)
        self.ends = [t ^ h for t, h in zip(self.tail, self.head, strict=True)]  # other end: ends[e] ^ v
        self.in_tree = [False] * len(self.tail)
        self.tree_adj: list[list[int]] = [[] for _ in range(n)]  # tree edges at each node
        self.tree_edges: list[int] = []
        self.cut = [0] * len(self.tail)
        self.par = [-1] * n  # the tree edge to the parent (-1 at the root)
        self.low = [0] * n
        self.lim = [0] * n
        self.search_at = 0

    def slack(self, e: int) -> int:
        return self.rank[self.head[e]] - self.rank[self.tail[e]] - self.minlen[e]

    def _add_tree_edge(self, e: int) -> None:
        self.in_tree[e] = True
        self.tree_edges.append(e)
        self.tree_adj[self.tail[e]].append(e)
        self.tree_adj[self.head[e]].append(e)

    # ----- a spanning tree of tight edges
    def feasible_tree(self) -> None:
        """Grow a tree of tight edges from node 0, Prim-like: the edge of least slack between the
        tree and the rest joins it, the tree's ranks moved as a whole to make it tight. The move
        is an offset kept aside (a tree node's rank is ``rank + offset``), so a move costs
        nothing, and the edges leaving the tree wait in two heaps (by which end is in the tree)
        under keys that the offset turns into slacks."""
        in_tree = [False] * self.n
        out_heap: list[tuple[int, int]] = []  # tail in the tree: slack = key - offset
        in_heap: list[tuple[int, int]] = []  # head in the tree: slack = key + offset
        offset = 0

        def join(v: int) -> None:
            in_tree[v] = True
            self.rank[v] -= offset  # kept relative to the offset from now on
            for e in self.out[v]:
                if not in_tree[self.head[e]]:
                    heapq.heappush(out_heap, (self.rank[self.head[e]] - self.rank[v] - self.minlen[e], e))
            for e in self.inc[v]:
                if not in_tree[self.tail[e]]:
                    heapq.heappush(in_heap, (self.rank[v] - self.rank[self.tail[e]] - self.minlen[e], e))

        join(0)
        joined = 1
        while joined < self.n:
            while out_heap and in_tree[self.head[out_heap[0][1]]]:
                heapq.heappop(out_heap)
            while in_heap and in_tree[self.tail[in_heap[0][1]]]:
                heapq.heappop(in_heap)
            if not out_heap and not in_heap:
                raise ValueError("network_simplex: the graph is not connected")
            slack_out = out_heap[0][0] - offset if out_heap else None
            slack_in = in_heap[0][0] + offset if in_heap else None
            if slack_in is None or (slack_out is not None and slack_out <= slack_in):
                assert slack_out is not None
                _, e = heapq.heappop(out_heap)
                offset += slack_out  # the tree moves down the ranks: the edge's tail reaches it
                w = self.head[e]
            else:
                _, e = heapq.heappop(in_heap)
                offset -= slack_in
                w = self.tail[e]
            self._add_tree_edge(e)
            join(w)
            joined += 1
        for v in range(self.n):
            self.rank[v] += offset

    # ----- post-order numbers and cut values
    def number(self, root: int, parent_edge: int, low: int) -> None:
        """``low``/``lim`` and parent edges of ``root``'s subtree, numbered from ``low`` (dot's
        dfs_range, iteratively); a subtree whose parent edge and first number are unchanged keeps
        its numbers (the nodes on the path a swap changed are marked by :meth:`_invalidate`)."""
        par, lows, lims, adj_of, ends = self.par, self.low, self.lim, self.tree_adj, self.ends
        par[root] = parent_edge
        lows[root] = low
        nxt = low
        stack = [root]
        index = [0]
        while stack:
            v = stack[-1]
            adj = adj_of[v]
            i = index[-1]
            pv = par[v]
            while i < len(adj) and adj[i] == pv:
                i += 1
            if i < len(adj):
                index[-1] = i + 1
                e = adj[i]
                w = ends[e] ^ v
                if par[w] == e and lows[w] == nxt:  # the same subtree, numbered as before
                    nxt = lims[w] + 1
                    continue
                par[w] = e
                lows[w] = nxt
                stack.append(w)
                index.append(0)
            else:
                lims[v] = nxt
                nxt += 1
                stack.pop()
                index.pop()

    def _below(self, v: int, x: int) -> bool:
        """Whether x lies in v's subtree."""
        return self.low[v] <= self.lim[x] <= self.lim[v]

    def cut_value(self, f: int) -> int:
        """dot's x_cutval: the cut value of tree edge ``f`` from those of the tree edges below it."""
        if self.par[self.tail[f]] == f:
            v, sign = self.tail[f], 1
        else:
            v, sign = self.head[f], -1
        total = 0
        for edges in (self.out[v], self.inc[v]):
            for e in edges:
                other = self.head[e] if self.tail[e] == v else self.tail[e]
                if not self._below(v, other):
                    outside, value = True, self.weight[e]
                else:
                    outside = False
                    value = (self.cut[e] if self.in_tree[e] else 0) - self.weight[e]
                if sign > 0:
                    d = 1 if self.head[e] == v else -1
                else:
                    d = 1 if self.tail[e] == v else -1
                if outside:
                    d = -d
                total += value if d > 0 else -value
        return total

    def init_cut_values(self) -> None:
        order = sorted(range(self.n), key=lambda v: self.lim[v])  # children before parents
        for v in order:
            if self.par[v] >= 0:
                self.cut[self.par[v]] = self.cut_value(self.par[v])

    # ----- pivots
    def leave_edge(self) -> int:
        best = -1
        found = 0
        size = len(self.tree_edges)
        for k in range(size):
            i = (self.search_at + k) % size
            e = self.tree_edges[i]
            if self.cut[e] < 0:
                if best < 0 or self.cut[e] < self.cut[best]:
                    best = e
                found += 1
                if found >= _SEARCH:
                    self.search_at = i
                    return best
        self.search_at = 0
        return best

    def enter_edge(self, e: int) -> int:
        """The non-tree edge of least slack from ``e``'s head component to its tail component."""
        t, h = self.tail[e], self.head[e]
        if self.lim[t] < self.lim[h]:
            v, search_out = t, False  # the tail side is the subtree below e
        else:
            v, search_out = h, True
        low, lim = self.low[v], self.lim[v]
        best, best_slack = -1, 0
        stack = [v]
        while stack:
            x = stack.pop()
            for f in (self.out[x] if search_out else self.inc[x]):
                other = self.head[f] if search_out else self.tail[f]
                if not self.in_tree[f] and not (low <= self.lim[other] <= lim):
                    s = self.slack(f)
                    if best < 0 or s < best_slack:
                        best, best_slack = f, s
            if best >= 0 and best_slack == 0:
                break  # no slack is less
            for f in self.tree_adj[x]:
                if f != self.par[x]:
                    stack.append(self.head[f] if self.tail[f] == x else self.tail[f])
        return best

    def _rerank(self, v: int, delta: int) -> None:
        """Subtract ``delta`` from the ranks of v's side of its parent edge (dot's rerank)."""
        rank, adj_of, ends = self.rank, self.tree_adj, self.ends
        stack = [(v, self.par[v])]
        while stack:
            x, skip = stack.pop()
            rank[x] -= delta
            for f in adj_of[x]:
                if f != skip:
                    stack.append((ends[f] ^ x, f))

    def _tree_update(self, v: int, w: int, value: int, forward: bool) -> int:
        while not (self.low[v] <= self.lim[w] <= self.lim[v]):
            e = self.par[v]
            d = forward if v == self.tail[e] else not forward
            self.cut[e] += value if d else -value
            v = self.tail[e] if self.lim[self.tail[e]] > self.lim[self.head[e]] else self.head[e]
        return v

    def _invalidate(self, lca: int, v: int) -> None:
        """Mark the nodes from v up to the lowest common ancestor for renumbering (dot's
        invalidate_path)."""
        while self.low[v] != -1:
            self.low[v] = -1
            e = self.par[v]
            if e < 0 or self.lim[v] >= self.lim[lca]:
                return
            v = self.tail[e] if self.lim[self.tail[e]] > self.lim[self.head[e]] else self.head[e]

    def update(self, e: int, f: int) -> None:
        delta = self.slack(f)
        if delta > 0:
            t, h = self.tail[e], self.head[e]
            if self.lim[t] < self.lim[h]:
                self._rerank(t, delta)
            else:
                self._rerank(h, -delta)
        value = self.cut[e]
        lca = self._tree_update(self.tail[f], self.head[f], value, True)
        if self._tree_update(self.head[f], self.tail[f], value, False) != lca:
            raise AssertionError("network_simplex: mismatched lowest common ancestor")
        lca_low = self.low[lca]
        self._invalidate(lca, self.head[f])
        self._invalidate(lca, self.tail[f])
        self.cut[f] = -value
        self.cut[e] = 0
        # swap e for f in the tree
        self.in_tree[e] = False
        self.tree_adj[self.tail[e]].remove(e)
        self.tree_adj[self.head[e]].remove(e)
        self.tree_edges[self.tree_edges.index(e)] = f
        self.in_tree[f] = True
        self.tree_adj[self.tail[f]].append(f)
        self.tree_adj[self.head[f]].append(f)
        self.number(lca, self.par[lca], lca_low)

    def balance(self) -> None:
        """Centre what may move for free (dot's LR_balance): across a tree edge of cut value 0,
        moving one side costs nothing; move it half the slack of the edge that would replace it."""
        for e in list(self.tree_edges):
            if self.cut[e] != 0:
                continue
            f = self.enter_edge(e)
            if f < 0:
                continue
            delta = self.slack(f)
            if delta <= 1:
                continue
            if self.lim[self.tail[e]] < self.lim[self.head[e]]:
                self._rerank(self.tail[e], delta // 2)
            else:
                self._rerank(self.head[e], -(delta // 2))


def _connected(n: int, tail: list[int], head: list[int], minlen: list[int], weight: list[int],
               rank: list[int]) -> int:
    """Join the graph's components (if more than one) under one extra node by weightless edges;
    returns the number of nodes."""
    parent = list(range(n))

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for t, h in zip(tail, head, strict=True):
        a, b = find(t), find(h)
        if a != b:
            parent[a] = b
    roots = sorted({find(v) for v in range(n)})
    if len(roots) < 2:
        return n
    rank.append(min(rank))
    for r in roots:
        tail.append(n)
        head.append(r)
        minlen.append(0)
        weight.append(0)
    return n + 1


def network_simplex(
    n: int,
    tail: Sequence[int],
    head: Sequence[int],
    minlen: Sequence[int],
    weight: Sequence[int],
    rank: Sequence[int],
    *,
    max_iter: int | None = None,
    balance: bool = False,
) -> list[int]:
    """Ranks of ``n`` nodes minimising ``sum(weight * (rank[head] - rank[tail]))`` subject to
    ``rank[head] - rank[tail] >= minlen`` on every edge (see NOTE [ network simplex,
    iteratively ]), from the feasible ranks ``rank`` (the components of a graph in pieces are joined
under one extra node by weightless edges, which change nothing). At most
    ``max_iter`` swaps (feasible, possibly not least, when stopped early). ``balance`` centres
    nodes whose place costs nothing either way (as dot does for x coordinates). The least rank
    is 0."""
    if n == 0:
        return []
    tail, head, minlen, weight, ranks = list(tail), list(head), list(minlen), list(weight), list(rank)
    size = _connected(n, tail, head, minlen, weight, ranks)
    s = _Simplex(size, tail, head, minlen, weight, ranks)
    for e in range(len(s.tail)):
        if s.slack(e) < 0:
            raise ValueError(f"network_simplex: the ranks given are not feasible on edge {e}")
    s.feasible_tree()
    s.number(0, -1, 1)
    s.init_cut_values()
    swaps = 0
    while max_iter is None or swaps < max_iter:
        e = s.leave_edge()
        if e < 0:
            break
        f = s.enter_edge(e)
        if f < 0:
            raise AssertionError("network_simplex: no edge enters the tree")
        s.update(e, f)
        swaps += 1
    if balance:
        s.balance()
    low = min(s.rank[:n])
    return [r - low for r in s.rank[:n]]
