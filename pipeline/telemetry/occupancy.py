"""How busy the model actors were, and what they waited for (Ray-free: the `Meter` actor and the driver use it).

Each model actor measures, on its own clock, the seconds its engine stepped (`busy_s`, `EngineLoop.busy_s`)
and the seconds its engine loop had nothing to do (`idle_s`, `EngineLoop.idle_s`: no call queued, nothing
running), over its window (`window_s`: from its first call's start to its latest call's end). It reports
these cumulative figures to the `Meter` (`ModelReport`, at most every second and at the end of each call).
The meter splits each report's new idle seconds (`ActorOccupancy.add`) by what the run held at that moment:
no row was waiting for a model actor (rows preprocessed = rows handed to a model actor) -> the model waited
on the CPU stage (`input_s`); rows were waiting but Ray Data handed none over (its back-pressure on the model
stage's output: the writer lags) -> blocked on output (`output_s`). The rest of the window (submitting,
host work between steps) is neither.

The reverse: the window's seconds while rows waited for a model actor (`backlog_s`: the CPU stage ahead
of the model, its actors held back by Ray Data's back-pressure). The CPU pools' busy share (their
actor-seconds over actors x their window, `cpu_busy_fraction`) is reported beside, for people: it counts
the model's load time, when the CPU pools have little to do in any run. `verdict` names the pool to
grow: the model waited on the CPU stage more than `WAIT_LIMIT` of its window -> the CPU pool; blocked on
output as long -> the write pool; the model busy and rows waiting for it more than `WAIT_LIMIT` -> the
model pool.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

WAIT_LIMIT = 0.30  # a pool waited on another past this share of the run: name the other one


@dataclass(frozen=True)
class ModelReport:
    """One model actor's cumulative figures (seconds on its own clock; rows and tokens it generated)."""

    actor: str
    busy_s: float
    idle_s: float
    window_s: float
    rows: int = 0
    generated_tokens: int = 0
    # the same figures at the end of the actor's latest call: a run's final figures end there (the
    # actor's wait after its last call is the run ending, not the CPU stage)
    done_busy_s: float = 0.0
    done_idle_s: float = 0.0
    done_window_s: float = 0.0


@dataclass(frozen=True)
class ActorOccupancy:
    """One model actor's latest report and its idle seconds split by cause (`add`)."""

    report: ModelReport
    input_s: float = 0.0
    output_s: float = 0.0
    backlog_s: float = 0.0  # seconds of its window while rows waited for a model actor (the CPU stage ahead)

    @classmethod
    def first(cls, report: ModelReport, rows_waiting: int) -> ActorOccupancy:
        return cls(ModelReport(report.actor, 0.0, 0.0, 0.0)).add(report, rows_waiting)

    def add(self, report: ModelReport, rows_waiting: int) -> ActorOccupancy:
        """The next report: its new idle seconds go to input (no row waiting) or output (rows waiting)."""
        new_idle = max(0.0, report.idle_s - self.report.idle_s)
        if rows_waiting > 0:
            new_window = max(0.0, report.window_s - self.report.window_s)
            return replace(self, report=report, output_s=self.output_s + new_idle,
                           backlog_s=self.backlog_s + new_window)
        return replace(self, report=report, input_s=self.input_s + new_idle)

    def final(self) -> ActorOccupancy:
        """The figures as of the end of the actor's latest call: the wait after it (the run ending) left out."""
        r = self.report
        if r.done_window_s <= 0:
            return self
        tail = max(0.0, r.idle_s - r.done_idle_s)
        cut_input = min(tail, self.input_s)
        return ActorOccupancy(replace(r, busy_s=r.done_busy_s, idle_s=r.done_idle_s, window_s=r.done_window_s),
                              self.input_s - cut_input, max(0.0, self.output_s - (tail - cut_input)),
                              min(self.backlog_s, r.done_window_s))

    def to_json(self, run_rows_per_s: float | None = None, run_tokens_per_s: float | None = None) -> dict:
        """Per actor, for `_summary.json`: fractions of its window, and its rates while the engine stepped
        ("speed of light") beside the whole run's (the gap is the pipeline's loss)."""
        r, w = self.report, max(self.report.window_s, 1e-9)
        busy = max(r.busy_s, 1e-9)
        return {"actor": r.actor, "window_s": round(r.window_s, 3), "busy_s": round(r.busy_s, 3),
                "busy_fraction": round(min(1.0, r.busy_s / w), 4),
                "waiting_on_cpu_fraction": round(min(1.0, self.input_s / w), 4),
                "blocked_on_output_fraction": round(min(1.0, self.output_s / w), 4),
                "backlog_fraction": round(min(1.0, self.backlog_s / w), 4),
                "rows": r.rows, "generated_tokens": r.generated_tokens,
                "rows_per_s_busy": round(r.rows / busy, 3) if r.busy_s else None,
                "generated_tokens_per_s_busy": round(r.generated_tokens / busy, 3) if r.busy_s else None,
                "run_rows_per_s": run_rows_per_s, "run_generated_tokens_per_s": run_tokens_per_s}


