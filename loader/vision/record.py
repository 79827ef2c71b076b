"""The manifest's ``images`` entry of an image dataset (no Pillow import: the manifest loads it).

``{"images": N, "limits": {...}, "policy": {...} | null, "policy_fingerprint": "..." | null}``:

* ``images``: how many images the lane files hold (every row's ``num_images`` summed);
* ``limits``: the :class:`loader.vision.images.ImageLimits` the job checked every image against;
* ``policy``: the image-processing policy given to the job (``--image-policy``, as
  :meth:`loader.vision.policies.FixedResolutionPolicy.to_dict` writes it) whose counts are the
  lanes' ``image_visual_tokens``, or null when the job was given none (then the lanes hold no
  counts and the loader computes them online from width and height);
* ``policy_fingerprint``: the policy's :meth:`fingerprint`, so the loader can check that the
  policy it runs is the one the counts were made with.

The whole entry is part of the dataset fingerprint; text datasets have no entry, so their
manifests and fingerprints are unchanged.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Optional

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_LIMIT_FIELDS = ("max_bytes", "max_pixels", "max_aspect_ratio", "max_images_per_document")


@dataclass(frozen=True)
class ImagesRecord:
    images: int
    limits: dict[str, Any]
    policy: Optional[dict[str, Any]] = None
    policy_fingerprint: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def policy_mismatch(self, policy) -> Optional[str]:
        """Why the lanes' ``image_visual_tokens`` were not made with ``policy`` (an image policy of
        :mod:`loader.vision.policies`), naming the differing fields; None when they were."""
        if self.policy is None:
            return "the dataset was sharded without --image-policy: its lanes hold no visual-token counts"
        if policy.fingerprint() == self.policy_fingerprint:
            return None
        given = policy.to_dict()
        fields = sorted(name for name in set(given) | set(self.policy) if given.get(name) != self.policy.get(name))
        shown = ", ".join(f"{name}: {self.policy.get(name)!r} in the manifest, {given.get(name)!r} given"
                          for name in fields)
        return f"the lanes' visual tokens were counted with another image policy ({shown or 'same fields'})"

    @classmethod
    def problems_of(cls, data: Any) -> list[str]:
        """Every problem of a manifest ``images`` entry (empty when it is valid)."""
        if not isinstance(data, dict):
            return [f"expected an object, got {type(data).__name__}"]
        problems = []
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            problems.append(f"unknown fields {unknown} (known: {sorted(cls.__dataclass_fields__)})")
        count = data.get("images")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            problems.append(f"field 'images' must be an int >= 0 (got {count!r:.80})")
        limits = data.get("limits")
        if not isinstance(limits, dict) or sorted(limits) != sorted(_LIMIT_FIELDS):
            problems.append(f"field 'limits' must be an object with {', '.join(_LIMIT_FIELDS)} (got {limits!r:.120})")
        policy, fingerprint = data.get("policy"), data.get("policy_fingerprint")
        if policy is not None and not (isinstance(policy, dict) and isinstance(policy.get("kind"), str)):
            problems.append(f"field 'policy' must be null or an object with a 'kind' (got {policy!r:.120})")
        if (policy is None) != (fingerprint is None):
            problems.append("fields 'policy' and 'policy_fingerprint' are set together or not at all")
        if fingerprint is not None and not (isinstance(fingerprint, str) and _SHA256_HEX.fullmatch(fingerprint)):
            problems.append(f"field 'policy_fingerprint' must be 64 lowercase hex digits (got {fingerprint!r:.80})")
        return problems

    @classmethod
    def from_dict(cls, data: Any) -> "ImagesRecord":
        """Parse an entry; raises ``ValueError`` listing every problem (the manifest names the entry)."""
        problems = cls.problems_of(data)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(images=data["images"], limits=dict(data["limits"]), policy=data.get("policy"),
                   policy_fingerprint=data.get("policy_fingerprint"))
