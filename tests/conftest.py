import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A few thousand bundled sentences for training tests, and 200 for validation."""
    d = tmp_path_factory.mktemp("corpus")
    train_lines = (DATA / "train.txt").read_text().splitlines()[:3000]
    valid_lines = (DATA / "valid.txt").read_text().splitlines()[:200]
    (d / "train.txt").write_text("\n".join(train_lines) + "\n")
    (d / "valid.txt").write_text("\n".join(valid_lines) + "\n")
    return d / "train.txt", d / "valid.txt"


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real console entry point in a subprocess, as a user runs it."""
    env = dict(os.environ)
    env.pop("SMALLSTATE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "smallstate_lm.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout)


# Tests use tiny tensors: one intra-op thread avoids spin-wait contention between
# threads (and with other processes) that costs more than it saves at this size.
torch.set_num_threads(1)


TEST_DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def kenlm_model(tmp_path_factory) -> Path:
    """A real 3-gram built by lmplz + build_binary from the bundled text."""
    from smallstate_lm.ngram import build_ngram

    d = tmp_path_factory.mktemp("kenlm")
    build_ngram(DATA / "train.txt", 3, d / "lm.arpa", d / "lm.bin")
    return d / "lm.bin"


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory) -> Path:
    """A tiny Transformer checkpoint (random weights) over the bundled text's vocabulary."""
    from smallstate_lm.checkpoint import MODEL_FILE, save_checkpoint
    from smallstate_lm.files import read_sentences
    from smallstate_lm.models import build_model, get_preset
    from smallstate_lm.vocab import Vocabulary

    vocab = Vocabulary.build(read_sentences(DATA / "train.txt"), min_count=2)
    torch.manual_seed(0)
    model = build_model(get_preset("tiny").replace(vocab_size=len(vocab), dropout=0.0))
    d = tmp_path_factory.mktemp("tinylm")
    save_checkpoint(d / MODEL_FILE, model, vocab)
    return d
