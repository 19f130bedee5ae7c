"""`RetryingHandler`: pyarrow's fsspec handler with the one retry policy on its reading calls.

For pyarrow readers (Ray Data's read_parquet / read_json / read_csv of a manifest): file
info and listings are retried as a whole; opened files are `io.open_input` streams, whose
ranged reads retry one by one. The write-side calls are pyarrow's own (manifests are only
read). A module of its own so that the class pickles by reference (Ray ships it to read
tasks) and pyarrow.fs is imported only by the readers that need it.
"""
from __future__ import annotations

from pyarrow import PythonFile
from pyarrow.fs import FSSpecHandler, PyFileSystem

from vlbatch.operators.storage.io import open_input
from vlbatch.operators.storage.options import DEFAULT_STORAGE, StorageOptions
from vlbatch.operators.storage.retry import with_retries


class RetryingHandler(FSSpecHandler):
    def __init__(self, fs, storage: StorageOptions):
        super().__init__(fs)
        self.storage = storage

    def get_file_info(self, paths):
        return with_retries(lambda: super(RetryingHandler, self).get_file_info(paths),
                            what=f"file info of {', '.join(paths[:3])}", storage=self.storage)

    def get_file_info_selector(self, selector):
        return with_retries(lambda: super(RetryingHandler, self).get_file_info_selector(selector),
                            what=f"listing {selector.base_dir}", storage=self.storage)

    def open_input_file(self, path):
        return PythonFile(open_input(self.fs, path, self.storage), mode="r")

    def open_input_stream(self, path):
        return PythonFile(open_input(self.fs, path, self.storage), mode="r")


def arrow_filesystem(fs, storage: StorageOptions = DEFAULT_STORAGE) -> PyFileSystem:
    """A `pyarrow.fs.PyFileSystem` over `fs` whose reading calls follow the retry policy
    (lives here, not in io.py, so that io.py does not import arrow.py back: no cycle)."""
    return PyFileSystem(RetryingHandler(fs, storage))
