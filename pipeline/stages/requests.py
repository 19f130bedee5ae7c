"""Expansion of manifest rows into requests, with deterministic request ids.

One manifest row (a media) becomes one `MediaTask` holding all of its requests: one
caption request (task.mode=caption) or one request per question (task.mode=questions), and
with `task.caption` the caption request after them (request index = the media's number of
questions), so all of a media's prompts share one decode, one preprocess and the prefix
cache (the chat template puts the media before the text).
Request ids hash only run-independent inputs (media uri, request index, prompt), so a
rerun of the same job recomputes the same ids and resume can skip committed ones.
A row that cannot form a request (a null or empty media_uri, unknown media type, no
questions) becomes an error row (`InputError`) with one request, never a silent drop; it
keeps the manifest's value (null stays null, "" stays ""). An empty or whitespace-only
question is an `InputError` request of its own (the media's other questions run).

Rows of one media whose `input.columns.keep` values differ are separate rows (one output row per
manifest row, each with its own kept values): within a block the first keeps the ordinary id, and
a later one whose kept values differ from those already seen under that id hashes the media's key
plus its kept values' digest (`keep.digest`): deterministic for a given manifest, so resume finds
them again, and no other row's id changes. Rows with the same kept values are identical requests.

Paths reach here normalised (`sources/cells.resolve`: `./a.png` and `a.png` are one media).

Identical requests (same id: same media uri, request index and prompt) run once:
`drop_duplicates` keeps the first and counts the rest. The set of ids it remembers is the
caller's: the runner keeps one per expansion batch (one Ray Data block of the manifest), so
memory is bounded by a block, and duplicates in different blocks are not caught there (the
summary's `duplicate_ids` still counts those in the output).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable
from dataclasses import replace

from vlbatch.operators.errors import InputError, source_error
from vlbatch.operators.media.load import AUDIO_EXTENSIONS, extension, media_type_from_extension
from vlbatch.operators.sink.ids import IdIndex
from vlbatch.pipeline.config import TaskSection
from vlbatch.pipeline.config.answers import CAPTION_NAME, VIDEO_PROMPT, question_names
from vlbatch.pipeline.stages.rows import MediaTask

MEDIA_TYPES = ("image", "video")


def request_id(media_uri: str | None, request_index: int, prompt: str) -> str:
    """32 hex chars of sha256 over (uri, index, prompt); stable across runs and machines.
    A null uri hashes as NUL (no URI is), not as the string 'None'."""
    uri = "\x00" if media_uri is None else media_uri
    h = hashlib.sha256(f"{uri}\x1f{request_index}\x1f{prompt}".encode())
    return h.hexdigest()[:32]


def clip_request_id(request_id: str, clip_index: int) -> str:
    """The id of one clip's request (`video.clips`): 32 hex chars of sha256 over the video's request
    id and the clip's index, so resume is exact per clip (the clip rule is in the run id)."""
    return hashlib.sha256(f"{request_id}\x1fclip\x1f{clip_index}".encode()).hexdigest()[:32]


def infer_media_type(uri: str, given: str | None) -> str:
    """'image'/'video' from the manifest column, else from the file extension (the media
    loader's table: `vlbatch.operators.media.load.media_type_from_extension`)."""
    if given:
        t = str(given).strip().lower()
        if t not in MEDIA_TYPES:
            raise InputError(f"media_type {given!r} of {uri}: allowed values are 'image', 'video'")
        return t
    kind = media_type_from_extension(uri)
    if kind is not None:
        return kind
    ext = extension(uri)
    if ext in AUDIO_EXTENSIONS:
        raise InputError(f"{uri} is audio ({ext}), neither an image nor a video; "
                         "a media_type column can say 'video' if it holds one")
    raise InputError(f"cannot tell whether {uri} is an image or a video (extension {ext or 'none'!r}); "
                     "add a media_type column with 'image' or 'video'")


def _questions(raw, task: TaskSection) -> list[str]:
    if raw is None:
        return task.question_prompts()
    if isinstance(raw, str):  # CSV cells: a JSON list
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raw = [raw]
    if not isinstance(raw, (list, tuple)):
        raw = [raw]
    return ["" if q is None else str(q) for q in raw]  # blanks kept: each is an error row (`expand_rows`)


def caption_prompt(task: TaskSection, kind: str) -> str:
    """The caption prompt of a media of `kind`: a video's is `task.video_prompt`, else `task.prompt` where
    the config sets it, else `VIDEO_PROMPT` (the default prompt speaks of an image)."""
    if kind == "video":
        if task.video_prompt:
            return task.video_prompt
        if "prompt" not in task.model_fields_set:
            return VIDEO_PROMPT
    return task.prompt


def _media_kind(media_uri: str | None, media_type: str | None) -> tuple[str, InputError | None]:
    if media_uri is None or not media_uri.strip():
        what = "null" if media_uri is None else "empty"
        return "unknown", InputError(f"media_uri is {what} in the manifest (input.columns.media)")
    try:
        return infer_media_type(media_uri, media_type), None
    except InputError as e:
        return "unknown", e


def expand(media_uri: str | None, media_type: str | None, questions, task: TaskSection, media_bytes=None,
           identity: str | None = None, error: str | None = None, keep: bytes | None = None) -> MediaTask:
    """One manifest row -> its first MediaTask (`expand_rows`: the questions that are not blank)."""
    return expand_rows(media_uri, media_type, questions, task, media_bytes, identity, error, keep)[0]


