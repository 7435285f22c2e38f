"""Knowledge distillation: a student LM (an LSTM, say) trained on a frozen teacher's
next-token distributions as well as on the text (Irie et al. 2020).

Per real token, with temperature tau and weight lam:

    loss = (1 - lam) * CE(label, p_s) + lam * tau^2 * CE(q_tau, p_s,tau)

where p_s is the student's distribution, q the teacher's, and x_tau the distribution
with its logits divided by tau. The tau^2 factor keeps the gradient of the KD term
on the same scale whatever tau (Hinton et al. 2015); at tau = 1 it is 1. The KD term
is a cross-entropy, so it includes the teacher's entropy: its gradient is that of
KL(q || p_s), its value is not.

The teacher distribution q comes in three forms:
- full (default): every vocabulary entry, from the live teacher at each step;
- top-k: the teacher's k most probable tokens per position, renormalised over those
  k (after the temperature); the student side is its full-vocabulary distribution
  read at the k ids. With k = V this is the full form exactly;
- sampled: N tokens per position drawn with replacement from the teacher (at
  temperature 1, the proposal), each weighted by the self-normalised importance
  weight q_tau(x) / q(x), proportional to q(x)^(1/tau - 1): uniform at tau = 1, where
  the term is an unbiased Monte Carlo estimate of the full cross-entropy.

Top-k and sampled targets can be precomputed once for every training position
(`teacher_cache`: ids and teacher log-probs at temperature 1 in float16, so one cache
serves any temperature), so later runs never run the teacher. A cache fixes the
samples of the sampled form for the whole run; without one they are drawn anew at
each step.

The student uses the teacher's vocabulary, so ids align. The training loop is the
trainer's (`train(tc, loss_fn)`); this module supplies the loss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm

from .checkpoint import atomic_torch_save, load_model
from .data import encode_sentences, perplexity, split_long
from .device import pick_device
from .errors import ConfigError
from .evaluate import score_corpus
from .files import atomic_write_text, read_sentences
from .models import MODELS, get_preset
from .state import length_mask, pad_batch
from .train import train
from .train_config import DistillConfig, TrainConfig

CACHE_FORMAT = "smallstate-lm/teacher-cache/1"


# ---- the loss --------------------------------------------------------------------


@dataclass
class TeacherTargets:
    """The teacher's side of the KD term for one batch of (B, T) positions.

    Sparse form: ids (B, T, K) and logq (B, T, K), the teacher's natural-log
    probabilities (temperature 1) of those ids. Full form: ids None and logq (B, T, V).
    Padded positions may hold anything: `distill_loss` masks them.
    """

    mode: str  # "full", "top_k" or "sampled"
    logq: Tensor
    ids: Tensor | None = None


def target_weights(t: TeacherTargets, temperature: float) -> Tensor:
    """The weight of each target id in the KD cross-entropy: (B, T, K or V), summing to
    1 over the last dim. top-k and full: the teacher distribution at `temperature`,
    renormalised over the ids held. sampled: self-normalised importance weights
    q_tau(x) / q(x) of draws from q, i.e. softmax(logq * (1/tau - 1))."""
    logq = t.logq.float()
    scale = (1.0 / temperature - 1.0) if t.mode == "sampled" else 1.0 / temperature
    return torch.softmax(logq * scale, dim=-1)


def distill_loss(student_logp: Tensor, tokens: Tensor, lengths: Tensor, targets: TeacherTargets | None,
                 lam: float, temperature: float) -> tuple[Tensor, int]:
    """(1 - lam) * CE(labels) + lam * temperature^2 * CE(teacher, student at
    temperature), both the mean over real tokens.

    student_logp: (B, T, V) natural-log student distributions (any values at
    padding); tokens: (B, T) the labels; lengths: (B,) real tokens per row. `targets`
    may be None only when lam == 0. Returns (loss, number of real tokens).
    """
    T = student_logp.shape[1]
    n_tok = int(lengths.sum())
    real = length_mask(lengths, T)[:, :, None].float()  # (B, T, 1)
    logp = student_logp.float()
    ids, coef = tokens[:, :, None], (1.0 - lam) * real  # the labels and their weights: (B, T, 1) each
    if lam == 0.0:
        return -(coef * logp.gather(2, ids)).sum() / n_tok, n_tok
    if targets is None:
        raise ValueError("distill_loss needs teacher targets when lam > 0")
    w = target_weights(targets, temperature) * (lam * temperature**2) * real  # (B, T, K or V)
    if targets.ids is not None and temperature == 1.0:
        # Labels and teacher ids read the same distribution: one gather, and one
        # (B, T, V) gradient, for both.
        ids, coef = torch.cat([ids, targets.ids.long()], 2), torch.cat([coef, w], 2)  # (B, T, 1+K)
        return -(coef * logp.gather(2, ids)).sum() / n_tok, n_tok
    soft = torch.log_softmax(logp / temperature, dim=-1) if temperature != 1.0 else logp  # (B, T, V)
    kd = soft if targets.ids is None else soft.gather(2, targets.ids.long())  # (B, T, V or K)
    total = -(coef * logp.gather(2, ids)).sum() - (w * kd).sum()
    return total / n_tok, n_tok


@torch.no_grad()
def teacher_targets(teacher: nn.Module, tokens: Tensor, lengths: Tensor, mode: str, k: int,
                    generator: torch.Generator | None = None) -> TeacherTargets:
    """Run the (frozen, eval-mode) teacher on a padded batch from `<s>` and keep its
    full distribution, its top k, or k draws per position (see the module doc).
    tokens (B, T), lengths (B,)."""
    B = tokens.shape[0]
    logq, _ = teacher.log_probs_all(tokens, teacher.initial_state(B, tokens.device), lengths)  # (B, T, V)
    logq = logq.float()
    if mode == "full":
        return TeacherTargets("full", logq)
    if mode == "top_k":
        vals, ids = logq.topk(min(k, logq.shape[-1]), dim=-1)  # (B, T, K)
        return TeacherTargets("top_k", vals, ids)
    flat = logq.reshape(-1, logq.shape[-1])  # (B*T, V)
    # Padded positions hold log-prob 0 for every id; any draw there is masked later.
    ids = torch.multinomial(flat.exp(), k, replacement=True, generator=generator)  # (B*T, K)
    vals = flat.gather(1, ids)
    return TeacherTargets("sampled", vals.view(*logq.shape[:2], k), ids.view(*logq.shape[:2], k))  # (B, T, K)


def make_loss_fn(dc: DistillConfig, teacher: nn.Module | None, cache: TeacherCache | None, seed: int = 0):
    """The trainer's `loss_fn(model, tokens, lengths, seq_ids) -> (loss, n_tok)`:
    targets from the cache (rows `seq_ids`) or from the live teacher."""
    if dc.lam > 0 and teacher is None and cache is None:
        raise ValueError("distillation with lam > 0 needs a teacher or a cache")
    gen: list[torch.Generator] = []  # made on first use, on the batch's device

    def loss_fn(model: nn.Module, tokens: Tensor, lengths: Tensor, seq_ids: list[int]) -> tuple[Tensor, int]:
        if model.log_probs_all is None:
            raise ConfigError(f"student arch {model.cfg.arch!r} cannot give full distributions (log_probs_all)")
        B = tokens.shape[0]
        student_logp, _ = model.log_probs_all(tokens, model.initial_state(B, tokens.device), lengths)  # (B, T, V)
        targets = None
        if dc.lam > 0:
            if cache is not None:
                targets = cache.lookup(seq_ids, tokens.shape[1], lengths, tokens.device)
            else:
                if dc.mode == "sampled" and not gen:
                    gen.append(torch.Generator(device=tokens.device).manual_seed(seed))
                teacher.to(tokens.device)
                targets = teacher_targets(teacher, tokens, lengths, dc.mode, dc.k, gen[0] if gen else None)
        return distill_loss(student_logp, tokens, lengths, targets, dc.lam, dc.temperature)

    return loss_fn


# ---- the teacher cache -----------------------------------------------------------


@dataclass
class TeacherCache:
    """Top-k or sampled teacher targets for every position of a list of sequences.

    ids (P, K) int16 when the vocabulary allows, else int32; logq (P, K) float16
    teacher log-probs at temperature 1; offsets (n + 1,) int64: sequence i holds
    positions offsets[i] .. offsets[i+1] - 1. `key` records what the cache was made
    from (teacher weights, sequences, mode, k) so a stale cache is refused."""

    mode: str
    ids: Tensor
    logq: Tensor
    offsets: Tensor
    key: dict

    def lookup(self, seq_ids: list[int], T: int, lengths: Tensor, device: torch.device | str) -> TeacherTargets:
        """Targets for a padded batch whose row b is sequence seq_ids[b] (lengths[b]
        real tokens in T columns)."""
        rows = torch.as_tensor(seq_ids, dtype=torch.long)
        start, stop = self.offsets[rows], self.offsets[rows + 1]  # (B,)
        lengths = lengths.cpu()
        if bool(((stop - start) != lengths).any()):
            raise ConfigError("the teacher cache does not match the training batches (sequence lengths differ)")
        pos = start[:, None] + torch.arange(T)[None, :]  # (B, T)
        pos = torch.where(length_mask(lengths, T), pos, 0)  # padding reads position 0, masked later
        ids = self.ids[pos].to(device=device, dtype=torch.long)  # (B, T, K)
        logq = self.logq[pos].to(device=device, dtype=torch.float32)  # (B, T, K)
        return TeacherTargets(self.mode, logq, ids)

    def save(self, path: str | Path) -> None:
        """Atomic: a crash never leaves a half-written cache under `path`."""
        atomic_torch_save({"format": CACHE_FORMAT, "mode": self.mode, "ids": self.ids, "logq": self.logq,
                           "offsets": self.offsets, "key": json.dumps(self.key, sort_keys=True)}, Path(path))

    @classmethod
    def load(cls, path: str | Path) -> TeacherCache:
        path = Path(path)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # any unreadable file: one message naming it
            raise ConfigError(f"{path}: unreadable teacher cache ({type(e).__name__}); delete it to rebuild") from None
        if not isinstance(obj, dict) or obj.get("format") != CACHE_FORMAT:
            raise ConfigError(f"{path}: not a teacher cache (expected format {CACHE_FORMAT!r})")
        return cls(mode=obj["mode"], ids=obj["ids"], logq=obj["logq"], offsets=obj["offsets"],
                   key=json.loads(obj["key"]))


def weights_digest(model: nn.Module) -> str:
    """sha256 of a model's parameters and buffers, in state-dict order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sequences_digest(seqs: list[list[int]]) -> str:
    h = hashlib.sha256()
    h.update(np.asarray([len(s) for s in seqs], dtype=np.int64).tobytes())
    h.update(np.asarray([t for s in seqs for t in s], dtype=np.int64).tobytes())
    return h.hexdigest()


