"""Kaldi lattice archives: hand-built fixtures (tests/data/make_kaldi_fixtures.py, struct only), round trips of
our writer, scripts, streaming gzip, damaged archives and content detection of lattice files."""

import gzip
import importlib.util
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from conftest import REPO, TEST_DATA

from smallstate_lm.rescoring.formats.kaldi.write import KaldiArchiveWriter, kaldi_lattice_bytes, kaldi_lattice_text
from smallstate_lm.rescoring.formats.lattice_io import lattice_inputs, read_fst, read_lattice, read_slf
from smallstate_lm.rescoring.formats.resolve import (
    lattice_format,
    looks_like_kaldi_archive,
    parse_rspecifier,
    utterance_id,
)
from smallstate_lm.rescoring.lattices.lattice import Lattice, LatticeFormatError, Ragged, SymbolTable

KALDI = TEST_DATA / "kaldi"
BUNDLED = REPO / "lattices"
INF = np.inf


@pytest.fixture(scope="module")
def abc() -> SymbolTable:
    return SymbolTable.read(KALDI / "words.txt")  # <eps> 0, a 1, b 2, c 3


@pytest.fixture(scope="module")
def words() -> SymbolTable:
    return SymbolTable.read(BUNDLED / "words.txt")


def iter_all(spec, symbols) -> Iterator[tuple[str, Lattice, str | None]]:
    """(name, lattice, kind) of each lattice of an input, read as `rescore` reads it (`lattice_inputs`), lazily."""
    for item in lattice_inputs([spec], symbols):
        yield item.name, item.load(), item.kind


def read_all(spec, symbols) -> list[tuple[str, Lattice, str | None]]:
    return list(iter_all(spec, symbols))


def summary(lat: Lattice) -> tuple:
    """Arcs as (src, dst, word, graph, acoustic, tids) in reading order, finals as {state: (graph, acoustic, tids)}."""
    arcs = [(int(s), int(d), int(w), float(g), float(a), t) for s, d, w, g, a, t in zip(
        lat.src, lat.dst, lat.word, lat.graph, lat.acoustic, lat.arc_tids.tolist())]
    finals = {s: (float(lat.final_graph[s]), float(lat.final_acoustic[s]), lat.final_tids[s].tolist())
              for s in np.flatnonzero(lat.is_final()).tolist()}
    assert all(len(lat.final_tids[s]) == 0 for s in np.flatnonzero(~lat.is_final()))
    return lat.num_states, lat.start, arcs, finals


# What the fixtures hold, written out by hand from the format definition (not from the generator's tables).
# Reading puts the start state's arcs first (utt-3 starts at state 2), as fst_binary does for single files.
COMPACT = {
    "utt1": (4, 0, [(0, 1, 1, 1.5, 10.25, [11, 12, 12]), (0, 2, 2, 2.0, 8.5, [13]), (1, 3, 3, 0.5, 4.0, [14, 15]),
                    (2, 3, 0, 0.0, 1.25, [16])], {3: (0.75, 0.5, [17, 18])}),
    "utt2": (2, 0, [(0, 1, 2, 0.0, 0.0, [])], {1: (0.0, 0.0, [])}),
    "utt-3": (3, 2, [(2, 0, 1, 0.25, 3.0, [21]), (0, 1, 3, 1.0, 2.0, [22, 23])], {1: (0.0, 0.0, [])}),
}
# A Lattice arc's transition-id is its input label: one id, or none for ilabel 0.
LATTICE = {
    "utt1": (5, 0, [(0, 1, 1, 1.5, 4.0, [11]), (0, 3, 2, 2.0, 8.5, [13]), (1, 2, 0, 0.0, 3.25, [12]),
                    (2, 4, 3, 0.5, 0.0, []), (3, 4, 0, 0.0, 1.25, [16])], {4: (0.75, 0.5, [])}),
    "utt2": (3, 0, [(0, 1, 2, 1.0, 2.0, [5]), (0, 2, 1, 0.5, 0.5, [6])], {1: (0.0, 0.0, [])}),
}


