"""N-best containers and their readers/writers.

Formats:
- TSV with a header `utt rank total_cost ac_logprob lm_logprob_ln n_words words` (the
  decoder dumps of shared/data: `am` = ac_logprob, `graph` = lm_logprob_ln, natural log);
- JSON Lines: `{"utt": ..., "hyps": [{"words": [...], "am": ..., "graph": ...}]}` (or `"text"` for
  `"words"`, `"score"` for one combined score), or one JSON list of such objects;
- Kaldi-style text `utt w1 w2 ...` for 1-best output and references.

Every reader names the file and line of the first malformed record.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import ScoreError, SmallstateError
from ...files import atomic_write_text, read_lines


class NBestFormatError(SmallstateError):
    """An n-best, 1-best or reference file is malformed."""


@dataclass
class Hypothesis:
    words: list[str]
    am: float = 0.0  # acoustic log-likelihood, natural log (higher is better)
    graph: float = 0.0  # first-pass LM / graph log-prob, natural log
    id: str | None = None
    scores: dict[str, float] = field(default_factory=dict)  # components added by rescoring
    confidences: list[float] | None = None  # per word, in [0, 1] (lattices: posteriors)


@dataclass
class Utterance:
    utt: str
    hyps: list[Hypothesis]
    consensus: Hypothesis | None = None  # a lattice's consensus (MBR) transcript, when that is what was chosen


TSV_COLUMNS = ["utt", "rank", "total_cost", "ac_logprob", "lm_logprob_ln", "n_words", "words"]


def _finite(value: str, path: Path, line: int, column: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise NBestFormatError(f"{path}:{line}: column {column!r} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise NBestFormatError(f"{path}:{line}: column {column!r} must be finite, got {value!r}")
    return x


def _open_text(path: Path) -> list[str]:
    return read_lines(path, NBestFormatError)


def _group(pairs: list[tuple[str, Hypothesis]], path: Path) -> list[Utterance]:
    """Keep file order of utterances; a repeated utterance must be contiguous."""
    out: list[Utterance] = []
    seen: set[str] = set()
    for utt, hyp in pairs:
        if out and out[-1].utt == utt:
            out[-1].hyps.append(hyp)
            continue
        if utt in seen:
            raise NBestFormatError(f"{path}: hypotheses of utterance {utt!r} are not contiguous")
        seen.add(utt)
        out.append(Utterance(utt, [hyp]))
    if not out:
        raise NBestFormatError(f"{path}: no hypotheses in file")
    return out


def read_nbest_tsv(path: str | os.PathLike) -> list[Utterance]:
    path = Path(path)
    lines = _open_text(path)
    if not lines or lines[0].split("\t") != TSV_COLUMNS:
        raise NBestFormatError(f"{path}:1: expected the header {' '.join(TSV_COLUMNS)} (tab-separated)")
    pairs = []
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        cols = line.split("\t")
        if len(cols) != len(TSV_COLUMNS):
            raise NBestFormatError(f"{path}:{i}: expected {len(TSV_COLUMNS)} tab-separated columns, got {len(cols)}")
        words = cols[6].split()
        try:
            n_words = int(cols[5])
        except ValueError:
            raise NBestFormatError(f"{path}:{i}: column 'n_words' must be an integer, got {cols[5]!r}") from None
        if n_words != len(words):
            raise NBestFormatError(f"{path}:{i}: n_words says {n_words} but 'words' holds {len(words)}")
        am = _finite(cols[3], path, i, "ac_logprob")
        graph = _finite(cols[4], path, i, "lm_logprob_ln")
        pairs.append((cols[0], Hypothesis(words=words, am=am, graph=graph, id=cols[1])))
    return _group(pairs, path)


def _number(h: dict, key: str, where: str) -> float:
    v = h.get(key, 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise NBestFormatError(f"{where}.{key}: expected a finite number, got {v!r}")
    return float(v)


def parse_hypothesis(h, where: str) -> Hypothesis:
    """One hypothesis object of the JSON inputs: `words` (a list, or a string split on whitespace) or
    `text` (a string), and the scores `am`, `graph` (natural log, default 0) or `score`: one combined
    first-pass score, kept as `am` with `graph` 0 (a decoder that fused its LM into one number gives no
    separate graph score). `where` names the file, line and field for errors."""
    if not isinstance(h, dict):
        raise NBestFormatError(f"{where}: expected an object")
    if "words" in h and "text" in h:
        raise NBestFormatError(f"{where}: give 'words' or 'text', not both")
    key = "text" if "text" in h else "words"
    words = h.get(key)
    if key == "text" and not isinstance(words, str):
        raise NBestFormatError(f"{where}.text: expected a string, got {words!r}")
    if isinstance(words, str):
        words = words.split()
    if not isinstance(words, list) or not all(isinstance(w, str) and w and not any(c.isspace() for c in w)
                                              for w in words):
        raise NBestFormatError(f"{where}.{key}: expected a list of words without spaces (or 'text': a string)")
    if "score" in h:
        if "am" in h or "graph" in h:
            raise NBestFormatError(f"{where}: give 'score' (one combined score) or 'am'/'graph', not both")
        am, graph = _number(h, "score", where), 0.0
    else:
        am, graph = _number(h, "am", where), _number(h, "graph", where)
    return Hypothesis(words=list(words), am=am, graph=graph, id=str(h["id"]) if "id" in h else None)


def parse_record(rec, where: str) -> Utterance:
    """`{"utt": ..., "hyps": [...]}` (see parse_hypothesis)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("utt"), str) or not rec["utt"]:
        raise NBestFormatError(f"{where}: expected an object with a string 'utt'")
    hyps = rec.get("hyps")
    if not isinstance(hyps, list) or not hyps:
        raise NBestFormatError(f"{where}: 'hyps' must be a non-empty list")
    return Utterance(rec["utt"], [parse_hypothesis(h, f"{where}: hyps[{j}]") for j, h in enumerate(hyps)])


