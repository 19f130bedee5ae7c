"""Storage: one fsspec layer and one retry policy for manifests, media and output sinks.

- `options`: `StorageOptions` (where and how to reach storage; no secrets) and
  `filesystem(uri, storage)` for local paths, `file://` and `s3://` (s3fs).
- `retry`: the retry policy (`with_retries`) and error classification (`classify`):
  transient failures are retried with backoff and jitter, then `StorageError`.
- `io`: `read_bytes` (whole objects, typed errors), `open_media` (a media as a `media_file.MediaFile`:
  a descriptor, its bytes held once), `open_input` (a seekable stream whose
  ranged reads retry), `arrow_filesystem` (the same for pyarrow / Ray Data readers) and
  `put_atomic` (a file that appears whole or not at all, used by the sinks), `bucket_exists`
  (a HEAD bucket: buckets are never created).
- `named_file`: `read_named_file`, a file a job config or a command names (a schema file, the job config,
  a checkpoint's small files): a regular file within its kind's cap, else a `ConfigError` naming the field.
Ray-free; importing this package loads nothing heavy.
"""
from vlbatch.operators.storage.io import (
                                         bucket_exists,
                                         is_object_store,
                                         open_input,
                                         open_media,
                                         put_atomic,
                                         read_bytes,
    replace_file,
)
from vlbatch.operators.storage.media_file import MediaFile, memfd_of
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions, filesystem, join
from vlbatch.operators.storage.retry import classify, with_retries

__all__ = ["DEFAULT_STORAGE", "MediaFile", "StorageOptions", "arrow_filesystem", "bucket_exists", "classify",
           "filesystem", "is_object_store", "join", "memfd_of", "open_input", "open_media", "put_atomic", "read_bytes",
           "replace_file", "with_retries"]


def arrow_filesystem(fs, storage: StorageOptions = DEFAULT_STORAGE):
    """`storage.arrow.arrow_filesystem`, imported on call so that importing this package stays light."""
    from vlbatch.operators.storage.arrow import arrow_filesystem as build

    return build(fs, storage)
