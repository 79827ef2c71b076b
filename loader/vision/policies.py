"""Image-processing policies: how many visual tokens an image costs and the pixels a model gets.

A policy is a frozen dataclass built from config (:func:`policy_from_dict`, or the
``--image-policy`` option of ``zephon shard`` through :func:`parse_policy_spec`). Every
policy answers, exactly and from the image size alone:

* ``resized_size(width, height) -> (height, width)``: the size the image is resized to;
* ``grid_thw(width, height) -> (t, h, w)``: the patch grid the vision encoder sees;
* ``visual_tokens(width, height) -> int``: the placeholder tokens the image takes in
  ``input_ids`` (what packing counts);

and from a decoded image (:func:`loader.vision.images.decode_rgb`):

* ``pixel_values(image) -> PixelValues``: float32 pixels in the layout of its model family,
  with the grid; ``process(data)`` is the same from encoded bytes;
* ``batch([PixelValues, ...]) -> (pixel_values, image_grid_thw)``: several images as one
  forward pass takes them (``fixed``: ``[n, 3, S, S]``; ``dynamic``: the patch rows
  concatenated, as ``Qwen2VLImageProcessor`` returns a list of images), grids ``[n, 3]`` int64.

Two policies:

``fixed`` (LLaVA / SigLIP family)
    ``mode="resize"`` squashes the image to ``S x S`` (SigLIP); ``mode="pad"`` first pads it
    to a centred square of its longer side filled with ``pad_fill`` (default
    ``int(255 * mean)`` per channel, LLaVA-1.5's ``expand2square``) and then resizes to
    ``S x S``. ``visual_tokens = (S // patch_size) ** 2`` whatever the image (a remainder
    ``S mod patch_size`` is dropped by the patch embedding, e.g. SigLIP-so400m at 384 / 14 =
    27 x 27 = 729), ``grid_thw = (1, S // p, S // p)``, ``pixel_values`` is ``[3, S, S]``.
    Defaults are LLaVA-1.5's: ``S = 336``, ``patch_size = 14`` (576 tokens), ``pad``, CLIP
    mean/std.

``dynamic`` (Qwen2-VL family)
    ``smart_resize`` as ``transformers`` implements it: round height and width to multiples
    of ``factor = patch_size * merge_size`` keeping the aspect ratio; if that is above
    ``max_pixels`` scale down by ``beta = sqrt(h * w / max_pixels)`` and floor to the factor
    (at least one factor), if below ``min_pixels`` scale up by
    ``beta = sqrt(min_pixels / (h * w))`` and ceil to the factor. ``grid_thw = (1, H / p,
    W / p)``, ``visual_tokens = (H / p) * (W / p) / merge_size ** 2`` and ``pixel_values`` are
    the flattened patches ``[(H / p) * (W / p), 3 * temporal_patch_size * p * p]``: rows in
    ``(H/p/m, W/p/m, m, m)`` order (the merge blocks contiguous), columns in ``(channel,
    temporal, patch row, patch column)`` order, the still image repeated
    ``temporal_patch_size`` times, exactly the layout of ``Qwen2VLImageProcessor``. Defaults
    are Qwen2-VL's: ``patch_size = 14``, ``merge_size = 2``, ``temporal_patch_size = 2``,
    ``min_pixels = 56 * 56``, ``max_pixels = 28 * 28 * 1280``, CLIP mean/std.

Pixel arithmetic (both policies, the same as ``transformers``' PIL backend, so the values
match it to float32 rounding): resize the 8-bit RGB image with Pillow and the pinned
``resample`` filter (``bicubic`` by default, named in the policy and its fingerprint), then
``float32(uint8 * (1 / 255))`` computed in float64, then ``(x - mean) / std`` in float32.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Mapping, Union

import numpy as np

from loader.errors import ImagePolicyError
from loader.vision.reasons import ImageRejected

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESCALE_FACTOR = 1 / 255
RESAMPLE_FILTERS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")
DEFAULT_RESAMPLE = "bicubic"
FIXED_MODES = ("resize", "pad")
QWEN2_VL_MAX_ASPECT_RATIO = 200  # smart_resize refuses a longer side over 200 x the shorter


@dataclass(frozen=True)
class PixelValues:
    """One image's pixels in its policy's layout, and the patch grid ``(t, h, w)``."""

    values: np.ndarray  # float32; [3, S, S] (fixed) or [h * w, 3 * t_patch * p * p] (dynamic)
    grid_thw: tuple[int, int, int]


def _resample(name: str) -> int:
    from PIL import Image

    return getattr(Image.Resampling, name.upper())


def _normalized(image, size_hw: tuple[int, int], resample: str, mean, std) -> np.ndarray:
    """``[3, H, W]`` float32: resized with Pillow, rescaled in float64, normalised in float32."""
    height, width = size_hw
    if image.mode != "RGB":
        raise ValueError(f"pixel_values needs an RGB image (got mode {image.mode!r}); decode it with "
                         "loader.vision.images.decode_rgb")
    resized = np.asarray(image.resize((width, height), resample=_resample(resample)))
    # The value of a pixel depends only on its uint8 value and channel, so the arithmetic runs once
    # per (channel, value) and the image is a gather: the same float32 results, elementwise.
    lut = _normalization_table(tuple(mean), tuple(std))
    return np.stack([np.take(lut[:, channel], resized[:, :, channel]) for channel in range(3)])


def _normalization_table(mean: tuple, std: tuple) -> np.ndarray:
    """``[256, 3]`` float32: ``(float32(v * (1/255) in float64) - mean) / std`` in float32, per channel."""
    scaled = (np.arange(256, dtype=np.float64) * RESCALE_FACTOR).astype(np.float32)[:, None]
    return (scaled - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)


def _check_size(width: int, height: int) -> None:
    if isinstance(width, bool) or isinstance(height, bool) or not (
            isinstance(width, (int, np.integer)) and isinstance(height, (int, np.integer))):
        raise TypeError(f"width and height must be ints (got {width!r}, {height!r})")
    if width < 1 or height < 1:
        raise ValueError(f"an image is at least 1x1 (got {width}x{height})")


def _channel_triple(value: Any, name: str, problems: list[str], *, low: float, high: float,
                    strictly_above: bool = False) -> None:
    ok = (isinstance(value, tuple) and len(value) == 3
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))
    if ok:
        ok = all((v > low if strictly_above else v >= low) and v <= high for v in value)
    if not ok:
        bound = f"({low}, {high}]" if strictly_above else f"[{low}, {high}]"
        problems.append(f"{name} must be three numbers in {bound}, one per RGB channel (got {value!r})")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class _PolicyBase:
    kind: ClassVar[str]

    def _common_problems(self) -> list[str]:
        problems = []
        if self.resample not in RESAMPLE_FILTERS:
            problems.append(f"resample must be one of {', '.join(RESAMPLE_FILTERS)} (got {self.resample!r})")
        _channel_triple(self.image_mean, "image_mean", problems, low=0.0, high=1.0)
        _channel_triple(self.image_std, "image_std", problems, low=0.0, high=float("inf"), strictly_above=True)
        return problems

    def to_dict(self) -> dict[str, Any]:
        """The policy as JSON-able config (``kind`` first), what the manifest records."""
        return {"kind": self.kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}}

    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of :meth:`to_dict`: equal exactly when the outputs are."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()

    def process(self, data: bytes, limits=None) -> PixelValues:
        """``pixel_values`` of encoded bytes, decoded by :func:`loader.vision.images.decode_rgb`
        (which raises :class:`ImageRejected` for bytes the job would have rejected)."""
        from loader.vision.images import DEFAULT_LIMITS, decode_rgb  # Pillow: only where pixels are decoded

        return self.pixel_values(decode_rgb(data, limits or DEFAULT_LIMITS))

    def compact(self, image) -> PixelValues:
        """The pixels without what the batch layout repeats, as workers ship them (loader.vision.transfer):
        ``fixed`` is :meth:`pixel_values`; ``dynamic`` keeps one temporal copy. :meth:`batch_compact`
        lays several out exactly as :meth:`batch` of their :meth:`pixel_values`."""
        return self.pixel_values(image)

    def process_compact(self, data: bytes, limits=None) -> PixelValues:
        """:meth:`compact` of encoded bytes (decoded as :meth:`process` does)."""
        from loader.vision.images import DEFAULT_LIMITS, decode_rgb  # Pillow: only where pixels are decoded

        return self.compact(decode_rgb(data, limits or DEFAULT_LIMITS))

    def batch_compact(self, images: list[PixelValues]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`batch` of the images whose :meth:`compact` forms these are (one copy)."""
        return self.batch(images)

    def batch_fields(self, sequences) -> dict[str, np.ndarray]:
        """The image fields of a micro-batch of packed sequences (``loader.stages.collate``),
        images in row order then token order: ``pixel_values`` (:meth:`batch` of the images:
        ``[n, 3, S, S]`` fixed, ``[sum of h * w, D]`` dynamic), ``image_grid_thw`` ``[n, 3]``,
        ``image_sequence_index`` ``[n]`` (the row of each image) and ``image_token_offsets``
        ``[n]`` (the position of its first placeholder token in that row). The pixels are
        copied here (a worker's slot is given back after collation)."""
        images, rows, offsets = [], [], []
        for row, sequence in enumerate(sequences):
            found = sequence.images
            if found is None or not len(found):
                continue
            images += [PixelValues(values, tuple(grid)) for values, grid in zip(found.pixels, found.grids.tolist())]
            rows += [row] * len(found)
            offsets.append(found.positions)
        pixel_values, grids = self.batch_compact(images)  # the one copy (dynamic: every temporal copy)
        return {
            "pixel_values": pixel_values,
            "image_grid_thw": grids,
            "image_sequence_index": np.array(rows, dtype=np.int64),
            "image_token_offsets": np.concatenate(offsets).astype(np.int64) if offsets else np.zeros(0, np.int64),
        }

    def batch(self, images: list[PixelValues]) -> tuple[np.ndarray, np.ndarray]:
        """``(pixel_values, image_grid_thw)`` of several images as their model family takes them
        in one forward pass: ``fixed`` stacks to ``[n, 3, S, S]``; ``dynamic`` concatenates the
        patch rows to ``[sum of h * w, 3 * t * p * p]`` (what ``Qwen2VLImageProcessor`` returns for
        a list of images). ``image_grid_thw`` is ``[n, 3]`` int64 either way."""
        grid = np.array([image.grid_thw for image in images], dtype=np.int64).reshape(len(images), 3)
        if not images:
            return np.zeros((0, *self._item_shape), dtype=np.float32), grid
        return self._joined([image.values for image in images]), grid


