"""What a run that failed inside Ray says on the terminal: one line naming the cause and the field,
a distinct exit code; Ray's detail (its tracebacks, hundreds of lines) goes to a log file.

    vlbatch: the model stage could not start (model.path=/m): ConfigError: tensor_parallel_size=2 must
    divide linear_num_key_heads=3 (uneven splits are not supported); details:
    ~/.local/state/vlbatch/runs/run-0a1b2c3d4e5f/error.log

The cause is the innermost error: a `VlbatchError` in the exception's chain (Ray Data re-raises a
UDF's exception with its cause), else the last exception line of Ray's text that is not one of
Ray's envelopes (`UserCodeException: UDF failed ...`; a streamed graph's `ObjectRefStreamEndOfStreamError` has
no message at all), e.g. `StorageError: no space left on <folder>` from the write stage (an actor whose
constructor raised reaches the driver as `ActorDiedError`, the constructor's traceback only in
its message). Exit codes (jobs/errors.py): a `ConfigError` cause (the checkpoint, a kernel the
device lacks: `SetupError`) is a bad config, 2; anything else that kept an actor from starting
(model or processor load, an s3 download, out of memory) or every node that could hold a stage's
actor lost mid-run (`NodesLostError`: "the model stage lost its nodes") is `EXIT_SETUP_FAILED`, 8; any other
failure of the run is 1.
"""
from __future__ import annotations

import importlib
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

from vlbatch.jobs.errors import EXIT_JOB_FAILED, EXIT_SETUP_FAILED, EXIT_USAGE
from vlbatch.operators.errors import ActorStartError, ConfigError, NodesLostError, VlbatchError

# "pkg.mod.SomeError: message" (the last line of a Python traceback); group 1 the dotted name
_EXC_LINE = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))(?:: (.*))?$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAGE = re.compile(r"MapBatches\((\w+)\)")
STAGES = {"ModelStage": ("model", "model.path"), "PrepareStage": ("preprocess", "model.path"),
          "PreprocessStage": ("preprocess", "model.path"), "DecodeStage": ("decode", "input.uri"),
          "WriteStage": ("write", "output.uri"), "ScanStage": ("scan", "model.path")}


@dataclass(frozen=True)
class Failure:
    """The one-line account of a failed run: `cause` ("Type: message") and the exit code."""

    line: str
    exit_code: int


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and what caused it, outermost first."""
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(out) < 16 and all(e is not o for o in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _is_config(name: str) -> bool:
    """Whether the dotted exception name is one of our ConfigErrors (imported only from vlbatch.*)."""
    mod, _, cls = name.rpartition(".")
    if not mod.startswith("vlbatch."):
        return False
    try:
        return issubclass(getattr(importlib.import_module(mod), cls), ConfigError)
    except (ImportError, AttributeError, TypeError):
        return False


_WRAPPERS = ("RayTaskError", "ActorDiedError", "UserCodeException")  # Ray's envelopes, never the cause


def _from_text(text: str) -> tuple[str, bool] | None:
    """(`Type: message`, is a ConfigError) from a traceback text: its last exception line that is not one
    of Ray's envelopes (`_WRAPPERS`: Ray prints a UDF's error, then "UserCodeException: UDF failed")."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        m = _EXC_LINE.match(lines[i])
        if not m or (i and lines[i].startswith(" ")) or m.group(1).rsplit(".", 1)[-1].startswith(_WRAPPERS):
            continue
        rest = []
        for ln in lines[i + 1:]:  # the message's own lines: up to the blank line that ends it
            if not ln.strip():
                break
            rest.append(ln.strip())
        msg = "; ".join([m.group(2) or "", *rest]).strip("; ")
        return f"{m.group(1).rsplit('.', 1)[-1]}: {msg}", _is_config(m.group(1))
    return None


def cause(exc: BaseException) -> tuple[str, bool]:
    """(`Type: message` on one line, whether it is a ConfigError) of a run's failure."""
    chain = _chain(exc)
    for e in reversed(chain):  # Ray's RayTaskError of a UDF's error is an instance of it; `.cause` the original
        orig = e.cause if isinstance(getattr(e, "cause", None), VlbatchError) else e
        if isinstance(orig, VlbatchError):
            return f"{type(orig).__name__}: {'; '.join(ln.strip() for ln in str(orig).splitlines() if ln.strip())}", \
                isinstance(orig, ConfigError)
    for e in chain:  # a streamed graph ends in Ray's ObjectRefStreamEndOfStreamError (empty): the text names why
        found = _from_text(str(e))
        if found:
            return found
    last = chain[-1]
    return f"{type(last).__name__}: {' '.join(str(last).split())}", False


def describe(exc: BaseException, config, log_path: Path) -> Failure:
    """The line and exit code for `exc`, raised by the run (see the module docstring); the full
    exception with Ray's text is appended to `log_path`."""
    text = "".join(traceback.format_exception(exc))
    text += "".join(f"\n{e.stage}'s failed starts:\n{e.detail}" for e in _chain(exc) if getattr(e, "detail", ""))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as f:
        f.write(text)
    what, is_config = cause(exc)
    is_config = is_config or any(getattr(e, "config", False) is True
                                 for e in _chain(exc) if isinstance(e, ActorStartError))
    started = [e.stage for e in _chain(exc) if isinstance(e, ActorStartError)]  # no actor of a stage could start
    names = started or [n for e in _chain(exc) for n in _STAGE.findall(str(e))]
    stage, field = STAGES.get(names[0], (names[0], None)) if names else (None, None)
    init = bool(started) or any(getattr(e, "_actor_init_failed", False)
                                or "error raised in its creation task" in str(e) for e in _chain(exc))
    where = "the run failed"
    if stage:
        where = f"the {stage} stage could not start" if init else f"the {stage} stage failed"
    if stage and any(isinstance(e, NodesLostError) for e in _chain(exc)):  # mid-run: its nodes are gone
        where = f"the {stage} stage lost its nodes"
    if field and config is not None:
        section, key = field.split(".")
        where += f" ({field}={getattr(getattr(config, section), key)})"
    code = EXIT_USAGE if is_config else EXIT_SETUP_FAILED if init else EXIT_JOB_FAILED
    return Failure(f"vlbatch: {where}: {what}; details: {log_path}", code)
