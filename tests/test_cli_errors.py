"""Bad input gives one line on stderr, a non-zero exit and no run directory that looks valid."""

import socket
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


@pytest.mark.parametrize("setting, state", [("shared_kv=False", 2 * 2 * 64), ("shared_kv=false", 2 * 2 * 64),
                                            ("shared_kv=True", 2 * 64)])
def test_set_takes_python_and_json_spellings_of_booleans(small_corpus, tmp_path, setting, state):
    out = tmp_path / "run"
    proc = _train(*small_corpus, out, "--preset", "tiny", "--set", setting)
    assert proc.returncode == 0, proc.stderr
    assert torch.load(out / "model.pt", weights_only=True)["config"]["shared_kv"] is (setting.endswith("rue"))
    assert '"state_numel_per_position": %d' % state in proc.stdout


def test_checkpoint_with_a_flag_kept_as_text_loads_as_it_was_built(trained, small_corpus, tmp_path):
    obj = torch.load(trained / "model.pt", weights_only=True)
    assert obj["config"]["shared_kv"] is False and obj["config"]["bias"] is False
    obj["config"]["bias"] = ""  # falsy text: built without biases, as the weights are
    old = tmp_path / "old.pt"
    torch.save(obj, old)
    proc = run_cli("eval", "--model", old, "--text", small_corpus[1], "--json")
    assert proc.returncode == 0, proc.stderr
    assert "holds the text ''" in proc.stderr and "built with bias=False" in proc.stderr


def test_shared_kv_kept_as_the_text_false_loads_the_shared_model_it_is(tmp_path):
    from smallstate_lm.checkpoint import load_model, save_checkpoint
    from smallstate_lm.models import build_model, get_preset
    from smallstate_lm.vocab import Vocabulary

    vocab = Vocabulary.build([["the", "lord", "is", "my", "shepherd"]])
    model = build_model(get_preset("tiny").replace(vocab_size=len(vocab), shared_kv=True, dropout=0.0)).eval()
    save_checkpoint(tmp_path / "model.pt", model, vocab)
    obj = torch.load(tmp_path / "model.pt", weights_only=True)
    obj["config"]["shared_kv"] = "False"  # what `--set shared_kv=False` stored: the text, truthy when built
    torch.save(obj, tmp_path / "model.pt")
    with pytest.warns(UserWarning, match="built with shared_kv=True"):
        loaded = load_model(tmp_path)
    assert loaded.config.shared_kv is True
    tokens = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        a, _ = model.score(tokens, model.initial_state(1))
        b, _ = loaded.model.score(tokens, loaded.model.initial_state(1))
    assert (a - b).abs().max() <= 1e-6


def test_set_with_a_value_of_the_wrong_type(small_corpus, tmp_path):
    out = tmp_path / "run"
    proc = _train(*small_corpus, out, "--preset", "tiny", "--set", "shared_kv=no")
    assert_clean_error(proc, "shared_kv must be true or false", "'no'")
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


def test_checkpoint_with_its_end_overwritten_ends_its_sentence(trained, small_corpus, tmp_path):
    data = bytearray((trained / "model.pt").read_bytes())
    data[-300:] = bytes(300)  # the zip's central directory gone: torch's message runs on with advice
    bad = tmp_path / "overwritten.pt"
    bad.write_bytes(bytes(data))
    proc = run_cli("eval", "--model", bad, "--text", small_corpus[1])
    assert_clean_error(proc, str(bad), "central directory)")
    assert proc.stderr.strip().endswith(")")


def test_rescore_output_that_cannot_be_a_directory_is_refused_before_loading(tmp_path):
    lattice = Path(__file__).resolve().parent.parent / "lattices" / "kal-dev0000.lat.fst"
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    # a missing --lm would be the error if the models were loaded first
    proc = run_cli("rescore", lattice, "--words", lattice.parent / "words.txt", "--lm", tmp_path / "no-model",
                   "-o", blocker / "out")
    assert_clean_error(proc, f"-o {blocker / 'out'}", f"{blocker} is a file")
    proc = run_cli("rescore", lattice, "--words", lattice.parent / "words.txt", "--lm", tmp_path / "no-model",
                   "-o", blocker)
    assert_clean_error(proc, f"-o {blocker}: is a file")
    assert blocker.read_text() == "x"