# ---------------------------------------------------------------------------------------------- fixtures

def _generator():
    spec = importlib.util.spec_from_file_location("make_kaldi_fixtures", TEST_DATA / "make_kaldi_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_fixtures_are_what_the_generator_writes():
    for name, data in _generator().fixtures().items():
        on_disk = (KALDI / name).read_bytes()
        if name.endswith(".gz"):  # compressed bytes may differ between zlib versions; the content may not
            on_disk, data = gzip.decompress(on_disk), gzip.decompress(data)
        assert on_disk == data, name


@pytest.mark.parametrize("name, kind, expected", [
    ("compact.ark", "compact", COMPACT), ("compact_text.ark", "compact", COMPACT), ("lat.1.gz", "compact", COMPACT),
    ("lattice.ark", "lattice", LATTICE), ("lattice_text.ark", "lattice", LATTICE),
])
def test_hand_built_fixture_reads_exactly(abc, name, kind, expected):
    got = read_all(KALDI / name, abc)
    assert [k for k, _, _ in got] == list(expected)
    for key, lat, k in got:
        assert (k, lat.name) == (kind, key)
        assert summary(lat) == expected[key], key
        assert lat.graph.dtype == np.float64 and lat.arc_tids.values.dtype == np.int32


def test_writer_reproduces_the_hand_built_bytes_and_kaldis_text(abc):
    for ark, text, kind in (("compact.ark", "compact_text.ark", "compact"), ("lattice.ark", "lattice_text.ark",
                                                                             "lattice")):
        data = (KALDI / ark).read_bytes()
        printed = ""
        for key, lat, _ in read_all(KALDI / ark, abc):
            ours = kaldi_lattice_bytes(lat, kind)
            at = data.index(key.encode() + b" ") + len(key) + 1
            props = 4 + (4 + 6) + (4 + len("compactlattice44" if kind == "compact" else "lattice4")) + 8
            theirs = data[at: at + len(ours)]  # all but the properties field (build-history dependent in OpenFST)
            assert (ours[:props], ours[props + 8:]) == (theirs[:props], theirs[props + 8:]), key
            printed += f"{key} " + kaldi_lattice_text(lat, kind)
        assert printed == (KALDI / text).read_text()


def test_mixed_archive_keeps_each_entrys_kind(abc, tmp_path):
    """Binary and text entries may alternate; a "\\0B" marker before a binary lattice is tolerated."""
    compact = (KALDI / "compact.ark").read_bytes()
    p = tmp_path / "mixed.ark"
    p.write_bytes((KALDI / "lattice_text.ark").read_bytes() + compact.replace(b"utt2 \xd6", b"utt2 \0B\xd6"))
    got = [(k, kind) for k, _, kind in read_all(p, abc)]
    assert got == [("utt1", "lattice"), ("utt2", "lattice"), ("utt1", "compact"), ("utt2", "compact"),
                   ("utt-3", "compact")]


# ---------------------------------------------------------------------------------------------- round trips

def random_lattice(rng: np.random.Generator, name: str, symbols: SymbolTable, max_tids: int, S: int = 7,
                   A: int = 15) -> Lattice:
    """States 0..S-1 in topological order, arcs sorted by source, random words (or epsilon), costs and
    transition-ids."""
    ids = np.append(np.flatnonzero(symbols.word_flags(np.arange(len(symbols) + 1))), 0)
    src = np.sort(rng.integers(0, S - 1, A))
    dst = src + 1 + rng.integers(0, 1 << 30, A) % (S - 1 - src)
    final = rng.random(S) < 0.3
    final[-1] = True
    fg = np.where(final, rng.normal(size=S), INF)
    counts = rng.integers(0, max_tids + 1, A)  # (A,) transition-ids per arc
    tids = Ragged(np.append(0, np.cumsum(counts)), rng.integers(1, 5000, counts.sum()).astype(np.int32))
    ftids = [rng.integers(1, 5000, rng.integers(0, 3)) if f and max_tids > 1 else [] for f in final]
    return Lattice(name, S, 0, src, dst, rng.choice(ids, A), rng.normal(size=A) * 5, rng.exponential(50, A),
                   fg, np.where(final, rng.exponential(3, S), INF), symbols, tids,
                   Ragged.from_lists(ftids))


def assert_round_trip(original: Lattice, back: Lattice) -> None:
    """`back` is `original` with costs rounded to float32 (and empty transition-ids where it had none)."""
    assert (back.name, back.num_states, back.start) == (original.name, original.num_states, original.start)
    for f in ("src", "dst", "word"):
        assert np.array_equal(getattr(back, f), getattr(original, f)), f
    for f in ("graph", "acoustic", "final_graph", "final_acoustic"):
        assert np.array_equal(getattr(back, f), getattr(original, f).astype(np.float32).astype(np.float64)), f
    tids = original.arc_tids.tolist() if original.arc_tids is not None else [[]] * original.num_arcs
    assert back.arc_tids.tolist() == tids
    ftids = original.final_tids.tolist() if original.final_tids is not None else [[]] * original.num_states
    assert back.final_tids.tolist() == [t if f else [] for t, f in zip(ftids, original.is_final())]


def bundled_with_tids(words: SymbolTable, max_tids: int) -> list[Lattice]:
    rng = np.random.default_rng(1)
    out = []
    for p in sorted(BUNDLED.glob("*.lat.fst"))[::3]:
        lat = read_fst(p, words)
        assert lat.start == 0 and np.all(np.diff(lat.src) >= 0)  # so the reading order is the writing order
        lat.arc_tids = Ragged.from_lists([rng.integers(1, 9000, rng.integers(0, max_tids + 1))
                                          for _ in range(lat.num_arcs)])
        out.append(lat)
    return out


@pytest.mark.parametrize("kind", ["compact", "lattice"])
@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("suffix", [".ark", ".ark.gz"])
def test_written_archives_read_back_equal(words, tmp_path, kind, binary, suffix):
    rng = np.random.default_rng(0)
    max_tids = 4 if kind == "compact" else 1
    lats = [random_lattice(rng, f"rand-{i}", words, max_tids) for i in range(5)]
    lats[0].arc_tids = lats[0].final_tids = None  # written with empty strings
    lats += bundled_with_tids(words, max_tids)
    path = tmp_path / f"lat{suffix}"
    with KaldiArchiveWriter(path, kind=kind, binary=binary) as w:
        for lat in lats:
            w.write(lat.name, lat)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == suffix.endswith(".gz")
    back = read_all(path, words)
    assert [(k, kd) for k, _, kd in back] == [(lat.name, kind) for lat in lats]
    for lat, (_, got, _) in zip(lats, back):
        assert_round_trip(lat, got)


def test_lattice_kind_refuses_arcs_with_several_transition_ids(words, tmp_path):
    lat = random_lattice(np.random.default_rng(3), "u", words, max_tids=1)
    lat.arc_tids = Ragged.from_lists([[1]] * (lat.num_arcs - 1) + [[7, 8]])
    with pytest.raises(LatticeFormatError, match=r"lattice 'u': arc \d+ -> \d+ carries 2 transition-ids; .*'compact'"):
        kaldi_lattice_bytes(lat, "lattice")
    kaldi_lattice_bytes(lat, "compact")


def test_writer_is_atomic(words, tmp_path):
    lat = random_lattice(np.random.default_rng(4), "u", words, max_tids=2)
    for name in ("lat.ark", "lat.1.gz"):
        with pytest.raises(RuntimeError, match="stop"):
            with KaldiArchiveWriter(tmp_path / name) as w:
                w.write("u", lat)
                raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="white space"):
        with KaldiArchiveWriter(tmp_path / "lat.ark") as w:
            w.write("two words", lat)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- scripts, specs

