"""Tree attention or padded rows: both timed on the device once, and each call scored the way predicted faster
for its hypotheses (prefix sharing computes fewer tokens, but where kernel launches rather than arithmetic bound
the time, padded rows can win)."""

from __future__ import annotations

from dataclasses import dataclass

from ..vocab import EOS_ID
from .trie import trie_size


@dataclass(frozen=True)
class PathCosts:
    """Seconds per trie node of tree attention and per token of padded rows, measured on one device."""

    tree_node_s: float
    padded_token_s: float

    def prefers_tree(self, nodes: int, tokens: int) -> bool:
        return nodes * self.tree_node_s <= tokens * self.padded_token_s


def measure_path_costs(scorer, rounds: int = 3) -> PathCosts:
    """`scorer` (a NeuralScorer)'s two paths timed on the same lists, shaped like a decoder's n-best output (8
    lists of 32 hypotheses of 12 words that share a stem of 4 to 8 words): the fastest of `rounds` runs of each,
    taken in turns."""
    import random

    import torch

    from ..device import fastest_seconds

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
