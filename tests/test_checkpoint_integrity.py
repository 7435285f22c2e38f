"""A damaged checkpoint is refused at load, naming the file and the tensor; one written
before checkpoints carried digests still loads."""

import json
import math
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TEST_DATA, run_cli

from smallstate_lm.checkpoint import (
    DIGEST_KEY,
    MODEL_FILE,
    export_model,
    load_model,
    read_checkpoint,
    save_checkpoint,
    self_check,
)
from smallstate_lm.errors import CheckpointError, ScoreError
from smallstate_lm.rescoring.nbest.lists import Hypothesis, Utterance, write_nbest_jsonl


def overwrite_tensor_bytes(src: Path, dst: Path, data: bytes) -> list[str]:
    """Copy `src` to `dst` with `data` written over the middle of its largest tensor's
    storage (torch does not check the zip entry's CRC, as a reader of a damaged disk
    would not); return the names of the tensors whose values changed."""
    raw = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    raw[start: start + len(data)] = data
    dst.write_bytes(bytes(raw))
    before = torch.load(src, weights_only=True)["model"]
    after = torch.load(dst, weights_only=True)["model"]
    return [k for k in before if not torch.equal(before[k], after[k])]


FINITE_NOISE = np.random.default_rng(0).standard_normal(1024).astype(np.float32).tobytes()  # 4,096 bytes


def without_digest(src: Path, dst: Path) -> None:
    """A checkpoint as written before digests existed."""
    obj = torch.load(src, weights_only=True)
    obj.pop(DIGEST_KEY, None)
    torch.save(obj, dst)


def test_saved_checkpoints_carry_a_digest_of_their_tensors(tiny_lm_dir):
    _, obj = read_checkpoint(tiny_lm_dir)
    assert set(obj[DIGEST_KEY]) == set(obj["model"])


def test_overwritten_bytes_are_refused_naming_file_and_tensor(tiny_lm_dir, tmp_path):
    bad = tmp_path / "model.pt"
    changed = overwrite_tensor_bytes(tiny_lm_dir / MODEL_FILE, bad, FINITE_NOISE)
    assert changed
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    msg = str(e.value)
    assert msg.startswith(str(bad)) and "digest" in msg
    assert all(name in msg for name in changed), msg


def test_eval_and_rescore_refuse_a_corrupted_checkpoint(tiny_lm_dir, tmp_path):
    bad = tmp_path / "model.pt"
    overwrite_tensor_bytes(tiny_lm_dir / MODEL_FILE, bad, FINITE_NOISE)
    text = tmp_path / "text.txt"
    text.write_text("the lord is my shepherd\n")
    out = tmp_path / "out"
    for args in (("eval", "--model", bad, "--text", text),
                 ("rescore", TEST_DATA / "nbest.tsv", "--lm", bad, "--device", "cpu", "-o", out, "--quiet")):
        proc = run_cli(*args)
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"error: {bad}: ") and "digest" in lines[0]
    assert not out.exists()


def test_non_finite_weight_is_refused_naming_the_tensor(tiny_lm_dir, tmp_path):
    good = load_model(tiny_lm_dir)
    name = next(k for k, v in good.model.state_dict().items() if v.is_floating_point() and v.dim() == 2)
    with torch.no_grad():
        good.model.state_dict()[name][0, 0] = math.nan
    nan_file = tmp_path / "nan.pt"
    save_checkpoint(nan_file, good.model, good.vocab)  # the digest agrees: the weights were NaN when saved
    with pytest.raises(CheckpointError, match=rf"nan.pt: .*{name}.* (NaN|not finite)"):
        load_model(nan_file)


def test_old_checkpoint_without_digest_loads_and_gets_the_non_finite_check(tiny_lm_dir, tmp_path):
    old = tmp_path / "old.pt"
    without_digest(tiny_lm_dir / MODEL_FILE, old)
    assert DIGEST_KEY not in read_checkpoint(old)[1]
    load_model(old)
    ff = tmp_path / "old-ff.pt"
    changed = overwrite_tensor_bytes(old, ff, b"\xff" * 4096)  # 0xffffffff is a float32 NaN
    with pytest.raises(CheckpointError, match=rf"old-ff.pt: .*{changed[0]}"):
        load_model(ff)


def test_the_shipped_model_verifies_and_a_copy_without_digest_still_loads(tmp_path):
    """The shipped model carries a digest that verifies; the same weights saved the way checkpoints were
    written before digests existed still load (releases users already have)."""
    shipped = REPO / "models" / "bible-small" / MODEL_FILE
    obj = torch.load(shipped, weights_only=True)
    assert set(obj[DIGEST_KEY]) == set(obj["model"])
    self_check(load_model(shipped))
    old = tmp_path / "old" / MODEL_FILE
    old.parent.mkdir()
    torch.save({k: v for k, v in obj.items() if k != DIGEST_KEY}, old)
    (old.parent / "vocab.txt").write_bytes((shipped.parent / "vocab.txt").read_bytes())
    self_check(load_model(old.parent))


def test_export_writes_a_digest_that_load_verifies(tiny_lm_dir, tmp_path):
    path = export_model(tiny_lm_dir, tmp_path / "release")
    _, obj = read_checkpoint(path)
    assert set(obj[DIGEST_KEY]) == set(obj["model"])
    changed = overwrite_tensor_bytes(path, tmp_path / "bad.pt", FINITE_NOISE[:2048])
    with pytest.raises(CheckpointError, match=rf"bad.pt: .*{changed[0]}"):
        load_model(tmp_path / "bad.pt")


def test_self_check_refuses_a_model_whose_scores_are_not_finite(tiny_lm_dir):
    loaded = load_model(tiny_lm_dir)
    self_check(loaded)
    with torch.no_grad():
        for p in loaded.model.parameters():
            p.fill_(3e38)  # finite weights, but the forward overflows
    with pytest.raises(CheckpointError, match=rf"{tiny_lm_dir}.*not finite"):
        self_check(loaded)


def test_nbest_writer_refuses_nan_instead_of_writing_invalid_json(tmp_path):
    hyp = Hypothesis(words=["a"], am=-1.0, graph=-2.0, id="0", scores={"neural": math.nan, "total": math.nan})
    out = tmp_path / "nbest.jsonl"
    with pytest.raises(ScoreError, match=r"nbest.jsonl: utterance u1: .*neural.* not a finite number"):
        write_nbest_jsonl(out, [Utterance("u1", [hyp])])
    assert not out.exists()
    write_nbest_jsonl(out, [Utterance("u1", [Hypothesis(words=["a"], am=-1.0, graph=-2.0)])])
    assert json.loads(out.read_text())["hyps"][0]["am"] == -1.0
