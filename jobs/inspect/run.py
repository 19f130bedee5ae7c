"""`vlbatch inspect RUN`: what a run produced, read from its output (no Ray, no model).

RUN is a run directory (`<output.uri>/<run_id>`, local or s3://; an `output.uri` holding one run
is taken to mean that run) or a job config (its `output.uri` / run id, storage and video
settings). `read_run` streams the committed part files once (a few columns, one part at a time:
memory does not grow with the run), counting statuses, error types (one example message each)
and token histograms, and keeps a seeded random sample of media: every row matching `--where` of the
`n` media with the smallest random keys (one key per media and seed: `cards`, which also groups
them into cards). The run's `_summary.json` gives the throughput timeline (`pipeline/telemetry/timeline.py`);
the fingerprint is `read_fingerprint`. `vlbatch.jobs.inspect.text` writes the terminal form (and is the
command), `vlbatch.jobs.inspect.html` the page.
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vlbatch.operators.errors import ConfigError, MediaError, StorageError, VlbatchError
from vlbatch.operators.media.video import DEFAULT_SAMPLING, FrameSampling
from vlbatch.operators.storage import DEFAULT_STORAGE, StorageOptions, filesystem, join, read_bytes
from vlbatch.operators.storage.retry import describe, with_retries

FINGERPRINT_NAME = "_fingerprint.json"  # the run's config fingerprint, beside the part files (when recorded)
SUMMARY_NAME = "_summary.json"
WHERE_COLUMNS = ("status", "error_type", "media_type", "finish_reason", "model")
SCAN_COLUMNS = ["id", "media_uri", "media_type", "status", "error_type", "error_message", "prompt_tokens",
                "visual_tokens", "generated_tokens", "model", "run_id", "quality_flags"]
TOKENS = ("prompt", "visual", "generated")
ERROR_MEDIA = 4  # media kept per error type for the page
QUALITY_EXAMPLES = 3  # rows kept per quality flag (operators/quality.py) for the report


@dataclass(frozen=True)
class RunRef:
    uri: str  # the run directory
    storage: StorageOptions = DEFAULT_STORAGE
    sampling: FrameSampling = DEFAULT_SAMPLING  # the run's video sampling (the config's, else the defaults)
    media_column: str | None = None  # embedded media: the manifest's media column (from the config)
    from_config: bool = False


@dataclass
class RunReport:
    ref: RunRef
    parts: int = 0
    rows: int = 0
    status: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # error_type -> rows
    examples: dict = field(default_factory=dict)  # error_type -> one message
    error_media: dict = field(default_factory=dict)  # error_type -> [{media_uri, media_type, error_message}]
    hist: dict = field(default_factory=lambda: {k: Counter() for k in TOKENS})  # power-of-two buckets
    run_ids: Counter = field(default_factory=Counter)
    models: Counter = field(default_factory=Counter)
    summary: dict | None = None  # _summary.json
    fingerprint: dict | None = None
    where: tuple[tuple[str, str], ...] = ()
    matched: int = 0  # rows matching `where`
    sample: list[dict] = field(default_factory=list)  # full rows, sorted by media_uri, request_index
    quality: Counter = field(default_factory=Counter)  # ok answers per quality flag
    quality_rows: dict = field(default_factory=dict)  # flag -> [(part, row)] first examples, then full rows
    seed: int = 0
    timelines: list = field(default_factory=list)  # video.clips: `clips.VideoTimeline`s of a few videos


def parse_where(items: list[str] | None) -> tuple[tuple[str, str], ...]:
    """['status=error'] -> (('status', 'error'),); ConfigError naming the bad one."""
    out = []
    for item in items or []:
        col, sep, value = item.partition("=")
        if not sep or col.strip() not in WHERE_COLUMNS:
            raise ConfigError(f"--where {item!r}: expected COLUMN=VALUE with COLUMN one of {', '.join(WHERE_COLUMNS)}")
        out.append((col.strip(), value.strip()))
    return tuple(out)


def resolve_run(target: str, endpoint_url: str | None = None) -> RunRef:
    """A run directory or a job config -> RunRef (ConfigError when neither)."""
    if os.path.isfile(target):
        from vlbatch.pipeline.config import load_config

        cfg = load_config(target)
        v = cfg.video
        sampling = FrameSampling(fps=v.fps, num_frames=v.num_frames, min_frames=v.min_frames, max_frames=v.max_frames)
        storage = cfg.storage.options()
        return RunRef(join(cfg.output.uri, cfg.resolved_run_id()), storage, sampling, cfg.input.columns.media, True)
    storage = StorageOptions(endpoint_url=endpoint_url) if endpoint_url else DEFAULT_STORAGE
    return RunRef(_run_dir(target.rstrip("/"), storage), storage)


def _run_dir(uri: str, storage: StorageOptions) -> str:
    """`uri` if it holds part files; else its one sub-folder that does."""
    from vlbatch.operators.sink.parquet import PART_PREFIX
    from vlbatch.operators.storage.options import check_output_uri

    check_output_uri(uri)  # the places a run can be written to, and nothing else (never an http(s) probe)
    fs, path = filesystem(uri, storage)
    if not reading(uri, storage, lambda: fs.exists(path)):
        raise ConfigError(f"{uri}: no such run directory or config file")
    names = [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)]
    if any(n.startswith(PART_PREFIX) for n in names) or SUMMARY_NAME in names:
        return uri
    runs = sorted(n for n in names if not n.startswith(("_", ".")) and
                  any(m.rsplit("/", 1)[-1].startswith(PART_PREFIX) for m in _ls(fs, f"{path}/{n}")))
    if len(runs) == 1:
        return join(uri, runs[0])
    if runs:
        raise ConfigError(f"{uri} holds {len(runs)} runs ({', '.join(runs[:10])}); name one: {join(uri, runs[0])}")
    raise ConfigError(f"{uri}: no committed output (no part files) here or in its sub-folders")


def reading(uri: str, storage: StorageOptions, fn):
    """`fn()`, a storage call on the run `uri`, under the retry policy; a failure that is not ours
    (botocore's NoCredentialsError, an unreachable endpoint, a denied bucket) becomes one
    `StorageError` naming `uri` and the cause, never a traceback."""
    hint = ""
    if uri.startswith("s3://") and not storage.endpoint_url:
        hint = ("; no endpoint was given, so this is AWS S3: for another S3-compatible store (MinIO, Ceph) "
                "pass --endpoint-url (or inspect the job config: its storage.endpoint_url is used); "
                "credentials come from the AWS environment (AWS_* variables, profiles)")
    try:
        return with_retries(fn, what=f"reading {uri}", storage=storage)
    except StorageError as e:  # transient failures outlasted the retries (an unreachable endpoint)
        raise StorageError(f"{e}{hint}") from e
    except VlbatchError:
        raise
    except Exception as e:  # noqa: BLE001 - fsspec / s3fs / botocore / OSError: one line, see above
        raise StorageError(f"{uri}: cannot read the run ({describe(e)}){hint}") from e


def _ls(fs, path: str) -> list[str]:
    try:
        return fs.ls(path, detail=False) if fs.isdir(path) else []
    except OSError:
        return []


def read_json(uri: str, storage: StorageOptions) -> dict | None:
    """A small JSON file of the run (None when absent or not JSON)."""
    try:
        data = json.loads(read_bytes(uri, storage, max_bytes=16 << 20))
    except (MediaError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_fingerprint(ref: RunRef) -> dict | None:
    """The run's recorded config fingerprint (`FINGERPRINT_NAME` beside the parts), None if not recorded."""
    return read_json(join(ref.uri, FINGERPRINT_NAME), ref.storage)


def fingerprint_lines(report: RunReport) -> list[str]:
    """What identifies the run: its fingerprint's fields, else its run id and model."""
    fp = report.fingerprint
    if fp:
        return [f"{k}: {json.dumps(v, sort_keys=True) if isinstance(v, dict | list) else v}"
                for k, v in sorted(_flat(fp).items())]
    ids = ", ".join(k for k, _ in report.run_ids.most_common(3)) or "-"
    models = ", ".join(k for k, _ in report.models.most_common(3)) or "-"
    return [f"no fingerprint recorded; run_id: {ids}; model: {models}"]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_run(ref: RunRef, *, sample: int = 8, where=(), seed: int = 0) -> RunReport:
    """Stream the run's parts once (module docstring; a clipped run's timelines: `jobs/inspect/clips.py`)."""
    from vlbatch.jobs.inspect.clips import CLIP_COLUMNS, Timelines
    from vlbatch.operators.sink.parquet import ParquetSink

    sink = ParquetSink(ref.uri, ref.storage)
    parts = reading(ref.uri, ref.storage, sink.parts)
    rep = RunReport(ref=ref, parts=len(parts), where=tuple(where), seed=seed)
    kept: dict[str, tuple[float, list]] = {}  # card key -> (its random key, [(part, row)]) of the sample so far
    timelines = Timelines()
    for part in parts:
        t = sink.read_part(part, SCAN_COLUMNS + CLIP_COLUMNS)
        timelines.add(t, part)
        _count(rep, t)
        _count_quality(rep, t, part)
        match = np.flatnonzero(_mask(t, rep.where))
        rep.matched += len(match)
        if sample and len(match):
            _keep_media(kept, t, match, part, sample, seed)
    rep.sample = _rows(sink, [(0.0, p, r) for _, at in kept.values() for p, r in at])
    rep.timelines = timelines.finish(sink)
    rep.quality_rows = {f: _rows(sink, [(0.0, p, r) for p, r in at]) for f, at in rep.quality_rows.items()}
    rep.summary = read_json(join(ref.uri, SUMMARY_NAME), ref.storage)
    rep.fingerprint = read_fingerprint(ref)
    return rep


def _keep_media(kept: dict, t: pa.Table, match: np.ndarray, part: str, sample: int, seed: int) -> None:
    """Keep in `kept` the `sample` media with the smallest random keys so far (`cards.media_key`: one
    per media and seed), each with all its matching rows. Keys are hashed per distinct media of the part;
    only rows under the current cut are looked at one by one."""
    from vlbatch.jobs.inspect.cards import card_key, media_key

    sub = t.select(["id", "media_uri"]).take(pa.array(match))
    enc = pc.dictionary_encode(sub["media_uri"].combine_chunks())
    names = enc.dictionary.to_pylist()
    per_name = np.array([media_key(card_key({"media_uri": u}), seed) for u in names] + [0.0])
    codes = enc.indices.fill_null(len(names)).to_numpy(zero_copy_only=False)
    keys = per_name[codes]
    nulls = np.flatnonzero(codes == len(names))
    if len(nulls):  # a row without a media_uri is a card of its own
        ids = sub["id"].take(pa.array(nulls)).to_pylist()
        keys[nulls] = [media_key(card_key({"media_uri": None, "id": i}), seed) for i in ids]
    cut = sorted(k for k, _ in kept.values())[sample - 1] if len(kept) >= sample else 1.0
    uniq = np.unique(keys)
    if len(uniq) >= sample:  # this part's own `sample` media bound the cut too
        cut = min(cut, float(uniq[sample - 1]))
    for i in np.flatnonzero(keys <= cut).tolist():
        uri = names[codes[i]] if codes[i] < len(names) else None
        ck = card_key({"media_uri": uri, "id": None if uri is not None else sub["id"][i].as_py()})
        kept.setdefault(ck, (float(keys[i]), []))[1].append((part, int(match[i])))
    for ck, _ in sorted(kept.items(), key=lambda x: x[1][0])[sample:]:
        del kept[ck]


def _count(rep: RunReport, t: pa.Table) -> None:
    rep.rows += t.num_rows
    rep.status.update(dict(zip(*_value_counts(t["status"]), strict=True)))
    rep.run_ids.update(dict(zip(*_value_counts(t["run_id"]), strict=True)))
    rep.models.update(dict(zip(*_value_counts(t["model"]), strict=True)))
    for name in TOKENS:
        rep.hist[name].update(histogram(t[f"{name}_tokens"]))
    errs = t.filter(pc.equal(t["status"], "error"))
    for d in errs.select(["media_uri", "media_type", "error_type", "error_message"]).to_pylist():
        et = d["error_type"] or "unknown"
        rep.errors[et] += 1
        rep.examples.setdefault(et, d["error_message"] or "")
        media = rep.error_media.setdefault(et, [])
        if len(media) < ERROR_MEDIA and all(m["media_uri"] != d["media_uri"] for m in media):
            media.append(d)


def _count_quality(rep: RunReport, t: pa.Table, part: str) -> None:
    """Flags per ok answer, and the first `QUALITY_EXAMPLES` rows of each (a part without the column:
    written before it existed, nothing counted)."""
    if "quality_flags" not in t.column_names:
        return
    col = t["quality_flags"]
    rows = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
    for flag, row in zip(pc.list_flatten(col).to_pylist(), rows.tolist(), strict=True):
        rep.quality[flag] += 1
        at = rep.quality_rows.setdefault(flag, [])
        if len(at) < QUALITY_EXAMPLES:
            at.append((part, row))


def _value_counts(col) -> tuple[list, list]:
    vc = pc.value_counts(col)
    return [v if v is not None else "null" for v in vc.field("values").to_pylist()], vc.field("counts").to_pylist()


def histogram(col) -> Counter:
    """Counts per power-of-two bucket, labelled as `pipeline.progress.token_histogram` ('0', '<lo>-<2lo>')."""
    v = np.asarray(pc.drop_null(col).to_numpy(zero_copy_only=False), dtype=np.int64)
    v = v[v >= 0]
    out = Counter({"0": int((v == 0).sum())} if (v == 0).any() else {})
    pos = v[v > 0]
    if len(pos):
        bits = np.floor(np.log2(pos)).astype(np.int64)  # exact for ints below 2**50
        for b, n in zip(*np.unique(bits, return_counts=True), strict=True):
            out[f"{1 << int(b)}-{1 << (int(b) + 1)}"] += int(n)
    return out


def _mask(t: pa.Table, where) -> np.ndarray:
    m = np.ones(t.num_rows, dtype=bool)
    for col, value in where:
        m &= pc.fill_null(pc.equal(t[col], value), False).to_numpy(zero_copy_only=False)
    return m


def _rows(sink, kept: list[tuple[float, str, int]]) -> list[dict]:
    """The sampled rows in full (each part holding one read once)."""
    by_part: dict[str, list[int]] = {}
    for _, part, row in kept:
        by_part.setdefault(part, []).append(row)
    rows = []
    for part, idx in by_part.items():
        rows += sink.read_part(part).take(pa.array(idx)).to_pylist()
    return sorted(rows, key=lambda r: (r["status"] != "ok", r.get("media_uri") or "", r.get("request_index") or 0,
                                       r["id"]))


def hist_key(label: str) -> int:
    return 0 if label == "0" else int(label.split("-")[0])


@dataclass(frozen=True)
class Attempt:
    """One call of `vlbatch run` on the run (`pipeline/telemetry/attempts.py`), or the whole run (`number` None)."""

    number: int | None
    started: datetime | None  # UTC; None: not recorded (a summary older than the records)
    finished: datetime | None
    rows: int  # requests computed, by status below
    ok: int
    error: int
    skipped: int | None  # already committed before the call (None: the whole run)
    seconds: float
    rows_per_s: float
    ended: str | None = None  # "finished", "interrupted", "failed" (None: not recorded, or the whole run)


def run_attempts(summary: dict | None) -> list[Attempt]:
    """The run's attempts, oldest first, from `_summary.json` (its `attempts`; a summary without them
    is its own call, of unknown time); [] without a summary. Values that are not what the runner
    writes read as 0 / not recorded (the file is read, not trusted)."""
    from vlbatch.pipeline.telemetry.attempts import ENDINGS, attempts_of

    out = []
    for i, a in enumerate(attempts_of(summary) if summary else [], 1):
        n = _num(a.get("attempt"))
        out.append(Attempt(int(n) if n else i, _time(a.get("started_at")), _time(a.get("finished_at")),
                           int(_num(a.get("rows"))), int(_num(a.get("ok"))), int(_num(a.get("error"))),
                           int(_num(a.get("skipped"))), _num(a.get("elapsed_s")), _num(a.get("rows_per_s")),
                           a.get("ended") if a.get("ended") in ENDINGS else None))
    return out


def whole_run(attempts: list[Attempt]) -> Attempt:
    """The attempts summed: rows and seconds; rows/s is their ratio, the first start and the last finish."""
    seconds = sum(a.seconds for a in attempts)
    rows = sum(a.rows for a in attempts)
    return Attempt(None, attempts[0].started if attempts else None, attempts[-1].finished if attempts else None,
                   rows, sum(a.ok for a in attempts), sum(a.error for a in attempts), None, seconds,
                   rows / seconds if seconds > 0 else 0.0)


def when(t: datetime | None, seconds: bool = True) -> str:
    return "not recorded" if t is None else t.strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")


def _num(v) -> float:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return float(v) if ok else 0.0


def _time(v) -> datetime | None:
    try:
        t = datetime.fromisoformat(v) if isinstance(v, str) else None
    except ValueError:
        return None
    return None if t is None or t.tzinfo is None else t.astimezone(UTC)


def rates(summary: dict | None) -> list[tuple[float, float, float, float]]:
    """The run's timeline, every attempt one after another (`run_timeline`; a summary older than it: its last
    call's), as [(t_mid_s, rows/s, generated tok/s, visual tok/s)] (empty when not recorded)."""
    from vlbatch.pipeline.telemetry.attempts import run_timeline_of

    tl = run_timeline_of(summary or {}) or {}
    tl = tl if isinstance(tl, dict) else {}
    w, buckets, names = tl.get("bucket_s"), tl.get("buckets") or [], tl.get("fields") or []
    if not w or not buckets or not {"rows", "generated_tokens", "visual_tokens"} <= set(names):
        return []
    i = {n: names.index(n) for n in names}
    return [((k + 0.5) * w, b[i["rows"]] / w, b[i["generated_tokens"]] / w, b[i["visual_tokens"]] / w)
            for k, b in enumerate(buckets)]

