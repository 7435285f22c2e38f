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
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as tdist
from torch import Tensor, nn
from tqdm import tqdm

from .checkpoint import LAST_FILE, MODEL_FILE, read_checkpoint, save_checkpoint
from .data import (
    BucketBatcher,
    ShuffledBatcher,
    StreamBatcher,
    encode_sentences,
    perplexity,
    split_long,
)
from .device import pick_device
from .errors import ConfigError
from .evaluate import score_corpus
from .files import read_sentences
from .models import ModelConfig, build_model, count_parameters, get_preset
from .state import pad_batch
from .vocab import BOS_ID, EncodeStats, Vocabulary


@dataclass
class TrainConfig:
    train: str
    valid: str
    out: str
    preset: str = "tiny"
    overrides: dict = field(default_factory=dict)  # ModelConfig fields on top of the preset
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float | None = None  # default: 2e-3 for AdamW, 1.0 for SGD
    weight_decay: float = 0.01
    warmup_steps: int = 100
    max_steps: int | None = None
    # Stop after this many training tokens (words + </s>); the cosine schedule then spans
    # the token budget, so runs with different batch sizes are compared per token.
    max_tokens: int | None = None
    max_epochs: int = 20
    max_minutes: float | None = None
    # What max_minutes measures: "wall" clock, or this process's "cpu" time (fairer for
    # comparing models on a machine shared with other work)
    clock: Literal["wall", "cpu"] = "wall"
    stop_after: int | None = None  # stop at this step without changing the schedule (as an interruption would)
    # ~32 sentences: on CPU budgets the number of updates matters more than batch size
    batch_tokens: int = 512
    # Random batches of this many sentences instead of length buckets of batch_tokens
    batch_sentences: int | None = None
    max_len: int = 128
    clip: float = 1.0
    valid_every: int = 500
    # Also validate at the first step that reaches each of these training-token counts
    valid_at_tokens: list[int] = field(default_factory=list)
    # A text scored at every validation and logged as eval_ppl, never used to select or
    # stop (e.g. a dev set, for a convergence curve)
    eval_text: str | None = None
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
    vocab_from: str | None = None  # a run directory or vocab.txt whose vocabulary to use (e.g. a teacher's)
    # Stream mode: consecutive max_len-token segments of running text, the model state
    # carried (detached) from one segment to the next; needs a model with bounded history.
    stream: bool = False
    # Matmul precision under autocast: "auto" = bf16 on CUDA, fp32 on CPU; "bf16" on CPU
    # pays off where the CPU has bf16 matrix units (AMX, AVX512-BF16). Weights stay fp32.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    progress: bool = True


class Distributed:
    """Data-parallel context from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK).

    Every rank builds the same global batch; rank r trains on rows r, r+N, ... of it, and
    its loss is scaled so that DistributedDataParallel's gradient average equals the
    gradient of the global batch's mean token loss: one process at the same global batch
    computes the same update. Rank 0 alone validates, logs and writes checkpoints, and
    broadcasts what the others must agree on (validation perplexity, the clock).
    """

    def __init__(self, device: torch.device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = device
        if self.world > 1:
            if device.type == "cuda":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
            if not tdist.is_initialized():
                tdist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, rows: list) -> list:
        return rows[self.rank :: self.world]

    def broadcast(self, value: float) -> float:
        """Rank 0's value, on every rank."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        tdist.broadcast(t, 0)
        return float(t.item())

    def all_sum(self, value: float) -> float:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t)
        return float(t.item())

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    def close(self) -> None:
        if self.enabled and tdist.is_initialized():
            tdist.destroy_process_group()


class _ScoreLoss(nn.Module):
    """The model's summed token log-prob as a `forward`, which is what
    DistributedDataParallel hooks into to synchronise gradients."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, lengths: Tensor | None, state=None, weights: Tensor | None = None):
        if state is None:
            state = self.model.initial_state(tokens.shape[0], tokens.device)
        logp, new_state = self.model.score(tokens, state, lengths)
        return (logp.sum() if weights is None else (logp * weights).sum()), new_state


