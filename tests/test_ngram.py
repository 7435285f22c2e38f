import math

import kenlm
import numpy as np
import pytest
from conftest import DATA, run_cli

from smallstate_lm.ngram import NgramError, NgramLM, build_ngram, evaluate_ngram


def test_scores_are_kenlm_log10_converted_to_natural_log(kenlm_model):
    lm, raw = NgramLM(kenlm_model), kenlm.Model(str(kenlm_model))
    words = "and the lord spoke to moses saying".split()
    expected = sum(lp for lp, _, _ in raw.full_scores(" ".join(words))) * math.log(10)
    assert math.isclose(lm.token_logprobs(words).sum(), expected, rel_tol=1e-9)
    assert math.isclose(lm.sentence_logprob(words), expected, rel_tol=1e-6)  # KenLM sums in float32


def test_stateful_word_by_word_equals_whole_sentence(kenlm_model):
    lm = NgramLM(kenlm_model)
    words = "in the beginning god created zzyzx the heavens".split()  # one OOV
    state, got = lm.initial_state(), []
    for w in words:
        lp, state = lm.score_word(state, w)
        got.append(lp)
    got.append(lm.score_eos(state))
    assert np.allclose(got, lm.token_logprobs(words))
    # states are hashable: equal histories merge
    _, s1 = lm.score_word(lm.initial_state(), "the")
    _, s2 = lm.score_word(lm.initial_state(), "the")
    assert hash(s1) == hash(s2) and s1 == s2


def test_eval_perplexity_counts_words_and_eos(kenlm_model, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the lord is good\nqwertyuiop the\n")
    r = evaluate_ngram(kenlm_model, text)
    lm = NgramLM(kenlm_model)
    total = lm.sentence_logprob("the lord is good".split()) + lm.sentence_logprob(["qwertyuiop", "the"])
    assert r["tokens"] == 4 + 2 + 2 and r["oov_words"] == 1
    assert math.isclose(r["perplexity"], math.exp(-total / 8))


def test_cli_train_and_eval_on_a_tiny_corpus(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("a b c\nb c d\n")  # far too small for Kneser-Ney without --discount_fallback
    proc = run_cli("ngram", "train", "--order", "3", "--text", text, "-o", tmp_path / "lm.arpa",
                   "--binary", tmp_path / "lm.bin")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "lm.arpa").read_text().lstrip().startswith("\\data\\")
    proc = run_cli("ngram", "eval", "--ngram", tmp_path / "lm.bin", "--text", text, "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"perplexity"' in proc.stdout


def test_lmplz_errors_are_reported_readably(tmp_path):
    text = tmp_path / "bad.txt"
    text.write_text("<s> hello world\n")
    with pytest.raises(NgramError, match="lmplz on .*bad.txt failed: Special word <s>"):
        build_ngram(text, 3, tmp_path / "lm.arpa")
    assert not (tmp_path / "lm.arpa").exists()


def test_unreadable_ngram_file_names_the_file(tmp_path):
    bad = tmp_path / "broken.arpa"
    bad.write_text("this is not an arpa file\n")
    with pytest.raises(NgramError, match="broken.arpa"):
        NgramLM(bad)


def test_prune_thresholds_are_checked():
    with pytest.raises(NgramError, match="prune"):
        build_ngram(DATA / "valid.txt", 3, "/tmp/never.arpa", prune=[0, 2, 1])