@torch.no_grad()
def build_teacher_cache(teacher: nn.Module, seqs: list[list[int]], mode: str, k: int, batch_tokens: int = 4096,
                        device: torch.device | str = "cpu", seed: int = 0, progress: bool = False) -> TeacherCache:
    """Run the teacher once over `seqs` (each scored from `<s>`, as in training) and
    keep its top k (mode "top_k") or k draws (mode "sampled") at every position."""
    if mode not in ("top_k", "sampled"):
        raise ValueError(f"a cache holds top_k or sampled targets, not {mode!r}")
    vocab_size = teacher.cfg.vocab_size
    k_eff = min(k, vocab_size) if mode == "top_k" else k
    lens = torch.as_tensor([len(s) for s in seqs], dtype=torch.long)
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.long)
    offsets[1:] = lens.cumsum(0)
    P = int(offsets[-1])
    id_dtype = torch.int16 if vocab_size <= torch.iinfo(torch.int16).max + 1 else torch.int32
    ids_all = torch.zeros(P, k_eff, dtype=id_dtype)
    logq_all = torch.zeros(P, k_eff, dtype=torch.float16)
    gen = torch.Generator(device=device).manual_seed(seed) if mode == "sampled" else None
    # Length-sorted batches waste little on padding.
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * len(seqs[i]) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    for idx in tqdm(batches, disable=not progress, desc="teacher cache", unit="batch"):
        tokens, lengths = pad_batch([seqs[i] for i in idx], device)
        t = teacher_targets(teacher, tokens, lengths, mode, k_eff, gen)
        T = tokens.shape[1]
        real = length_mask(lengths, T).cpu()  # (B, T)
        pos = offsets[torch.as_tensor(idx)][:, None] + torch.arange(T)[None, :]  # (B, T)
        ids_all[pos[real]] = t.ids.cpu()[real].to(id_dtype)
        logq_all[pos[real]] = t.logq.cpu()[real].to(torch.float16)
    key = {"teacher": weights_digest(teacher), "sequences": sequences_digest(seqs), "mode": mode, "k": k_eff,
           "vocab_size": vocab_size}
    return TeacherCache(mode=mode, ids=ids_all, logq=logq_all, offsets=offsets, key=key)


