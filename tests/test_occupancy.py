"""Issue 53: how busy the model is and why, accounted on a fake clock (no Ray, no model)."""
from __future__ import annotations

import threading

import pytest

from vlbatch.operators.engine.loop import EngineLoop
from vlbatch.pipeline.telemetry.meter import CPU_READY, CPU_WINDOW_S, MODEL_OCCUPANCY, Meter
from vlbatch.pipeline.telemetry.metrics import MODEL_IN, queue_depths
from vlbatch.pipeline.telemetry.occupancy import ActorOccupancy, ModelReport, Occupancy, cpu_busy_fraction
from vlbatch.pipeline.telemetry.progress import Progress
from vlbatch.pipeline.telemetry.timeline import Timeline


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_idle_seconds_split_by_the_rows_waiting_when_reported():
    a = ActorOccupancy.first(ModelReport("a", busy_s=1.0, idle_s=2.0, window_s=4.0), rows_waiting=0)
    assert (a.input_s, a.output_s) == (2.0, 0.0)  # nothing waited for the model: it waited on the CPU stage
    a = a.add(ModelReport("a", busy_s=2.0, idle_s=5.0, window_s=8.0, rows=6, generated_tokens=24), rows_waiting=3)
    assert (a.input_s, a.output_s) == (2.0, 3.0)  # rows waited but none came: blocked on output
    j = a.to_json(run_rows_per_s=0.5, run_tokens_per_s=2.0)
    assert j["busy_fraction"] == 0.25 and j["waiting_on_cpu_fraction"] == 0.25
    assert j["blocked_on_output_fraction"] == 0.375
    assert j["rows_per_s_busy"] == 3.0 and j["generated_tokens_per_s_busy"] == 12.0  # speed of light
    assert j["run_rows_per_s"] == 0.5 and j["backlog_fraction"] == 0.5  # rows waited over 4 s of its 8
    # the run's final figures end at its last call: the wait after it (the run ending) is left out
    done = a.add(ModelReport("a", 2.0, 9.0, 12.0, 6, 24, done_busy_s=2.0, done_idle_s=5.0, done_window_s=8.0),
                 rows_waiting=0).final()
    assert (done.report.window_s, done.input_s, done.output_s) == (8.0, 2.0, 3.0)


def test_the_verdict_names_the_pool_to_grow():
    def occ(busy, cpu_wait, out_wait, backlog):
        return Occupancy(busy, cpu_wait, out_wait, backlog, cpu_busy=0.5)

    starved = occ(0.4, 0.5, 0.0, 0.0)
    assert "grow the CPU pool" in starved.verdict() and starved.text() == "model busy 40%: waiting on the CPU stage"
    assert "grow the write pool" in occ(0.4, 0.05, 0.5, 0.5).verdict()
    slow_model = occ(0.95, 0.02, 0.0, 0.9)
    assert "grow the model pool" in slow_model.verdict() and slow_model.text() == "model busy 95%: busy"
    assert occ(0.8, 0.2, 0.0, 0.2).verdict() is None  # neither waited past 30 %
    assert occ(0.5, 0.2, 0.0, 0.9).verdict() is None  # rows waited, but the model was not busy: no verdict
    assert cpu_busy_fraction(3.0, 2, 3.0) == 0.5 and cpu_busy_fraction(1.0, 0, 3.0) is None


def test_occupancy_weighs_actors_by_their_windows():
    a = ActorOccupancy(ModelReport("a", 9.0, 1.0, 10.0), input_s=1.0).to_json()
    b = ActorOccupancy(ModelReport("b", 0.0, 30.0, 30.0), input_s=30.0).to_json()
    o = Occupancy.of([a, b], cpu_busy=1.0)
    assert o.busy == pytest.approx(9 / 40) and o.waiting_on_cpu == pytest.approx(31 / 40)
    assert Occupancy.of([], None) is None


def test_meter_splits_reports_by_queue_and_times_the_cpu_window():
    clock = FakeClock()
    m = Meter(clock=clock)
    m.add({CPU_READY: 1})
    m.add({"decoded": 4, "preprocessed": 4, MODEL_IN: 4})
    m.report_model(ModelReport("a", 1.0, 1.0, 2.0))  # nothing waiting: input
    m.add({"preprocessed": 2})  # two rows preprocessed, not yet handed over
    assert queue_depths(m.counts) == {"preprocess": 0, "model": 2, "write": 0}
    m.report_model(ModelReport("a", 1.0, 4.0, 5.0))  # 3 s more idle while rows waited: output
    clock.t = 7.0
    snap = m.snapshot()
    occ = snap[MODEL_OCCUPANCY]["a"]
    assert (occ.input_s, occ.output_s) == (1.0, 3.0) and snap[CPU_WINDOW_S] == 7.0


def test_progress_line_and_timeline_show_the_model_busy():
    clock = FakeClock()
    p = Progress(total=10, clock=clock, tty=False, stream=open("/dev/null", "w"))  # noqa: SIM115
    occ = ActorOccupancy(ModelReport("a", 4.1, 5.9, 10.0), input_s=5.9)
    p.observe({CPU_READY: 1, CPU_WINDOW_S: 10.0, MODEL_OCCUPANCY: {"a": occ}})
    assert p.line().endswith("model busy 41%: waiting on the CPU stage")
    t = Timeline(clock=clock)
    t.observe_model(1.0, 0.5)
    clock.t = 2.5
    t.observe_model(1.5, 2.5)
    j = t.to_json()
    i, w = j["fields"].index("model_busy_ms"), j["fields"].index("model_wait_ms")
    assert [(b[i], b[w]) for b in j["buckets"]] == [(1000, 500), (0, 0), (500, 2000)]


class IdleEngine:
    """The smallest engine an `EngineLoop` drives: one step finishes every request submitted."""

    config = None
    num_waiting = 0

    def __init__(self, clock: FakeClock):
        self.clock, self.held = clock, []

    @property
    def has_work(self) -> bool:
        return bool(self.held)

    def submit(self, requests):
        self.held += requests
        return []

    def step(self):
        from vlbatch.operators.engine.request import Result, Timings

        self.clock.t += 0.25  # a step takes a quarter second on the fake clock
        done, self.held = self.held, []
        return [Result.failed(r, "x", "EngineError", Timings(0.0, 0.0, 0.0)) for r in done]


def test_engine_loop_counts_idle_waits_and_step_time_on_its_clock():
    from types import SimpleNamespace

    clock = FakeClock()
    loop = EngineLoop(IdleEngine(clock), max_visual_tokens=10, clock=clock)
    req = SimpleNamespace(id="r1", media=(), prompt_len=1, visual_tokens=0)
    assert set(loop.run([req], visual_tokens=1)) == {"r1"}
    waiting = threading.Event()
    # the loop thread now waits for input: 3 s pass on the fake clock while it is idle
    for _ in range(1000):
        with loop._cond:
            if loop._idle_since is not None:
                waiting.set()
                break
        threading.Event().wait(0.01)
    assert waiting.is_set()
    clock.t += 3.0
    assert loop.idle_now() == pytest.approx(3.0) and loop.busy_s == pytest.approx(0.25)
    assert set(loop.run([SimpleNamespace(id="r2", media=(), prompt_len=1, visual_tokens=0)], visual_tokens=1)) == {"r2"}
    loop.close()
    assert loop.idle_s == pytest.approx(3.0) and loop.busy_s == pytest.approx(0.5)
