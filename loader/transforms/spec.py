"""What a config (or ``zephon shard --transform``) names: a transform spec, parsed and imported.

A spec is ``function`` (``"module:function"``, or the short name of a built-in of
:mod:`loader.transforms.builtins` such as ``"drop_regex"``), ``args`` (keyword arguments, a
JSON table), an optional ``version`` the user declares (bump it when the function's code
changes: it enters the config fingerprint and the checkpoint), and an optional ``stage``:

* ``"text"``: the function needs the document text; on text sources it runs before
  tokenization, and it may change the text only there (offline, and online on text sources);
* ``"tokens"``: the function needs ``input_ids`` (and the per-token features); it runs on
  pre-tokenized sources, after the ids are read, and on online chat sources after each
  conversation is rendered, tokenized and masked (ids and ``loss_mask``);
* ``"records"``: the function needs ``doc.record``, an online chat source's conversation
  (``{"messages": [...], "tools": [...]}``) before it is rendered; it may drop it or return
  ``doc.replace(record=...)`` (:mod:`loader.transforms.conversations`).

A function may declare its stage and version with the :func:`transform` decorator; the
spec's own values win. A function declared ``stage="any"`` (the built-in ``identity``) takes
``"tokens"`` on pre-tokenized sources and ``"text"`` elsewhere.

On the command line a spec is ``module:function[@version][:json-args]``, e.g.
``--transform 'drop_regex:{"pattern": "lorem"}'`` or ``--transform 'my.filters:clean@2'``.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from loader.errors import ConfigError, TransformError
from loader.transforms.builtins import BUILTINS
from loader.transforms.declare import ANY_STAGE, STAGES, transform  # noqa: F401  (transform: also importable from here)
from loader.validation import JsonTable, OrAbsent, Rule, Text, fail, validate_instance

BUILTIN_MODULE = "loader.transforms.builtins"


def _function_problem(name: str) -> Optional[str]:
    """Why ``name`` cannot name a function, or None."""
    if ":" not in name:
        if name in BUILTINS:
            return None
        return (f"function {name!r} is neither 'module:function' nor a built-in "
                f"({', '.join(sorted(BUILTINS))})")
    module, _, function = name.partition(":")
    parts = module.split(".") + [function]
    if not all(p.isidentifier() for p in parts):
        return f"function {name!r} must be 'module.path:function_name' (Python identifiers, one ':')"
    return None


@dataclass(frozen=True)
class TransformSpec:
    """One configured transform (an entry of a ``transforms`` list)."""

    function: str
    args: dict[str, Any] = field(default_factory=dict)
    version: Optional[str] = None
    stage: Optional[str] = None

    FIELD_RULES: ClassVar[dict[str, Rule]] = {
        "function": Text(),
        "args": JsonTable(),
        "version": OrAbsent(Text()),
        "stage": OrAbsent(Text(choices=STAGES)),
    }
    FIELD_DOCS: ClassVar[dict[str, str]] = {
        "function": "`module:function` (your code, importable in every process) or the name of a built-in; "
                    "imported when the loader is built.",
        "args": "Keyword arguments of the function (JSON values).",
        "version": "Enters the config fingerprint and the checkpoint: bump it when the code changes. Default: "
                    "the function's declared version.",
        "stage": "`text` (sees `doc.text`, before tokenization), `tokens` (sees `doc.input_ids` and "
                 "`doc.features`) or `records` (an online chat source's conversation before it is rendered). "
                 "Default: the function's declared stage, else `text`.",
    }

    def __post_init__(self) -> None:
        validate_instance(self, ConfigError, "transforms entry")
        problem = _function_problem(self.function)
        if problem:
            fail(ConfigError, "transforms entry", [problem])

    @property
    def qualified_name(self) -> str:
        """``module:function``, built-ins included (what messages and counters name)."""
        return self.function if ":" in self.function else f"{BUILTIN_MODULE}:{self.function}"

    @property
    def label(self) -> str:
        """The short name counters are reported under: the function as configured."""
        return self.function

    def to_entry(self) -> dict[str, Any]:
        """The spec as it enters fingerprints and checkpoints (JSON, keys sorted on dump)."""
        return {"function": self.function, "args": dict(self.args), "version": self.version, "stage": self.stage}

    def load(self) -> Callable:
        """Import the function; a :class:`TransformError` says why it cannot be."""
        module_name, _, function_name = self.qualified_name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # ImportError, or whatever the module raises while importing
            raise TransformError(
                f"transform {self.qualified_name}: module {module_name!r} cannot be imported "
                f"({type(exc).__name__}: {exc}); install it or put its folder on PYTHONPATH (worker "
                "processes and Beam workers import it too)") from exc
        function = getattr(module, function_name, None)
        if not callable(function):
            raise TransformError(f"transform {self.qualified_name}: module {module_name!r} has no function "
                                 f"{function_name!r}")
        declared = getattr(function, "__zephon_stage__", None)
        if self.stage is not None and declared in STAGES and declared != self.stage:
            raise TransformError(f"transform {self.qualified_name} works on {declared}; the config says stage = "
                                 f"{self.stage!r}: remove the stage or set it to {declared!r}")
        return function

    def resolved(self, pretokenized: bool) -> "TransformSpec":
        """The spec with the function's declared stage and version filled in (imports it)."""
        function = self.load()
        stage = self.stage or getattr(function, "__zephon_stage__", None) or "text"
        if stage == ANY_STAGE:
            stage = "tokens" if pretokenized else "text"
        version = self.version if self.version is not None else getattr(function, "__zephon_version__", None)
        return TransformSpec(self.function, dict(self.args), version, stage)


def parse_transform_arg(text: str) -> TransformSpec:
    """``module:function[@version][:json-args]`` (or ``builtin[...]``) -> spec; a ConfigError names the flag."""
    where = f"--transform {text!r}"
    head, brace, tail = text.partition(":{")
    args: dict[str, Any] = {}
    if brace:
        try:
            args = json.loads("{" + tail)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: the arguments after the function are not a JSON object ({exc}); "
                              "quote the flag for the shell, e.g. --transform 'drop_regex:{\"pattern\": \"x\"}'") from None
    function, at, version = head.partition("@")
    try:
        return TransformSpec(function=function, args=args, version=version if at else None)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
