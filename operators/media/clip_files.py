"""Clip files (`output.clip_files`): each clip re-encoded with PyAV from the pictures the one clip decode
already holds (`clip_decode.py`; no second decode), Ray-free.

- Who: the killable decoder child encodes (`write_clip`) into its parent worker's local temporary folder
  (`DecodeWorker.decode_clips(clip_files=)`; the child never sees the output or its credentials); the
  parent checks the name the child gives and stores the finished file (`store_clip`), then deletes it.

- Where: `<run>/_clips/<clip_file_name(media_uri, clip index)>.<format>` (`clips_folder`), local or s3://
  (fsspec, the output's storage options). The folder's `_` keeps it out of a Parquet reader's view of the
  run folder (pyarrow's dataset discovery, Spark, DuckDB skip `_` and `.` names), so the README's
  `ds.dataset(run, format="parquet")` reads the rows only. Runs written before kept them in `<run>/clips/`
  (`LEGACY_CLIPS_DIR`): their rows' `clip_uri` still names those files, and a start cleans debris in both.
  The name hashes the media's URI and the clip's index, so it is the same on every run of the job (the
  clip rule is in the run id) and shared by rows of one video.
- What: every decoded picture of the clip, frames [start, end) of the source in presentation order, so
  the cut is frame-exact. The source's frame rate and time base are kept; timestamps are *relative*: the
  file's first frame is at 0 s, frame j at its source timestamp minus the clip's first (the row's
  `clip_start_s` says where the clip starts in the source). Display rotation is kept.
- Atomic: `ClipWriter` streams frames one by one into the encoder, writing a local temporary file
  (`<name>.<32 hex>.vlbatch-tmp`, then `os.replace`); `store_clip` publishes it (local output: moved to
  `<name>.<32 hex>.vlbatch-tmp` beside the final name, then `os.replace`; object storage: one PUT via
  `storage.put_atomic`). A failure deletes the temporary file: never a half file under the final name.
- Resume: a file already under the final name is not rewritten (`ClipTarget.exists`): a clip whose rows
  were not committed when a run stopped gets the file the earlier run finished. A killed writer's
  temporary file is deleted when the next run opens (`clean_debris` of each of `clip_folders`, from
  `pipeline/graph.py`).

Failures (the decision): the clip's caption does not depend on its file. An encode the codec refuses (a
`MediaError`: e.g. a size the codec cannot take) leaves the clip's rows ok with `clip_uri` null and logs
one warning naming the media, the clip and the codec's message (`vlbatch.clip_files` logger, the CPU
actor's log); rerunning with another codec does not redo those committed rows. A storage failure (a
`StorageError` that outlasted the retries, an `OSError` of the local disk) makes the clip's rows error rows
under that error's name, which a resumed run redoes (transient), file included, so no clip file is
silently lost to a passing outage; the video's other clips go on.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from vlbatch.operators.errors import MediaError, StorageError
from vlbatch.operators.storage import StorageOptions, filesystem, join
from vlbatch.operators.storage.io import TMP_MARK, put_atomic

_TUNED = ("libx264", "libx265")  # encoders that take `crf` and `preset` (others: their own defaults)
# a killed writer's temporary file beside the final names (local output): `<32 hex>.<format>.<32 hex>.vlbatch-tmp`
_DEBRIS = re.compile(r"^[0-9a-f]{32}\.[a-z0-9]+\.[0-9a-f]{32}" + re.escape(TMP_MARK) + "$")
CLIPS_DIR = "_clips"  # the run's clip files, under the run folder (module docstring: why `_`)
LEGACY_CLIPS_DIR = "clips"  # where runs written before `CLIPS_DIR` kept them


@dataclass(frozen=True)
class ClipFileSettings:
    """`output.clip_files` (pipeline/config/storage.py `ClipFilesSection`)."""

    format: str = "mp4"
    codec: str = "libx264"
    crf: int = 23
    preset: str = "veryfast"


def codec_problem(name: str) -> str | None:
    """None when PyAV here can encode video with codec `name`; else why not."""
    import av

    if name not in av.codecs_available:
        return f"{name!r} is not a codec this FFmpeg build has"
    try:
        codec = av.Codec(name, "w")
    except Exception:  # noqa: BLE001 - a decoder only
        return f"{name!r} has no encoder in this FFmpeg build"
    if codec.type != "video":
        return f"{name!r} is a {codec.type} codec, not a video one"
    return None


def clips_folder(run_dir: str) -> str:
    """Where a run's clip files go: `<run>/_clips` (`run_dir`: the run folder, local or s3://)."""
    return join(run_dir.rstrip("/"), CLIPS_DIR)