class _Schedule:
    """Learning-rate multiplier: linear warmup then cosine to 10% (step-based), or
    time-based cosine when only a time budget is known; newbob scales it for SGD."""

    def __init__(self, tc: TrainConfig, total_steps: int | None):
        self.tc, self.total = tc, total_steps
        self.newbob = 1.0

    def factor(self, step: int, elapsed_min: float, tokens: int = 0) -> float:
        tc = self.tc
        if tc.optimizer == "sgd":
            return self.newbob
        warm = min(1.0, (step + 1) / max(1, tc.warmup_steps))
        if tc.max_tokens:
            progress = tokens / tc.max_tokens
        elif self.total:
            progress = step / self.total
        elif tc.max_minutes:
            progress = elapsed_min / tc.max_minutes
        else:
            progress = 0.0
        return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# (model, tokens (B, T), lengths (B,), indices of the batch's training sequences) ->
# (loss: mean per real token, number of real tokens). Replaces the cross-entropy.
LossFn = Callable[[nn.Module, Tensor, Tensor, list], tuple[Tensor, int]]


def load_vocabulary(path: str | Path) -> Vocabulary:
    """A vocabulary from a run directory (its vocab.txt) or a vocab.txt file."""
    p = Path(path)
    p = p / "vocab.txt" if p.is_dir() else p
    if not p.is_file():
        raise ConfigError(f"{path}: no vocabulary there (expected a run directory with vocab.txt, or a vocab.txt)")
    return Vocabulary.load(p)


def train(tc: TrainConfig, loss_fn: LossFn | None = None) -> dict:
    """Train and return a summary dict (best validation perplexity, steps, paths).

    `loss_fn` replaces the plain cross-entropy (distillation); it sees every batch of
    sentence mode and is not available in stream mode."""
    if tc.optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"optimizer must be 'adamw' or 'sgd', got {tc.optimizer!r}")
    if tc.valid_every < 1:
        raise ConfigError(f"valid_every must be >= 1, got {tc.valid_every}")
    if tc.max_tokens is not None and tc.max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {tc.max_tokens}")
    out = Path(tc.out)
    dist = Distributed(pick_device(tc.device))
    try:
        return _train(tc, loss_fn, out, dist)
    finally:
        dist.close()


