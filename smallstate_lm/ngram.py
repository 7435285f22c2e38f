"""KenLM n-grams: build with lmplz/build_binary, query statefully in natural log.

KenLM reports log10; everything leaving this module is natural log (× ln 10).
Unknown words are scored as KenLM's `<unk>` and counted as OOV, the same convention
as `smallstate-lm eval`: perplexity over words plus one `</s>` per sentence.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
from operator import itemgetter
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import SmallstateError
from .files import read_sentences

LN10 = math.log(10.0)


class NgramError(SmallstateError):
    """lmplz/build_binary failed, or an n-gram file cannot be read."""


def find_tool(name: str) -> str:
    """KenLM binaries: next to this Python first (set-up installs them in .venv/bin), then PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        raise NgramError(f"{name} not found next to {sys.executable} or on PATH; run `make setup` to build it")
    return found


def _run_tool(cmd: list[str], stdin_path: Path | None, stdout_path: Path | None, what: str) -> None:
    with tempfile.TemporaryFile() as err:
        stdin = open(stdin_path, "rb") if stdin_path else subprocess.DEVNULL
        stdout = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL
        try:
            rc = subprocess.run(cmd, stdin=stdin, stdout=stdout, stderr=err).returncode
        finally:
            for f in (stdin, stdout):
                if hasattr(f, "close"):
                    f.close()
        if rc != 0:
            err.seek(0)
            lines = [ln for ln in err.read().decode("utf-8", "replace").splitlines() if ln.strip()]
            # KenLM prints "<source>:<line> in <function> threw <Exception>." then the reason.
            threw = [i for i, ln in enumerate(lines) if " threw " in ln]
            if threw and threw[-1] + 1 < len(lines):
                msg = lines[threw[-1] + 1].split(".  ")[0]
            else:
                msg = lines[-1] if lines else f"exit status {rc}"
            raise NgramError(f"{what} failed: {msg.strip()}")


def build_ngram(text: str | os.PathLike, order: int, arpa: str | os.PathLike, binary: str | os.PathLike | None = None,
                prune: Sequence[int] | None = None, memory: str = "10%") -> dict:
    """Estimate a modified-Kneser-Ney n-gram with lmplz (`--discount_fallback`, so tiny
    corpora work) and optionally convert it with build_binary. Outputs are written
    atomically. Returns a summary dict."""
    text, arpa = Path(text), Path(arpa)
    if order < 1 or order > 9:
        raise NgramError(f"--order must lie in 1..9 (KenLM's compiled maximum), got {order}")
    sentences = read_sentences(text)  # the same missing/empty/no-words errors as training
    words = sum(len(s) for s in sentences)
    if prune:
        prune = list(prune)
        if len(prune) > order or any(p < 0 for p in prune) or prune != sorted(prune):
            raise NgramError(f"--prune takes at most {order} non-decreasing counts, got {prune}")
    arpa.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=arpa.parent, prefix=".lmplz.") as tmp:
        tmp_arpa = Path(tmp) / "lm.arpa"
        cmd = [find_tool("lmplz"), "-o", str(order), "--discount_fallback", "-S", memory, "-T", tmp]
        if prune:
            cmd += ["--prune", *map(str, prune)]
        _run_tool(cmd, text, tmp_arpa, f"lmplz on {text}")
        os.replace(tmp_arpa, arpa)
        if binary is not None:
            binary = Path(binary)
            binary.parent.mkdir(parents=True, exist_ok=True)
            tmp_bin = Path(tmp) / "lm.bin"
            _run_tool([find_tool("build_binary"), str(arpa), str(tmp_bin)], None, None, f"build_binary on {arpa}")
            os.replace(tmp_bin, binary)
    return {"arpa": str(arpa), "binary": str(binary) if binary else None, "order": order,
            "sentences": len(sentences), "words": words}


class NgramLM:
    """A KenLM model with natural-log scores and a stateful per-word interface.

    States are `kenlm.State` values: hashable, so expanded lattice states with the
    same n-gram history can be merged on them.
    """

    def __init__(self, path: str | os.PathLike):
        import kenlm

        self.path = Path(path)
        if not self.path.exists():
            raise NgramError(f"{self.path}: n-gram file not found")
        try:
            self.model = kenlm.Model(str(self.path))
        except Exception as e:  # KenLM raises OSError or RuntimeError with a long C++ message
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise NgramError(f"{self.path}: not a readable ARPA or KenLM binary file ({first[:200]})") from None
        self._kenlm = kenlm
        self.new_state = kenlm.State  # an empty state, for `model.BaseScore` to write into
        self.order = self.model.order

    def __contains__(self, word: str) -> bool:
        return word in self.model

    def initial_state(self):
        s = self._kenlm.State()
        self.model.BeginSentenceWrite(s)
        return s

    def score_word(self, state, word: str):
        """-> (natural-log p(word | state), state after word)."""
        out = self._kenlm.State()
        return self.model.BaseScore(state, word, out) * LN10, out

    def score_eos(self, state) -> float:
        out = self._kenlm.State()
        return self.model.BaseScore(state, "</s>", out) * LN10

    def token_logprobs(self, words: Sequence[str], state=None) -> np.ndarray:
        """(len(words) + 1,) natural-log probabilities of each word and `</s>`, from `<s>` (or from `state`,
        e.g. after a context's words)."""
        if state is not None:
            out = np.empty(len(words) + 1)
            for i, w in enumerate(words):
                out[i], state = self.score_word(state, w)
            out[-1] = self.score_eos(state)
            return out
        sent = " ".join(words)
        return np.fromiter(map(itemgetter(0), self.model.full_scores(sent, bos=True, eos=True)),
                           dtype=np.float64, count=len(words) + 1) * LN10

    def sentence_logprob(self, words: Sequence[str]) -> float:
        return self.model.score(" ".join(words), bos=True, eos=True) * LN10


def evaluate_ngram(path: str | os.PathLike, text: str | os.PathLike) -> dict:
    lm = NgramLM(path)
    total, n, oov, words = 0.0, 0, 0, 0
    for s in read_sentences(text):
        total += lm.sentence_logprob(s)
        n += len(s) + 1
        words += len(s)
        oov += sum(1 for w in s if w not in lm)
    return {"ngram": str(lm.path), "order": lm.order, "text": str(text), "perplexity": math.exp(-total / n),
            "logprob_sum_ln": total, "tokens": n, "words": words, "oov_words": oov,
            "oov_rate": oov / words if words else 0.0}
