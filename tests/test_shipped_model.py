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


def test_the_shipped_model_is_small_and_loads_like_a_run_directory(documented):
    assert (MODEL / "model.pt").stat().st_size <= 20 * 2**20
    lm = load_model(MODEL)
    assert lm.config.to_dict() == documented["config"]
    assert lm.vocab.words == (MODEL / "vocab.txt").read_text().splitlines()
    assert next(lm.model.parameters()).dtype.is_floating_point
    assert not lm.model.training
