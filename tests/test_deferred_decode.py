"""The deferred video decode (`video.decode_device: cuda | model-cpu`), its plumbing tested on the CPU.

With `model-cpu` the model stage decodes on its CPU by the same path `cuda` takes on a GPU
(`operators/preprocess/shipped.py`: the CPU stage plans, ships bytes + plan; the model stage
decodes the planned indices with TorchCodec and resizes by the CPU path's code). It must give
the frames, grids, prompts and answers of the CPU-stage decode bit for bit, on the suite's real
encoded videos (B-frames, VP8 / VP9, MPEG-4, VFR, rotated, lying headers), and turn bad media
into error rows on either stage. NVDEC itself needs a GPU: `benchmarks/gpu_run.sh` (step
`gpu_decode`) checks it there.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from vlbatch.pipeline.config import validate_config
from vlbatch.pipeline.stages.rows import MediaTask, Prepared, from_table, to_table

REPO = Path(__file__).resolve().parents[1]
# configs/demo.yaml asks a structured question and cuts videos into clips: these tests want its caption job
CAPTION_ONLY = ("task.mode=caption", "task.questions=[]", "task.caption=false", "video.clips.mode=none")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    from vlbatch.devtools.samples import write_sample_videos

    return write_sample_videos(tmp_path_factory.mktemp("videos"))


def _cfg(tmp_path, device: str):
    from vlbatch.pipeline.demo import BUNDLED_MODEL

    return validate_config({"model": {"path": str(BUNDLED_MODEL)}, "input": {"uri": "x"},
                            "output": {"uri": str(tmp_path / "out")},
                            "video": {"fps": 2.0, "max_frames": 8, "max_pixels": 16384, "decode_device": device}})


def _prepared(cfg, paths: list[str]) -> list[Prepared]:
    """The CPU stages' rows, through Arrow as the model stage receives them."""
    from vlbatch.pipeline.stages.decode import DecodeStage
    from vlbatch.pipeline.stages.preprocess import PreprocessStage

    decode, prep = DecodeStage(cfg), PreprocessStage(cfg)
    rows = [MediaTask(p, "video", (f"q{i}",), (0,), ("What happens?",)) for i, p in enumerate(paths)]
    return from_table(to_table([prep.prepare_one(decode.decode_one(r)) for r in rows], Prepared), Prepared)


@pytest.mark.slow
def test_deferred_frames_and_prompts_equal_the_cpu_stage(tmp_path, videos):
    from vlbatch.pipeline.backends.backends import pixel_specs, shared_pixels
    from vlbatch.pipeline.demo import BUNDLED_MODEL

    spec = pixel_specs(str(BUNDLED_MODEL))["video"]
    paths = [v.path for v in videos]
    cpu, deferred = _prepared(_cfg(tmp_path, "cpu"), paths), _prepared(_cfg(tmp_path, "model-cpu"), paths)
    good = [v for v in videos if not v.bad]
    assert len(good) >= 10  # B-frames, VP8 / VP9, MPEG-4, VFR, three rotations, a lying header
    for v, a, b in zip(videos, cpu, deferred, strict=True):
        assert (a.status, a.error_type) == (b.status, b.error_type), v.name  # bad media: error rows on both
        if a.status != "ok":
            continue
        assert b.deferred and not a.deferred and b.pixels.size == 0 and b.media_bytes, v.name
        assert (b.grid_thw, b.input_ids, b.spans, b.rope_deltas) == (a.grid_thw, a.input_ids, a.spans, a.rope_deltas)
        assert np.array_equal(b.positions, a.positions) and b.plan_indices
        frames = shared_pixels(b, spec, "cpu")  # the model stage's decode + resize, on the CPU
        assert frames.dtype == torch.uint8 and torch.equal(frames, torch.from_numpy(np.array(a.pixels))), v.name
    assert sum(r.status == "ok" for r in deferred) == len(good)


