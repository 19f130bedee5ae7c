"""No stale answers under a pinned run_id (issue 33): the run folder keeps the fingerprint of
what its answers were made with (`pipeline/plan/fingerprint.py`), and a rerun that would answer
differently is refused before any work, naming the changed fields, unless --allow-config-change.

The CLI tests drive `vlbatch run` / `validate` as a user would (subprocesses); the one real
run joins the session's Ray (tests/conftest.py) on a tiny checkpoint and two generated images."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_jobs_support import REPO, read_output, vlbatch, write_job

from vlbatch.pipeline.config import load_config
from vlbatch.pipeline.plan.fingerprint import (
    FINGERPRINT_NAME,
    changed_fields,
    checkpoint_identity,
    fingerprint,
    record_fingerprint,
)


def test_fingerprint_names_what_changes_answers_and_leaves_out_how_it_runs():
    base = load_config(REPO / "configs" / "demo.yaml")
    fp = fingerprint(base)
    for key in ("model.path", "model.checkpoint", "model.dtype", "sampling.max_tokens", "sampling.temperature",
                "sampling.seed", "task.prompt", "task.system_prompt", "task.thinking", "image.max_pixels",
                "video.fps", "video.max_frames"):
        assert key in fp, key
    assert fp["model.checkpoint"]  # the bundled checkpoint is local: it has an identity
    same = ["resources.model.max_actors=2", "model.engine.prefix_cache_mb=0", "ray.block_mb=4",
            "output.commit_interval_s=5", "image.max_bytes=1000", "video.decode_timeout_s=5",
            "video.decoder=pyav"]
    assert changed_fields(fp, fingerprint(load_config(REPO / "configs" / "demo.yaml", same))) == {}
    other = ["sampling.max_tokens=32", "task.system_prompt=Be brief.", "video.max_frames=8", "model.dtype=bfloat16"]
    assert changed_fields(fp, fingerprint(load_config(REPO / "configs" / "demo.yaml", other))) == {
        "sampling.max_tokens": [64, 32], "task.system_prompt": [None, "Be brief."], "video.max_frames": [16, 8],
        "model.dtype": ["float32", "bfloat16"]}
    # a fingerprint written before a field existed: the field's default stands for it
    older = {k: v for k, v in fp.items() if k != "sampling.top_k"}
    assert changed_fields(older, fp) == {}


def test_checkpoint_identity_sees_new_weights_of_the_same_shapes(tmp_path, tiny_ckpt):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("dense"), ckpt)
    before = checkpoint_identity(str(ckpt))
    assert before == checkpoint_identity(str(ckpt))  # deterministic
    weights = next(ckpt.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor: same header, same size
    weights.write_bytes(bytes(data))
    assert checkpoint_identity(str(ckpt)) != before
    # the same checkpoint elsewhere: its path alone is no change; other weights at the same path are
    moved = tmp_path / "moved"
    shutil.copytree(tiny_ckpt("dense"), moved)
    old = {"model.path": str(tiny_ckpt("dense")), "model.checkpoint": checkpoint_identity(str(tiny_ckpt("dense")))}
    assert changed_fields(old, {"model.path": str(moved), "model.checkpoint": checkpoint_identity(str(moved))}) == {}
    assert set(changed_fields(old, {"model.path": str(ckpt), "model.checkpoint": checkpoint_identity(str(ckpt))})) == {
        "model.path", "model.checkpoint"}
    remote = {"model.path": "s3://b/a", "model.checkpoint": None}
    assert set(changed_fields(remote, {"model.path": "s3://b/c", "model.checkpoint": None})) == {"model.path"}
    assert checkpoint_identity("s3://bucket/ckpt") is None  # remote: its path stands for it


def _demo(tmp_path: Path) -> list[str]:
    from vlbatch.pipeline.demo import demo_overrides, prepare_demo

    prepare_demo(tmp_path, include_bad=False)
    return demo_overrides(tmp_path)


@pytest.mark.slow
def test_readme_example_after_the_demo_is_refused_naming_the_field(tmp_path):
    """After `make demo`, `vlbatch run configs/demo.yaml --set sampling.max_tokens=32` used to
    print `0 ok, 0 error, 20 skipped` (answers made with 64 tokens). Now: exit 2 before Ray, one
    line naming sampling.max_tokens and the ways on."""
    over = _demo(tmp_path)
    cfg = REPO / "configs" / "demo.yaml"
    record_fingerprint(load_config(cfg, over))  # what the demo's run left in out/demo/output/demo/
    assert (tmp_path / "output" / "demo" / FINGERPRINT_NAME).is_file()

    sets = [a for ov in [*over, "sampling.max_tokens=32"] for a in ("--set", ov)]
    for cmd in (["run", str(cfg), "--no-lock", *sets], ["validate", str(cfg), *sets]):
        r = vlbatch(*cmd, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "[vlbatch] ray:" not in r.stdout  # refused before Ray started
        err = r.stderr.strip().splitlines()
        assert len(err) == 1, err
        assert "sampling.max_tokens: 64 -> 32" in err[0] and "'demo'" in err[0]
        assert "new output.run_id" in err[0] and "--allow-config-change" in err[0]
    same = vlbatch("validate", str(cfg), *[a for ov in over for a in ("--set", ov)], timeout=120)
    assert same.returncode == 0, same.stderr


@pytest.mark.ray
def test_pinned_run_refuses_a_changed_config_and_allow_keeps_the_old_rows(tmp_path, tiny_ckpt):
    """A real run under a pinned run_id, then a rerun with another max_tokens: refused; with
    --allow-config-change the done ids are kept (nothing recomputed) and the change is recorded."""
    cfg = write_job(tmp_path / "wd", tiny_ckpt("dense"), n_images=2, write_batch=2)
    pin = ["--set", "output.run_id=pinned"]
    run_dir = tmp_path / "output" / "pinned"

    first = vlbatch("run", str(cfg), "--no-lock", *pin, timeout=400)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    stored = json.loads((run_dir / FINGERPRINT_NAME).read_text())
    assert stored["fingerprint"]["sampling.max_tokens"] == 4 and stored["accepted_changes"] == []
    rows = read_output(run_dir)
    assert len(rows) == 2

    refused = vlbatch("run", str(cfg), "--no-lock", *pin, "--set", "sampling.max_tokens=8", timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "sampling.max_tokens: 4 -> 8" in refused.stderr
    assert read_output(run_dir) == rows  # nothing touched

    allowed = vlbatch("run", str(cfg), "--no-lock", *pin, "--set", "sampling.max_tokens=8", "--allow-config-change",
                      timeout=400)
    assert allowed.returncode == 0, (allowed.stdout + allowed.stderr)[-4000:]
    assert "nothing to do: all 2 requests of" in allowed.stdout.splitlines()[-1]  # no Ray started
    stored = json.loads((run_dir / FINGERPRINT_NAME).read_text())
    assert stored["fingerprint"]["sampling.max_tokens"] == 8
    assert [c["changed"] for c in stored["accepted_changes"]] == [{"sampling.max_tokens": [4, 8]}]
