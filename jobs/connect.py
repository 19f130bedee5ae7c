"""Which Ray `vlbatch run` uses, reaching it, and keeping Ray's console noise off the terminal.

Which Ray: ``--address``, else the config's ``ray.address``, else ``RAY_ADDRESS`` (set by Ray
for submitted jobs, so they run on their cluster); without any of them (or with ``local``)
a new local Ray is started for this run and shut down with it. A Ray already running on
this machine (another user's, say) is never joined unless asked for (``--address auto``).

Reaching it: before `ray.init` (whose connect has no useful timeout: ~20 s of retries, or
forever on a port that accepts and never answers) the GCS address is probed: a TCP connect
and an HTTP/2 handshake (the GCS and the Ray Client server are gRPC servers), each bounded
by `PROBE_TIMEOUT_S`; once it passes, Ray's connect retries are cut to `JOIN_CONNECT_TRIES`
(``RAY_gcs_server_port_wait_time_s``, unless already set). A refused, silent or non-gRPC port,
and Ray's own connect errors (token authentication refused, ...), become
`ClusterUnreachableError` (exit 5), one line.

Noise (`quiet_ray`, the default; ``vlbatch run --verbose`` shows it): Ray's Python loggers
print ERROR and above only, Ray Data's console handler CRITICAL only (its log file,
``ray-data.log`` in the session's logs, keeps everything), and what C++ code writes straight
to file descriptor 2 (the driver's core-worker ERROR lines, gRPC) goes to a file
(the run's `driver-stderr.log`, jobs/run_logs.py) instead of the terminal, as do the cluster's
error messages Ray's driver prints on stdout (``(raylet) ... Traceback``); Ray's C++ loggers keep their own log files.
Python's own `sys.stderr` (our progress and error lines, tracebacks) still reaches the terminal.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vlbatch.jobs.errors import ClusterUnreachableError

PROBE_TIMEOUT_S = 5.0
JOIN_CONNECT_TRIES = 10  # Ray's connect attempts (about 1 s each) once the probe has passed
# HTTP/2 client connection preface + an empty SETTINGS frame; a gRPC server answers with its SETTINGS.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_SETTINGS = 0x04
_RUNTIME_ENV = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
# a new local Ray's processes export their metrics every 2 s (Ray's default: 10 s): its endpoint ends with the
# run, which waits for its final values to be exported first (pipeline/telemetry/metrics.py `wait_exported`)
LOCAL_SYSTEM_CONFIG = {"metrics_report_interval_ms": 2000}


@dataclass(frozen=True)
class RayTarget:
    """The Ray a run uses: `address` None = a new local Ray started for it."""

    address: str | None

    @classmethod
    def choose(cls, address: str | None) -> RayTarget:
        """`address` (``--address`` or ``ray.address``), else ``RAY_ADDRESS``, else a new local Ray."""
        addr = address or os.environ.get("RAY_ADDRESS") or None
        return cls(None if addr in (None, "local") else addr)

    def gcs_host_port(self) -> tuple[str, int] | None:
        """(host, port) to probe; None when there is nothing to probe (local, ``auto``, no port)."""
        if self.address is None or self.address == "auto":
            return None
        hostport = self.address.removeprefix("ray://").split("/", 1)[0]
        host, sep, port = hostport.rpartition(":")
        if not sep or not port.isdigit():
            return None
        return host.strip("[]") or "127.0.0.1", int(port)


def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ClusterUnreachableError unless a gRPC (HTTP/2) server answers at host:port."""
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        raise ClusterUnreachableError(f"cannot reach Ray at {where}: no answer to a TCP connect "
                                      f"within {timeout_s:g}s") from None
    except OSError as e:
        raise ClusterUnreachableError(f"cannot reach Ray at {where}: {e.strerror or e}") from None
    with sock:
        try:
            sock.settimeout(timeout_s)
            sock.sendall(_H2_PREFACE)
            head = sock.recv(9)  # one HTTP/2 frame header: length(3) type(1) flags(1) stream(4)
        except TimeoutError:
            raise ClusterUnreachableError(f"cannot reach Ray at {where}: the port accepts connections but "
                                          f"did not answer within {timeout_s:g}s (not a Ray GCS port?)") from None
        except OSError as e:
            raise ClusterUnreachableError(f"cannot reach Ray at {where}: {e.strerror or e}") from None
    if len(head) < 4 or head[3] != _H2_SETTINGS:
        raise ClusterUnreachableError(f"cannot reach Ray at {where}: the port does not speak gRPC "
                                      "(not a Ray GCS port? the dashboard port is for `vlbatch submit`)")


