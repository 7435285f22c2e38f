"""Training: sentence-level batches bucketed by length, AdamW with warmup + cosine
decay or SGD with newbob, gradient clipping, periodic validation, atomic
checkpoints, resume and early stopping.

Run directory layout: `model.pt` (best weights so far; what eval/rescoring load),
`last.pt` (everything needed to resume), `vocab.txt`, `train_log.jsonl` (one JSON
record per step and per validation).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from .checkpoint import LAST_FILE, MODEL_FILE, read_checkpoint, save_checkpoint
from .data import BucketBatcher, encode_sentences, pad_batch, perplexity, read_sentences, split_long
from .errors import ConfigError
from .evaluate import score_corpus
from .models import ModelConfig, build_model, count_parameters, get_preset
from .vocab import EncodeStats, Vocabulary


@dataclass
class TrainConfig:
    train: str
    valid: str
    out: str
    preset: str = "tiny"
    overrides: dict = field(default_factory=dict)  # ModelConfig fields on top of the preset
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float | None = None  # default: 1e-3 for AdamW, 1.0 for SGD
    weight_decay: float = 0.01
    warmup_steps: int = 200
    max_steps: int | None = None
    max_epochs: int = 20
    max_minutes: float | None = None
    stop_after: int | None = None  # stop at this step without changing the schedule (as an interruption would)
    batch_tokens: int = 4096
    max_len: int = 128
    clip: float = 1.0
    valid_every: int = 500
    patience: int = 5  # validations without improvement before early stopping; 0 = never
    newbob_factor: float = 0.5
    newbob_threshold: float = 0.01  # relative validation improvement below which SGD halves its lr
    seed: int = 1
    min_count: int = 1
    max_vocab: int | None = None
    lowercase: bool = False
    device: str = "auto"
    resume: bool = False
    init_from: str | None = None  # start from this checkpoint's weights, vocabulary and config (continued training)
    progress: bool = True


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


class _Schedule:
    """Learning-rate multiplier: linear warmup then cosine to 10% (step-based), or
    time-based cosine when only a time budget is known; newbob scales it for SGD."""

    def __init__(self, tc: TrainConfig, total_steps: int | None):
        self.tc, self.total = tc, total_steps
        self.newbob = 1.0

    def factor(self, step: int, elapsed_min: float) -> float:
        tc = self.tc
        if tc.optimizer == "sgd":
            return self.newbob
        warm = min(1.0, (step + 1) / max(1, tc.warmup_steps))
        if self.total:
            progress = step / self.total
        elif tc.max_minutes:
            progress = elapsed_min / tc.max_minutes
        else:
            progress = 0.0
        return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(tc: TrainConfig) -> dict:
    """Train and return a summary dict (best validation perplexity, steps, paths)."""
    if tc.optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"optimizer must be 'adamw' or 'sgd', got {tc.optimizer!r}")
    if tc.valid_every < 1:
        raise ConfigError(f"valid_every must be >= 1, got {tc.valid_every}")
    out = Path(tc.out)
    device = pick_device(tc.device)

    resume_obj = None
    if tc.resume:
        _, resume_obj = read_checkpoint(out, LAST_FILE)
    elif (out / MODEL_FILE).exists() or (out / LAST_FILE).exists():
        raise ConfigError(f"{out}: already holds a run; pass --resume to continue it or choose another --out")

    # Read and check all input before anything is written.
    train_sents = read_sentences(tc.train, tc.lowercase)
    valid_sents = read_sentences(tc.valid, tc.lowercase)
    init_obj = None
    if tc.init_from and resume_obj is None:
        _, init_obj = read_checkpoint(tc.init_from)
    if resume_obj is not None or init_obj is not None:
        src = resume_obj if resume_obj is not None else init_obj
        vocab = Vocabulary.from_dict(src["vocab"])
        cfg = ModelConfig.from_dict(dict(src["config"]))
        if init_obj is not None and tc.overrides:
            cfg = cfg.replace(**tc.overrides)
    else:
        vocab = Vocabulary.build(train_sents, tc.min_count, tc.max_vocab, tc.lowercase)
        cfg = get_preset(tc.preset).replace(**tc.overrides, vocab_size=len(vocab))
    cfg.validate()
    train_seqs = split_long(encode_sentences(train_sents, vocab), tc.max_len)
    valid_stats = EncodeStats()
    valid_seqs = encode_sentences(valid_sents, vocab, valid_stats)
    batcher = BucketBatcher(train_seqs, tc.batch_tokens, tc.seed)
    if max(len(s) for s in train_seqs) > tc.batch_tokens:
        raise ConfigError(f"batch_tokens ({tc.batch_tokens}) is smaller than max_len ({tc.max_len})")

    torch.manual_seed(tc.seed)
    model = build_model(cfg).to(device)
    lr = tc.lr if tc.lr is not None else (1e-3 if tc.optimizer == "adamw" else 1.0)
    if tc.optimizer == "adamw":
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    max_steps = tc.max_steps or tc.max_epochs * len(batcher)
    # With only a time budget the cosine follows the clock (not reproducible across resumes).
    total_steps = None if (tc.max_minutes and not tc.max_steps) else max_steps
    sched = _Schedule(tc, total_steps)

    step, best, bad_evals, elapsed_before = 0, float("inf"), 0, 0.0
    if init_obj is not None:
        try:
            model.load_state_dict(init_obj["model"])
        except RuntimeError as e:
            first = str(e).splitlines()[0]
            raise ConfigError(f"{tc.init_from}: weights do not fit the model config ({first})") from None
    if resume_obj is not None:
        model.load_state_dict(resume_obj["model"])
        opt.load_state_dict(resume_obj["optimizer"])
        prog = resume_obj["progress"]
        step, best, bad_evals = int(prog["step"]), float(prog["best_valid_ppl"]), int(prog["bad_evals"])
        elapsed_before, sched.newbob = float(prog["elapsed_seconds"]), float(prog["newbob"])
        torch.set_rng_state(resume_obj["rng"])
        if device.type == "cuda" and "cuda_rng" in resume_obj:
            torch.cuda.set_rng_state(resume_obj["cuda_rng"])
    else:
        out.mkdir(parents=True, exist_ok=True)
        vocab.save(out / "vocab.txt")

    log_f = open(out / "train_log.jsonl", "a", encoding="utf-8")

    def log(rec: dict):
        log_f.write(json.dumps(rec) + "\n")
        log_f.flush()

    def save_last():
        extra = {
            "optimizer": opt.state_dict(),
            "progress": {"step": step, "best_valid_ppl": best, "bad_evals": bad_evals,
                         "elapsed_seconds": elapsed, "newbob": sched.newbob},
            "train_config": {k: v for k, v in asdict(tc).items() if k != "overrides"},
            "rng": torch.get_rng_state(),
        }
        if device.type == "cuda":
            extra["cuda_rng"] = torch.cuda.get_rng_state()
        save_checkpoint(out / LAST_FILE, model, vocab, **extra)

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    if resume_obj is None:
        log({"event": "start", "params": count_parameters(model), "config": cfg.to_dict(),
             "train_sentences": len(train_sents), "vocab_size": len(vocab), "batches_per_epoch": len(batcher)})
    t_start = time.perf_counter()
    elapsed = elapsed_before
    # With only a time budget the step count is unknown: the bar then just counts.
    bar = tqdm(total=None if total_steps is None else max_steps, initial=step, disable=not tc.progress, unit="step",
               dynamic_ncols=True)
    tok_window, t_window = 0, time.perf_counter()
    stop_reason = "max_steps"
    model.train()
    while step < max_steps:
        epoch, batch = batcher.batch(step)
        tokens, lengths = pad_batch(batch, device)
        f = sched.factor(step, elapsed / 60)
        for g in opt.param_groups:
            g["lr"] = lr * f
        with autocast:
            logp, _ = model.score(tokens, model.initial_state(len(batch), device), lengths)
        n_tok = int(lengths.sum())
        loss = -logp.sum() / n_tok
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if tc.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip)
        opt.step()
        step += 1
        elapsed = elapsed_before + time.perf_counter() - t_start
        loss_v = loss.item()
        if not math.isfinite(loss_v):
            raise ConfigError(f"training diverged at step {step} (loss {loss_v}); lower --lr")
        log({"step": step, "epoch": epoch, "loss": loss_v, "lr": lr * f, "tokens": n_tok})
        tok_window += n_tok
        now = time.perf_counter()
        bar.update(1)
        if now - t_window > 1.0:
            bar.set_postfix(loss=f"{loss_v:.3f}", ppl=f"{math.exp(min(loss_v, 50)):.1f}",
                            tok_s=f"{tok_window / (now - t_window):.0f}")
            tok_window, t_window = 0, now

        last_step = step >= max_steps
        timed_out = tc.max_minutes is not None and elapsed >= tc.max_minutes * 60
        interrupted = tc.stop_after is not None and step >= tc.stop_after
        if step % tc.valid_every == 0 or last_step or timed_out or interrupted:
            lp, n = score_corpus(model, valid_seqs, device=device)
            ppl = perplexity(lp, n)
            improved = ppl < best
            if tc.optimizer == "sgd" and math.isfinite(best) and (best - ppl) / best < tc.newbob_threshold:
                sched.newbob *= tc.newbob_factor
            if improved:
                best, bad_evals = ppl, 0
                save_checkpoint(out / MODEL_FILE, model, vocab, step=step, valid_ppl=ppl)
            else:
                bad_evals += 1
            log({"event": "valid", "step": step, "valid_ppl": ppl, "best_valid_ppl": best,
                 "elapsed_seconds": elapsed})
            bar.write(f"step {step}: valid ppl {ppl:.2f} (best {best:.2f})")
            save_last()
            if tc.patience and bad_evals >= tc.patience:
                stop_reason = "early_stopping"
                break
            if timed_out:
                stop_reason = "max_minutes"
                break
            if interrupted:
                stop_reason = "stop_after"
                break
    bar.close()
    log_f.close()
    return {"out": str(out), "steps": step, "best_valid_ppl": best, "stop_reason": stop_reason,
            "elapsed_seconds": elapsed, "parameters": count_parameters(model),
            "state_numel_per_position": model.state_numel_per_position(),
            "valid_oov_rate": valid_stats.oov_rate}


def remove_incomplete_run(out: Path) -> None:
    """After a failure before the first checkpoint, leave no directory that looks like a run."""
    if out.is_dir() and not (out / MODEL_FILE).exists() and not (out / LAST_FILE).exists():
        shutil.rmtree(out, ignore_errors=True)

