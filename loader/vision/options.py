"""The loader config's ``images`` table (resolved to the loader's image options by :mod:`loader.vision.loader_options`).

Registered at import with :mod:`loader.config_tables`, which imports this module by name the
first time a config holds the table: the config names no kind, and this module stays light.

Every field is documented by ``FIELD_DOCS`` (the configuration reference, ``images`` table)::

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

from loader.config_tables import register_config_table
from loader.errors import ImagePolicyError
from loader.validation import Integer, OrAbsent, Problems, Record, Rule, Text
from loader.vision.policies import parse_policy_spec, policy_from_dict

OVERFLOW_MODES = ("reject", "truncate")  # images.overflow (loader.vision.block)


class PolicyRule(Rule):
    """A policy name, a JSON object string or a table (:mod:`loader.vision.policies`), or absent;
    stored as the policy's dict."""

    expected = "\"fixed\", \"dynamic\", a JSON object string or a table with a 'kind'"

    def check(self, value: Any, path: str, problems: Problems) -> Any:
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
    """How image sources become tokens and pixels (the loader config's ``images`` table)."""

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
    FIELD_DOCS: ClassVar[dict[str, str]] = {
        "policy": "`\"fixed\"`, `\"dynamic\"`, a JSON string or a table as `zephon shard --image-policy` takes it. "
                  "Absent: the policy the datasets were sharded with.",
        "image_token": "Placeholder token text repeated once per visual token. Default per family: dynamic "
                       "`<|image_pad|>`, fixed `<image>`.",
        "image_start_token": "Token before each image's placeholders (`\"\"`: none). Default: dynamic "
                             "`<|vision_start|>`, fixed none.",
        "image_end_token": "Token after each image's placeholders (`\"\"`: none). Default: dynamic `<|vision_end|>`, "
                           "fixed none.",
        "overflow": "A document with images longer than `seq_len`: `reject` drops it (counted), `truncate` cuts "
                    "it before the image the cut would fall in.",
        "max_images_per_sequence": "Most images in one packed sequence (absent: no cap).",
    }

    def stream_entry(self) -> dict:
        """What of it decides the stream (the config fingerprint's ``images`` entry)."""
        return {"policy": self.policy, "image_token": self.image_token, "image_start_token": self.image_start_token,
                "image_end_token": self.image_end_token, "overflow": self.overflow,
                "max_images_per_sequence": self.max_images_per_sequence}


register_config_table("images", ImagesTable())
