"""`vlbatch demo --preprocess-only`: preprocessing over generated sample media, printed per item."""
from __future__ import annotations

from vlbatch.jobs.demo import run_preprocess_demo as run_demo


def test_demo_runs_and_reports_each_item(tmp_path, capsys):
    assert run_demo(tmp_path) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln and not ln.startswith(("checkpoint", "item", "done"))}
    # 640x480 is already a multiple of 32 and within budget: 30 x 40 patches, 300 merged tokens
    assert "[1, 30, 40]" in lines["rgb_640x480.jpg"] and " 1200 " in lines["rgb_640x480.jpg"]
    # 1080 rounds to 1088 (34 x 32): 68 x 120 patches
    assert "[1, 68, 120]" in lines["rgb_1920x1080.jpg"]
    # 10 s at 2 fps = 20 frames = 10 temporal groups
    assert "[10, " in lines["clip_640x360_25fps.npy"]
    assert "MediaError" in lines["bad_bytes.bin"]
    stamp = (tmp_path / "tiny-checkpoint" / "config.json").stat().st_mtime_ns
    assert run_demo(tmp_path) == 0  # reuses the checkpoint
    assert (tmp_path / "tiny-checkpoint" / "config.json").stat().st_mtime_ns == stamp
