"""Where a run's own log files live: a folder of the user's state directory named by run id.

    $VLBATCH_STATE_DIR, else $XDG_STATE_HOME/vlbatch, else ~/.local/state/vlbatch
      runs/<run_id>/driver-stderr.log   what Ray writes to the driver's fd 2 and its worker-log lines
      runs/<run_id>/error.log           a failed run's full error (Ray's tracebacks)

Per user (their home, the folder made 0700) and per run id: two jobs whose config files share a name,
or two users on one machine, never write over each other's logs. `vlbatch inspect` names the folder
when it exists on the machine it runs on. A run id is a single safe path segment (the config checks
`output.run_id`; derived ids are `run-<hex>` / `vlb-<name>-<slot>`); anything else is refused here too.
"""
from __future__ import annotations

import os
from pathlib import Path

STATE_VAR = "VLBATCH_STATE_DIR"


def state_dir() -> Path:
    """The user's vlbatch state folder (module docstring)."""
    if os.environ.get(STATE_VAR):
        return Path(os.environ[STATE_VAR]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "vlbatch"


def run_log_dir(run_id: str) -> Path:
    """`runs/<run_id>` under the state folder (not created)."""
    if not run_id or run_id in (".", "..") or "/" in run_id or "\\" in run_id or "\0" in run_id:
        raise ValueError(f"not a run id: {run_id!r}")
    return state_dir() / "runs" / run_id


def made(folder: Path) -> Path:
    """`folder`, created if missing, the user's alone (0700: logs may quote paths and prompts)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def driver_stderr_path(log_dir: Path) -> Path:
    return log_dir / "driver-stderr.log"


def error_log_path(log_dir: Path) -> Path:
    return log_dir / "error.log"