@dataclass(frozen=True)
class CacheBuild:
    """How a missing teacher cache is made: token budget of the teacher's batches, device, seed, progress bar."""

    batch_tokens: int
    device: torch.device | str
    seed: int = 0
    progress: bool = False


def get_teacher_cache(path: str | Path, teacher: nn.Module, seqs: list[list[int]], mode: str, k: int,
                      build: CacheBuild) -> TeacherCache:
    """Load the cache at `path` when it was made from this teacher, these sequences,
    mode and k; make (as `build` says) and write it when the file does not exist."""
    path = Path(path)
    if path.exists():
        cache = TeacherCache.load(path)
        want = {"teacher": weights_digest(teacher), "sequences": sequences_digest(seqs), "mode": mode,
                "k": min(k, teacher.cfg.vocab_size) if mode == "top_k" else k, "vocab_size": teacher.cfg.vocab_size}
        for field, what in (("teacher", "teacher model"), ("sequences", "training text (or max_len)"),
                            ("vocab_size", "vocabulary"), ("mode", "target form"), ("k", "number of targets")):
            if cache.key.get(field) != want[field]:
                raise ConfigError(f"{path}: this teacher cache was made for another {what}; delete it or give "
                                  "another --teacher-cache")
        return cache
    cache = build_teacher_cache(teacher, seqs, mode, k, build.batch_tokens, build.device, build.seed, build.progress)
    cache.save(path)
    return cache


