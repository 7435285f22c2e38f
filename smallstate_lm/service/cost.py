"""The service's cost model: what a request will cost in seconds and bytes, known before any work.

At warm-up the loaded model is timed on the device it runs on (`calibrate`): tree scoring of
prefix tries (seconds per trie node, growing with the depth of the nodes' histories), one LM
step of lattice expansion (seconds per row, growing with the positions its state holds) and
KenLM lookups. From those numbers a request's seconds and peak bytes are predicted
(`CostModel.estimate`), requests are admitted or refused on them, and the worker's grains (trie
nodes per step, lattice rows per LM call) are sized so that one grain takes about `slice_ms`.

The model is linear and deliberately simple: a hypothesis list costs its trie nodes times the
per-node time at its deepest node, plus its tokens' n-gram lookups; a lattice costs, per level, the
LM steps it may take (per word arc, the paths into its source state, at most `max_per_state`:
an upper bound, the same one as `max_lattice_cost`) times the per-row time at that level's
history length, with the rows of a level capped by what `max_level_bytes` lets it keep.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

import numpy as np

from smallstate_lm.device import fastest_seconds
from smallstate_lm.rescoring.lattices.lattice import Lattice


@dataclass
class Estimate:
    seconds: float
    nbytes: int


@dataclass
class CostModel:
    """Seconds per unit of work on this server's device (defaults: a small model on a slow CPU, used
    until `calibrate` has measured the real ones) and the LM state's bytes."""

    node_s: float = 2e-4  # tree scoring, per trie node ...
    node_depth_s: float = 2e-6  # ... plus this per node and position of its history ...
    call_s: float = 1e-3  # ... plus this per scoring call (a small piece costs more per node than a large one)
    batch_node_s: float = 2e-4  # per node of small lists scored together (many tries in one pass), depth included
    row_s: float = 2e-4  # one lattice LM step, per row ...
    row_pos_s: float = 4e-6  # ... plus this per row and position of its state
    ngram_s: float = 2e-6  # one KenLM lookup
    arc_s: float = 2e-6  # bookkeeping per lattice arc and expansion of its source state
    state_bytes_per_position: int = 0
    state_bytes_fixed: int = 0
    calibrated: bool = False

    # ---- units -----------------------------------------------------------------------------------
    def per_node(self, depth: int) -> float:
        return self.node_s + self.node_depth_s * depth

    def per_row(self, positions: int) -> float:
        return self.row_s + self.row_pos_s * positions

    def grain_nodes(self, depth: int, budget_s: float) -> int:
        """Trie nodes of histories up to `depth` that one tree-scoring call gets through in about `budget_s`."""
        # a call's own cost is paid whatever its size: where it eats most of the budget, calls grow instead
        return max(8, int((budget_s - min(self.call_s, budget_s / 2)) / self.per_node(depth)))

    def rows_per_call(self, positions: int, budget_s: float) -> int:
        """Lattice LM rows of `positions`-long states that one step gets through in about `budget_s`."""
        return max(8, int(budget_s / self.per_row(positions)))

    # ---- requests -----------------------------------------------------------------------------
    def nbest_seconds(self, nodes: int, depth: int, tokens: int, neural: bool, ngram: bool, step_s: float) -> float:
        """A hypothesis list of `nodes` trie nodes (its deepest `depth`) and `tokens` tokens, scored in calls
        of at most a step's worth of nodes."""
        seconds = tokens * self.ngram_s if ngram else 0.0
        if neural:
            calls = max(1, math.ceil(nodes / self.grain_nodes(depth, step_s)))
            if calls == 1:  # scored whole, with the batch's other small lists
                return seconds + self.call_s + nodes * min(self.per_node(depth), self.batch_node_s)
            seconds += calls * self.call_s + nodes * self.per_node(depth)
        return seconds

    def lattice(self, shape: "LatticeShape", max_level_bytes: int | None, neural: bool, ngram: bool) -> Estimate:
        """Seconds and peak LM state bytes of expanding a lattice of `shape`, per level: its LM steps, each
        row holding its level's positions; a level's rows are capped by `max_level_bytes`, as the expansion
        caps them."""
        rows = shape.steps
        positions = np.arange(len(rows)) + 2  # <s> and the step itself
        steps = float(rows.sum())
        row_bytes = positions * self.state_bytes_per_position + self.state_bytes_fixed
        if neural and max_level_bytes is not None and self.state_bytes_per_position:
            rows = np.minimum(rows, np.maximum(1, max_level_bytes // np.maximum(1, row_bytes)))
        seconds = float((rows * (self.row_s + self.row_pos_s * positions)).sum()) if neural else 0.0
        seconds += steps * self.ngram_s * ngram + shape.arc_paths * self.arc_s
        # a level's new states, the gathered states of its parents and the level before it still held
        peak = int(3 * (rows * row_bytes).max()) if neural and len(rows) else 0
        return Estimate(seconds, peak)


@dataclass
class LatticeShape:
    """What expanding a prepared lattice may take, known before any LM work: the LM steps of each level (per
    word arc and per final state, the histories its state may hold, i.e. the paths into it, at most
    `max_per_state`: an upper bound), and the paths into the arcs' source states summed (bookkeeping)."""

    steps: np.ndarray
    arc_paths: float

    @property
    def total_steps(self) -> int:
        return int(self.steps.sum())


def lattice_shape(lat: Lattice, max_per_state: int) -> LatticeShape:
    """`LatticeShape` of the prepared `lat`, linear in its arcs."""
    n = lat.num_states
    paths, depth = [0] * n, [0] * n
    paths[lat.start] = 1
    for a, b in zip(lat.src.tolist(), lat.dst.tolist()):  # prepared: topological states, arcs sorted by source
        paths[b] = min(max_per_state, paths[b] + paths[a])
        if depth[a] + 1 > depth[b]:
            depth[b] = depth[a] + 1
    paths_a, depth_a = np.array(paths, dtype=np.int64), np.array(depth, dtype=np.int64)
    at = np.concatenate([lat.src[lat.symbols.word_flags(lat.word)], np.flatnonzero(lat.is_final())])
    steps = np.bincount(depth_a[at], weights=paths_a[at], minlength=1)
    return LatticeShape(steps, float(paths_a[lat.src].sum()))


def calibrate(neural, ngram) -> CostModel:
    """Time the loaded models on their device (about a second on a slow CPU)."""
    cm = CostModel()
    if neural is not None:
        model = neural.model
        size = next(model.parameters()).element_size()
        cm.state_bytes_per_position = model.state_numel_per_position() * size
        cm.state_bytes_fixed = model.state_numel_fixed() * size
        _calibrate_tree(cm, neural)
        _calibrate_steps(cm, neural)
    if ngram is not None:
        _calibrate_ngram(cm, ngram)
    cm.calibrated = True
    return cm


def _calibrate_tree(cm: CostModel, neural) -> None:
    """Two tries of about the same nodes, shallow and as deep as long hypotheses go: per node = node_s +
    node_depth_s * depth; a small one for what a call costs beyond its nodes; and a batch of small lists."""
    vocab = neural.vocab.sample_words() or ["a"]
    # as deep as long hypotheses go, within the model's positions (a Hugging Face LM has a fixed number)
    long = min(128, (neural.model.max_positions or 2**30) - 2)

    def hypotheses(hyps: int, length: int) -> list[list[str]]:
        rng = random.Random(hyps * 1000 + length)
        return [[rng.choice(vocab) for _ in range(length)] for _ in range(hyps)]

    rng = random.Random(7)  # 32 utterances of 5 hypotheses of 12 words, as a batch of small requests
    groups = [[[rng.choice(vocab) for _ in range(12)] for _ in range(5)] for _ in range(32)]
    tries = [[hypotheses(64, 8)], [hypotheses(4, long)], [hypotheses(1, 16)], groups]
    nodes = [max(1, neural.estimate_cost(t).trie_nodes) for t in tries]
    seconds = fastest_seconds(*[lambda t=t: neural.token_logprobs(t) for t in tries])
    (s1, s2, s3, s4) = (s / n for s, n in zip(seconds, nodes))
    d1, d2 = 9, long + 1  # depths (with </s>)
    slope = max(0.0, (s2 - s1) / (d2 - d1))
    cm.node_depth_s, cm.node_s = slope, max(1e-9, s1 - slope * d1)
    cm.call_s = max(0.0, nodes[2] * (s3 - cm.per_node(17)))
    cm.batch_node_s = max(1e-9, (seconds[3] - cm.call_s) / nodes[3])


def _calibrate_steps(cm: CostModel, neural) -> None:
    """One LM step of 64 rows after short and long histories: per row = row_s + row_pos_s * positions."""
    import torch

    model, device, rows = neural.model, neural.device, 64
    steps, positions = [], []
    for length in (1, 32):
        gen = torch.Generator().manual_seed(length)
        hist = torch.randint(4, len(neural.vocab), (rows, length), generator=gen).to(device)
        step = torch.randint(4, len(neural.vocab), (rows, 1), generator=gen).to(device)
        with torch.inference_mode():
            _, state = model.score(hist, model.initial_state(rows, device))

        def one(step=step, state=state) -> None:
            with torch.inference_mode():
                model.score(step, state)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        steps.append(one)
        positions.append(length + 2)  # <s> and the step itself
    s1, s2 = (s / rows for s in fastest_seconds(*steps))
    (p1, p2) = positions
    slope = max(0.0, (s2 - s1) / (p2 - p1))
    cm.row_pos_s, cm.row_s = slope, max(1e-9, s1 - slope * p1)


def _calibrate_ngram(cm: CostModel, ngram) -> None:
    words = ["the", "of", "and", "to", "in", "that", "he", "shall"] * 64
    cm.ngram_s = max(1e-9, fastest_seconds(lambda: ngram.token_logprobs(words))[0] / (len(words) + 1))


def lattices_together(per_batch: int, nbytes: list[int], limit: int) -> int:
    """How many of lattices of predicted peaks `nbytes` the worker expands at a time: a batch (`per_batch`:
    `ExpandConfig.lattices_per_batch`), or fewer when the largest of them together would need more than `limit`
    bytes (at least one: a lattice over the limit alone is refused when its request comes in)."""
    k = 0
    total = 0
    for b in heapq.nlargest(per_batch, nbytes):
        total += b
        if total > limit:
            break
        k += 1
    return max(1, k)