def clip_folders(run_dir: str) -> tuple[str, str]:
    """Every folder of `run_dir` that may hold its clip files: `clips_folder`, then the legacy one."""
    return clips_folder(run_dir), join(run_dir.rstrip("/"), LEGACY_CLIPS_DIR)


def clip_file_name(media_uri: str, clip_index: int) -> str:
    """32 hex chars of sha256 over the media's URI and the clip's index: stable across runs."""
    return hashlib.sha256(f"{media_uri}\x1fclipfile\x1f{clip_index}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ClipTarget:
    """Where a run's clip files go: `folder` (`clips_folder(run)`, local path or s3:// URI), how they are
    encoded and the storage options of the output."""

    folder: str
    settings: ClipFileSettings
    storage: StorageOptions

    def uri_of(self, name: str) -> str:
        return join(self.folder, f"{name}.{self.settings.format}")

    def exists(self, uri: str) -> bool:
        fs, path = filesystem(uri, self.storage)
        return fs.exists(path)

    def remove(self, uri: str) -> None:
        """Delete the stored clip file `uri` (its clip ended as an error row); only a file of this folder,
        and one already gone is fine. `StorageError` when the output cannot be reached."""
        if not uri.startswith(self.folder.rstrip("/") + "/"):
            raise MediaError(f"{uri!r} is not a clip file of {self.folder}")
        fs, path = filesystem(uri, self.storage)
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"cannot delete the clip file {uri}: {e}") from e


def clean_debris(folder: str, storage: StorageOptions) -> int:
    """Delete the temporary files a killed writer left in the local clips `folder` (only names of that
    form: `_DEBRIS`) -> how many. Called before a run's workers start (none writes then); object
    storage has none (a clip is uploaded in one PUT)."""
    if not _is_local(folder):
        return 0
    _, path = filesystem(folder, storage)
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    gone = 0
    for name in names:
        if _DEBRIS.match(name):
            try:
                os.unlink(os.path.join(path, name))
                gone += 1
            except FileNotFoundError:
                pass
    return gone


def _is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith(("file://", "local://"))


