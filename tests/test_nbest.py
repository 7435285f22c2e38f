import json
import math

import numpy as np
import pytest
import torch
from conftest import TEST_DATA

from smallstate_lm.checkpoint import load_model
from smallstate_lm.errors import ConfigError, SmallstateError, VocabularyError
from smallstate_lm.ngram import NgramLM
from smallstate_lm.rescoring.decode.wer import align_counts
from smallstate_lm.rescoring.nbest.components import apply_weights, compute_components
from smallstate_lm.rescoring.nbest.lists import (
    Hypothesis,
    NBestFormatError,
    Utterance,
    read_nbest_jsonl,
    read_nbest_tsv,
    read_text,
    write_nbest_jsonl,
)
from smallstate_lm.scoring.scorer import NeuralScorer
from smallstate_lm.weights import Weights, count_oov, oov_counts

HEADER = "utt\trank\ttotal_cost\tac_logprob\tlm_logprob_ln\tn_words\twords\n"


@pytest.fixture(scope="module")
def utts():
    return read_nbest_tsv(TEST_DATA / "nbest.tsv")


def test_tsv_reader_keeps_utterances_and_scores(utts):
    assert [u.utt for u in utts] == [f"dev000{i}" for i in range(6)]
    h = utts[0].hyps[0]
    assert h.words[:3] == ["he", "is", "a"] and h.am < 0 and h.graph < 0


@pytest.mark.parametrize("body,needle", [
    ("utt\twords\n", ":1: expected the header"),
    (HEADER + "u1\t0\t1.0\t-5\t-2\t2\n", ":2: expected 7 tab-separated columns"),
    (HEADER + "u1\t0\t1.0\tx\t-2\t1\thello\n", ":2: column 'ac_logprob' must be a number"),
    (HEADER + "u1\t0\t1.0\t-5\tnan\t1\thello\n", ":2: column 'lm_logprob_ln' must be finite"),
    (HEADER + "u1\t0\t1.0\t-5\t-2\t3\thello\n", ":2: n_words says 3"),
    (HEADER + "u1\t0\t1\t-5\t-2\t1\ta\nu2\t0\t1\t-5\t-2\t1\tb\nu1\t1\t1\t-5\t-2\t1\tc\n", "not contiguous"),
    (HEADER, "no hypotheses"),
])
def test_tsv_reader_names_file_and_line(tmp_path, body, needle):
    p = tmp_path / "bad.tsv"
    p.write_text(body)
    with pytest.raises(NBestFormatError, match="bad.tsv") as e:
        read_nbest_tsv(p)
    assert needle in str(e.value)


@pytest.mark.parametrize("line,needle", [
    ("{not json", ":2: not valid JSON"),
    ('{"hyps": []}', ":2: expected an object with a string 'utt'"),
    ('{"utt": "u", "hyps": []}', ":2: 'hyps' must be a non-empty list"),
    ('{"utt": "u", "hyps": [{"words": [1, 2]}]}', ":2: hyps[0].words"),
    ('{"utt": "u", "hyps": [{"words": ["a"], "am": "loud"}]}', ":2: hyps[0].am"),
])
def test_jsonl_reader_names_file_line_and_field(tmp_path, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"utt": "ok", "hyps": [{"words": ["a"], "am": -1, "graph": -2}]}\n' + line + "\n")
    with pytest.raises(NBestFormatError, match="bad.jsonl") as e:
        read_nbest_jsonl(p)
    assert needle in str(e.value)


def test_jsonl_round_trip(tmp_path, utts):
    write_nbest_jsonl(tmp_path / "n.jsonl", utts)
    back = read_nbest_jsonl(tmp_path / "n.jsonl")
    assert [[h.words for h in u.hyps] for u in back] == [[h.words for h in u.hyps] for u in utts]
    assert back[2].hyps[3].am == utts[2].hyps[3].am


def test_text_reader_rejects_duplicates(tmp_path):
    p = tmp_path / "ref.txt"
    p.write_text("a hello\nb world\na again\n")
    with pytest.raises(NBestFormatError, match="ref.txt:3: utterance 'a' appears twice"):
        read_text(p)


@pytest.mark.parametrize("share,tree", [(True, True), (True, False), (False, False)],
                         ids=["tree-attention", "trie-levels-select", "padded"])
def test_neural_scores_equal_scoring_each_sentence_alone(tiny_lm_dir, utts, share, tree):
    lm = load_model(tiny_lm_dir)
    scorer = NeuralScorer(lm.model, lm.vocab, "cpu", batch_tokens=512, share_prefixes=share, group_tokens=600,
                          use_tree=tree)
    got = scorer.token_logprobs([[h.words for h in u.hyps] for u in utts])
    with torch.no_grad():
        for u, per in zip(utts, got):
            for h, lp in zip(u.hyps, per):
                ids = torch.tensor([lm.vocab.encode(h.words) + [1]])
                ref, _ = lm.model.score(ids, lm.model.initial_state(1))
                assert abs(lp.sum() - float(ref.sum())) <= 1e-4
    if share:
        assert scorer.tokens_computed < scorer.tokens_total / 1.5  # prefixes were shared
    else:
        assert scorer.tokens_computed == scorer.tokens_total


def test_ngram_component_equals_kenlm_full_scores(kenlm_model, utts):
    import kenlm

    comps, _ = compute_components(utts, None, NgramLM(kenlm_model), progress=False)
    raw = kenlm.Model(str(kenlm_model))
    for u, c in zip(utts, comps):
        for h, s in zip(u.hyps, c.ngram):
            assert math.isclose(s, sum(x[0] for x in raw.full_scores(" ".join(h.words))) * math.log(10))


