"""A response format's grammar compiled under a budget, in a child process the deadline can kill.

Why a process: xgrammar's `compile_grammar` is one C++ call. It releases the GIL (other threads run), but
nothing stops it: a JSON schema with a 100,000-value enum compiled for minutes (and gigabytes) inside the
model actor, and a thread left running it would keep its core and memory after its deadline. A child
process is killed at the deadline and takes what it held with it.

`GrammarBudget` (`model.engine.grammar` in the job config): a format's source above `max_bytes` is refused
before anything compiles it (`size_problem`); one that does not compile within `compile_s` is refused
(`InputError`, permanent: it would time out again). The same budget, the same child: `vlbatch validate`
(`pipeline/plan/checkpoint.response_format_problems`, the checkpoint's tokenizer) and the engine at run
time (`grammar.GrammarBook`, off the engine loop's thread).

`ChildCompiler`: one child (`grammar_child.py`, its wire format there) started on the first compile and
kept for the next ones, one compile at a time; killed when a compile passes the deadline (the next compile
starts a new one: about 3 s, the child imports xgrammar and torch), and by `close()`; it dies with its
parent. The deadline counts from the moment the child has the format (its start-up is not the format's).
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass

from vlbatch.operators.engine.request import ResponseFormat
from vlbatch.operators.errors import EngineError, InputError

CHILD = "vlbatch.operators.engine.grammar_child"
START_S = 300.0  # the child's start (imports) may take this long on a loaded machine: EngineError past it


@dataclass(frozen=True)
class GrammarBudget:
    """compile_s: seconds one format's grammar may take to compile; max_bytes: the largest format source
    (a schema's JSON text, a pattern, the choices' JSON) compiled at all."""

    compile_s: float = 10.0
    max_bytes: int = 128 << 10

    def __post_init__(self):
        if not self.compile_s > 0 or self.max_bytes < 1:
            raise ValueError(f"grammar budget: compile_s must be > 0 and max_bytes >= 1, got {self}")


def size_problem(fmt: ResponseFormat, budget: GrammarBudget) -> str | None:
    """The message when `fmt`'s source is over `budget.max_bytes` (nothing compiled), else None."""
    n = len(fmt.spec.encode())
    if n <= budget.max_bytes:
        return None
    return (f"the {fmt.kind} response format is {n} bytes, over the grammar budget of {budget.max_bytes} bytes "
            "(model.engine.grammar.max_bytes)")


def timeout_problem(fmt: ResponseFormat, budget: GrammarBudget) -> str:
    return (f"the {fmt.kind} response format did not compile within the grammar budget of {budget.compile_s:g} s "
            "(model.engine.grammar.compile_s)")


class ChildCompiler:
    """Compiles formats in one killable child (module docstring). `tokenizer`: what the child compiles
    against: {"info": xgrammar TokenizerInfo JSON} (the engine's), {"dir": checkpoint folder,
    "vocab_size": V, "stop_ids": [...]} (validate), or None: tokenizer-free (the grammar only). Not
    thread-safe: one caller (the engine's compile thread, or validate)."""

    def __init__(self, tokenizer: dict | None, budget: GrammarBudget):
        self.tokenizer, self.budget = tokenizer, budget
        self._proc: subprocess.Popen | None = None

    def compile(self, fmt: ResponseFormat) -> str | None:
        """`fmt`'s compiled grammar as xgrammar's JSON (None when tokenizer-free); InputError when it is
        over the budget or refused, EngineError when the child cannot start."""
        if (why := size_problem(fmt, self.budget)) is not None:
            raise InputError(why)
        proc = self._started()
        answer, killed = self._exchange(proc, {"kind": fmt.kind, "spec": fmt.spec}, self.budget.compile_s)
        if killed:
            self._reap()
            raise InputError(timeout_problem(fmt, self.budget))
        if answer is None:  # the child died on this format (xgrammar aborts when memory runs out)
            code = self._reap()
            raise InputError(f"the {fmt.kind} response format killed the grammar compiler (exit code {code})")
        if answer.get("error"):
            raise InputError(answer["error"])
        return answer.get("compiled")

    def close(self) -> None:
        """Kill the child (if any)."""
        self._reap()

    def _started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._reap()
        self._proc = subprocess.Popen([sys.executable, "-m", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        answer, _ = self._exchange(self._proc, {"tokenizer": self.tokenizer}, START_S)
        if answer is None or not answer.get("ready"):
            code = self._reap()
            raise EngineError(f"the grammar compiler process did not start (exit code {code}): "
                              f"{(answer or {}).get('error') or 'no answer'}")
        return self._proc

    @staticmethod
    def _exchange(proc: subprocess.Popen, message: dict, limit_s: float) -> tuple[dict | None, bool]:
        """Send one line, read the answer line, killing the child at `limit_s` -> (the answer or None
        when the child ended without one, whether the deadline killed it)."""
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            proc.kill()

        timer = threading.Timer(limit_s, kill)
        timer.daemon = True
        timer.start()
        try:
            proc.stdin.write(json.dumps(message) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        finally:
            timer.cancel()
        if killed.is_set():
            return None, True
        try:
            return (json.loads(line) if line else None), False
        except ValueError:
            return None, False

    def _reap(self) -> int | None:
        """Kill and wait for the child -> its exit code (None: there was none)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        return code
