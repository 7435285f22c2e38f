"""Checkpoints: one torch file holding config, vocabulary, weights and (for resuming)
optimizer and progress. Loaded with `weights_only=True`, so a checkpoint can never
execute code; written through a temp file and a rename, so a crash never leaves a
half-written file under the real name. Each file carries a sha256 digest per weight
tensor, checked at load: torch does not check its zip entries' CRCs, so damaged bytes
would otherwise load as (often NaN) weights without a word.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import CheckpointError, SmallstateError
from .files import atomic_output
from .models import ModelConfig, build_model
from .subword import vocabulary_of
from .vocab import EOS_ID, Vocabulary

FORMAT = "smallstate-lm/1"
MODEL_FILE = "model.pt"  # best weights: what eval and rescoring load
LAST_FILE = "last.pt"  # full training state: what --resume loads
# {tensor name: sha256 hex} over the "model" entry; files written before it have none and are
# checked for non-finite weights only
DIGEST_KEY = "tensor_sha256"
SELF_CHECK_WORDS = ("the", "lord", "is", "my", "shepherd")


def atomic_torch_save(obj, path: Path) -> None:
    with atomic_output(path) as tmp:
        torch.save(obj, tmp)


def tensor_digests(weights: dict) -> dict[str, str]:
    """sha256 of each tensor's name, dtype, shape and bytes, by name (non-tensors are skipped)."""
    out = {}
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            continue
        h = hashlib.sha256(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        flat = t.detach().cpu().contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy())
        out[name] = h.hexdigest()
    return out


def save_checkpoint(path: Path, model: nn.Module, vocab: Vocabulary, **extra) -> None:
    cfg: ModelConfig = model.cfg
    weights = model.state_dict()
    obj = {"format": FORMAT, "config": cfg.to_dict(), "vocab": vocab.to_dict(), "model": weights,
           DIGEST_KEY: tensor_digests(weights)}
    obj.update(extra)
    atomic_torch_save(obj, path)


def _tensors(names: list[str], most: int = 5) -> str:
    """`tensor 'a'` or `tensors 'a', 'b' and 3 more`."""
    shown = ", ".join(repr(n) for n in names[:most])
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{'tensor' if len(names) == 1 else 'tensors'} {shown}{more}"


def _check_weights(path: Path, obj: dict) -> None:
    """Refuse weights that differ from the digest saved with them, or that are not finite."""
    weights = obj["model"]
    if not isinstance(weights, dict):
        raise CheckpointError(f"{path}: the 'model' entry is not a dict of tensors")
    stored = obj.get(DIGEST_KEY)
    if stored is not None:
        if not isinstance(stored, dict):
            raise CheckpointError(f"{path}: the {DIGEST_KEY!r} entry is not a dict of digests")
        actual = tensor_digests(weights)
        bad = sorted(k for k in stored.keys() | actual.keys() if stored.get(k) != actual.get(k))
        if bad:
            raise CheckpointError(f"{path}: corrupt checkpoint: the sha256 digest saved with the weights does not "
                                  f"match {_tensors(bad)}; expected the bytes as written")
    bad = [k for k, t in weights.items()
           if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(f"{path}: {_tensors(bad)}: NaN or infinite values; expected finite weights "
                              "(a corrupt file, or a training run that diverged)")


def _load_failure(path: Path, e: Exception) -> CheckpointError:
    """One line for a file torch could not load. Its refusals under weights_only come with
    advice to load with weights_only=False, which would run the file's code: name what was
    refused instead."""
    text = str(e).strip()
    if "Weights only load failed" in text:
        unsafe = re.search(r"GLOBAL (\S+?)[.,]?(?:\s|$)", text)
        if unsafe:
            return CheckpointError(f"{path}: refused to load: the file asks for the Python global "
                                   f"{unsafe.group(1)}, which could run code; expected a smallstate-lm "
                                   "checkpoint (tensors, numbers, strings and containers only)")
        text = text.split("WeightsUnpickler error:")[-1]
        text = "\n".join(x for x in text.splitlines() if "weights_only" not in x and "torch.load" not in x)
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    reason = _first_sentence(lines[0]) if lines else type(e).__name__
    return CheckpointError(f"{path}: corrupt or truncated checkpoint ({reason})")


def _first_sentence(text: str, most: int = 200) -> str:
    """The first sentence of `text` without its full stop, cut at a word (with "...") beyond `most`
    characters: torch's messages go on with advice, and a cut must not end mid-word."""
    sentence = re.split(r"(?<=[^.\s])\.\s", text + " ", maxsplit=1)[0].strip().rstrip(".")
    if len(sentence) <= most:
        return sentence
    return sentence[:most].rsplit(" ", 1)[0].rstrip(",;:") + "..."


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
        raise _load_failure(path, e) from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a smallstate-lm checkpoint (expected format {FORMAT!r})")
    for key in ("config", "vocab", "model"):
        if key not in obj:
            raise CheckpointError(f"{path}: checkpoint lacks its {key!r} entry")
    _check_weights(path, obj)
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
               DIGEST_KEY: tensor_digests(weights), **keep, **extra}
    atomic_torch_save(release, out / MODEL_FILE)
    vocabulary_of(obj["vocab"]).save(out / "vocab.txt")
    return out / MODEL_FILE


