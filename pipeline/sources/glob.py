"""`input.format: glob`: every file a glob matches is one media (no questions column).

A plain folder (no glob characters) reads the folder's media: every file under it (recursively)
whose extension is an image or video one (`operators/media/load.py:folder_media`), hidden (`.x`) and
underscore (`_x`) entries left out so a manifest or notes beside the media are
not taken for media. A glob is taken as written: each file it matches is one media.

Local links: a match whose real path (every symlink resolved) lies outside the glob's root (the
folder, or the glob's folder before its first wildcard) is an `InputError` row, never read,
unless `input.follow_symlinks: true` (a link `x.jpg -> /etc/passwd` in a shared folder). Links
inside the root are read. The check is made when the glob is listed (a link made later is not
seen).
"""
from __future__ import annotations

import glob as globlib
import os
from collections.abc import Iterator
from functools import cached_property

import pyarrow as pa
import ray

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.media.load import folder_media
from vlbatch.operators.storage import filesystem, with_retries
from vlbatch.operators.storage.options import protocol_of, with_protocol
from vlbatch.pipeline.sources.base import Source, limit, manifest_table


class GlobSource(Source):
    """The glob is listed once in the driver (sorted); the rows are that list (so `count` is known
    before any row is read)."""

    @property
    def _uris(self) -> list[str]:
        return [u for u, _ in self._rows]

    @cached_property
    def _rows(self) -> list[tuple[str, str | None]]:
        """(URI, error or None) per match, sorted."""
        inp, storage = self.cfg.input, self.storage
        fs, path = filesystem(inp.uri, storage)
        if not globlib.has_magic(path) and with_retries(lambda: fs.isdir(path), what=f"listing {inp.uri}",
                                                        storage=storage):
            found = with_retries(lambda: fs.find(path), what=f"listing {inp.uri}", storage=storage)
            matches = folder_media(path, found)
            root = path
            if not matches:
                raise ConfigError(f"input.uri: the folder {inp.uri!r} holds no image or video files")
        else:
            matches = sorted(with_retries(lambda: fs.glob(path), what=f"listing {inp.uri}", storage=storage))
            root = _glob_root(path)
        if not matches:
            raise ConfigError(f"input.uri: the glob {inp.uri!r} matches no files")
        escaped = [] if inp.follow_symlinks or protocol_of(inp.uri) not in ("file", "local") \
            else _escaping(root, matches)
        return [(with_protocol(inp.uri, m), escaped_error(m, root) if m in escaped else None) for m in matches]

    def manifest(self) -> pa.Table:
        """The manifest rows: one per match (a link out of the root: its error, module docstring)."""
        rows = self._rows
        return manifest_table(len(rows), media_uri=[u for u, _ in rows], error=[e for _, e in rows])

    def read(self, *, num_cpus: float | None = None, concurrency: int | None = None) -> ray.data.Dataset:
        return limit(ray.data.from_arrow(self.manifest()), self.cfg.input.limit)

    def driver_blocks(self) -> Iterator[pa.Table]:
        """The listing the preflight made (`count`), as one block: no storage call here."""
        return iter([self.manifest()])

    def count(self) -> int:
        """The matches, `input.limit` applied (the listing `read` uses, made once)."""
        n = len(self._uris)
        return n if self.cfg.input.limit is None else min(n, self.cfg.input.limit)

    def counted_by(self) -> str:
        return "glob listing"


def _glob_root(path: str) -> str:
    """The folder of a glob before its first wildcard ('/d/imgs/*/x*.png' -> '/d/imgs')."""
    parts = path.split("/")
    cut = next((i for i, p in enumerate(parts) if globlib.has_magic(p)), len(parts) - 1)  # a plain file: its folder
    return "/".join(parts[:cut]) or "/"


def _escaping(root: str, matches: list[str]) -> set[str]:
    """The local matches whose real path (links resolved) is outside `root`'s real path."""
    inside = os.path.realpath(root).rstrip(os.sep) + os.sep
    return {m for m in matches if not os.path.realpath(m).startswith(inside)}


def escaped_error(match: str, root: str) -> str:
    return (f"{match} is a symlink that leads outside {root}/ (the input's folder): not followed; "
            "input.follow_symlinks: true reads it")
