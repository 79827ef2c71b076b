"""Chat templates: loading one, and rendering a conversation exactly as ``transformers`` does.

A chat template is a Jinja program in the Hugging Face convention. It comes from a ``.jinja``
file or from a ``tokenizer_config.json`` (its ``chat_template``: one string, or the
list-of-named-templates form ``[{"name": "default", "template": ...}, ...]``; a config without
one falls back to the ``chat_template.jinja`` saved beside it, as ``transformers`` v5 saves it).

Rendering mirrors ``transformers`` 5.x, so a template renders here to the same text, character
for character (tested against ``apply_chat_template(..., tokenize=False)``):

- the environment: ``transformers/utils/chat_template_utils.py::_cached_compile_jinja_template``
  (``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension; ``raise_exception``, a ``tojson`` filter that
  does not HTML-escape and accepts ``indent`` / ``separators`` / ``sort_keys``, a limited
  ``dict`` and an underscore-refusing ``namespace``; jinja2 >= 3.1.6). Two deliberate
  differences, for determinism and bounded work (:mod:`loader.chat.render_limits`):
  ``strftime_now`` is undefined (a guarded call takes the template's fallback, an unguarded
  one is a ``ChatTemplateError``), and a render's loops, time, output and ``*`` / ``**``
  results are bounded;
- the ``{% generation %}...{% endgeneration %}`` tag (``AssistantTracker`` there): renders its
  body unchanged and, while tracking, records the character span of the body in the text
  rendered so far;
- the variables: ``messages``, ``tools``, ``documents`` (always ``None`` here),
  ``add_generation_prompt``, the named special tokens of the tokenizer config (``bos_token``,
  ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``
  and a dict-form ``extra_special_tokens``: ``PreTrainedTokenizerBase.special_tokens_map``),
  then ``extra_variables`` on top (``apply_chat_template``'s ``**kwargs`` overwrite special
  tokens the same way);
- the inputs, as ``render_jinja_template`` prepares them: keys whose value is ``None`` are
  dropped from each message (``_normalize_chat_messages``), everything is rebuilt from plain
  JSON types (``_plain_template_data``), and a message's reasoning given as ``thinking`` or
  ``reasoning`` is also offered as ``reasoning_content`` (``_alias_reasoning_fields``);
- template choice among named templates (``get_chat_template``): the ``template_name`` asked
  for, else ``tool_use`` when the conversation has tools and that template exists, else
  ``default``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Optional

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np

from loader.chat import render_limits
from loader.chat.render_limits import BoundedEnvironment
from loader.chat.shipped import resolve_template
from loader.errors import ChatTemplateError
from loader.io import storage

# transformers refuses older jinja2: they have known sandbox escapes, and templates are untrusted code.
MIN_JINJA2_VERSION = (3, 1, 6)

# PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: the special tokens a template sees by name.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# render_jinja_template: reasoning names; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Variables render() sets itself; transformers raises a TypeError when its kwargs repeat them.
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")

# The regex render_jinja_template uses to decide whether a template has generation tags.
_GENERATION_TAG_RE = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation: the text, and the ``{% generation %}`` spans when tracking.

    ``generation_spans`` are ``(start, end)`` character offsets into ``text``, in the order the
    template's generation blocks finished, as ``transformers`` records them; empty when the
    render did not track or the template has no generation tags.
    """

    text: str
    generation_spans: tuple[tuple[int, int], ...] = ()


class _GenerationTracker(jinja2.ext.Extension):
    """``{% generation %}``: transformers' ``AssistantTracker``, mirrored.

    The body renders unchanged. While a tracker is active (a ``ContextVar``, so threads that
    render at once do not mix their spans), the span of the body is recorded: its start is the
    length of the text the template has yielded so far. As in transformers, a generation block
    inside a construct that buffers its output (a macro, a ``{% set %}`` block, a filter block)
    records a start relative to what was yielded, not to the final text.
    """

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        self._tracking: ContextVar = ContextVar("zephon_generation_tracker", default=None)
        environment.extend(zephon_generation_tracker=self)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context: jinja2.nodes.EvalContext, caller: jinja2.runtime.Macro) -> str:
        rendered_body = caller()
        tracking = self._tracking.get()
        if tracking is not None:
            yielded, marks = tracking
            # The span starts after the blocks yielded so far: their count now, their length at the
            # end (summing them here, at every tag, was quadratic in the conversation's length).
            marks.append((len(yielded), len(rendered_body)))
        return rendered_body

    @contextmanager
    def track(self, yielded: list[str], marks: list[tuple[int, int]]):
        """Record ``(blocks yielded before it, body length)`` of every generation block into
        ``marks`` while the render appends its blocks to ``yielded``."""
        if self._tracking.get() is not None:
            raise RuntimeError("a chat template render is already tracking generation spans in this context")
        token = self._tracking.set((yielded, marks))
        try:
            yield
        finally:
            self._tracking.reset(token)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers: Jinja's own tojson HTML-escapes (<, >, &, ') and takes fewer options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    # transformers' limited `dict`: callable and fromkeys, no attribute access to type internals.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # transformers' namespace: refuses underscore-prefixed attributes (a path to CPython internals).
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