def test_deferred_video_that_does_not_decode_is_an_error_for_each_prompt(tmp_path, videos):
    """Bytes that stop decoding between the plan and the model stage (here: replaced by a cut
    copy) are the media's permanent `MediaError` for every prompt, never a failed call."""
    from vlbatch.operators.engine.request import SamplingParams
    from vlbatch.operators.errors import MediaError
    from vlbatch.pipeline.backends.backends import media_requests, pixel_specs
    from vlbatch.pipeline.demo import BUNDLED_MODEL

    spec = pixel_specs(str(BUNDLED_MODEL))["video"]
    good = next(v for v in videos if v.name == "h264_even.mp4")
    (row,) = _prepared(_cfg(tmp_path, "model-cpu"), [good.path])
    row = replace(row, ids=("a", "b"), input_ids=row.input_ids * 2, spans=row.spans * 2,
                  positions=np.concatenate([row.positions] * 2, axis=1), rope_deltas=row.rope_deltas * 2)
    ok = media_requests(row, spec, lambda rid: SamplingParams(), False, decode_device="cpu")
    assert set(ok) == {"a", "b"} and ok["a"].media[0] is ok["b"].media[0]  # one tensor for both prompts
    for data in (b"not a video", row.media_bytes[: len(row.media_bytes) // 3]):
        bad = media_requests(replace(row, media_bytes=data), spec, lambda rid: SamplingParams(), False,
                             decode_device="cpu")
        assert set(bad) == {"a", "b"} and all(isinstance(e, MediaError) for e in bad.values()), bad


def test_cuda_decode_device_is_refused_in_one_line_without_cuda(tmp_path):
    """Where CUDA is absent (this machine) `cuda` is refused before any work, in one line, by the
    driver's checks and by the model actor (`SetupError`: the run fails, no error rows); `model-cpu`
    (the same path on the CPU) is accepted wherever TorchCodec is."""
    from vlbatch.operators.errors import ConfigError, SetupError
    from vlbatch.operators.media.gpu_decode import DEFERRED, check_decode_device, decode_device_problem
    from vlbatch.pipeline.backends.backends import decode_device

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the refusal cannot be shown here (gpu_run.sh runs the decode)")
    assert decode_device_problem("model-cpu", "cpu") is None and DEFERRED == {"cuda": "cuda", "model-cpu": "cpu"}
    why = decode_device_problem("cuda", "auto")
    assert why is not None and "\n" not in why and "video.decode_device: cpu" in why
    with pytest.raises(ConfigError, match="no CUDA device here"):
        check_decode_device("cuda", "auto")
    assert decode_device(_cfg(tmp_path, "model-cpu")) == "cpu" and decode_device(_cfg(tmp_path, "cpu")) == "cpu"
    with pytest.raises(SetupError, match="video.decode_device: .*model.device") as e:  # auto resolved: the CPU
        decode_device(_cfg(tmp_path, "cuda"))
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.ray
def test_pipeline_answers_equal_with_the_decode_in_the_model_stage(two_cpu_ray, tmp_path, videos):
    """The whole job on the session's Ray, once with the CPU stage decoding and once with the model
    stage decoding (`model-cpu`): the same rows, answers, token counts and error rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlbatch.operators.sink.parquet import ParquetSink
    from vlbatch.pipeline.config import load_config
    from vlbatch.pipeline.demo import BUNDLED_MODEL
    from vlbatch.pipeline.graph import run_job

    names = ("h264_bframes.mp4", "vfr.mp4", "rotated_90.mp4", "claims_more.mp4", "not_media.mp4", "zero.mp4")
    uris = [next(v.path for v in videos if v.name == n) for n in names]
    manifest = tmp_path / "manifest.parquet"
    pq.write_table(pa.table({"media_uri": uris, "media_type": ["video"] * len(uris)}), manifest)
    rows = {}
    for device in ("cpu", "model-cpu"):
        cfg = load_config(REPO / "configs" / "demo.yaml", [
            f"model.path={BUNDLED_MODEL}", f"input.uri={manifest}", "input.format=parquet",
            f"output.uri={tmp_path / device}", "sampling.max_tokens=6", "max_error_fraction=1.0",
            "video.max_frames=8", "video.max_pixels=16384", f"video.decode_device={device}", *CAPTION_ONLY])
        result: dict = {}
        t = threading.Thread(target=lambda c=cfg, r=result: r.update(summary=run_job(c)), daemon=True)
        t.start()
        t.join(timeout=600)
        assert not t.is_alive(), f"the {device} job hung"
        table = ParquetSink(result["summary"].output_dir).read()
        rows[device] = {r["id"]: r for r in table.to_pylist()}
    keys = ("media_uri", "status", "error_type", "answer", "prompt_tokens", "visual_tokens", "generated_tokens")
    assert set(rows["cpu"]) == set(rows["model-cpu"]) and len(rows["cpu"]) == len(names)
    for rid, a in rows["cpu"].items():
        assert {k: a[k] for k in keys} == {k: rows["model-cpu"][rid][k] for k in keys}
    assert sorted(r["status"] for r in rows["cpu"].values()) == ["error"] * 2 + ["ok"] * 4