def test_refs_that_name_none_of_the_utterances_are_an_error_not_a_zero_wer(kenlm_model, tmp_path):
    lattice = Path(__file__).resolve().parent.parent / "lattices" / "kal-dev0000.lat.fst"
    refs = tmp_path / "ref.txt"
    refs.write_text("other-utt he is a double minded man\n")
    proc = run_cli("rescore", lattice, "--words", lattice.parent / "words.txt", "--ngram", kenlm_model,
                   "-o", tmp_path / "out", "--refs", refs, "--quiet")
    assert_clean_error(proc, "--refs: none of the 1 utterances has a reference", "'kal-dev0000'", "'other-utt'")
    assert not (tmp_path / "out" / "wer.txt").exists()


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


def test_unsafe_pickle_names_the_refused_global_and_gives_no_unsafe_advice(small_corpus, tmp_path):
    import os

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    bad = tmp_path / "evil.pt"
    torch.save({"format": "smallstate-lm/1", "model": Evil()}, bad)
    proc = run_cli("eval", "--model", bad, "--text", small_corpus[1])
    assert_clean_error(proc, str(bad), "system")
    assert "weights_only" not in proc.stderr and "pwned" not in proc.stdout


LATTICES = Path(__file__).resolve().parent / "data" / "lattices"


def _rescore_lattices(tiny_lm_dir, out, *inputs):
    return run_cli("rescore", *inputs, "--words", LATTICES / "words.txt", "--lm", tiny_lm_dir, "--device", "cpu",
                   "-o", out, "--quiet")


def test_directory_among_lattice_inputs_is_that_inputs_error(tiny_lm_dir, tmp_path):
    named = tmp_path / "dir.lat.fst"
    plain = tmp_path / "plain"
    named.mkdir()
    plain.mkdir()
    out = tmp_path / "out"
    proc = _rescore_lattices(tiny_lm_dir, out, LATTICES / "slt-dev0004.lat.fst", named, plain)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 2 and all(x.startswith("error:") and "is a directory" in x for x in lines), proc.stderr
    assert str(named) in lines[0] and str(plain) in lines[1]
    assert (out / "best.txt").read_text().startswith("slt-dev0004 ")
    assert len((out / "nbest.jsonl").read_text().splitlines()) == 1


def test_run_where_every_lattice_fails_writes_no_outputs(tiny_lm_dir, tmp_path):
    cut = tmp_path / "cut.lat.fst"
    cut.write_bytes((LATTICES / "slt-dev0004.lat.fst").read_bytes()[:3000])
    (tmp_path / "text.lat.fst").write_text("0 1 1 1\n")
    out = tmp_path / "out"
    proc = _rescore_lattices(tiny_lm_dir, out, cut, tmp_path / "text.lat.fst")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert all(x.startswith("error:") for x in lines) and "cut.lat.fst" in lines[0], proc.stderr
    assert not (out / "best.txt").exists() and not (out / "nbest.jsonl").exists()


def test_serve_with_a_bad_checkpoint_is_one_line(tmp_path):
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"this is not a checkpoint at all" * 10)
    proc = run_cli("serve", "--lm", bad, "--port", "0", "--device", "cpu", timeout=120)
    assert_clean_error(proc, str(bad), "corrupt")


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(tmp_path, tiny_lm_dir):
    """A second replica on a taken port: refused at once (the model would take a minute to load first)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("serve", "--lm", tiny_lm_dir, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                       timeout=120)
    assert_clean_error(proc, f"--port {port}", "cannot listen there")


def test_demo_outside_a_checkout_says_it_needs_one(tmp_path, monkeypatch, capsys):
    """Installed, the package has no models/, data/ or lattices/ beside it: the demo looks in the current
    directory, and where they are not either it says so in one line, exit 2."""
    import smallstate_lm.cli.demo as demo_module
    from smallstate_lm.cli import main

    repo = Path(demo_module.__file__).resolve().parents[2]
    monkeypatch.setattr(demo_module, "_package_checkout", lambda: tmp_path / "site-packages")
    monkeypatch.chdir(repo)
    assert demo_module._bundled("lattices") == repo / "lattices"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["demo", "-o", str(tmp_path / "demo")])
    assert e.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: the demo needs a checkout of the repository"), lines
    assert "--model" in lines[0] and not (tmp_path / "demo").exists()
