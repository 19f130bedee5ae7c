"""The CPU stages' shared row helpers (`decode.py`, `preprocess.py`, `prepare.py`).

Each CPU stage is a class usable as a Ray Data actor-pool UDF: constructed once per actor
(opening the decode subprocess or loading the processor), called with a pyarrow batch of
the previous stage's rows, returning a pyarrow table with one row per input row (the
preprocess stage adds one error row per prompt that fails alone, `prepare_rows`). A failure
in one row becomes that row's error row (`catch_row`); it never fails the task.
Rows already in error pass through unchanged. Ray Data runs several batches on one
actor at once (threads); the decode subprocess and the processor are not thread-safe,
so each call holds the actor's lock.
"""
from __future__ import annotations

from vlbatch.operators.errors import SetupError
from vlbatch.pipeline.stages.rows import MediaTask, clip_fields


def error_fields(row: MediaTask) -> dict:
    return {"status": row.status, "error_type": row.error_type, "error_message": row.error_message}


def base_fields(row: MediaTask) -> dict:
    return {"media_uri": row.media_uri, "media_type": row.media_type, "ids": row.ids,
            "request_indices": row.request_indices, "prompts": row.prompts, **error_fields(row), "keep": row.keep,
            "prompt_names": row.prompt_names, **clip_fields(row)}


def catch_row(row: MediaTask, fn, err_cls):
    """fn(), or the row as an error row: a typed `VlbatchError` keeps its class name (permanent
    or transient per `vlbatch.operators.errors`); any other exception (a bug, a library error) is
    recorded under its own name and counts as transient on resume. Never a task failure, except
    a `SetupError` (the job's own checkpoint or device is broken, not the medium): it fails the
    run, so no row of it is ever committed."""
    try:
        return fn()
    except SetupError:
        raise
    except Exception as e:
        return err_cls(**base_fields(row)).failed(e)



def requests_of(rows) -> int:
    """Output rows (requests) of a list of media rows."""
    return sum(len(r.ids) for r in rows)
