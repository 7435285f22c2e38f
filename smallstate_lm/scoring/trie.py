"""Prefix tries of token sequences and what they cost tree attention (`TreeSize`), counted without building
them where only the size is asked (the service's pricing, the scorer's plan). No torch: sizing a request
costs no start-up."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

# Up to this many tokens, trie sizes are counted in plain Python (a 5-best list, 59 tokens: 6 us against 52 us
# for the array operations; a 50-best list, 565 tokens: 47 against 62 us; the arrays win from about 1,000; AMD EPYC)
SMALL_TRIE_TOKENS = 768


@dataclass(frozen=True)
class TreeSize:
    """What a batch of tries costs tree attention, in the terms of a model's `tree_plan`:
    rows, nodes of the largest row, nodes in all, the deepest node's depth, and the sum
    over leaves of depth + 1. `a + b` is the batch of both."""

    n_rows: int = 0
    max_nodes: int = 0
    total_nodes: int = 0
    max_depth: int = 0
    path_len: int = 0

    def __add__(self, other: "TreeSize") -> "TreeSize":
        return TreeSize(self.n_rows + other.n_rows, max(self.max_nodes, other.max_nodes),
                        self.total_nodes + other.total_nodes, max(self.max_depth, other.max_depth),
                        self.path_len + other.path_len)

    def nbytes(self, model, max_work_bytes: int | None) -> int:
        """The peak working memory of `model.score_tree` on such a batch under the cap."""
        return self.plan(model, max_work_bytes).nbytes

    def plan(self, model, max_work_bytes: int | None):
        """The plan `model.score_tree` follows on such a batch under the cap (`model.tree_plan`'s)."""
        return model.tree_plan(self.n_rows, self.max_nodes, self.total_nodes, self.max_depth, self.path_len,
                               max_work_bytes)


class PrefixTrie:
    """The prefix trie of token sequences, cut into segments: maximal non-branching
    chains of nodes. One segment is one row of one `score` call; a segment's parent
    is the segment holding the node it hangs from, and its level is its depth in
    segments (all segments of a level are scored in one batched call).

    `size` is what the trie costs tree attention (`TreeSize`)."""

    def __init__(self, seqs: Sequence[Sequence[int]]):
        children: list[dict[int, int]] = [{}]  # node 0 is the root (the state after <s>)
        token: list[int] = [-1]
        parent: list[int] = [-1]
        depth: list[int] = [0]
        self.node_paths: list[list[int]] = []
        for s in seqs:
            node, path = 0, []
            for t in s:
                nxt = children[node].get(t)
                if nxt is None:
                    nxt = len(children)
                    children[node][t] = nxt
                    children.append({})
                    token.append(t)
                    parent.append(node)
                    depth.append(len(path) + 1)
                node = nxt
                path.append(node)
            self.node_paths.append(path)
        ends = {p[-1] for p in self.node_paths if p}
        self.n_nodes = len(children) - 1
        # leaves are the nodes without children (the root, when there is nothing else)
        self.size = TreeSize(1, self.n_nodes, self.n_nodes, max(depth),
                             sum(d + 1 for d, c in zip(depth, children) if not c))
        # nodes 1..n in creation order: every parent precedes its children
        self.node_token = token
        self.node_parent = parent
        self._children, self._ends = children, ends

    @functools.cached_property
    def _segments(self) -> tuple[list[list[int]], list[list[int]], list[int], list[int]]:
        """(nodes, tokens, parent segment, level) per segment; only the level-by-level path asks, so tree
        attention does not pay for them."""
        children, ends, token = self._children, self._ends, self.node_token
        seg_nodes, seg_tokens, seg_parent, seg_level = [], [], [], []
        stack = [(0, -1, 0)]  # (node the segments hang from, its segment, level)
        while stack:
            start, parent, level = stack.pop()
            for child in children[start].values():
                nodes = [child]
                while len(children[nodes[-1]]) == 1 and nodes[-1] not in ends:
                    nodes.append(next(iter(children[nodes[-1]].values())))
                idx = len(seg_nodes)
                seg_nodes.append(nodes)
                seg_tokens.append([token[n] for n in nodes])
                seg_parent.append(parent)
                seg_level.append(level)
                if children[nodes[-1]]:
                    stack.append((nodes[-1], idx, level + 1))
        return seg_nodes, seg_tokens, seg_parent, seg_level

    @property
    def seg_nodes(self) -> list[list[int]]:
        return self._segments[0]

    @property
    def seg_tokens(self) -> list[list[int]]:
        return self._segments[1]

    @property
    def seg_parent(self) -> list[int]:
        return self._segments[2]

    @property
    def seg_level(self) -> list[int]:
        return self._segments[3]

    @property
    def n_levels(self) -> int:
        return 1 + max(self.seg_level, default=-1)


class SortedTrie(NamedTuple):
    """The nodes of the prefix trie of sequences already in sorted order, what tree attention reads of a
    `PrefixTrie` (`node_token`, `node_parent`, `node_paths`, `n_nodes`), built without a dict per node: each
    sequence shares with the trie exactly its common prefix with the sequence before it."""

    node_token: list[int]
    node_parent: list[int]
    node_paths: list[list[int]]
    n_nodes: int

    @classmethod
    def build(cls, seqs: Sequence[Sequence[int]]) -> SortedTrie:
        token, parent, paths = [-1], [-1], []
        prev: Sequence[int] = ()
        prev_path: list[int] = []
        for s in seqs:
            c, n = 0, min(len(s), len(prev))
            while c < n and s[c] == prev[c]:
                c += 1
            path = prev_path[:c]
            node = path[-1] if c else 0
            for t in s[c:]:
                token.append(t)
                parent.append(node)
                node = len(token) - 1
                path.append(node)
            paths.append(path)
            prev, prev_path = s, path
        return cls(token, parent, paths, len(token) - 1)


def trie_size(seqs: Sequence[Sequence[int]]) -> TreeSize:
    """`PrefixTrie(seqs).size` without building the trie: `trie_sizes` of this one list."""
    lens = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    ids = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
    return trie_sizes(ids, lens, np.zeros(len(seqs), dtype=np.int64), 1)[0]


def trie_sizes(ids: np.ndarray, lens: np.ndarray, lists: np.ndarray, n_lists: int,
               end: int | None = None) -> list[TreeSize]:
    """The prefix-trie size of each of many lists of sequences, in one set of array operations (a request
    of 256 n-best lists in ~10 ms): from the sequences sorted, each adds its length less the prefix it
    shares with the one before, and is a leaf unless the next one extends it. `ids` holds every sequence's
    tokens one after another, `lens` their lengths, `lists` the list (0 .. n_lists - 1) each sequence
    belongs to; `end`, when given, is a token appended to every sequence. Sequences of different lists
    never share a prefix: the list is a first, never-equal-across-lists column of the sorted table."""
    lens = np.asarray(lens, dtype=np.int64)
    n = len(lens)
    sizes = [TreeSize(1, 0, 0, 0, 1)] * n_lists
    if n == 0:
        return sizes
    if len(ids) <= SMALL_TRIE_TOKENS:
        return _small_trie_sizes(ids, lens, lists, n_lists, end)
    starts = np.cumsum(lens) - lens
    full = lens + (end is not None)
    a = np.full((n, int(full.max()) + 1), -1, dtype=np.int64)
    a[:, 0] = lists
    rows = np.repeat(np.arange(n), lens)
    a[rows, np.arange(len(rows)) - np.repeat(starts, lens) + 1] = ids
    if end is not None:
        a[np.arange(n), lens + 1] = end
    order = np.lexsort(a.T[::-1])
    a, full, lists = a[order], full[order], np.asarray(lists)[order]
    same = (a[1:] == a[:-1]) & (a[1:] >= 0)
    common = np.maximum(np.cumprod(same, axis=1).sum(axis=1) - 1, 0)  # shared tokens with the sequence before
    leaf = np.ones(n, dtype=bool)
    leaf[:-1] = common < full[:-1]
    leaf &= full > 0
    nodes = np.bincount(lists, weights=full, minlength=n_lists) - np.bincount(lists[1:], weights=common,
                                                                              minlength=n_lists)
    depth = np.zeros(n_lists, dtype=np.int64)
    np.maximum.at(depth, lists, full)
    path = np.bincount(lists, weights=np.where(leaf, full + 1, 0), minlength=n_lists)
    present = np.bincount(lists, minlength=n_lists) > 0
    return [TreeSize(1, int(k), int(k), int(d), int(p)) if has and d > 0 else TreeSize(1, 0, 0, 0, 1)
            for k, d, p, has in zip(nodes.tolist(), depth.tolist(), path.tolist(), present.tolist())]


def _small_trie_sizes(ids, lens: np.ndarray, lists, n_lists: int, end: int | None) -> list[TreeSize]:
    """`trie_sizes` in plain Python, for few tokens: the array operations' fixed cost (~50 us) is most of a
    small request's. The same walk over each list's sorted sequences."""
    flat = np.asarray(ids).tolist()
    by_list: list[list[list[int]]] = [[] for _ in range(n_lists)]
    pos = 0
    for length, k in zip(lens.tolist(), np.asarray(lists).tolist()):
        seq = flat[pos : pos + length]
        pos += length
        if end is not None:
            seq.append(end)
        by_list[k].append(seq)
    out = []
    for seqs in by_list:
        seqs.sort()
        common = [0] * (len(seqs) + 1)  # tokens each shares with the one before; a last 0 ends the list
        nodes = depth = path = 0
        for k, s in enumerate(seqs):
            if k:
                prev, c, m = seqs[k - 1], 0, min(len(s), len(seqs[k - 1]))
                while c < m and s[c] == prev[c]:
                    c += 1
                common[k] = c
            nodes += len(s) - common[k]
            depth = max(depth, len(s))
        for k, s in enumerate(seqs):  # a leaf unless the next one extends it
            if s and (k + 1 == len(seqs) or common[k + 1] < len(s)):
                path += len(s) + 1
        out.append(TreeSize(1, nodes, nodes, depth, path) if depth > 0 else TreeSize(1, 0, 0, 0, 1))
    return out


def sorted_groups(seqs: Sequence[Sequence], fits) -> list[tuple[list[int], TreeSize]]:
    """The indices of `seqs` in sorted order (so that sequences sharing a prefix stay together), cut into
    groups whose one-row trie's `TreeSize` `fits(size)` (a sequence that fits alone nowhere is a group of
    its own), each with that size."""
    groups: list[tuple[list[int], TreeSize]] = []
    group: list[int] = []
    size = TreeSize()
    for j in sorted(range(len(seqs)), key=seqs.__getitem__):
        grown = _grown(size, seqs[group[-1]] if group else None, seqs[j])
        if group and not fits(grown):
            groups.append((group, size))
            group, grown = [], _grown(TreeSize(), None, seqs[j])
        group.append(j)
        size = grown
    groups.append((group, size))
    return groups


def _grown(size: TreeSize, prev: Sequence[int] | None, seq: Sequence[int]) -> TreeSize:
    """The size of a one-row trie over sorted sequences, of size `size` and ending in `prev`
    (None: empty), once `seq` (>= prev) joins it: `seq` adds its length less the prefix it
    shares with prev, and a leaf unless it repeats prev; prev's end stops being a leaf
    when `seq` extends it."""
    if prev is None:
        return TreeSize(1, len(seq), len(seq), len(seq), len(seq) + 1)
    common = 0
    for a, b in zip(prev, seq):
        if a != b:
            break
        common += 1
    path = size.path_len
    if common < len(seq):
        path += len(seq) + 1 - (len(prev) + 1 if common == len(prev) else 0)
    new = len(seq) - common
    return TreeSize(1, size.max_nodes + new, size.total_nodes + new, max(size.max_depth, len(seq)), path)
