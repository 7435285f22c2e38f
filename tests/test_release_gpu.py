"""scripts/release_gpu.py (issue 44's GPU call), on the CPU: the families meet one non-embedding budget,
the release candidates keep at most 2,048 state numbers per position, a run writes one result line per
member with perplexities and packs only the returned members' weights, which load back."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_state_tradeoff import module

from smallstate_lm.checkpoint import load_model
from smallstate_lm.models import build_model

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "release_gpu.py"


def script(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_every_family_meets_bible_smalls_budget_and_the_release_keeps_its_state():
    rg = module("release_gpu")
    members, budget = rg.plan(0.05)
    assert budget == 5_249_536  # models/bible-small's non-embedding parameters (its README: `small`)
    kinds = {m.kind for m in members}
    assert kinds == {"release", "family"}
    for m in members:
        cfg = rg.config_of(m)
        with torch.device("meta"):
            model = build_model(cfg)
        assert model.state_numel_per_position() == m.state
        if m.kind == "family":
            assert abs(m.nonemb / budget - 1) <= 0.05, m.name
        else:
            assert m.state <= 2048, m.name
    knobs = {m.name: m.sets.get(m.knob) for m in members if m.knob}
    assert all(v and v % 8 == 0 for v in knobs.values()), knobs


def test_a_run_without_its_text_is_refused_in_one_line(tmp_path):
    r = script("run", "--out", tmp_path / "out", "--data", tmp_path / "nowhere", "--members", "small")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"release_gpu: error: --data {tmp_path / 'nowhere'}: no train.txt there"]
    r = script("run", "--out", tmp_path / "out", "--members", "small,nope")
    assert r.returncode == 2 and "--members: unknown nope" in r.stderr


@pytest.mark.slow
def test_a_short_run_reports_every_member_and_packs_the_returned_ones(small_corpus, tmp_path):
    train, valid = small_corpus
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(train, data / "train.txt")
    shutil.copy(valid, data / "valid.txt")
    shutil.copy(valid, data / "dev.txt")
    out, runs = tmp_path / "out", tmp_path / "runs" / "release"
    r = script("run", "--out", out, "--runs", runs, "--data", data, "--device", "cpu", "--minutes", "0.01",
               "--members", "small,r384-5L-2F-kv", timeout=600)
    assert r.returncode == 0, r.stderr + r.stdout
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert lines[0]["call"]["members"] == 2
    by = {x["member"]: x for x in lines[1:]}
    assert set(by) == {"small", "r384-5L-2F-kv"}
    for rec in by.values():
        assert rec["summary"]["tokens"] > 0
        assert rec["valid"]["perplexity"] > 1 and rec["dev"]["perplexity"] > 1
        assert rec["valid"]["state_numel_per_position"] == rec["state"]
    parts = sorted(out.glob("release.tar.*"))
    assert parts, r.stdout
    rt = module("run_transport")
    rt.unpack(parts, tmp_path / "back")
    assert sorted(p.name for p in (tmp_path / "back").iterdir() if p.is_dir()) == ["r384-5L-2F-kv"]
    back = load_model(tmp_path / "back" / "r384-5L-2F-kv")
    trained = load_model(runs / "r384-5L-2F-kv")
    assert back.config == trained.config and back.vocab.words == trained.vocab.words
