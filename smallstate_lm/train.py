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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

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
    join_sentences,
    perplexity,
    split_long,
)
from .device import pick_device
from .errors import ConfigError
from .evaluate import score_corpus
from .files import read_sentences
from .models import ModelConfig, build_model, count_parameters, get_preset
from .state import pad_batch
from .subword import TOKENIZER_FILE, SubwordVocabulary, TokenizerSpec, train_tokenizer, vocabulary_of
from .train_config import TrainConfig
from .vocab import BOS_ID, EncodeStats, Vocabulary


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


def warmup(step: int, warmup_steps: int) -> float:
    """Linear warmup factor of 0-based `step`: 1/warmup_steps at step 0, 1 from step warmup_steps - 1 on."""
    return min(1.0, (step + 1) / max(1, warmup_steps))


class _Schedule:
    """Learning-rate multiplier: linear warmup then cosine to 10% (step-based), or
    time-based cosine when only a time budget is known; for SGD, newbob's factor alone."""

    def __init__(self, tc: TrainConfig, total_steps: int | None):
        self.tc, self.total = tc, total_steps

    def factor(self, step: int, elapsed_min: float, tokens: int = 0, newbob: float = 1.0) -> float:
        tc = self.tc
        if tc.optimizer == "sgd":
            return newbob
        if tc.max_tokens:
            progress = tokens / tc.max_tokens
        elif self.total:
            progress = step / self.total
        elif tc.max_minutes:
            progress = elapsed_min / tc.max_minutes
        else:
            progress = 0.0
        return warmup(step, tc.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# (model, tokens (B, T), lengths (B,), indices of the batch's training sequences) ->
# (loss: mean per real token, number of real tokens). Replaces the cross-entropy.
LossFn = Callable[[nn.Module, Tensor, Tensor, list], tuple[Tensor, int]]


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW whose weight decay applies to matrices only (not to biases, norms and other vectors)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, loss: Tensor, lr: float, clip: float) -> Tensor:
    """One update from `loss` (a scalar whose graph is still there): the model's auxiliary
    loss (if it has one) added, gradients clipped to norm `clip` (0 = no clipping), the
    optimizer stepped at learning rate `lr`, then the model's after-step hook (if any).
    Returns the total minimised."""
    total = loss + model.aux_loss() if model.aux_loss is not None else loss
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    total.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    if model.after_step is not None:
        model.after_step()
    return total


def check_finite(loss: float, step: int) -> float:
    """`loss` (natural log, after `step` updates), or a ConfigError when training has diverged."""
    if not math.isfinite(loss):
        raise ConfigError(f"training diverged at step {step} (loss {loss}); lower --lr")
    return loss


def load_vocabulary(path: str | Path) -> Vocabulary:
    """A vocabulary from a run directory (its tokenizer, else its vocab.txt), a vocab.txt file or a tokenizer
    file."""
    p = Path(path)
    if p.is_dir() and (p / TOKENIZER_FILE).is_file():
        return SubwordVocabulary.load_file(p / TOKENIZER_FILE)
    if p.name == TOKENIZER_FILE and p.is_file():
        return SubwordVocabulary.load_file(p)
    p = p / "vocab.txt" if p.is_dir() else p
    if not p.is_file():
        raise ConfigError(f"{path}: no vocabulary there (expected a run directory with vocab.txt, or a vocab.txt)")
    return Vocabulary.load(p)


@dataclass
class _Progress:
    """How far a run has come: saved in last.pt (these names), taken up by --resume."""

    step: int = 0
    best_valid_ppl: float = math.inf
    bad_evals: int = 0
    elapsed_seconds: float = 0.0  # training time by tc.clock, validation included, resumed runs included
    newbob: float = 1.0
    tokens: int = 0

    @classmethod
    def restore(cls, prog: dict) -> _Progress:
        return cls(int(prog["step"]), float(prog["best_valid_ppl"]), int(prog["bad_evals"]),
                   float(prog["elapsed_seconds"]), float(prog["newbob"]), int(prog.get("tokens", 0)))


