"""Image bytes -> upright RGB uint8 pixels `[H, W, 3]`.

Owns decoding, orientation and colour conversion. The result equals what
transformers' pipeline gives the Qwen processor for the same file
(`PIL.Image.open` -> `ImageOps.exif_transpose` -> `convert_to_rgb`):

- EXIF orientation is applied;
- animated images (GIF, APNG, WebP) use their first frame;
- images with transparency (an alpha band such as RGBA / LA / PA, or a
  `transparency` entry on P / L / RGB) are composited onto white with
  `Image.alpha_composite`, as transformers' `convert_to_rgb` does;
- every other mode (L, 1, P, CMYK, YCbCr, I;16, I, F, ...) goes through Pillow's
  `convert("RGB")`. For high-bit-depth modes (I;16, I, F) Pillow clips values to
  0..255 rather than scaling; that is the reference's behaviour and the default
  here. `scale_high_bit_depth=True` maps 16-bit data by `v >> 8` instead (a
  deliberate departure from the reference, off by default).

Errors: empty, truncated or non-image bytes and decompression bombs raise
`MediaError`; an aspect ratio above 200:1 raises `InputError` (the processor's
limit, reported at load time so no work is wasted).
"""
from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from vlbatch.operators.errors import InputError, MediaError

MAX_ASPECT_RATIO = 200  # the processor's limit (smart_resize refuses beyond it); checked here first

# Pillow raises DecompressionBombError above twice this; we use the same figure
# as our own, explicit default limit (about 179 megapixels).
DEFAULT_MAX_PIXELS = 2 * 89_478_485


def _open(data: bytes, max_pixels: int) -> Image.Image:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MediaError(f"image data must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise MediaError("image data is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            # we enforce our own limit below; Pillow's warning would only be noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise MediaError(f"image rejected as a decompression bomb: {e}") from e
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"bytes are not a decodable image ({len(data)} bytes): {e}") from e
    w, h = img.size
    if w * h > max_pixels:
        raise MediaError(
            f"image rejected as a possible decompression bomb: {w}x{h} = {w * h} pixels exceeds the "
            f"limit of {max_pixels} pixels"
        )
    if w <= 0 or h <= 0:
        raise MediaError(f"image has no pixels ({w}x{h})")
    return img


def _to_rgb(img: Image.Image, scale_high_bit_depth: bool) -> np.ndarray:
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(background, rgba).convert("RGB"))
    if scale_high_bit_depth and img.mode.startswith("I;16"):
        gray = (np.asarray(img).astype(np.uint16) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    return np.asarray(img.convert("RGB"))


def load_image(
    data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS, scale_high_bit_depth: bool = False
) -> np.ndarray:
    """Decode image bytes to upright RGB uint8 `[H, W, 3]` (C-contiguous).

    Raises `MediaError` (not an image, truncated, empty, over `max_pixels`) or
    `InputError` (aspect ratio above 200:1).
    """
    img = _open(data, max_pixels)
    w, h = img.size
    if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
        raise InputError(
            f"aspect ratio {max(w, h) / min(w, h):.1f}:1 of a {w}x{h} (WxH) image exceeds the limit of "
            f"{MAX_ASPECT_RATIO}:1; crop or pad it before captioning"
        )
    try:
        img.seek(0)  # first frame of an animation (Pillow opens there; explicit for clarity)
        img.load()
        img = ImageOps.exif_transpose(img)
        out = _to_rgb(img, scale_high_bit_depth)
    except Image.DecompressionBombError as e:
        raise MediaError(f"image rejected as a decompression bomb: {e}") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError(f"image data is truncated or corrupt: {e}") from e
    return np.ascontiguousarray(out, dtype=np.uint8)