@dataclass(frozen=True)
class Occupancy:
    """The run's figures, summed over model actors (fractions of the summed windows)."""

    busy: float  # 0..1
    waiting_on_cpu: float
    blocked_on_output: float
    backlog: float  # share of the model's window while rows waited for a model actor
    cpu_busy: float | None  # the CPU pools' busy share over the run (None: unknown, no CPU actor counted)

    @classmethod
    def of(cls, actors: list[dict], cpu_busy: float | None) -> Occupancy | None:
        """From `ActorOccupancy.to_json` dicts; None without a model actor that had a window."""
        w = sum(a["window_s"] for a in actors)
        if w <= 0:
            return None

        def share(key: str) -> float:
            return min(1.0, sum(a[key] * a["window_s"] for a in actors) / w)

        return cls(share("busy_fraction"), share("waiting_on_cpu_fraction"), share("blocked_on_output_fraction"),
                   share("backlog_fraction"), cpu_busy)

    def cause(self) -> str:
        """What the model mostly waited for, for the progress line."""
        if max(self.waiting_on_cpu, self.blocked_on_output) < 0.05:
            return "busy"
        return "waiting on the CPU stage" if self.waiting_on_cpu >= self.blocked_on_output else \
            "blocked on output (the write stage)"

    def text(self) -> str:
        """`model busy 41 %: waiting on the CPU stage`."""
        return f"model busy {self.busy:.0%}: {self.cause()}"

    def verdict(self) -> str | None:
        """The pool to grow, or None (neither side waited past `WAIT_LIMIT`)."""
        if self.waiting_on_cpu > WAIT_LIMIT:
            return (f"the model waited on the CPU stage {self.waiting_on_cpu:.0%} of the run: grow the CPU pool "
                    "(resources.decode / resources.preprocess: more actors or CPUs)")
        if self.blocked_on_output > WAIT_LIMIT:
            return (f"the model was blocked on output {self.blocked_on_output:.0%} of the run: grow the write pool "
                    "(resources.write)")
        if self.backlog > WAIT_LIMIT and self.busy >= 1.0 - WAIT_LIMIT:
            return (f"the CPU stage waited on the model: rows were ready for it {self.backlog:.0%} of the run (model "
                    f"busy {self.busy:.0%}): grow the model pool (resources.model.max_actors)")
        return None

    def to_json(self) -> dict:
        return {**{k: (None if v is None else round(v, 4)) for k, v in asdict(self).items()},
                "verdict": self.verdict()}


def cpu_busy_fraction(cpu_actor_s: float, cpu_actors: int, window_s: float) -> float | None:
    """The CPU pools' busy share: their actor-seconds over actors x window (None when unknown)."""
    if cpu_actors <= 0 or window_s <= 0:
        return None
    return min(1.0, cpu_actor_s / (cpu_actors * window_s))
