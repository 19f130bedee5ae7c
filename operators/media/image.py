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

Memory: one decoded copy at a time (a 169 Mpx PNG is a 483 MB result; the
reference path holds several). PNG / JPEG / WebP / BMP in the modes Pillow can
map onto a buffer (L, P, I;16, RGB, RGBA, CMYK) decode straight into the
output's memory and are converted there in place, strip by strip; other files
convert strip by strip from Pillow's storage into the output. The EXIF
transpose is fused into that write, or one copy after the in-place conversion.
Every conversion is pixel-wise, so strips give the whole-image result.

Errors: empty, truncated or non-image bytes and decompression bombs raise
`MediaError`; an aspect ratio above 200:1 raises `InputError` (the processor's
limit, reported at load time so no work is wasted).
"""
from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import ExifTags, Image, UnidentifiedImageError

from vlbatch.operators.errors import InputError, MediaError, stable_message

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
        raise MediaError(f"image rejected as a decompression bomb: {stable_message(str(e))}") from e
    except UnidentifiedImageError as e:  # its text names the file object, a per-run address
        # the size only: the bytes are the file's (a remote manifest's or a link's target), never quoted
        raise MediaError(f"bytes are not a decodable image ({len(data)} bytes): no image format "
                         "recognises them") from e
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"bytes are not a decodable image ({len(data)} bytes): {stable_message(str(e))}") from e
    w, h = img.size
    if w * h > max_pixels:
        raise MediaError(
            f"image rejected as a possible decompression bomb: {w}x{h} = {w * h} pixels exceeds the "
            f"limit of {max_pixels} pixels"
        )
    if w <= 0 or h <= 0:
        raise MediaError(f"image has no pixels ({w}x{h})")
    return img


# Pillow's storage bytes per pixel for the modes it can map onto a buffer of ours; those decode
# straight into the output's memory. Other modes (LA, I, F, 1, ...) decode into Pillow's own.
_MAPPED_BYTES = {"L": 1, "P": 1, "I;16": 2, "RGB": 4, "RGBA": 4, "CMYK": 4}
# formats whose loaders decode into the memory they are given (GIF and TIFF may swap in their own)
_INTO_BUFFER = frozenset({"PNG", "JPEG", "WEBP", "BMP"})
STRIP_BYTES = 2 << 20  # source bytes converted per strip (each strip makes a few copies of this size)

# EXIF orientation -> view of the upright [H', W', 3] in the file's stored [H, W, 3] orientation
# (the inverse of the transpose `ImageOps.exif_transpose` applies; 5 and 7 are their own inverse)
_STORED_VIEW = {
    2: lambda a: a[:, ::-1],  # FLIP_LEFT_RIGHT
    3: lambda a: a[::-1, ::-1],  # ROTATE_180
    4: lambda a: a[::-1],  # FLIP_TOP_BOTTOM
    5: lambda a: a.transpose(1, 0, 2),  # TRANSPOSE
    6: lambda a: np.rot90(a, 1),  # ROTATE_270 (clockwise)
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),  # TRANSVERSE
    8: lambda a: np.rot90(a, -1),  # ROTATE_90 (counter-clockwise)
}


def _to_rgb(img: Image.Image, scale_high_bit_depth: bool) -> np.ndarray:
    """One image (here: a strip of rows) -> `[h, W, 3]` uint8, as transformers' `convert_to_rgb`."""
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(background, rgba).convert("RGB"))
    if scale_high_bit_depth and img.mode.startswith("I;16"):
        gray = (np.asarray(img).astype(np.uint16) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    return np.asarray(img.convert("RGB"))


def _load(img: Image.Image, data: bytes) -> tuple[Image.Image, np.ndarray | None]:
    """Load the pixels of `img` (opened from `data`, not loaded). Returns the loaded image and, for
    mapped modes of `_INTO_BUFFER` formats, the flat uint8 buffer of `max(3, s) * H * W` bytes they
    were decoded into (s bytes a pixel, in its last `s * H * W` bytes, so the RGB result fits in the
    same memory); None when the pixels are in Pillow's storage."""
    s = _MAPPED_BYTES.get(img.mode) if img.format in _INTO_BUFFER else None
    if s is None:
        img.load()
        return img, None
    w, h = img.size
    buf = np.empty(max(3, s) * h * w, np.uint8)
    # ImageFile.load decodes into an image memory already set (right mode and size)
    core = Image.core.map_buffer(buf, (w, h), "raw", buf.size - s * h * w, (img.mode, 0, 1))
    img.im = core
    img.load()
    if img.im is core:
        return img, buf
    # the loader swapped in memory of its own (and may have used state meant for it): the ordinary way
    img = _open(data, w * h)
    img.seek(0)
    img.load()
    return img, None


def _convert_strips(img: Image.Image, dst: np.ndarray, scale_high_bit_depth: bool, rows: int) -> None:
    """dst[y0:y1] = RGB of source rows y0:y1, strip by strip (pixel-wise conversions, so equal to
    converting the whole image). In place over `_load`'s buffer: strip k's output
    ends at byte 3*W*y1, never past where the unread rows start."""
    w, h = img.size
    for y0 in range(0, h, rows):
        y1 = min(h, y0 + rows)
        dst[y0:y1] = _to_rgb(img.crop((0, y0, w, y1)), scale_high_bit_depth)


def _decode_rgb(img: Image.Image, data: bytes, scale_high_bit_depth: bool, strip_rows: int | None = None
                ) -> np.ndarray:
    """Upright RGB `[H', W', 3]` of `img` (opened, at its first frame) holding one decoded copy at a time.

    Mapped modes decode into the output's buffer and convert in place (then a 4-byte source gives
    back its last quarter); other modes convert from Pillow's storage straight into the upright
    output. EXIF orientation: fused into that conversion, or one transposing copy after the in-place one.
    """
    w, h = img.size
    rows = strip_rows or max(1, STRIP_BYTES // (4 * w))
    img, buf = _load(img, data)
    orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
    stored = _STORED_VIEW.get(orientation, lambda a: a)
    upright_shape = (w, h, 3) if orientation in (5, 6, 7, 8) else (h, w, 3)
    if buf is None:
        out = np.empty(upright_shape, np.uint8)
        _convert_strips(img, stored(out), scale_high_bit_depth, rows)
        return out
    _convert_strips(img, buf[: h * w * 3].reshape(h, w, 3), scale_high_bit_depth, rows)
    img.close()  # releases Pillow's hold on buf
    try:
        buf.resize(h * w * 3, refcheck=True)  # realloc: gives the tail back
    except ValueError:  # still referenced: keep the larger block
        buf = buf[: h * w * 3]
    out = buf.reshape(h, w, 3)
    if orientation not in _STORED_VIEW:
        return out
    upright = np.empty(upright_shape, np.uint8)
    stored(upright)[...] = out
    return upright


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
        out = _decode_rgb(img, data, scale_high_bit_depth)
    except Image.DecompressionBombError as e:
        raise MediaError(f"image rejected as a decompression bomb: {stable_message(str(e))}") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise MediaError(f"image data is truncated or corrupt: {stable_message(str(e))}") from e
    return np.ascontiguousarray(out, dtype=np.uint8)
