"""NCE and ECE of word confidences on examples worked out by hand, and the correctness labels from the WER
alignment."""

import math

import pytest

from smallstate_lm.errors import SmallstateError
from smallstate_lm.rescoring.decode.confidence_eval import (
    ece,
    evaluate_confidences,
    label_transcripts,
    nce,
    plot_reliability,
    reliability,
    reliability_table,
)
from smallstate_lm.rescoring.decode.wer import correct_words


def test_correct_words_follow_the_wer_alignment():
    # ref a b c d / hyp a x c e d: x substitutes b, e is inserted
    assert correct_words("a b c d".split(), "a x c e d".split()) == [True, False, True, False, True]
    assert correct_words([], ["a"]) == [False] and correct_words(["a"], []) == []


def test_nce_worked_out_by_hand():
    conf, correct = [0.9, 0.8, 0.3], [True, True, False]
    h_max = -(2 * math.log(2 / 3) + math.log(1 / 3))
    h_conf = -(math.log(0.9) + math.log(0.8) + math.log(0.7))
    assert math.isclose(nce(conf, correct), (h_max - h_conf) / h_max, rel_tol=1e-12)
    assert math.isclose(nce([2 / 3] * 3, correct), 0.0, abs_tol=1e-12)  # the base rate explains nothing
    clip = 1e-4
    perfect = (h_max + 3 * math.log1p(-clip)) / h_max  # 1, up to the clipping of 1 and 0
    assert math.isclose(nce([1.0, 1.0, 0.0], correct, clip), perfect, rel_tol=1e-12)
    assert nce([0.1, 0.1, 0.9], correct) < 0  # confidently backwards: worse than the base rate
    assert math.isnan(nce([0.5, 0.9], [True, True]))  # no errors: nothing to explain


def test_ece_worked_out_by_hand():
    conf, correct = [0.05, 0.15, 0.95, 1.0], [False, True, True, False]
    # bins [0, .1): conf .05, acc 0; [.1, .2): .15, acc 1; [.9, 1]: mean .975, acc .5 (1.0 falls in the last)
    expected = (abs(0 - 0.05) + abs(1 - 0.15) + 2 * abs(0.5 - 0.975)) / 4
    assert math.isclose(ece(conf, correct), expected, rel_tol=1e-12)
    bins = reliability(conf, correct)
    assert [b.words for b in bins] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 2]
    assert math.isclose(bins[9].confidence, 0.975) and bins[9].accuracy == 0.5 and math.isnan(bins[5].accuracy)
    assert ece([0.25, 0.25, 0.25, 0.25], [True, False, False, False], n_bins=4) == 0.0  # calibrated


def test_reports_tables_and_bad_input(tmp_path):
    conf, correct = label_transcripts({"u1": "a b c".split(), "u2": ["d"]},
                                      {"u1": ("a x c".split(), [0.9, 0.4, 0.8]), "u2": (["d"], [0.7])})
    assert correct == [True, False, True, True] and conf == [0.9, 0.4, 0.8, 0.7]
    r = evaluate_confidences(conf, correct)
    assert r.words == 4 and r.correct == 3 and math.isclose(r.mean_confidence, 0.7)
    assert "NCE" in r.line()
    table = reliability_table({"rescored": r})
    assert table.splitlines()[0].startswith("| confidence | rescored: words") and len(table.splitlines()) == 12
    pytest.importorskip("matplotlib")
    assert plot_reliability({"rescored": r}, str(tmp_path / "r.png")) and (tmp_path / "r.png").stat().st_size > 0
    with pytest.raises(SmallstateError, match="'u3'"):
        label_transcripts({"u1": ["a"]}, {"u3": (["a"], [0.5])})
    with pytest.raises(SmallstateError, match="2 words but 1 confidences"):
        label_transcripts({"u1": ["a"]}, {"u1": (["a", "b"], [0.5])})
    with pytest.raises(SmallstateError, match=r"\[0, 1\]"):
        nce([1.5], [True])
