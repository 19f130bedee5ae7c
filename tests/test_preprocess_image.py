"""load_image: every PIL mode, EXIF, animations and bad bytes, against transformers' RGB conversion.

The reference path for a file is what transformers applies to a PIL image:
`PIL.Image.open` -> `ImageOps.exif_transpose` -> `image_transforms.convert_to_rgb`.
"""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps
from transformers.image_transforms import convert_to_rgb

from vlbatch.operators.errors import InputError, MediaError
from vlbatch.operators.preprocess import load_image


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _noise(h: int, w: int, c: int, seed: int = 0, dtype=np.uint8, hi: int = 256) -> np.ndarray:
    a = np.random.default_rng(seed).integers(0, hi, (h, w, c) if c else (h, w))
    return a.astype(dtype)


def mode_samples() -> dict[str, bytes]:
    """One encoded file per mode / container the loader must handle (odd sizes on purpose)."""
    h, w = 37, 53
    rgb = Image.fromarray(_noise(h, w, 3))
    rgba = Image.fromarray(_noise(h, w, 4, 1), "RGBA")
    pal = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=17)
    pal_t = pal.copy()
    pal_t.info["transparency"] = 3
    gray = Image.fromarray(_noise(h, w, 0, 2))
    gray_t = gray.copy()
    la = Image.fromarray(_noise(h, w, 2, 3), "LA")
    i16 = Image.fromarray(_noise(h, w, 0, 4, np.uint16, 65536))  # mode I;16
    i32 = Image.fromarray(_noise(h, w, 0, 5, np.int32, 70000) - 1000)
    f32 = Image.fromarray(_noise(h, w, 0, 6).astype(np.float32) * 1.7 - 20.0)
    frames = [Image.fromarray(_noise(h, w, 3, s)).convert("P") for s in range(3)]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    apng = io.BytesIO()
    rgb.save(apng, format="PNG", save_all=True, append_images=[Image.fromarray(_noise(h, w, 3, 9))])
    return {
        "rgb_jpeg": _encode(rgb, "JPEG", quality=90),
        "rgb_png": _encode(rgb, "PNG"),
        "rgba_png": _encode(rgba, "PNG"),
        "rgba_webp": _encode(rgba, "WEBP", lossless=True),
        "p_png": _encode(pal, "PNG"),
        "p_transparency_png": _encode(pal_t, "PNG"),
        "p_transparency_gif": _encode(pal_t, "GIF"),
        "l_png": _encode(gray, "PNG"),
        "l_transparency_png": _encode(gray_t, "PNG", transparency=7),
        "la_png": _encode(la, "PNG"),
        "1_png": _encode(gray.convert("1"), "PNG"),
        "cmyk_jpeg": _encode(rgb.convert("CMYK"), "JPEG", quality=95),
        "cmyk_tiff": _encode(rgb.convert("CMYK"), "TIFF"),
        "i16_png": _encode(i16, "PNG"),
        "i32_tiff": _encode(i32, "TIFF"),
        "f32_tiff": _encode(f32, "TIFF"),
        "ycbcr_jpeg": _encode(rgb.convert("YCbCr"), "JPEG"),
        "animated_gif": gif.getvalue(),
        "animated_png": apng.getvalue(),
    }


def reference_rgb(data: bytes) -> np.ndarray:
    img = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    return convert_to_rgb(img, return_numpy=True)


SAMPLES = mode_samples()


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_modes_match_reference_conversion(name):
    data = SAMPLES[name]
    ours = load_image(data)
    ref = reference_rgb(data)
    assert ours.dtype == np.uint8 and ours.ndim == 3 and ours.shape[2] == 3 and ours.flags.c_contiguous
    np.testing.assert_array_equal(ours, ref)


def test_alpha_is_composited_on_white():
    px = np.zeros((4, 6, 4), np.uint8)
    px[..., 0] = 200  # red channel, fully transparent -> white
    px[:2, :, 3] = 255  # top half opaque -> (200, 0, 0)
    ours = load_image(_encode(Image.fromarray(px, "RGBA"), "PNG"))
    assert (ours[2:] == 255).all()
    assert (ours[:2] == [200, 0, 0]).all()


def test_animation_takes_first_frame():
    first = _noise(8, 10, 3, 11)
    frames = [Image.fromarray(first), Image.fromarray(_noise(8, 10, 3, 12))]
    buf = io.BytesIO()
    frames[0].save(buf, format="PNG", save_all=True, append_images=frames[1:])
    np.testing.assert_array_equal(load_image(buf.getvalue()), first)


@pytest.mark.parametrize("orientation", [1, 2, 3, 4, 5, 6, 7, 8])
def test_exif_orientation_is_applied(orientation):
    base = _noise(20, 30, 3, orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encode(Image.fromarray(base), "PNG", exif=exif)
    ours = load_image(data)
    np.testing.assert_array_equal(ours, reference_rgb(data))
    # independent check: rotations 5..8 swap width and height
    assert ours.shape[:2] == ((30, 20) if orientation >= 5 else (20, 30))
    if orientation == 3:
        np.testing.assert_array_equal(ours, base[::-1, ::-1])


def test_high_bit_depth_scaling_is_opt_in():
    a = np.array([[0, 255, 256, 65535]], np.uint16)
    data = _encode(Image.fromarray(a), "PNG")
    assert load_image(data)[0, :, 0].tolist() == [0, 255, 255, 255]  # the reference clips
    assert load_image(data, scale_high_bit_depth=True)[0, :, 0].tolist() == [0, 0, 1, 255]


def _png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims width x height (a decompression bomb's signature)."""
    data = bytearray(_encode(Image.new("L", (1, 1)), "PNG"))
    ihdr = data[12:29]  # b"IHDR" + 13 bytes of fields
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def test_decompression_bomb_is_a_media_error():
    with pytest.raises(MediaError, match="decompression bomb"):
        load_image(_png_claiming(40000, 40000))
    with pytest.raises(MediaError, match="decompression bomb"):
        load_image(_png_claiming(15000, 15000))  # under Pillow's limit, over ours
    ok = _encode(Image.fromarray(_noise(100, 100, 3)), "PNG")
    with pytest.raises(MediaError, match="10000 pixels exceeds the limit of 5000"):
        load_image(ok, max_pixels=5000)


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "empty"),
        (b"this is not an image at all", "not a decodable image"),
        (SAMPLES["rgb_png"][: len(SAMPLES["rgb_png"]) // 2], "truncated or corrupt"),
        (SAMPLES["rgb_jpeg"][:300], "truncated or corrupt|not a decodable"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "not a decodable image"),
    ],
    ids=["empty", "text", "truncated_png", "truncated_jpeg", "bad_png_header"],
)
def test_bad_bytes_raise_media_error(data, words):
    with pytest.raises(MediaError, match=words):
        load_image(data)


def test_aspect_ratio_limit():
    assert load_image(_encode(Image.new("RGB", (400, 2)), "PNG")).shape == (2, 400, 3)  # exactly 200:1
    with pytest.raises(InputError, match="aspect ratio 201.0:1"):
        load_image(_encode(Image.new("RGB", (1, 201)), "PNG"))
