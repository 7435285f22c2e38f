"""N-best lists the way ASR toolkits write them, read into `Utterance`s (natural log,
higher is better). NBEST_FORMATS is the one table of formats: name, what it is, how `auto`
recognises it, and its reader. docs/nbest-inputs.md says what each toolkit's scores mean here.

- tsv, jsonl, json: the project's own formats (lists.py);
- espnet: an ESPnet inference output directory, `{n}best_recog/{text,score}`; the score is the
  beam search's total (decoder + CTC + LM + length bonus, all weighted), kept as `am`, graph 0;
- nemo: the candidates file of NeMo's `eval_beamsearch_ngram*.py` (`text<TAB>score`, beam_size
  lines per manifest row) with the manifest for the utterance ids; the score (fused with NeMo's
  n-gram, alpha and beta) is kept as `am`, graph 0;
- kaldi: the text archives of `nbest-to-linear` as steps/rnnlmrescore.sh writes them
  (`archives.N/{words,lmwt.withlm,acwt}`, keys `utt-N`): am = -acoustic cost, graph = -LM cost.

Hypotheses with the same words in one list are merged (`merge_duplicates`), and the number merged
is reported (`ImportReport`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Sequence

from ...errors import ConfigError
from ...files import read_lines
from .lists import (
    TSV_COLUMNS,
    Hypothesis,
    NBestFormatError,
    Utterance,
    read_nbest_json,
    read_nbest_jsonl,
    read_nbest_tsv,
)

MERGE_MODES = ("logsumexp", "max")
# keys of a NeMo manifest row naming the utterance, tried in this order before the audio file's stem
MANIFEST_ID_KEYS = ("utt_id", "utterance_id", "id")
# nbest-to-linear's outputs as steps/rnnlmrescore.sh (and steps/rnnlm/lmrescore_nbest.sh) name them
KALDI_WORDS = ("words_text", "words")  # utils/int2sym.pl's symbols first, else the word ids
KALDI_LM_COSTS = ("lmwt.withlm", "lmwt.nolm")  # the decoder's graph cost; without the old LM as fallback
KALDI_AC_COSTS = "acwt"


@dataclass
class ImportOptions:
    """How to read n-best inputs. `format` is a name of NBEST_FORMATS or "auto" (by content and layout);
    `manifest` (NeMo) gives the utterance ids, `beam_size` (NeMo) the candidates per utterance (else from
    the file name, else lines / manifest rows); `words` is the decoder's words.txt for Kaldi word ids;
    `lm_costs`/`ac_costs` name Kaldi cost archives explicitly; `merge` is how duplicates combine."""

    format: str = "auto"
    manifest: Path | None = None
    beam_size: int | None = None
    words: Path | None = None
    lm_costs: Path | None = None
    ac_costs: Path | None = None
    merge: Literal["logsumexp", "max"] = "logsumexp"

    def __post_init__(self):
        names = ("auto", *FORMATS)
        if self.format not in names:
            raise ConfigError(f"n-best format must be one of {', '.join(names)}; got {self.format!r}")
        if self.merge not in MERGE_MODES:
            raise ConfigError(f"duplicate merging must be one of {', '.join(MERGE_MODES)}; got {self.merge!r}")
        if self.beam_size is not None and self.beam_size < 1:
            raise ConfigError(f"beam size must be >= 1, got {self.beam_size}")


@dataclass
class ImportReport:
    inputs: list[tuple[str, str]] = field(default_factory=list)  # (path, format name)
    utterances: int = 0
    hypotheses: int = 0  # after merging
    merged: int = 0  # hypotheses folded into another one with the same words
    merged_utterances: int = 0
    merge: str = "logsumexp"
    notes: list[str] = field(default_factory=list)  # what the readers found worth saying

    def messages(self) -> list[str]:
        out = list(self.notes)
        if self.merged:
            how = "log-sum-exp of their scores" if self.merge == "logsumexp" else "the best score"
            out.append(f"merged {self.merged} duplicate {'hypothesis' if self.merged == 1 else 'hypotheses'} (same "
                       f"words) in {self.merged_utterances} utterance{'s' if self.merged_utterances > 1 else ''}, "
                       f"keeping {how}")
        return out


@dataclass(frozen=True)
class NBestFormat:
    name: str
    description: str
    detection: str  # how `auto` recognises it
    read: Callable[[Path, ImportOptions, list[str]], list[Utterance]]  # (path, options, notes to append to)


def parse_number(text: str, where: str) -> float:
    """A finite number, plain (`-12.34`) or as Python prints a tensor or array (`tensor(-12.34)`,
    `tensor(-12.34, device='cuda:0')`, `tensor([-12.34])`, `np.float32(-12.34)`)."""
    s = text.strip()
    if s.endswith(")") and "(" in s:
        s = s[s.index("(") + 1 : -1].split(",")[0].strip().strip("[]").strip()
    try:
        x = float(s)
    except ValueError:
        raise NBestFormatError(f"{where}: expected a number, got {text.strip()!r}") from None
    if not math.isfinite(x):
        raise NBestFormatError(f"{where}: expected a finite number, got {text.strip()!r}")
    return x


def _keyed(path: Path, what: str, allow_empty: bool = False) -> dict[str, tuple[int, str]]:
    """`key rest-of-line` lines (Kaldi text archives, ESPnet's text/score): key -> (line number, rest)."""
    out: dict[str, tuple[int, str]] = {}
    for i, line in enumerate(read_lines(path, NBestFormatError, what), start=1):
        key, _, rest = line.strip().partition(" ")
        if not key:
            continue
        if key in out:
            raise NBestFormatError(f"{path}:{i}: key {key!r} already on line {out[key][0]}")
        out[key] = (i, rest.strip())
    if not out and not allow_empty:
        raise NBestFormatError(f"{path}: no entries in the {what}")
    return out


def _natural(p: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


# --- ESPnet ---------------------------------------------------------------------------------------

_BEST_DIR = re.compile(r"^(\d+)best_recog$")


def _best_dirs(root: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), d) for d in root.iterdir() if d.is_dir() and (m := _BEST_DIR.match(d.name))]
    return sorted(found)


