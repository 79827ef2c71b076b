"""Lane kinds: what a lane's rows hold, told to the core through one protocol and a registry.

A *kind* is one sort of lane data: plain text, pre-tokenized ids, online chat, images, chat
with images. The core (ordering, I/O, stages, checkpoint, the loader runtime) names no kind:
it asks the registry for the kind of a lane (:func:`kind_for`) and the kind decodes the lane's
row groups into blocks (:meth:`LaneKind.decode`), says which extra columns it reads
(:meth:`LaneKind.lane_columns`) and whether its blocks reject documents online
(:attr:`LaneKind.rejects_online`). A kind that adds an entry to the dataset manifest (chat's
``chat``, images' ``images``) registers the entry's parser (:func:`register_manifest_entry`),
which :meth:`loader.io.manifest.Manifest.from_dict` calls for that key.

Each kind is a module that registers itself when imported; :mod:`loader.kinds` imports the
built-in ones, so they are registered whenever this module is. A new kind is one more module:
subclass :class:`LaneKind` with ``named = True``, call :func:`register_kind` (see
docs/DESIGN.md, "How to add a kind", and docs/guides/kinds.md). The built-in kinds are matched
from a lane's flags; a named kind by the manifest's ``kind`` entry (:func:`lane_kind`), and
worker processes import the modules of the named kinds (:func:`kind_modules`).

This module imports nothing of the project beyond the error types and the block types the
protocol names, so every layer may import it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

from loader.errors import ConfigError, ManifestError
from loader.registry import Registry
from loader.io.blocks import Block, TokenFormat
from loader.stages.features import Feature


@dataclass(frozen=True)
class BlockSource:
    """One row group of a lane, as a kind's decoder receives it.

    ``values``: the lane's value column (``input_ids``, ``text`` or ``conversation``);
    ``columns``: the feature columns the lane reads, then the kind's own lane columns (named by
    ``column_names``); ``chat`` / ``images``: the lane's online chat (``OnlineChat``) and image
    options, None when the lane has none; ``epoch`` and ``block_of()`` (the row group's index in
    the epoch's order, computed on first call) place the block in its stream.
    """

    values: Any  # a pyarrow Array
    columns: Sequence[Any]
    column_names: tuple[str, ...]
    features: Sequence[Feature]
    token_format: TokenFormat
    tokenizer: Any
    where: str
    row_group: int
    chat: Any
    images: Any
    epoch: int
    block_of: Callable[[], int]


class LaneKind:
    """The protocol of a kind of lane data (module docstring). Subclasses set :attr:`name` and
    implement :meth:`matches` and :meth:`decode`; the rest have defaults for kinds without them.

    A *named* kind (:attr:`named`; every kind outside the built-ins) is never matched from a
    lane's flags: its datasets record its name in the manifest's ``kind`` entry (written by
    ``zephon shard --kind NAME``) and the loader picks it by that name (:func:`lane_kind`).
    Its lanes hold a ``text`` column (the job's untokenized output) which its :meth:`decode`
    turns into tokens; :meth:`matches` need not be implemented."""

    name: ClassVar[str]
    rejects_online: ClassVar[bool] = False  # its blocks count refused documents (``reject_counts``)
    named: ClassVar[bool] = False  # chosen by the manifest's ``kind`` entry, not by matches()
    # The micro-batch field that reports the documents its blocks drop online (a {reason: count}
    # of these reasons, with the sequence that enters the block), or None.
    reject_field: ClassVar[Optional[str]] = None
    reject_reasons: ClassVar[tuple[str, ...]] = ()

    def matches(self, *, pretokenized: bool, chat: Any, images: Any) -> bool:
        """Whether a lane of this description is of this kind (exactly one built-in kind matches a
        lane); a named kind matches none (the manifest names it)."""
        if self.named:
            return False
        raise NotImplementedError(f"{type(self).__name__}.matches")

    def lane_columns(self, schema_names: set) -> tuple[str, ...]:
        """The kind's own columns a lane reads beside its value and feature columns."""
        return ()

    def decode(self, source: BlockSource) -> Block:
        """The block of one row group (rows in replay order): tokens, document starts, features."""
        raise NotImplementedError(f"{type(self).__name__}.decode")

    def stream_options(self, manifest: Any, spec: Any, source_name: str, tokenizer: Any) -> dict:
        """The lane stream's options of a source of this kind (``LaneTokenStream`` keywords:
        ``chat``, ``images``), from its manifest and the ``LaneSpec``; none by default."""
        return {}

    def sequence_resolver(self, stream: Any, spec: Any, manifest: Any) -> Any:
        """What completes each packed sequence of a stream of this kind before it is handed out
        (an object with ``attach(sequence)`` and ``close()``: images' pixels), or None."""
        return None

    def bin_cap(self, spec: Any) -> Optional[tuple[int, Callable[[Any], int]]]:
        """``(cap, count)``: a best-fit bin of this kind's lanes holds pieces whose ``count(piece)``
        sum to at most ``cap`` (images per sequence), or None (no cap)."""
        return None

    def worker_slot_bytes(self, spec: Any, seq_len: int, items: int) -> int:
        """Bytes a worker message of ``items`` sequences needs beyond their token arrays
        (images' pixels, worst case); 0 by default."""
        return 0

    def __repr__(self) -> str:
        return f"<lane kind {self.name!r}>"


@dataclass(frozen=True)
class ManifestEntry:
    """A top-level manifest field that a kind adds: ``parse`` turns its JSON value into the
    record (raising :class:`loader.errors.ManifestError` that names the field), ``check`` lists problems of
    the record against the rest of the manifest's JSON (``data``)."""

    key: str
    parse: Callable[[Any], Any]
    check: Optional[Callable[[Any, dict], list[str]]] = None


@dataclass(frozen=True)
class SequenceAttachment:
    """What a kind attaches to its packed sequences (``PackedSequence.images``: the pixels of an
    image sequence) and how a worker message carries it: ``pack(sequences, arrays)`` returns one
    entry per sequence (None: none attached) and adds the arrays to write into the slot;
    ``unpack(entry, arrays, row)`` builds the attachment again from the slot's arrays."""

    name: str
    pack: Callable[[list, dict], list]
    unpack: Callable[[Any, dict, int], Any]


@dataclass(frozen=True)
class SourcePlan:
    """What a kind's module checks and decides when a loader is planned, over all its sources
    (``loader.runtime.plan``), under the name of what it plans (``images``, ``chat``):

    ``options(config, manifests, source_names, tokenizer)``: the loader-wide options of its
    lanes (``LaneSpec.images``), None without such a source; ``rejects(manifests, source_names,
    tokenizer, *, seq_len, packing, wrap_tokens, overlong)``: checks the sources (errors now, in the
    trainer) and returns the reasons of its online rejects' batch field; ``overflows(manifest, *,
    seq_len, packing, wrap_tokens)``: whether a source may hold a document longer than one
    best_fit sequence (the config's ``overlong`` then adds its transform)."""

    name: str
    options: Optional[Callable[..., Any]] = None
    rejects: Optional[Callable[..., tuple[str, ...]]] = None
    overflows: Optional[Callable[..., bool]] = None


_KINDS: dict[str, LaneKind] = {}
_ENTRIES: dict[str, ManifestEntry] = {}
_ATTACHMENTS: Registry[SequenceAttachment] = Registry("sequence attachment", "import the kind that attaches it")
_PLANS: Registry[SourcePlan] = Registry("source plan", "import the kind that plans it")


def register_kind(kind: LaneKind) -> LaneKind:
    """Add ``kind`` to the registry (its name must be new); returns it."""
    if not isinstance(kind, LaneKind):
        raise TypeError(f"register_kind takes a LaneKind instance (got {kind!r})")
    if kind.name in _KINDS:
        raise ValueError(f"lane kind {kind.name!r} is registered twice ({_KINDS[kind.name]!r}, {kind!r})")
    _KINDS[kind.name] = kind
    return kind


def unregister_kind(name: str) -> None:
    """Remove a kind (a test's own kind, once the test is done)."""
    _KINDS.pop(name)


def registered_kinds() -> tuple[LaneKind, ...]:
    return tuple(_KINDS.values())


def named_kinds() -> tuple[str, ...]:
    """The names of the registered named kinds (``zephon shard --kind`` choices)."""
    return tuple(name for name, kind in _KINDS.items() if kind.named)


def kind_for(*, pretokenized: bool, chat: Any = None, images: Any = None) -> LaneKind:
    """The one registered built-in kind that matches a lane of this description."""
    found = [k for k in _KINDS.values()
             if not k.named and k.matches(pretokenized=pretokenized, chat=chat, images=images)]
    if len(found) != 1:
        described = f"pretokenized={pretokenized}, chat={chat is not None}, images={images is not None}"
        raise ValueError(f"{len(found)} lane kinds match a lane with {described} (registered: "
                         f"{', '.join(_KINDS) or 'none'}); exactly one must")
    return found[0]


def kind_named(name: str, where: str = "the manifest") -> LaneKind:
    """The registered named kind ``name`` (a manifest's ``kind`` entry); an unknown one is a
    :class:`~loader.errors.ManifestError` that lists the registered named kinds."""
    kind = _KINDS.get(name)
    if kind is None or not kind.named:
        raise ManifestError(
            f"{where}: field 'kind' is {name!r}, which no imported module registers (registered named kinds: "
            f"{', '.join(named_kinds()) or 'none'}); import the module that registers it (register_kind) "
            "before building the loader")
    return kind


def lane_kind(name: Optional[str], *, pretokenized: bool, chat: Any = None, images: Any = None) -> LaneKind:
    """The kind of a lane: the named kind of the manifest's ``kind`` entry when it has one,
    else the built-in kind its flags match (:func:`kind_for`)."""
    if name is not None:
        return kind_named(name)
    return kind_for(pretokenized=pretokenized, chat=chat, images=images)


def manifest_kind(manifest: Any) -> LaneKind:
    """The kind of a dataset's lanes (a :class:`loader.io.manifest.Manifest`): its named kind, or
    the built-in kind of its flags (chat only where the loader renders it: ``online_chat``)."""
    return lane_kind(manifest.kind, pretokenized=manifest.pretokenized,
                     chat=manifest.chat if manifest.online_chat else None, images=manifest.images)


def kinds_of(manifests: Sequence[Any]) -> tuple[LaneKind, ...]:
    """The distinct kinds of a loader's sources, in source order."""
    return tuple(dict.fromkeys(manifest_kind(m) for m in manifests))


def kind_modules() -> tuple[str, ...]:
    """The modules that registered the named kinds, for worker processes to import
    (:func:`import_kind_modules`): a worker is a fresh interpreter, which has imported only
    the built-in kinds. A kind defined in ``__main__`` cannot be imported there by name."""
    modules = []
    for kind in _KINDS.values():
        module = type(kind).__module__
        if kind.named and module not in modules:
            if module == "__main__":
                raise ConfigError(
                    f"lane kind {kind.name!r} is defined in the __main__ script, which worker processes cannot "
                    "import; move it to an importable module (on sys.path) and import that, or set num_workers=0")
            modules.append(module)
    return tuple(modules)


def import_kind_modules(modules: Sequence[str]) -> None:
    """Import the modules of :func:`kind_modules` (in a worker, with the trainer's ``sys.path``),
    skipping kinds already registered."""
    for module in modules:
        importlib.import_module(module)


def register_manifest_entry(entry: ManifestEntry) -> ManifestEntry:
    """Add a manifest entry parser (its key must be new); entries are parsed in registration order."""
    if entry.key in _ENTRIES:
        raise ValueError(f"manifest entry {entry.key!r} is registered twice")
    _ENTRIES[entry.key] = entry
    return entry


def manifest_entries() -> tuple[ManifestEntry, ...]:
    return tuple(_ENTRIES.values())


def register_source_plan(plan: SourcePlan) -> SourcePlan:
    """Add what a kind plans for a loader's sources (its name must be new)."""
    return _PLANS.register(plan.name, plan)


def source_plan(name: str) -> SourcePlan:
    """The registered source plan ``name``; one nobody registered plans nothing."""
    return _PLANS.get(name) or SourcePlan(name)


def source_plans() -> tuple[SourcePlan, ...]:
    return _PLANS.values()


def register_attachment(attachment: SequenceAttachment) -> SequenceAttachment:
    """Add a sequence attachment's message codec (its name must be new)."""
    return _ATTACHMENTS.register(attachment.name, attachment)


def sequence_attachment(name: str) -> SequenceAttachment:
    """The registered codec of the sequence attachment ``name`` (its kind's module registers it)."""
    return _ATTACHMENTS.lookup(name)
