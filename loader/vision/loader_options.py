"""The loader's :class:`~loader.vision.block.ImageOptions`: the config's ``images`` table checked
against the image datasets' manifests and the tokenizer.

Apart from :mod:`loader.vision.options` (the table itself), so that reading a config does not
import the block decoders (pyarrow) this needs.
"""

from __future__ import annotations

from typing import Optional

from loader.errors import ConfigError
from loader.stages.tokenizer import resolve_special_token
from loader.vision.block import ImageOptions
from loader.vision.options import ImagesConfig
from loader.vision.policies import policy_from_dict

FAMILY_TOKENS = {  # (start, image, end) per policy kind; None: no such token
    "dynamic": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "fixed": (None, "<image>", None),
}


def resolve_image_options(config, manifests, source_names, tokenizer) -> Optional["ImageOptions"]:
    """The loader's :class:`ImageOptions`, or None when no source holds images.

    Refuses, naming the fix: concat packing and token-unit mixing with image sources (a cut
    would split an image), transforms on them, a policy that disagrees with the counts an
    image dataset recorded, and placeholder tokens missing from the tokenizer.
    """
    image_sources = [(name, m) for name, m in zip(source_names, manifests) if getattr(m, "images", None) is not None]
    if not image_sources:
        return None
    names = [name for name, _ in image_sources]
    if config.packing != "best_fit":
        raise ConfigError(f"sources {names} hold images: packing must be \"best_fit\" (got {config.packing!r}); "
                          "concat packing cuts documents anywhere, and a cut inside an image's placeholder tokens "
                          "would split the image across two sequences")
    if config.mixing_unit == "token":  # refused with one source too: the docs promise it, whatever the count
        raise ConfigError(f"sources {names} hold images: mixing_unit = \"token\" is not supported with image "
                          "sources (it would cut documents inside an image's placeholders); use mixing_unit = "
                          "\"sequence\"")
    for k, name in enumerate(source_names):
        if name in names and config.source_transforms(k):
            raise ConfigError(f"datasets[{k}] ({name!r}): transforms do not apply to image sources yet; filter "
                              "them in the Beam job (zephon shard --transform)")
    images = config.images or ImagesConfig()
    policy_config = images.policy
    if policy_config is None:
        recorded = {name: m.images.policy for name, m in image_sources}
        if any(policy is None for policy in recorded.values()) or len({repr(p) for p in recorded.values()}) != 1:
            raise ConfigError(f"images.policy is not set and the image sources do not all record one policy "
                              f"({recorded}); set images.policy = \"dynamic\" or \"fixed\" (or a table)")
        policy_config = next(iter(recorded.values()))
    policy = policy_from_dict(policy_config, "images.policy")
    for name, manifest in image_sources:
        if manifest.images.policy is not None:
            mismatch = manifest.images.policy_mismatch(policy)
            if mismatch:
                raise ConfigError(f"images.policy: dataset {name!r}: {mismatch}; use the dataset's policy or "
                                  "re-shard it with --image-policy set to this one")
    start, image, end = FAMILY_TOKENS[policy.kind]
    tokens = {"image_start_token": images.image_start_token if images.image_start_token is not None else start,
              "image_token": images.image_token if images.image_token is not None else image,
              "image_end_token": images.image_end_token if images.image_end_token is not None else end}
    ids = {option: None if not text else resolve_special_token(tokenizer, text, (), f"images.{option}")
           for option, text in tokens.items()}
    return ImageOptions(policy_config=policy.to_dict(), image_id=ids["image_token"], start_id=ids["image_start_token"],
                        end_id=ids["image_end_token"], overflow=images.overflow,
                        max_images_per_sequence=images.max_images_per_sequence, seq_len=config.seq_len,
                        packing=config.packing)