class ClipWriter:
    """One clip file: `add(frame)` per decoded picture (PyAV `VideoFrame`s with their source `pts` and
    `time_base`), `close()` -> the final URI, or `abort()`. Holds only the encoder's own look-ahead."""

    def __init__(self, target: ClipTarget, name: str, *, rate: Fraction, time_base: Fraction, width: int,
                 height: int, rotation: int = 0):
        import av

        self.target, self.uri = target, target.uri_of(name)
        self.time_base, self.first_pts = time_base, None
        if _is_local(self.uri):
            _, final = filesystem(self.uri, target.storage)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            self.tmp = f"{final}.{uuid.uuid4().hex}{TMP_MARK}"
        else:
            fd, self.tmp = tempfile.mkstemp(suffix=f".{target.settings.format}{TMP_MARK}")
            os.close(fd)
        self.out = av.open(self.tmp, "w", format=target.settings.format)
        try:
            self.stream = self._stream(rate, width, height, rotation)
        except BaseException:
            self.abort()
            raise

    def _stream(self, rate: Fraction, width: int, height: int, rotation: int):
        s = self.target.settings
        stream = self.out.add_stream(s.codec, rate=rate)
        stream.width, stream.height = width, height
        # 4:2:0 takes even sizes only; odd ones keep every sample in 4:4:4
        stream.pix_fmt = "yuv420p" if width % 2 == 0 and height % 2 == 0 else "yuv444p"
        stream.codec_context.time_base = self.time_base  # the source's: its timestamps survive as they are
        stream.codec_context.thread_count = 1  # the CPU actor's one core (x264 would start 1.5 per CPU seen)
        stream.time_base = self.time_base
        if s.codec in _TUNED:
            stream.codec_context.options = {"crf": str(s.crf), "preset": s.preset}
        if rotation:
            stream.set_display_rotation(rotation)
        return stream

    def add(self, frame) -> None:
        """Encode one decoded picture, its pts made relative to the clip's first picture. The frame is
        the decode's own (clips may overlap): its pts, time base and type are put back after the
        encoder took its reference."""
        from av.video.frame import PictureType

        if frame.format.name != self.stream.pix_fmt:
            frame = frame.reformat(format=self.stream.pix_fmt)  # a new frame
        saved = (frame.pts, frame.time_base, frame.pict_type)
        pts = round(frame.pts * frame.time_base / self.time_base)
        if self.first_pts is None:
            self.first_pts = pts
        frame.pts, frame.time_base = pts - self.first_pts, self.time_base
        frame.pict_type = PictureType.NONE  # the encoder chooses its own frame types
        try:
            packets = self.stream.encode(frame)
        finally:
            frame.pts, frame.time_base, frame.pict_type = saved
        self.out.mux(packets)

    def close(self) -> str:
        """Flush, then publish the file whole under its final name -> its URI."""
        try:
            self.out.mux(self.stream.encode(None))
            self.out.close()
            if _is_local(self.uri):
                _, final = filesystem(self.uri, self.target.storage)
                os.replace(self.tmp, final)
            else:
                fs, path = filesystem(self.uri, self.target.storage)
                with open(self.tmp, "rb") as f:
                    put_atomic(fs, path, f.read(), self.target.storage)
                os.unlink(self.tmp)
        except BaseException:
            self.abort()
            raise
        return self.uri

    def abort(self) -> None:
        """Drop the temporary file (the final name never saw a byte)."""
        try:
            self.out.close()
        except Exception:  # noqa: BLE001 - already closed or broken: the file goes anyway
            pass
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def store_clip(target: ClipTarget, name: str, local: str) -> str:
    """Publish the finished local clip file `local` (the decoder child wrote it) as clip file `name` ->
    its URI, then delete `local`; a file already under the final name is kept. `local` is opened without
    following links and must be a regular file (the child may swap it after the parent checked its name).
    Local output: a temporary name beside the final one (a rename, or a copy across devices), then
    `os.replace`; object storage: one PUT (`put_atomic`). `StorageError`: the output could not be reached
    or written; `MediaError`: `local` is not a regular file."""
    uri = target.uri_of(name)
    try:
        fd = os.open(local, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        _unlink(local)
        raise MediaError(f"the decoder's clip file {os.path.basename(local)!r} cannot be opened as a file: {e}") from e
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise MediaError(f"the decoder's clip file {os.path.basename(local)!r} is not a regular file")
            if not target.exists(uri):
                _publish(target, uri, local, f)
    except OSError as e:
        raise StorageError(f"storing clip file {uri}: {e}") from e
    finally:
        _unlink(local)
    return uri


def _publish(target: ClipTarget, uri: str, local: str, f) -> None:
    """`store_clip`'s write of the open file `f` (`local`) under `uri`, whole or not at all."""
    if not _is_local(uri):
        fs, path = filesystem(uri, target.storage)
        put_atomic(fs, path, f.read(), target.storage)
        return
    _, final = filesystem(uri, target.storage)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = f"{final}.{uuid.uuid4().hex}{TMP_MARK}"
    try:
        try:
            os.rename(local, tmp)  # one device: the checked file itself (renaming never follows a link)
            if not stat.S_ISREG(os.lstat(tmp).st_mode):
                raise MediaError(f"the decoder's clip file {os.path.basename(local)!r} is not a regular file")
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            with open(tmp, "wb") as out:  # another device: copied from the file opened above
                shutil.copyfileobj(f, out)
        os.replace(tmp, final)
    except BaseException:
        _unlink(tmp)
        raise


def empty_folder(folder: str) -> None:
    """Delete everything in `folder` (the decoder child's clip files not stored: a killed child's, a refused
    name's), links as links."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:  # the worker closed already
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            _unlink(entry.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_clip(target: ClipTarget, name: str, frames: Iterable, stream, rotation: int = 0) -> str:
    """The clip file `name` of `frames` (PyAV frames of the input `stream`, in order) -> its URI; a file
    already there is kept as it is. `MediaError`: the codec refused the frames; `StorageError`: the
    output could not be reached or written."""
    import av

    uri = target.uri_of(name)
    try:
        if target.exists(uri):
            return uri
    except OSError as e:
        raise StorageError(f"cannot check for clip file {uri}: {e}") from e
    rate = stream.average_rate or stream.guessed_rate
    writer = None
    try:
        for frame in frames:
            if writer is None:
                writer = ClipWriter(target, name, rate=Fraction(rate), time_base=Fraction(frame.time_base),
                                    width=frame.width, height=frame.height, rotation=rotation)
            writer.add(frame)
        if writer is None:
            raise MediaError("the clip has no frame to write")
        return writer.close()
    except av.FFmpegError as e:
        if writer is not None:
            writer.abort()
        if isinstance(e, OSError):  # the temporary file could not be written (a full disk): storage, not codec
            raise StorageError(f"writing clip file {name}: {e}") from e
        raise MediaError(f"encoding clip file {name} with {target.settings.codec}: {e}") from e
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
