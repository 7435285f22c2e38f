"""Kaldi lattice archives through the CLI: read -> rescore -> write back as an archive of the same kind,
CTM from transition-ids, the same 1-best as the single .fst files, bad archives reported and skipped."""

import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from smallstate_lm.rescoring.formats.kaldi.write import KaldiArchiveWriter
from smallstate_lm.rescoring.formats.lattice_io import lattice_inputs, read_fst
from smallstate_lm.rescoring.lattices.lattice import Ragged, SymbolTable

LATTICES = Path(__file__).resolve().parents[1] / "lattices"
WORDS = LATTICES / "words.txt"


def iter_kaldi_lattices(spec, symbols):
    """(key, lattice, kind) of each entry of a Kaldi archive or script, read as `rescore` reads it."""
    for item in lattice_inputs([spec], symbols):
        yield item.name, item.load(), item.kind


def _with_tids(lat, rng, per_arc, final_tids=2):
    lat.arc_tids = Ragged.from_lists([rng.integers(1, 3000, size=int(rng.integers(*per_arc)))
                                      for _ in range(lat.num_arcs)])
    lat.final_tids = Ragged.from_lists([rng.integers(1, 3000, size=final_tids) if np.isfinite(g) else []
                                        for g in lat.final_graph])
    return lat


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    """The bundled lattices as two Kaldi archives (gzip CompactLattice, plain Lattice + scp), with made-up
    transition-ids (CompactLattice: 1-4 per arc; Lattice: one per arc)."""
    d = tmp_path_factory.mktemp("ark")
    sym = SymbolTable.read(WORDS)
    files = sorted(LATTICES.glob("*.lat.fst"))
    rng = np.random.default_rng(0)
    half = len(files) // 2
    with KaldiArchiveWriter(d / "lat.1.gz", "compact") as w:
        for f in files[:half]:
            lat = _with_tids(read_fst(f, sym), rng, (1, 5))
            w.write(f.name[: -len(".lat.fst")], lat)
    with KaldiArchiveWriter(d / "lat.2.ark", "lattice", scp=d / "lat.2.scp") as w:
        for f in files[half:]:
            w.write(f.name[: -len(".lat.fst")], _with_tids(read_fst(f, sym), rng, (1, 2), final_tids=0))
    return d, files


def _rescore(ngram, out, *inputs, extra=()):
    proc = run_cli("rescore", *inputs, "--words", WORDS, "--weights", LATTICES / "weights-ngram.json",
                   "--ngram", ngram, "-o", out, "--quiet", *extra)
    return proc


def test_archive_rescoring_writes_archives_back_and_equals_fst_files(tmp_path, archives, kenlm_model):
    d, files = archives
    proc = _rescore(kenlm_model, tmp_path / "ark", d / "lat.1.gz", f"scp:{d / 'lat.2.scp'}", extra=("--ctm",))
    assert proc.returncode == 0, proc.stderr
    proc = _rescore(kenlm_model, tmp_path / "fst", *files)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ark" / "best.txt").read_text() == (tmp_path / "fst" / "best.txt").read_text()

    sym = SymbolTable.read(WORDS)
    inputs = {k: (lat, kind) for spec in (d / "lat.1.gz", f"scp:{d / 'lat.2.scp'}")
              for k, lat, kind in iter_kaldi_lattices(spec, sym)}
    out = {}
    for name in ("lat.1.gz", "lat.2.ark"):
        for k, lat, kind in iter_kaldi_lattices(tmp_path / "ark" / "lattices" / name, sym):
            out[k] = (lat, kind)
    assert set(out) == set(inputs)
    for k, (lat, kind) in out.items():
        src, src_kind = inputs[k]
        assert kind == src_kind
        # every rescored arc keeps the transition-ids of an input arc with the same word
        # every rescored arc is an input arc's copy: same word, transition-ids and (untouched) acoustic cost
        have = {(int(w), tuple(src.arc_tids[a].tolist()), float(src.acoustic[a])) for a, w in enumerate(src.word)}
        for a, w in enumerate(lat.word):
            assert (int(w), tuple(lat.arc_tids[a].tolist()), float(lat.acoustic[a])) in have
    # the new graph costs hold the n-gram: the rescored best path differs in cost from the first pass's
    fst_out = read_fst(tmp_path / "fst" / "lattices" / f"{files[0].name}", sym)
    k0 = files[0].name[: -len(".lat.fst")]
    assert np.allclose(sorted(out[k0][0].graph), sorted(fst_out.graph), atol=1e-4)

    ctm = (tmp_path / "ark" / "best.ctm").read_text().splitlines()
    best = dict(line.split(maxsplit=1) for line in (tmp_path / "ark" / "best.txt").read_text().splitlines()
                if " " in line)
    by_utt: dict[str, list[tuple[float, float, str]]] = {}
    for line in ctm:
        utt, ch, start, dur, word, conf = line.split()
        assert ch == "1" and 0.0 <= float(conf) <= 1.0
        by_utt.setdefault(utt, []).append((float(start), float(dur), word))
    for utt, words in by_utt.items():
        assert " ".join(w for *_, w in words) == best[utt]
        starts = [s for s, _, _ in words]
        assert starts == sorted(starts) and all(dur > 0 for _, dur, _ in words)
        for (s, dur, _), (s2, _, _) in zip(words, words[1:]):
            assert s + dur <= s2 + 1e-6