def espnet_roots(path: Path) -> list[Path]:
    """The directories holding `{n}best_recog/`: asr_inference.py's --output_dir, a `{n}best_recog`
    directory's parent, or the `output.*` job directories of an asr.sh decode dir (`logdir/output.J`)."""
    if not path.is_dir():
        return []
    if _BEST_DIR.match(path.name):
        return [path.parent]
    if _best_dirs(path):
        return [path]
    for base in (path, path / "logdir"):
        if base.is_dir():
            jobs = sorted((d for d in base.glob("output.*") if d.is_dir() and _best_dirs(d)), key=_natural)
            if jobs:
                return jobs
    return []


def read_espnet(path: Path, opts: ImportOptions, notes: list[str]) -> list[Utterance]:
    roots = espnet_roots(path)
    if not roots:
        raise NBestFormatError(f"{path}: not an ESPnet inference output (expected 1best_recog/text and "
                               "1best_recog/score in it, or in logdir/output.*/)")
    hyps: dict[str, list[Hypothesis]] = {}
    for root in roots:
        for n, d in _best_dirs(root):
            texts = _keyed(d / "text", "ESPnet text file", allow_empty=True)
            scores = _keyed(d / "score", "ESPnet score file", allow_empty=True)
            for utt, (line, _) in scores.items():
                if utt not in texts:
                    raise NBestFormatError(f"{d / 'score'}:{line}: utterance {utt!r} has no line in {d / 'text'}")
            for utt, (line, words) in texts.items():
                if utt not in scores:
                    raise NBestFormatError(f"{d / 'text'}:{line}: utterance {utt!r} has no line in {d / 'score'}")
                s_line, s = scores[utt]
                score = parse_number(s, f"{d / 'score'}:{s_line}")
                hyps.setdefault(utt, []).append(Hypothesis(words=words.split(), am=score, graph=0.0, id=str(n)))
    if not hyps:
        raise NBestFormatError(f"{path}: no hypotheses in the ESPnet output ({{n}}best_recog/text files are empty)")
    return [Utterance(u, h) for u, h in hyps.items()]


# --- NeMo -----------------------------------------------------------------------------------------

