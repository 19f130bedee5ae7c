"""Video decode on the model's GPU (`video.decode_device: cuda`): TorchCodec with NVDEC.

Owns where a video may be decoded on a device and the device-side decode itself.

- `decode_device_problem(device, model_device)`: None if `device` can decode here, else one line
  (the model runs on the CPU, TorchCodec or its FFmpeg libraries are missing, no CUDA device);
  `vlbatch validate` / `run` print it before any work starts (`pipeline/plan/checks.py`).
- `decode_planned(data, indices, total_frames, device)`: the model stage's half of the deferred
  decode: the frames at `indices`, which the CPU stage planned (`DecodeWorker.plan`) over
  `total_frames`, by the same route as `decode_on_device`; `MediaError` when the file decodes to
  another plan (a cut file whose recount moves the samples), since the prompt was built for this one.
- `decode_on_device(data, sampling, device)`: the same plan as the CPU path
  (`operators/media/video.py`: the shared PyAV probe, `FrameSampling.indices`, the same output limit),
  frames decoded by TorchCodec on `device`: a `DeviceClip` whose `frames` is a `[F, H, W, 3]` uint8
  torch tensor on that device, upright, bit for bit the frames the CPU path returns where NVDEC's
  colour conversion matches swscale (on the CPU device: always; tests/test_media_torchcodec.py).
  A file cut short falls back to the PyAV recount on the CPU, and its frames are copied to `device`.

It runs in the model actor's own process (the GPU's context lives there), not in the killable
decoder child: NVDEC runs in hardware and parses the container with FFmpeg as the child does. The
only part that goes through the child is the CPU stage's plan (`DecodeWorker.plan`: the same
protocol, a plan header and no frames), so no frame of this path crosses the child's hand-off.
"""
from __future__ import annotations

from dataclasses import dataclass

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.media.video import FrameSampling, Plan, collect, decode_stream


@dataclass(frozen=True)
class DeviceClip:
    """Sampled frames on a device: `frames` `[F, H, W, 3]` uint8 torch tensor; the rest as `VideoClip`."""

    frames: object
    source_fps: float
    total_frames: int
    indices: tuple[int, ...]


DEFERRED = {"cuda": "cuda", "model-cpu": "cpu"}  # `video.decode_device` -> the device the model stage decodes on


def decode_device_problem(device: str, model_device: str) -> str | None:
    """None if `device` ("cpu", "model-cpu", "cuda", "cuda:N") can decode videos here for a model on
    `model_device` ("auto", "cpu", "cuda"), else one line saying why and what to do.
    "model-cpu": the deferred path with TorchCodec on the model actor's CPU (its test without a GPU)."""
    if device == "cpu":
        return None
    if device == "model-cpu":
        from vlbatch.operators.media.decoders.torchcodec_backend import torchcodec_problem

        return torchcodec_problem()
    if not device.startswith("cuda"):
        return f"unknown decode device {device!r}; use cpu, model-cpu or cuda"
    if model_device == "cpu":
        return ("cuda decodes inside the model stage on the model's GPU, but model.device is cpu; "
                "set model.device: cuda (or auto), or video.decode_device: cpu")
    from vlbatch.operators.media.decoders.torchcodec_backend import torchcodec_problem

    if why := torchcodec_problem():
        return why
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False); set video.decode_device: cpu"
    return None


def check_decode_device(device: str, model_device: str) -> None:
    """Raise `ConfigError` (the one line of `decode_device_problem`) unless `device` can decode here."""
    if why := decode_device_problem(device, model_device):
        raise ConfigError(f"video.decode_device: {why}")


def decode_planned(data: bytes, indices: tuple[int, ...], total_frames: int, device: str,
                   threads: int = 1) -> object:
    """uint8 `[F, H, W, 3]` torch tensor on `device`: the frames at `indices` (planned over
    `total_frames` frames by the CPU stage, `DecodeWorker.plan`), upright. `MediaError` for a file
    that is not a video, or that decodes to another plan than the shipped one."""
    from vlbatch.operators.errors import MediaError

    # a sampling that replays the shipped indices: the decode route (and its cut-file recount) stays one
    sampling = _Replay(planned=tuple(int(i) for i in indices))
    clip = decode_on_device(data, sampling, device, threads)
    if clip.indices != sampling.planned or clip.total_frames != total_frames:
        raise MediaError(f"the video decodes to {clip.total_frames} frames, not the {total_frames} its index "
                         "holds (a cut file): its sampled frames moved since the CPU stage planned them; "
                         "decode it with video.decode_device: cpu")
    return clip.frames


@dataclass(frozen=True)
class _Replay(FrameSampling):
    """A `FrameSampling` that returns the planned indices (clipped to the frames present)."""

    planned: tuple[int, ...] = ()

    def indices(self, info):
        import numpy as np

        return np.clip(np.asarray(self.planned, np.int64), 0, max(info.frames - 1, 0))


def decode_on_device(data: bytes, sampling: FrameSampling, device: str, threads: int = 1) -> DeviceClip:
    """The sampled frames of `data`, decoded by TorchCodec on `device` (see the module docstring).

    Raises `MediaError` / `InputError` as the CPU path does; `ConfigError` where `device` cannot decode."""
    import torch

    from vlbatch.operators.errors import MediaError
    from vlbatch.operators.media.decoders import ShortVideo
    from vlbatch.operators.media.decoders.torchcodec_backend import TorchcodecDecoder

    if device != "cpu":
        check_decode_device(device, "cuda")
    try:
        video = TorchcodecDecoder(threads=threads, device=device).open(data)
    except ShortVideo:
        video = None
    if video is not None:
        with video:
            plan = Plan(video.info, tuple(int(i) for i in sampling.indices(video.info)), "torchcodec")
            plan.check(sampling)
            try:
                parts = [batch.repeat_interleave(torch.tensor(repeats, device=batch.device), dim=0)
                         for repeats, batch in video.iter_tensors(plan.indices)]
                return DeviceClip(torch.cat(parts), plan.info.fps, plan.info.frames, plan.indices)
            except ShortVideo:
                pass
    clip = collect(decode_stream(data, sampling, "pyav", threads))  # a cut file: PyAV recounts on the CPU
    if clip.frames is None:
        raise MediaError("no frame of the video stream could be decoded")
    return DeviceClip(torch.from_numpy(clip.frames).to(device), clip.source_fps, clip.total_frames, clip.indices)
