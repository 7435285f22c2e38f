"""Tree attention within a memory cap (issue 15 item 1).

One utterance of many long unique hypotheses made the one-pass tree attention build an
(N+1) x (N+1) mask over its N trie nodes (40 GB for 1,000 hypotheses of 200 words). The
scorer now plans every batch within `max_work_bytes` (blocks of queries over each node's
ancestors, sub-tries when even that is too much) and gives the numbers of the unbounded
pass and of plain per-hypothesis `score`.
"""

import random
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from smallstate_lm.errors import WorkLimitError
from smallstate_lm.models import build_model, get_preset
from smallstate_lm.models.transformer import tree_forest
from smallstate_lm.scoring import trie as scoring_trie
from smallstate_lm.scoring.scorer import NeuralScorer
from smallstate_lm.scoring.tree_attention import DEFAULT_MAX_WORK_BYTES
from smallstate_lm.scoring.trie import PrefixTrie, trie_size
from smallstate_lm.state import length_mask
from smallstate_lm.vocab import EOS_ID, Vocabulary

MiB = 2**20
TOL = 1e-5
VOCAB = Vocabulary.build([[f"w{i}" for i in range(60)]])


class TensorMemory(TorchDispatchMode):
    """Peak bytes of the tensors alive at once among those the ops inside the mode create
    (views and in-place results count once per storage). Scratch that a kernel allocates
    and frees before it returns is not seen; every tensor a code path keeps is."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors holding it]
        self.now = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.live:
                    self.live[ptr] = [t.untyped_storage().nbytes(), 0]
                    self.now += self.live[ptr][0]
                self.live[ptr][1] += 1
                weakref.finalize(t, self._release, ptr)
        self.peak = max(self.peak, self.now)
        return out


def tiny_model(**extra):
    cfg = get_preset("tiny").replace(vocab_size=len(VOCAB), d_model=32, n_heads=4, d_ff=64, d_embed=16,
                                     dropout=0.0, **extra)
    torch.manual_seed(0)
    return build_model(cfg).eval()


def long_hypotheses(n: int, length: int, seed: int = 0) -> list[list[str]]:
    """n unique hypotheses of `length` words in a few families sharing 10-30 word prefixes,
    plus a repeat and a hypothesis that is a word prefix of another."""
    rng = random.Random(seed)
    stems = [[f"w{rng.randrange(60)}" for _ in range(rng.randrange(10, 30))] for _ in range(4)]
    hyps = []
    while len(hyps) < n:
        stem = stems[len(hyps) % 4]
        h = stem + [f"w{rng.randrange(60)}" for _ in range(length - len(stem))]
        if h not in hyps:
            hyps.append(h)
    return hyps + [hyps[0], hyps[1][:-5]]


def measured(scorer: NeuralScorer, groups):
    with TensorMemory() as mem:
        out = scorer.token_logprobs(groups)
    return out, mem.peak


def trie_rows(seqs_per_row):
    """score_tree's inputs for tries over token sequences: tokens, parents, lengths."""
    tries = [PrefixTrie(s) for s in seqs_per_row]
    N = max(t.n_nodes for t in tries)
    tokens = torch.zeros(len(tries), N, dtype=torch.long)
    parents = torch.zeros(len(tries), N, dtype=torch.long)
    for b, t in enumerate(tries):
        tokens[b, : t.n_nodes] = torch.tensor(t.node_token[1:])
        parents[b, : t.n_nodes] = torch.tensor(t.node_parent[1:]) - 1
    return tries, tokens, parents, torch.tensor([t.n_nodes for t in tries])


@pytest.mark.parametrize("extra", [{}, {"shared_kv": True}, {"pos": "rotary"}, {"pos": "rotary", "shared_kv": True}],
                         ids=["kv", "shared-kv", "rotary", "rotary-shared-kv"])
@torch.no_grad()
def test_blocked_tree_attention_equals_the_dense_pass_and_each_path(extra):
    model = tiny_model(**extra)
    rows = [[VOCAB.encode(h) + [EOS_ID] for h in long_hypotheses(n, 30, seed)] for n, seed in ((12, 1), (5, 2))]
    tries, tokens, parents, lengths = trie_rows(rows)
    cap = MiB
    size = tries[0].size + tries[1].size
    plan = model.tree_plan(size.n_rows, size.max_nodes, size.total_nodes, size.max_depth, size.path_len, cap)
    assert plan.blocked and plan.nbytes <= cap
    dense = model.score_tree(tokens, parents, lengths)
    with TensorMemory() as mem:
        blocked = model.score_tree(tokens, parents, lengths, max_work_bytes=cap)
    assert mem.peak <= cap
    assert (blocked - dense).abs().max() <= TOL and (blocked[1, lengths[1]:] == 0).all()
    for b, trie in enumerate(tries):
        for seq, path in zip(rows[b], trie.node_paths):
            ref, _ = model.score(torch.tensor([seq]), model.initial_state(1))
            assert (blocked[b, [p - 1 for p in path]] - ref[0]).abs().max() <= TOL