def _environment() -> BoundedEnvironment:
    version = tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < MIN_JINJA2_VERSION:
        raise ChatTemplateError(
            f"chat templates need jinja2 >= 3.1.6 (older versions have sandbox escapes); "
            f"installed: {jinja2.__version__}. Fix: pip install -U 'jinja2>=3.1.6'"
        )
    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    render_limits.install(env)  # strftime_now undefined (no clock), a budgeted range
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """transformers' ``_plain_template_data``: rebuild from JSON types, anything else a placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):
        return _plain(value.item())  # np.bool_(False) must not become a truthy placeholder string
    return f"<{type(value).__name__}>"


def _template_messages(messages, from_json: bool = False) -> list[dict]:
    """The messages as the template sees them (transformers' normalisation, in its order).

    ``from_json``: the messages hold only JSON types (``json.loads`` output) and no
    ``None``-valued keys (:func:`loader.chat.conversations.parse_conversation` dropped them), so
    dropping ``None`` and ``_plain`` would rebuild equal values: the messages are used as they
    are (the sandbox is immutable: a template cannot change them)."""
    if from_json:
        plain = messages
    else:
        plain = _plain([{key: value for key, value in message.items() if value is not None} for message in messages])
    aliased = []
    for message in plain:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _token_text(value: Any, where: str) -> str:
    # tokenizer_config.json writes a special token as a string or as a serialised AddedToken.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ChatTemplateError(f"{where} must be a string or an AddedToken object with 'content' (got {value!r})")


def special_tokens_of(config: Mapping[str, Any], origin: str = "tokenizer_config.json") -> dict[str, str]:
    """The named special tokens a ``tokenizer_config.json`` gives a template (``special_tokens_map``)."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        if config.get(name) is not None:
            tokens[name] = _token_text(config[name], f"{origin}: {name}")
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for name, value in extra.items():
            tokens[str(name)] = _token_text(value, f"{origin}: extra_special_tokens.{name}")
    return tokens


@dataclass(frozen=True)
class ChatTemplate:
    """One chat template source (or several named ones) plus the variables it renders with.

    ``sources`` maps a template name to its Jinja text; a single template is named
    ``"default"``. ``template_name`` picks one of several; ``None`` follows transformers'
    choice (see the module docstring). ``special_tokens`` and ``extra_variables`` are the
    template variables beyond the conversation (``extra_variables`` win on a clash).
    """

    sources: Mapping[str, str]
    origin: str = "<string>"
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    extra_variables: Mapping[str, Any] = field(default_factory=dict)
    template_name: Optional[str] = None
    _compiled: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _generation_tags: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.sources or not all(isinstance(text, str) for text in self.sources.values()):
            raise ChatTemplateError(f"{self.origin}: no chat template text (got {self.sources!r})")
        if self.template_name is not None and self.template_name not in self.sources:
            raise ChatTemplateError(
                f"{self.origin}: no chat template named {self.template_name!r}; available: {sorted(self.sources)}"
            )
        clashes = sorted(set(self.extra_variables) & set(RESERVED_VARIABLES))
        if clashes:
            raise ChatTemplateError(
                f"{self.origin}: extra_variables may not set {clashes}; the conversation provides "
                f"{list(RESERVED_VARIABLES)}"
            )
        env = _environment()
        for name, text in self.sources.items():
            self._generation_tags[name] = _GENERATION_TAG_RE.search(text) is not None
            try:
                self._compiled[name] = env.from_string(text)
            except jinja2.exceptions.TemplateSyntaxError as exc:
                raise ChatTemplateError(
                    f"{self.origin}: chat template {name!r} does not compile: {exc.message} (line {exc.lineno})"
                ) from exc

    def __reduce__(self):
        # Compiled Jinja templates do not pickle; Beam ships DoFns (and this) pickled, so the
        # template travels as its sources and options and compiles again on arrival.
        options = (dict(self.sources), self.origin, dict(self.special_tokens), dict(self.extra_variables))
        return (type(self), options + (self.template_name,))

    @classmethod
    def from_string(cls, text: str, **options) -> "ChatTemplate":
        return cls(sources={"default": text}, **options)

    def select(self, has_tools: bool) -> str:
        """Name of the template a conversation renders with (transformers' ``get_chat_template``).

        One difference: a config holding a single named template uses it whatever its name
        (transformers would ask for a name unless it is ``default``).
        """
        if self.template_name is not None:
            return self.template_name
        if len(self.sources) == 1:
            return next(iter(self.sources))
        if has_tools and "tool_use" in self.sources:
            return "tool_use"
        if "default" in self.sources:
            return "default"
        raise ChatTemplateError(
            f"{self.origin} holds several chat templates and none is named 'default'; "
            f"pick one with template_name= (available: {sorted(self.sources)})"
        )

    def has_generation_tags(self, has_tools: bool = False) -> bool:
        """Whether the template used for such a conversation marks assistant spans (transformers' regex)."""
        return self._generation_tags[self.select(has_tools)]

    def render(
        self,
        messages,
        *,
        tools=None,
        add_generation_prompt: bool = False,
        track_generation: bool = False,
        from_json: bool = False,
    ) -> RenderedChat:
        """Render ``messages`` (a list of message mappings) to text, as ``apply_chat_template`` does.

        With ``track_generation`` the spans of ``{% generation %}`` blocks are recorded. Errors
        the template raises (``raise_exception``, undefined attributes, type errors on odd
        data) propagate: :mod:`loader.chat.encode` turns them into rejects of that record.
        ``from_json`` promises that ``messages`` and ``tools`` hold only JSON types and the
        messages no ``None``-valued keys (a :class:`~loader.chat.conversations.Conversation`
        parsed from ``json.loads`` output): the same text, without transformers' copy of them.
        """
        compiled = self._compiled[self.select(tools is not None)]
        variables = {
            **_plain(dict(self.special_tokens)),
            **_plain(dict(self.extra_variables)),
            "messages": _template_messages(messages, from_json),
            "tools": (list(tools) if from_json else _plain(list(tools))) if tools is not None else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        return render_limits.run_bounded(lambda: self._render(compiled, variables, track_generation), self.origin,
                                         ChatTemplateError)

    @staticmethod
    def _render(compiled, variables: dict, track_generation: bool) -> RenderedChat:
        """One render, its chunks under :func:`render_limits.bounded_chunks` (time, size)."""
        if not track_generation:
            return RenderedChat("".join(render_limits.bounded_chunks(compiled.generate(**variables))))
        yielded: list[str] = []
        marks: list[tuple[int, int]] = []
        context = compiled.new_context(variables)
        with compiled.environment.zephon_generation_tracker.track(yielded, marks):
            try:  # as Template.render, but the blocks land in a list the tracker can count
                yielded.extend(render_limits.bounded_chunks(compiled.root_render_func(context)))
            except Exception:
                compiled.environment.handle_exception()
        if not marks:
            return RenderedChat("".join(yielded))
        starts = list(accumulate(map(len, yielded), initial=0))
        return RenderedChat("".join(yielded), tuple((starts[count], starts[count] + length) for count, length in marks))


def _named_templates(value: Any, origin: str) -> dict[str, str]:
    # tokenizer_config.json: a string, or [{"name": ..., "template": ...}, ...] (transformers' saved form).
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and value:
        templates = {}
        for index, entry in enumerate(value):
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ChatTemplateError(
                    f"{origin}: chat_template[{index}] must be {{'name': str, 'template': str}} (got {entry!r})"
                )
            templates[entry["name"]] = entry["template"]
        return templates
    raise ChatTemplateError(
        f"{origin}: chat_template must be a string or a non-empty list of {{'name', 'template'}} objects "
        f"(got {type(value).__name__})"
    )


def load_chat_template(
    path: str,
    *,
    template_name: Optional[str] = None,
    extra_variables: Optional[Mapping[str, Any]] = None,
    storage_options=None,
) -> ChatTemplate:
    """Load a chat template from a ``.jinja`` file or a ``tokenizer_config.json`` (local, ``gs://`` or ``s3://``),
    or a template shipped with Zephon by its name (``"chatml"``: :mod:`loader.chat.shipped`).

    A file whose text parses as a JSON object is a tokenizer config: its ``chat_template`` is
    used (or the ``chat_template.jinja`` beside it) and its special tokens become template
    variables. Anything else is Jinja text (no special tokens then; give them with
    ``extra_variables``, e.g. ``{"bos_token": "<|begin_of_text|>"}``).
    """
    path = resolve_template(path) or path
    text = _read_text(path, storage_options)
    options = dict(template_name=template_name, extra_variables=dict(extra_variables or {}))
    config = _json_object_or_none(text)
    if config is None:
        return ChatTemplate(sources={"default": text}, origin=path, **options)
    special_tokens = special_tokens_of(config, path)
    if config.get("chat_template") is not None:
        sources = _named_templates(config["chat_template"], path)
        return ChatTemplate(sources=sources, origin=path, special_tokens=special_tokens, **options)
    sibling = storage.join(path.rsplit("/", 1)[0], "chat_template.jinja") if "/" in path else "chat_template.jinja"
    if storage.exists(sibling, storage_options):
        sources = {"default": _read_text(sibling, storage_options)}
        return ChatTemplate(sources=sources, origin=sibling, special_tokens=special_tokens, **options)
    raise ChatTemplateError(
        f"{path} is a tokenizer config without a 'chat_template' and there is no chat_template.jinja beside it; "
        "pass the template's .jinja file instead"
    )


def _read_text(path: str, storage_options) -> str:
    return storage.read_user_text(
        path, storage_options, error=ChatTemplateError, noun="chat template", named_by="option --chat-template",
        directory_hint="point at its tokenizer_config.json or chat_template.jinja",
    )


def _json_object_or_none(text: str) -> Optional[dict]:
    if not text.lstrip().startswith("{"):
        return None  # a Jinja template may start with "{%" / "{{", which is never valid JSON
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
