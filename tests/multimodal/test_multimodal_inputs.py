"""dfllm.multimodal.image: decoding images from every accepted form, clear errors, stable hashes."""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import fsspec
import pytest
from PIL import Image

from dfllm.multimodal import ImageLoadError, image_hash, load_image


def _png(color=(200, 10, 30), size=(7, 5), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def test_load_image_every_form(tmp_path):
    data = _png()
    ref = Image.open(io.BytesIO(data)).convert("RGB")
    path = tmp_path / "a.png"
    path.write_bytes(data)
    with fsspec.open("memory://imgs/a.png", "wb") as f:
        f.write(data)
    forms = [
        data,
        bytearray(data),
        memoryview(data),
        "data:image/png;base64," + base64.b64encode(data).decode(),
        str(path),
        path,
        "file://" + str(path),
        "memory://imgs/a.png",
        {"url": str(path)},
        {"bytes": data, "path": None},
    ]
    for form in forms:
        img = load_image(form)
        assert isinstance(img, Image.Image), type(form)
        assert img.size == (7, 5)
        assert img.convert("RGB").tobytes() == ref.tobytes(), type(form)
    pil = Image.new("RGB", (3, 3))
    assert load_image(pil) is pil
    jpeg = load_image(_png(fmt="JPEG"))
    assert jpeg.format == "JPEG" and jpeg.size == (7, 5)


@pytest.mark.parametrize(
    "value,match",
    [
        (b"not an image", "cannot decode"),
        (b"", "empty"),
        (12, "type int"),
        (None, "type NoneType"),
        ("/no/such/image.png", "not found"),
        ("memory://no/such.png", "not found"),
        ("data:image/png;base64,AAAA", "cannot decode"),
        ("data:image/png;base64", "separating"),
        ({"foo": 1}, "'url', 'bytes' or 'path'"),
    ],
)
def test_load_image_errors_name_the_problem(value, match):
    with pytest.raises(ImageLoadError, match=match):
        load_image(value)
    assert issubclass(ImageLoadError, ValueError)


def test_http_without_network_is_a_clear_error():
    with pytest.raises(ImageLoadError, match="no network fetch"):
        load_image("http://127.0.0.1:9/none.png")  # port 9 (discard): nothing listens


def test_truncated_png_is_an_error():
    with pytest.raises(ImageLoadError, match="cannot decode"):
        load_image(_png(size=(64, 64))[:60])


def test_image_hash_is_pixel_based_and_stable_across_processes():
    a = load_image(_png())
    b = load_image(_png())  # same pixels, another decode
    c = load_image(_png(color=(200, 10, 31)))
    assert image_hash(a) == image_hash(b)
    assert image_hash(a) != image_hash(c)
    assert image_hash(a) != image_hash(a.convert("RGBA"))  # mode is part of the key
    assert image_hash(Image.new("RGB", (2, 3))) != image_hash(Image.new("RGB", (3, 2)))  # so is size
    # image.py alone in a fresh interpreter (importing dfllm would load dask, torch...: seconds)
    import dfllm.multimodal.image as module

    code = (
        "import base64, importlib.util as u; "
        f"s = u.spec_from_file_location('image', {module.__file__!r}); m = u.module_from_spec(s); "
        "s.loader.exec_module(m); "
        f"print(m.image_hash(m.load_image(base64.b64decode({base64.b64encode(_png()).decode()!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == image_hash(a)
    with pytest.raises(TypeError):
        image_hash(b"bytes")  # type: ignore[arg-type]
