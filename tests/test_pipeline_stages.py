"""The pipeline's stage classes called directly (no Ray): the fused CPU stage equals the two
stages in sequence, preprocessing several prompts of one media equals the processor run once
per prompt, the write actor equals the write function, steady-state progress figures."""
from __future__ import annotations

import io
import logging

import numpy as np
import pyarrow as pa
import pytest

from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.stages.rows import MediaTask, Prepared, from_table, to_table


@pytest.fixture(scope="module")
def proc(tiny_ckpt):
    from vlbatch.operators.preprocess import Processor

    return Processor.from_pretrained(tiny_ckpt("dense"))


def _chat(proc, kind: str, prompt: str, system: str | None = None) -> str:
    from vlbatch.pipeline.stages.preprocess import chat_messages

    return proc.apply_chat_template(chat_messages(prompt, kind, system), add_generation_prompt=True)


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("kind", ["image", "video"])
def test_process_prompts_equals_the_processor_once_per_prompt(proc, kind):
    from vlbatch.operators.types import VideoClip
    from vlbatch.pipeline.stages.preprocess import process_prompts, process_prompts_naive

    rng = np.random.default_rng(1)
    if kind == "image":
        media = {"images": [rng.integers(0, 256, (97, 203, 3), dtype=np.uint8)]}
    else:  # 5 frames: an odd count (the last temporal group is padded)
        media = {"videos": [VideoClip(frames=rng.integers(0, 256, (5, 64, 90, 3), dtype=np.uint8), source_fps=2.0,
                                      total_frames=10, indices=(0, 2, 4, 6, 8))]}
    texts = [_chat(proc, kind, "Short?"), _chat(proc, kind, "A much longer question about it, with words?", "Be brief."),
             _chat(proc, kind, "")]
    visual, fast = process_prompts(proc, texts, **media)
    ref = process_prompts_naive(proc, texts, **media)
    for r, f in zip(ref, fast, strict=True):
        _same({k: v for k, v in r.items() if k in f}, f)
        _same({k: v for k, v in r.items() if k not in f}, visual)  # the media's outputs, computed once


def test_process_prompts_raises_what_the_processor_raises(proc):
    from vlbatch.operators.errors import InputError
    from vlbatch.pipeline.stages.preprocess import process_prompts

    with pytest.raises(InputError):  # 1:300 aspect ratio
        process_prompts(proc, [_chat(proc, "image", "q")], images=[np.zeros((300, 1, 3), np.uint8)])
    with pytest.raises(InputError):  # a placeholder without its media
        process_prompts(proc, [_chat(proc, "image", "q")])


def _job(tmp_path, ckpt, **resources) -> dict:
    return {"model": {"path": str(ckpt)}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path / "out")},
            "image": {"max_pixels": 16384}, "task": {"system_prompt": "Be brief."}, "resources": resources}


def test_fused_cpu_stage_equals_decode_then_preprocess(tmp_path, tiny_ckpt):
    from PIL import Image

    from vlbatch.pipeline.stages.decode import DecodeStage
    from vlbatch.pipeline.stages.prepare import PrepareStage
    from vlbatch.pipeline.stages.preprocess import PreprocessStage

    rng = np.random.default_rng(0)
    good = tmp_path / "a.png"
    Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)).save(good)
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    rows = [MediaTask(str(good), "image", ("i", "j"), (0, 1), ("Describe.", "What colour?")),
            MediaTask(str(bad), "image", ("k",), (0,), ("Describe.",)),
            MediaTask(str(tmp_path / "missing.png"), "image", ("l",), (0,), ("Describe.",)),
            MediaTask("x.xyz", "unknown", ("m",), (0,), ("",)).failed(ValueError("no type"))]
    cfg = validate_config(_job(tmp_path, tiny_ckpt("dense")))
    batch = to_table(rows, MediaTask)
    fused = from_table(PrepareStage(cfg)(batch), Prepared)
    two = from_table(PreprocessStage(cfg)(DecodeStage(cfg)(batch)), Prepared)
    assert [r.status for r in fused] == ["ok", "error", "error", "error"]
    assert [r.error_type for r in fused] == [None, "MediaError", "MediaError", "ValueError"]
    for a, b in zip(fused, two, strict=True):
        assert np.array_equal(a.pixels, b.pixels) and a.pixels.dtype == np.uint8
        assert np.array_equal(a.positions, b.positions)
        same = ("ids", "prompts", "status", "error_type", "grid_thw", "content_hash", "input_ids", "spans",
                "rope_deltas", "visual_tokens")
        assert [k for k in same if getattr(a, k) != getattr(b, k)] == []
        assert (a.error_message or "").split(" at 0x")[0] == (b.error_message or "").split(" at 0x")[0]
    ok = fused[0]
    t, h, w = ok.grid_thw
    assert len(ok.input_ids) == 2 and ok.visual_tokens == t * h * w // 4 == sum(e - s for s, e in ok.prompt_spans(1))
    assert ok.decode_s > 0 and ok.preprocess_s > 0


