"""Progress of a clipped run (issue 51): rows are per clip and prompt, and a video's clip count is known
only once it is decoded, so the line counts media cut and clips so far, and the row total and ETA are an
estimate from the media cut (`pipeline/telemetry/progress.py`). A plain run's line is unchanged."""
from __future__ import annotations

import io

import pyarrow as pa

from vlbatch.pipeline.telemetry.progress import Progress


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _stats(n: int) -> pa.Table:
    cols = {"status": ["ok"] * n, "error_type": [None] * n, "generated_tokens": [1] * n, "prompt_tokens": [5] * n,
            "cached_tokens": [0] * n, "visual_tokens": [4] * n, "file": [None] * n}
    return pa.table(cols)


def test_clipped_progress_counts_media_and_clips_and_estimates_the_rows():
    clock, out = _Clock(), io.StringIO()
    p = Progress(total=None, stream=out, interval_s=5.0, tty=False, clock=clock, clipped=True, media_total=10)
    clock.t = 5.0
    p.observe({"decoded": 3, "clips": 3})  # the first video is being cut: no media finished yet
    line = p.line()
    assert "committed 0/? rows (media 0/10 cut, 3 clips so far)" in line and "ETA --:--" in line, line
    p.observe({"decoded": 8, "clips": 8, "media_cut": 2, "generated": 8})  # 2 videos cut: 4 rows each
    line = p.line()
    assert "committed 0/~40 rows (media 2/10 cut, 8 clips so far)" in line, line
    assert "ETA 00:20" in line, line  # 8 generated in 5 s, 32 left of the estimate
    clock.t = 10.0
    p.update(_stats(16))
    p.observe({"decoded": 24, "clips": 24, "media_cut": 4, "generated": 16})
    assert "committed 16/~60 rows (media 4/10 cut, 24 clips so far)" in p.line()
    p.set_total(58)  # the end of the run: the exact count
    assert "committed 16/58 rows  " in p.line() and "clips so far" not in p.line()


def test_clipped_progress_with_no_media_count_and_a_plain_run():
    p = Progress(total=None, stream=io.StringIO(), tty=False, clipped=True)
    p.observe({"decoded": 2, "clips": 2, "media_cut": 1})
    assert "committed 0/? rows (media 1/? cut, 2 clips so far)" in p.line()
    plain = Progress(total=7, stream=io.StringIO(), tty=False)
    plain.observe({"decoded": 2, "media_cut": 1})
    assert "committed 0/7 rows  " in plain.line() and "cut" not in plain.line()


def test_one_clip_so_far_is_singular():
    p = Progress(total=None, stream=io.StringIO(), tty=False, clipped=True, media_total=2)
    p.observe({"decoded": 1, "clips": 1})
    assert "committed 0/? rows (media 0/2 cut, 1 clip so far)" in p.line(), p.line()
