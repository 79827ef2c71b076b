"""The loader config's ``images`` table, and the :class:`~loader.vision.block.ImageOptions` it resolves to.

Every field is documented in README.md ("Loader configuration", ``images``)::

    images = {policy = "dynamic", overflow = "truncate", max_images_per_sequence = 4}

``policy``: ``"fixed"`` / ``"dynamic"`` (family defaults), a JSON string or a table as
``--image-policy`` takes it; absent: the policy the dataset was sharded with (its manifest's
``images.policy``). Placeholder tokens default per family: dynamic (Qwen2-VL)
``<|vision_start|>`` ``<|image_pad|>`` ``<|vision_end|>``, fixed (LLaVA) ``<image>`` alone;
``image_start_token`` / ``image_end_token`` set to ``""`` mean no such token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional

from loader.validation import Integer, OrAbsent, Problems, Record, Rule, Text

OVERFLOW_MODES = ("reject", "truncate")  # images.overflow (loader.vision.block)
FAMILY_TOKENS = {  # (start, image, end) per policy kind; None: no such token
    "dynamic": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "fixed": (None, "<image>", None),
}


class PolicyRule(Rule):
    """A policy name, a JSON object string or a table (:mod:`loader.vision.policies`), or absent;
    stored as the policy's dict."""

    expected = "\"fixed\", \"dynamic\", a JSON object string or a table with a 'kind'"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        from loader.vision.policies import ImagePolicyError, parse_policy_spec, policy_from_dict

        if value is None:
            return None
        try:
            if isinstance(value, str):
                return parse_policy_spec(value, path).to_dict()
            if isinstance(value, Mapping):
                return policy_from_dict(value, path).to_dict()
        except ImagePolicyError as exc:
            problems.add(str(exc))
            return value
        problems.bad(path, value, self.expected)
        return value


class ImagesTable(Record):
    """The config's ``images`` field: absent, or a table whose every problem is named by its path."""

    def __init__(self) -> None:
        super().__init__(ImagesConfig)

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        return None if value is None else super().check(value, path, problems)


class TokenText(Rule):
    """A token's text, or ``""`` for no token."""

    expected = "a token's text (a string; \"\" for none)"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
        if not isinstance(value, str):
            problems.bad(path, value, self.expected)
        return value


@dataclass(frozen=True)
class ImagesConfig:
    """How image sources become tokens and pixels (README "Loader configuration", ``images``)."""

    policy: Optional[dict] = None
    image_token: Optional[str] = None
    image_start_token: Optional[str] = None
    image_end_token: Optional[str] = None
    overflow: str = "reject"
    max_images_per_sequence: Optional[int] = None

    FIELD_RULES: ClassVar[dict[str, Rule]] = {
        "policy": PolicyRule(),
        "image_token": OrAbsent(Text()),
        "image_start_token": OrAbsent(TokenText()),
        "image_end_token": OrAbsent(TokenText()),
        "overflow": Text(choices=OVERFLOW_MODES),
        "max_images_per_sequence": OrAbsent(Integer(minimum=1)),
    }

    def stream_entry(self) -> dict:
        """What of it decides the stream (the config fingerprint's ``images`` entry)."""
        return {"policy": self.policy, "image_token": self.image_token, "image_start_token": self.image_start_token,
                "image_end_token": self.image_end_token, "overflow": self.overflow,
                "max_images_per_sequence": self.max_images_per_sequence}


def resolve_image_options(config, manifests, source_names, tokenizer) -> Optional["ImageOptions"]:
    """The loader's :class:`ImageOptions`, or None when no source holds images.

    Refuses, naming the fix: concat packing and token-unit mixing with image sources (a cut
    would split an image), transforms on them, a policy that disagrees with the counts an
    image dataset recorded, and placeholder tokens missing from the tokenizer.
    """
    from loader.config import ConfigError
    from loader.stages.tokenizer import resolve_special_token
    from loader.vision.block import ImageOptions
    from loader.vision.policies import policy_from_dict

    image_sources = [(name, m) for name, m in zip(source_names, manifests) if getattr(m, "images", None) is not None]
    if not image_sources:
        return None
    names = [name for name, _ in image_sources]
    if config.packing != "best_fit":
        raise ConfigError(f"sources {names} hold images: packing must be \"best_fit\" (got {config.packing!r}); "
                          "concat packing cuts documents anywhere, and a cut inside an image's placeholder tokens "
                          "would split the image across two sequences")
    if config.mixing_unit == "token":  # refused with one source too: the README promises it, whatever the count
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
