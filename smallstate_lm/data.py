"""Text reading and sentence-level batching bucketed by length."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import DataError
from .vocab import EOS_ID, EncodeStats, Vocabulary


def encode_sentences(
    sentences: Sequence[Sequence[str]], vocab: Vocabulary, stats: EncodeStats | None = None
) -> list[list[int]]:
    """Each sentence becomes `w1 .. wn </s>` as ids (`<s>` is the LM's initial state)."""
    return [vocab.encode(s, stats) + [EOS_ID] for s in sentences]


def split_long(seqs: list[list[int]], max_len: int) -> list[list[int]]:
    """Cut sequences longer than `max_len` into pieces; each piece is then scored from
    `<s>`, which loses a little context but no text."""
    out: list[list[int]] = []
    for s in seqs:
        out.extend(s[i : i + max_len] for i in range(0, len(s), max_len))
    return out


def join_sentences(seqs: Sequence[Sequence[int]], k: int, max_len: int) -> list[list[int]]:
    """Consecutive encoded sentences (each ending in `</s>`) joined into sequences of up to `k` sentences and
    at most `max_len` tokens (a sentence longer than that stands alone), so an LM trained or scored on them sees
    the previous sentences of its window: `</s>` is the boundary, and the token after it starts the next
    sentence. The windows do not overlap, so a window's first sentence is still read without context."""
    if k < 1:
        raise DataError(f"context sentences must be >= 1, got {k}")
    out: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for s in seqs:
        if cur and (n == k or len(cur) + len(s) > max_len):
            out.append(cur)
            cur, n = [], 0
        cur = cur + list(s)
        n += 1
    if cur:
        out.append(cur)
    return out


class _EpochBatches:
    """What the sentence batchers share: a subclass gives `seqs`, `seed`, `__len__`
    (batches per epoch) and `batch_ids(step)`."""

    def _epoch_permutation(self, n: int, epoch: int) -> list[int]:
        """A random order of range(n) for `epoch`, the same on every call (and resume);
        the last one is kept, as every step of an epoch asks for it."""
        if getattr(self, "_perm_key", None) != (n, epoch):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 1)
            self._perm = torch.randperm(n, generator=gen).tolist()
            self._perm_key = (n, epoch)
        return self._perm

    def batch(self, step: int) -> tuple[int, list[list[int]]]:
        """The batch for global step `step` (0-based): (epoch, sequences)."""
        return step // len(self), [self.seqs[i] for i in self.batch_ids(step)]


@dataclass
class BucketBatcher(_EpochBatches):
    """Batches of sentences of similar length, at most `batch_tokens` padded tokens
    each; the batch order is shuffled per epoch from (seed, epoch), so any step of
    any epoch can be regenerated on resume."""

    seqs: list[list[int]]
    batch_tokens: int
    seed: int = 0

    def __post_init__(self):
        if self.batch_tokens < 1:
            raise DataError(f"batch_tokens must be >= 1, got {self.batch_tokens}")
        gen = torch.Generator().manual_seed(self.seed)
        # Random tie-breaking before the stable sort so equal-length sentences mix.
        order = torch.randperm(len(self.seqs), generator=gen).tolist()
        order.sort(key=lambda i: len(self.seqs[i]))
        self.batches: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            n = len(self.seqs[i])
            if cur and (len(cur) + 1) * max(n, len(self.seqs[cur[-1]])) > self.batch_tokens:
                self.batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            self.batches.append(cur)

    def __len__(self) -> int:
        return len(self.batches)

    def epoch_order(self, epoch: int) -> list[int]:
        return self._epoch_permutation(len(self.batches), epoch)

    def batch_ids(self, step: int) -> list[int]:
        """Indices into `seqs` of the batch for global step `step`, in row order."""
        epoch, k = divmod(step, len(self.batches))
        return self.batches[self.epoch_order(epoch)[k]]


@dataclass
class ShuffledBatcher(_EpochBatches):
    """Batches of `sentences` sentences drawn without replacement from a fresh random
    order each epoch, whatever their lengths (padding to the longest in the batch). Less
    efficient than length buckets, but a batch is a random sample of the text rather than
    of one length class. Same interface as BucketBatcher."""

    seqs: list[list[int]]
    sentences: int
    seed: int = 0

    def __post_init__(self):
        if self.sentences < 1:
            raise DataError(f"batch_sentences must be >= 1, got {self.sentences}")
        self.n_batches = max(1, len(self.seqs) // self.sentences)

    def __len__(self) -> int:
        return self.n_batches

    def batch_ids(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.n_batches)
        return self._epoch_permutation(len(self.seqs), epoch)[k * self.sentences : (k + 1) * self.sentences]


class StreamBatcher:
    """Running text for stream training: every sequence concatenated, cut into
    `n_streams` contiguous streams, each read `seg_len` tokens at a time, so step k's
    row b continues step k-1's row b (the trainer carries the model state across).
    Segment 0 of each epoch starts from a fresh state."""

    def __init__(self, seqs: Sequence[Sequence[int]], batch_tokens: int, seg_len: int):
        if seg_len < 1:
            raise DataError(f"segment length must be >= 1, got {seg_len}")
        flat = torch.as_tensor([t for s in seqs for t in s], dtype=torch.long)
        self.n_streams = max(1, batch_tokens // seg_len)
        self.seg_len = seg_len
        per_stream = len(flat) // self.n_streams
        self.n_segments = per_stream // seg_len
        if self.n_segments < 1:
            raise DataError(f"training text ({len(flat)} tokens) is too short for {self.n_streams} streams "
                            f"of {seg_len}-token segments; lower --batch-tokens or --max-len")
        self.data = flat[: self.n_streams * per_stream].view(self.n_streams, per_stream)  # (B, L)

    def __len__(self) -> int:
        return self.n_segments

    def batch(self, step: int) -> tuple[int, int, Tensor]:
        """-> (epoch, segment index within the epoch, tokens (n_streams, seg_len))."""
        epoch, k = divmod(step, self.n_segments)
        return epoch, k, self.data[:, k * self.seg_len : (k + 1) * self.seg_len]


def eval_batches(seqs: Sequence, batch_tokens: int, key=len) -> Iterator[list]:
    """Length-sorted batches for scoring (order does not matter for sums); `key` gives
    an item's length (e.g. items that are indices into the sequences)."""
    order = sorted(range(len(seqs)), key=lambda i: key(seqs[i]))
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * key(seqs[i]) > batch_tokens:
            yield [seqs[j] for j in cur]
            cur = []
        cur.append(i)
    if cur:
        yield [seqs[j] for j in cur]


def perplexity(logprob_sum: float, tokens: int) -> float:
    return math.exp(-logprob_sum / tokens) if tokens else float("nan")
