"""scripts/state_tradeoff.py: the family at one budget, its refusals, and the int8 trip of
trained weights through scripts/run_transport.py (train -> pack -> unpack -> the same model
within the quantisation step)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smallstate_lm.checkpoint import load_model
from smallstate_lm.models import build_model, get_preset

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT = SCRIPTS / "state_tradeoff.py"


def script(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def module(name: str = "state_tradeoff"):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def test_family_meets_the_budget_and_shared_kv_halves_the_state():
    st = module()
    args = st.main.__globals__["argparse"].Namespace(
        family="7x1,4x2,2x5,4x2kv", preset="small", set=[], d_model=64, heads=None, dropout=0.0, budget=None,
        tolerance=0.05, fixed_d_ff=False)
    members, budget = st.plan(args)
    by = {m.name: m for m in members}
    assert by["4L-2F"].d_ff == 256  # the budget is the 4L-2F member at d_ff = 4 d
    for m in members:
        assert abs(m.nonemb / budget - 1) <= 0.05
        cfg = get_preset("small").replace(vocab_size=50, d_model=64, n_heads=1, **m.overrides())
        model = build_model(cfg)
        emb = 50 * (64 + 1)  # per word: its tied embedding row and its output bias
        assert sum(p.numel() for p in model.parameters()) - emb == m.nonemb
    assert by["4L-2F-sharedkv"].state * 2 == by["4L-2F"].state == 2 * 4 * 64
    assert by["7L-1F"].state == 2 * 7 * 64


@pytest.mark.parametrize("args, message", [
    (["plan", "--preset", "nope"], "--preset 'nope': unknown"),
    (["plan", "--preset", "lstm-small"], "Transformer shapes"),
    (["plan", "--set", "colour=red"], "--set 'colour=red'"),
    (["plan", "--set", "dropout=lots"], "--set dropout=lots"),
    (["plan", "--budget", "0"], "--budget must be > 0"),
    (["plan", "--budget=-3M"], "expected a number"),
    (["plan", "--family", "4x2,4y2"], "'4y2' is not LxF"),
    (["plan", "--fixed-d-ff", "--family", "7x1,2x5"], "differ from the budget"),
    (["train", "--d-model", "16", "--train", "/nonexistent/train.txt"], "/nonexistent/train.txt: cannot read"),
])
def test_bad_input_is_refused_in_one_line(args, message):
    r = script(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr


def test_quantize_keeps_ties_and_stays_within_half_a_step():
    st = module("run_transport")
    model = build_model(get_preset("tiny").replace(vocab_size=300))
    weights = model.state_dict()
    back = st.dequantize(st.quantize(weights))
    assert back.keys() == weights.keys()
    tied = [k for k in weights if k != "embed.weight" and weights[k].data_ptr() == weights["embed.weight"].data_ptr()]
    for k in tied:
        assert back[k] is back["embed.weight"]
    for k, t in weights.items():
        if t.dim() == 2 and t.numel() >= 4096:
            step = t.abs().amax(1, keepdim=True) / 127
            assert ((back[k].float() - t).abs() <= step / 2 + 1e-3 * step + 1e-4).all(), k


@pytest.mark.slow
def test_trained_family_travels_as_int8_and_scores_alike(small_corpus, tmp_path):
    train, valid = small_corpus
    runs = tmp_path / "runs"
    r = script("train", "--runs", runs, "--family", "1x1,1x2kv", "--d-model", "16", "--train", train,
               "--valid", valid, "--dev", valid, "--max-tokens", "3000", "--jobs", "2", "--threads", "1",
               "--device", "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    family = json.loads((runs / "family.json").read_text())
    assert [m["name"] for m in family["members"]] == ["1L-1F", "1L-2F-sharedkv"]
    again = script("train", "--runs", runs, "--family", "1x1,1x2kv", "--d-model", "16", "--train", train,
                   "--valid", valid, "--dev", valid, "--max-tokens", "3000", "--device", "cpu")
    assert again.returncode == 0 and again.stdout.count("trained already") == 2

    r = script("pack", "--runs", runs, "--out", tmp_path / "parts")
    assert r.returncode == 0, r.stderr[-2000:]
    parts = sorted((tmp_path / "parts").iterdir())
    r = script("unpack", *parts, "--runs", tmp_path / "back")
    assert r.returncode == 0, r.stderr[-2000:]
    tokens = torch.tensor([[5, 9, 2, 7, 3]])
    for name in ("1L-1F", "1L-2F-sharedkv"):
        a, b = load_model(runs / name), load_model(tmp_path / "back" / name)
        assert b.config == a.config and len(b.vocab) == len(a.vocab)
        assert json.loads((tmp_path / "back" / name / "summary.json").read_text())["tokens"] >= 3000
        with torch.no_grad():
            la, _ = a.model.score(tokens, a.model.initial_state(1))
            lb, _ = b.model.score(tokens, b.model.initial_state(1))
        assert (la - lb).abs().max() < 0.05  # int8 per row: a small, bounded change

    r = script("unpack", tmp_path / "parts" / "nothing.tar.00")
    assert r.returncode == 2 and "cannot read" in r.stderr
