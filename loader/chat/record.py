"""The manifest's ``chat`` entry (:class:`ChatRecord`), and the chat options it records.

The chat kind's part of the dataset manifest (:mod:`loader.io.manifest` parses the rest and
hands this entry to the kind registered for it, :mod:`loader.kinds.chat`). Imports no
template or tokenizer code: every reader of a manifest loads it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Optional

from loader.errors import ManifestError
from loader.io.storage_options import SHA256_HEX

LOSS_ON_CHOICES = ("all", "last")  # chat.loss_on: every assistant turn, or the last one
OVERFLOW_CHOICES = ("reject", "truncate")  # chat.overflow: a conversation over max_tokens


@dataclass(frozen=True)
class ChatRecord:
    """The manifest's ``chat`` entry: how the conversations of a chat dataset are encoded.

    ``tokenized``: the lanes hold ``input_ids`` and ``loss_mask`` (the job encoded them);
    otherwise they hold :data:`~loader.io.names.CONVERSATION_COLUMN` and ``template`` is set (``sources``,
    ``special_tokens``, ``extra_variables``, ``template_name``: what
    :class:`loader.chat.ChatTemplate` is built from). ``template_origin`` names the file the
    job read (information only, not fingerprinted).
    """

    messages_field: str
    tokenized: bool
    loss_on: str
    max_tokens: Optional[int]
    overflow: str
    template_fingerprint: str
    template: Optional[dict[str, Any]] = None
    template_origin: Optional[str] = None
    # Tokens of the longest conversation (tokenized datasets written since it is recorded): the
    # loader refuses best_fit only if it really does not fit (loader.chat.block.check_chat_fits).
    # Absent (None) in older manifests, which keep their bytes and fingerprints.
    longest_tokens: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.template is None:
            del data["template"]
        if self.longest_tokens is None:
            del data["longest_tokens"]
        return data

    def fingerprint_content(self) -> dict[str, Any]:
        # template_origin: where the job read the template (a path of its machine); longest_tokens:
        # a statistic of the lane files, which the fingerprint covers already (their SHA-256s), so
        # that recording it kept the fingerprints of re-sharded datasets.
        content = self.to_dict()
        content.pop("template_origin", None)
        content.pop("longest_tokens", None)
        return content

    @classmethod
    def from_dict(cls, data: Any, where: str = "chat") -> "ChatRecord":
        """Parse the ``chat`` entry; every problem is reported at once, each naming its field."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected an object, got {type(data).__name__}")
        problems = []
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            problems.append(f"unknown fields {unknown} (known: {sorted(known)})")
        for name, typ in (("messages_field", str), ("tokenized", bool), ("loss_on", str), ("overflow", str),
                          ("template_fingerprint", str)):
            if name not in data:
                problems.append(f"missing field '{name}'")
            elif not isinstance(data[name], typ):
                problems.append(f"field '{name}' must be {typ.__name__} (got {data[name]!r:.80})")
        if isinstance(data.get("loss_on"), str) and data["loss_on"] not in LOSS_ON_CHOICES:
            problems.append(f"field 'loss_on' must be one of {LOSS_ON_CHOICES} (got {data['loss_on']!r})")
        if isinstance(data.get("overflow"), str) and data["overflow"] not in OVERFLOW_CHOICES:
            problems.append(f"field 'overflow' must be one of {OVERFLOW_CHOICES} (got {data['overflow']!r})")
        max_tokens = data.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
            problems.append(f"field 'max_tokens' must be a positive int or null (got {max_tokens!r:.80})")
        longest = data.get("longest_tokens")
        if longest is not None and (not isinstance(longest, int) or isinstance(longest, bool) or longest < 1):
            problems.append(f"field 'longest_tokens' must be a positive int or absent (got {longest!r:.80})")
        if isinstance(data.get("template_fingerprint"), str) and not SHA256_HEX.fullmatch(data["template_fingerprint"]):
            problems.append(f"field 'template_fingerprint' must be 64 lowercase hex digits "
                            f"(got {data['template_fingerprint']!r:.80})")
        template = data.get("template")
        if template is not None:
            template_problems = _template_problems(template)
            problems += [f"template.{p}" for p in template_problems]
            fingerprint = data.get("template_fingerprint")
            if not template_problems and isinstance(fingerprint, str) and template_fingerprint(template) != fingerprint:
                problems.append(f"field 'template' does not hash to its 'template_fingerprint' {fingerprint} "
                                f"(it hashes to {template_fingerprint(template)}): the stored template was edited; "
                                "re-shard with the template you mean, or restore the manifest")
        elif data.get("tokenized") is False:
            problems.append("field 'template' is missing: a dataset tokenized online needs the template it renders with")
        origin = data.get("template_origin")
        if origin is not None and not isinstance(origin, str):
            problems.append(f"field 'template_origin' must be a string or null (got {origin!r:.80})")
        if problems:
            raise ManifestError(f"{where}: " + "; ".join(problems))
        return cls(**{name: data.get(name) for name in known})


def template_fingerprint(template: dict[str, Any]) -> str:
    """The digest of a template record (``chat.template``: sources, special tokens, variables,
    name) the Beam job stores as ``chat.template_fingerprint`` and the loader checks it against."""
    content = {"sources": dict(template["sources"]), "special_tokens": dict(template.get("special_tokens") or {}),
               "template_name": template.get("template_name"),
               "extra_variables": dict(template.get("extra_variables") or {})}
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def _template_problems(template: Any) -> list[str]:
    if not isinstance(template, dict):
        return [f"must be an object (got {type(template).__name__})"]
    problems = []
    sources = template.get("sources")
    if not (isinstance(sources, dict) and sources and all(isinstance(k, str) and isinstance(v, str)
                                                             for k, v in sources.items())):
        problems.append("sources must be a non-empty object of template name -> Jinja text")
    tokens = template.get("special_tokens", {})
    if not (isinstance(tokens, dict) and all(isinstance(v, str) for v in tokens.values())):
        problems.append("special_tokens must be an object of token name -> text")
    if not isinstance(template.get("extra_variables", {}), dict):
        problems.append("extra_variables must be an object")
    name = template.get("template_name")
    if name is not None and not isinstance(name, str):
        problems.append(f"template_name must be a string or null (got {name!r:.80})")
    unknown = sorted(set(template) - {"sources", "special_tokens", "extra_variables", "template_name"})
    if unknown:
        problems.append(f"unknown fields {unknown}")
    return problems
