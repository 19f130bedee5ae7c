"""Target sizes (smart_resize) and the resize op for images and video frames.

Owns the arithmetic that picks each image's / clip's resized height and width
and the interpolation that produces the resized pixels.

Sizes: `smart_resize_image` and `smart_resize_video` reproduce transformers 5.23
(`qwen2_vl/image_processing_qwen2_vl.smart_resize` and
`qwen3_vl/video_processing_qwen3_vl.smart_resize`, including the per-frame cap
`cap_pixels_per_frame` of `Qwen3VLVideoProcessor.resize`) with the same float
expressions, so the grids are identical. Limit violations raise `InputError`.

Resize backend (decision): the reference that `AutoProcessor` loads for our
checkpoints is `Qwen2VLImageProcessor` (torchvision backend; the config names
`Qwen2VLImageProcessorFast`, which 5.23 maps to it) for images and
`Qwen3VLVideoProcessor` for video. Both call
`torchvision.transforms.v2.functional.resize(uint8 [.., 3, H, W], (h, w),
interpolation=BICUBIC, antialias=True)`, which on CPU runs torch's native uint8
antialiased bicubic kernel (`_upsample_bicubic2d_aa` on uint8, integer
arithmetic) and returns the input unchanged when the size already matches.
`resize_frames` makes exactly that kernel call with exactly those arguments on
the same uint8 values, so the resized pixels are bit-identical to the reference's
(largest difference seen in the parity tests: 0). The one change is the memory
layout: we pass the decoded `[F, H, W, 3]` pixels as a channels-last view
instead of first copying them to channels-first; the kernel computes the same
values in either layout (the tests compare against the reference's
channels-first call) and channels-last is its native, several times faster
layout. We do not use PIL (the reference's slow path) nor a float resize
(different rounding).
"""
from __future__ import annotations

import math

import torch

from vlbatch.operators.errors import InputError
from vlbatch.operators.media.image import MAX_ASPECT_RATIO


def _aspect_error(height: int, width: int) -> InputError:
    ratio = max(height, width) / max(min(height, width), 1)
    return InputError(
        f"aspect ratio {ratio:.1f}:1 of a {width}x{height} (WxH) input exceeds the limit of "
        f"{MAX_ASPECT_RATIO}:1; crop or pad it before captioning"
    )


def _check_dims(height: int, width: int) -> None:
    if height <= 0 or width <= 0:
        raise InputError(f"image size must be positive, got {width}x{height} (WxH)")


def smart_resize_image(
    height: int, width: int, *, factor: int = 32, min_pixels: int = 65536, max_pixels: int = 16777216
) -> tuple[int, int]:
    """(h, w) multiples of `factor` with `min_pixels <= h*w <= max_pixels`, aspect kept.

    Rounds each side to the nearest multiple of `factor`; if the area leaves the
    budget, scales both sides by `sqrt(area / budget)` and floors (too large) or
    ceils (too small) to the factor. Raises `InputError` above 200:1.
    """
    _check_dims(height, width)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise _aspect_error(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_max_pixels(
    num_frames: int,
    *,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    cap_pixels_per_frame: bool = False,
    max_video_tokens: int = 768,
) -> int:
    """The clip's pixel budget over frames x h x w.

    Without the cap it is `max_pixels`. With `cap_pixels_per_frame` each frame
    may use at most `min(max_video_tokens * factor^2, max_pixels // F)` pixels,
    floored at `int(1.05 * min_pixels)`, so short clips do not spend the whole
    budget on few frames.
    """
    if not cap_pixels_per_frame:
        return max_pixels
    frame_cap = max_video_tokens * factor * factor
    per_frame = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05))
    return per_frame * num_frames


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int = 2,
    factor: int = 32,
    min_pixels: int = 4096,
    max_pixels: int = 25165824,
) -> tuple[int, int]:
    """(h, w) for a clip of `num_frames` frames; the budget covers frames x h x w.

    Frames smaller than `factor` on a side are first enlarged so the short side
    reaches `factor`. Raises `InputError` for fewer frames than `temporal_factor`
    and for aspect ratios above 200:1.
    """
    _check_dims(height, width)
    if num_frames < temporal_factor:
        raise InputError(
            f"a video needs at least {temporal_factor} sampled frames (the temporal patch size), got {num_frames}"
        )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise _aspect_error(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Resize uint8 `[N, 3, H, W]` (any memory format) to `[N, 3, height, width]` uint8.

    The op torchvision's `resize_image` runs for the reference on CPU uint8 with
    BICUBIC + antialias (see the module docstring): identity when the size is
    unchanged, else `interpolate(mode="bicubic", align_corners=False,
    antialias=True)` directly on uint8 (no float cast). Calling it here rather
    than through torchvision avoids importing torchvision (seconds) at run time.
    A channels-last input gives a channels-last output.
    """
    if frames.dtype != torch.uint8:
        raise ValueError(f"resize_frames expects uint8 pixels, got {frames.dtype}")
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    return torch.nn.functional.interpolate(frames, size=[height, width], mode="bicubic", align_corners=False,
                                           antialias=True)
