"""A media file held once: an open descriptor the decoder child reads, instead of a copy of its bytes.

- `MediaFile(fd, size)`: an open, read-only descriptor of a local file the job named, or of a sealed
  memfd holding downloaded bytes; `size` is the byte count that was checked against the limit, and
  every reader stops there (a file that grows after the check is read no further). The owner closes
  it (`close`, or `with`); the decoder child gets its own copy of the descriptor (SCM_RIGHTS), never
  the bytes.
- `open_checked(path, uri, max_bytes, limit_name)`: the local checks `read_bytes` has always made, on
  the descriptor itself (opened `O_NONBLOCK` so a FIFO never blocks; `fstat`: a regular file, within
  the limit), so what is read later is exactly what was checked, whatever is renamed over the path.
- `memfd_of(data)`: bytes (downloaded, or carried by the input) written once into a memfd, sealed
  against any change, so a compromised child cannot alter what the parent handed it.
- `MediaFile.reader()`: a seekable binary file over `[0, size)` with its own position (`os.pread`),
  so several readers (the PyAV probe, then another decoder) never share an offset.
"""
from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass

from vlbatch.operators.errors import InputError, MediaError

_SEALS = ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")


@dataclass(frozen=True)
class MediaFile:
    """An open read-only descriptor (owned: `close`) and the checked byte count readers stop at."""

    fd: int
    size: int

    def reader(self) -> FileReader:
        return FileReader(self.fd, self.size)

    def read_all(self) -> bytes:
        """All `size` bytes (an image: the decoders never need this)."""
        with self.reader() as f:
            return f.readall()

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> MediaFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SizedReader(io.RawIOBase):
    """A read-only seekable file of `size` bytes with its own position; a subclass reads (`readinto`)."""

    def __init__(self, size: int):
        super().__init__()
        self._size, self._pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos


class FileReader(SizedReader):
    """Read-only seekable view of `fd`'s bytes `[0, size)`; reads with `os.pread`, never moving the fd's offset."""

    def __init__(self, fd: int, size: int):
        super().__init__(size)
        self._fd = fd

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self._size - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._pos)
        self._pos += got
        return got


def open_checked(path: str, uri: str, max_bytes: int | None, limit_name: str) -> MediaFile:
    """A regular local file opened read-only and checked on its descriptor: `MediaError` for a directory
    or a FIFO / device / socket (O_NONBLOCK: opening one returns at once), `InputError` over `max_bytes`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (FIFO, device or socket)"
            raise MediaError(f"cannot read {uri}: {kind}")
        if max_bytes is not None and st.st_size > max_bytes:
            raise InputError(f"{uri}: {st.st_size} bytes is over the {limit_name} limit of {max_bytes}")
    except BaseException:
        os.close(fd)
        raise
    return MediaFile(fd, st.st_size)


def memfd_of(data, name: str = "vlbatch-media") -> MediaFile:
    """`data` (bytes-like) written once into a new memfd, sealed read-only; the caller may drop `data` then."""
    import fcntl

    view = memoryview(data).cast("B")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:done + (64 << 20)], done)
        seals = 0
        for seal in _SEALS:
            seals |= getattr(fcntl, seal)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return MediaFile(fd, view.nbytes)