def _reason(exc: BaseException) -> str:
    """One line out of Ray's chained connect errors (the innermost cause says why)."""
    from ray.exceptions import AuthenticationError

    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    text = "\n".join(str(e) for e in chain)  # Ray puts an inner traceback into the message text
    if any(isinstance(e, AuthenticationError) for e in chain) or "InvalidAuthToken" in text:
        return ("the cluster uses token authentication and refused us (set RAY_AUTH_MODE=token and "
                "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to its token)")
    inner = str(chain[-1])
    lines = [ln.strip() for ln in inner.splitlines() if ln.strip()]
    if not lines:
        return type(chain[-1]).__name__
    return lines[-1] if "Traceback (most recent call last)" in inner else lines[0]  # the inner error's line


def connect_said(target: RayTarget, *, verbose: bool = False) -> str:
    """`connect`, between the run's two lines about it (`[vlbatch] starting Ray`, `[vlbatch] ray: <where>`)."""
    print("[vlbatch] starting Ray", flush=True)
    where = connect(target, verbose=verbose)
    print(f"[vlbatch] ray: {where}", flush=True)
    return where


def connect(target: RayTarget, *, verbose: bool = False) -> str:
    """Connect this process to `target`; returns the line saying which cluster it uses.

    Raises ClusterUnreachableError when a cluster to join cannot be reached or refuses us.
    """
    import ray

    level = logging.INFO if verbose else logging.ERROR
    kwargs = {"log_to_driver": verbose, "logging_level": level}
    if target.address is None:
        from vlbatch.pipeline.telemetry.metrics import node_endpoint

        _init(ray, runtime_env=_RUNTIME_ENV, _system_config=LOCAL_SYSTEM_CONFIG, **kwargs)
        where = node_endpoint()
        metrics = f"; metrics: {where}" if where else ""
        return f"new local cluster ({ray.cluster_resources().get('CPU', 0):g} CPUs{metrics})"
    hp = target.gcs_host_port()
    if hp is not None:
        probe(*hp)
    # The GCS answered: Ray's ~20 one-second connect retries (for a GCS still starting) would
    # only delay a refusal (token auth); 10 unless the operator set this Ray knob.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(JOIN_CONNECT_TRIES))
    try:
        _init(ray, address=target.address, **kwargs)
    except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as e:
        raise ClusterUnreachableError(f"cannot connect to Ray at {target.address}: {_reason(e)}") from None
    return target.address


def _init(ray, **kwargs) -> None:
    """`ray.init(**kwargs)`, then SIGINT / SIGTERM are ours again (`jobs/stops.arm`: ray.init sets its own
    SIGTERM handlers, Python's `sys.exit(15)` at its start and `sys.exit(1)` once its node is up). A SIGTERM
    while it runs reaches one of those, and `ray.init` exits only from them: the `SystemExit` is the
    `Interrupted` it was (exit 143 and the one line, jobs/stops.py), not exit 15 / 1 with no word."""
    from vlbatch.jobs.stops import Interrupted, arm

    try:
        ray.init(**kwargs)
        arm()
    except SystemExit:
        raise Interrupted(signal.SIGTERM) from None


