"""The neural scorer: per-token natural-log probabilities of word sequences under a stateful LM, with each
utterance's hypotheses sharing their prefixes (tree attention, or the trie's segments level by level through the
state contract) or as padded rows."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from ..state import pad_batch
from ..vocab import EOS_ID, Vocabulary
from .paths import PathCosts, measure_path_costs
from .tree_attention import DEFAULT_MAX_WORK_BYTES, TreePlanner, WorkCost
from .trie import PrefixTrie, TreeSize, trie_size
from .words import per_word


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
        self.trees = TreePlanner(model, batch_tokens, max_work_bytes)  # frozen: a scorer's limits never change
        self.tokens_total = 0
        self.tokens_computed = 0
        self.path_costs: PathCosts | None = None  # set by choose_paths
        self.calls_padded = 0  # calls scored as padded rows by that choice

    def encode(self, words: Sequence[str]) -> list[int]:
        """Word ids followed by `</s>`; OOVs become `<unk>`."""
        return self.vocab.encode(words) + [EOS_ID]

    @torch.no_grad()
    def token_logprobs(self, groups: Sequence[Sequence[Sequence[str]]],
                       sizes: Sequence[TreeSize] | None = None,
                       contexts: Sequence[Sequence[int]] | None = None) -> list[list[np.ndarray]]:
        """groups: per utterance, its hypotheses as word lists; `sizes`, when the caller has them, the
        `trie_size` of each utterance's encoded hypotheses. Returns, per utterance and hypothesis, an array of
        len(words)+1 log-probs (the last one is `</s>`); a subword LM's word gets the sum of its pieces'.
        `contexts`: per utterance, tokens read before every one of its hypotheses (`context.context_tokens`),
        a prefix its trie shares, whose own log-probs are not returned."""
        encoded = [[self.encode(h) for h in hyps] for hyps in groups]
        if contexts is not None and any(contexts):
            cut = [len(c) for c in contexts]
            out = self.encoded_logprobs([[list(c) + h for h in hyps] for c, hyps in zip(contexts, encoded)])
            out = [[lp[n:] for lp in lps] for n, lps in zip(cut, out)]
        else:
            out = self.encoded_logprobs(encoded, sizes)
        if self.vocab.subword:
            out = [per_word(self.vocab, hyps, lps) for hyps, lps in zip(groups, out)]
        return out

    @torch.no_grad()
    def encoded_logprobs(self, encoded: list[list[list[int]]],
                         sizes: Sequence[TreeSize] | None = None) -> list[list[np.ndarray]]:
        """`token_logprobs` of hypotheses already encoded (`encode`: word ids, then `</s>`)."""
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
            _, nodes, nbytes = self.trees.plan(encoded)
            return WorkCost(nodes, nbytes)
        seqs = [s for hyps in encoded for s in hyps]
        nodes = sum(trie_size(hyps).total_nodes for hyps in encoded) if self.share_prefixes else sum(map(len, seqs))
        cfg = self.model.cfg
        longest = max(map(len, seqs), default=0)
        # per token: its state, activations and a row of attention scores per head
        per_token = 4 * (self.model.state_numel_per_position() + 16 * cfg.d_model + cfg.d_ff
                         + 2 * cfg.n_heads * longest)
        return WorkCost(nodes, max(self.batch_tokens, longest) * per_token)

    def _score_trees(self, encoded, out, sizes: list[TreeSize] | None = None) -> None:
        """Tree attention over each utterance's trie (or its sub-tries), batched as planned."""
        self.tokens_computed += self.trees.run(encoded, out, self.device, sizes)
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
