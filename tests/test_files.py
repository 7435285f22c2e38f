"""Atomic outputs: the final name appears whole, with the mode a plain write would give."""

import stat

import pytest

from smallstate_lm.files import atomic_output, atomic_write_bytes, atomic_write_text


def test_an_atomic_output_gets_the_mode_of_a_plain_write(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_write_text(tmp_path / "atomic.txt", "x")
    mode = stat.S_IMODE((tmp_path / "atomic.txt").stat().st_mode)
    assert mode == stat.S_IMODE(plain.stat().st_mode)


def test_a_failed_write_leaves_neither_the_name_nor_a_temp_file(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_output(tmp_path / "out.bin") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_atomic_writes_replace_whole_files_and_leave_no_temp_files(tmp_path):

    target = tmp_path / "sub" / "lat.fst"
    for data in (b"first version", b"second"):  # the second replaces the first, whole
        atomic_write_bytes(target, data)
        assert target.read_bytes() == data
    atomic_write_bytes(tmp_path / "sub" / "busy.fst", b"x")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["busy.fst", "lat.fst"]


def test_background_writes_land_whole_and_a_failed_one_is_raised(tmp_path):
    from smallstate_lm.files import BackgroundWriter

    w = BackgroundWriter(max_pending=3)  # the caller waits for the oldest beyond 3
    for i in range(50):
        w.write(tmp_path / "out" / f"{i}.fst", bytes([i]) * 1000)
        assert len(w._pending) <= 3
    w.close()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{i}.fst" for i in range(50))
    assert all((tmp_path / "out" / f"{i}.fst").read_bytes() == bytes([i]) * 1000 for i in range(50))
    (tmp_path / "blocker").write_text("a file where a directory should be")
    w = BackgroundWriter()
    w.write(tmp_path / "blocker" / "x.fst", b"x")
    with pytest.raises(OSError):
        w.close()


def test_cancelled_background_writes_leave_whole_files_or_none(tmp_path):
    from smallstate_lm.files import BackgroundWriter

    w = BackgroundWriter()
    for i in range(200):
        w.write(tmp_path / f"{i}.fst", bytes([i % 256]) * 50_000)
    w.cancel()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert all(not n.startswith(".") for n in names), names  # no temp file left behind
    assert all((tmp_path / n).read_bytes() == bytes([int(n.split(".")[0]) % 256]) * 50_000 for n in names)
