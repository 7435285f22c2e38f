"""`rescore --decode mbr` and word confidences on the bundled lattices, end to end through the CLI; `tune
--decode` writes the decode and the scales, and `rescore --weights` honours them."""

import json
import re
from pathlib import Path

import pytest
from conftest import run_cli

from smallstate_lm.errors import ConfigError
from smallstate_lm.rescoring.runs.tune_decode import MBR_GRID, POSTERIOR_GRID
from smallstate_lm.weights import Weights

LATTICES = Path(__file__).resolve().parent.parent / "lattices"
WORDS = LATTICES / "words.txt"
REFS = LATTICES / "ref.txt"


def _best(out: Path) -> dict[str, list[str]]:
    return {u: w.split() for u, _, w in (line.partition(" ") for line in (out / "best.txt").read_text().splitlines())}


def _unit(xs) -> bool:
    return all(isinstance(x, float) and 0.0 <= x <= 1.0 for x in xs)


def test_rescore_decode_mbr_writes_confidences(tmp_path, kenlm_model):
    lats = sorted(LATTICES.glob("*.lat.fst"))
    out = tmp_path / "mbr"
    proc = run_cli("rescore", *lats, "--words", WORDS, "--ngram", kenlm_model, "--set", "am_scale=0.105",
                   "--decode", "mbr", "--posterior-scale", "0.7", "--refs", REFS, "-o", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    best = _best(out)
    records = [json.loads(line) for line in (out / "nbest.jsonl").read_text().splitlines()]
    assert len(records) == len(lats) == len(best)
    for rec in records:
        top = rec["hyps"][0]
        assert len(top["confidences"]) == len(top["words"]) and _unit(top["confidences"])
        assert all("confidences" not in h for h in rec["hyps"][1:])
        assert rec["consensus"]["words"] == best[rec["utt"]]
        assert len(rec["consensus"]["confidences"]) == len(best[rec["utt"]]) and _unit(rec["consensus"]["confidences"])
    viterbi = tmp_path / "viterbi"
    proc = run_cli("rescore", *lats, "--words", WORDS, "--ngram", kenlm_model, "--set", "am_scale=0.105", "-o",
                   viterbi, "--quiet")
    assert proc.returncode == 0, proc.stderr
    for line in (viterbi / "nbest.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert "consensus" not in rec and _unit(rec["hyps"][0]["confidences"])
        assert rec["hyps"][0]["words"] == _best(viterbi)[rec["utt"]]


def test_ctm_carries_confidences_for_both_decodes(tmp_path, kenlm_model):
    slfs = sorted(LATTICES.glob("*.lm.slf.gz"))
    for decode in ("viterbi", "mbr"):
        out = tmp_path / decode
        proc = run_cli("rescore", *slfs, "--ngram", kenlm_model, "--set", "am_scale=0.105", "--decode", decode,
                       "--ctm", "--nbest", "0", "-o", out, "--quiet")
        assert proc.returncode == 0, proc.stderr
        rows: dict[str, list[tuple[float, float, str, float]]] = {}
        for line in (out / "best.ctm").read_text().splitlines():
            utt, channel, start, dur, word, conf = line.split()
            assert channel == "1" and 0.0 <= float(conf) <= 1.0
            rows.setdefault(utt, []).append((float(start), float(dur), word, float(conf)))
        best = _best(out)
        assert {u: [r[2] for r in ws] for u, ws in rows.items()} == {u: w for u, w in best.items() if w}
        for words in rows.values():
            for (s, d, _, _), (s2, _, _, _) in zip(words, words[1:]):
                assert d >= 0 and s + d <= s2 + 1e-6


def test_tune_chooses_the_decode_and_rescore_reproduces_it(tmp_path, kenlm_model):
    lats = sorted(LATTICES.glob("*.lat.fst"))
    for decodes in ("viterbi,mbr", "mbr"):
        weights = tmp_path / f"{decodes}.json"
        proc = run_cli("tune", *lats, "--words", WORDS, "--refs", REFS, "--ngram", kenlm_model, "--set",
                       "am_scale=0.105", "--search", "ngram_weight,word_penalty", "--decode", decodes, "-o", weights,
                       "--quiet")
        assert proc.returncode == 0, proc.stderr
        assert "viterbi: WER%/NCE vs posterior_scale" in proc.stdout or decodes == "mbr"
        assert "mbr: WER%/NCE vs mbr_scale" in proc.stdout
        tuned = json.loads(weights.read_text())
        assert tuned["decode"] in decodes.split(",") and tuned["posterior_scale"] in POSTERIOR_GRID
        assert "dev_confidence_nce" in tuned
        if decodes == "mbr":
            assert tuned["decode"] == "mbr" and tuned["mbr_scale"] in MBR_GRID
        out = tmp_path / f"out-{decodes}"
        proc = run_cli("rescore", *lats, "--words", WORDS, "--ngram", kenlm_model, "--weights", weights, "--refs",
                       REFS, "-o", out, "--quiet")
        assert proc.returncode == 0, proc.stderr
        wer = float(re.search(r"%WER ([\d.]+)", (out / "wer.txt").read_text()).group(1))
        assert abs(wer - 100 * tuned["dev_wer"]) < 0.01  # the decode the weights name is the one applied
        assert ("consensus" in (out / "nbest.jsonl").read_text()) == (tuned["decode"] == "mbr")


def test_bad_decode_options_are_named(tmp_path, kenlm_model):
    lat = sorted(LATTICES.glob("*.lat.fst"))[0]
    proc = run_cli("rescore", lat, "--words", WORDS, "--ngram", kenlm_model, "--decode", "best", "-o", tmp_path / "a")
    assert proc.returncode == 2 and "decode" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("rescore", lat, "--words", WORDS, "--ngram", kenlm_model, "--posterior-scale", "0", "-o",
                   tmp_path / "b")
    assert proc.returncode == 2 and "posterior_scale" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("tune", lat, "--words", WORDS, "--refs", REFS, "--ngram", kenlm_model, "--decode", "viterbi,best",
                   "-o", tmp_path / "w.json")
    assert proc.returncode == 2 and "--decode" in proc.stderr and "Traceback" not in proc.stderr


def test_weights_carry_the_decode_and_scales(tmp_path):
    w = Weights(decode="mbr", posterior_scale=0.7, mbr_scale=2.0)
    w.save(tmp_path / "w.json")
    assert Weights.load(tmp_path / "w.json") == w
    with pytest.raises(ConfigError, match="decode"):
        Weights(decode="best")
    with pytest.raises(ConfigError, match="posterior_scale"):
        Weights(posterior_scale=0.0)