class _Bar:
    """The progress bar: in steps, or in tokens under a token budget (the step count it
    takes is unknown beforehand); with only a time budget it just counts. Loss,
    perplexity and tokens/s refresh about once a second."""

    def __init__(self, tc: TrainConfig, progress: _Progress, total_steps: int | None, enabled: bool):
        self.by_tokens = tc.max_tokens is not None
        self.bar = tqdm(total=tc.max_tokens if self.by_tokens else total_steps,
                        initial=progress.tokens if self.by_tokens else progress.step,
                        unit="tok" if self.by_tokens else "step", unit_scale=self.by_tokens, disable=not enabled,
                        dynamic_ncols=True)
        self.tokens, self.t = 0, time.perf_counter()

    def update(self, n_tok: int, loss: float) -> None:
        self.tokens += n_tok
        now = time.perf_counter()
        self.bar.update(n_tok if self.by_tokens else 1)
        if now - self.t > 1.0:
            self.bar.set_postfix(loss=f"{loss:.3f}", ppl=f"{math.exp(min(loss, 50)):.1f}",
                                 tok_s=f"{self.tokens / (now - self.t):.0f}")
            self.tokens, self.t = 0, now

    def write(self, message: str) -> None:
        self.bar.write(message)

    def close(self) -> None:
        self.bar.close()


@dataclass
class _Run:
    """A training run between steps: what `_setup` builds and `_step` / `_validate` advance."""

    tc: TrainConfig
    out: Path
    dist: Distributed
    model: nn.Module
    scorer: nn.Module  # the model's loss as a module (DistributedDataParallel under torchrun)
    opt: torch.optim.Optimizer
    lr: float  # the peak learning rate
    sched: _Schedule
    max_steps: int
    batcher: BucketBatcher | ShuffledBatcher | StreamBatcher
    loss_fn: LossFn | None
    autocast: contextlib.AbstractContextManager
    vocab: Vocabulary
    valid_seqs: list[list[int]]
    eval_seqs: list[list[int]] | None
    valid_oov_rate: float
    progress: _Progress
    clock: Callable[[], float]  # elapsed_seconds now
    bar: _Bar
    log_f: TextIO | None  # rank 0's train_log.jsonl
    tokens_seen: int = 0  # this process's training throughput, validation excluded
    step_seconds: float = 0.0
    carried: object = None  # stream mode: the state after the previous segment (resume starts afresh)

    def log(self, rec: dict) -> None:
        if self.log_f is not None:
            self.log_f.write(json.dumps(rec) + "\n")
            self.log_f.flush()

    def save_last(self) -> None:
        if not self.dist.main:
            return
        extra = {
            "optimizer": self.opt.state_dict(),
            "progress": asdict(self.progress),
            "train_config": {k: v for k, v in asdict(self.tc).items() if k != "overrides"},
            "rng": torch.get_rng_state(),
        }
        if self.dist.device.type == "cuda":
            extra["cuda_rng"] = torch.cuda.get_rng_state()
        save_checkpoint(self.out / LAST_FILE, self.model, self.vocab, **extra)

    def close(self) -> None:
        self.bar.close()
        if self.log_f is not None:
            self.log_f.close()


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
    if tc.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"precision must be auto, fp32 or bf16, got {tc.precision!r}")
    if tc.clock not in ("wall", "cpu"):
        raise ConfigError(f"clock must be 'wall' or 'cpu', got {tc.clock!r}")
    if tc.context_sentences < 1:
        raise ConfigError(f"context_sentences must be >= 1, got {tc.context_sentences}")
    if tc.stream and tc.context_sentences > 1:
        raise ConfigError("stream mode reads running text already; leave out --context-sentences")
    if tc.stream and loss_fn is not None:
        raise ConfigError("stream mode cannot be combined with a custom loss (distillation)")
    dist = Distributed(pick_device(tc.device))
    try:
        run = _setup(tc, loss_fn, Path(tc.out), dist)
        try:
            stop_reason = _loop(run)
        finally:
            run.close()
        return _summary(run, stop_reason)
    finally:
        dist.close()


