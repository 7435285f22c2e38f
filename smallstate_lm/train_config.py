"""The settings of `train` and `distill`: plain dataclasses, kept apart from the
trainer so that the command line can build its options from them without importing
torch. A field made with `option(...)` is also a command-line option (cli.py reads
its help, names and type from here); a plain field is a library-only setting."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal

from .errors import ConfigError

DEFAULT_CACHE_K = 64  # top-k used when a cache is asked for without --top-k or --sampled


def option(default: Any = MISSING, *, help: str | None = None, flags: tuple[str, ...] = (), path: bool = False,
           negated: str | None = None, default_factory: Any = MISSING) -> Any:
    """A dataclass field that is a command-line option too.

    `help`: its help text; `flags`: its option names when not `--field-name`; `path`: the
    value names a file (the option takes a path, the field holds it as a string);
    `negated`: the name of the flag offered instead, which sets the field to False
    (`--quiet` for `progress`)."""
    cli = {"help": help, "flags": flags, "path": path, "negated": negated}
    return field(default=default, default_factory=default_factory, metadata={"cli": cli})


PRESETS_HELP = ("Model preset: 8L-3F, 8L-3F-sharedkv, 32L-1F, small, tiny, xl-small, span-small, feedback-small, "
                "allatt-small, conv-small, pconv-small, hconv-small, cgru-small, sa-conv-small, lstm-small, ...")


@dataclass
class TrainConfig:
    train: str = option(help="Training text, one sentence per line.", path=True)
    valid: str = option(help="Validation text for perplexity and early stopping.", path=True)
    out: str = option(help="Run directory to create (or continue with --resume).", flags=("--out", "-o"), path=True)
    preset: str = option("tiny", help=PRESETS_HELP)
    # ModelConfig fields on top of the preset
    overrides: dict = option(default_factory=dict, flags=("--set",), help="Model config override key=value, "
                             "repeatable (e.g. --set shared_kv=true --set dropout=0.2).")
    optimizer: Literal["adamw", "sgd"] = option("adamw", help="adamw (warmup + cosine) or sgd (newbob).")
    lr: float | None = option(None, help="Peak learning rate [default: 2e-3 adamw, 1.0 sgd].")
    weight_decay: float = 0.01
    warmup_steps: int = option(100)
    max_steps: int | None = option(None, help="Total steps (the cosine schedule spans them).")
    # A token budget compares runs with different batch sizes per token.
    max_tokens: int | None = option(None, help="Stop after this many training tokens (the LM's: words, or pieces "
                                    "with --tokenizer, and </s>); the cosine schedule spans them.")
    max_epochs: int = option(20)
    max_minutes: float | None = option(None, help="Stop after this much training time.")
    # cpu time is fairer for comparing models on a machine shared with other work
    clock: Literal["wall", "cpu"] = option("wall", help="What --max-minutes measures: wall clock, or this "
                                           "process's cpu time.")
    stop_after: int | None = option(None, help="Stop at this step, schedule unchanged (resume later).")
    # ~32 sentences: on CPU budgets the number of updates matters more than batch size
    batch_tokens: int = option(512, help="Padded tokens per batch (about 32 sentences; raise it with --lr on GPUs).")
    batch_sentences: int | None = option(None, help="Random batches of this many sentences instead of length "
                                         "buckets of --batch-tokens.")
    max_len: int = option(128, help="Longer sentences are cut into pieces.")
    # the text's lines must be in reading order for the joined sentences to be each other's context
    context_sentences: int = option(1, help="Train (and validate) on windows of up to this many consecutive "
                                    "sentences of the text (at most --max-len tokens), </s> between them, so the "
                                    "LM learns to use what was said before; 1 = sentence by sentence.")
    clip: float = option(1.0, help="Gradient-norm clipping; 0 disables.")
    valid_every: int = option(500)
    valid_at_tokens: list[int] = option(default_factory=list, help="Also validate when training reaches this many "
                                        "tokens; repeatable.")
    # e.g. a dev set, for a convergence curve
    eval_text: str | None = option(None, path=True, help="Also score this text at every validation (logged as "
                                   "eval_ppl in train_log.jsonl; never used to select or stop).")
    patience: int = option(5, help="Validations without improvement before stopping; 0 = never.")
    newbob_factor: float = 0.5
    newbob_threshold: float = 0.01  # relative validation improvement below which SGD halves its lr
    seed: int = option(1)
    tokenizer: str = option("word", help="The LM's tokens: word (each word of the training text; --max-vocab, "
                            "--min-count), or bpe:N / unigram:N (N SentencePiece pieces trained on the training "
                            "text; every word is the sum of its pieces).")
    min_count: int = option(1)
    max_vocab: int | None = option(None)
    lowercase: bool = option(False)
    device: str = option("auto", help="auto, cpu, cuda, cuda:N.")
    resume: bool = option(False, help="Continue the run in --out from its last.pt.")
    init_from: str | None = option(None, path=True, help="Start from this checkpoint's weights, vocabulary and "
                                   "config (a new run with a fresh optimizer and schedule).")
    vocab_from: str | None = option(None, path=True, help="Use this run directory's (or vocab.txt's) vocabulary.")
    # Consecutive max_len-token segments of running text, the model state carried
    # (detached) from one segment to the next; needs a model with bounded history.
    stream: bool = option(False, help="Train on running text: consecutive --max-len segments with the state "
                          "carried across (models with bounded state: xl-small, span-small, ...).")
    precision: Literal["auto", "fp32", "bf16"] = option("auto", help="Matmul precision under autocast: auto (bf16 "
                                                        "on CUDA, fp32 on CPU), fp32, or bf16 (also on CPUs with "
                                                        "bf16 units such as AMX; weights stay fp32).")
    progress: bool = option(True, negated="quiet", help="No progress bar.")


@dataclass
class DistillConfig:
    teacher: str = option(help="The teacher's run directory or checkpoint.", path=True)
    # 0 = plain training, 1 = teacher only
    lam: float = option(0.5, flags=("--lambda",), help="Weight of the teacher term: (1-λ)·CE(labels) + "
                        "λ·T²·CE(teacher).")
    temperature: float = option(1.0, help="Softens both distributions (KD term scaled by T²).")
    top_k: int | None = option(None, help="Teacher's k most probable tokens per position, renormalised "
                               "[default: the full distribution; 64 with --teacher-cache].")
    sampled: int | None = option(None, help="Instead, N tokens sampled from the teacher per position, "
                                 "importance-weighted.")
    teacher_cache: str | None = option(None, path=True, help="File of the teacher's top-k (or sampled) targets: "
                                       "made on the first run, read by later ones.")
    cache_batch_tokens: int = 4096  # padded tokens per teacher forward while making the cache

    def validate(self) -> None:
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"lambda must lie in [0, 1], got {self.lam}")
        if not (self.temperature > 0.0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.sampled is not None:
            raise ConfigError("give either --top-k or --sampled, not both")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top-k must be >= 1, got {self.top_k}")
        if self.sampled is not None and self.sampled < 1:
            raise ConfigError(f"sampled must be >= 1, got {self.sampled}")
        if self.cache_batch_tokens < 1:
            raise ConfigError(f"cache_batch_tokens must be >= 1, got {self.cache_batch_tokens}")

    @property
    def mode(self) -> str:
        """'full', 'top_k' or 'sampled' (a cache without either means top-k 64)."""
        if self.sampled is not None:
            return "sampled"
        if self.top_k is not None or self.teacher_cache is not None:
            return "top_k"
        return "full"

    @property
    def k(self) -> int:
        """Targets per position in the top-k and sampled forms."""
        if self.sampled is not None:
            return self.sampled
        return self.top_k if self.top_k is not None else DEFAULT_CACHE_K
