"""Algorithmic tasks with a length curriculum (Kaiser & Sutskever 2016; Dowdell & Zhang 2019).

Each example is one token sequence scored by the model after `<s>`:

    input symbols, "=", output symbols, </s>

over a small vocabulary built by the task (the specials keep ids 0..2 as in
`vocab.py`; the task's symbols follow). Training is teacher-forced cross-entropy on
the output symbols and the closing `</s>` only; the input and the separator are
context, not targets. The tasks, for a length n:

- copy:     n digits                  -> the same digits
- reverse:  n digits                  -> the digits in reverse order
- sort:     n digits                  -> the digits in ascending order
- not:      n bits                    -> each bit flipped
- remember: n digits, then n "_"      -> the n digits (recalled across the blank gap of n
            positions: every output symbol is 2n + 1 positions after its source)
- addition: a "+" b, n bits each      -> a + b in n + 1 bits
- multiply: a "*" b, n bits each      -> a * b in 2n bits

Numbers are binary, least-significant bit first, zero-padded to the stated width
(so the output length is fixed by n and carries run left to right, the order the
model reads them in).

Curriculum: training starts at length `start_length` (5). Each training example's
length is uniform in [1, current] with probability `shorter` (1/2) and otherwise the
current length, so short cases are not forgotten. Every `eval_every` steps a fresh
held-out batch at the current length (drawn from a random stream separate from the
training one) is scored with argmax predictions under teacher forcing; only when
every output symbol of every example is right is that length counted as solved and
the length grown by 1 (and the new length evaluated at once, so a model that already
generalises climbs without extra training). When the budget runs out, a larger
held-out set at the current length gives the final accuracy; it counts as one more
check (a perfect score solves that length). A row whose teacher-forced argmax
outputs are all right is exactly the row greedy decoding would produce, so this is
exact-match accuracy of autoregressive decoding.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .errors import ConfigError
from .vocab import EOS_ID, SPECIALS, Vocabulary

SEP = "="
DIGITS = tuple("0123456789")
BITS = ("0", "1")
BLANK = "_"


def _digits(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(DIGITS) for _ in range(n)]


def _bits(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(BITS) for _ in range(n)]


def to_bits(value: int, width: int) -> list[str]:
    """`value` as `width` binary digits, least-significant first (value < 2**width)."""
    if not 0 <= value < 1 << width:
        raise ValueError(f"{value} does not fit in {width} bits")
    return [str((value >> i) & 1) for i in range(width)]


def from_bits(bits: list[str]) -> int:
    """Inverse of `to_bits`: least-significant digit first."""
    return sum(1 << i for i, b in enumerate(bits) if b == "1")


def _copy(rng, n):
    x = _digits(rng, n)
    return x, list(x)


def _reverse(rng, n):
    x = _digits(rng, n)
    return x, x[::-1]


def _sort(rng, n):
    x = _digits(rng, n)
    return x, sorted(x)


def _not(rng, n):
    x = _bits(rng, n)
    return x, ["1" if b == "0" else "0" for b in x]


def _remember(rng, n):
    x = _digits(rng, n)
    return x + [BLANK] * n, list(x)


def _addition(rng, n):
    a, b = _bits(rng, n), _bits(rng, n)
    return a + ["+"] + b, to_bits(from_bits(a) + from_bits(b), n + 1)


def _multiply(rng, n):
    a, b = _bits(rng, n), _bits(rng, n)
    return a + ["*"] + b, to_bits(from_bits(a) * from_bits(b), 2 * n)


@dataclass(frozen=True)
class Task:
    """One task: its symbols (besides the specials and the separator) and a generator
    `make(rng, n) -> (input symbols, output symbols)` for length n >= 1."""

    name: str
    symbols: tuple[str, ...]
    make: Callable[[random.Random, int], tuple[list[str], list[str]]]

    def vocabulary(self) -> Vocabulary:
        """`<s> </s> <unk>`, then the task's symbols, then the separator."""
        return Vocabulary(list(SPECIALS) + list(self.symbols) + [SEP])