@dataclass(frozen=True)
class FixedResolutionPolicy(_PolicyBase):
    """Every image to ``image_size x image_size`` (LLaVA / SigLIP family); module docstring."""

    kind: ClassVar[str] = "fixed"
    image_size: int = 336
    patch_size: int = 14
    mode: str = "pad"
    resample: str = DEFAULT_RESAMPLE
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    pad_fill: Union[tuple[int, int, int], None] = None  # None: int(255 * mean) per channel (LLaVA-1.5)

    def __post_init__(self) -> None:
        problems = self._common_problems()
        for name in ("image_size", "patch_size"):
            if not _positive_int(getattr(self, name)):
                problems.append(f"{name} must be a positive int (got {getattr(self, name)!r})")
        if not problems and self.patch_size > self.image_size:
            problems.append(f"patch_size {self.patch_size} is larger than image_size {self.image_size}: no patch fits")
        if self.mode not in FIXED_MODES:
            problems.append(f"mode must be one of {', '.join(FIXED_MODES)} (got {self.mode!r})")
        if self.pad_fill is not None:
            valid = (isinstance(self.pad_fill, tuple) and len(self.pad_fill) == 3 and all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in self.pad_fill))
            if not valid:
                problems.append(f"pad_fill must be null or three ints in [0, 255] (got {self.pad_fill!r})")
        if problems:
            raise ImagePolicyError("image policy 'fixed': " + "; ".join(problems))

    @property
    def _item_shape(self) -> tuple[int, ...]:
        return 3, self.image_size, self.image_size

    @staticmethod
    def _joined(values: list[np.ndarray]) -> np.ndarray:
        return np.stack(values)

    @property
    def fill(self) -> tuple[int, int, int]:
        """The padding colour of ``mode="pad"``."""
        if self.pad_fill is not None:
            return self.pad_fill
        return tuple(int(channel * 255) for channel in self.image_mean)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        _check_size(width, height)
        return self.image_size, self.image_size

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        _check_size(width, height)
        side = self.image_size // self.patch_size
        return 1, side, side

    def visual_tokens(self, width: int, height: int) -> int:
        _, grid_h, grid_w = self.grid_thw(width, height)
        return grid_h * grid_w

    def pixel_values(self, image) -> PixelValues:
        """``[3, S, S]`` float32 of an RGB Pillow image."""
        from PIL import Image

        if self.mode == "pad" and image.width != image.height:
            side = max(image.width, image.height)
            square = Image.new("RGB", (side, side), self.fill)
            square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
            image = square
        pixels = _normalized(image, self.resized_size(image.width, image.height), self.resample,
                             self.image_mean, self.image_std)
        return PixelValues(pixels, self.grid_thw(image.width, image.height))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(height, width)`` of Qwen2-VL's resize, line for line ``transformers``' ``smart_resize``.

    Raises :class:`ImageRejected` (``image_extreme_aspect_ratio``) where ``transformers``
    raises ``ValueError``: an aspect ratio above 200.
    """
    if max(height, width) / min(height, width) > QWEN2_VL_MAX_ASPECT_RATIO:
        raise ImageRejected("image_extreme_aspect_ratio",
                            f"{width}x{height}: the dynamic policy (Qwen2-VL smart_resize) needs an aspect ratio "
                            f"of at most {QWEN2_VL_MAX_ASPECT_RATIO}")
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


@dataclass(frozen=True)
class DynamicResolutionPolicy(_PolicyBase):
    """Aspect-preserving resize to multiples of ``patch_size * merge_size`` (Qwen2-VL family)."""

    kind: ClassVar[str] = "dynamic"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    resample: str = DEFAULT_RESAMPLE
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        problems = self._common_problems()
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            if not _positive_int(getattr(self, name)):
                problems.append(f"{name} must be a positive int (got {getattr(self, name)!r})")
        if not problems and self.min_pixels > self.max_pixels:
            problems.append(f"min_pixels {self.min_pixels} is above max_pixels {self.max_pixels}")
        if not problems and self.max_pixels < self.factor ** 2:
            problems.append(f"max_pixels {self.max_pixels} is below one merge block "
                            f"({self.factor}x{self.factor} = {self.factor ** 2} pixels)")
        if problems:
            raise ImagePolicyError("image policy 'dynamic': " + "; ".join(problems))

    @property
    def _item_shape(self) -> tuple[int, ...]:
        return (3 * self.temporal_patch_size * self.patch_size ** 2,)

    @staticmethod
    def _joined(values: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(values)

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers ``factor x factor`` pixels."""
        return self.patch_size * self.merge_size

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        _check_size(width, height)
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        resized_h, resized_w = self.resized_size(width, height)
        return 1, resized_h // self.patch_size, resized_w // self.patch_size

    def visual_tokens(self, width: int, height: int) -> int:
        _, grid_h, grid_w = self.grid_thw(width, height)
        return grid_h * grid_w // (self.merge_size ** 2)

    def pixel_values(self, image) -> PixelValues:
        """Flattened patches ``[grid_h * grid_w, 3 * temporal_patch_size * p * p]`` float32 and the grid."""
        compact = self.compact(image)
        rows = len(compact.values)
        return PixelValues(self._repeated([compact], rows).reshape(rows, *self._item_shape), compact.grid_thw)

    def compact(self, image) -> PixelValues:
        """The patches with one temporal copy, ``[grid_h * grid_w, 3 * p * p]`` (columns: channel,
        patch row, patch column); :meth:`pixel_values` repeats each channel's patch
        ``temporal_patch_size`` times, as Qwen2-VL does for a still image."""
        size_hw = self.resized_size(image.width, image.height)
        pixels = _normalized(image, size_hw, self.resample, self.image_mean, self.image_std)  # [C, H, W]
        p, m = self.patch_size, self.merge_size
        grid_h, grid_w = size_hw[0] // p, size_hw[1] // p
        blocks = pixels.reshape(3, grid_h // m, m, p, grid_w // m, m, p)
        # (C, H/p/m, m, p, W/p/m, m, p) -> (H/p/m, W/p/m, m, m, C, p, p)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
        return PixelValues(np.ascontiguousarray(blocks).reshape(grid_h * grid_w, 3 * p * p), (1, grid_h, grid_w))

    def batch_compact(self, images: list[PixelValues]) -> tuple[np.ndarray, np.ndarray]:
        grid = np.array([image.grid_thw for image in images], dtype=np.int64).reshape(len(images), 3)
        rows = sum(len(image.values) for image in images)
        return self._repeated(images, rows).reshape(rows, *self._item_shape), grid

    def _repeated(self, images: list[PixelValues], rows: int) -> np.ndarray:
        """``[rows, 3, t, p * p]``: compact images' patches (``rows`` in all) with every temporal
        copy, written once into one new array."""
        p, t = self.patch_size, self.temporal_patch_size
        out = np.empty((rows, 3, t, p * p), dtype=np.float32)
        at = 0
        for image in images:
            n = len(image.values)
            out[at : at + n] = image.values.reshape(n, 3, 1, p * p)
            at += n
        return out


ImagePolicy = Union[FixedResolutionPolicy, DynamicResolutionPolicy]
POLICIES: dict[str, type] = {FixedResolutionPolicy.kind: FixedResolutionPolicy,
                             DynamicResolutionPolicy.kind: DynamicResolutionPolicy}
_TUPLE_FIELDS = ("image_mean", "image_std", "pad_fill")


def policy_from_dict(data: Any, where: str = "image_policy") -> ImagePolicy:
    """The policy of a config mapping ``{"kind": "fixed" | "dynamic", <field>: value, ...}``.

    Missing fields take the family defaults; unknown fields and bad values are reported
    together in one :class:`ImagePolicyError` naming ``where``.
    """
    if not isinstance(data, Mapping):
        raise ImagePolicyError(f"{where} must be an object with a 'kind' (got {type(data).__name__})")
    kind = data.get("kind")
    if kind not in POLICIES:
        raise ImagePolicyError(f"{where}.kind must be one of {', '.join(POLICIES)} (got {kind!r})")
    cls = POLICIES[kind]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known - {"kind"})
    if unknown:
        raise ImagePolicyError(f"{where}: unknown field(s) {', '.join(unknown)} for kind {kind!r} "
                               f"(known: {', '.join(sorted(known))})")
    values = {name: tuple(value) if name in _TUPLE_FIELDS and isinstance(value, list) else value
              for name, value in data.items() if name != "kind"}
    try:
        return cls(**values)
    except ImagePolicyError as exc:
        raise ImagePolicyError(f"{where}: {exc}") from exc


def parse_policy_spec(spec: str, where: str = "--image-policy") -> ImagePolicy:
    """``"fixed"`` / ``"dynamic"`` (family defaults) or a JSON object such as
    ``'{"kind": "dynamic", "max_pixels": 602112}'``."""
    text = spec.strip()
    if not text.startswith("{"):
        return policy_from_dict({"kind": text}, where)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ImagePolicyError(f"{where} {spec!r} is not valid JSON ({exc}); give a kind "
                               f"({', '.join(POLICIES)}) or a JSON object with a 'kind'") from exc
    return policy_from_dict(data, where)
