"""The PocketSphinx example (examples/pocketsphinx): WAV -> PocketSphinx lattices -> `smallstate-lm rescore`.

The expansion of PocketSphinx's word graph is checked on a small hand-made graph; the whole pipeline runs on
two sentences synthesised at test time (skipped without espeak-ng/Festival or the pocketsphinx package).
"""

import dataclasses
import importlib.util
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA, REPO, run_cli

from smallstate_lm.rescoring.formats.lattice_io import lattice_to_text, read_fst, read_slf, read_slf_text
from smallstate_lm.rescoring.lattices.lattice import Lattice, SymbolTable
from smallstate_lm.weights import check_overlap

EXAMPLE = REPO / "examples" / "pocketsphinx"
sys.path.insert(0, str(EXAMPLE))  # decode.py imports its neighbour audio16k.py
_spec = importlib.util.spec_from_file_location("pocketsphinx_example_decode", EXAMPLE / "decode.py")
decode = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look themselves up there
_spec.loader.exec_module(decode)

SENTENCES = ["the lord is my shepherd", "in the beginning god created the heavens and the earth"]


# --------------------------------------------------------------------------------------------------------
# The expansion, on a worked example (no PocketSphinx needed)

class _TableLM:
    """A trigram given as a table, in PocketSphinx's calling convention: prob([word, *history most recent
    first]) -> integer log units; anything missing has probability zero."""

    ZERO = -(10**9)

    def __init__(self, table: dict[tuple[str, ...], int]):
        self.table = table

    def size(self) -> int:
        return 3

    def prob(self, words: list[str]) -> int:
        return self.table.get(tuple(words), self.ZERO)


# <s> -> a -> (filler) -> b -> </s>  and  <s> -> c -> b -> </s>; a link's a= scores its *source* node's word.
_RAW = decode.RawLattice(
    start=0, end=4, word=["<s>", "a", None, "b", "</s>", "c"], time=[0.0, 0.1, 0.2, 0.3, 0.4, 0.1],
    src=[0, 1, 2, 3, 0, 5], dst=[1, 2, 3, 4, 5, 3], ac=[-1.0, -2.0, -3.0, -4.0, -1.0, -1.0])
# Units of 0.5 nat: ln P(a|<s>) = -1, ln P(b|<s> a) = -3, ln P(</s>|a b) = -1,
#                   ln P(c|<s>) = -2, ln P(b|<s> c) = -0.5, ln P(</s>|c b) = -4.
_TABLE = {("a", "<s>"): -2, ("b", "a", "<s>"): -6, ("</s>", "b", "a"): -2,
          ("c", "<s>"): -4, ("b", "c", "<s>"): -1, ("</s>", "b", "c"): -8}
_WIP = 0.1


def _expand_worked_example(beam: float, raw: "decode.RawLattice" = _RAW) -> Lattice:
    lm = decode.FirstPassLM(_TableLM(_TABLE), ln_per_unit=0.5, log_zero=_TableLM.ZERO)
    exp = decode.expand(raw, lm, str.lower, wip_cost=_WIP, am_scale=1.0, beam=beam, expand_beam=100.0,
                        name="worked")
    # lmscale 1 and wdpenalty -_WIP put the insertion penalty _WIP on every word and on </s>
    return read_slf_text(decode.to_slf(exp, "worked", lmscale=1.0, wdpenalty=-_WIP)).prepare()


def test_expansion_scores_each_word_with_its_own_two_word_history():
    lat = _expand_worked_example(beam=100.0)
    # graph only: path a b = 1 + 3 + 1 (the filler keeps "<s> a" as b's history); path c b = 2 + 0.5 + 4
    words, cost = lat.best_path(am_scale=0.0, graph_scale=1.0)
    assert words == ["a", "b"] and cost == pytest.approx(5.0 + 3 * _WIP)
    # acoustic only: path c b = 1 + 1 + 4 beats a b = 1 + 2 + 3 + 4
    words, cost = lat.best_path(am_scale=1.0, graph_scale=0.0)
    assert words == ["c", "b"] and cost == pytest.approx(6.0)


def test_expansion_puts_each_links_acoustic_score_on_its_source_word():
    lat = _expand_worked_example(beam=100.0)
    a = lat.symbols.id("a")
    assert lat.acoustic[lat.word == a].tolist() == [2.0]  # the link leaving node "a", not the one entering it


def test_expansion_beam_drops_paths_outside_it():
    # totals (graph + acoustic): a b = 5.3 + 10, c b = 6.8 + 6; a beam of 1 keeps c b only
    lat = _expand_worked_example(beam=1.0)
    names = {lat.symbols.word(int(w)) for w in lat.word if lat.symbols.is_word(int(w))}
    assert names == {"c", "b"}


def test_expansion_does_not_rely_on_node_times():
    # all nodes at time 0: the expansion must follow the links, not the clock, and give the same lattice
    raw = dataclasses.replace(_RAW, time=[0.0] * len(_RAW.time))
    assert lattice_to_text(_expand_worked_example(100.0, raw)) == lattice_to_text(_expand_worked_example(100.0))


