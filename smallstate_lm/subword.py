"""Subword vocabularies: the LM's tokens are the pieces a SentencePiece model cuts words into (BPE or unigram, as
icefall's and ESPnet's token LMs), trained on the LM's training text and kept inside every checkpoint.

A word is always cut on its own (SentencePiece never lets a piece cross a space, so a sentence's pieces are its
words' pieces end to end): the pieces of a hypothesis's prefix are a prefix of its pieces, tries over pieces
share what tries over words share, and a word's log-probability is the sum of its pieces'. The ids of `<s>`,
`</s>` and `<unk>` are the word vocabulary's (0, 1, 2), so everything that speaks of them is unchanged."""

from __future__ import annotations

import base64
import io
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

from .errors import ConfigError, VocabularyError
from .files import atomic_write_bytes
from .vocab import BOS_ID, EOS_ID, SPECIALS, UNK_ID, EncodeStats, Vocabulary

TOKENIZER_FILE = "tokenizer.model"  # beside vocab.txt in a run or export directory
_SPEC = re.compile(r"^(bpe|unigram):([1-9][0-9]*)$")
# Pieces of the whole vocabulary size that SentencePiece needs at least besides the three specials
MIN_PIECES = 8


@dataclass(frozen=True)
class TokenizerSpec:
    """`word`, or `bpe:N` / `unigram:N` (a SentencePiece model of N pieces, the three specials included)."""

    kind: str  # "word", "bpe", "unigram"
    size: int = 0

    @classmethod
    def parse(cls, text: str) -> TokenizerSpec:
        if text == "word":
            return cls("word")
        m = _SPEC.match(text)
        if m is None:
            raise ConfigError(f"--tokenizer {text!r}: expected word, bpe:N or unigram:N (N pieces, e.g. bpe:500)")
        size = int(m.group(2))
        if size < len(SPECIALS) + MIN_PIECES:
            raise ConfigError(f"--tokenizer {text!r}: at least {len(SPECIALS) + MIN_PIECES} pieces")
        return cls(m.group(1), size)

    def __str__(self) -> str:
        return self.kind if self.kind == "word" else f"{self.kind}:{self.size}"


def train_tokenizer(sentences: Sequence[Sequence[str]], spec: TokenizerSpec) -> SubwordVocabulary:
    """A SentencePiece model of `spec` trained on `sentences` (words as written: no normalisation, so a word is
    cut exactly as the decoder wrote it), as the LM's vocabulary. Deterministic: every sentence is read (none
    sampled), in order."""
    import sentencepiece as spm

    if spec.kind == "word":
        raise ValueError("a word vocabulary is not trained here (Vocabulary.build)")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=(" ".join(s) for s in sentences if s), model_writer=model, model_type=spec.kind,
            vocab_size=spec.size, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID, pad_id=-1,
            bos_piece=SPECIALS[BOS_ID], eos_piece=SPECIALS[EOS_ID], unk_piece=SPECIALS[UNK_ID],
            character_coverage=1.0, normalization_rule_name="identity", num_threads=1,
            hard_vocab_limit=True, minloglevel=2)
    except RuntimeError as e:  # e.g. more pieces asked for than the text has
        raise ConfigError(f"--tokenizer {spec}: SentencePiece could not train on this text: "
                          f"{str(e).strip().splitlines()[-1]}") from None
    return SubwordVocabulary(model.getvalue(), str(spec))


class PieceVocabulary(Vocabulary):
    """The Vocabulary interface over a tokenizer's pieces: `encode(words)` gives each word's pieces end to end (so
    more ids than words; `token_counts` says how many per word), each word cut once (`_cut`, the subclass's) and
    cached. A word is out of vocabulary when a piece of it is `unk_piece` (None: every word can be cut)."""

    subword = True
    unk_piece: int | None = UNK_ID

    def _cut(self, word: str) -> tuple[int, ...]:
        raise NotImplementedError

    def pieces(self, word: str) -> tuple[int, ...]:
        """The ids of `word`'s pieces; `</s>` (a sentence's end inside a context) is the end token itself."""
        p = self._pieces.get(word)
        if p is None:
            p = self._pieces[word] = (EOS_ID,) if word == SPECIALS[EOS_ID] else self._cut(word)
        return p

    def __contains__(self, word: str) -> bool:
        return self.unk_piece is None or self.unk_piece not in self.pieces(word)

    def normalise(self, word: str) -> str:
        return word

    def encode(self, words: Sequence[str], stats: EncodeStats | None = None) -> list[int]:
        cut = [self.pieces(w) for w in words]
        if stats is not None:
            stats.words += len(cut)
            stats.oov += 0 if self.unk_piece is None else sum(self.unk_piece in p for p in cut)
        return list(chain.from_iterable(cut))

    def ids(self, words: Iterable[str]) -> Iterator[int]:
        return chain.from_iterable(map(self.pieces, words))

    def token_counts(self, words: Sequence[str]) -> list[int]:
        return [len(self.pieces(w)) for w in words]

    def lengths(self, sentences: Iterable[Sequence[str]]) -> list[int]:
        return [sum(map(len, map(self.pieces, s))) for s in sentences]


