"""load_image's memory: one decoded copy at a time, measured as peak RSS in a fresh process.

A large, low-entropy file (small on disk, large decoded) is loaded in a subprocess; the
growth of its peak RSS over its RSS just before the call must stay near the size of the
returned array. The peak is `VmHWM` (this process image's high-water mark), not
`ru_maxrss`: Linux carries `ru_maxrss` over from the forking parent across exec, so a
child of a large pytest process would report the parent's size. Pillow stores RGB / RGBA pixels at 4 bytes each, so one
decoded copy of such an image is 4/3 of the `[H, W, 3]` result: the bound allows that,
plus a fixed slack (strips, the compressed bytes, allocator rounding). Loading the same
files the way the reference does (open, exif_transpose, convert, np.asarray) peaks at
several copies.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

SIDE = 8000  # 192 MB decoded as [H, W, 3]
SLACK = 24 << 20


def _pattern(side: int, channels: int) -> np.ndarray:
    """[side, side, channels] uint8 with little entropy: stripes that compress to a few hundred KB."""
    ramp = (np.arange(side, dtype=np.uint16) // 64 * 37 % 256).astype(np.uint8)
    out = np.empty((side, side, channels), np.uint8)
    for c in range(channels):
        out[..., c] = ramp[None, :] if c % 2 else ramp[:, None]
    return out


def _write_files(folder) -> dict[str, str]:
    rgb = _pattern(SIDE, 3)
    paths = {}
    for name, img in (("rgb", Image.fromarray(rgb)),
                      ("rgba", Image.fromarray(_pattern(SIDE, 4), "RGBA")),
                      ("palette", Image.fromarray(rgb).quantize(colors=16))):
        paths[name] = str(folder / f"{name}.png")
        img.save(paths[name], format="PNG", compress_level=1)
        img.close()
    return paths


MEASURE = r"""
import json, sys
import numpy as np
from vlbatch.operators.media.image import load_image

def status(key):  # bytes
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

data = open(sys.argv[1], "rb").read()
before = status("VmRSS")
out = load_image(data)
peak = status("VmHWM")
# afterwards (memory no longer matters): the same pixels as transformers' loading
import io
from PIL import Image, ImageOps
from transformers.image_transforms import convert_to_rgb
ref = convert_to_rgb(ImageOps.exif_transpose(Image.open(io.BytesIO(data))), return_numpy=True)
print(json.dumps({"growth": peak - before, "nbytes": out.nbytes, "equal": bool(np.array_equal(out, ref))}))
"""


@pytest.fixture(scope="module")
def large_pngs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("large")
    # written by a child process so this one's RSS stays small
    script = f"import pathlib, sys; sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r}); " \
             "import test_media_image_memory as t, json; print(json.dumps(t._write_files(pathlib.Path(sys.argv[1]))))"
    done = subprocess.run([sys.executable, "-c", script, str(folder)], check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rgb", "rgba", "palette"])
def test_peak_memory_is_one_decoded_copy(large_pngs, name):
    done = subprocess.run([sys.executable, "-c", MEASURE, large_pngs[name]], check=True, capture_output=True,
                          text=True)
    got = json.loads(done.stdout)
    assert got["nbytes"] == SIDE * SIDE * 3 and got["equal"]
    bound = 4 / 3 * got["nbytes"] + SLACK
    assert got["growth"] < bound, (f"{name}: peak RSS grew by {got['growth'] / 2**20:.0f} MiB for a "
                                   f"{got['nbytes'] / 2**20:.0f} MiB image (bound {bound / 2**20:.0f} MiB)")


# --- the strip-wise, in-place conversion equals the whole-image reference ----------------------------

def _samples():
    from test_preprocess_image import SAMPLES

    return SAMPLES


def _reference(data: bytes) -> np.ndarray:
    from test_preprocess_image import reference_rgb

    return reference_rgb(data)


def _decode(data: bytes, strip_rows: int) -> np.ndarray:
    from vlbatch.operators.media import image

    img = image._open(data, image.DEFAULT_MAX_PIXELS)
    img.seek(0)
    return image._decode_rgb(img, data, False, strip_rows=strip_rows)


@pytest.mark.parametrize("strip_rows", [1, 5, 36])
@pytest.mark.parametrize("name", sorted(_samples()))
def test_strips_match_reference(name, strip_rows):
    data = _samples()[name]  # 37 rows: strips of 1, of 5 (a short last one), and 36 + 1
    out = _decode(data, strip_rows)
    assert out.flags.c_contiguous and out.dtype == np.uint8
    np.testing.assert_array_equal(out, _reference(data))


def _with_orientation(img: Image.Image, fmt: str, orientation: int) -> bytes:
    import io

    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, format=fmt, exif=exif)
    return buf.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("mode, fmt", [("RGB", "PNG"), ("RGB", "JPEG"), ("RGBA", "PNG"), ("P", "PNG"),
                                       ("L", "PNG"), ("LA", "PNG"), ("I;16", "PNG")])
def test_orientation_is_fused_with_strips(mode, fmt, orientation):
    """In-place modes transpose with one copy afterwards; Pillow-storage modes (LA) write through the view."""
    rng = np.random.default_rng(orientation)
    rgba = Image.fromarray(rng.integers(0, 256, (23, 31, 4), dtype=np.uint8), "RGBA")
    img = rgba.convert("RGB").quantize(9) if mode == "P" else rgba.convert(mode)
    data = _with_orientation(img, fmt, orientation)
    out = _decode(data, strip_rows=4)
    assert out.shape == ((31, 23, 3) if orientation >= 5 else (23, 31, 3)) and out.flags.c_contiguous
    np.testing.assert_array_equal(out, _reference(data))


def test_a_loader_that_swaps_memory_falls_back(monkeypatch):
    """GIF's loader replaces the memory it is given (frame 0 with transparency) after Pillow put the
    palette into ours: forced onto the buffer path, the guard must notice and decode the ordinary way."""
    from vlbatch.operators.media import image

    monkeypatch.setattr(image, "_INTO_BUFFER", image._INTO_BUFFER | {"GIF"})
    for name in ("p_transparency_gif", "animated_gif"):
        data = _samples()[name]
        np.testing.assert_array_equal(image.load_image(data), _reference(data))