# --------------------------------------------------------------------------------------------------------
# End to end: espeak-ng/Festival -> WAV -> PocketSphinx -> lattices -> smallstate-lm rescore

def _need_tools():
    pytest.importorskip("pocketsphinx", reason="the pocketsphinx package is not installed (pip install pocketsphinx)")
    if not (shutil.which("espeak-ng") or shutil.which("text2wave")):
        pytest.skip("no speech synthesiser: neither espeak-ng nor festival's text2wave is installed")


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> Path:
    """Two synthesised utterances decoded into OUT/{utt0000,utt0001}.{lat.fst,lm.slf}, words.txt, ..."""
    _need_tools()
    d = tmp_path_factory.mktemp("pocketsphinx")
    (d / "sentences.txt").write_text("\n".join(SENTENCES) + "\n")
    for cmd in ([EXAMPLE / "make_wavs.py", d / "sentences.txt", "-o", d / "wavs"],
                [EXAMPLE / "decode.py", d / "wavs", "-o", d / "out"]):
        proc = subprocess.run([sys.executable, *map(str, cmd)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    return d


def _dictionary_words() -> set[str]:
    from pocketsphinx import get_model_path

    lines = (Path(get_model_path()) / "en-us" / "cmudict-en-us.dict").read_text().splitlines()
    return {decode._ALT_PRON.sub("", line.split()[0]) for line in lines if line.strip()}


def test_decoded_lattices_read_back_with_paths_of_dictionary_words(decoded):
    out = decoded / "out"
    symbols = SymbolTable.read(out / "words.txt")
    dictionary = _dictionary_words()
    for utt in ("utt0000", "utt0001"):
        lat = read_fst(out / f"{utt}.lat.fst", symbols).prepare()
        words, cost = lat.best_path(am_scale=1 / 9.5)
        assert words and math.isfinite(cost)
        used = {symbols.word(int(w)) for w in np.unique(lat.word) if w}
        assert used and used <= dictionary


def _best_arcs(lat: Lattice, am_scale: float) -> list[int]:
    """Arcs of the best path of a prepared lattice (states topologically numbered, start 0)."""
    S = lat.num_states
    dist, back = np.full(S, np.inf), np.full(S, -1)
    dist[0] = 0.0
    for a in np.argsort(lat.src, kind="stable"):
        c = dist[lat.src[a]] + lat.graph[a] + am_scale * lat.acoustic[a]
        if c < dist[lat.dst[a]]:
            dist[lat.dst[a]], back[lat.dst[a]] = c, a
    s = int(np.argmin(np.where(lat.is_final(), dist + lat.final_graph + am_scale * lat.final_acoustic, np.inf)))
    arcs = []
    while s != 0:
        arcs.append(int(back[s]))
        s = int(lat.src[back[s]])
    return arcs[::-1]


def test_graph_costs_are_the_decoders_trigram_in_natural_log(decoded):
    from pocketsphinx import Decoder

    lm = Decoder(loglevel="ERROR").get_lm()
    ln_unit = math.log(1.0001)  # PocketSphinx's default -logbase
    wip_cost = -math.log(0.65) / 6.5  # -ln(wip) / lw with the default settings
    lat = read_slf(decoded / "out" / "utt0001.lm.slf").prepare()
    history = ["<s>"]
    n_checked = 0
    for a in _best_arcs(lat, am_scale=1 / 9.5):
        w = lat.symbols.word(int(lat.word[a])) if lat.word[a] else "!NULL"  # </s> marks the final links
        if w == "!NULL":
            assert lat.graph[a] == 0.0
            continue
        expected = -lm.prob([w, *reversed(history[-2:])]) * ln_unit + wip_cost
        assert lat.graph[a] == pytest.approx(expected, abs=1e-5)
        history.append(w)
        n_checked += 1
    assert history[-1] == "</s>" and n_checked >= 2


def test_rescore_reads_the_lattices_and_writes_one_best_line_per_utterance(decoded, tiny_lm_dir, kenlm_model):
    out, res = decoded / "out", decoded / "rescored"
    proc = run_cli("rescore", out / "utt0000.lat.fst", out / "utt0001.lat.fst", "--words", out / "words.txt",
                   "--weights", out / "weights.json", "--lm", tiny_lm_dir, "--ngram", kenlm_model,
                   "--refs", decoded / "wavs" / "ref.txt", "-o", res, "--quiet")
    assert proc.returncode == 0, proc.stderr
    best = (res / "best.txt").read_text().splitlines()
    assert [line.split()[0] for line in best] == ["utt0000", "utt0001"]
    assert "%WER" in (res / "wer.txt").read_text()


def test_lattice_words_match_the_lm_vocabulary(decoded):
    symbols = SymbolTable.read(decoded / "out" / "words.txt")
    paths = [read_fst(decoded / "out" / f"{utt}.lat.fst", symbols).best_path(am_scale=1 / 9.5)[0]
             for utt in ("utt0000", "utt0001")]
    lm_words = {w for line in (DATA / "train.txt").read_text().splitlines() for w in line.split()}
    assert check_overlap(paths, lm_words, "the LM text") >= 0.5  # raises VocabularyError below 50%
