"""A Kaldi archive's bytes, read forward a chunk at a time: plain, or gzip (`lat.N.gz`, told by its magic bytes,
not its name) decompressed on the fly, so that an archive of any size takes the memory of one entry. Concatenated
gzip members are read on, as `gunzip` does. Errors name the archive, the entry's key and the byte offset (of the
gunzipped stream, for gzip) or the line of the problem.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

from ...lattices.lattice import LatticeFormatError
from ..fst_layout import MAX_NAME
from ..resolve import open_lattice_file

GZIP_MAGIC = b"\x1f\x8b"
I32, I64 = struct.Struct("<i"), struct.Struct("<q")
_CHUNK = 1 << 16  # bytes read from the file at a time; one gunzip step yields at most 4 * _CHUNK bytes


def open_archive(path: Path, what: str) -> tuple[BinaryIO, bool, int]:
    """The open file, whether it is gzip (by its magic bytes) and its size; errors name the file."""
    f = open_lattice_file(path, what)
    gzipped = f.read(2) == GZIP_MAGIC
    f.seek(0)
    return f, gzipped, os.fstat(f.fileno()).st_size


class ArchiveStream:
    """An archive's bytes read forward a chunk at a time (gunzipped on the fly): `buf[pos:]` is unread, `buf[0]`
    is byte `base` of the (uncompressed) archive and lies on line `line0`. `start_entry` drops what was read, so
    the buffer holds one entry. Errors name the archive, the entry's key and a byte offset or line."""

    def __init__(self, raw: BinaryIO, source: str, gzipped: bool, base: int = 0, limit: int | None = None) -> None:
        self.raw, self.source, self.gzipped = raw, source, gzipped
        self.buf = bytearray()
        self.pos, self.base, self.line0 = 0, base, 1
        self.limit = None if gzipped else limit  # the file's size: no entry reaches beyond it
        self.key: str | None = None
        self.unz = zlib.decompressobj(wbits=31) if gzipped else None
        self.done = False
        self.whole = base == 0  # read from the start, so lines are the file's lines

    def error(self, msg: str, line: int | None = None) -> LatticeFormatError:
        """An error naming the archive, the line (when given), the entry's key, then `msg`."""
        where = self.source
        if line is not None and self.whole:
            where += f":{line}"
        elif line is not None:  # read from an offset (scp): lines are counted from the object's start
            msg += f" (line {line} of the lattice text)"
        entry = "" if self.key is None else f": lattice {self.key!r}"
        return LatticeFormatError(f"{where}{entry}: {msg}")

    def at(self, pos: int) -> str:
        """Where `buf[pos]` is in the archive, for messages: `byte N` (of the gunzipped stream for gzip)."""
        return f"byte {self.base + pos}" + (" of the gunzipped archive" if self.gzipped else "")

    def line(self, pos: int) -> int:
        return self.line0 + self.buf.count(b"\n", 0, pos)

    def start_entry(self) -> None:
        self.line0 = self.line(self.pos)
        del self.buf[: self.pos]
        self.base += self.pos
        self.pos = 0

    def need(self, end: int) -> bool:
        """Whether the archive holds `buf[:end]` (reading on as needed)."""
        if end <= len(self.buf):
            return True
        if self.limit is not None and self.base + end > self.limit:
            return False
        while len(self.buf) < end:
            if not self.more():
                return False
        return True

    def more(self) -> bool:
        """Append the next chunk to `buf`; False at the end of the archive."""
        if self.done:
            return False
        if self.unz is None:
            chunk = self.raw.read(_CHUNK)
            self.buf += chunk
            self.done = not chunk
            return bool(chunk)
        return self._gunzip_more()

    def _gunzip_more(self) -> bool:
        while True:
            d = self.unz
            if d.eof:  # a gzip member ended: the file ends, or another member follows (concatenated gzip files)
                rest = d.unused_data or self.raw.read(_CHUNK)
                if not rest:
                    self.done = True
                    return False
                if len(rest) < 2:
                    rest += self.raw.read(_CHUNK)
                if rest[:2] != GZIP_MAGIC:
                    raise self.error(f"bytes that are not gzip data follow the gzip stream after "
                                     f"{self.at(len(self.buf))}; expected another gzip member or the end of the file")
                d = self.unz = zlib.decompressobj(wbits=31)
                data = rest
            else:
                data = d.unconsumed_tail or self.raw.read(_CHUNK)
                if not data:
                    raise self.error(f"gzip data ends early (truncated file) after {self.at(len(self.buf))}")
            try:
                out = d.decompress(data, 4 * _CHUNK)
            except zlib.error as e:
                raise self.error(f"corrupt gzip data after {self.at(len(self.buf))} ({e})") from None
            if out:
                self.buf += out
                return True

    def take(self, fmt: struct.Struct, what: str) -> tuple:
        if not self.need(self.pos + fmt.size):
            raise self.error(f"archive ends inside the lattice (truncated); expected {what} at {self.at(self.pos)}")
        out = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return out

    def string(self, what: str, limit: int = MAX_NAME) -> str:
        at = self.pos
        (n,) = self.take(I32, f"the length of the {what}")
        if not 0 <= n <= limit:
            raise self.error(f"corrupt lattice: the {what} has length {n} at {self.at(at)}; expected 0 to {limit}")
        if not self.need(self.pos + n):
            raise self.error(f"archive ends inside the lattice (truncated); expected the {n} bytes of the {what} at "
                             f"{self.at(self.pos)}")
        self.pos += n
        return bytes(self.buf[self.pos - n: self.pos]).decode("utf-8", "replace")

    def readline(self) -> tuple[bytes, bool]:
        """The next line without its newline, and whether it had one (False: the archive ended)."""
        start = self.pos
        while (nl := self.buf.find(b"\n", start)) < 0:
            start = len(self.buf)
            if not self.more():
                line, self.pos = bytes(self.buf[self.pos:]), len(self.buf)
                return line, False
        line, self.pos = bytes(self.buf[self.pos: nl]), nl + 1
        return line, True
