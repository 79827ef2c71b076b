"""Encoded image bytes: inspect them (format, size, SHA-256, or a reject reason) and decode them.

:func:`inspect_image` is what the Beam job runs on every image before it stores the bytes as
given (never re-encoded); :func:`decode_rgb` is what an image-processing policy starts from.

Inspection, in this order (the first failing check is the reason, see
:mod:`loader.vision.reasons`)::

    no bytes / 0 bytes                       -> image_missing
    more than limits.max_bytes               -> image_too_large       (before any parsing)
    magic bytes not JPEG / PNG / WebP        -> image_unsupported_format if Pillow knows the
                                                format, else image_undecodable
    PNG without IEND / WebP shorter than its RIFF size -> image_truncated
    header: width x height > max_pixels      -> image_too_large       (before decoding)
    header: max(w,h)/min(w,h) > max ratio    -> image_extreme_aspect_ratio
    full decode (Pillow, the sniffed plugin only):
        data runs out                        -> image_truncated
        any other decoder error              -> image_undecodable

Decompression bombs: the pixel count is checked from the header, before any pixel is
decoded, and only the plugin of the sniffed format is ever asked to parse the bytes. Pillow's
own bomb guard (``Image.MAX_IMAGE_PIXELS``, a process-wide setting) is not relied on; if it
fires first it is reported as ``image_too_large`` too. The default ``max_pixels`` (8192² =
67,108,864) is below Pillow's default warning threshold, so Pillow's guard does not fire for
images this module accepts.

Deterministic decode (:func:`decode_rgb`): the first frame (animated PNG/WebP), no EXIF
orientation applied (width and height are the stored ones, as ``transformers``' processors
see them), no JPEG draft mode, converted to 8-bit RGB the way ``transformers``'
``convert_to_rgb`` does: an image with an alpha band or a transparency entry is converted to
RGBA and composited onto opaque white, everything else is ``Image.convert("RGB")``. The same
bytes give the same pixels on every run and machine with the same Pillow build (Pillow's
wheels bundle libjpeg-turbo, libpng/zlib and libwebp; a different build of those libraries
may round JPEG's inverse DCT differently).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Optional

from PIL import Image, UnidentifiedImageError

from loader.vision.reasons import ImageRejected

SUPPORTED_FORMATS = ("JPEG", "PNG", "WEBP")  # Pillow's format names, as recorded in the lane
DEFAULT_MAX_BYTES = 32 << 20  # 32 MiB of encoded bytes
DEFAULT_MAX_PIXELS = 8192 * 8192
DEFAULT_MAX_ASPECT_RATIO = 200.0  # Qwen2-VL's smart_resize refuses anything longer
DEFAULT_MAX_IMAGES_PER_DOCUMENT = 256

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the 12 bytes of PNG's empty, final IEND chunk


@dataclass(frozen=True)
class ImageLimits:
    """What an image may be; every field is documented in docs/guides/images.md (limits)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO
    max_images_per_document: int = DEFAULT_MAX_IMAGES_PER_DOCUMENT

    def __post_init__(self) -> None:
        problems = [f"{name} must be a positive number (got {value!r})"
                    for name, value in asdict(self).items()
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0]
        if not problems and self.max_aspect_ratio < 1:
            problems.append(f"max_aspect_ratio must be >= 1 (got {self.max_aspect_ratio})")
        if problems:
            raise ValueError("image limits: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_LIMITS = ImageLimits()


@dataclass(frozen=True)
class ImageInfo:
    """An accepted image: what the lane stores beside its bytes."""

    format: str  # one of SUPPORTED_FORMATS
    width: int
    height: int
    sha256: str  # hex digest of the encoded bytes as given
    nbytes: int


def sniff_format(data: bytes) -> Optional[str]:
    """The supported format the magic bytes announce, or None."""
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:8] == _PNG_MAGIC:
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _structurally_truncated(data: bytes, image_format: str) -> Optional[str]:
    """Why the container is cut short when Pillow might not notice, or None."""
    if image_format == "PNG" and _PNG_IEND not in data:  # bytes after IEND are allowed
        return "the PNG has no IEND chunk (the file ends early)"
    if image_format == "WEBP":
        declared = int.from_bytes(data[4:8], "little") + 8
        if len(data) < declared:
            return f"the WebP RIFF header declares {declared} bytes but only {len(data)} are present"
    return None


