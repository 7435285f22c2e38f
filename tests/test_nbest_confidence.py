"""Word confidences of an n-best list's best hypothesis: the posterior of the hypotheses that say each
word in its place, by hand on small lists, and in what `rescore` writes for n-best inputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import TEST_DATA, run_cli

from smallstate_lm.rescoring.nbest.confidence import list_confidences


def _softmax(x):
    e = np.exp(np.asarray(x, dtype=float) - max(x))
    return e / e.sum()


def test_each_word_gets_the_posterior_of_the_hypotheses_that_say_it_in_its_place():
    words = [["a", "b", "c"], ["a", "x", "c"], ["a", "b"], ["q", "a", "b", "c"]]
    totals = [-1.0, -2.0, -2.5, -4.0]
    p = _softmax(totals)
    got = list_confidences(words, np.array(totals), 1.0)
    # "a b": c deleted; "q a b c": q inserted before everything the best one says
    want = [p[0] + p[1] + p[2] + p[3], p[0] + p[2] + p[3], p[0] + p[1] + p[3]]
    assert got == pytest.approx(want, abs=1e-12)


def test_scale_sharpens_the_posterior_and_words_all_agree_on_are_certain():
    words = [["a", "b"], ["a", "c"], ["a", "d"]]
    totals = np.array([-1.0, -1.5, -3.0])
    soft, sharp = list_confidences(words, totals, 0.5), list_confidences(words, totals, 5.0)
    assert soft[0] == sharp[0] == pytest.approx(1.0)
    assert soft[1] < sharp[1] < 1.0
    assert sharp[1] == pytest.approx(_softmax(5.0 * totals)[0])
    assert list_confidences([[], ["a"]], np.array([0.0, -1.0]), 1.0) == []
    # a best hypothesis ranked first by MBR need not have the highest total
    assert list_confidences(words, totals, 1.0, best=1)[1] == pytest.approx(_softmax(totals)[1])
    assert all(math.isfinite(c) for c in list_confidences(words, np.array([-1e9, 0.0, -5.0]), 1.0))


def test_rescore_writes_the_best_hypothesis_confidences_of_each_list(kenlm_model, tmp_path):
    out = tmp_path / "out"
    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--ngram", kenlm_model, "-o", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    recs = [json.loads(line) for line in (out / "nbest.jsonl").read_text().splitlines()]
    assert recs
    for r in recs:
        best, rest = r["hyps"][0], r["hyps"][1:]
        assert len(best["confidences"]) == len(best["words"])
        assert all(0.0 <= c <= 1.0 for c in best["confidences"])
        assert all("confidences" not in h for h in rest)
        totals = np.array([h["total"] for h in r["hyps"]])
        assert best["confidences"] == pytest.approx(
            list_confidences([h["words"] for h in r["hyps"]], totals, 0.7), abs=1e-9)