def test_a_script_under_another_name_is_read_as_a_script(tmp_path, archives, kenlm_model):
    """A Kaldi script named `lat.list` (not .scp) is told by its lines and rescored as `scp:lat.2.scp` is (it was
    once read as an archive, and failed)."""
    d, _ = archives
    listed = tmp_path / "lat.list"
    shutil.copy(d / "lat.2.scp", listed)
    for name, spec in (("scp", f"scp:{d / 'lat.2.scp'}"), ("list", listed)):
        proc = _rescore(kenlm_model, tmp_path / name, spec, extra=("--nbest", "0"))
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "list" / "best.txt").read_text() == (tmp_path / "scp" / "best.txt").read_text()
    assert len((tmp_path / "list" / "best.txt").read_text().splitlines()) == len(listed.read_text().splitlines())
    written = (tmp_path / "list" / "lattices" / "lat.list").read_bytes()
    assert written == (tmp_path / "scp" / "lattices" / "lat.2.ark").read_bytes()


def test_text_archive_output_and_a_corrupt_archive_among_good_ones(tmp_path, archives, kenlm_model):
    d, _ = archives
    bad = tmp_path / "lat.3.ark"
    data = (d / "lat.2.ark").read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # cut inside an entry
    proc = _rescore(kenlm_model, tmp_path / "out", d / "lat.1.gz", bad, extra=("--archive-text", "--nbest", "0"))
    assert proc.returncode == 2
    assert str(bad) in proc.stderr and "Traceback" not in proc.stderr
    written = tmp_path / "out" / "lattices"
    assert (written / "lat.1.gz").exists() and (written / "lat.3.ark").exists()
    sym = SymbolTable.read(WORDS)
    keys_in = [k for k, _, _ in iter_kaldi_lattices(d / "lat.1.gz", sym)]
    text_keys = [k for k, _, _ in iter_kaldi_lattices(f"ark,t:{written / 'lat.1.gz'}", sym)]
    assert text_keys == keys_in
    best_keys = [line.split()[0] for line in (tmp_path / "out" / "best.txt").read_text().splitlines()]
    assert best_keys[: len(keys_in)] == keys_in  # input order, the cut archive's good entries after


def test_tune_on_an_archive_equals_tune_on_files(tmp_path, archives, kenlm_model):
    d, files = archives
    got = {}
    for name, inputs in (("ark", [d / "lat.1.gz", f"scp:{d / 'lat.2.scp'}"]), ("fst", files)):
        proc = run_cli("tune", *inputs, "--words", WORDS, "--refs", LATTICES / "ref.txt", "--ngram", kenlm_model,
                       "--set", "am_scale=0.105", "-o", tmp_path / f"{name}.json", "--quiet")
        assert proc.returncode == 0, proc.stderr
        got[name] = (tmp_path / f"{name}.json").read_text()
    assert got["ark"] == got["fst"]


def test_ctm_from_slf_node_times(tmp_path, kenlm_model):
    slfs = sorted(LATTICES.glob("*.lm.slf.gz"))[:4]
    proc = run_cli("rescore", *slfs, "--ngram", kenlm_model, "-o", tmp_path, "--quiet", "--ctm", "--nbest", "0")
    assert proc.returncode == 0, proc.stderr
    best = {u: w.split() for u, _, w in (line.partition(" ") for line in (tmp_path / "best.txt").read_text()
                                         .splitlines())}
    rows: dict[str, list[tuple[float, float, str]]] = {}
    for line in (tmp_path / "best.ctm").read_text().splitlines():
        utt, _, start, dur, word, conf = line.split()
        assert 0.0 <= float(conf) <= 1.0
        rows.setdefault(utt, []).append((float(start), float(dur), word))
    assert set(rows) == {u for u, w in best.items() if w}
    for utt, words in rows.items():
        assert [w for *_, w in words] == best[utt]
        for (s, d, _), (s2, _, _) in zip(words, words[1:]):
            assert d >= 0 and s + d <= s2 + 1e-6  # SLF node times: words follow one another


def test_a_bad_entry_fails_alone_and_clashing_or_missing_archives_are_named(tmp_path, kenlm_model):
    sym = SymbolTable.read(WORDS)
    files = sorted(LATTICES.glob("*.lat.fst"))[:4]
    lats = [read_fst(f, sym) for f in files]
    lats[1].word = lats[1].word.copy()
    lats[1].word[lats[1].word > 0] = 10**6  # a word id words.txt does not have: this entry's content is wrong
    ark = tmp_path / "a" / "lat.1.ark"
    ark.parent.mkdir()
    with KaldiArchiveWriter(ark) as w:
        for f, lat in zip(files, lats):
            w.write(f.name.split(".")[0], lat)
    scp_lines = [f"{f.name.split('.')[0]} {ark}:{99999999 if k == 2 else 0}" for k, f in enumerate(files)]
    proc = _rescore(kenlm_model, tmp_path / "out", ark, tmp_path / "a" / "lat.9.gz", extra=("--nbest", "0"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "1000000" in proc.stderr and "lat.9.gz" in proc.stderr and "not found" in proc.stderr
    got = [line.split()[0] for line in (tmp_path / "out" / "best.txt").read_text().splitlines()]
    assert got == [files[k].name.split(".")[0] for k in (0, 2, 3)]  # the entries after the bad one are read
    # a script line with a bad offset fails alone too
    scp = tmp_path / "a" / "x.scp"
    scp.write_text("\n".join(scp_lines[:2]) + "\n" + scp_lines[2] + "\n")
    proc = _rescore(kenlm_model, tmp_path / "out2", f"scp:{scp}", extra=("--nbest", "0"))
    assert proc.returncode == 2 and "x.scp:3" in proc.stderr
    # two archives that would be written back under one name
    other = tmp_path / "b" / "lat.1.ark"
    other.parent.mkdir()
    other.write_bytes(ark.read_bytes())
    proc = _rescore(kenlm_model, tmp_path / "out3", ark, other)
    assert proc.returncode != 0 and "lattices/lat.1.ark" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out3").exists()
