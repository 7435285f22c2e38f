"""File helpers shared by every reader and writer: atomic outputs and text input
with errors that name the file."""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import Iterator

from .errors import DataError

_TEMP_NAMES = itertools.count()


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; when the block succeeds it is renamed over
    `path`, when it fails it is removed, so no half-written file ever carries the name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _open_temp(path)
    os.close(fd)  # the block writes through the path
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _open_temp(path: Path) -> tuple[Path, int]:
    """A new file beside `path`, open for writing, with the mode a plain open() would give (umask applied):
    named by process and a counter (a run writes thousands), O_EXCL against any clash."""
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{next(_TEMP_NAMES)}.tmp")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`atomic_output` for bytes in hand, written through the temp file's own descriptor (a run writes
    thousands of lattices: one open each, not two)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _open_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class BackgroundWriter:
    """`atomic_write_bytes` on one background thread, so that the file system's time (create, write,
    rename: the GIL is released) overlaps the caller's computing. At most `max_pending` writes wait (the
    caller then waits for the oldest: a slow disk holds back the run, not its memory). A failed write is
    raised by the next `write` or by `close`, which waits for every write; `cancel` drops the writes not
    begun (each file is written whole or not at all either way)."""

    def __init__(self, max_pending: int = 32):
        self._pool = None
        self._pending: list = []
        self.max_pending = max_pending

    def write(self, path: str | os.PathLike, data: bytes) -> None:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smallstate-write")
        self._check(wait=len(self._pending) >= self.max_pending)
        self._pending.append(self._pool.submit(atomic_write_bytes, path, data))

    def _check(self, wait: bool) -> None:
        """Raise a finished write's error; with `wait`, wait for the oldest write first."""
        if wait and self._pending:
            self._pending[0].result()
        still = []
        for f in self._pending:
            if f.done():
                f.result()  # raises the write's error
            else:
                still.append(f)
        self._pending = still

    def close(self) -> None:
        try:
            for f in self._pending:
                f.result()
        finally:
            self.cancel()

    def cancel(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending = []


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_lines(path: str | os.PathLike, error: type[Exception], what: str = "file") -> list[str]:
    """The lines of a UTF-8 text file; a missing or undecodable file raises `error`
    with the file name."""
    return read_text(path, error, what).splitlines()


def read_text(path: str | os.PathLike, error: type[Exception], what: str = "file") -> str:
    """A UTF-8 text file's text; a missing or undecodable file raises `error` with the file name."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected a {what}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_utt2doc(path: str | os.PathLike, error: type[Exception]) -> list[tuple[str, str]]:
    """An utt2doc file (`utterance document` per line, as Kaldi's utt2spk; blank lines skipped) as its pairs in
    file order; a malformed line or an utterance listed twice raises `error` naming the file and line."""
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    for n, line in enumerate(read_lines(path, error, "utt2doc file"), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise error(f"{path}:{n}: expected 'utterance document', got {line.strip()!r}")
        if parts[0] in seen:
            raise error(f"{path}:{n}: utterance {parts[0]!r} is listed twice")
        seen.add(parts[0])
        pairs.append((parts[0], parts[1]))
    return pairs


def read_sentences(path: str | os.PathLike, lowercase: bool = False) -> list[list[str]]:
    """One sentence per line, words split on whitespace; blank lines are skipped.

    Raises DataError when the file is missing, unreadable, empty or holds no words.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a text file")
    sentences: list[list[str]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                words = (line.lower() if lowercase else line).split()
                if words:
                    sentences.append(words)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    if not sentences:
        what = "empty" if path.stat().st_size == 0 else "holds no words"
        raise DataError(f"{path}: {what}; expected one sentence per line")
    return sentences


def check_output_dir(path: str | os.PathLike, error: type[Exception], option: str = "-o") -> None:
    """Refuse, before any work, an output directory that cannot be made or written: a file in
    its place or on its path, or a parent that this process may not write."""
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == path else f"cannot be made: {probe} is a file"
        raise error(f"{option} {path}: {where}; expected a directory (or a path where one can be made)")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise error(f"{option} {path}: {probe} is not writable by this user; expected a directory it may write in")

