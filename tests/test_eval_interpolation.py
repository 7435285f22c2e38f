"""`eval --ngram`: the n-gram on the same tokens and the best linear interpolation."""

import json

import numpy as np
import pytest
from conftest import DATA, run_cli

from smallstate_lm.checkpoint import export_model, load_model
from smallstate_lm.evaluate import evaluate_file, interpolate
from smallstate_lm.ngram import evaluate_ngram


def test_interpolation_at_the_ends_is_each_model_and_the_best_is_no_worse(tiny_lm_dir, kenlm_model):
    r = evaluate_file(tiny_lm_dir, DATA / "valid.txt", ngram=kenlm_model)
    mix = r["interpolation"]
    assert mix["ngram_perplexity"] == pytest.approx(evaluate_ngram(kenlm_model, DATA / "valid.txt")["perplexity"],
                                                    rel=1e-6)
    assert mix["curve"]["1.00"] == pytest.approx(r["perplexity"], rel=1e-6)
    assert mix["curve"]["0.00"] == pytest.approx(mix["ngram_perplexity"], rel=1e-6)
    assert mix["perplexity"] <= min(mix["curve"].values())
    assert 0.0 <= mix["lambda"] <= 1.0


def test_two_complementary_models_mix_better_than_either():
    # each model gives half its tokens p=0.5 and the other half p=0.01
    a = np.log(np.array([0.5, 0.01] * 50))
    b = np.log(np.array([0.01, 0.5] * 50))
    mix = interpolate(a, b)
    assert mix["lambda"] == pytest.approx(0.5)
    assert mix["perplexity"] == pytest.approx(1 / 0.255, rel=1e-6)


def test_eval_cli_prints_and_reports_the_interpolation(tiny_lm_dir, kenlm_model):
    p = run_cli("eval", "--model", tiny_lm_dir, "--text", DATA / "valid.txt", "--ngram", kenlm_model, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["interpolation"]["lambda"] >= 0.0
    p = run_cli("eval", "--model", tiny_lm_dir, "--text", DATA / "valid.txt", "--ngram", kenlm_model)
    assert p.returncode == 0 and "interpolated     perplexity" in p.stdout
    p = run_cli("eval", "--model", tiny_lm_dir, "--text", DATA / "valid.txt", "--ngram", DATA / "README.md")
    assert p.returncode != 0 and "Traceback" not in p.stderr


def test_export_halves_the_weights_and_keeps_the_model(tiny_lm_dir, tmp_path):
    path = export_model(tiny_lm_dir, tmp_path / "release")
    assert path.stat().st_size < 0.6 * (tiny_lm_dir / "model.pt").stat().st_size
    a, b = load_model(tiny_lm_dir), load_model(tmp_path / "release")
    assert a.config == b.config and a.vocab.words == b.vocab.words
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert y.dtype == x.dtype, name  # loaded back to float32
        assert (x - y).abs().max() <= 1e-3 * max(1.0, float(x.abs().max())), name
    assert (tmp_path / "release" / "vocab.txt").read_text().splitlines() == a.vocab.words
