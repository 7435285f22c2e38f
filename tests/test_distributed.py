"""torchrun data-parallel training (gloo, 2 CPU processes) equals one process at the same global batch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smallstate_lm.checkpoint import load_model

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))


def _losses(run: Path) -> list[float]:
    recs = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r]


def _valid(run: Path) -> list[float]:
    recs = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return [r["valid_ppl"] for r in recs if r.get("event") == "valid"]


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed")
@pytest.mark.parametrize("extra", [
    ["--preset", "tiny"],
    # running text with carried Transformer-XL memories, each rank holding half of the streams
    ["--preset", "xl-small", "--stream", "--max-len", "16", "--set", "d_model=32", "--set", "d_ff=64",
     "--set", "n_layers=2", "--set", "mem_len=16"],
    # a persistent left padding is used by the first segment only: a parameter without a gradient later
    ["--preset", "pconv-small", "--stream", "--max-len", "16", "--set", "d_model=32", "--set", "d_ff=64",
     "--set", "n_layers=2", "--set", "conv_kernel=4"],
], ids=["sentences", "stream-xl", "stream-pconv"])
@pytest.mark.slow
def test_two_processes_equal_one_at_the_same_global_batch(tmp_path, small_corpus, extra):
    train, valid = small_corpus
    args = ["--train", str(train), "--valid", str(valid), *extra, "--set", "dropout=0",
            "--max-steps", "6", "--batch-tokens", "512", "--valid-every", "3", "--quiet", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "smallstate_lm.cli", "train", *args, "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "smallstate_lm", "train", *args,
                          "--out", str(tmp_path / "two")], capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5
    assert _valid(tmp_path / "one") == pytest.approx(_valid(tmp_path / "two"), rel=1e-5)
    m1, m2 = load_model(tmp_path / "one"), load_model(tmp_path / "two")
    for (n, p1), (_, p2) in zip(m1.model.state_dict().items(), m2.model.state_dict().items()):
        assert torch.allclose(p1, p2, atol=1e-5), n
    # rank 0 alone wrote the run: one log with one start record
    starts = [line for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines() if '"start"' in line]
    assert len(starts) == 1 and json.loads(starts[0])["processes"] == 2
