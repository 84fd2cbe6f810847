"""Images a client sends are read safely (issue 33, items 3 and 7): only PNG, JPEG, WebP,
GIF and BMP are ever opened (PIL's EPS plugin would run Ghostscript on the bytes, whatever
mime type the data: URL declares), every header is checked before anything is decoded
(the request's total pixels too), and a model without a vision tower decodes nothing."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import EpsImagePlugin, Image
from server_runs import running_server

from mlx_lm_diffusion.media import images

EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\n"
    b"newpath 0 0 moveto 10 10 lineto stroke\nshowpage\n%%EOF\n"
)
SERVER = images.ImagePolicy(allow_paths=False)


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("1", (width, height)).save(out, format="PNG")  # a few kB: a decompression bomb
    return out.getvalue()


@pytest.fixture
def decodes(monkeypatch):
    """Every image decoded in full, and every Ghostscript run PIL would start."""
    seen = {"decoded": 0, "ghostscript": 0}
    decode = images._decode

    def counting(image, what):
        seen["decoded"] += 1
        return decode(image, what)

    def ghostscript(*args, **kwargs):
        seen["ghostscript"] += 1
        raise RuntimeError("Ghostscript ran")

    monkeypatch.setattr(images, "_decode", counting)
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", ghostscript)
    return seen


@pytest.mark.parametrize("mime", ["image/png", "image/jpeg", "image/eps"])
def test_postscript_is_never_opened_whatever_the_declared_type(decodes, mime):
    assert Image.open(io.BytesIO(EPS)).format == "EPS"  # (PIL alone would take it for an image)
    with pytest.raises(images.ImageError, match="not an image in an allowed format") as e:
        images.open_image(data_url(EPS, mime), SERVER)
    assert e.value.status == 400 and decodes == {"decoded": 0, "ghostscript": 0}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_the_allowed_formats_open(fmt):
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(out, format=fmt)
    image = images.open_image(data_url(out.getvalue()), SERVER)
    assert image.size == (8, 6) and image.mode == "RGB"


def test_animated_images_are_refused():
    out = io.BytesIO()
    frames = [Image.new("RGB", (8, 8), (i * 40, 0, 0)) for i in range(3)]
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    with pytest.raises(images.ImageError, match="animated"):
        images.open_image(data_url(out.getvalue(), "image/gif"), SERVER)


def test_a_request_of_bombs_is_refused_before_any_is_decoded(decodes):
    """Each 6300 x 6300 PNG is under the per-image limit (and a few kB): three of them are
    past the request's pixel budget, refused from their headers alone."""
    bomb = data_url(png(6300, 6300))
    assert 6300 * 6300 <= images.MAX_IMAGE_PIXELS < 3 * 6300 * 6300
    with pytest.raises(images.ImageError, match="pixels together") as e:
        images.open_images([bomb] * 3, SERVER)
    assert e.value.status == 413 and decodes["decoded"] == 0
    with pytest.raises(images.ImageError, match="past the limit"):  # one past the per-image limit
        images.open_images([data_url(png(7000, 7000))], SERVER)
    assert decodes["decoded"] == 0
    assert [i.size for i in images.open_images([data_url(png(64, 48))] * 3, SERVER)] == [(64, 48)] * 3


def test_a_model_without_a_vision_tower_decodes_no_image(llada_path, decodes):
    import http.client

    message = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Hi"},
                {"type": "image_url", "image_url": {"url": data_url(png(64, 64))}},
            ],
        }
    ]
    with running_server(["--model", str(llada_path), "--port", "0", "--log-level", "WARNING"]) as (httpd, _):
        conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=120)
        for body in ({"messages": message, "max_tokens": 2}, {"messages": message, "max_tokens": 2, "model": "nope"}):
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            error = json.loads(response.read())["error"]
            if body.get("model") == "nope":
                assert response.status == 404 and error["code"] == "model_not_found", error
            else:
                assert response.status == 400 and "takes no images" in error["message"], error
    assert decodes["decoded"] == 0