@torch.no_grad()
def test_wide_shallow_tries_run_in_blocks_deep_narrow_ones_in_one_pass():
    """Under a cap both fit, the plan takes blocks where the dense pass's square of nodes per row moves far
    more than the blocks' nodes times depth (an n-best list's wide shallow trie), and the one pass where a
    trie is a single deep path; either way the numbers are the unbounded pass's."""
    model = tiny_model()
    wide = [[VOCAB.encode([f"w{a}", f"w{b}", f"w{c}"]) + [EOS_ID] for a in range(12) for b in range(6) for c in (0, 1)]]
    deep = [[VOCAB.encode([f"w{i % 60}" for i in range(40)]) + [EOS_ID]]]
    cap = DEFAULT_MAX_WORK_BYTES
    for rows, blocked in ((wide, True), (deep, False)):
        tries, tokens, parents, lengths = trie_rows(rows)
        size = tries[0].size
        plan = model.tree_plan(size.n_rows, size.max_nodes, size.total_nodes, size.max_depth, size.path_len, cap)
        assert plan.blocked == blocked and plan.nbytes <= cap
        assert model._dense_tree_bytes(size.n_rows, size.max_nodes, size.total_nodes) <= cap  # the one pass fits
        got = model.score_tree(tokens, parents, lengths, max_work_bytes=cap)
        told = model.score_tree(tokens, parents, lengths, max_work_bytes=cap, plan=plan)
        dense = model.score_tree(tokens, parents, lengths)
        assert (got - dense).abs().max() <= TOL and (told - dense).abs().max() <= TOL


@pytest.mark.parametrize("cap_mib,split", [(1, True), (4, False)], ids=["sub-tries", "one-blocked-row"])
def test_scorer_stays_under_the_cap_and_equals_the_unbounded_tree(cap_mib, split):
    model = tiny_model()
    groups = [long_hypotheses(40, 60), long_hypotheses(3, 20, seed=5)]
    cap = cap_mib * MiB
    unbounded, peak_unbounded = measured(NeuralScorer(model, VOCAB, max_work_bytes=None), groups)
    assert peak_unbounded > 16 * MiB  # the one-pass tree's (N+1)^2 mask: what the cap is for

    scorer = NeuralScorer(model, VOCAB, max_work_bytes=cap)
    cost = scorer.estimate_cost(groups)
    got, peak = measured(scorer, groups)
    assert peak <= cost.nbytes <= cap
    padded = NeuralScorer(model, VOCAB, share_prefixes=False).token_logprobs(groups)
    for u in range(len(groups)):
        for a, b, c in zip(got[u], unbounded[u], padded[u]):
            assert abs(a - b).max() <= TOL and abs(a - c).max() <= TOL
    trie_nodes = sum(PrefixTrie([scorer.encode(h) for h in hyps]).n_nodes for hyps in groups)
    assert cost.trie_nodes == trie_nodes
    tokens = sum(len(scorer.encode(h)) for hyps in groups for h in hyps)
    assert NeuralScorer(model, VOCAB, share_prefixes=False).estimate_cost(groups).trie_nodes == tokens
    # sub-tries run their shared prefixes once each; one blocked row runs every node once
    assert (scorer.tokens_computed > trie_nodes) == split


def test_planned_sizes_are_those_of_the_tries_that_run():
    """The scorer plans from counts; score_tree plans again from the tensors it gets: both
    must see the same sizes, or a batch planned to fit would be refused."""
    model = tiny_model()
    hyps = [VOCAB.encode(h) + [EOS_ID] for h in long_hypotheses(30, 40, seed=3)]
    hyps += [hyps[2][:7], hyps[2][:7], hyps[5][:1], hyps[5][:20] + [EOS_ID]]  # prefixes of others, a repeat
    rows = NeuralScorer(model, VOCAB, max_work_bytes=256 * 1024).trees.split(0, hyps)
    assert len(rows) > 1 and sorted(j for r in rows for j in r.hyps) == list(range(len(hyps)))
    for row in rows:
        assert row.size == PrefixTrie([hyps[j] for j in row.hyps]).size
    tries, tokens, parents, lengths = trie_rows([hyps[:20], hyps[20:]])
    real = length_mask(lengths, tokens.shape[1])
    forest = tree_forest(tokens, torch.where(real, parents, -1) + 1, real)
    size = tries[0].size + tries[1].size
    assert (int(forest.depth.max()), len(forest.paths)) == (size.max_depth, size.path_len)


@torch.no_grad()
def test_sizes_from_the_caller_plan_as_the_scorers_own():
    """The service sizes a request's tries when it admits it and hands the sizes to the scorer, which then
    does not size them again: the same plan, the same numbers."""
    model = tiny_model()
    groups = [long_hypotheses(12, 40, seed=1), long_hypotheses(5, 35, seed=2)]
    scorer = NeuralScorer(model, VOCAB)
    sizes = [trie_size([scorer.encode(h) for h in hyps]) for hyps in groups]
    for a, b in zip(scorer.token_logprobs(groups), scorer.token_logprobs(groups, sizes)):
        for x, y in zip(a, b):
            assert (x == y).all()