def _train(tc: TrainConfig, loss_fn: LossFn | None, out: Path, dist: Distributed) -> dict:
    device = dist.device
    if tc.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"precision must be auto, fp32 or bf16, got {tc.precision!r}")
    if dist.enabled and loss_fn is not None:
        raise ConfigError("distillation runs in one process; start it without torchrun")

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
        vocab = (load_vocabulary(tc.vocab_from) if tc.vocab_from
                 else Vocabulary.build(train_sents, tc.min_count, tc.max_vocab, tc.lowercase))
        cfg = get_preset(tc.preset).replace(**tc.overrides, vocab_size=len(vocab))
    cfg.validate()
    train_seqs = split_long(encode_sentences(train_sents, vocab), tc.max_len)
    valid_stats = EncodeStats()
    valid_seqs = encode_sentences(valid_sents, vocab, valid_stats)
    eval_seqs = (encode_sentences(read_sentences(tc.eval_text, tc.lowercase), vocab)
                 if tc.eval_text and dist.main else None)
    if not tc.batch_sentences and max(len(s) for s in train_seqs) > tc.batch_tokens:
        raise ConfigError(f"batch_tokens ({tc.batch_tokens}) is smaller than max_len ({tc.max_len})")
    if tc.stream and loss_fn is not None:
        raise ConfigError("stream mode cannot be combined with a custom loss (distillation)")
    batcher = (StreamBatcher([[BOS_ID, *s] for s in encode_sentences(train_sents, vocab)], tc.batch_tokens,
                             tc.max_len) if tc.stream
               else ShuffledBatcher(train_seqs, tc.batch_sentences, tc.seed) if tc.batch_sentences
               else BucketBatcher(train_seqs, tc.batch_tokens, tc.seed))

    torch.manual_seed(tc.seed)
    model = build_model(cfg).to(device)
    if tc.stream and getattr(model, "max_history", None) is None:
        raise ConfigError(f"stream mode needs a model whose state is bounded (e.g. xl-small, span-small); "
                          f"{cfg.name} keeps its whole history")
    aux_loss = getattr(model, "aux_loss", None)
    after_step = getattr(model, "after_step", None)
    scorer: nn.Module = _ScoreLoss(model)
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel

        # Some parameters can miss a step's graph: a persistent left padding is read only by the
        # initial state (outside the carried segments of stream mode), and an adaptive-softmax
        # cluster without targets in a rank's rows is skipped.
        sparse = tc.stream or cfg.softmax == "adaptive"
        scorer = DistributedDataParallel(scorer, device_ids=[device.index] if device.type == "cuda" else None,
                                         find_unused_parameters=sparse)
        torch.manual_seed(tc.seed * 1_000_003 + dist.rank)  # different dropout masks on each rank's rows
    lr = tc.lr if tc.lr is not None else (2e-3 if tc.optimizer == "adamw" else 1.0)
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

    step, best, bad_evals, elapsed_before, tokens_total = 0, float("inf"), 0, 0.0, 0
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
        tokens_total = int(prog.get("tokens", 0))
        torch.set_rng_state(resume_obj["rng"])
        if device.type == "cuda" and "cuda_rng" in resume_obj:
            torch.cuda.set_rng_state(resume_obj["cuda_rng"])
    elif dist.main:
        out.mkdir(parents=True, exist_ok=True)
        vocab.save(out / "vocab.txt")
    dist.barrier()  # every rank has passed the "already holds a run" check before rank 0 writes more

    log_f = open(out / "train_log.jsonl", "a", encoding="utf-8") if dist.main else None

    def log(rec: dict):
        if log_f is not None:
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()

    def save_last():
        if not dist.main:
            return
        extra = {
            "optimizer": opt.state_dict(),
            "progress": {"step": step, "best_valid_ppl": best, "bad_evals": bad_evals,
                         "elapsed_seconds": elapsed, "newbob": sched.newbob, "tokens": tokens_total},
            "train_config": {k: v for k, v in asdict(tc).items() if k != "overrides"},
            "rng": torch.get_rng_state(),
        }
        if device.type == "cuda":
            extra["cuda_rng"] = torch.cuda.get_rng_state()
        save_checkpoint(out / LAST_FILE, model, vocab, **extra)

    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    if resume_obj is None:
        log({"event": "start", "params": count_parameters(model), "config": cfg.to_dict(),
             "train_sentences": len(train_sents), "vocab_size": len(vocab), "batches_per_epoch": len(batcher),
             "processes": dist.world})
    if tc.clock not in ("wall", "cpu"):
        raise ConfigError(f"clock must be 'wall' or 'cpu', got {tc.clock!r}")
    now_s = time.process_time if tc.clock == "cpu" else time.perf_counter
    t_start = now_s()
    elapsed = elapsed_before
    # With only a time budget the step count is unknown: the bar then just counts.
    # A token budget is counted in tokens (the step count it takes is unknown beforehand).
    by_tokens = tc.max_tokens is not None
    bar = tqdm(total=tc.max_tokens if by_tokens else None if total_steps is None else max_steps,
               initial=tokens_total if by_tokens else step, unit="tok" if by_tokens else "step",
               unit_scale=by_tokens, disable=not (tc.progress and dist.main), dynamic_ncols=True)
    tok_window, t_window = 0, time.perf_counter()
    stop_reason = "max_steps"
    tokens_seen, step_seconds = 0, 0.0  # this process's training throughput, validation excluded
    carried = None  # stream mode: the state after the previous segment (resume starts afresh)
    model.train()
    while step < max_steps and (tc.max_tokens is None or tokens_total < tc.max_tokens):
        t_step = time.perf_counter()
        f = sched.factor(step, elapsed / 60, tokens_total)
        for g in opt.param_groups:
            g["lr"] = lr * f
        with autocast:
            if tc.stream:
                epoch, seg, tokens = batcher.batch(step)
                # `<s>` separates the sentences of the stream: an input, never a target
                targets = tokens != BOS_ID
                n_tok = int(targets.sum())
                tokens = tokens[dist.rank :: dist.world].to(device)
                targets = targets[dist.rank :: dist.world].to(device)
                if seg == 0 or carried is None:
                    carried = model.initial_state(tokens.shape[0], device)
                lp_sum, carried = scorer(tokens, None, carried, targets.to(torch.float32))
                carried = carried.detach()
                loss = -lp_sum * (dist.world / n_tok)
            elif loss_fn is not None:
                epoch, batch = batcher.batch(step)
                tokens, lengths = pad_batch(batch, device)
                loss, n_tok = loss_fn(model, tokens, lengths, batcher.batch_ids(step))
            else:
                epoch, batch = batcher.batch(step)
                n_tok = sum(len(b) for b in batch)
                mine = dist.shard(batch)
                # A rank without rows still joins the gradient average, with a zero loss.
                weight = dist.world / n_tok if mine else 0.0
                tokens, lengths = pad_batch(mine or batch[:1], device)
                lp_sum, _ = scorer(tokens, lengths)
                loss = -lp_sum * weight
            total = loss + aux_loss() if aux_loss is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        if tc.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip)
        opt.step()
        if after_step is not None:
            after_step()
        step += 1
        tokens_seen += n_tok
        tokens_total += n_tok
        step_seconds += time.perf_counter() - t_step
        elapsed = elapsed_before + now_s() - t_start
        # the global batch's mean token loss, identical on every rank
        loss_v = dist.all_sum(loss.item()) / dist.world if dist.enabled and loss_fn is None else loss.item()
        if not math.isfinite(loss_v):
            raise ConfigError(f"training diverged at step {step} (loss {loss_v}); lower --lr")
        log({"step": step, "epoch": epoch, "loss": loss_v, "lr": lr * f, "tokens": n_tok})
        tok_window += n_tok
        now = time.perf_counter()
        bar.update(n_tok if by_tokens else 1)
        if now - t_window > 1.0:
            bar.set_postfix(loss=f"{loss_v:.3f}", ppl=f"{math.exp(min(loss_v, 50)):.1f}",
                            tok_s=f"{tok_window / (now - t_window):.0f}")
            tok_window, t_window = 0, now

        last_step = step >= max_steps or (tc.max_tokens is not None and tokens_total >= tc.max_tokens)
        timed_out = tc.max_minutes is not None and elapsed >= tc.max_minutes * 60
        if dist.enabled and tc.max_minutes is not None:
            timed_out = dist.broadcast(float(timed_out)) > 0  # rank 0's clock decides for all
        interrupted = tc.stop_after is not None and step >= tc.stop_after
        crossed = any(tokens_total - n_tok < t <= tokens_total for t in tc.valid_at_tokens)
        if step % tc.valid_every == 0 or last_step or timed_out or interrupted or crossed:
            if dist.main:
                lp, n = score_corpus(model, valid_seqs, device=device)
                ppl = perplexity(lp, n)
            ppl = dist.broadcast(ppl if dist.main else 0.0)
            improved = ppl < best
            if tc.optimizer == "sgd" and math.isfinite(best) and (best - ppl) / best < tc.newbob_threshold:
                sched.newbob *= tc.newbob_factor
            if improved:
                best, bad_evals = ppl, 0
                if dist.main:
                    save_checkpoint(out / MODEL_FILE, model, vocab, step=step, valid_ppl=ppl)
            else:
                bad_evals += 1
            rec = {"event": "valid", "step": step, "tokens": tokens_total, "valid_ppl": ppl,
                   "best_valid_ppl": best, "elapsed_seconds": elapsed}
            if eval_seqs is not None:
                lp, n = score_corpus(model, eval_seqs, device=device)
                rec["eval_ppl"] = perplexity(lp, n)
            log(rec)
            if dist.main:
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
    if log_f is not None:
        log_f.close()
    if stop_reason == "max_steps" and tc.max_tokens is not None and tokens_total >= tc.max_tokens:
        stop_reason = "max_tokens"
    return {"out": str(out), "steps": step, "tokens": tokens_total, "best_valid_ppl": best,
            "stop_reason": stop_reason,
            "elapsed_seconds": elapsed, "parameters": count_parameters(model),
            "state_numel_per_position": model.state_numel_per_position(),
            "train_tokens_per_second": tokens_seen / step_seconds if step_seconds else None,
            "valid_oov_rate": valid_stats.oov_rate}


def remove_incomplete_run(out: Path) -> None:
    """After a failure before the first checkpoint, leave no directory that looks like a run."""
    if out.is_dir() and not (out / MODEL_FILE).exists() and not (out / LAST_FILE).exists():
        shutil.rmtree(out, ignore_errors=True)
