import json
import re

import pytest
from conftest import TEST_DATA, run_cli


def test_tune_then_rescore(tmp_path, kenlm_model, tiny_lm_dir):
    weights = tmp_path / "weights.json"
    proc = run_cli("tune", "--nbest", TEST_DATA / "nbest.tsv", "--refs", TEST_DATA / "ref.txt", "--lm", tiny_lm_dir,
                   "--ngram", kenlm_model, "-o", weights, "--set", "am_scale=0.105", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "WER% vs lm_weight" in proc.stdout
    tuned = json.loads(weights.read_text())
    assert tuned["am_scale"] == 0.105
    out = tmp_path / "out"
    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--lm", tiny_lm_dir, "--ngram", kenlm_model, "--weights",
                   weights, "--refs", TEST_DATA / "ref.txt", "-o", out, "--quiet")
    assert proc.returncode == 0, proc.stderr
    best = (out / "best.txt").read_text().splitlines()
    assert len(best) == 6 and best[0].startswith("dev0000 ")
    assert len((out / "nbest.jsonl").read_text().splitlines()) == 6
    wer = float(re.search(r"%WER ([\d.]+)", (out / "wer.txt").read_text()).group(1))
    assert abs(wer - 100 * tuned["dev_wer"]) < 0.01  # rescoring with the tuned weights reproduces tune's WER
    assert wer <= 100 * tuned["dev_first_pass_wer"]


def test_direct_weight_flags_equal_set(tmp_path, kenlm_model):
    runs = {"set": ["--set", "ngram_weight=0.7", "--set", "word_penalty=-0.5", "--set", "lm_weight=0"],
            "flags": ["--ngram-weight", "0.7", "--word-penalty", "-0.5", "--lm-weight", "0"]}
    got = {}
    for name, args in runs.items():
        proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--ngram", kenlm_model, *args, "-o", tmp_path / name,
                       "--quiet")
        assert proc.returncode == 0, proc.stderr
        got[name] = [json.loads(line) for line in (tmp_path / name / "nbest.jsonl").read_text().splitlines()]
    assert got["set"] == got["flags"]
    h = got["flags"][0]["hyps"][0]
    assert h["total"] == pytest.approx(0.1 * h["am"] + h["graph"] + 0.7 * h["ngram"] - 0.5 * h["n_words"])
    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "--ngram", kenlm_model, "--mbr-scale", "-1", "-o",
                   tmp_path / "bad", "--quiet")
    assert proc.returncode == 2 and "mbr_scale" in proc.stderr and "Traceback" not in proc.stderr


def test_rescore_reports_bad_input_cleanly(tmp_path, kenlm_model):
    bad = tmp_path / "broken.tsv"
    bad.write_text("utt\trank\n")
    proc = run_cli("rescore", bad, "--ngram", kenlm_model, "-o", tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "broken.tsv:1" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = run_cli("rescore", TEST_DATA / "nbest.tsv", "-o", tmp_path / "out")
    assert proc.returncode == 2 and "--lm" in proc.stderr