@pytest.mark.parametrize("small_tokens", [scoring_trie.SMALL_TRIE_TOKENS, 0], ids=["plain-python", "arrays"])
def test_trie_sizes_from_sorted_arrays_are_those_of_the_tries(small_tokens, monkeypatch):
    """Admission sizes a request's tries without building them (`trie_size`): same nodes, depth and
    leaf paths as the trie, with prefixes of other hypotheses, repeats and shared stems; small inputs
    counted in plain Python, large ones with array operations."""
    monkeypatch.setattr(scoring_trie, "SMALL_TRIE_TOKENS", small_tokens)
    for seed in range(200):
        r = random.Random(seed)
        seqs = [[r.randrange(4) for _ in range(r.randrange(1, 8))] for _ in range(r.randrange(1, 30))]
        seqs += [s[: r.randrange(1, len(s) + 1)] for s in seqs[:3]] + seqs[:2]
        assert trie_size(seqs) == PrefixTrie(seqs).size, seqs
    assert trie_size([]) == PrefixTrie([]).size


def test_a_cap_below_one_hypothesis_is_refused_before_any_work():
    model = tiny_model()
    groups = [long_hypotheses(5, 60)]
    scorer = NeuralScorer(model, VOCAB, max_work_bytes=64 * 1024)
    cost = scorer.estimate_cost(groups)
    assert cost.nbytes > scorer.max_work_bytes
    with TensorMemory() as mem, pytest.raises(WorkLimitError, match="max_work_bytes"):
        scorer.token_logprobs(groups)
    assert mem.peak == 0 and scorer.tokens_computed == 0


def test_the_issue_request_plans_within_the_default_cap():
    """1,000 unique 200-word hypotheses with the `tiny` preset: 200k trie nodes, which the
    one-pass tree would have scored with a 40 GB mask."""
    model = build_model(get_preset("tiny").replace(vocab_size=len(VOCAB), dropout=0.0))
    rng = random.Random(0)
    hyps = [[f"w{rng.randrange(60)}" for _ in range(200)] for _ in range(1000)]
    scorer = NeuralScorer(model, VOCAB)
    cost = scorer.estimate_cost([hyps])
    assert cost.trie_nodes == PrefixTrie([scorer.encode(h) for h in hyps]).n_nodes > 190_000
    assert scorer.max_work_bytes == DEFAULT_MAX_WORK_BYTES and cost.nbytes <= DEFAULT_MAX_WORK_BYTES
    assert NeuralScorer(model, VOCAB, max_work_bytes=None).estimate_cost([hyps]).nbytes > 2**35


@torch.no_grad()
def test_blocks_larger_than_the_output_layers_logit_chunk_stay_within_the_plan(monkeypatch):
    """With a large vocabulary the output layer holds only LOGIT_BUDGET logits at once, so the
    plan lets blocks grow past that many queries: the measured peak must still fit."""
    import smallstate_lm.models.output as output
    import smallstate_lm.models.transformer as transformer

    model = tiny_model()
    rows = [[VOCAB.encode(h) + [EOS_ID] for h in long_hypotheses(12, 30, 1)]]
    tries, tokens, parents, lengths = trie_rows(rows)
    budget = 8 * model.cfg.vocab_size  # logits of 8 queries at once
    monkeypatch.setattr(output, "LOGIT_BUDGET", budget)
    monkeypatch.setattr(transformer, "LOGIT_BUDGET", budget)
    size = tries[0].size
    cap = MiB
    plan = model.tree_plan(size.n_rows, size.max_nodes, size.total_nodes, size.max_depth, size.path_len, cap)
    assert plan.blocked and 8 < plan.block < size.total_nodes and plan.nbytes <= cap
    dense = model.score_tree(tokens, parents, lengths)
    with TensorMemory() as mem:
        blocked = model.score_tree(tokens, parents, lengths, max_work_bytes=cap)
    assert mem.peak <= plan.nbytes
    assert (blocked - dense).abs().max() <= TOL


def test_a_sorted_trie_is_the_prefix_trie_of_its_sequences():
    """What sub-tries are built with (their hypotheses come sorted): the same nodes, tokens and parents."""
    from smallstate_lm.scoring.trie import SortedTrie

    rng = random.Random(3)
    for _ in range(200):
        seqs = sorted([rng.randint(3, 6) for _ in range(rng.randint(1, 6))] + [EOS_ID]
                      for _ in range(rng.randint(1, 30)))
        a, b = PrefixTrie(seqs), SortedTrie.build(seqs)
        assert a.n_nodes == b.n_nodes == trie_size(seqs).total_nodes
        for s, pa, pb in zip(seqs, a.node_paths, b.node_paths):
            assert [b.node_token[n] for n in pb] == [a.node_token[n] for n in pa] == s
            assert [b.node_parent[n] for n in pb] == [0] + pb[:-1]