def _quiet_ray_data() -> None:
    """Ray Data's console handler: CRITICAL only (its file handler, not a stream, keeps the rest). Its
    ERROR lines are a failed run's stack traces ("please open an issue on the Ray project"), which
    `jobs/failures.py` turns into one line naming the cause."""
    import ray.data  # noqa: F401 - configures the "ray.data" logger

    for h in logging.getLogger("ray.data").handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.setLevel(logging.CRITICAL)


@contextlib.contextmanager
def quiet_ray(path: Path, verbose: bool) -> Iterator[None]:
    """Keep Ray's console noise off the terminal for the block (see the module docstring): into the file
    `path`, a run's driver-stderr.log (`jobs/run_logs.driver_stderr_path`, in a folder the caller made)."""
    if verbose:
        yield
        return
    sys.stderr.flush()
    saved_fd = os.dup(2)
    saved_stderr = sys.stderr
    uses_fd2 = _fileno(sys.stderr) == 2
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if uses_fd2:  # Python's own stderr keeps the terminal: a new file object on a copy of fd 2
            sys.stderr = os.fdopen(os.dup(saved_fd), "w", buffering=1, encoding=saved_stderr.encoding,
                                   errors=saved_stderr.errors)
        os.dup2(log_fd, 2)
        _quiet_ray_data()
        restore = _raylet_messages_to(path)
        yield
    finally:
        if "restore" in locals():
            restore()
        if uses_fd2:  # flushed, not closed: a Ray thread may still hold it
            sys.stderr.flush()
            sys.stderr = saved_stderr
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        os.close(log_fd)


RAY_ERROR_THREAD = "ray_listen_error_messages"  # the driver thread that prints the cluster's error messages


# A line of Ray's worker-log printer (`(raylet) ...`, `(MapWorker(...) pid=123, ip=...) ...`,
# `(autoscaler +1s) ...`), colour codes dropped: printed on the driver's own thread too, when ray.shutdown
# flushes the lines its deduplicator held (`... [repeated 15x across cluster]`, seen after a Ctrl-C).
RAY_LINE = re.compile(r"\((?:raylet|autoscaler \+[^)]*|[^\n]*?pid=\w+)(?:, ip=[^)]*)?\) ")


class _Diverted:
    """A stream for the block: what Ray's error-listener thread writes, and Ray's worker-log lines
    from any thread, go to `log` (colour codes dropped); everything else to `stream` as before."""

    _ANSI = re.compile(r"\x1b\[[0-9;]*m")

    def __init__(self, stream, log):
        self._stream, self._log = stream, log
        self._newline_owed = False  # print() writes its "\n" apart: it follows a diverted line
        for name in ("isatty", "fileno"):  # the real stream's, bound once (asked by every progress line)
            if hasattr(stream, name):
                setattr(self, name, getattr(stream, name))

    def write(self, text: str) -> int:
        plain = self._ANSI.sub("", text)
        ours = threading.current_thread().name == RAY_ERROR_THREAD or RAY_LINE.match(plain) is not None
        if ours or (self._newline_owed and text == "\n"):
            self._newline_owed = ours and not text.endswith("\n")
            return self._log.write(plain)
        self._newline_owed = False
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()
        self._log.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the real stream's
        return getattr(self._stream, name)


def _raylet_messages_to(path: Path):
    """Ray's driver prints the errors the cluster publishes (``(raylet) Task ... failed ... Traceback``,
    an actor's death) on sys.stdout from its error-listener thread, whatever ``log_to_driver`` says,
    and at `ray.shutdown` the worker-log lines its deduplicator held, on sys.stdout / sys.stderr: send
    them to the log file `path` instead; -> a function that undoes it."""
    log = path.open("a", buffering=1)
    saved_out, saved_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Diverted(saved_out, log), _Diverted(saved_err, log)

    def restore() -> None:
        if isinstance(sys.stdout, _Diverted):
            sys.stdout = saved_out
        if isinstance(sys.stderr, _Diverted):
            sys.stderr = saved_err
        log.flush()  # not closed: the listener thread may still write to it

    return restore


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
