"""Tree attention over prefix tries: the plan (batches of tries within a token budget and a cap on working
memory, sub-tries where one trie does not fit) and its run through the model's `score_tree`, one pass per
batch of tries."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from torch import nn

from ..errors import WorkLimitError
from ..state import pad_batch
from .trie import PrefixTrie, SortedTrie, TreeSize, sorted_groups, trie_size

# The working memory (bytes) a scorer lets one tree-attention call hold unless told
# otherwise: small beside a server's memory, ample for n-best lists of ordinary size
# (a trie past a few thousand nodes runs in blocks, or in sub-tries, within it).
DEFAULT_MAX_WORK_BYTES = 256 * 2**20


class WorkCost(NamedTuple):
    """What scoring some utterances will cost, known before any work: `trie_nodes`, the
    nodes of their prefix tries (every token without prefix sharing), and `nbytes`, the
    peak working memory of the scorer's plan. Above the scorer's `max_work_bytes` the
    plan cannot run: `token_logprobs` would raise WorkLimitError."""

    trie_nodes: int
    nbytes: int


@dataclass
class TreeRow:
    """One row of a tree-attention batch: the trie over hypotheses `hyps` of utterance
    `utt`, all of them or a sub-trie's; `trie` is built when the row runs if not before."""

    utt: int
    hyps: list[int]
    size: TreeSize
    trie: PrefixTrie | None = None
    sorted: bool = False  # hyps in the sorted order of their sequences (a sub-trie's)


@dataclass(frozen=True)
class TreePlanner:
    """Plans and runs tree attention for one model: batches within `batch_tokens` rows x nodes and each call's
    working memory within `max_work_bytes` (None: no cap)."""

    model: nn.Module
    batch_tokens: int
    max_work_bytes: int | None

    def plan(self, encoded, sizes: list[TreeSize] | None = None) -> tuple[list[list[TreeRow]], int, int]:
        """The tree-attention plan for utterances of encoded hypotheses (their tries' `sizes`, when known):
        batches of rows within `batch_tokens` and the cap, the utterances' trie nodes, and the plan's peak
        bytes (above the cap: a hypothesis alone does not fit)."""
        rows: list[TreeRow] = []
        nodes = 0
        for u, hyps in enumerate(encoded):
            # sized from counts; a row's trie is built when its batch runs, so that one batch's tries are
            # alive at a time (a request near max_trie_nodes: some 40 MB of Python objects)
            size = sizes[u] if sizes is not None else trie_size(hyps)
            nodes += size.total_nodes
            if self.fits(size):
                rows.append(TreeRow(u, list(range(len(hyps))), size))
            else:
                rows.extend(self.split(u, hyps))
        rows.sort(key=lambda r: r.size.max_nodes)
        batches, i = [], 0
        while i < len(rows):
            size, n = rows[i].size, 1
            while i + n < len(rows) and (n + 1) * rows[i + n].size.max_nodes <= self.batch_tokens \
                    and self.fits(size + rows[i + n].size):
                size = size + rows[i + n].size
                n += 1
            batches.append(rows[i : i + n])
            i += n
        peak = max((sum((r.size for r in b), TreeSize()).nbytes(self.model, self.max_work_bytes) for b in batches),
                   default=0)
        return batches, nodes, peak

    def fits(self, size: TreeSize) -> bool:
        """Whether score_tree can run a batch of that size within the cap (and the model's `max_tree_nodes`
        per row: a model whose tree attention is dense is faster on smaller sub-tries)."""
        limit = self.model.max_tree_nodes
        if limit is not None and size.max_nodes > limit:
            return False
        if size.n_rows == 1 and self._rows_under_the_limit_fit:
            return True
        return self.max_work_bytes is None or size.nbytes(self.model, self.max_work_bytes) <= self.max_work_bytes

    @functools.cached_property
    def _rows_under_the_limit_fit(self) -> bool:
        """Whether every one-row trie within the model's `max_tree_nodes` fits the cap: the largest such row (its
        most nodes, depth and paths) decides, and splitting an utterance then plans no pass per hypothesis."""
        limit = self.model.max_tree_nodes
        if limit is None or self.max_work_bytes is None:
            return False
        worst = TreeSize(1, limit, limit, limit, limit * (limit + 1))
        return worst.nbytes(self.model, self.max_work_bytes) <= self.max_work_bytes

    def split(self, u: int, hyps: list[list[int]]) -> list[TreeRow]:
        """Utterance u's hypotheses cut into sub-tries that fit the cap, in sorted order so
        that the hypotheses sharing a prefix stay together."""
        return [TreeRow(u, group, size, sorted=True) for group, size in sorted_groups(hyps, self.fits)]

    def run(self, encoded, out, device, sizes: list[TreeSize] | None = None) -> int:
        """Tree attention over each utterance's trie (or its sub-tries), batched as planned; `out[u][j]` gets
        hypothesis j of utterance u's log-probs. Returns the trie nodes computed. Raises WorkLimitError when
        even one hypothesis at a time passes the cap."""
        batches, _, peak = self.plan(encoded, sizes)
        if self.max_work_bytes is not None and peak > self.max_work_bytes:
            raise WorkLimitError(f"scoring these hypotheses needs {peak / 2**20:.1f} MiB of working memory even one "
                                 f"hypothesis at a time, more than max_work_bytes ({self.max_work_bytes / 2**20:.1f} "
                                 "MiB): raise it, or send shorter hypotheses")
        computed = 0
        for batch in batches:
            tries = [r.trie or (SortedTrie.build if r.sorted else PrefixTrie)([encoded[r.utt][j] for j in r.hyps])
                     for r in batch]
            tokens, lengths = pad_batch([t.node_token[1:] for t in tries], device)
            parents, _ = pad_batch([[p - 1 for p in t.node_parent[1:]] for t in tries], device)
            plan = sum((r.size for r in batch), TreeSize()).plan(self.model, self.max_work_bytes)
            logp = self.model.score_tree(tokens, parents, lengths, max_work_bytes=self.max_work_bytes, plan=plan)
            logp = logp.double().cpu().numpy()
            for r, (row, trie) in enumerate(zip(batch, tries)):
                node_logp = np.concatenate([[0.0], logp[r, : trie.n_nodes]])
                for j, path in zip(row.hyps, trie.node_paths):
                    out[row.utt][j] = node_logp[path]
                computed += trie.n_nodes
        return computed