def test_scp_with_offsets_reads_the_same_lattices(abc, tmp_path):
    direct = [(k, summary(lat)) for k, lat, _ in read_all(KALDI / "compact.ark", abc)]
    assert [(k, summary(lat)) for k, lat, _ in read_all(f"scp:{KALDI / 'compact.scp'}", abc)] == direct
    # offsets written by our writer (Kaldi's ark,scp:), in a different order and with a repeat
    with KaldiArchiveWriter(tmp_path / "a.ark", scp=tmp_path / "a.scp") as w:
        for k, lat, _ in read_all(KALDI / "compact.ark", abc):
            w.write(k, lat)
    lines = (tmp_path / "a.scp").read_text().splitlines()
    assert lines[0] == f"utt1 {tmp_path / 'a.ark'}:5"
    (tmp_path / "b.scp").write_text("\n".join([lines[2], lines[0], lines[2]]) + "\n")
    got = [(k, summary(lat)) for k, lat, _ in read_all(tmp_path / "b.scp", abc)]
    assert got == [direct[2], direct[0], direct[2]]


def test_scp_errors_are_clear(abc, tmp_path):
    (tmp_path / "gz.scp").write_text(f"utt1 {KALDI / 'lat.1.gz'}:5\n")
    with pytest.raises(LatticeFormatError, match=r"gz.scp:1: .*lat.1.gz is gzip-compressed"):
        read_all(tmp_path / "gz.scp", abc)
    (tmp_path / "pipe.scp").write_text("utt1 gunzip -c lat.1.gz |\n")
    with pytest.raises(LatticeFormatError, match=r"pipe.scp:1: .*commands are not run"):
        read_all(tmp_path / "pipe.scp", abc)
    (tmp_path / "noofs.scp").write_text(f"utt1 {KALDI / 'compact.ark'}\n")  # a whole file is one object
    with pytest.raises(LatticeFormatError, match=r"compact.ark \(from .*noofs.scp:1\): lattice 'utt1': not a lattice: "
                                                 r"bad magic number at byte 0"):
        read_all(tmp_path / "noofs.scp", abc)