class SubwordVocabulary(PieceVocabulary):
    """A vocabulary whose tokens are SentencePiece pieces. A word is out of vocabulary when a piece of it is
    `<unk>` (a character the model never saw)."""

    def __init__(self, model: bytes, spec: str):
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(model)
        except (RuntimeError, TypeError) as e:
            raise VocabularyError(f"not a SentencePiece model: {e}") from None
        if (sp.bos_id(), sp.eos_id(), sp.unk_id()) != (BOS_ID, EOS_ID, UNK_ID):
            raise VocabularyError(f"the SentencePiece model must have <s>, </s>, <unk> at ids {BOS_ID}, {EOS_ID}, "
                                  f"{UNK_ID}; it has {sp.bos_id()}, {sp.eos_id()}, {sp.unk_id()}")
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        super().__init__(list(SPECIALS) + pieces[len(SPECIALS):])
        # the spec it was trained with (a tokenizer file read on its own says only its size)
        self.model, self.spec, self._sp = bytes(model), spec or f"sentencepiece:{len(pieces)}", sp
        self._pieces: dict[str, tuple[int, ...]] = {}  # a word's pieces, cut once

    def _cut(self, word: str) -> tuple[int, ...]:
        return tuple(self._sp.encode(word))

    # ---- persistence --------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"words": list(self.words), "lowercase": False,
                "tokenizer": {"kind": "sentencepiece", "spec": self.spec,
                              "model": base64.b64encode(self.model).decode("ascii")}}

    @classmethod
    def from_record(cls, d: dict) -> SubwordVocabulary:
        t = d["tokenizer"]
        if not isinstance(t, dict) or t.get("kind") != "sentencepiece":
            raise VocabularyError(f"unknown tokenizer record {str(t)[:80]!r} (expected kind sentencepiece)")
        try:
            vocab = cls(base64.b64decode(t["model"], validate=True), str(t.get("spec", "")))
        except (KeyError, ValueError) as e:
            raise VocabularyError(f"malformed tokenizer record: {e}") from None
        if list(d.get("words", vocab.words)) != vocab.words:
            raise VocabularyError("the vocabulary's pieces are not its tokenizer's")
        return vocab

    def save(self, path: str | os.PathLike) -> None:
        """vocab.txt (the pieces, for reading) and the tokenizer itself beside it (TOKENIZER_FILE)."""
        super().save(path)
        atomic_write_bytes(Path(path).with_name(TOKENIZER_FILE), self.model)

    @classmethod
    def load_file(cls, path: str | os.PathLike) -> SubwordVocabulary:
        """The vocabulary of a tokenizer file (TOKENIZER_FILE of a run or export directory)."""
        path = Path(path)
        try:
            model = path.read_bytes()
        except OSError as e:
            raise VocabularyError(f"{path}: cannot read the tokenizer: {e.strerror}") from None
        try:
            return cls(model, spec="")
        except VocabularyError as e:
            raise VocabularyError(f"{path}: {e}") from None


def vocabulary_of(record: dict) -> Vocabulary:
    """The vocabulary of a checkpoint's record: a subword one when the record holds a tokenizer (records written
    before tokenizers existed hold none, and are word vocabularies)."""
    if isinstance(record, dict) and "tokenizer" in record:
        return SubwordVocabulary.from_record(record)
    return Vocabulary.from_dict(record)


class WordTable:
    """The words of lattices as the expansion's neural LM tokens when the LM scores pieces: each distinct word an
    index into a table of its pieces (index `</s>` is `</s>` itself), so that an arc's step feeds its word's
    pieces to the LM in one forward, and the arc's log-probability is theirs summed."""

    def __init__(self, vocab: SubwordVocabulary):
        self.vocab = vocab
        self.pieces: list[tuple[int, ...]] = [(), (EOS_ID,), (UNK_ID,)]  # indices 0 (no word), </s>, <unk>
        self._index: dict[str, int] = {}

    def index(self, word: str) -> int:
        i = self._index.get(word)
        if i is None:
            i = self._index[word] = len(self.pieces)
            self.pieces.append(self.vocab.pieces(word))
        return i

    def rows(self, tokens: Sequence[int]) -> tuple[list[list[int]], list[int]]:
        """The pieces of the words at `tokens` (table indices), padded to the longest with `</s>`, and their
        counts."""
        cut = [self.pieces[t] for t in tokens]
        width = max(map(len, cut), default=0)
        return [list(p) + [EOS_ID] * (width - len(p)) for p in cut], [len(p) for p in cut]
