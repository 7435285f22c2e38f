"""Lattice inputs resolved once: `rescore` looks at each lattice file's content at most once to tell its format,
then opens it once more to read it; a Kaldi script under a name that does not say so is read as a script."""

import builtins
import io
import shutil
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, TEST_DATA

from smallstate_lm.cli import main
from smallstate_lm.rescoring.formats.kaldi.write import KaldiArchiveWriter
from smallstate_lm.rescoring.formats.lattice_io import read_fst
from smallstate_lm.rescoring.formats.resolve import resolve_input, utterance_id
from smallstate_lm.rescoring.lattices.lattice import SymbolTable

BUNDLED = REPO / "lattices"
KALDI = TEST_DATA / "kaldi"


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    """One input of each kind, each in its own file, from the bundled lattices: OpenFST and SLF files named by
    their format; an SLF file named `.lat.gz`, a Kaldi archive named `lat.1.gz` and a Kaldi script named
    `lat.list` (into `part.ark`), told only by their content."""
    words = SymbolTable.read(BUNDLED / "words.txt")
    fst, slf = sorted(BUNDLED.glob("*.lat.fst")), sorted(BUNDLED.glob("*.lm.slf.gz"))
    paths = {"fst": tmp_path / fst[0].name, "slf": tmp_path / slf[1].name, "slf-by-content": tmp_path / "utt7.lat.gz",
             "archive-by-content": tmp_path / "lat.1.gz", "script-by-content": tmp_path / "lat.list",
             "archive-of-script": tmp_path / "part.ark"}
    shutil.copy(fst[0], paths["fst"])
    shutil.copy(slf[1], paths["slf"])
    shutil.copy(slf[2], paths["slf-by-content"])
    with KaldiArchiveWriter(paths["archive-by-content"]) as w:
        for f in fst[3:5]:
            w.write(f"a-{utterance_id(f)}", read_fst(f, words))
    with KaldiArchiveWriter(paths["archive-of-script"], scp=tmp_path / "part.scp") as w:
        for f in fst[5:7]:
            w.write(f"s-{utterance_id(f)}", read_fst(f, words))
    (tmp_path / "part.scp").rename(paths["script-by-content"])
    return paths


def test_resolution_tells_each_kind(inputs):
    got = {kind: resolve_input(p).format.name for kind, p in inputs.items()}
    assert got == {"fst": "openfst", "slf": "slf", "slf-by-content": "slf", "archive-by-content": "kaldi-archive",
                   "script-by-content": "kaldi-script", "archive-of-script": "kaldi-archive"}
    assert resolve_input(f"scp:{inputs['script-by-content']}").format.name == "kaldi-script"
    assert resolve_input(f"ark:gunzip -c {inputs['archive-by-content']}|").format.name == "kaldi-archive"
    resolved = resolve_input(inputs["fst"])
    assert resolve_input(resolved) is resolved


def test_rescore_opens_each_lattice_file_once_more_than_its_name_requires(inputs, tmp_path, kenlm_model,
                                                                          monkeypatch):
    """Files named by their format are opened once (to read them); files told by content twice (4 KiB to tell
    the format, then to read them); no file more often, however many steps an input goes through."""
    opened: Counter[str] = Counter()
    watched = {str(p) for p in inputs.values()}
    real_open, real_io_open = builtins.open, io.open

    def counting(real):
        def open_(file, *args, **kwargs):
            if isinstance(file, (str, Path)) and str(file) in watched:
                opened[str(file)] += 1
            return real(file, *args, **kwargs)
        return open_

    monkeypatch.setattr(builtins, "open", counting(real_open))
    monkeypatch.setattr(io, "open", counting(real_io_open))  # pathlib's read_bytes and read_text open through it
    out = tmp_path / "out"
    argv = ["rescore", *(str(inputs[k]) for k in ("fst", "slf", "slf-by-content", "archive-by-content",
                                                  "script-by-content")),
            "--words", str(BUNDLED / "words.txt"), "--ngram", str(kenlm_model), "-o", str(out), "--quiet"]
    with pytest.raises(SystemExit) as e:  # typer ends every run with sys.exit
        main(argv)
    monkeypatch.undo()
    assert not e.value.code
    assert {kind: opened[str(p)] for kind, p in inputs.items()} == {
        "fst": 1, "slf": 1, "slf-by-content": 2, "archive-by-content": 2, "script-by-content": 2,
        "archive-of-script": 1}
    fst, slf = sorted(BUNDLED.glob("*.lat.fst")), sorted(BUNDLED.glob("*.lm.slf.gz"))
    best = [line.split()[0] for line in (out / "best.txt").read_text().splitlines()]
    assert best == [utterance_id(fst[0]), utterance_id(slf[1]), "utt7"] + [f"a-{utterance_id(f)}" for f in fst[3:5]] \
        + [f"s-{utterance_id(f)}" for f in fst[5:7]]
    assert sorted(p.name for p in (out / "lattices").iterdir()) == sorted(
        [f"{u}.lat.fst" for u in best[:3]] + ["lat.1.gz", "lat.list"])
