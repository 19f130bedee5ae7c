"""Progress and the run summary.

`Progress` aggregates the write stage's per-request stats rows as they arrive on the
driver, and the stages' counters (`pipeline/telemetry/meter.py`: rows decoded, preprocessed and
generated, actors ready) that the driver's `Ticker` reads every interval. On a terminal it
redraws one status line (phase, stage counts, committed rows, rows/s, visual tokens/s,
generated tokens/s, prefix-cache hit rate, errors, ETA, and once a model actor reported how busy
the model stage is and why not: `model busy 41 %: waiting on the CPU stage`); elsewhere (cron, Airflow) it prints
a timestamped log line every `ray.progress_interval_s` seconds, whether or not a row was
committed, and at the end. A change of phase (`starting the actors`, `running`) is a line of
its own at once. `update`, `observe` and `tick` may come from two threads (the graph's
iterator, the ticker): they take one lock.

A clipped run (`video.clips`, `clipped`): a video becomes one row per clip and prompt, and how many clips
it has is known only once it is decoded, so before the decode only the media count is knowable
(`media_total`: the rows the CPU stage cuts). The line then says `committed D/~E rows (media C/M cut, K
clips so far)`: E estimates the rows as the requests decoded so far per media cut, times `media_total`;
the ETA counts against E. `total`, when set (the end of the run), is the exact row count.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO

import pyarrow as pa

from vlbatch.pipeline.telemetry.meter import (
    CLIPS,
    CPU_READY,
    CPU_WINDOW_S,
    DECODED,
    MEDIA_CUT,
    MODEL_OCCUPANCY,
    MODEL_READY,
)
from vlbatch.pipeline.telemetry.occupancy import Occupancy, cpu_busy_fraction


def _fmt_eta(s: float | None) -> str:
    if s is None:
        return "--:--"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def token_histogram(values, into: Counter | None = None) -> Counter:
    """Counts per power-of-two bucket ('<lo>-<2lo>' holds lo <= v < 2lo; '0'); nulls skipped."""
    out = Counter() if into is None else into
    for v in values:
        if v is not None:
            v = int(v)
            out["0" if v == 0 else f"{1 << (v.bit_length() - 1)}-{1 << v.bit_length()}"] += 1
    return out


@dataclass
class Progress:
    total: int | None  # requests to do; None until known (a fresh run counts them beside the graph)
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    interval_s: float = 10.0
    tty: bool | None = None
    clock: callable = time.monotonic
    done: int = 0
    visual_tokens: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    vision_hits: int = 0
    vision_encodes: int = 0
    status: Counter = field(default_factory=Counter)
    error_types: Counter = field(default_factory=Counter)
    files: set = field(default_factory=set)
    prompt_hist: Counter = field(default_factory=Counter)  # prompt tokens per request (token_histogram)
    visual_hist: Counter = field(default_factory=Counter)  # visual tokens per request
    # actor-seconds per stage (decode, preprocess, model; model_cpu: CPU s of the engine thread)
    stage_s: Counter = field(default_factory=Counter)
    quality: Counter = field(default_factory=Counter)  # ok answers per quality flag (operators/quality.py)
    counts: dict = field(default_factory=dict)  # the stages' counters (pipeline/telemetry/meter.py), latest snapshot
    phase: str | None = None  # what the run is doing while nothing is committed (None: running)
    expect_models: int | None = None  # model actors the phase waits for (None: no model stage)
    clipped: bool = False  # video.clips: rows are per clip, their total unknown before the decode (module doc)
    media_total: int | None = None  # a clipped run: the media rows the CPU stage cuts (None: not known)

    def __post_init__(self):
        if self.tty is None:
            self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = self.clock()
        self._last = self.start
        self._logged: int | None = None  # rows counted in the last log line
        self.first_at: float | None = None
        self.first_rows = 0  # rows of the first commit
        self.last_at: float | None = None  # time of the latest commit
        self._lock = threading.RLock()
        self.model_ready_at: float | None = None

    def set_phase(self, phase: str | None, *, sticky: bool = True) -> None:
        """A new phase: one line at once (`[vlbatch] <phase>`, on a terminal too); `sticky`: later
        progress lines carry it until the next phase (None: running, no label)."""
        with self._lock:
            if phase is not None and phase != self.phase:
                self.stream.write(("\r\x1b[K" if self.tty else "") + f"[vlbatch] {phase}\n")
                self.stream.flush()
            self.phase = phase if sticky else None

    def set_total(self, total: int) -> None:
        with self._lock:
            self.total = total

    def observe(self, counts: dict) -> None:
        """The meter's latest counters; the start-up phase ends when a model actor is ready."""
        with self._lock:
            self.counts = dict(counts)
            if self.expect_models is None:
                return
            ready, n = self.counts.get(MODEL_READY, 0), self.expect_models
            if self.phase is None:
                return
            if ready:
                self.model_ready_at = self.clock()  # seen by the ticker: within its period of the load's end
                self.set_phase(f"running: {min(ready, n)}/{n} model actors ready", sticky=False)
            else:  # the label of the periodic lines until then
                self.phase = f"starting the actors, loading the model: 0/{n} model actors ready"

    def update(self, stats: pa.Table) -> None:
        with self._lock:
            self._update(stats)

    def _update(self, stats: pa.Table) -> None:
        d = stats.to_pydict()
        n = stats.num_rows
        now = self.clock()
        if self.first_at is None:  # start-up (Ray actors, model load) ends with the first commit
            self.first_at, self.first_rows = now, n
        self.last_at = now
        self.done += n
        self.status.update(d["status"])
        self.error_types.update(t for t in d["error_type"] if t)
        self.generated_tokens += sum(x or 0 for x in d["generated_tokens"])
        self.prompt_tokens += sum(x or 0 for x in d["prompt_tokens"])
        self.cached_tokens += sum(x or 0 for x in d["cached_tokens"])
        # per request: a media asked three questions counts its visual tokens three times (prompt tokens)
        self.visual_tokens += sum(x or 0 for x in d["visual_tokens"])
        self.vision_hits += sum(x or 0 for x in d.get("vision_hits", []))
        self.vision_encodes += sum(x or 0 for x in d.get("vision_encodes", []))
        for k in ("decode_s", "preprocess_s", "model_s", "model_cpu_s"):
            self.stage_s[k.removesuffix("_s")] += sum(x or 0.0 for x in d.get(k, []))
        token_histogram(d["prompt_tokens"], self.prompt_hist)
        token_histogram(d["visual_tokens"], self.visual_hist)
        self.files.update(f for f in d["file"] if f)
        self.quality.update(f for flags in d.get("quality_flags", []) if flags for f in flags)
        self.tick()

    @property
    def elapsed(self) -> float:
        return max(1e-9, self.clock() - self.start)

    def row_total(self) -> tuple[int | None, bool]:
        """(rows to do, exact): `total`; a clipped run without it: the requests decoded per media cut so far
        times `media_total` (an estimate; None before the first media is cut)."""
        if self.total is not None or not self.clipped:
            return self.total, True
        cut = self.counts.get(MEDIA_CUT, 0)
        if not cut or self.media_total is None:
            return None, False
        return max(round(self.counts.get(DECODED, 0) * max(self.media_total, cut) / cut), self.done), False

    def rates(self) -> dict:
        e = self.elapsed
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        # the ETA counts generated rows too: before the first commit, and while the writer holds rows
        basis = max(self.done, self.counts.get("generated", 0))
        total, _ = self.row_total()
        left = None if total is None else max(0, total - basis)
        rps = self.done / e
        brps = basis / e
        return {"rows_per_s": rps, "visual_tokens_per_s": self.visual_tokens / e,
                "generated_tokens_per_s": self.generated_tokens / e, "prefix_cache_hit_rate": hit,
                "vision_cache_hit_rate": (self.vision_hits / lookups
                                          if (lookups := self.vision_hits + self.vision_encodes) else 0.0),
                "eta_s": (left / brps) if brps > 0 and left is not None else None, **self.startup()}

    def startup(self) -> dict:
        """Start-up time: from the start to the first committed batch (actors, model load, pipeline fill),
        and the steady-state rate after it: rows committed after the first commit / the time between
        the first and the last commit (None until a second commit)."""
        steady = None
        if self.first_at is not None and self.last_at is not None and self.last_at > self.first_at:
            steady = (self.done - self.first_rows) / (self.last_at - self.first_at)
        return {"time_to_first_row_s": None if self.first_at is None else self.first_at - self.start,
                "steady_rows_per_s": steady}

    def model_actors(self, final: bool = False) -> list[dict]:
        """Each model actor's occupancy (`ActorOccupancy.to_json`, this run's rates beside), from the meter;
        `final`: as of each actor's last call (`ActorOccupancy.final`)."""
        r = self.rates()
        return [(a.final() if final else a).to_json(round(r["rows_per_s"], 3), round(r["generated_tokens_per_s"], 3))
                for _, a in sorted(self.counts.get(MODEL_OCCUPANCY, {}).items())]

    def occupancy(self, final: bool = False) -> Occupancy | None:
        """The model stage's busy / waiting shares and the CPU pools' busy share (None: no model report)."""
        cpu = cpu_busy_fraction(self.stage_s["decode"] + self.stage_s["preprocess"], self.counts.get(CPU_READY, 0),
                                self.counts.get(CPU_WINDOW_S, 0.0))
        return Occupancy.of(self.model_actors(final), cpu)

    def line(self) -> str:
        r = self.rates()
        errs = self.status.get("error", 0)
        n, exact = self.row_total()
        total = "?" if n is None else f"{'' if exact else '~'}{n}"
        c = self.counts
        if self.clipped and self.total is None:  # what is known before the decode: media, clips so far
            media = "?" if self.media_total is None else self.media_total
            clips = c.get(CLIPS, 0)
            total += f" rows (media {c.get(MEDIA_CUT, 0)}/{media} cut, {clips} clip{'' if clips == 1 else 's'} so far)"
        else:
            total += " rows"
        stages = (f"decoded {c.get('decoded', 0)}  preprocessed {c.get('preprocessed', 0)}  "
                  f"generated {c.get('generated', 0)}  committed ")
        phase = f"[{self.phase}] " if self.phase else ""
        return (f"{phase}{stages}{self.done}/{total}  {r['rows_per_s']:.2f} rows/s  "
                f"vis {r['visual_tokens_per_s']:.0f} tok/s  gen {r['generated_tokens_per_s']:.1f} tok/s  "
                f"prefix-hit {r['prefix_cache_hit_rate']:.0%}  errors {errs}  ETA {_fmt_eta(r['eta_s'])}"
                + (f"  {occ.text()}" if (occ := self.occupancy()) is not None else ""))

    def tick(self, final: bool = False) -> None:
        with self._lock:
            self._tick(final)

    def _tick(self, final: bool) -> None:
        now = self.clock()
        if self.tty:
            if final or now - self._last >= 0.2:
                self.stream.write("\r\x1b[K" + self.line() + ("\n" if final else ""))
                self.stream.flush()
                self._last = now
        elif (final and self._logged != self.done) or now - self._last >= self.interval_s:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            self.stream.write(f"{stamp} vlbatch progress: {self.line()}\n")
            self.stream.flush()
            self._last = now
            self._logged = self.done