def _setup(tc: TrainConfig, loss_fn: LossFn | None, out: Path, dist: Distributed) -> _Run:
    """Read and check all input before anything is written; then build the model and
    optimizer, and start the run directory (or take up the one there with --resume)."""
    if dist.enabled and loss_fn is not None:
        raise ConfigError("distillation runs in one process; start it without torchrun")
    resume = None
    if tc.resume:
        _, resume = read_checkpoint(out, LAST_FILE)
    elif (out / MODEL_FILE).exists() or (out / LAST_FILE).exists():
        raise ConfigError(f"{out}: already holds a run; pass --resume to continue it or choose another --out")
    train_sents = read_sentences(tc.train, tc.lowercase)
    valid_sents = read_sentences(tc.valid, tc.lowercase)
    init = read_checkpoint(tc.init_from)[1] if tc.init_from and resume is None else None
    vocab, cfg = _vocab_and_config(tc, train_sents, resume, init)
    batcher = _batcher(tc, train_sents, vocab)
    valid_stats = EncodeStats()
    valid_seqs = _windows(tc, encode_sentences(valid_sents, vocab, valid_stats))
    eval_seqs = (_windows(tc, encode_sentences(read_sentences(tc.eval_text, tc.lowercase), vocab))
                 if tc.eval_text and dist.main else None)

    model, scorer = _model(tc, cfg, dist)
    lr = tc.lr if tc.lr is not None else (2e-3 if tc.optimizer == "adamw" else 1.0)
    opt = adamw(model, lr, tc.weight_decay) if tc.optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=lr)
    progress = _start_from(tc, model, opt, init, resume, dist.device)
    if resume is None and dist.main:
        out.mkdir(parents=True, exist_ok=True)
        vocab.save(out / "vocab.txt")
    dist.barrier()  # every rank has passed the "already holds a run" check before rank 0 writes more

    max_steps = tc.max_steps or tc.max_epochs * len(batcher)
    # With only a time budget the cosine follows the clock (not reproducible across resumes).
    total_steps = None if (tc.max_minutes and not tc.max_steps) else max_steps
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and dist.device.type == "cuda")
    run = _Run(tc=tc, out=out, dist=dist, model=model, scorer=scorer, opt=opt, lr=lr,
               sched=_Schedule(tc, total_steps), max_steps=max_steps, batcher=batcher, loss_fn=loss_fn,
               autocast=torch.autocast(dist.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext(),
               vocab=vocab, valid_seqs=valid_seqs, eval_seqs=eval_seqs, valid_oov_rate=valid_stats.oov_rate,
               progress=progress, clock=_clock(tc, progress.elapsed_seconds),
               bar=_Bar(tc, progress, total_steps, tc.progress and dist.main),
               log_f=open(out / "train_log.jsonl", "a", encoding="utf-8") if dist.main else None)
    if resume is None:
        run.log({"event": "start", "params": count_parameters(model), "config": cfg.to_dict(),
                 "train_sentences": len(train_sents), "vocab_size": len(vocab), "batches_per_epoch": len(batcher),
                 "processes": dist.world})
    return run


def _vocab_and_config(tc: TrainConfig, train_sents: list[list[str]], resume: dict | None,
                      init: dict | None) -> tuple[Vocabulary, ModelConfig]:
    """A resumed or continued run keeps its checkpoint's vocabulary and model config
    (--init-from takes --set on top); a new one builds both."""
    src = resume if resume is not None else init
    if src is not None:
        vocab = vocabulary_of(src["vocab"])
        cfg = ModelConfig.from_dict(dict(src["config"]))
        if init is not None and tc.overrides:
            cfg = cfg.replace(**tc.overrides)
    else:
        vocab = (load_vocabulary(tc.vocab_from) if tc.vocab_from else _new_vocabulary(tc, train_sents))
        cfg = get_preset(tc.preset).replace(**tc.overrides, vocab_size=len(vocab))
    cfg.validate()
    return vocab, cfg


def _new_vocabulary(tc: TrainConfig, train_sents: list[list[str]]) -> Vocabulary:
    """The words of the training text (--max-vocab, --min-count), or a tokenizer trained on it (--tokenizer)."""
    spec = TokenizerSpec.parse(tc.tokenizer)
    if spec.kind == "word":
        return Vocabulary.build(train_sents, tc.min_count, tc.max_vocab, tc.lowercase)
    if tc.max_vocab is not None or tc.min_count != 1:
        raise ConfigError(f"--tokenizer {spec} sets the vocabulary's size ({spec.size} pieces): leave out "
                          f"--max-vocab and --min-count")
    return train_tokenizer(train_sents, spec)


def _windows(tc: TrainConfig, seqs: list[list[int]]) -> list[list[int]]:
    """Sentences as the run reads them: alone, or joined with the ones before them (--context-sentences)."""
    return join_sentences(seqs, tc.context_sentences, tc.max_len) if tc.context_sentences > 1 else seqs


def _batcher(tc: TrainConfig, train_sents: list[list[str]],
             vocab: Vocabulary) -> BucketBatcher | ShuffledBatcher | StreamBatcher:
    train_seqs = split_long(_windows(tc, encode_sentences(train_sents, vocab)), tc.max_len)
    if not tc.batch_sentences and max(len(s) for s in train_seqs) > tc.batch_tokens:
        raise ConfigError(f"batch_tokens ({tc.batch_tokens}) is smaller than max_len ({tc.max_len})")
    if tc.stream:
        return StreamBatcher([[BOS_ID, *s] for s in encode_sentences(train_sents, vocab)], tc.batch_tokens,
                             tc.max_len)
    if tc.batch_sentences:
        return ShuffledBatcher(train_seqs, tc.batch_sentences, tc.seed)
    return BucketBatcher(train_seqs, tc.batch_tokens, tc.seed)


def _model(tc: TrainConfig, cfg: ModelConfig, dist: Distributed) -> tuple[nn.Module, nn.Module]:
    """The model (seeded) and its loss as a module, wrapped for data parallelism under torchrun."""
    torch.manual_seed(tc.seed)
    model = build_model(cfg).to(dist.device)
    if tc.stream and model.max_history is None:
        raise ConfigError(f"stream mode needs a model whose state is bounded (e.g. xl-small, span-small); "
                          f"{cfg.name} keeps its whole history")
    scorer: nn.Module = _ScoreLoss(model)
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel

        # Some parameters can miss a step's graph: a persistent left padding is read only by the
        # initial state (outside the carried segments of stream mode), and an adaptive-softmax
        # cluster without targets in a rank's rows is skipped.
        sparse = tc.stream or cfg.softmax == "adaptive"
        device = dist.device
        scorer = DistributedDataParallel(scorer, device_ids=[device.index] if device.type == "cuda" else None,
                                         find_unused_parameters=sparse)
        torch.manual_seed(tc.seed * 1_000_003 + dist.rank)  # different dropout masks on each rank's rows
    return model, scorer


def _start_from(tc: TrainConfig, model: nn.Module, opt: torch.optim.Optimizer, init: dict | None,
                resume: dict | None, device: torch.device) -> _Progress:
    """Load the weights to start from (--init-from), or everything a resumed run had
    (weights, optimizer, progress, random state); returns the progress so far."""
    if init is not None:
        try:
            model.load_state_dict(init["model"])
        except RuntimeError as e:
            first = str(e).splitlines()[0]
            raise ConfigError(f"{tc.init_from}: weights do not fit the model config ({first})") from None
    if resume is None:
        return _Progress()
    model.load_state_dict(resume["model"])
    opt.load_state_dict(resume["optimizer"])
    torch.set_rng_state(resume["rng"])
    if device.type == "cuda" and "cuda_rng" in resume:
        torch.cuda.set_rng_state(resume["cuda_rng"])
    return _Progress.restore(resume["progress"])


def _clock(tc: TrainConfig, before: float) -> Callable[[], float]:
    """Seconds of training so far by `tc.clock`, `before` of them from earlier runs."""
    now = time.process_time if tc.clock == "cpu" else time.perf_counter
    start = now()
    return lambda: before + now() - start


def _loop(run: _Run) -> str:
    """Train until a budget, early stopping or --stop-after ends the run; returns which."""
    tc, dist, p = run.tc, run.dist, run.progress
    run.model.train()
    while p.step < run.max_steps and (tc.max_tokens is None or p.tokens < tc.max_tokens):
        n_tok = _step(run)
        last_step = p.step >= run.max_steps or (tc.max_tokens is not None and p.tokens >= tc.max_tokens)
        timed_out = tc.max_minutes is not None and p.elapsed_seconds >= tc.max_minutes * 60
        if dist.enabled and tc.max_minutes is not None:
            timed_out = dist.broadcast(float(timed_out)) > 0  # rank 0's clock decides for all
        interrupted = tc.stop_after is not None and p.step >= tc.stop_after
        crossed = any(p.tokens - n_tok < t <= p.tokens for t in tc.valid_at_tokens)
        if p.step % tc.valid_every == 0 or last_step or timed_out or interrupted or crossed:
            _validate(run)
            if tc.patience and p.bad_evals >= tc.patience:
                return "early_stopping"
            if timed_out:
                return "max_minutes"
            if interrupted:
                return "stop_after"
    return "max_tokens" if tc.max_tokens is not None and p.tokens >= tc.max_tokens else "max_steps"


def _step(run: _Run) -> int:
    """One update on the next batch, logged; returns the batch's training tokens (all ranks)."""
    dist, p = run.dist, run.progress
    t_step = time.perf_counter()
    lr = run.lr * run.sched.factor(p.step, p.elapsed_seconds / 60, p.tokens, p.newbob)
    with run.autocast:
        epoch, loss, n_tok = _batch_loss(run)
    train_step(run.model, run.opt, loss, lr, run.tc.clip)
    p.step += 1
    p.tokens += n_tok
    run.tokens_seen += n_tok
    run.step_seconds += time.perf_counter() - t_step
    p.elapsed_seconds = run.clock()
    # the global batch's mean token loss, identical on every rank
    loss_v = dist.all_sum(loss.item()) / dist.world if dist.enabled and run.loss_fn is None else loss.item()
    check_finite(loss_v, p.step)
    run.log({"step": p.step, "epoch": epoch, "loss": loss_v, "lr": lr, "tokens": n_tok})
    run.bar.update(n_tok, loss_v)
    return n_tok


def _batch_loss(run: _Run) -> tuple[int, Tensor, int]:
    """(epoch, loss, tokens of the whole global batch) for the next batch. This rank's
    loss is scaled so that DistributedDataParallel's gradient average is the gradient
    of the global batch's mean token loss."""
    dist, device, step = run.dist, run.dist.device, run.progress.step
    if run.tc.stream:
        epoch, seg, tokens = run.batcher.batch(step)
        # `<s>` separates the sentences of the stream: an input, never a target
        targets = tokens != BOS_ID
        n_tok = int(targets.sum())
        tokens = tokens[dist.rank :: dist.world].to(device)
        targets = targets[dist.rank :: dist.world].to(device)
        if seg == 0 or run.carried is None:
            run.carried = run.model.initial_state(tokens.shape[0], device)
        lp_sum, carried = run.scorer(tokens, None, run.carried, targets.to(torch.float32))
        run.carried = carried.detach()
        return epoch, -lp_sum * (dist.world / n_tok), n_tok
    epoch, batch = run.batcher.batch(step)
    if run.loss_fn is not None:
        tokens, lengths = pad_batch(batch, device)
        loss, n_tok = run.loss_fn(run.model, tokens, lengths, run.batcher.batch_ids(step))
        return epoch, loss, n_tok
    n_tok = sum(len(b) for b in batch)
    mine = dist.shard(batch)
    # A rank without rows still joins the gradient average, with a zero loss.
    weight = dist.world / n_tok if mine else 0.0
    tokens, lengths = pad_batch(mine or batch[:1], device)
    lp_sum, _ = run.scorer(tokens, lengths)
    return epoch, -lp_sum * weight, n_tok


def _validate(run: _Run) -> None:
    """Validation perplexity (rank 0 scores, every rank gets it): keeps the best weights
    in model.pt, counts validations without improvement, lowers SGD's rate (newbob),
    logs (with eval_text's perplexity) and writes last.pt."""
    tc, dist, p, device = run.tc, run.dist, run.progress, run.dist.device
    ppl = 0.0
    if dist.main:
        lp, n = score_corpus(run.model, run.valid_seqs, device=device)
        ppl = perplexity(lp, n)
    ppl = dist.broadcast(ppl)
    best = p.best_valid_ppl
    if tc.optimizer == "sgd" and math.isfinite(best) and (best - ppl) / best < tc.newbob_threshold:
        p.newbob *= tc.newbob_factor
    if ppl < best:
        p.best_valid_ppl, p.bad_evals = ppl, 0
        if dist.main:
            save_checkpoint(run.out / MODEL_FILE, run.model, run.vocab, step=p.step, valid_ppl=ppl)
    else:
        p.bad_evals += 1
    rec = {"event": "valid", "step": p.step, "tokens": p.tokens, "valid_ppl": ppl,
           "best_valid_ppl": p.best_valid_ppl, "elapsed_seconds": p.elapsed_seconds}
    if run.eval_seqs is not None:
        lp, n = score_corpus(run.model, run.eval_seqs, device=device)
        rec["eval_ppl"] = perplexity(lp, n)
    run.log(rec)
    if dist.main:
        run.bar.write(f"step {p.step}: valid ppl {ppl:.2f} (best {p.best_valid_ppl:.2f})")
    run.save_last()


def _summary(run: _Run, stop_reason: str) -> dict:
    p = run.progress
    return {"out": str(run.out), "steps": p.step, "tokens": p.tokens, "best_valid_ppl": p.best_valid_ppl,
            "stop_reason": stop_reason, "elapsed_seconds": p.elapsed_seconds,
            "parameters": count_parameters(run.model),
            "state_numel_per_position": run.model.state_numel_per_position(),
            "train_tokens_per_second": run.tokens_seen / run.step_seconds if run.step_seconds else None,
            "valid_oov_rate": run.valid_oov_rate}


def remove_incomplete_run(out: Path) -> None:
    """After a failure before the first checkpoint, leave no directory that looks like a run."""
    if out.is_dir() and not (out / MODEL_FILE).exists() and not (out / LAST_FILE).exists():
        shutil.rmtree(out, ignore_errors=True)
