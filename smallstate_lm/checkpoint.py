"""Checkpoints: one torch file holding config, vocabulary, weights and (for resuming)
optimizer and progress. Loaded with `weights_only=True`, so a checkpoint can never
execute code; written through a temp file and a rename, so a crash never leaves a
half-written file under the real name.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import CheckpointError, SmallstateError
from .files import atomic_output
from .models import ModelConfig, build_model
from .vocab import Vocabulary

FORMAT = "smallstate-lm/1"
MODEL_FILE = "model.pt"  # best weights: what eval and rescoring load
LAST_FILE = "last.pt"  # full training state: what --resume loads


def atomic_torch_save(obj, path: Path) -> None:
    with atomic_output(path) as tmp:
        torch.save(obj, tmp)


def save_checkpoint(path: Path, model: nn.Module, vocab: Vocabulary, **extra) -> None:
    cfg: ModelConfig = model.cfg
    obj = {"format": FORMAT, "config": cfg.to_dict(), "vocab": vocab.to_dict(), "model": model.state_dict()}
    obj.update(extra)
    atomic_torch_save(obj, path)


def read_checkpoint(path: str | os.PathLike, default_file: str = MODEL_FILE) -> tuple[Path, dict]:
    """Read a checkpoint file, or `default_file` inside a run directory."""
    path = Path(path)
    if path.is_dir():
        path = path / default_file
        if not path.exists():
            raise CheckpointError(f"{path.parent}: no {default_file} in this directory; "
                                  "expected a run directory written by `smallstate-lm train`")
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file or run directory")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError,
            KeyError, IndexError, AttributeError, TypeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: corrupt or truncated checkpoint ({reason[:200]})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a smallstate-lm checkpoint (expected format {FORMAT!r})")
    for key in ("config", "vocab", "model"):
        if key not in obj:
            raise CheckpointError(f"{path}: checkpoint lacks its {key!r} entry")
    return path, obj


def export_model(src: str | os.PathLike, out_dir: str | os.PathLike, half: bool = True, **extra) -> Path:
    """Write a release copy of a trained model: `out_dir/model.pt` with only config,
    vocabulary and weights (fp16 when `half`; loading casts them back to the model's
    float32), and `out_dir/vocab.txt`. Tied weights stay one tensor in the file.
    Returns the model file."""
    path, obj = read_checkpoint(src)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    copies: dict[int, torch.Tensor] = {}

    def small(t: torch.Tensor) -> torch.Tensor:
        if not (half and t.is_floating_point()):
            return t
        key = t.untyped_storage().data_ptr() + t.storage_offset()
        if key not in copies:
            copies[key] = t.half()
        return copies[key]

    weights = {k: small(v) for k, v in obj["model"].items()}
    keep = {k: obj[k] for k in ("step", "valid_ppl") if k in obj}
    release = {"format": FORMAT, "config": obj["config"], "vocab": obj["vocab"], "model": weights,
               **keep, **extra}
    atomic_torch_save(release, out / MODEL_FILE)
    Vocabulary.from_dict(obj["vocab"]).save(out / "vocab.txt")
    return out / MODEL_FILE


@dataclass
class LoadedModel:
    model: nn.Module
    vocab: Vocabulary
    config: ModelConfig
    path: Path
    extra: dict


def load_model(
    path: str | os.PathLike, device: str | torch.device = "cpu", default_file: str = MODEL_FILE
) -> LoadedModel:
    """Rebuild the exact saved model in eval mode; every failure is a CheckpointError
    naming the file."""
    path, obj = read_checkpoint(path, default_file)
    try:
        cfg = ModelConfig.from_dict(dict(obj["config"]))
        cfg.validate()
        vocab = Vocabulary.from_dict(obj["vocab"])
    except (SmallstateError, TypeError) as e:
        raise CheckpointError(f"{path}: bad config or vocabulary: {e}") from None
    if len(vocab) != cfg.vocab_size:
        raise CheckpointError(f"{path}: vocabulary has {len(vocab)} words but the model expects {cfg.vocab_size}")
    model = build_model(cfg)
    try:
        model.load_state_dict(obj["model"])
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{path}: weights do not match the config ({' '.join(first[:2])[:300]})") from None
    model.to(device).eval()
    extra = {k: v for k, v in obj.items() if k not in ("config", "vocab", "model")}
    return LoadedModel(model=model, vocab=vocab, config=cfg, path=path, extra=extra)
