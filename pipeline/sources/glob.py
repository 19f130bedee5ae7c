"""`input.format: glob`: every file a glob matches is one media (no questions column).

A plain folder (no glob characters) reads the folder's media: every file under it (recursively)
whose extension is an image or video one (`operators/media/load.py:folder_media`), hidden (`.x`) and
underscore (`_x`) entries left out so a manifest or notes beside the media are
not taken for media. A glob is taken as written: each file it matches is one media.
"""
from __future__ import annotations

import glob as globlib
from functools import cached_property

import ray

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.media.load import folder_media
from vlbatch.operators.storage import filesystem, with_retries
from vlbatch.operators.storage.options import with_protocol
from vlbatch.pipeline.sources.base import Source, limit, manifest_table


class GlobSource(Source):
    """The glob is listed once in the driver (sorted); the rows are that list (so `count` is known
    before any row is read)."""

    @cached_property
    def _uris(self) -> list[str]:
        inp, storage = self.cfg.input, self.cfg.storage.options()
        fs, path = filesystem(inp.uri, storage)
        if not globlib.has_magic(path) and with_retries(lambda: fs.isdir(path), what=f"listing {inp.uri}",
                                                        storage=storage):
            found = with_retries(lambda: fs.find(path), what=f"listing {inp.uri}", storage=storage)
            matches = folder_media(path, found)
            if not matches:
                raise ConfigError(f"input.uri: the folder {inp.uri!r} holds no image or video files")
        else:
            matches = sorted(with_retries(lambda: fs.glob(path), what=f"listing {inp.uri}", storage=storage))
        if not matches:
            raise ConfigError(f"input.uri: the glob {inp.uri!r} matches no files")
        return [with_protocol(inp.uri, m) for m in matches]

    def read(self, *, num_cpus: float | None = None, concurrency: int | None = None) -> ray.data.Dataset:
        uris = self._uris
        table = manifest_table(len(uris), media_uri=uris)
        return limit(ray.data.from_arrow(table), self.cfg.input.limit)

    def count(self) -> int:
        """The matches, `input.limit` applied (the listing `read` uses, made once)."""
        n = len(self._uris)
        return n if self.cfg.input.limit is None else min(n, self.cfg.input.limit)