def test_total_is_the_weighted_sum_and_ranking_follows_it(tiny_lm_dir, kenlm_model, utts):
    lm = load_model(tiny_lm_dir)
    comps, _ = compute_components(utts, NeuralScorer(lm.model, lm.vocab), NgramLM(kenlm_model), progress=False)
    w = Weights(am_scale=0.1, graph_scale=0.5, lm_weight=0.7, ngram_weight=0.3, word_penalty=-0.2,
                oov_penalty=-1.0)
    ranked = apply_weights(utts, comps, w)
    for u in ranked:
        totals = [h.scores["total"] for h in u.hyps]
        assert totals == sorted(totals, reverse=True)
        for h in u.hyps:
            s = h.scores
            expect = (0.1 * s["am"] + 0.5 * s["graph"] + 0.7 * s["neural"] + 0.3 * s["ngram"]
                      - 0.2 * s["n_words"] - 1.0 * s["n_oov"])
            assert math.isclose(s["total"], expect, rel_tol=1e-9, abs_tol=1e-9)


def test_linear_interpolation_mixes_probabilities_per_word(tiny_lm_dir, kenlm_model, utts):
    lm = load_model(tiny_lm_dir)
    comps, _ = compute_components(utts[:2], NeuralScorer(lm.model, lm.vocab), NgramLM(kenlm_model), progress=False)
    c = comps[0]
    from smallstate_lm.rescoring.nbest.components import linear_lm

    assert np.allclose(linear_lm(c, 1.0), c.neural) and np.allclose(linear_lm(c, 0.0), c.ngram)
    mid = linear_lm(c, 0.3)
    manual = [np.log(0.3 * np.exp(a) + 0.7 * np.exp(b)).sum() for a, b in zip(c.neural_tok, c.ngram_tok)]
    assert np.allclose(mid, manual)
    with pytest.raises(ConfigError, match="both"):
        linear_lm(compute_components(utts[:1], None, NgramLM(kenlm_model), progress=False)[0][0], 0.5)


def test_oov_words_map_to_unk_and_are_counted(tiny_lm_dir, utts):
    lm = load_model(tiny_lm_dir)
    u = Utterance("x", [Hypothesis(["the", "xylophonist", "said"], am=-10), Hypothesis(["the", "lord"], am=-10)])
    comps, stats = compute_components([u], NeuralScorer(lm.model, lm.vocab), None, progress=False)
    assert list(comps[0].n_oov) == [1, 0]
    assert math.isclose(stats.oov_rate, 1 / 5)
    alone = NeuralScorer(lm.model, lm.vocab).token_logprobs([[["the", "<unk>", "said"]]])[0][0]
    assert np.allclose(comps[0].neural_tok[0], alone)  # scored exactly as <unk>
    hi = apply_weights([u], comps, Weights(oov_penalty=0.0))[0]
    lo = apply_weights([u], comps, Weights(oov_penalty=-5.0))[0]
    pick = {tuple(h.words): h.scores["total"] for h in hi.hyps}
    pick_lo = {tuple(h.words): h.scores["total"] for h in lo.hyps}
    assert math.isclose(pick[("the", "xylophonist", "said")] - pick_lo[("the", "xylophonist", "said")], 5.0)


def test_oov_counts_ask_each_distinct_word_once_and_count_every_token(tiny_lm_dir, kenlm_model):
    lm = load_model(tiny_lm_dir)
    sents = [["the", "zzq", "zzq", "lord"], [], ["zzq"], ["the", "lord"], ["qqz", "the", "zzq"]]
    for known in (lm.vocab, NgramLM(kenlm_model), None):
        assert oov_counts(sents, known) == [count_oov(s, known) for s in sents]
    assert oov_counts(sents, lm.vocab) == [2, 0, 1, 0, 2] and oov_counts([], lm.vocab) == []


def test_vocabulary_mismatch_is_an_error(tiny_lm_dir):
    lm = load_model(tiny_lm_dir)
    u = Utterance("x", [Hypothesis("THE LORD SAID UNTO MOSES".split())])
    with pytest.raises(VocabularyError, match="0.0% of 5 hypothesis words"):
        compute_components([u], NeuralScorer(lm.model, lm.vocab), None, progress=False)


def test_empty_hypothesis_list_is_an_error():
    with pytest.raises(SmallstateError, match="'u1' has an empty hypothesis list"):
        compute_components([Utterance("u1", [])], None, None, progress=False)


def test_weights_round_trip_and_errors(tmp_path):
    w = Weights(lm_weight=0.8, ngram_weight=0.3, word_penalty=-0.5, interpolation="linear", lam=0.4)
    w.save(tmp_path / "w.json", {"dev_wer": 0.1})
    assert Weights.load(tmp_path / "w.json") == w
    (tmp_path / "bad.json").write_text('{"lm_weight": "heavy"}')
    with pytest.raises(ConfigError, match="bad.json"):
        Weights.load(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="broken.json:1"):
        Weights.load(tmp_path / "broken.json")


def test_wer_counts_from_kaldialign():
    c = align_counts("a b c d".split(), "a x c d e".split())
    assert (c.sub, c.dels, c.ins, c.ref_words) == (1, 0, 1, 4) and c.wer == 0.5


def test_jsonl_output_carries_components(tmp_path, kenlm_model, utts):
    comps, _ = compute_components(utts, None, NgramLM(kenlm_model), progress=False)
    write_nbest_jsonl(tmp_path / "o.jsonl", apply_weights(utts, comps, Weights()))
    rec = json.loads((tmp_path / "o.jsonl").read_text().splitlines()[0])
    assert {"am", "graph", "ngram", "total", "rank", "n_words"} <= set(rec["hyps"][0])
