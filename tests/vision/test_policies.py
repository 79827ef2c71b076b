"""loader.vision.policies against transformers' image processors (built from parameters, no download)."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest

from image_factory import drawn_image, image_bytes
from loader.vision.images import decode_rgb
from loader.vision.policies import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    DynamicResolutionPolicy,
    FixedResolutionPolicy,
    ImagePolicyError,
    parse_policy_spec,
    policy_from_dict,
)
from loader.vision.reasons import ImageRejected

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    # transformers 5.24: the torchvision-backed Qwen2VLImageProcessor falls back to this PIL
    # backend when torchvision is absent (as here); import it directly.
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

DYNAMIC_CONFIGS = [
    dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280),
    dict(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=128 * 28 * 28, max_pixels=256 * 28 * 28),
    dict(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=64 * 32 * 32),
    dict(patch_size=8, merge_size=1, temporal_patch_size=1, min_pixels=64, max_pixels=40000),
]
# Many sizes and aspect ratios: tiny, square, wide, tall, near the 200:1 limit, huge.
SIDES = [1, 2, 7, 13, 27, 28, 29, 55, 56, 57, 100, 223, 224, 225, 333, 480, 511, 640, 999, 1080, 1920, 4000]
SIZES = [(w, h) for w, h in itertools.product(SIDES, SIDES) if max(w, h) / min(w, h) <= 200]


def hf_qwen(config: dict) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(**config)


@pytest.mark.parametrize("config", DYNAMIC_CONFIGS, ids=lambda c: f"p{c['patch_size']}m{c['merge_size']}")
def test_dynamic_visual_tokens_equal_qwen2_vl_processor(config):
    policy = DynamicResolutionPolicy(**config)
    processor = hf_qwen(config)
    assert len(SIZES) > 300
    for width, height in SIZES:
        patches = processor.get_number_of_image_patches(height, width)
        assert policy.visual_tokens(width, height) * config["merge_size"] ** 2 == patches, (width, height)
        t, grid_h, grid_w = policy.grid_thw(width, height)
        resized_h, resized_w = policy.resized_size(width, height)
        assert (t, grid_h * config["patch_size"], grid_w * config["patch_size"]) == (1, resized_h, resized_w)
        assert resized_h % policy.factor == 0 and resized_w % policy.factor == 0
        if min(resized_h, resized_w) > policy.factor:  # a side clamped to one factor may overshoot
            assert resized_h * resized_w <= config["max_pixels"], (width, height)


@pytest.mark.parametrize("config", DYNAMIC_CONFIGS[1:], ids=lambda c: f"p{c['patch_size']}m{c['merge_size']}")
@pytest.mark.parametrize("size, image_format", [((1, 1), "PNG"), ((37, 200), "JPEG"), ((300, 170), "WEBP"),
                                                 ((640, 480), "JPEG"), ((96, 1000), "PNG"), ((1200, 33), "WEBP")])
def test_dynamic_pixel_values_equal_qwen2_vl_processor(config, size, image_format):
    image = decode_rgb(image_bytes(*size, image_format=image_format, seed=sum(size)))
    ours = DynamicResolutionPolicy(**config).pixel_values(image)
    theirs = hf_qwen(config)(images=[image], return_tensors="np")
    assert ours.values.dtype == np.float32 and ours.values.flags.c_contiguous
    assert ours.values.shape == theirs["pixel_values"].shape
    assert list(ours.grid_thw) == theirs["image_grid_thw"][0].tolist()
    np.testing.assert_allclose(ours.values, theirs["pixel_values"], rtol=0, atol=1e-6)


def test_batches_equal_the_processors_multi_image_output():
    images = [decode_rgb(image_bytes(*size, image_format="PNG", seed=i))
              for i, size in enumerate([(300, 170), (40, 900), (64, 64)])]
    config = DYNAMIC_CONFIGS[1]
    dynamic = DynamicResolutionPolicy(**config)
    values, grid = dynamic.batch([dynamic.pixel_values(image) for image in images])
    theirs = hf_qwen(config)(images=images, return_tensors="np")
    np.testing.assert_allclose(values, theirs["pixel_values"], rtol=0, atol=1e-6)
    assert grid.tolist() == theirs["image_grid_thw"].tolist() and grid.dtype == np.int64
    fixed = FixedResolutionPolicy()
    values, grid = fixed.batch([fixed.process(image_bytes(50, 80, "JPEG", seed=i)) for i in range(2)])
    assert values.shape == (2, 3, 336, 336) and grid.tolist() == [[1, 24, 24]] * 2
    assert dynamic.batch([])[0].shape == (0, 3 * 2 * 14 * 14) and fixed.batch([])[0].shape == (0, 3, 336, 336)


def test_dynamic_patch_layout_by_hand():
    """Rows are merge blocks of patches in (block row, block col, row in block, col in block)
    order; a row holds channel-major, then temporal copies, then the patch's pixels."""
    policy = DynamicResolutionPolicy(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16,
                                     max_pixels=64, image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0),
                                     resample="nearest")
    pixels = np.arange(4 * 8 * 3, dtype=np.uint8).reshape(4, 8, 3)
    from PIL import Image

    out = policy.pixel_values(Image.fromarray(pixels))  # 8 x 4 stays 8 x 4: grid 2 x 4
    assert out.grid_thw == (1, 2, 4) and out.values.shape == (8, 3 * 2 * 2 * 2)
    scaled = (pixels.astype(np.float64) / 255).astype(np.float32)
    for row, (block_col, inner_row, inner_col) in enumerate(itertools.product(range(2), range(2), range(2))):
        top, left = inner_row * 2, (block_col * 2 + inner_col) * 2
        patch = scaled[top:top + 2, left:left + 2, :].transpose(2, 0, 1)  # [C, p, p]
        expected = np.stack([patch, patch], axis=1).reshape(-1)  # [C, T, p, p]
        np.testing.assert_array_equal(out.values[row], expected)