def test_write_actor_commits_what_write_batch_commits(tmp_path):
    from vlbatch.operators.sink.parquet import ParquetSink
    from vlbatch.pipeline.stages.rows import Generated
    from vlbatch.pipeline.stages.write_stage import WriteStage, write_batch

    g = Generated("u1", "image", ("a", "b"), (0, 1), ("p0", "p1"), answers=("x", "y"), thinking=(None, None),
                  statuses=("ok", "ok"), req_error_types=(None, None), req_error_messages=(None, None),
                  finish_reasons=("stop", "length"), prompt_tokens=(10, 11), generated_tokens=(2, 3),
                  cached_tokens=(0, 9), visual_tokens=4, vision_hits=0, vision_encodes=1, batch_model_s=1.0)
    cfg = validate_config({"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)}})
    table = to_table([g], Generated)
    s1 = WriteStage(cfg, str(tmp_path / "w1"), "r")(table)
    s2 = write_batch(table, cfg=cfg, run_dir=str(tmp_path / "w2"), run_id="r")
    assert s1.drop_columns(["file"]).equals(s2.drop_columns(["file"]))
    rolled = ParquetSink(str(tmp_path / "w1"))
    assert rolled.read().num_rows == 0  # staged by the actor's roller (under the size target), not yet published
    rolled.seal()  # the runner's end of the run
    assert rolled.read().equals(ParquetSink(str(tmp_path / "w2")).read())


def test_progress_steady_rate_excludes_start_up():
    from vlbatch.pipeline.telemetry.progress import Progress

    t = [0.0]
    p = Progress(total=10, stream=io.StringIO(), tty=False, clock=lambda: t[0])

    def stats(n):
        return pa.table({"id": ["x"] * n, "status": ["ok"] * n, "error_type": [None] * n, "prompt_tokens": [1] * n,
                         "visual_tokens": [1] * n, "generated_tokens": [1] * n, "cached_tokens": [0] * n,
                         "file": ["f"] * n})

    assert p.rates()["steady_rows_per_s"] is None
    t[0] = 8.0
    p.update(stats(2))  # start-up: 8 s to the first commit
    assert p.rates()["steady_rows_per_s"] is None and p.rates()["time_to_first_row_s"] == 8.0
    t[0] = 10.0
    p.update(stats(4))
    t[0] = 12.0
    p.update(stats(4))
    r = p.rates()
    assert r["steady_rows_per_s"] == 8 / 4 and r["rows_per_s"] == 10 / 12


def test_cpu_fit_warning(tmp_path, caplog):
    from vlbatch.pipeline.plan.cluster import Cluster
    from vlbatch.pipeline.plan.fit import check_fit

    def check_cpus_fit(cfg, cpus, fixed_size):  # the one fit check, on a cluster of `cpus` CPUs
        check_fit(cfg, Cluster(cpus, 0.0, 64 << 30, fixed_size, "the cluster"))

    base = {"model": {"path": "m"}, "input": {"uri": "x"}, "output": {"uri": str(tmp_path)}}
    res = {"preprocess": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5}, "model": {"num_cpus": 1}}
    fused = validate_config({**base, "resources": {**res, "write": {"num_cpus": 0.25}}})
    assert fused.resources.fuse_cpu_stages  # the default
    with caplog.at_level(logging.WARNING, logger="vlbatch.pipeline"):
        check_cpus_fit(fused, 2.0, fixed_size=False)  # 0.5 + 1 + 0.25 + 0.05 (the read)
        assert not caplog.records
        split = validate_config({**base, "resources": {**res, "fuse_cpu_stages": False}})
        check_cpus_fit(split, 2.0, fixed_size=False)  # 0.5 + 0.5 + 1 + 0.25 + 0.05
        assert "2.30 CPUs" in caplog.text


def test_model_stage_concurrent_calls_equal_one_call(tmp_path, tiny_ckpt):
    """Calls running at once on one model actor (as Ray Data runs them, threads) give each
    call its own rows with the answers one call gives; the work figures on the calls' first
    rows add up to the actor's totals."""
    import threading

    from PIL import Image

    from vlbatch.pipeline.stages.model_stage import ModelStage
    from vlbatch.pipeline.stages.prepare import PrepareStage
    from vlbatch.pipeline.stages.rows import Generated

    rng = np.random.default_rng(1)
    tasks = []
    for k in range(6):
        path = tmp_path / f"m{k}.png"
        Image.fromarray(rng.integers(0, 256, (40 + 8 * k, 56, 3), dtype=np.uint8)).save(path)
        tasks.append(MediaTask(str(path), "image", (f"a{k}", f"b{k}"), (0, 1), ("Describe.", "What colour?")))
    tasks.append(MediaTask(str(tmp_path / "missing.png"), "image", ("gone",), (0,), ("Describe.",)))
    job = _job(tmp_path, tiny_ckpt("dense"), model={"batch_visual_tokens": 10**6})
    job.update(model={"path": job["model"]["path"], "dtype": "float32"}, sampling={"max_tokens": 6})
    cfg = validate_config(job)
    prepared = PrepareStage(cfg)(to_table(tasks, MediaTask))
    one = {g.media_uri: g for g in from_table(ModelStage(cfg)(prepared), Generated)}
    stage = ModelStage(cfg)
    parts = [prepared.slice(0, 2), prepared.slice(2, 3), prepared.slice(5, 2)]
    outs: list = [None] * 3
    threads = [threading.Thread(target=lambda k=k: outs.__setitem__(k, from_table(stage(parts[k]), Generated)))
               for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    got = [g for o in outs for g in o]
    assert [[g.media_uri for g in o] for o in outs] == [[t.media_uri for t in tasks[a:a + n]]
                                                          for a, n in ((0, 2), (2, 3), (5, 2))]
    for g in got:
        assert g.answers == one[g.media_uri].answers and g.statuses == one[g.media_uri].statuses
    assert got[-1].statuses == ("error",) and got[-1].req_error_types == ("MediaError",)
    assert sum(g.vision_encodes for g in got) == 6  # every image through the tower once, counted once
    busy = sum(g.batch_model_s for g in got)
    assert busy > 0 and abs(busy - stage.backend.loop.busy_s) < 1e-9
    cpu = sum(g.batch_model_cpu_s for g in got)
    assert 0 < cpu <= busy + 0.05 and abs(cpu - stage.backend.loop.busy_cpu_s) < 1e-9


def _decoded_row(kind: str, prompts: tuple[str, ...]):
    """A decoded image (1 frame, 50 x 70) or video (5 frames, 48 x 64) asked three `prompts` -> (the
    `Decoded` row, the processor's media keyword arguments for the same frames)."""
    from vlbatch.operators.types import VideoClip
    from vlbatch.pipeline.stages.rows import Decoded

    rng = np.random.default_rng(4)
    if kind == "image":
        row = Decoded("u", "image", ("a", "b", "c"), (0, 1, 2), prompts,
                      frames=rng.integers(0, 256, (1, 50, 70, 3), dtype=np.uint8))
        return row, {"images": [row.frames[0]]}
    row = Decoded("u", "video", ("a", "b", "c"), (0, 1, 2), prompts,
                  frames=rng.integers(0, 256, (5, 48, 64, 3), dtype=np.uint8),
                  source_fps=2.0, total_frames=10, frame_indices=(0, 2, 4, 6, 8))
    return row, {"videos": [VideoClip(row.frames, 2.0, 10, row.frame_indices)]}


@pytest.mark.parametrize("kind", ["image", "video"])
def test_prepared_row_is_the_processor_output_once_per_media(tmp_path, tiny_ckpt, kind):
    """The CPU stage's uint8 row, read back from Arrow, builds requests equal to the processor's
    float32 path (`Request.from_processor`, normalised values bit for bit), all around the one
    Arrow buffer (no per-question copy) with the hash computed once; the engine's answers equal."""
    from dataclasses import replace

    import torch

    from vlbatch.operators.engine import Request, SamplingParams
    from vlbatch.operators.factory import load_engine
    from vlbatch.operators.model.pixels import normalize_frames
    from vlbatch.operators.preprocess import Processor
    from vlbatch.pipeline.backends.backends import media_requests, pixel_specs
    from vlbatch.pipeline.stages.preprocess import PreprocessStage

    prompts = ("Describe.", "What colour is it?", "Count things.")
    row, media = _decoded_row(kind, prompts)
    ckpt = tiny_ckpt("dense")
    cfg = validate_config(_job(tmp_path, ckpt))
    prep = from_table(to_table([PreprocessStage(cfg).prepare_one(row)], Prepared), Prepared)[0]
    assert prep.status == "ok" and prep.pixels.dtype == np.uint8 and prep.pixels.ndim == 4  # frames, no patch layout
    spec = pixel_specs(str(ckpt))[kind]
    built = media_requests(prep, spec, lambda rid: SamplingParams(max_new_tokens=5), False)
    reqs = [built[rid] for rid in prep.ids]
    proc = Processor.from_pretrained(ckpt)
    proc.image_config = replace(proc.image_config, max_pixels=cfg.image.max_pixels)
    pv_key = "pixel_values" if kind == "image" else "pixel_values_videos"
    for req, prompt in zip(reqs, prompts, strict=True):
        ref = Request.from_processor(req.id, proc(_chat(proc, kind, prompt, "Be brief."), **media), 0,
                                     sampling=SamplingParams(max_new_tokens=5))
        (m,), (r,) = req.media, ref.media
        assert req.prompt_token_ids == ref.prompt_token_ids and req.rope_delta == ref.rope_delta
        assert torch.equal(req.position_ids, ref.position_ids) and m.spans == r.spans and m.grid_thw == r.grid_thw
        assert torch.equal(m.model_input("cpu", torch.float32).view(torch.int32),
                           r.model_input("cpu", torch.float32).view(torch.int32))
        assert torch.equal(r.model_input("cpu", torch.float32), torch.from_numpy(
            proc(_chat(proc, kind, prompt, "Be brief."), **media)[pv_key]))  # the conversion at the boundary: exact
        assert m.frames.data_ptr() == prep.pixels.ctypes.data  # the Arrow buffer itself
        assert m.content_hash == prep.content_hash == reqs[0].media[0].content_hash
    assert len({id(r.media[0]) for r in reqs}) == 1  # equal spans: one shared MediaItem
    patch, merge, temporal = spec.layout
    assert np.array_equal(normalize_frames(torch.from_numpy(prep.pixels.copy()), spec.table, patch=patch, merge=merge,
                                           temporal=temporal).numpy(), proc(_chat(proc, kind, "x"), **media)[pv_key])
    engine = load_engine(ckpt, kv_budget_bytes=16 << 20)
    refs = [Request.from_processor(r.id, proc(_chat(proc, kind, p, "Be brief."), **media), 0,
                                   sampling=SamplingParams(max_new_tokens=5)) for r, p in zip(reqs, prompts, strict=True)]
    want = {r.id: r.token_ids for r in engine.generate(refs)}
    engine2 = load_engine(ckpt, kv_budget_bytes=16 << 20)
    got = {r.id: r.token_ids for r in engine2.generate(reqs)}
    assert got == want and engine2.stats()["vision_encodes"] == 1


def test_media_key_hashes_the_frames_and_tells_media_apart(proc):
    """The CPU stage hashes a media's resized frames with its kind's layout and table, as a
    `MediaItem` built around those frames would; the key changes with any pixel, with the kind,
    and differs from the hash of the same pixels in patch layout (a miss, never a false hit)."""
    import torch

    from vlbatch.operators.engine.media_spans import MediaItem, media_hash
    from vlbatch.pipeline.stages.preprocess import media_key

    rng = np.random.default_rng(3)
    img = rng.integers(0, 256, (70, 90, 3), dtype=np.uint8)
    m = proc.encode_media([img], None, frames=True)
    frames, grid = m.arrays["pixel_values"], tuple(m.arrays["image_grid_thw"][0].tolist())
    key = media_key(proc, "image", frames, grid)
    assert key == media_key(proc, "image", frames.copy(), grid)
    from vlbatch.operators.preprocess.shipped import PixelSpec

    item = MediaItem("image", torch.from_numpy(frames.copy()), grid, ((0, 1),), PixelSpec.of(proc.image_config))
    assert item.content_hash == key
    patches = proc.encode_media([img], None, uint8=True).arrays["pixel_values"]
    assert key != media_hash("image", patches, grid, proc.norm_table("image"))
    assert key != media_key(proc, "video", frames, grid)
    changed = img.copy()
    changed[35, 45] = 255 - changed[35, 45]  # one pixel, far from its old value (survives the resize)
    m2 = proc.encode_media([changed], None, frames=True)
    assert media_key(proc, "image", m2.arrays["pixel_values"], grid) != key


def test_a_clip_refused_by_preprocess_loses_its_stored_clip_file(tmp_path, tiny_ckpt):
    """Issue 60 item 6: a clip whose file was stored at decode but whose every request then fails in
    preprocess (a 300:1 frame) ends as error rows that name no clip file, and the file is deleted; an ok
    clip keeps its file and its `clip_uri`."""
    from vlbatch.pipeline.stages.clip_rows import clip_target
    from vlbatch.pipeline.stages.preprocess import PreprocessStage
    from vlbatch.pipeline.stages.rows import Decoded

    job = _job(tmp_path, tiny_ckpt("dense"))
    job["video"] = {"clips": {"mode": "fixed", "window_s": 2.0}}
    job["output"]["clip_files"] = {"format": "mp4"}
    cfg = validate_config(job)
    target = clip_target(cfg)
    folder = tmp_path / "out" / cfg.resolved_run_id() / "_clips"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(5)

    def clip_row(index: int, shape: tuple[int, int]) -> Decoded:
        uri = target.uri_of(f"clip{index}")
        (folder / uri.rsplit("/", 1)[1]).write_bytes(b"mp4")  # as store_clip leaves it
        return Decoded("v.mp4", "video", (f"i{index}",), (0,), ("Describe.",), clip_index=index,
                       clip_start_s=2.0 * index, clip_end_s=2.0 * index + 2, clip_source="fixed", clip_uri=uri,
                       frames=rng.integers(0, 256, (2, *shape, 3), dtype=np.uint8), source_fps=2.0,
                       total_frames=8, frame_indices=(0, 1))

    stage = PreprocessStage(cfg)
    bad, good = stage.prepare_rows(clip_row(0, (2, 600))), stage.prepare_rows(clip_row(1, (48, 64)))
    assert [(r.status, r.error_type, r.clip_uri) for r in bad] == [("error", "InputError", None)]
    assert [(r.status, r.clip_uri) for r in good] == [("ok", target.uri_of("clip1"))]
    assert sorted(p.name for p in folder.iterdir()) == ["clip1.mp4"]
    with pytest.raises(Exception, match="not a clip file"):
        target.remove(str(tmp_path / "elsewhere.mp4"))  # only files of the clips folder