def _other_format(data: bytes) -> Optional[str]:
    """The format Pillow identifies for bytes that are not a supported format (header only)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                return image.format
    except Exception:  # anything Pillow cannot identify is undecodable, whatever the plugin raised
        return None


def _open(data: bytes, image_format: str) -> Image.Image:
    """Open with the sniffed plugin only; header errors become rejections."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=[image_format])
    except Image.DecompressionBombError as exc:
        raise ImageRejected("image_too_large", f"Pillow's decompression-bomb guard refused it ({exc})") from exc
    except UnidentifiedImageError as exc:
        raise ImageRejected("image_undecodable", f"{image_format} magic bytes but no readable {image_format} "
                            "header") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise _decode_failure(exc, image_format) from exc


def _decode_failure(exc: BaseException, image_format: str) -> ImageRejected:
    message = str(exc)
    if "truncated" in message.lower() or isinstance(exc, EOFError):
        return ImageRejected("image_truncated", f"the {image_format} data ends early ({message})")
    return ImageRejected("image_undecodable", f"{image_format} data Pillow cannot decode "
                         f"({type(exc).__name__}: {message})")


def _check_size(width: int, height: int, limits: ImageLimits) -> None:
    if width <= 0 or height <= 0:
        raise ImageRejected("image_undecodable", f"the header gives a {width}x{height} image")
    if width * height > limits.max_pixels:
        raise ImageRejected("image_too_large", f"{width}x{height} = {width * height} pixels, above the limit "
                            f"of {limits.max_pixels} (max_pixels)")
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise ImageRejected("image_extreme_aspect_ratio", f"{width}x{height} has aspect ratio {ratio:.1f}, above "
                            f"the limit of {limits.max_aspect_ratio:g} (max_aspect_ratio)")


def _decoded(data: Optional[bytes], limits: ImageLimits) -> tuple[Image.Image, str]:
    """The fully decoded (loaded) image and its format, or :class:`ImageRejected`."""
    if data is None or len(data) == 0:
        raise ImageRejected("image_missing", "no image bytes" if data is None else "the image holds 0 bytes")
    if len(data) > limits.max_bytes:
        raise ImageRejected("image_too_large", f"{len(data)} encoded bytes, above the limit of {limits.max_bytes} "
                            "(max_bytes)")
    image_format = sniff_format(data)
    if image_format is None:
        other = _other_format(data)
        if other is not None:
            raise ImageRejected("image_unsupported_format", f"a {other} image; supported formats are "
                                f"{', '.join(SUPPORTED_FORMATS)}")
        # The bytes are never quoted: a path may have named any file (../../etc/passwd).
        raise ImageRejected("image_undecodable", f"not an image Pillow can identify ({len(data)} bytes, no JPEG, "
                            "PNG or WebP signature)")
    cut = _structurally_truncated(data, image_format)
    if cut is not None:
        raise ImageRejected("image_truncated", cut)
    image = _open(data, image_format)
    _check_size(image.width, image.height, limits)
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise ImageRejected("image_too_large", f"Pillow's decompression-bomb guard refused it ({exc})") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise _decode_failure(exc, image_format) from exc
    return image, image_format


def inspect_image(data: Optional[bytes], limits: ImageLimits = DEFAULT_LIMITS) -> ImageInfo:
    """Format, size and SHA-256 of encoded image bytes, decoded in full to prove they decode.

    Raises :class:`loader.vision.reasons.ImageRejected` with the reason (module docstring).
    """
    image, image_format = _decoded(data, limits)
    width, height = image.size
    image.close()
    return ImageInfo(format=image_format, width=width, height=height, sha256=hashlib.sha256(data).hexdigest(),
                     nbytes=len(data))


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB as ``transformers``' ``convert_to_rgb``: transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_rgb(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """The image's first frame as an 8-bit RGB Pillow image (module docstring: deterministic decode).

    Runs the same checks as :func:`inspect_image`, so bytes the lane holds always decode.
    """
    image, _image_format = _decoded(data, limits)
    rgb = to_rgb(image)
    if rgb is not image:
        image.close()
    return rgb