def test_dynamic_extreme_aspect_ratio_is_an_image_reject():
    policy = DynamicResolutionPolicy()
    with pytest.raises(ImageRejected) as caught:
        policy.visual_tokens(201, 1)
    assert caught.value.reason == "image_extreme_aspect_ratio"


FIXED_SIZES = [(1, 1), (336, 336), (640, 480), (50, 700), (1000, 33), (17, 18)]


@pytest.mark.parametrize("size", FIXED_SIZES)
@pytest.mark.parametrize("image_format", ["PNG", "JPEG"])
def test_fixed_pad_equals_llava_processor(size, image_format):
    image = decode_rgb(image_bytes(*size, image_format=image_format, seed=size[0]))
    policy = FixedResolutionPolicy()  # LLaVA-1.5: 336, patch 14, pad, CLIP mean/std, bicubic
    processor = LlavaImageProcessorPil(do_pad=True, size={"shortest_edge": 336},
                                       crop_size={"height": 336, "width": 336})
    theirs = processor(images=[image], return_tensors="np")["pixel_values"][0]
    ours = policy.pixel_values(image)
    assert ours.values.shape == (3, 336, 336) and ours.grid_thw == (1, 24, 24)
    assert policy.visual_tokens(*size) == 576
    np.testing.assert_allclose(ours.values, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", FIXED_SIZES)
def test_fixed_resize_equals_siglip_processor(size):
    image = decode_rgb(image_bytes(*size, image_format="WEBP", seed=size[1]))
    policy = FixedResolutionPolicy(image_size=384, patch_size=14, mode="resize", image_mean=(0.5, 0.5, 0.5),
                                   image_std=(0.5, 0.5, 0.5))
    theirs = SiglipImageProcessorPil(size={"height": 384, "width": 384})(images=[image], return_tensors="np")
    np.testing.assert_allclose(policy.pixel_values(image).values, theirs["pixel_values"][0], rtol=0, atol=1e-6)
    assert policy.visual_tokens(*size) == 27 * 27  # SigLIP-so400m-patch14-384: 729


def test_fixed_counts_and_pixels_by_independent_computation():
    """Tokens are floor(S / p)^2 for any size; a one-colour image gives (c / 255 - mean) / std
    everywhere, and padding adds int(255 * mean) bands exactly where expand2square puts them."""
    from PIL import Image

    for image_size, patch in [(224, 16), (336, 14), (384, 14), (448, 32), (30, 7)]:
        policy = FixedResolutionPolicy(image_size=image_size, patch_size=patch)
        for width, height in [(1, 1), (3000, 20), (20, 3000), (image_size, image_size)]:
            assert policy.visual_tokens(width, height) == math.floor(image_size / patch) ** 2
    colour = (200, 10, 90)
    resize = FixedResolutionPolicy(image_size=32, patch_size=8, mode="resize")
    values = resize.pixel_values(Image.new("RGB", (70, 20), colour)).values
    expected = (np.array(colour) / 255 - np.array(OPENAI_CLIP_MEAN)) / np.array(OPENAI_CLIP_STD)
    np.testing.assert_allclose(values, np.broadcast_to(expected[:, None, None], (3, 32, 32)), atol=1e-5)
    pad = FixedResolutionPolicy(image_size=64, patch_size=8, mode="pad", resample="nearest")
    values = pad.pixel_values(Image.new("RGB", (64, 32), colour)).values  # bands of 16 rows above and below
    fill = np.array([int(255 * m) for m in OPENAI_CLIP_MEAN])
    band = (fill / 255 - np.array(OPENAI_CLIP_MEAN)) / np.array(OPENAI_CLIP_STD)
    np.testing.assert_allclose(values[:, :16], np.broadcast_to(band[:, None, None], (3, 16, 64)), atol=1e-5)
    np.testing.assert_allclose(values[:, 16:48], np.broadcast_to(expected[:, None, None], (3, 32, 64)), atol=1e-5)
    np.testing.assert_allclose(values[:, 48:], np.broadcast_to(band[:, None, None], (3, 16, 64)), atol=1e-5)


def test_pixel_values_are_deterministic_across_calls():
    image = drawn_image(123, 77, seed=9)
    for policy in (FixedResolutionPolicy(), DynamicResolutionPolicy(max_pixels=200 * 28 * 28)):
        first, second = policy.pixel_values(image), policy.pixel_values(image)
        assert first.values.tobytes() == second.values.tobytes() and first.grid_thw == second.grid_thw


def _float_reference(policy, image) -> np.ndarray:
    """``pixel_values`` computed the way the policies did before workers shipped uint8: resize,
    ``float32(v * (1/255))`` in float64, ``(x - mean) / std`` in float32, then the layout."""
    from PIL import Image

    if isinstance(policy, FixedResolutionPolicy) and policy.mode == "pad" and image.width != image.height:
        side = max(image.width, image.height)
        square = Image.new("RGB", (side, side), policy.fill)
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        image = square
    height, width = policy.resized_size(image.width, image.height)
    resized = np.asarray(image.resize((width, height), resample=Image.Resampling.BICUBIC))
    scaled = (resized.astype(np.float64) * (1 / 255)).astype(np.float32).transpose(2, 0, 1)
    pixels = (scaled - np.asarray(policy.image_mean, np.float32)[:, None, None]) / \
        np.asarray(policy.image_std, np.float32)[:, None, None]
    if isinstance(policy, FixedResolutionPolicy):
        return pixels
    p, m, t = policy.patch_size, policy.merge_size, policy.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    patches = np.repeat(pixels[None], t, axis=0).reshape(t, 3, grid_h // m, m, p, grid_w // m, m, p)
    return patches.transpose(2, 5, 3, 6, 1, 0, 4, 7).reshape(grid_h * grid_w, 3 * t * p * p)


def test_compact_pixels_are_uint8_and_normalise_to_the_float_pixels_bit_for_bit():
    """Workers ship the compact form (uint8, a quarter of float32's bytes); the collator's
    batch_compact must give exactly the float32 pixel_values (and batch) of the same images."""
    images = [drawn_image(123, 77, seed=9), drawn_image(40, 300, seed=2), drawn_image(500, 90, seed=4)]
    for policy in (FixedResolutionPolicy(), FixedResolutionPolicy(image_size=64, patch_size=8, mode="resize"),
                   DynamicResolutionPolicy(max_pixels=200 * 28 * 28)):
        compact = [policy.compact(image) for image in images]
        assert all(c.values.dtype == np.uint8 for c in compact)
        full = [policy.pixel_values(image) for image in images]
        for image, values in zip(images, full):
            assert values.values.dtype == np.float32
            assert values.values.tobytes() == _float_reference(policy, image).tobytes()
        batched, grids = policy.batch_compact(compact)
        expected, expected_grids = policy.batch(full)
        assert batched.dtype == np.float32 and batched.tobytes() == expected.tobytes()
        assert grids.tolist() == expected_grids.tolist()
        assert sum(c.values.nbytes for c in compact) * 4 <= sum(f.values.nbytes for f in full)


def test_policy_config_round_trip_and_errors():
    for policy in (FixedResolutionPolicy(mode="resize", image_size=224, patch_size=16),
                   DynamicResolutionPolicy(max_pixels=602112)):
        assert policy_from_dict(policy.to_dict()) == policy
        assert parse_policy_spec(__import__("json").dumps(policy.to_dict())) == policy
        assert policy.fingerprint() == policy_from_dict(policy.to_dict()).fingerprint()
    assert parse_policy_spec("dynamic") == DynamicResolutionPolicy()
    assert parse_policy_spec("fixed") == FixedResolutionPolicy()
    assert FixedResolutionPolicy().fingerprint() != FixedResolutionPolicy(resample="bilinear").fingerprint()
    with pytest.raises(ImagePolicyError, match=r"kind must be one of fixed, dynamic \(got 'square'\)"):
        parse_policy_spec("square")
    with pytest.raises(ImagePolicyError, match="unknown field.*merge_size"):
        policy_from_dict({"kind": "fixed", "merge_size": 2})
    with pytest.raises(ImagePolicyError, match="min_pixels 100 is above max_pixels 50.*") as caught:
        policy_from_dict({"kind": "dynamic", "min_pixels": 100, "max_pixels": 50})
    assert "image_policy" in str(caught.value)
    with pytest.raises(ImagePolicyError) as caught:
        policy_from_dict({"kind": "fixed", "image_size": 0, "resample": "cubic", "image_std": [0, 1, 1]})
    assert all(word in str(caught.value) for word in ("image_size", "resample", "image_std"))
    with pytest.raises(ImagePolicyError, match="not valid JSON"):
        parse_policy_spec("{kind: dynamic}")
