"""Loader configuration: one dataclass, loadable from TOML or JSON or keyword arguments.

Every field is documented in README.md ("Loader configuration"). Validation happens here,
once, with messages that name the field, show the value and list the valid choices.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Optional

from loader.validation import (
    Boolean, FilePath, Integer, ListOf, Names, Number, OrAbsent, Problems, Record, Rule, SubTable, Text, Weights,
    check_record, fail, validate_instance,
)

from loader.errors import ZephonError
from loader.stages.features import BATCH_FEATURE_FIELDS
from loader.transforms.spec import TransformSpec
from loader.vision.options import ImagesConfig, ImagesTable

PACKING_MODES = ("concat", "best_fit")
MIXING_UNITS = ("sequence", "token")
EXHAUSTION_POLICIES = ("repeat", "stop")
# How a stream of finite data (a source with exhaustion "stop" or max_epochs) ends
# (docs/guides/finite-epochs.md): "fill" delivers every document of every epoch, lanes that
# ran out early giving fill rows (no supervised tokens, batch["fill"]) until the last lane
# is done; "drop" ends at the first step that reaches a lane with nothing left (the
# documents still waiting in the other lanes are not delivered: Zephon before epoch_tail).
EPOCH_TAILS = ("fill", "drop")
# Conversations tokenized offline that do not fit one best_fit sequence (longer than seq_len
# minus the loader's BOS/EOS; docs/guides/finite-epochs.md): "refuse" the dataset (only when
# its recorded longest conversation does not fit), "drop" them (counted as the transform
# length_tokens' drops) or "truncate" them after their last assistant turn that fits
# (truncate_turns; one with none that fits is dropped, counted).
OVERLONG_CHOICES = ("refuse", "drop", "truncate")
# Per-token tensors a micro-batch can hold. ``input_ids`` is always there; the rest cost the
# batch builder a pass over the batch each, so a trainer that derives them itself (or does
# not use them) can leave them out. Per-sequence entries (source_ids, global_indices, step,
# micro_step) are always there.
# Then one field per per-token feature (loader.stages.features registry: token_source_ids,
# loss_mask), present in a batch when the loader's sources carry the feature.
BATCH_FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens") + BATCH_FEATURE_FIELDS


class ConfigError(ZephonError, ValueError):
    """A loader configuration value that cannot work; the message names the field."""

    exit_code = 2  # the CLI's usage-error status


@dataclass(frozen=True)
class SourceConfig:
    """One lane-sharded dataset in the mix."""

    path: str
    weight: float = 1.0
    name: Optional[str] = None  # defaults to the manifest's source_name
    exhaustion: str = "repeat"  # "repeat": next epoch (reshuffled); "stop": drop out of the mix
    max_epochs: Optional[int] = None  # with "repeat": stop after this many epochs
    transforms: tuple[TransformSpec, ...] = ()  # this source's own, after the config's (README "Transforms")

    FIELD_RULES: ClassVar[dict[str, Rule]] = {
        "path": FilePath(),
        "weight": Number(minimum=0),
        "name": OrAbsent(Text()),
        "exhaustion": Text(choices=EXHAUSTION_POLICIES),
        "max_epochs": OrAbsent(Integer(minimum=1)),
        "transforms": ListOf(Record(TransformSpec)),
    }

    def __post_init__(self) -> None:
        validate_instance(self, ConfigError, "datasets entry")


@dataclass(frozen=True)
class ScheduleEntry:
    """From global step ``step`` on, mix with ``weights`` (one per source, by name)."""

    step: int
    weights: dict[str, float]

    FIELD_RULES: ClassVar[dict[str, Rule]] = {"step": Integer(minimum=0), "weights": Weights()}

    def __post_init__(self) -> None:
        validate_instance(self, ConfigError, "schedule entry")


# StorageOptions fields that LoaderConfig sets from its own top-level fields (the rest are
# the ``storage`` table's), as StorageOptions field -> LoaderConfig field.
STORAGE_TOP_LEVEL = {"cache_dir": "cache_dir", "cache_max_bytes": "cache_max_bytes",
                     "verify_checksums": "verify_checksums", "endpoint": "storage_endpoint"}


def _storage_options_class() -> type:
    from loader.io.storage import StorageOptions  # pyarrow: only when a storage table is checked

    return StorageOptions


def _storage_top_level() -> frozenset[str]:
    shared = {f.name for f in fields(_storage_options_class())} & {f.name for f in fields(LoaderConfig)}
    return frozenset(STORAGE_TOP_LEVEL) | shared


@dataclass(frozen=True)
class LoaderConfig:
    """What the loader produces. See README "Loader configuration" for every field."""

    datasets: tuple[SourceConfig, ...]
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    seed: int
    tokenizer: str
    packing: str = "concat"
    best_fit_open_bins: int = 8
    add_bos: bool = False
    add_eos: bool = True
    eos_token: Optional[str] = None
    bos_token: Optional[str] = None
    pad_token: Optional[str] = None
    num_workers: int = 0
    prefetch: Optional[int] = None  # None: loader.workers.pool.default_prefetch (by seq_len and slot size)
    mixing_unit: str = "sequence"
    schedule: tuple[ScheduleEntry, ...] = ()
    cache_dir: Optional[str] = None
    cache_max_bytes: int = 10 * 1024**3
    verify_checksums: bool = True
    verify_local_files: bool = False  # issue 14: sha256 of local lane files (see README "Data integrity")
    storage_endpoint: Optional[str] = None
    storage: dict[str, Any] = field(default_factory=dict)  # advanced StorageOptions: retries, timeouts, read-ahead
    worker_timeout_s: float = 300.0
    read_ahead: bool = True
    read_ahead_threads: int = 2
    batch_fields: tuple[str, ...] = BATCH_FIELDS
    # Step boundaries whose lane states are kept for state_dict(step=t) (frameworks fetch ahead).
    step_states_kept: int = 4
    # Log loader.metrics' one-line summary at INFO every this many steps (0: never).
    metrics_log_every_steps: int = 0
    # Transforms of every source, before each dataset's own (README "Transforms"), and the step
    # from which a change of them takes effect when resuming a checkpoint made with others.
    transforms: tuple[TransformSpec, ...] = ()
    transforms_from_step: Optional[int] = None
    # Image sources: policy, placeholder tokens, overflow, images per sequence (README, ``images``).
    images: Optional[ImagesConfig] = None
    # Finite data: "fill" (every document, fill rows at the tail) or "drop" (end at the first
    # exhausted lane). See EPOCH_TAILS and docs/guides/finite-epochs.md.
    epoch_tail: str = "fill"
    # Offline-tokenized conversations longer than a best_fit sequence: OVERLONG_CHOICES.
    overlong: str = "refuse"

    FIELD_RULES: ClassVar[dict[str, Rule]] = {
        "datasets": ListOf(Record(SourceConfig), min_items=1, example='datasets = [{path = "data/web"}]'),
        "seq_len": Integer(minimum=1),
        "global_batch_size": Integer(minimum=1),
        "micro_batch_size": Integer(minimum=1),
        "seed": Integer(minimum=0, hint="there is no default seed"),
        "tokenizer": FilePath(),
        "packing": Text(choices=PACKING_MODES),
        "best_fit_open_bins": Integer(minimum=1),
        "add_bos": Boolean(),
        "add_eos": Boolean(),
        "eos_token": OrAbsent(Text()),
        "bos_token": OrAbsent(Text()),
        "pad_token": OrAbsent(Text()),
        "num_workers": Integer(minimum=0),
        "prefetch": OrAbsent(Integer(minimum=1)),
        "mixing_unit": Text(choices=MIXING_UNITS),
        "schedule": ListOf(Record(ScheduleEntry)),
        "cache_dir": OrAbsent(FilePath()),
        "cache_max_bytes": Integer(minimum=1),
        "verify_checksums": Boolean(),
        "verify_local_files": Boolean(),
        "storage_endpoint": OrAbsent(Text()),
        "storage": SubTable(_storage_options_class, _storage_top_level,
                            note="cache_dir, cache_max_bytes, verify_checksums, verify_local_files and "
                                 "storage_endpoint are top-level fields"),
        "worker_timeout_s": Number(minimum=0, exclusive=True, hint="a worker timeout of 0 would fail every wait"),
        "read_ahead": Boolean(),
        "read_ahead_threads": Integer(minimum=1, hint="set read_ahead = false to read on demand"),
        "batch_fields": Names(BATCH_FIELDS, required=("input_ids",)),
        "step_states_kept": Integer(minimum=0),
        "metrics_log_every_steps": Integer(minimum=0, hint="0 means no periodic metrics line"),
        "transforms": ListOf(Record(TransformSpec), example='transforms = [{function = "drop_regex", '
                                                           'args = {pattern = "lorem"}}]'),
        "transforms_from_step": OrAbsent(Integer(minimum=0)),
        "images": ImagesTable(),
        "epoch_tail": Text(choices=EPOCH_TAILS),
        "overlong": Text(choices=OVERLONG_CHOICES),
    }

    def __post_init__(self) -> None:
        # Every field's type and range (loader.validation), then the checks across fields.
        validate_instance(self, ConfigError, "loader config")
        problems = self._cross_field_problems()
        if problems:
            fail(ConfigError, "loader config", problems)

    def storage_options(self):
        """The :class:`loader.io.storage.StorageOptions` for every read (manifest, tokenizer, lanes)."""
        from loader.io.storage import StorageOptions

        top_level = {name: getattr(self, ours) for name, ours in STORAGE_TOP_LEVEL.items()}
        top_level.update({name: getattr(self, name) for name in _storage_top_level() - set(STORAGE_TOP_LEVEL)})
        return StorageOptions(**top_level, **self.storage)

    def _cross_field_problems(self) -> list[str]:
        """Problems between fields whose types and ranges are already valid."""
        problems = []
        if not (self.add_eos or self.add_bos) and self.packing == "concat":
            problems.append(
                "concat packing needs a document separator: set add_eos = true (recommended) or add_bos = true"
            )
        names = [d.name for d in self.datasets if d.name is not None]
        if len(names) != len(set(names)):
            problems.append(f"datasets: source names must be unique (got {names})")
        if sum(d.weight for d in self.datasets) <= 0:
            problems.append("datasets: at least one weight must be > 0")
        last = -1
        for entry in self.schedule:
            if entry.step <= last:
                problems.append(f"schedule: steps must be strictly increasing (got {entry.step} after {last})")
            last = entry.step
        return problems

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> "LoaderConfig":
        """Build from a mapping (a parsed file); every unknown, missing or bad field is named at once."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: a loader config must be a table/object of fields (got {type(data).__name__})")
        data = dict(data)
        if "loader" in data and isinstance(data["loader"], dict):  # allow a [loader] table
            data = {**data.pop("loader"), **data}
        problems = Problems()
        stored = check_record(cls, data, "", problems)
        if problems:
            fail(ConfigError, where, problems.items)
        try:
            return cls(**stored)
        except ConfigError as exc:
            fail(ConfigError, where, getattr(exc, "problems", [str(exc)]))

    @classmethod
    def from_file(cls, path: str, **overrides: Any) -> "LoaderConfig":
        """Load a ``.toml`` or ``.json`` file; relative dataset/tokenizer paths are relative to it."""
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError as exc:
            raise ConfigError(f"config file {path}: cannot be read ({exc.strerror or exc})") from exc
        try:
            data = tomllib.loads(raw.decode("utf-8")) if path.endswith(".toml") else json.loads(raw)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            kind = "TOML" if path.endswith(".toml") else "JSON"
            raise ConfigError(f"{path}: cannot parse as {kind} ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a loader config must be a table/object of fields (got {type(data).__name__})")
        base = os.path.dirname(os.path.abspath(path))
        datasets = data.get("datasets")
        for entry in datasets if isinstance(datasets, list) else ():
            if isinstance(entry, dict) and isinstance(entry.get("path"), str):
                entry["path"] = _resolve(base, entry["path"])
        for key in ("tokenizer", "cache_dir"):
            if isinstance(data.get(key), str) and data[key]:
                data[key] = _resolve(base, data[key])
        data.update(overrides)
        return cls.from_dict(data, where=path)

    def replace(self, **changes: Any) -> "LoaderConfig":
        from dataclasses import replace

        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def finite(self) -> bool:
        """Whether some source ends (exhaustion "stop" or max_epochs): the stream then ends too."""
        return any(d.exhaustion == "stop" or d.max_epochs is not None for d in self.datasets)

    @property
    def fills_tails(self) -> bool:
        """Whether the stream delivers every lane's tail, with fill rows where lanes ran out."""
        return self.finite and self.epoch_tail == "fill"

    def stream_fields(self) -> dict[str, Any]:
        """The fields that determine the global stream (not how it is computed).

        ``epoch_tail`` is one only where it changes the stream (finite data) and only as
        "fill": a "drop" config, and every endless one, has the fields (and fingerprint) of
        the Zephon before the option, whose finite streams all ended that way."""
        tail = {"epoch_tail": self.epoch_tail} if self.fills_tails else {}
        if self.overlong != "refuse":  # only then: every config before the option keeps its fingerprint
            tail["overlong"] = self.overlong
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "packing": self.packing,
            "best_fit_open_bins": self.best_fit_open_bins if self.packing == "best_fit" else None,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "mixing_unit": self.mixing_unit if len(self.datasets) > 1 else None,
            **tail,
        }

    def source_transforms(self, index: int) -> tuple[TransformSpec, ...]:
        """The transforms of ``datasets[index]``: the config's, then the dataset's own."""
        return self.transforms + self.datasets[index].transforms

    def transform_entries(self) -> Optional[list[list[dict[str, Any]]]]:
        """Per dataset, its transforms as configured (None without any: the fingerprint of a
        config without transforms is what it was before transforms existed)."""
        per_source = [[t.to_entry() for t in self.source_transforms(k)] for k in range(len(self.datasets))]
        return per_source if any(per_source) else None

    def fingerprint(self) -> str:
        fields_ = self.stream_fields()
        transforms = self.transform_entries()
        if transforms is not None:  # the transforms decide which documents (and tokens) exist
            fields_ = dict(fields_, transforms=transforms)
        if self.images is not None:  # placeholder tokens, overflow and caps decide the sequences
            fields_ = dict(fields_, images=self.images.stream_entry())
        blob = json.dumps(fields_, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def _resolve(base: str, path: str) -> str:
    if path.startswith("gs://") or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))

