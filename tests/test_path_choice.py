"""Choosing between tree attention and padded rows by measured cost (`NeuralScorer.choose_paths`, the
default on CUDA): either path gives the other's numbers, and the choice follows the measured costs."""

import numpy as np
import pytest
import torch
from test_cuda import _hypotheses
from test_state_contract import shrunk

from smallstate_lm.models import build_model
from smallstate_lm.scoring.paths import PathCosts
from smallstate_lm.scoring.scorer import NeuralScorer

TOL = 1e-5


@pytest.fixture(scope="module")
def setup():
    vocab, groups = _hypotheses(7, n_utts=6)
    torch.manual_seed(0)
    model = build_model(shrunk("small", False).replace(vocab_size=len(vocab))).eval()
    return model, vocab, groups


def scores(scorer, groups):
    before = scorer.tokens_total, scorer.tokens_computed
    out = scorer.token_logprobs(groups)
    return out, scorer.tokens_total - before[0], scorer.tokens_computed - before[1]


def assert_close(a, b):
    for ua, ub in zip(a, b):
        for x, y in zip(ua, ub):
            np.testing.assert_allclose(x, y, atol=TOL, rtol=0)


def test_measured_costs_are_positive_and_keep_the_numbers(setup):
    model, vocab, groups = setup
    tree, _, _ = scores(NeuralScorer(model, vocab), groups)
    chooser = NeuralScorer(model, vocab)
    costs = chooser.choose_paths(rounds=1)
    assert costs.tree_node_s > 0 and costs.padded_token_s > 0
    assert chooser.tokens_total == chooser.tokens_computed == 0, "measuring is not counted as scoring"
    got, _, _ = scores(chooser, groups)
    assert_close(got, tree)


@pytest.mark.parametrize("costs, padded", [(PathCosts(1.0, 1e-9), True), (PathCosts(1e-9, 1.0), False)],
                         ids=["padded-cheaper", "tree-cheaper"])
def test_each_call_takes_the_path_predicted_faster(setup, costs, padded):
    model, vocab, groups = setup
    tree, _, _ = scores(NeuralScorer(model, vocab), groups)
    scorer = NeuralScorer(model, vocab)
    scorer.path_costs = costs
    got, total, computed = scores(scorer, groups)
    assert scorer.calls_padded == int(padded)
    assert (computed == total) if padded else (computed < total), "padded rows compute every token"
    assert_close(got, tree)


def test_the_rule_weighs_nodes_against_tokens():
    costs = PathCosts(tree_node_s=2.0, padded_token_s=1.0)  # a node costs two padded tokens
    assert costs.prefers_tree(nodes=40, tokens=100) and not costs.prefers_tree(nodes=60, tokens=100)


def test_nothing_is_measured_without_prefix_sharing(setup):
    model, vocab, _ = setup
    scorer = NeuralScorer(model, vocab, share_prefixes=False)
    assert scorer.choose_paths() is None and scorer.path_costs is None


def test_the_commands_measure_paths_on_cuda_only_and_can_be_told_not_to(tiny_lm_dir, tmp_path):
    from conftest import TEST_DATA, run_cli

    from smallstate_lm.rescoring.runs.nbest_run import NBestScoring, load_scorers

    scorer, _ = load_scorers(NBestScoring(lm=tiny_lm_dir, device="cpu", progress=False))
    assert scorer.path_costs is None, "on a CPU tree attention is taken without measuring"
    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--lm", tiny_lm_dir, "--device", "cpu", "--no-path-choice",
                   "-o", tmp_path / "out", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "best.txt").read_text().strip()