TASKS: dict[str, Task] = {
    "copy": Task("copy", DIGITS, _copy),
    "reverse": Task("reverse", DIGITS, _reverse),
    "sort": Task("sort", DIGITS, _sort),
    "not": Task("not", BITS, _not),
    "remember": Task("remember", DIGITS + (BLANK,), _remember),
    "addition": Task("addition", BITS + ("+",), _addition),
    "multiply": Task("multiply", BITS + ("*",), _multiply),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[name]


@dataclass
class TaskBatch:
    """tokens: (B, T) long, right-padded with `</s>`; lengths: (B,) real tokens per row;
    target: (B, T) bool, True at the output symbols and the closing `</s>` (the
    positions the loss and the accuracy are taken over)."""

    tokens: Tensor
    lengths: Tensor
    target: Tensor


def make_batch(task: Task, vocab: Vocabulary, rng: random.Random, sizes: list[int],
               device: torch.device | str = "cpu") -> TaskBatch:
    """One example per entry of `sizes` (each the task length n >= 1 of that row)."""
    rows, starts = [], []
    for n in sizes:
        if n < 1:
            raise ValueError(f"task length must be >= 1, got {n}")
        x, y = task.make(rng, n)
        rows.append(vocab.encode(x + [SEP] + y) + [EOS_ID])
        starts.append(len(x) + 1)
    T = max(len(r) for r in rows)
    tokens = torch.full((len(rows), T), EOS_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    pos = torch.arange(T)[None, :]  # (1, T)
    target = (pos >= torch.tensor(starts)[:, None]) & (pos < lengths[:, None])  # (B, T)
    return TaskBatch(tokens.to(device), lengths.to(device), target.to(device))


def output_loss(model: nn.Module, batch: TaskBatch) -> Tensor:
    """Mean natural-log cross-entropy over the target positions only (teacher forcing:
    the whole sequence is fed, but input and separator predictions are not trained)."""
    B = batch.tokens.shape[0]
    logp, _ = model.score(batch.tokens, model.initial_state(B, batch.tokens.device), batch.lengths)
    return -logp.masked_fill(~batch.target, 0.0).sum() / batch.target.sum()


@torch.no_grad()
def greedy_correct(model: nn.Module, batch: TaskBatch) -> Tensor:
    """(B, T) bool: at each target position, whether the model's argmax next token
    (given the true prefix) is the target; False elsewhere.

    Precondition: every row has the same input length (a batch of one task length),
    so the prefix is run in one `step` call and the outputs one token per call.
    """
    tokens, target = batch.tokens, batch.target
    B, T = tokens.shape
    starts = target.float().argmax(1)  # (B,) first target position of each row
    P = int(starts[0])
    if bool((starts != P).any()) or bool((batch.lengths != batch.lengths[0]).any()):
        raise ValueError("greedy_correct needs a batch whose rows all have the same layout")
    dist, state = model.step(tokens[:, :P], model.initial_state(B, tokens.device))
    preds = [dist.argmax(-1)]
    for t in range(P, T - 1):
        dist, state = model.step(tokens[:, t: t + 1], state)
        preds.append(dist.argmax(-1))
    hit = torch.zeros(B, T, dtype=torch.bool, device=tokens.device)
    hit[:, P:] = torch.stack(preds, 1) == tokens[:, P:]  # (B, T - P)
    return hit & target


def evaluate(model: nn.Module, task: Task, vocab: Vocabulary, rng: random.Random, n: int, n_examples: int,
             device: torch.device | str = "cpu", batch_size: int = 128) -> tuple[float, float]:
    """Exact-match accuracy (every output symbol right) and symbol accuracy of
    `n_examples` fresh examples of length n, teacher-forced argmax, in eval mode."""
    was_training = model.training
    model.eval()
    exact = symbols = n_symbols = 0
    try:
        for i in range(0, n_examples, batch_size):
            batch = make_batch(task, vocab, rng, [n] * min(batch_size, n_examples - i), device)
            hit = greedy_correct(model, batch)
            exact += int((hit | ~batch.target).all(1).sum())
            symbols += int(hit.sum())
            n_symbols += int(batch.target.sum())
    finally:
        model.train(was_training)
    return exact / n_examples, symbols / n_symbols


@dataclass
class Curriculum:
    """The length schedule: a length counts as solved when a held-out batch at it is
    entirely right; the length then grows by 1, up to `max_length`."""

    length: int
    max_length: int
    solved: int = 0  # longest solved length; 0 = none yet
    history: list[dict] = field(default_factory=list)  # {"length", "step", "seconds"} per solved length

    @property
    def finished(self) -> bool:
        return self.solved >= self.max_length

    def record(self, accuracy: float, step: int = 0, seconds: float = 0.0) -> bool:
        """Take the exact-match accuracy of a held-out batch at the current length;
        returns whether that length is now solved (and the length grown)."""
        if accuracy < 1.0:
            return False
        self.solved = self.length
        self.history.append({"length": self.length, "step": step, "seconds": round(seconds, 2)})
        self.length = min(self.length + 1, self.max_length)
        return True


@dataclass
class TaskConfig:
    task: str
    preset: str = "tiny"
    overrides: dict = field(default_factory=dict)  # ModelConfig fields on top of the preset
    minutes: float | None = None  # wall-clock budget, evaluation included
    steps: int | None = None  # training-step budget; with both, whichever ends first
    batch: int = 32
    seed: int = 1
    start_length: int = 5
    max_length: int = 64
    eval_every: int = 50
    shorter: float = 0.5  # share of training examples drawn uniformly from [1, length] instead of at the length
    eval_batch: int = 128  # held-out examples per curriculum check
    final_examples: int = 512  # held-out examples for the accuracy at the final length
    lr: float = 3e-3
    warmup_steps: int = 100
    clip: float = 1.0
    device: str = "cpu"
    progress: bool = True

    def validate(self) -> None:
        get_task(self.task)
        if self.minutes is None and self.steps is None:
            raise ConfigError("give a budget: --minutes M or --steps N")
        if self.minutes is not None and not self.minutes > 0:
            raise ConfigError(f"--minutes must be > 0, got {self.minutes}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        for name in ("batch", "start_length", "eval_every", "eval_batch", "final_examples", "warmup_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_length < self.start_length:
            raise ConfigError(f"--max-length ({self.max_length}) must be >= the start length ({self.start_length})")
        if not 0.0 <= self.shorter <= 1.0:
            raise ConfigError(f"shorter must lie in [0, 1], got {self.shorter}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")


def build_task_model(tc: TaskConfig, task: Task) -> nn.Module:
    """A fresh model of the preset (plus overrides) over the task's vocabulary."""
    from .models import build_model, get_preset

    cfg = get_preset(tc.preset).replace(**{**tc.overrides, "vocab_size": len(task.vocabulary())})
    cfg.validate()
    torch.manual_seed(tc.seed)
    return build_model(cfg)


def run_task(tc: TaskConfig) -> dict:
    """Train a fresh model on one task with the length curriculum until the budget
    runs out or `max_length` is solved; returns the result record (see `format_summary`).

    `solved_length` is the longest length whose held-out batch was entirely right
    (0 when not even `start_length` was); `final_accuracy` is the exact-match
    accuracy of `final_examples` fresh examples at `final_length`, the length being
    trained on when the run stopped (`max_length` when everything was solved). That
    final check counts as a curriculum check: when it is perfect, `final_length` is
    solved too. `evals` lists every check as [step, length, accuracy].
    """
    from .device import pick_device
    from .models import count_parameters

    tc.validate()
    task = get_task(tc.task)
    vocab = task.vocabulary()
    device = pick_device(tc.device)
    model = build_task_model(tc, task).to(device)
    # A separate stream for held-out batches: what decides growth is never trained on
    # (up to chance repeats, which only the shortest lengths of the bit tasks make likely).
    held_out = _HeldOut(model, task, vocab, random.Random(f"held-out/{tc.seed}"), device, tc.eval_batch)
    cur = Curriculum(tc.start_length, tc.max_length)
    step, loss_v, stop_reason = _train_on_curriculum(tc, held_out, cur)
    seconds = time.perf_counter() - held_out.t0
    final_length = cur.length
    final_acc, final_sym = evaluate(model, task, vocab, held_out.rng, final_length, tc.final_examples, device,
                                    tc.eval_batch)
    # The final check is a held-out batch too (a larger one): when it is entirely right,
    # the length counts as solved even if the budget ran out before a scheduled check.
    if not cur.finished:
        held_out.evals.append([step, final_length, round(final_acc, 4)])
        cur.record(final_acc, step, seconds)
    return {
        "task": tc.task, "model": tc.preset, "arch": model.cfg.name,
        "overrides": tc.overrides, "parameters": count_parameters(model),
        "solved_length": cur.solved, "final_length": final_length, "final_accuracy": round(final_acc, 4),
        "final_symbol_accuracy": round(final_sym, 4), "steps": step, "seconds": round(seconds, 2),
        "stop_reason": stop_reason, "final_loss": round(loss_v, 4) if math.isfinite(loss_v) else None,
        "start_length": tc.start_length, "max_length": tc.max_length, "budget_minutes": tc.minutes,
        "budget_steps": tc.steps, "batch": tc.batch, "seed": tc.seed, "lr": tc.lr, "solved_at": cur.history,
        "evals": held_out.evals,
    }


@dataclass
class _HeldOut:
    """The curriculum checks of a run: fresh held-out batches from their own random
    stream, every check listed in `evals` as [step, length, accuracy]."""

    model: nn.Module
    task: Task
    vocab: Vocabulary
    rng: random.Random
    device: torch.device
    batch: int
    t0: float = field(default_factory=time.perf_counter)  # the run's start
    evals: list[list] = field(default_factory=list)

    def grow(self, cur: Curriculum, step: int) -> float:
        """Check the current length, and as long as it is solved the next one (a model that
        already generalises climbs without extra training); returns the last accuracy."""
        acc = 0.0
        while not cur.finished:
            n = cur.length
            acc, _ = evaluate(self.model, self.task, self.vocab, self.rng, n, self.batch, self.device, self.batch)
            self.evals.append([step, n, round(acc, 4)])
            if not cur.record(acc, step, time.perf_counter() - self.t0):
                break
        return acc


def _train_on_curriculum(tc: TaskConfig, held_out: _HeldOut, cur: Curriculum) -> tuple[int, float, str]:
    """The training loop (the trainer's update step, constant rate after warmup) with a
    curriculum check every `eval_every` steps; returns (steps, last loss, why it stopped)."""
    from tqdm import tqdm

    from .train import adamw, check_finite, train_step, warmup

    model, task, vocab, device = held_out.model, held_out.task, held_out.vocab, held_out.device
    opt = adamw(model, tc.lr, weight_decay=0.01)
    rng = random.Random(tc.seed)
    step, loss_v = 0, float("nan")
    bar = tqdm(total=tc.steps, disable=not tc.progress, unit="step", dynamic_ncols=True,
               desc=f"{tc.task} {tc.preset}")
    model.train()
    try:
        while not cur.finished:
            if tc.steps is not None and step >= tc.steps:
                return step, loss_v, "steps"
            if tc.minutes is not None and time.perf_counter() - held_out.t0 >= tc.minutes * 60:
                return step, loss_v, "minutes"
            n = cur.length
            sizes = [rng.randint(1, n) if rng.random() < tc.shorter else n for _ in range(tc.batch)]
            batch = make_batch(task, vocab, rng, sizes, device)
            loss = train_step(model, opt, output_loss(model, batch), tc.lr * warmup(step, tc.warmup_steps), tc.clip)
            step += 1
            loss_v = check_finite(loss.item(), step)
            bar.update(1)
            if step % tc.eval_every == 0:
                acc = held_out.grow(cur, step)
                bar.set_postfix(length=cur.length, solved=cur.solved, loss=f"{loss_v:.3f}", acc=f"{acc:.2f}")
        return step, loss_v, "solved"
    finally:
        bar.close()


def format_summary(r: dict) -> str:
    """A few readable lines for one `run_task` result."""
    if r["solved_length"]:
        reached = f"solved length {r['solved_length']}"
        if r["stop_reason"] == "solved":
            reached += " (the maximum)"
    else:
        reached = f"did not solve the start length {r['start_length']}"
    budget = " / ".join(x for x in (f"{r['budget_minutes']} min" if r["budget_minutes"] else "",
                                     f"{r['budget_steps']} steps" if r["budget_steps"] else "") if x)
    return "\n".join([
        f"task {r['task']}, model {r['model']} ({r['arch']}, {r['parameters']:,} parameters), budget {budget}",
        f"{reached} after {r['steps']} steps in {r['seconds']:.1f} s (stopped: {r['stop_reason']})",
        f"at length {r['final_length']}: {100 * r['final_accuracy']:.1f}% of held-out examples exactly right, "
        f"{100 * r['final_symbol_accuracy']:.1f}% of output symbols",
    ])