# ---- the run ---------------------------------------------------------------------


def distill(tc: TrainConfig, dc: DistillConfig) -> dict:
    """Train a student (`tc.preset` plus `tc.overrides`) on the teacher in `dc`, with
    the teacher's vocabulary; returns the trainer's summary plus the distillation
    settings and the teacher's validation perplexity. Writes `distill.json` (the
    settings) into the run directory."""
    dc.validate()
    device = pick_device(tc.device)
    teacher_lm = load_model(dc.teacher, device)
    teacher = teacher_lm.model
    able = ", ".join(a for a, c in MODELS.items() if c.log_probs_all is not None)
    if teacher.log_probs_all is None:
        raise ConfigError(f"teacher arch {teacher_lm.config.arch!r} cannot give full distributions; "
                          f"distillation needs one of the archs: {able}")
    student_cfg = get_preset(tc.preset).replace(**tc.overrides)
    if MODELS[student_cfg.arch].log_probs_all is None:
        raise ConfigError(f"student preset {tc.preset!r} (arch {student_cfg.arch}) cannot give full distributions; "
                          f"distillation needs one of the archs: {able}")
    teacher.eval().requires_grad_(False)
    vocab = teacher_lm.vocab

    cache = None
    if dc.teacher_cache is not None and dc.lam > 0:
        seqs = split_long(encode_sentences(read_sentences(tc.train, vocab.lowercase), vocab), tc.max_len)
        cache = get_teacher_cache(dc.teacher_cache, teacher, seqs, dc.mode, dc.k,
                                  CacheBuild(dc.cache_batch_tokens, device, tc.seed, tc.progress))
    loss_fn = make_loss_fn(dc, teacher if cache is None else None, cache, tc.seed)

    with tempfile.TemporaryDirectory(prefix="smallstate-distill-") as tmp:
        # The teacher's own vocabulary (from its checkpoint), so the student's ids align.
        vocab_file = Path(tmp) / "vocab.txt"
        vocab.save(vocab_file)
        summary = train(dataclasses.replace(tc, vocab_from=str(vocab_file), lowercase=vocab.lowercase), loss_fn)

    valid_seqs = encode_sentences(read_sentences(tc.valid, vocab.lowercase), vocab)
    t_lp, t_n = score_corpus(teacher, valid_seqs, device=device)
    settings = {"teacher": str(teacher_lm.path), "lambda": dc.lam, "temperature": dc.temperature, "kd": dc.mode,
                "k": None if dc.mode == "full" else dc.k, "teacher_cache": dc.teacher_cache,
                "teacher_valid_ppl": perplexity(t_lp, t_n)}
    atomic_write_text(Path(tc.out) / "distill.json", json.dumps(settings, indent=2) + "\n")
    return {**summary, **settings}
