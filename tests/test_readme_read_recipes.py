"""The README's ways of reading a run, run as written on a real run (issue 60, items 7 and 8).

One `vlbatch run` on the random tiny checkpoint: a clipped video with `output.clip_files` on and an image, a
caption, and a question whose JSON schema is in a `schema_file` beside the job config (relative, the README's
form). Then:
- every Python block of README.md, and of the docs/ pages it links, that reads a run folder (it names
  `<run_id>`) is taken from the file as it is, its `"<...>/<run_id>"` path replaced by the run's folder, and
  executed: the README cannot drift from what works. The clip files live in `<run>/_clips/`, so
  `ds.dataset(run, format="parquet")` reads the rows and nothing else;
- `vlbatch export RUN -o x.parquet` with no --config reads the recorded task (the schema, not its file) and types
  the question's column from it; its values are the rows' parsed values."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_clips import scenes_pattern
from test_jobs_support import REPO, read_output, vlbatch

SCHEMA = {"type": "boolean"}  # a short value: the tiny model's answer fits max_tokens
RUN_PATH = re.compile(r"""(["'])[^"'\n]*<run_id>\1""")  # a recipe's run folder: "/data/captions/<run_id>"


def _job(tmp_path: Path, ckpt: Path) -> Path:
    import numpy as np
    from PIL import Image

    from vlbatch.devtools.samples import encode_video

    media = tmp_path / "media"
    media.mkdir()
    encode_video(media / "v.mp4", 32, 64, 48, 8, options={"g": "8"}, pattern=scenes_pattern)  # 4 s: 2 clips
    Image.fromarray((np.random.default_rng(0).random((40, 48, 3)) * 255).astype("uint8")).save(media / "a.png")
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"media_uri": str(media / "v.mp4"), "media_type": "video"}) + "\n"
                        + json.dumps({"media_uri": str(media / "a.png"), "media_type": "image"}) + "\n")
    (tmp_path / "moving.json").write_text(json.dumps(SCHEMA))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"""model: {{path: {ckpt}, dtype: float32, device: cpu}}
input: {{uri: {manifest}, format: jsonl}}
task:
  mode: questions
  caption: true
  prompt: Describe.
  video_prompt: What happens?
  questions:
    - {{name: moving, prompt: "Does it move?", response_format: {{type: json_schema, schema_file: moving.json}}}}
sampling: {{max_tokens: 8}}
image: {{max_pixels: 12544}}
video: {{fps: 2.0, min_frames: 2, max_frames: 4, max_pixels: 12544, clips: {{mode: fixed, window_s: 2.0}}}}
resources:
  preprocess: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 1}}
  model: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 2}}
  write: {{num_cpus: 0.25, min_actors: 1, max_actors: 1, batch_size: 4}}
output: {{uri: {tmp_path / 'out'}, clip_files: {{format: mp4}}}}
ray: {{progress_interval_s: 1}}
""")
    return cfg


pytestmark = pytest.mark.ray  # both tests read the run `run_dir` makes


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_ckpt, session_ray_holder) -> Path:
    from conftest import session_ray

    # the run joins the session's Ray (tests/conftest.py); a module fixture runs before the test's
    # `ray_cluster`, so it connects (or starts) that Ray itself
    held = [session_ray(session_ray_holder)]
    tmp_path = tmp_path_factory.mktemp("recipes")
    cfg = _job(tmp_path, tiny_ckpt("dense"))
    r = vlbatch("run", str(cfg), "--no-lock", timeout=600,
                env={"RAY_ADDRESS": held[0].address})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    return run


def _read_recipes() -> list[tuple[str, str]]:
    """(where, code) of each ```python block naming `<run_id>` in README.md and the docs/ pages it links."""
    readme = REPO / "README.md"
    pages = [readme] + sorted({REPO / m for m in re.findall(r"\]\((docs/[^)#]+\.md)", readme.read_text())})
    out = []
    for page in pages:
        for i, block in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S)):
            if "<run_id>" in block:
                out.append((f"{page.name} python block {i}", block))
    return out


def test_every_readme_read_recipe_runs_as_written_with_clip_files_on(run_dir):
    rows = read_output(run_dir)
    recipes = _read_recipes()
    assert recipes, "README.md holds no Python recipe reading a run folder"
    for where, code in recipes:
        assert len(RUN_PATH.findall(code)) >= 1, where
        namespace: dict = {}
        exec(compile(RUN_PATH.sub(repr(str(run_dir)), code), where, "exec"), namespace)  # noqa: S102 - our README
        if "rows" in namespace:  # the README's `rows = ds.dataset(...).to_table().to_pandas()`
            got = namespace["rows"]
            assert len(got) == len(rows) and sorted(got["id"]) == sorted(r["id"] for r in rows), where
    clips = [r for r in rows if r["clip_index"] is not None]
    assert len(clips) == 2 * 2 and all(r["status"] == "ok" for r in clips)  # 2 clips x (question, caption)
    uris = {r["clip_uri"] for r in clips}
    assert len(uris) == 2 and all(u.startswith(f"{run_dir}/_clips/") and Path(u).is_file() for u in uris)


def test_export_reads_a_schema_file_run_with_no_config(run_dir, tmp_path):
    dest = tmp_path / "media.parquet"
    r = vlbatch("export", str(run_dir), "-o", str(dest), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == f"exported 6 rows (2 media, 2 clips) to {dest}"
    t = pq.read_table(dest)
    assert str(t.schema.field("moving").type) == "bool"
    want = {(r["media_uri"], r["clip_index"]): (json.loads(r["parsed"]) if r["status"] == "ok" else None)
            for r in read_output(run_dir) if r["prompt_name"] == "moving"}
    got = {(r["media_uri"], r["clip_index"]): r["moving"] for r in t.to_pylist()}
    assert got == want and any(v is not None for v in got.values())