@dataclass
class LoadedModel:
    model: nn.Module
    vocab: Vocabulary
    config: ModelConfig
    path: Path
    extra: dict


def load_model(
    path: str | os.PathLike, device: str | torch.device = "cpu", default_file: str = MODEL_FILE,
    precision: str = "fp32",
) -> LoadedModel:
    """Rebuild the exact saved model in eval mode, its weights cast to `precision` (fp32, bf16,
    fp16), and `self_check` it in that precision (fp16 overflow shows there); every failure is a
    CheckpointError naming the file."""
    from .device import pick_dtype, settle_attention_backend
    dtype = pick_dtype(precision)
    path, obj = read_checkpoint(path, default_file)
    try:
        cfg = ModelConfig.from_dict(dict(obj["config"]))
        cfg.validate()
        vocab = vocabulary_of(obj["vocab"])
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
    model.to(device=device, dtype=dtype).eval()
    settle_attention_backend(torch.device(device), dtype)
    extra = {k: v for k, v in obj.items() if k not in ("config", "vocab", "model", DIGEST_KEY)}
    loaded = LoadedModel(model=model, vocab=vocab, config=cfg, path=path, extra=extra)
    self_check(loaded)
    return loaded


@torch.no_grad()
def self_check(loaded: LoadedModel) -> None:
    """Score a short fixed sentence (SELF_CHECK_WORDS, OOVs as <unk>, then </s>) and raise
    CheckpointError unless every natural-log probability is finite: finite weights can
    still overflow in the forward, which no check of the file sees."""
    model = loaded.model
    device = next(model.parameters()).device
    tokens = torch.tensor([loaded.vocab.encode(SELF_CHECK_WORDS) + [EOS_ID]], device=device)  # (1, T)
    was_training = model.training
    model.eval()
    try:
        logp, _ = model.score(tokens, model.initial_state(1, device))  # (1, T)
    finally:
        model.train(was_training)
    if not bool(torch.isfinite(logp).all()):
        values = ", ".join(f"{x:.3g}" for x in logp[0].tolist())
        dtype = next(model.parameters()).dtype
        why = ("broken weights?" if dtype == torch.float32 else
               "the weights overflow in fp16? try precision bf16 or fp32" if dtype == torch.float16 else
               "broken weights, or too coarse in bf16? try precision fp32")
        raise CheckpointError(f"{loaded.path}: the model's log-probabilities of {' '.join(SELF_CHECK_WORDS)!r} "
                              f"are not finite ({values}); expected finite scores ({why})")