def read_nbest_jsonl(path: str | os.PathLike) -> list[Utterance]:
    """JSON Lines, one utterance object per line (parse_record)."""
    path = Path(path)
    out = []
    for i, line in enumerate(_open_text(path), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise NBestFormatError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        out.append(parse_record(rec, f"{path}:{i}"))
    if not out:
        raise NBestFormatError(f"{path}: no utterances in file")
    return out


_SPACE = re.compile(r"\s*")


def read_nbest_json(path: str | os.PathLike) -> list[Utterance]:
    """One JSON list of utterance objects (parse_record); errors name the line where the object starts."""
    path = Path(path)
    text = "\n".join(_open_text(path))
    decoder = json.JSONDecoder()

    def line_at(i: int) -> int:
        return text.count("\n", 0, i) + 1

    pos = _SPACE.match(text, 0).end()
    if text[pos : pos + 1] != "[":
        raise NBestFormatError(f"{path}:{line_at(pos)}: expected a JSON list of utterance objects")
    pos = _SPACE.match(text, pos + 1).end()
    out: list[Utterance] = []
    while text[pos : pos + 1] != "]" or out:
        start = pos
        try:
            rec, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise NBestFormatError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        out.append(parse_record(rec, f"{path}:{line_at(start)}: [{len(out)}]"))
        pos = _SPACE.match(text, pos).end()
        if text[pos : pos + 1] == "]":
            break
        if text[pos : pos + 1] != ",":
            raise NBestFormatError(f"{path}:{line_at(pos)}: expected ',' or ']' after utterance [{len(out) - 1}]")
        pos = _SPACE.match(text, pos + 1).end()
    if not out:
        raise NBestFormatError(f"{path}: no utterances in the list")
    if text[pos + 1 :].strip():
        raise NBestFormatError(f"{path}:{line_at(pos + 1)}: text after the list's closing ']'")
    return out


def read_nbest(path: str | os.PathLike) -> list[Utterance]:
    """By extension: .jsonl -> JSON Lines, .json -> a JSON list when the file starts with '[' (else JSON
    Lines), anything else -> TSV. `nbest_import.read_nbest_inputs` also reads toolkit layouts."""
    p = Path(path)
    if p.suffix == ".json" and "".join(_open_text(p)).lstrip().startswith("["):
        return read_nbest_json(p)
    return read_nbest_jsonl(p) if p.suffix in (".jsonl", ".json") else read_nbest_tsv(p)


def read_text(path: str | os.PathLike, allow_empty: bool = True) -> dict[str, list[str]]:
    """Kaldi-style `utt w1 w2 ...`; an utterance id alone means an empty transcript."""
    path = Path(path)
    out: dict[str, list[str]] = {}
    for i, line in enumerate(_open_text(path), start=1):
        parts = line.split()
        if not parts:
            continue
        if parts[0] in out:
            raise NBestFormatError(f"{path}:{i}: utterance {parts[0]!r} appears twice")
        if len(parts) == 1 and not allow_empty:
            raise NBestFormatError(f"{path}:{i}: utterance {parts[0]!r} has no words")
        out[parts[0]] = parts[1:]
    if not out:
        raise NBestFormatError(f"{path}: no utterances in file")
    return out


def write_text(path: str | os.PathLike, items: dict[str, list[str]]) -> None:
    atomic_write_text(Path(path), "".join(f"{u} {' '.join(w)}".rstrip() + "\n" for u, w in items.items()))


def write_nbest_jsonl(path: str | os.PathLike, utts: list[Utterance]) -> None:
    """Raises ScoreError, and writes nothing, when a score is NaN or infinite: JSON has no
    such numbers (json.dumps would write a bare NaN that no JSON reader accepts). A hypothesis's word
    confidences are written as `confidences`, an utterance's consensus as `consensus` ({words, confidences})."""
    lines = []
    for u in utts:
        hyps = [{"words": h.words, "am": h.am, "graph": h.graph, **({"id": h.id} if h.id is not None else {}),
                 **h.scores, **({"confidences": h.confidences} if h.confidences is not None else {})}
                for h in u.hyps]
        rec = {"utt": u.utt, "hyps": hyps}
        if u.consensus is not None:
            rec["consensus"] = {"words": u.consensus.words, "confidences": u.consensus.confidences}
        try:
            lines.append(json.dumps(rec, allow_nan=False))
        except ValueError:
            bad = next((f"hypothesis {k}: {key}={v}" for k, h in enumerate(hyps) for key, v in h.items()
                        if isinstance(v, float) and not math.isfinite(v)), "a score")
            raise ScoreError(f"{path}: utterance {u.utt}: {bad} is not a finite number; nothing written "
                             "(expected finite scores: is the LM checkpoint broken?)") from None
    atomic_write_text(Path(path), "\n".join(lines) + "\n")
