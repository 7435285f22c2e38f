"""Scorers and score combination (natural log, higher is better).

Every hypothesis keeps its components separately — am, graph, neural, ngram, the
word count and OOV count — so a sweep over weights re-ranks cached numbers and never
calls an LM again. All scores are natural log.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from .errors import ConfigError, WorkLimitError
from .state import pad_batch
from .vocab import EOS_ID, Vocabulary
from .weights import (  # noqa: F401  (the public names of score combination, re-exported)
    COMPONENTS,
    Weights,
    check_overlap,
    count_oov,
    lm_score,
    log_mix,
    oov_counts,
    oov_reference,
    weight_vector,
    weighted_total,
)

# ---------------------------------------------------------------------------------------
# Neural scoring
# ---------------------------------------------------------------------------------------


# The working memory (bytes) a scorer lets one tree-attention call hold unless told
# otherwise: small beside a server's memory, ample for n-best lists of ordinary size
# (a trie past a few thousand nodes runs in blocks, or in sub-tries, within it).
DEFAULT_MAX_WORK_BYTES = 256 * 2**20
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

    def nbytes(self, model: nn.Module, max_work_bytes: int | None) -> int:
        """The peak working memory of `model.score_tree` on such a batch under the cap."""
        return self.plan(model, max_work_bytes).nbytes

    def plan(self, model: nn.Module, max_work_bytes: int | None):
        """The plan `model.score_tree` follows on such a batch under the cap (`model.tree_plan`'s)."""
        return model.tree_plan(self.n_rows, self.max_nodes, self.total_nodes, self.max_depth, self.path_len,
                               max_work_bytes)


class WorkCost(NamedTuple):
    """What scoring some utterances will cost, known before any work: `trie_nodes`, the
    nodes of their prefix tries (every token without prefix sharing), and `nbytes`, the
    peak working memory of the scorer's plan. Above the scorer's `max_work_bytes` the
    plan cannot run: `token_logprobs` would raise WorkLimitError."""

    trie_nodes: int
    nbytes: int


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


class NeuralScorer:
    """Per-token natural-log probabilities of word sequences under a stateful LM.

    `share_prefixes=True` scores each unique prefix once: per utterance, a trie over
    its hypotheses, scored in one pass of tree attention when the model has
    `score_tree`, else segment by segment with `state.select()` handing each branch
    its parent's state (batched across utterances level by level). `False` scores
    every hypothesis as its own padded row. All give the same numbers up to float
    rounding.

    `max_work_bytes` caps the working memory of each tree-attention call (None: no cap,
    one dense pass per batch): a trie too large for the dense pass runs in blocks, one
    too large even for that is split into sub-tries of whole hypotheses. `estimate_cost`
    says what a request will cost before any work.
    """

    def __init__(self, model: nn.Module, vocab: Vocabulary, device: str | torch.device = "cpu",
                 batch_tokens: int = 8192, share_prefixes: bool = True, group_tokens: int | None = None,
                 use_tree: bool = True, max_work_bytes: int | None = DEFAULT_MAX_WORK_BYTES):
        if max_work_bytes is not None and max_work_bytes <= 0:
            raise ConfigError(f"max_work_bytes must be positive (or None for no cap), got {max_work_bytes}")
        self.model, self.vocab, self.device = model, vocab, torch.device(device)
        self.batch_tokens = batch_tokens
        self.group_tokens = group_tokens or 8 * batch_tokens
        # Tree attention (one pass per trie) where the model offers it; otherwise the
        # tries are walked level by level through the state contract.
        self.use_tree = use_tree and model.score_tree is not None and model.tree_plan is not None
        self.share_prefixes = share_prefixes
        self.max_work_bytes = max_work_bytes
        self.tokens_total = 0
        self.tokens_computed = 0
        self.path_costs: PathCosts | None = None  # set by choose_paths
        self.calls_padded = 0  # calls scored as padded rows by that choice

    def encode(self, words: Sequence[str]) -> list[int]:
        """Word ids followed by `</s>`; OOVs become `<unk>`."""
        return self.vocab.encode(words) + [EOS_ID]

    @torch.no_grad()
    def token_logprobs(self, groups: Sequence[Sequence[Sequence[str]]],
                       sizes: Sequence[TreeSize] | None = None) -> list[list[np.ndarray]]:
        """groups: per utterance, its hypotheses as word lists; `sizes`, when the caller has them, the
        `trie_size` of each utterance's encoded hypotheses. Returns, per utterance and hypothesis, an array of
        len(words)+1 log-probs (the last one is `</s>`)."""
        encoded = [[self.encode(h) for h in hyps] for hyps in groups]
        out: list[list[np.ndarray]] = [[None] * len(h) for h in encoded]  # type: ignore[list-item]
        self.model.eval()
        if sizes is None and self.share_prefixes and self.path_costs is not None:
            # sized once here when the choice of path needs the tries' sizes, for the plan too
            sizes = [trie_size(hyps) for hyps in encoded]
        sizes = list(sizes) if sizes is not None and self.share_prefixes else None
        if not self.share_prefixes or (self.path_costs is not None and not self._tree_pays(encoded, sizes)):
            self._score_padded(encoded, out)
            return out
        if self.use_tree:
            self._score_trees(encoded, out, sizes)
            return out
        # Utterances are grouped so that a group's trie holds about `group_tokens` tokens:
        # big levels make big batches, which is what keeps a CPU or GPU busy.
        start = 0
        while start < len(encoded):
            end, budget = start, 0
            while end < len(encoded) and (end == start or budget + sum(map(len, encoded[end])) <= self.group_tokens):
                budget += sum(map(len, encoded[end]))
                end += 1
            self._score_group(encoded[start:end], out[start:end])
            start = end
        return out

    def _score_padded(self, encoded, out) -> None:
        """Every hypothesis as its own row, rows of similar length batched within `batch_tokens`."""
        flat = [(u, j, seq) for u, hyps in enumerate(encoded) for j, seq in enumerate(hyps)]
        flat.sort(key=lambda x: len(x[2]))
        i = 0
        while i < len(flat):
            n = 1
            while i + n < len(flat) and (n + 1) * len(flat[i + n][2]) <= self.batch_tokens:
                n += 1
            chunk = flat[i : i + n]
            seqs = [c[2] for c in chunk]
            lp, _ = self._score_rows(seqs, None, None)
            for (u, j, seq), row in zip(chunk, lp):
                out[u][j] = row[: len(seq)]
            self.tokens_total += sum(len(s) for s in seqs)
            self.tokens_computed += sum(len(s) for s in seqs)
            i += n

    def choose_paths(self, rounds: int = 3) -> PathCosts:
        """Time tree attention and padded rows on this device (a fraction of a second) and, from then on,
        score each call the way predicted faster for its hypotheses: prefix sharing computes fewer tokens,
        but where kernel launches rather than arithmetic bound the time (a GPU with a small model) padded
        rows can be faster all the same. The choice only moves the numbers by float rounding."""
        self.path_costs = None
        if self.share_prefixes and self.use_tree:
            self.path_costs = measure_path_costs(self, rounds)
        return self.path_costs

    def _tree_pays(self, encoded, sizes: list[TreeSize]) -> bool:
        """Whether prefix sharing is predicted faster than padded rows for these hypotheses (their tries of
        `sizes`), by the costs `choose_paths` measured."""
        nodes = sum(size.total_nodes for size in sizes)
        tokens = sum(len(s) for hyps in encoded for s in hyps)
        pays = self.path_costs.prefers_tree(nodes, tokens)
        self.calls_padded += not pays
        return pays

    def estimate_cost(self, groups: Sequence[Sequence[Sequence[str]]]) -> WorkCost:
        """What `token_logprobs(groups)` will cost, without running the model: the trie
        nodes and the peak working memory of the plan (`WorkCost`). With tree attention,
        the bound of the very plan `token_logprobs` follows; for the other paths a rough
        estimate of their largest batch, which `batch_tokens` bounds, not `max_work_bytes`."""
        encoded = [[self.encode(h) for h in hyps] for hyps in groups]
        if self.share_prefixes and self.use_tree:
            _, nodes, nbytes = self._plan_trees(encoded)
            return WorkCost(nodes, nbytes)
        seqs = [s for hyps in encoded for s in hyps]
        nodes = sum(trie_size(hyps).total_nodes for hyps in encoded) if self.share_prefixes else sum(map(len, seqs))
        cfg = self.model.cfg
        longest = max(map(len, seqs), default=0)
        # per token: its state, activations and a row of attention scores per head
        per_token = 4 * (self.model.state_numel_per_position() + 16 * cfg.d_model + cfg.d_ff
                         + 2 * cfg.n_heads * longest)
        return WorkCost(nodes, max(self.batch_tokens, longest) * per_token)

    def _plan_trees(self, encoded, sizes: list[TreeSize] | None = None) -> tuple[list[list[_TreeRow]], int, int]:
        """The tree-attention plan for utterances of encoded hypotheses (their tries' `sizes`, when known):
        batches of rows within `batch_tokens` and the cap, the utterances' trie nodes, and the plan's peak
        bytes (above the cap: a hypothesis alone does not fit)."""
        rows: list[_TreeRow] = []
        nodes = 0
        for u, hyps in enumerate(encoded):
            # sized from counts; a row's trie is built when its batch runs, so that one batch's tries are
            # alive at a time (a request near max_trie_nodes: some 40 MB of Python objects)
            size = sizes[u] if sizes is not None else trie_size(hyps)
            nodes += size.total_nodes
            if self._fits(size):
                rows.append(_TreeRow(u, list(range(len(hyps))), size))
            else:
                rows.extend(self._split(u, hyps))
        rows.sort(key=lambda r: r.size.max_nodes)
        batches, i = [], 0
        while i < len(rows):
            size, n = rows[i].size, 1
            while i + n < len(rows) and (n + 1) * rows[i + n].size.max_nodes <= self.batch_tokens \
                    and self._fits(size + rows[i + n].size):
                size = size + rows[i + n].size
                n += 1
            batches.append(rows[i : i + n])
            i += n
        peak = max((sum((r.size for r in b), TreeSize()).nbytes(self.model, self.max_work_bytes) for b in batches),
                   default=0)
        return batches, nodes, peak

    def _fits(self, size: TreeSize) -> bool:
        """Whether score_tree can run a batch of that size within the cap."""
        return self.max_work_bytes is None or size.nbytes(self.model, self.max_work_bytes) <= self.max_work_bytes

    def _split(self, u: int, hyps: list[list[int]]) -> list[_TreeRow]:
        """Utterance u's hypotheses cut into sub-tries that fit the cap, in sorted order so
        that the hypotheses sharing a prefix stay together."""
        return [_TreeRow(u, group, size) for group, size in sorted_groups(hyps, self._fits)]

    def _score_trees(self, encoded, out, sizes: list[TreeSize] | None = None) -> None:
        """Tree attention over each utterance's trie (or its sub-tries), batched as planned."""
        batches, _, peak = self._plan_trees(encoded, sizes)
        if self.max_work_bytes is not None and peak > self.max_work_bytes:
            raise WorkLimitError(f"scoring these hypotheses needs {peak / 2**20:.1f} MiB of working memory even one "
                                 f"hypothesis at a time, more than max_work_bytes ({self.max_work_bytes / 2**20:.1f} "
                                 "MiB): raise it, or send shorter hypotheses")
        for batch in batches:
            tries = [r.trie or PrefixTrie([encoded[r.utt][j] for j in r.hyps]) for r in batch]
            tokens, lengths = pad_batch([t.node_token[1:] for t in tries], self.device)
            parents, _ = pad_batch([[p - 1 for p in t.node_parent[1:]] for t in tries], self.device)
            plan = sum((r.size for r in batch), TreeSize()).plan(self.model, self.max_work_bytes)
            logp = self.model.score_tree(tokens, parents, lengths, max_work_bytes=self.max_work_bytes, plan=plan)
            logp = logp.double().cpu().numpy()
            for r, (row, trie) in enumerate(zip(batch, tries)):
                node_logp = np.concatenate([[0.0], logp[r, : trie.n_nodes]])
                for j, path in zip(row.hyps, trie.node_paths):
                    out[row.utt][j] = node_logp[path]
                self.tokens_computed += trie.n_nodes
        self.tokens_total += sum(len(s) for hyps in encoded for s in hyps)

    def _score_rows(self, seqs, parent_state, parent_rows):
        """Score padded rows, each continuing row `parent_rows[i]` of `parent_state`
        (or `<s>`); -> (logp as float64 numpy (n, T_max), state after each row)."""
        tokens, lengths = pad_batch(seqs, self.device)
        state = (self.model.initial_state(len(seqs), self.device) if parent_state is None
                 else parent_state.select(torch.as_tensor(parent_rows, device=self.device)))
        logp, new_state = self.model.score(tokens, state, lengths)
        return logp.double().cpu().numpy(), new_state

    def _score_group(self, encoded, out) -> None:
        seqs = [s for hyps in encoded for s in hyps]
        trie = PrefixTrie(seqs)
        node_logp = np.zeros(trie.n_nodes + 1)
        prev_state, row_of = None, {}
        has_children = {p for p in trie.seg_parent if p >= 0}
        by_level: list[list[int]] = [[] for _ in range(trie.n_levels)]
        for i, lv in enumerate(trie.seg_level):
            by_level[lv].append(i)
        for segs in by_level:
            states, new_row_of, base = [], {}, 0
            for batch in _length_batches(segs, trie.seg_tokens, self.batch_tokens):
                parent_rows = None if prev_state is None else [row_of[trie.seg_parent[i]] for i in batch]
                lp, st = self._score_rows([trie.seg_tokens[i] for i in batch], prev_state, parent_rows)
                keep = []
                for r, i in enumerate(batch):
                    nodes = trie.seg_nodes[i]
                    node_logp[nodes] = lp[r, : len(nodes)]
                    if i in has_children:  # leaves (hypothesis ends) need no state
                        new_row_of[i] = base + len(keep)
                        keep.append(r)
                if keep:
                    base += len(keep)
                    states.append(st.select(torch.as_tensor(keep, device=self.device)).compact())
            if not states:
                break
            prev_state = type(states[0]).cat(states) if len(states) > 1 else states[0]
            row_of = new_row_of
        k = 0
        for u, hyps in enumerate(encoded):
            for j in range(len(hyps)):
                out[u][j] = node_logp[trie.node_paths[k]]
                k += 1
        self.tokens_total += sum(len(s) for s in seqs)
        self.tokens_computed += trie.n_nodes


@dataclass
class _TreeRow:
    """One row of a tree-attention batch: the trie over hypotheses `hyps` of utterance
    `utt`, all of them or a sub-trie's; `trie` is built when the row runs if not before."""

    utt: int
    hyps: list[int]
    size: TreeSize
    trie: PrefixTrie | None = None


@dataclass(frozen=True)
class PathCosts:
    """Seconds per trie node of tree attention and per token of padded rows, measured on one device."""

    tree_node_s: float
    padded_token_s: float

    def prefers_tree(self, nodes: int, tokens: int) -> bool:
        return nodes * self.tree_node_s <= tokens * self.padded_token_s


def measure_path_costs(scorer: "NeuralScorer", rounds: int = 3) -> PathCosts:
    """Both paths timed on the same lists, shaped like a decoder's n-best output (8 lists of 32 hypotheses
    of 12 words that share a stem of 4 to 8 words): the fastest of `rounds` runs of each, taken in turns."""
    import random

    from .device import fastest_seconds

    rng = random.Random(11)
    ids = list(range(4, len(scorer.vocab))) or [EOS_ID]  # a vocabulary of the specials only: any id will do
    encoded = []
    for _ in range(8):
        stem = [rng.choice(ids) for _ in range(8)]
        hyps = []
        for _ in range(32):
            cut = rng.randint(4, 8)
            hyps.append(stem[:cut] + [rng.choice(ids) for _ in range(12 - cut)] + [EOS_ID])
        encoded.append(hyps)
    nodes = sum(trie_size(hyps).total_nodes for hyps in encoded)
    tokens = sum(len(s) for hyps in encoded for s in hyps)
    counts = scorer.tokens_total, scorer.tokens_computed

    def timed(path):  # both paths end copying their log-probs to the host, which waits for the device
        return lambda: path(encoded, [[None] * len(h) for h in encoded])

    with torch.inference_mode():
        tree_s, padded_s = fastest_seconds(timed(scorer._score_trees), timed(scorer._score_padded), rounds=rounds)
    scorer.tokens_total, scorer.tokens_computed = counts
    return PathCosts(tree_s / nodes, padded_s / tokens)


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


def _length_batches(segs: list[int], tokens: list[list[int]], budget: int, slack: float = 2.0):
    """Rows of similar length together: a batch closes when the padded size would pass
    the token budget or its longest row would exceed `slack` x its shortest."""
    order = sorted(segs, key=lambda i: len(tokens[i]))
    batch: list[int] = []
    for i in order:
        n = len(tokens[i])
        if batch and ((len(batch) + 1) * n > budget or n > slack * len(tokens[batch[0]]) + 1):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch
