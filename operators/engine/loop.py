"""`EngineLoop`: one `Engine` shared by concurrent callers, never drained between their batches.

A caller (a model-stage call on a Ray actor thread) hands a batch of requests to `run`
and blocks until every one of them has a `Result`. One daemon thread owns the engine: it
submits queued batches between steps and steps over everything submitted, so a new batch
joins the running continuous batch and one batch's slow tail overlaps the next one's
prefill. Calling `Engine.generate` per batch instead drains the batch to zero sequences at
the end of every call (the slowest request of each batch holds the engine back).

Contract:
- `run(requests, visual_tokens=None)` returns `{request id: Result}` for every request given,
  each exactly once, errors included (`finish_reason == "error"`). Requests of one call are
  submitted together (one `Engine.submit`, so siblings are planned together). A call's
  visual tokens default to `pinned_visual_tokens(requests)`: each distinct media (content
  hash) once, however many of the call's requests ask about it (they share its pixels).
- Back-pressure: a call waits before its requests enter the engine while the calls
  already in hold more than `max_visual_tokens` visual tokens (the pixel values they pin);
  a call that finds the loop empty always goes in, whatever its size. A call holding a request
  id that another call is running waits until that call has its results, then runs it again.
- Calls leave the loop in their order: queued calls are submitted to the engine only while
  its waiting queue holds fewer than `lookahead` requests (default: the engine's
  `max_num_seqs`; at least one call whenever the engine is idle). The running batch stays
  full, but the engine's first-come-first-served admission (which lets a waiting request
  pass a sibling gated on a shared prefix) cannot spread every call's requests over the
  whole backlog: with all calls submitted at once, every call of a wave finished near the
  wave's end, and a caller (a Ray task whose output is handed on only when it returns)
  held finished rows for most of the run (issue 33).
- An exception from the engine fails every request in it at that moment (error type
  `EngineError`, the message names the exception; `Result.out_of_memory` when it was torch's
  `OutOfMemoryError` or `MemoryError`, so the caller may retry in smaller batches), resets the
  engine (`abort`) and the loop goes on with later calls.
- `on_finished(n)` (optional): called on the loop thread with the number of requests each
  step finished, as they finish (progress counters; it must be cheap and must not raise).
- `busy_s`: seconds spent in `Engine.step` so far (the engine's busy time; callers'
  waits overlap, this does not); `busy_cpu_s`: the CPU seconds of the loop thread in them
  (below `busy_s` when other processes take the engine's core, or the GIL is elsewhere);
  `idle_s`: seconds the loop thread waited with nothing to do (no call queued, nothing in the
  engine): the engine waiting for input. Both on `clock` (default `time.perf_counter`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from vlbatch.operators.engine.request import Request, Result, Timings


@dataclass
class _Call:
    """One caller's batch while it is queued or in the engine (mutated under the loop's lock)."""

    requests: list[Request]
    visual_tokens: int
    pending: set[str]
    results: dict[str, Result] = field(default_factory=dict)


def pinned_visual_tokens(requests: list[Request]) -> int:
    """Visual tokens of the distinct media of `requests`: a media shared by several requests
    (one content hash) counts once, as its pixels are held once and encoded once."""
    seen: dict[str, int] = {}
    for r in requests:
        for m in r.media:
            seen.setdefault(m.content_hash, m.num_tokens)
    return sum(seen.values())


class EngineLoop:
    def __init__(self, engine, max_visual_tokens: int, on_finished=None, lookahead: int | None = None,
                 clock=time.perf_counter):
        self.engine, self.clock = engine, clock
        self.max_visual_tokens = max_visual_tokens
        self.on_finished = on_finished
        config = getattr(engine, "config", None)
        self.lookahead = lookahead or getattr(config, "max_num_seqs", None)  # None: submit every call at once
        self.busy_s = 0.0
        self.busy_cpu_s = 0.0
        self.idle_s = 0.0
        self._idle_since: float | None = None  # the clock when the current wait for work began
        self._cond = threading.Condition()
        self._queue: list[_Call] = []  # admitted, not yet submitted (the loop thread submits)
        self._owner: dict[str, _Call] = {}  # request id -> its call, from admission to its result
        self._in_tokens = 0  # visual tokens of the admitted calls not yet complete
        self._thread: threading.Thread | None = None
        self._closed = False

    def run(self, requests: list[Request], visual_tokens: int | None = None) -> dict[str, Result]:
        """Every request's `Result` (blocks until all of them finished)."""
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids of one call must be distinct")
        if visual_tokens is None:
            visual_tokens = pinned_visual_tokens(requests)
        call = _Call(list(requests), visual_tokens, set(ids))
        if not call.pending:
            return {}
        with self._cond:
            if self._closed:
                raise RuntimeError("EngineLoop is closed")
            # a request id already running (the same request from another manifest block) waits for
            # that call to finish, then runs again: the sink's seal keeps one row per id
            self._cond.wait_for(lambda: (not self._owner or self._in_tokens + visual_tokens <= self.max_visual_tokens)
                                and not any(i in self._owner for i in ids))
            self._in_tokens += visual_tokens
            self._owner.update(dict.fromkeys(ids, call))
            self._queue.append(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            self._cond.wait_for(lambda: not call.pending)
        return call.results

    def close(self) -> None:
        """Stop the loop thread once it is idle (later `run` calls raise)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # -- the loop thread (the only one touching the engine) --------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._wait_for_work()
                if self._closed and not self._queue and not self.engine.has_work:
                    return
                n = self._submittable()
                queued, self._queue = self._queue[:n], self._queue[n:]
            try:
                while queued:
                    self._deliver(self.engine.submit(queued[0].requests))
                    queued.pop(0)
                if self.engine.has_work:
                    t0, c0 = self.clock(), time.thread_time()
                    try:
                        finished = self.engine.step()
                    finally:
                        self.busy_s += self.clock() - t0
                        self.busy_cpu_s += time.thread_time() - c0
                    self._deliver(finished)
            except Exception as exc:  # noqa: BLE001 - any engine failure fails what is in it, never the loop
                self._fail_all(exc, keep=queued[1:])

    def _wait_for_work(self) -> None:
        """Wait (under the lock) until a call is queued, the engine has work or the loop closes; the wait
        counts into `idle_s` (the engine waiting for input)."""
        def ready():
            return self._queue or self.engine.has_work or self._closed

        if ready():
            return
        self._idle_since = self.clock()
        self._cond.wait_for(ready)
        self.idle_s += self.clock() - self._idle_since
        self._idle_since = None

    def idle_now(self) -> float:
        """`idle_s` with the wait in progress counted up to now (read from any thread)."""
        with self._cond:
            since = self._idle_since
            return self.idle_s + (0.0 if since is None else self.clock() - since)

    def _submittable(self) -> int:
        """How many queued calls (from the front) go to the engine now (under the lock)."""
        waiting = getattr(self.engine, "num_waiting", None)
        if self.lookahead is None or waiting is None:
            return len(self._queue)
        n = 0
        while n < len(self._queue) and (waiting < self.lookahead or (n == 0 and not self.engine.has_work)):
            waiting += len(self._queue[n].requests)
            n += 1
        return n

    def _deliver(self, results: list[Result]) -> None:
        if not results:
            return
        with self._cond:
            for res in results:
                call = self._owner.pop(res.id, None)
                if call is not None:  # None: failed earlier by _fail_all
                    self._settle(call, res)
            self._cond.notify_all()
        if self.on_finished is not None:
            self.on_finished(len(results))

    def _settle(self, call: _Call, res: Result) -> None:
        """Record one result of `call` (under the lock); a complete call frees its visual tokens."""
        call.results[res.id] = res
        call.pending.discard(res.id)
        if not call.pending:
            self._in_tokens -= call.visual_tokens

    def _fail_all(self, exc: Exception, keep: list[_Call]) -> None:
        """Fail every request the engine holds; calls never submitted (`keep`, the queue) wait on."""
        import torch

        self.engine.abort()
        message = f"engine failed: {type(exc).__name__}: {exc}"[:2000]
        oom = isinstance(exc, (torch.OutOfMemoryError, MemoryError))
        with self._cond:
            self._queue = keep + self._queue
            waiting = {id(c) for c in self._queue}
            for rid, call in list(self._owner.items()):
                if id(call) in waiting:
                    continue
                del self._owner[rid]
                req = next(r for r in call.requests if r.id == rid)
                self._settle(call, Result.failed(req, message, "EngineError", Timings(0.0, 0.0, 0.0), oom))
            self._cond.notify_all()

