"""The model we ship (models/bible-small): it loads through the normal paths and gives the
perplexities its README states."""

import json
from pathlib import Path

import pytest

from smallstate_lm.checkpoint import load_model
from smallstate_lm.evaluate import evaluate_file

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "bible-small"
DEV = ROOT / "data" / "dev.txt"


@pytest.fixture(scope="module")
def documented():
    return json.loads((MODEL / "results.json").read_text())


def test_the_shipped_model_reproduces_its_documented_dev_perplexity(documented):
    r = evaluate_file(MODEL, DEV)
    assert r["tokens"] == documented["dev"]["tokens"]
    assert r["perplexity"] == pytest.approx(documented["dev"]["perplexity"], rel=0.005)


def test_the_shipped_model_with_the_bundled_4gram_interpolates_as_documented(documented, tmp_path):
    """The README's interpolated perplexity with a 4-gram that anyone can rebuild from
    data/train.txt (the full-text 4-gram is too large to ship)."""
    from smallstate_lm.ngram import build_ngram

    want = documented["interpolation_bundled_4gram"]
    build_ngram(ROOT / "data" / "train.txt", 4, tmp_path / "lm4.arpa", tmp_path / "lm4.bin")
    mix = evaluate_file(MODEL, DEV, ngram=tmp_path / "lm4.bin")["interpolation"]
    assert mix["ngram_perplexity"] == pytest.approx(want["ngram_perplexity"], rel=0.005)
    assert mix["perplexity"] == pytest.approx(want["perplexity"], rel=0.005)
    assert abs(mix["lambda"] - want["lambda"]) <= 0.02


def test_the_shipped_model_is_small_and_loads_like_a_run_directory(documented):
    assert (MODEL / "model.pt").stat().st_size <= 20 * 2**20
    lm = load_model(MODEL)
    assert lm.config.to_dict() == documented["config"]
    assert lm.vocab.words == (MODEL / "vocab.txt").read_text().splitlines()
    assert next(lm.model.parameters()).dtype.is_floating_point
    assert not lm.model.training


@pytest.mark.slow
def test_the_shipped_model_rescores_and_serves(kenlm_model, tmp_path):
    """`rescore --lm models/bible-small` on bundled lattices, and `serve` with it: the
    service's sentence log-prob equals the CLI's eval of the same sentence."""
    import httpx
    from conftest import run_cli
    from test_server import Server

    lat = ROOT / "lattices"
    fsts = sorted(lat.glob("slt-*.lat.fst"))[:2]
    p = run_cli("rescore", *fsts, "--words", lat / "words.txt", "--lm", MODEL, "--ngram", kenlm_model,
                "--refs", lat / "ref.txt", "-o", tmp_path / "out", "--quiet", "--device", "cpu")
    assert p.returncode == 0, p.stderr
    assert len((tmp_path / "out" / "best.txt").read_text().splitlines()) == 2
    sentence = "and jesus said unto them"
    (tmp_path / "s.txt").write_text(sentence + "\n")
    want = evaluate_file(MODEL, tmp_path / "s.txt")["logprob_sum_ln"]
    s = Server(MODEL, kenlm_model, "drain_seconds=0", log=tmp_path / "server.log")
    try:
        r = httpx.post(s.url + "/score", json={"sentences": [sentence]}, timeout=60)
    finally:
        assert s.stop() == 0
    assert r.status_code == 200, r.text
    assert r.json()["sentences"][0]["neural"]["logprob"] == pytest.approx(want, abs=1e-3)


@pytest.mark.slow
def test_demo_prints_first_pass_ngram_alone_and_neural_plus_ngram(tmp_path):
    from conftest import run_cli

    p = run_cli("demo", "-o", tmp_path / "demo", timeout=600)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    wer = {}
    for name in ("first pass", "n-gram alone", "neural + n-gram"):
        found = [x for x in lines if x.strip().startswith(name + " ")]
        assert len(found) == 1, p.stdout
        wer[name] = float(found[0].split()[-1].rstrip("%"))
    # the two rescoring runs decode the same lattices with the same first-pass scores
    first = [(tmp_path / "demo" / d / "wer.txt").read_text().splitlines()[1] for d in ("rescored", "rescored-ngram")]
    assert first[0] == first[1]
    assert (tmp_path / "demo" / "rescored" / "best.txt").exists()
    assert all(0.0 <= v <= 100.0 for v in wer.values()), wer


CONTEXT_MODEL = ROOT / "models" / "bible-context"


def test_the_shipped_context_model_reads_the_sentences_before_as_documented():
    """models/bible-context (bible-small fine-tuned across sentences): dev perplexity as documented with each
    sentence read alone and after the four before it, and as small as the sentence model's."""
    documented = json.loads((CONTEXT_MODEL / "results.json").read_text())["dev"]
    alone = evaluate_file(CONTEXT_MODEL, DEV)
    after = evaluate_file(CONTEXT_MODEL, DEV, context_sentences=4)
    assert alone["tokens"] == after["tokens"] == documented["tokens"]
    assert alone["perplexity"] == pytest.approx(documented["perplexity"], rel=0.005)
    assert after["perplexity"] == pytest.approx(documented["perplexity_after_4"], rel=0.005)
    assert (CONTEXT_MODEL / "model.pt").stat().st_size <= 20 * 2**20
