"""loader.vision.images: inspection, every reject reason, deterministic RGB decode."""

from __future__ import annotations

import hashlib
import zlib

import numpy as np
import pytest
from PIL import Image

from image_factory import FORMATS, drawn_image, encode, image_bytes
from loader.vision.images import ImageLimits, decode_rgb, inspect_image, sniff_format
from loader.vision.reasons import IMAGE_REJECT_REASONS, ImageRejected


def reason_of(data, limits=ImageLimits()) -> str:
    with pytest.raises(ImageRejected) as caught:
        inspect_image(data, limits)
    assert caught.value.reason in IMAGE_REJECT_REASONS
    return caught.value.reason


@pytest.mark.parametrize("image_format", FORMATS)
@pytest.mark.parametrize("size", [(1, 1), (17, 5), (640, 480), (33, 900)])
def test_inspect_reports_format_size_and_sha256(image_format, size):
    data = image_bytes(*size, image_format=image_format, seed=size[0])
    info = inspect_image(data)
    assert (info.format, info.width, info.height, info.nbytes) == (image_format, *size, len(data))
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert sniff_format(data) == image_format


@pytest.mark.parametrize("image_format", FORMATS)
def test_truncated_bytes_are_image_truncated(image_format):
    data = image_bytes(200, 120, image_format=image_format, seed=3)
    for cut in (len(data) // 2, len(data) - 1, 40):
        assert reason_of(data[:cut]) == "image_truncated", (image_format, cut)


def test_png_with_garbage_after_iend_is_accepted():
    data = image_bytes(30, 20, "PNG") + b"trailer bytes"
    assert inspect_image(data).width == 30


def test_missing_and_empty_bytes_are_image_missing():
    assert reason_of(None) == "image_missing"
    assert reason_of(b"") == "image_missing"


def test_not_an_image_and_corrupt_data_are_undecodable():
    assert reason_of(b"this is a caption, not an image") == "image_undecodable"
    png = bytearray(image_bytes(64, 64, "PNG", seed=1))
    png[60:90] = bytes(30)  # inside the IDAT chunk: the zlib stream breaks
    assert reason_of(bytes(png)) == "image_undecodable"
    assert reason_of(b"\xff\xd8\xff" + bytes(100)) == "image_undecodable"  # JPEG magic, no JPEG after it


@pytest.mark.parametrize("image_format", ["GIF", "BMP", "TIFF"])
def test_other_formats_are_unsupported(image_format):
    assert reason_of(encode(drawn_image(20, 10), image_format)) == "image_unsupported_format"


def test_limits_bytes_pixels_and_aspect_ratio():
    data = image_bytes(100, 50, "PNG")
    assert reason_of(data, ImageLimits(max_bytes=len(data) - 1)) == "image_too_large"
    assert inspect_image(data, ImageLimits(max_bytes=len(data))).width == 100
    assert reason_of(data, ImageLimits(max_pixels=100 * 50 - 1)) == "image_too_large"
    assert inspect_image(data, ImageLimits(max_pixels=100 * 50)).height == 50
    assert reason_of(image_bytes(201, 1, "PNG")) == "image_extreme_aspect_ratio"
    assert inspect_image(image_bytes(200, 1, "PNG")).width == 200
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")


def test_decompression_bomb_is_refused_from_the_header_without_decoding():
    # A 60000 x 60000 RGB header (10.8 GB decoded) over a tiny IDAT: refused as too large from the
    # header alone; had it been decoded, the short IDAT would have made it image_truncated.
    header = (60000).to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    bomb = (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(bytes(1000)))
            + _png_chunk(b"IEND", b""))
    assert len(bomb) < 200
    assert reason_of(bomb) == "image_too_large"
    # Below Pillow's own guard but above ours: still ours, before decoding.
    small_header = (9000).to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    small = bomb.replace(_png_chunk(b"IHDR", header), _png_chunk(b"IHDR", small_header))
    assert reason_of(small) == "image_too_large"


@pytest.mark.parametrize("image_format", FORMATS)
def test_decode_is_rgb_and_deterministic(image_format):
    data = image_bytes(90, 70, image_format=image_format, seed=5)
    first, second = np.asarray(decode_rgb(data)), np.asarray(decode_rgb(data))
    assert first.shape == (70, 90, 3) and first.dtype == np.uint8
    assert np.array_equal(first, second)
    if image_format != "JPEG":  # lossless: the pixels drawn
        assert np.array_equal(first, np.asarray(drawn_image(90, 70, seed=5)))


def test_transparency_is_composited_onto_white_and_grey_becomes_rgb():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    pixels = np.asarray(decode_rgb(encode(rgba, "PNG")))
    assert pixels[0, 0].tolist() == [10, 20, 30] and pixels[1, 1].tolist() == [255, 255, 255]
    grey = np.asarray(decode_rgb(image_bytes(8, 8, "PNG", mode="L")))
    assert grey.shape == (8, 8, 3) and np.array_equal(grey[..., 0], grey[..., 2])
    palette = np.asarray(decode_rgb(image_bytes(8, 8, "PNG", mode="P")))
    assert palette.shape == (8, 8, 3)
