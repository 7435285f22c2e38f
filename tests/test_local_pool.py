"""`rescore --jobs 2`: worker processes give the one-process run's outputs, file for file, and its error
reports."""

from pathlib import Path

from conftest import run_cli

from smallstate_lm.rescoring.formats.kaldi.write import KaldiArchiveWriter
from smallstate_lm.rescoring.formats.lattice_io import read_fst
from smallstate_lm.rescoring.lattices.lattice import SymbolTable

LATTICES = Path(__file__).resolve().parents[1] / "lattices"


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_workers_write_what_one_process_writes(tmp_path, kenlm_model):
    files = sorted(LATTICES.glob("*.lat.fst"))
    sym = SymbolTable.read(LATTICES / "words.txt")
    with KaldiArchiveWriter(tmp_path / "lat.1.gz") as w:  # an archive among the files: a task of its own
        for f in files[:3]:
            w.write(f.name[: -len(".lat.fst")] + "-ark", read_fst(f, sym))
    bad = tmp_path / "broken.lat.fst"
    bad.write_bytes(b"not an fst")
    inputs = [*files[3:], tmp_path / "lat.1.gz", bad]
    outs = {}
    for jobs in ("1", "2"):
        proc = run_cli("rescore", *inputs, "--words", LATTICES / "words.txt", "--ngram", kenlm_model,
                       "--weights", LATTICES / "weights-ngram.json", "--refs", LATTICES / "ref.txt",
                       "--jobs", jobs, "-o", tmp_path / jobs, "--quiet")
        assert proc.returncode == 2, proc.stderr  # the broken file is reported and skipped
        assert str(bad) in proc.stderr and "Traceback" not in proc.stderr
        outs[jobs] = _tree(tmp_path / jobs)
    assert outs["1"].keys() == outs["2"].keys()
    assert "lattices/lat.1.gz" in outs["1"] and "wer.txt" in outs["1"]
    for name in outs["1"]:
        assert outs["1"][name] == outs["2"][name], name
    best = (tmp_path / "2" / "best.txt").read_text().split("\n")
    assert [line.split()[0] for line in best if line][:len(files) - 3] == [f.name.split(".")[0] for f in files[3:]]