def test_rspecifiers():
    assert parse_rspecifier("ark,s,cs:gunzip -c /x/lat.1.gz |") == ("ark", Path("/x/lat.1.gz"))
    assert parse_rspecifier("scp,p:lat.scp")[0] == "scp"
    assert parse_rspecifier("t,ark:lat.txt") == parse_rspecifier("lat.txt")
    assert parse_rspecifier(KALDI / "compact.scp")[0] == "scp"
    for bad in ("ark:-", "ark:cat lat.ark |"):
        with pytest.raises(LatticeFormatError, match="pipe or stdin"):
            parse_rspecifier(bad)


# ---------------------------------------------------------------------------------------------- streaming gzip

@pytest.fixture(scope="module")
def big_gz(words, tmp_path_factory):
    """A gzip archive of 300 random lattices (about 4 MB gunzipped, many times the read chunk)."""
    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("big") / "lat.1.gz"
    with KaldiArchiveWriter(path) as w:
        for i in range(300):
            w.write(f"utt{i:03d}", random_lattice(rng, f"utt{i:03d}", words, max_tids=40, S=60, A=400))
    assert len(gzip.decompress(path.read_bytes())) > 3_000_000
    return path


def test_gzip_archive_is_streamed(words, big_gz, tmp_path):
    """The first entries of an archive whose tail is cut off or garbled read fine: the tail is never touched
    until it is needed; reading on then fails naming the archive, the entry and the offset."""
    data = big_gz.read_bytes()
    cut, garbled = tmp_path / "cut.1.gz", tmp_path / "garbled.1.gz"
    cut.write_bytes(data[: len(data) // 2])
    garbled.write_bytes(data[: len(data) // 2] + bytes(range(256)) * 16 + data[len(data) // 2 + 4096:])
    for p in (cut, garbled):
        it = iter_all(p, words)
        first = next(it)
        assert first[0] == "utt000" and first[1].num_arcs == 400
        with pytest.raises(LatticeFormatError) as e:
            for _ in it:
                pass
        assert str(e.value).startswith(f"{p}: lattice 'utt1") and "byte " in str(e.value)
    with pytest.raises(LatticeFormatError, match=r"gzip data ends early \(truncated file\) after byte \d+ of the "
                                                 "gunzipped archive"):
        read_all(cut, words)


def test_gzip_archive_reads_whole(words, big_gz):
    keys = [k for k, _, _ in iter_all(f"ark:gunzip -c {big_gz}|", words)]
    assert keys == [f"utt{i:03d}" for i in range(300)]


# ---------------------------------------------------------------------------------------------- damaged archives

def damaged(tmp_path, name: str, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_truncated_archive_names_the_entry_and_offset(abc, tmp_path):
    data = (KALDI / "compact.ark").read_bytes()  # objects at bytes 5 (utt1), 296 (utt2), 440 (utt-3)
    p = damaged(tmp_path, "cut.ark", data[:200])
    with pytest.raises(LatticeFormatError, match=r"cut.ark: lattice 'utt1': archive ends at byte 200, inside the "
                                                 r"lattice \(truncated.*expected arc \d of the \d arcs of state \d at "
                                                 r"byte 1\d\d"):
        read_all(p, abc)
    p = damaged(tmp_path, "cut2.ark", data[:298])
    with pytest.raises(LatticeFormatError, match=r"cut2.ark: lattice 'utt2': archive ends inside the lattice "
                                                 r"\(truncated\); expected the OpenFST magic number at byte 296"):
        read_all(p, abc)
    p = damaged(tmp_path, "cut.1.gz", gzip.compress(data[:600], mtime=0))
    with pytest.raises(LatticeFormatError, match=r"cut.1.gz: lattice 'utt-3': archive ends at byte 600 of the "
                                                 r"gunzipped archive, inside the lattice \(truncated"):
        read_all(p, abc)
    gz = (KALDI / "lat.1.gz").read_bytes()
    p = damaged(tmp_path, "cutgz.1.gz", gz[:-30])
    with pytest.raises(LatticeFormatError, match=r"cutgz.1.gz: lattice '[^']+': gzip data ends early \(truncated "
                                                 r"file\) after byte \d+ of the gunzipped archive"):
        read_all(p, abc)


def test_corrupt_archive_says_what_was_expected(abc, tmp_path):
    data = (KALDI / "compact.ark").read_bytes()
    p = damaged(tmp_path, "magic.ark", data[:296] + b"\xd6\x00\x00\x00" + data[300:])
    with pytest.raises(LatticeFormatError, match=r"magic.ark: lattice 'utt2': not a lattice: bad magic number at byte "
                                                 r"296; expected a binary OpenFST lattice"):
        read_all(p, abc)
    p = damaged(tmp_path, "arctype.ark", data[:440] + data[440:].replace(b"compactlattice44", b"compactlattice45", 1))
    with pytest.raises(LatticeFormatError, match=r"arctype.ark: lattice 'utt-3': arc type 'compactlattice45' in the "
                                                 r"header at byte 440 is not a Kaldi lattice \(expected "
                                                 "compactlattice44"):
        read_all(p, abc)
    p = damaged(tmp_path, "ntids.ark", data[:87] + (10**9).to_bytes(4, "little") + data[91:])
    with pytest.raises(LatticeFormatError, match=r"ntids.ark: lattice 'utt1': corrupt lattice: the final weight of "
                                                 r"state 0 has 1000000000 transition-ids at byte 87"):
        read_all(p, abc)
    gz = bytearray((KALDI / "lat.1.gz").read_bytes())
    gz[20:40] = bytes(20)
    with pytest.raises(LatticeFormatError, match=r"badgz.1.gz: corrupt gzip data after byte 0 of the gunzipped "):
        read_all(f"ark:{damaged(tmp_path, 'badgz.1.gz', bytes(gz))}", abc)  # its content no longer says so
    with pytest.raises(LatticeFormatError, match=r"compact.ark: lattice 'utt1': state 0: label 2 is not in the symbol "
                                                 r"table \(2 symbols\)"):
        read_all(KALDI / "compact.ark", SymbolTable.from_words(["a"]))


def test_bad_text_line_names_the_line_and_entry(abc, tmp_path):
    text = (KALDI / "compact_text.ark").read_text().replace("0\t1\t3\t1,2,22_23", "0\t1\t3\t1,2,22__23")
    p = damaged(tmp_path, "bad.txt", text.encode())
    with pytest.raises(LatticeFormatError, match=r"bad.txt:14: lattice 'utt-3': bad line '0\\t1\\t3\\t1,2,22__23': "
                                                 r"not a CompactLattice \(line 14: arc weight .* is not "
                                                 r"'g,a,t1_t2_..."):
        read_all(p, abc)


# ---------------------------------------------------------------------------------------------- detection

def test_content_decides_where_the_name_does_not(abc, words, tmp_path):
    slf = tmp_path / "dev0004.lat.gz"  # as Kaldi's utils/convert_slf.pl names SLF
    shutil.copy(BUNDLED / "slt-dev0004.lm.slf.gz", slf)
    ark = tmp_path / "lat.1.gz"
    shutil.copy(KALDI / "lat.1.gz", ark)
    text = tmp_path / "lat.1.txt"
    shutil.copy(KALDI / "compact_text.ark", text)
    fst = tmp_path / "utt9.lat"
    shutil.copy(BUNDLED / "slt-dev0004.lat.fst", fst)
    assert [lattice_format(p).name for p in (slf, ark, text, fst)] == ["slf", "kaldi-archive", "kaldi-archive",
                                                                       "openfst"]
    assert [utterance_id(p) for p in (slf, fst)] == ["dev0004", "utt9"]
    lat = read_lattice(slf, None)
    assert lat.name == "dev0004" and np.array_equal(lat.graph, read_slf(BUNDLED / "slt-dev0004.lm.slf.gz").graph)
    assert read_lattice(fst, words).name == "utt9"
    assert [(n, summary(lat)) for n, lat, _ in iter_all(ark, abc)] == [(k, v) for k, v in COMPACT.items()]
    assert [n for n, _, _ in iter_all(KALDI / "compact.scp", abc)] == list(COMPACT)
    assert [n for n, _, _ in iter_all(BUNDLED / "slt-dev0004.lat.fst", words)] == ["slt-dev0004"]
    script = tmp_path / "lats.list"  # a script whose name does not say so
    script.write_text("".join(f"{k} {KALDI / 'compact.ark'}:{o}\n" for k, o in (("utt2", 296), ("utt1", 5))))
    assert lattice_format(script).name == "kaldi-script"
    assert [n for n, _, _ in iter_all(script, abc)] == ["utt2", "utt1"]
    assert [k for k, _, _ in iter_all(str(script), abc)] == ["utt2", "utt1"]


def test_read_lattice_on_archives(abc, tmp_path):
    with pytest.raises(LatticeFormatError, match=r"lat.1.gz: Kaldi lattice archive .* holds several lattices"):
        read_lattice(KALDI / "lat.1.gz", abc)
    one = damaged(tmp_path, "one.ark", (KALDI / "compact_text.ark").read_bytes().split(b"\n\n")[0] + b"\n\n")
    assert summary(read_lattice(one, abc)) == COMPACT["utt1"] and read_lattice(one, abc).name == "utt1"
    with pytest.raises(LatticeFormatError, match="need the decoder's symbol table"):
        read_lattice(KALDI / "lat.1.gz", None)


def test_unknown_file_lists_the_formats(abc, tmp_path):
    p = damaged(tmp_path, "mystery.gz", gzip.compress(b"hello world\nthis is not a lattice\n"))
    assert lattice_format(p) is None
    with pytest.raises(LatticeFormatError, match=r"mystery.gz: unknown lattice format .*expected OpenFST binary .*; "
                                                 r"HTK SLF .*; Kaldi lattice archive .*; Kaldi lattice script"):
        read_lattice(p, abc)
    with pytest.raises(LatticeFormatError, match="missing.lat.gz: lattice file not found"):
        read_lattice(tmp_path / "missing.lat.gz", abc)
    assert not looks_like_kaldi_archive(b"utt1 hello world\n") and not looks_like_kaldi_archive(b"VERSION=1.0\nN=2")
