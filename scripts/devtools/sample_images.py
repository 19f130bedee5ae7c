"""Deterministic sample images in many sizes, modes and formats (no downloads).

Owns the image half of the sample set: every PIL mode the loader must handle
(RGB, RGBA, P with transparency, L, LA, CMYK, I;16, 1), the formats JPEG / PNG /
WebP / GIF (static and animated, animated WebP), an EXIF-rotated JPEG, sizes from
tiny to 1080p, and bad bytes. `SampleImage` records what a correct loader returns
(upright size; `bad` means it must raise `MediaError`).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SampleImage:
    """One generated image file. width/height: upright size after EXIF orientation."""

    name: str
    path: str
    mode: str | None
    format: str | None
    width: int | None
    height: int | None
    frames: int = 1
    bad: bool = False
    note: str = ""


def gradient(width: int, height: int, seed: int = 0) -> np.ndarray:
    """[H, W, 3] uint8 smooth colour gradient plus a little deterministic noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rgb = np.stack([255 * x / max(1, width - 1), 255 * y / max(1, height - 1),
                    128 + 100 * np.sin((x + y) / 7.0)], axis=-1)
    noise = np.random.default_rng(seed).integers(-8, 9, rgb.shape)
    return np.clip(rgb + noise, 0, 255).astype(np.uint8)


def _save(img, path: Path, fmt: str, **kw) -> None:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    path.write_bytes(buf.getvalue())


def write_sample_images(out_dir: str | Path) -> list[SampleImage]:
    """Write the image sample set into `out_dir` (well under a second); return its manifest."""
    from PIL import Image

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s: list[SampleImage] = []

    def add(name, img, fmt, note="", size=None, frames=1, **kw):
        _save(img, out / name, fmt, **kw)
        w, h = size or img.size
        s.append(SampleImage(name, str(out / name), img.mode, fmt, w, h, frames, note=note))

    rgb = Image.fromarray(gradient(640, 480))
    add("rgb_640x480.jpg", rgb, "JPEG", quality=92)
    add("rgb_1920x1080.jpg", Image.fromarray(gradient(1920, 1080, 1)), "JPEG", quality=85)
    add("rgb_odd_37x201.png", Image.fromarray(gradient(37, 201, 2)), "PNG", "odd size, tall")
    add("rgb_tiny_3x5.png", Image.fromarray(gradient(3, 5, 3)), "PNG", "must be enlarged by resize")
    add("rgb_wide_1000x7.png", Image.fromarray(gradient(1000, 7, 4)), "PNG", "aspect 143:1")
    rgba = Image.fromarray(np.dstack([gradient(120, 90, 5), np.linspace(0, 255, 120 * 90).reshape(90, 120)
                                      .astype(np.uint8)]), "RGBA")
    add("rgba_120x90.png", rgba, "PNG", "alpha gradient")
    pal = rgb.resize((100, 75)).quantize(colors=32)
    pal.info["transparency"] = 0
    add("palette_100x75.png", pal, "PNG", "P mode with a transparent index", transparency=0)
    add("gray_L_64x48.png", rgb.resize((64, 48)).convert("L"), "PNG")
    add("gray_LA_64x48.png", rgba.resize((64, 48)).convert("LA"), "PNG")
    add("cmyk_80x60.jpg", rgb.resize((80, 60)).convert("CMYK"), "JPEG", quality=95)
    i16 = Image.fromarray((np.linspace(0, 65535, 50 * 40).reshape(40, 50)).astype(np.uint16))
    add("gray16_50x40.png", i16, "PNG", "16-bit grayscale (I;16)")
    add("bilevel_1_33x21.png", rgb.resize((33, 21)).convert("1"), "PNG", "1-bit")
    add("rgb_200x150.webp", rgb.resize((200, 150)), "WEBP", quality=90)
    add("rgba_lossless_64x64.webp", rgba.resize((64, 64)), "WEBP", lossless=True)
    add("static_90x60.gif", rgb.resize((90, 60)).quantize(colors=64), "GIF")
    frames = [Image.fromarray(gradient(48, 32, k)).quantize(colors=64) for k in range(5)]
    add("animated_48x32.gif", frames[0], "GIF", "5 frames: loader takes the first", frames=5,
        save_all=True, append_images=frames[1:], duration=80, loop=0)
    wframes = [Image.fromarray(gradient(40, 30, k)) for k in range(3)]
    add("animated_40x30.webp", wframes[0], "WEBP", "3 frames", frames=3,
        save_all=True, append_images=wframes[1:], duration=100)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation 6: stored image must be rotated 90 degrees clockwise to display
    add("exif_rot6_160x90.jpg", Image.fromarray(gradient(160, 90, 6)), "JPEG", "EXIF orientation 6",
        size=(90, 160), exif=exif.tobytes(), quality=92)
    jpeg = (out / "rgb_640x480.jpg").read_bytes()
    for name, data, note in [("truncated.jpg", jpeg[: len(jpeg) // 3], "first third of a JPEG"),
                             ("zero.png", b"", "zero bytes"),
                             ("not_image.png", b"<html>not an image</html>\n" * 20, "HTML with an image extension")]:
        (out / name).write_bytes(data)
        s.append(SampleImage(name, str(out / name), None, None, None, None, bad=True, note=note))
    return s