def expand_rows(media_uri: str | None, media_type: str | None, questions, task: TaskSection, media_bytes=None,
                identity: str | None = None, error: str | None = None, keep: bytes | None = None) -> list[MediaTask]:
    """One manifest row -> its MediaTasks (all requests, none filtered): the media's requests, then one
    `InputError` row for its empty or whitespace-only questions, if any. A question's request index
    is its position in the manifest's list, so blanks never shift the others' ids. Request ids hash
    `identity` when the source gives one (a WebDataset key, a manifest line), else `media_uri`;
    `error`: the source's own failure for this row (an `InputError` row, a `StorageError` one when
    the source marked it transient: `errors.source_error`)."""
    kind, err = _media_kind(media_uri, media_type)
    if error is not None:
        kind, err = (kind if err is None else "unknown"), source_error(error)
    caption = caption_prompt(task, kind)
    asked = [] if task.mode == "caption" else _questions(questions, task)
    names = _names(task, questions is None, len(asked))
    blank = [i for i, q in enumerate(asked) if not q.strip()]
    if task.mode == "caption" or (task.mode == "scan" and len(blank) == len(asked) and not task.caption):
        indexed, blank, names = [(0, caption)], [], {0: CAPTION_NAME}
    else:
        indexed = [(i, q) for i, q in enumerate(asked) if q.strip()]
        if task.caption:  # the caption after the questions: their ids stay those of a questions-only run
            indexed.append((len(asked), caption))
        elif not asked:
            if err is None:
                err = InputError(f"{media_uri}: no questions (task.mode=questions)")
            indexed = [(0, "")]
    key = media_uri if identity is None else identity

    def row(pairs, failure):
        ids = tuple(request_id(key, i, p) for i, p in pairs)
        r = MediaTask(media_uri, kind, ids, tuple(i for i, _ in pairs), tuple(p for _, p in pairs),
                      media_bytes=None if failure is not None else media_bytes, keep=keep,
                      prompt_names=tuple(names.get(i) for i, _ in pairs))
        return r.failed(failure) if failure is not None else r

    rows = [row(indexed, err)] if indexed else []
    if blank:
        which = ", ".join(str(i) for i in blank)
        rows.append(row([(i, asked[i]) for i in blank], err or InputError(
            f"{media_uri}: question {which} of the row is empty or only whitespace (the manifest's questions)")))
    return rows


def _names(task: TaskSection, from_task: bool, asked: int) -> dict[int, str | None]:
    """{request index: prompt_name}: task.questions' names (when the row's questions are task's), the
    caption's after them; a manifest's own questions have none."""
    names: dict[int, str | None] = dict(enumerate(question_names(task.questions))) if from_task else {}
    if task.caption:
        names[asked] = CAPTION_NAME
    return names


def pending(row: MediaTask, done: frozenset[str] | set[str]) -> MediaTask | None:
    """The row with committed requests removed (None when nothing is left)."""
    keep = [i for i, rid in enumerate(row.ids) if rid not in done]
    if not keep:
        return None
    if len(keep) == len(row.ids):
        return row
    pick = lambda xs: tuple(xs[i] for i in keep)  # noqa: E731
    return replace(row, ids=pick(row.ids), request_indices=pick(row.request_indices), prompts=pick(row.prompts),
                   prompt_names=pick(row.prompt_names))


def drop_duplicates(rows: Iterable[MediaTask], seen: set[str]) -> tuple[list[MediaTask], int]:
    """`rows` without the requests whose id is in `seen` or came earlier (the first one stays),
    and the number of requests dropped; `seen` gains every id."""
    out, dropped = [], 0
    for row in rows:
        kept = pending(row, seen)
        dropped += len(row.ids) - (0 if kept is None else len(kept.ids))
        seen.update(row.ids)
        if kept is not None:
            out.append(kept)
    return out, dropped


def expand_all(records: Iterable[tuple], task: TaskSection,
               done: IdIndex | Collection[str] = frozenset()) -> tuple[list[MediaTask], int]:
    """[(uri, media_type, questions[, media_bytes, identity, error, keep])] -> (pending MediaTasks,
    duplicate requests dropped). `done`: the committed ids (an `IdIndex` is looked up once for
    the whole block, vectorised)."""
    rows = _expand_records(records, task)
    if isinstance(done, IdIndex):
        ids = [rid for r in rows for rid in r.ids]
        done = {rid for rid, hit in zip(ids, done.contains_many(ids), strict=True) if hit} if len(done) else set()
    rows = (pending(r, done) for r in rows)
    return drop_duplicates((r for r in rows if r is not None), set())


def _expand_records(records: Iterable[tuple], task: TaskSection) -> list[MediaTask]:
    """Each record's MediaTasks; a record whose ids were already seen with other kept values gets
    ids of its own (module docstring), so no manifest row's kept values are lost to a duplicate."""
    from vlbatch.pipeline.sources.keep import digest

    first_keep: dict[str, bytes | None] = {}  # id -> the kept values of the first row that had it
    out: list[MediaTask] = []
    for rec in records:
        rows = expand_rows(*rec[:3], task, *rec[3:])
        keep = rec[6] if len(rec) > 6 else None
        if keep is not None and any(first_keep.get(rid, keep) != keep for r in rows for rid in r.ids):
            media_bytes, identity, error = rec[3:6]  # a record with keep has all seven fields
            key = f"{rec[0] if identity is None else identity}\x1ekeep:{digest(keep)}"  # what the ids hash
            rows = expand_rows(*rec[:3], task, media_bytes, key, error, keep)
        for r in rows:
            for rid in r.ids:
                first_keep.setdefault(rid, keep)
        out.extend(rows)
    return out