def manifest_ids(path: Path) -> list[str]:
    """Utterance ids of a NeMo manifest (JSON lines), in order: an id field (MANIFEST_ID_KEYS) when the
    row has one, else the stem of `audio_filepath`."""
    ids: list[str] = []
    first_line: dict[str, int] = {}
    for i, line in enumerate(read_lines(path, NBestFormatError, "NeMo manifest"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise NBestFormatError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        key = next((k for k in MANIFEST_ID_KEYS if isinstance(row, dict) and k in row), None)
        if key is not None and isinstance(row[key], (str, int)) and str(row[key]).strip():
            utt = str(row[key]).strip()
        elif isinstance(row, dict) and isinstance(row.get("audio_filepath"), str) and row["audio_filepath"]:
            utt = Path(row["audio_filepath"]).stem
        else:
            raise NBestFormatError(f"{path}:{i}: expected an object with 'audio_filepath' (or an id field: "
                                   f"{', '.join(MANIFEST_ID_KEYS)})")
        if utt in first_line:
            raise NBestFormatError(f"{path}:{i}: utterance id {utt!r} already on line {first_line[utt]} (audio "
                                   "files with the same name? add an 'utt_id' field to the manifest)")
        first_line[utt] = i
        ids.append(utt)
    if not ids:
        raise NBestFormatError(f"{path}: no rows in the manifest")
    return ids


# the grid point in the name of NeMo's candidates file: preds_out_width{W}_alpha{a}_beta{b}.tsv (CTC; "size" in
# newer versions), preds_out_{strategy}_bw{W}[_ma.._mg..][_ba{alpha}].tsv (transducer)
_NEMO_BEAM = re.compile(r"(?:width|size|_bw)(\d+)(?=_|\.tsv$|$)")
_NEMO_PARAM = re.compile(r"(alpha|beta|_ba)(-?[\d.]+(?:e-?\d+)?)(?=_|\.tsv$|$)")


def _nemo_beam(path: Path, n_lines: int, n_rows: int, opts: ImportOptions, notes: list[str]) -> int:
    m = _NEMO_BEAM.search(path.name)
    params = {("alpha" if k == "_ba" else k): v for k, v in _NEMO_PARAM.findall(path.name)}
    if m:
        said = "".join(f", {k} {v}" for k, v in params.items())
        notes.append(f"{path.name}: NeMo decoded with beam {m.group(1)}{said} (from the file name); its scores "
                     "include NeMo's LM fusion: see docs/nbest-inputs.md")
    if opts.beam_size is not None:
        beam, source = opts.beam_size, "--beam-size"
    elif m:
        beam, source = int(m.group(1)), "the beam width in the file name"
    else:
        if n_lines % n_rows:
            raise NBestFormatError(f"{path}: {n_lines} candidate lines do not divide evenly among the {n_rows} "
                                   f"rows of {opts.manifest}; give the beam size (--beam-size)")
        return n_lines // n_rows
    if n_lines != beam * n_rows:
        raise NBestFormatError(f"{path}: {n_lines} candidate lines, but {n_rows} manifest rows x beam {beam} "
                               f"({source}) = {beam * n_rows}; NeMo writes fewer candidates when a beam holds "
                               "fewer, and then the lines cannot be split: check the manifest and beam size, "
                               "or write JSON lines with utterance ids (docs/nbest-inputs.md)")
    return beam


def read_nemo(path: Path, opts: ImportOptions, notes: list[str]) -> list[Utterance]:
    if opts.manifest is None:
        raise NBestFormatError(f"{path}: NeMo beam-search candidates carry no utterance ids; give the manifest "
                               "they were decoded from (--manifest manifest.json)")
    ids = manifest_ids(Path(opts.manifest))
    rows = []
    for i, line in enumerate(read_lines(path, NBestFormatError, "NeMo candidates file"), start=1):
        if not line.strip():
            continue
        text, tab, score = line.rpartition("\t")
        if not tab:
            raise NBestFormatError(f"{path}:{i}: expected 'text<TAB>score' (NeMo eval_beamsearch_ngram output)")
        rows.append((text.split(), parse_number(score, f"{path}:{i}: score")))
    if not rows:
        raise NBestFormatError(f"{path}: no candidates in file")
    beam = _nemo_beam(path, len(rows), len(ids), opts, notes)
    scores = [sc for _, sc in rows]
    sign = 1.0
    if min(scores) >= 0 and max(scores) > 0:
        # NeMo's `default` CTC beam search (ctc_decoders) writes -approx_ctc: a cost, lower is better
        sign = -1.0
        notes.append(f"{path}: every score is >= 0, so they are read as costs (NeMo's default CTC beam search "
                     "writes -approx_ctc): am = -score")
    elif min(scores) < 0 < max(scores):
        notes.append(f"{path}: scores have both signs; read as log-probabilities (higher is better)")
    return [Utterance(utt, [Hypothesis(words=w, am=sign * s, graph=0.0, id=str(k + 1))
                            for k, (w, s) in enumerate(rows[j * beam : (j + 1) * beam])])
            for j, utt in enumerate(ids)]


# --- Kaldi nbest-to-linear ------------------------------------------------------------------------

_KALDI_KEY = re.compile(r"^(.+)-(\d+)$")


def _first_existing(d: Path, names: Sequence[str]) -> Path | None:
    return next((d / n for n in names if (d / n).is_file()), None)


def kaldi_archive_sets(path: Path, opts: ImportOptions) -> list[tuple[Path, Path, Path]]:
    """(word archive, LM-cost archive, acoustic-cost archive) for each `archives.N/` of a decode dir, for
    a directory holding the archives, or for the word archive itself; --lm-costs/--ac-costs override."""
    if path.is_dir():
        dirs = sorted((d for d in path.glob("archives.*") if d.is_dir()), key=_natural) or [path]
    else:
        dirs = [path.parent]
    if len(dirs) > 1 and (opts.lm_costs or opts.ac_costs):
        raise NBestFormatError(f"{path}: {len(dirs)} archives.N directories; --lm-costs/--ac-costs name the "
                               "archives of one: give that one's word archive instead")
    sets = []
    for d in dirs:
        words = path if not path.is_dir() else _first_existing(d, KALDI_WORDS)
        lm = Path(opts.lm_costs) if opts.lm_costs else _first_existing(d, KALDI_LM_COSTS)
        ac = Path(opts.ac_costs) if opts.ac_costs else _first_existing(d, (KALDI_AC_COSTS,))
        for got, what, names in ((words, "word archive", " or ".join(KALDI_WORDS)),
                                 (lm, "LM-cost archive (--lm-costs)", " or ".join(KALDI_LM_COSTS)),
                                 (ac, "acoustic-cost archive (--ac-costs)", KALDI_AC_COSTS)):
            if got is None:
                raise NBestFormatError(f"{d}: no {what}: expected {names} (nbest-to-linear's outputs as "
                                       "steps/rnnlmrescore.sh names them)")
        sets.append((words, lm, ac))
    return sets


def _kaldi_archive(path: Path, what: str) -> dict[str, tuple[int, str]]:
    try:
        head = path.open("rb").read(4096)
    except FileNotFoundError:
        raise NBestFormatError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise NBestFormatError(f"{path}: is a directory, expected a {what}") from None
    if b"\0B" in head:
        raise NBestFormatError(f"{path}: a binary Kaldi archive; write it as text (ark,t:{path.name})")
    return _keyed(path, what)


def _kaldi_words(path: Path, entries: dict[str, tuple[int, str]], words: Path | None):
    """key -> words: symbols as they are, or integer ids through the decoder's words.txt."""
    tokens = [t for _, rest in entries.values() for t in rest.split()]
    if not tokens or not all(re.fullmatch(r"\d+", t) for t in tokens):
        return {k: rest.split() for k, (_, rest) in entries.items()}
    if words is None:
        raise NBestFormatError(f"{path}: holds word ids (integers); give the decoder's symbol table: --words "
                               "words.txt")
    from ..lattices.lattice import SymbolTable

    table = SymbolTable.read(words)
    out = {}
    for k, (line, rest) in entries.items():
        bad = next((t for t in rest.split() if not table.has_id(int(t))), None)
        if bad is not None:
            raise NBestFormatError(f"{path}:{line}: word id {bad} is not in {words}")
        out[k] = [table.word(int(t)) for t in rest.split()]
    return out


def _read_kaldi_set(words_p: Path, lm_p: Path, ac_p: Path, opts: ImportOptions) -> list[Utterance]:
    archives = {"words": _kaldi_archive(words_p, "Kaldi word archive"),
                "lm": _kaldi_archive(lm_p, "Kaldi LM-cost archive"),
                "ac": _kaldi_archive(ac_p, "Kaldi acoustic-cost archive")}
    paths = {"words": words_p, "lm": lm_p, "ac": ac_p}
    for name, other in (("lm", "words"), ("ac", "words"), ("words", "lm"), ("words", "ac")):
        extra = next((k for k in archives[name] if k not in archives[other]), None)
        if extra is not None:
            raise NBestFormatError(f"{paths[name]}:{archives[name][extra][0]}: key {extra!r} has no entry in "
                                   f"{paths[other]}")
    words = _kaldi_words(words_p, archives["words"], opts.words)
    by_utt: dict[str, list[tuple[int, Hypothesis]]] = {}
    for key, (line, _) in archives["words"].items():
        m = _KALDI_KEY.match(key)
        if m is None:
            raise NBestFormatError(f"{words_p}:{line}: key {key!r} is not 'utterance-N' (lattice-to-nbest's keys)")
        costs = [parse_number(archives[a][key][1], f"{paths[a]}:{archives[a][key][0]}") for a in ("lm", "ac")]
        hyp = Hypothesis(words=words[key], am=-costs[1], graph=-costs[0], id=m.group(2))
        by_utt.setdefault(m.group(1), []).append((int(m.group(2)), hyp))
    return [Utterance(u, [h for _, h in sorted(hs, key=lambda x: x[0])]) for u, hs in by_utt.items()]


def read_kaldi(path: Path, opts: ImportOptions, notes: list[str]) -> list[Utterance]:
    out = []
    for words_p, lm_p, ac_p in kaldi_archive_sets(path, opts):
        out += _read_kaldi_set(words_p, lm_p, ac_p, opts)
    return out


def _is_kaldi_dir(path: Path) -> bool:
    dirs = [d for d in path.glob("archives.*") if d.is_dir()] or [path]
    return all(_first_existing(d, KALDI_WORDS) and (d / KALDI_AC_COSTS).is_file() for d in dirs)


# --- the table, detection, merging ----------------------------------------------------------------

NBEST_FORMATS = (
    NBestFormat("tsv", "decoder n-best TSV, header " + " ".join(TSV_COLUMNS),
                "a file whose first line starts with 'utt<TAB>rank' (or a .tsv file of no other format)",
                lambda p, o, n: read_nbest_tsv(p)),
    NBestFormat("jsonl", 'JSON Lines: {"utt": ..., "hyps": [{"words" or "text", "am", "graph" or "score"}]}',
                "a file whose first line starts with '{'", lambda p, o, n: read_nbest_jsonl(p)),
    NBestFormat("json", "one JSON list of the jsonl format's utterance objects", "a file that starts with '['",
                lambda p, o, n: read_nbest_json(p)),
    NBestFormat("espnet", "ESPnet inference output: {n}best_recog/text and score (score = beam-search total)",
                "a directory with 1best_recog/ (asr_inference.py --output_dir), or with logdir/output.*/"
                "1best_recog/ (asr.sh), or a 1best_recog directory", read_espnet),
    NBestFormat("nemo", "NeMo eval_beamsearch_ngram candidates 'text<TAB>score', beam_size lines per row of "
                "the manifest (--manifest)", "a file whose first line ends in a tab and a number", read_nemo),
    NBestFormat("kaldi", "Kaldi nbest-to-linear text archives (keys utt-N): words or words_text, lmwt.withlm, "
                "acwt", "a directory with archives.N/ or with acwt and words; a file named words or words_text; "
                "or --lm-costs/--ac-costs given", read_kaldi),
)
FORMATS = {f.name: f for f in NBEST_FORMATS}


def _first_line(path: Path) -> str:
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    return line.rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise NBestFormatError(f"{path}: not UTF-8 text (byte {e.start}); expected an n-best list") from None
    except OSError as e:
        raise NBestFormatError(f"{path}: cannot be read ({e.strerror})") from None
    return ""


def _is_number(text: str) -> bool:
    try:
        parse_number(text, "")
        return True
    except NBestFormatError:
        return False


def detect_format(path: Path, opts: ImportOptions) -> NBestFormat:
    """The format of one input, by its layout (directories) or its first line (files); see NBEST_FORMATS."""
    path = Path(path)
    if path.is_dir():
        if espnet_roots(path):
            return FORMATS["espnet"]
        if _is_kaldi_dir(path):
            return FORMATS["kaldi"]
        raise NBestFormatError(f"{path}: a directory, but neither an ESPnet inference output "
                               "({n}best_recog/text and score) nor Kaldi nbest-to-linear archives "
                               f"(archives.N/ with {' or '.join(KALDI_WORDS)}, {KALDI_LM_COSTS[0]}, {KALDI_AC_COSTS})")
    if not path.exists():
        raise NBestFormatError(f"{path}: file not found")
    if path.name in KALDI_WORDS or opts.lm_costs is not None or opts.ac_costs is not None:
        return FORMATS["kaldi"]
    first = _first_line(path)
    start = first.lstrip()[:1]
    if first.startswith("utt\trank"):
        return FORMATS["tsv"]
    if start in ("[", "{"):
        return FORMATS["json" if start == "[" else "jsonl"]
    if "\t" in first and _is_number(first.rpartition("\t")[2]):
        return FORMATS["nemo"]
    if path.suffix in (".tsv", ".jsonl", ".json"):  # the reader of the name says what is wrong
        return FORMATS[path.suffix[1:]]
    raise NBestFormatError(f"{path}:1: not an n-best format this reads: expected "
                           + "; ".join(f"{f.name} ({f.detection})" for f in NBEST_FORMATS))


def merge_duplicates(utts: Sequence[Utterance], mode: str = "logsumexp") -> tuple[list[Utterance], int, int]:
    """Fold hypotheses of one list that have the same words into one, at the place of the first of them.

    The survivor is the one with the highest first-pass score am + graph (the first of equals) and keeps
    its fields; under "logsumexp" its am grows by log sum_k exp(s_k - s_best) over the group's scores s,
    so that am + graph is the log of the summed probabilities (the word sequence's probability over all
    its paths, as a transducer's or CTC beam search's recombination computes it); under "max" it is
    kept as it is. Returns (utterances, hypotheses removed, utterances that had duplicates)."""
    if mode not in MERGE_MODES:
        raise ConfigError(f"duplicate merging must be one of {', '.join(MERGE_MODES)}; got {mode!r}")
    out, removed, touched = [], 0, 0
    for u in utts:
        groups: dict[tuple[str, ...], list[Hypothesis]] = {}
        for h in u.hyps:
            groups.setdefault(tuple(h.words), []).append(h)
        if len(groups) == len(u.hyps):
            out.append(u)
            continue
        removed += len(u.hyps) - len(groups)
        touched += 1
        hyps = []
        for group in groups.values():
            totals = [h.am + h.graph for h in group]
            best = max(range(len(group)), key=lambda k: (totals[k], -k))
            h = group[best]
            am = h.am
            if mode == "logsumexp" and len(group) > 1:
                am += math.log(sum(math.exp(t - totals[best]) for t in totals))
            hyps.append(Hypothesis(words=list(h.words), am=am, graph=h.graph, id=h.id, scores=dict(h.scores)))
        out.append(Utterance(u.utt, hyps))
    return out, removed, touched


def read_nbest_inputs(paths: Sequence[Path], opts: ImportOptions | None = None,
                      on_note: Callable[[str], None] | None = None) -> tuple[list[Utterance], ImportReport]:
    """Every utterance of every input (files or directories, each in `opts.format` or detected), duplicates
    merged (`merge_duplicates`). An utterance may come from one input only. `on_note` receives each line of
    the report's messages (what was merged, what the readers noticed)."""
    opts = opts or ImportOptions()
    if not paths:
        raise NBestFormatError("no n-best inputs given")
    report = ImportReport(merge=opts.merge)
    utts: list[Utterance] = []
    source: dict[str, Path] = {}
    for p in map(Path, paths):
        fmt = FORMATS[opts.format] if opts.format != "auto" else detect_format(p, opts)
        for u in fmt.read(p, opts, report.notes):
            if u.utt in source:
                where = "twice in it" if source[u.utt] == p else f"also in {source[u.utt]}"
                raise NBestFormatError(f"{p}: utterance {u.utt!r} appears {where}")
            source[u.utt] = p
            utts.append(u)
        report.inputs.append((str(p), fmt.name))
    utts, report.merged, report.merged_utterances = merge_duplicates(utts, opts.merge)
    report.utterances = len(utts)
    report.hypotheses = sum(len(u.hyps) for u in utts)
    for message in report.messages() if on_note is not None else ():
        on_note(message)
    return utts, report
