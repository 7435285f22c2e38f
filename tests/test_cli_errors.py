"""Bad input gives one line on stderr, a non-zero exit and no run directory that looks valid."""

from pathlib import Path

import pytest
import torch
from conftest import run_cli


def assert_clean_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:")
    for n in needles:
        assert n in lines[0], lines[0]


def _train(train, valid, out, *extra):
    return run_cli("train", "--train", train, "--valid", valid, "--out", out, "--quiet", "--max-steps", "2",
                   *extra)


def test_missing_training_file(small_corpus, tmp_path):
    out = tmp_path / "run"
    proc = _train(tmp_path / "nope.txt", small_corpus[1], out)
    assert_clean_error(proc, "nope.txt", "not found")
    assert not out.exists()


@pytest.mark.parametrize("content,what", [("", "empty"), ("  \n\n\t\n", "no words")])
def test_empty_or_wordless_training_file(small_corpus, tmp_path, content, what):
    bad = tmp_path / "bad.txt"
    bad.write_text(content)
    out = tmp_path / "run"
    proc = _train(bad, small_corpus[1], out)
    assert_clean_error(proc, "bad.txt", what)
    assert not out.exists()


def test_unknown_preset(small_corpus, tmp_path):
    out = tmp_path / "run"
    proc = _train(small_corpus[0], small_corpus[1], out, "--preset", "99L-9F")
    assert_clean_error(proc, "99L-9F", "8L-3F-sharedkv")
    assert not out.exists()


def test_refuses_to_overwrite_a_run_without_resume(small_corpus, tmp_path):
    out = tmp_path / "run"
    assert _train(small_corpus[0], small_corpus[1], out).returncode == 0
    assert_clean_error(_train(small_corpus[0], small_corpus[1], out), "--resume")


@pytest.fixture(scope="module")
def trained(small_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "run"
    proc = _train(small_corpus[0], small_corpus[1], out)
    assert proc.returncode == 0, proc.stderr
    return out


def test_garbage_checkpoint(trained, small_corpus, tmp_path):
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"this is not a checkpoint at all" * 10)
    assert_clean_error(run_cli("eval", "--model", bad, "--text", small_corpus[1]), str(bad), "corrupt")


def test_truncated_checkpoint(trained, small_corpus, tmp_path):
    data = (trained / "model.pt").read_bytes()
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(data[: len(data) // 2])
    assert_clean_error(run_cli("eval", "--model", bad, "--text", small_corpus[1]), str(bad))


def test_checkpoint_whose_weights_do_not_match_its_config(trained, small_corpus, tmp_path):
    obj = torch.load(trained / "model.pt", weights_only=True)
    obj["config"]["d_ff"] = obj["config"]["d_ff"] * 2
    bad = tmp_path / "mismatch.pt"
    torch.save(obj, bad)
    assert_clean_error(run_cli("eval", "--model", bad, "--text", small_corpus[1]), str(bad), "do not match")


def test_directory_without_a_model(small_corpus, tmp_path):
    assert_clean_error(run_cli("eval", "--model", tmp_path, "--text", small_corpus[1]), str(tmp_path), "model.pt")


def test_eval_json_reports_what_the_issue_asks(trained, small_corpus):
    import json

    proc = run_cli("eval", "--model", trained, "--text", small_corpus[1], "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    for key in ("perplexity", "tokens_per_second", "parameters", "state_numel_per_position",
                "state_bytes_per_position", "oov_words", "convention"):
        assert key in r
    assert "</s>" in r["convention"] and "<unk>" in r["convention"]
    assert r["tokens"] == r["words"] + r["sentences"]
