"""Loader configuration: one dataclass, loadable from TOML or JSON or keyword arguments.

Each record declares its fields' rules (``FIELD_RULES``, checked by :mod:`loader.validation`)
and their meaning (``FIELD_DOCS``); the configuration reference of the docs site is generated
from both. Validation happens here, once, with messages that name the field, show the value
and list the valid choices.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
import dataclasses
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Optional

from loader.validation import (
    Boolean, FilePath, Integer, ListOf, Names, Number, OrAbsent, Problems, Record, Rule, SubTable, Text, Weights,
    check_record, fail, validate_instance,
)

from loader.config_tables import KindTable
from loader.errors import ConfigError
from loader.io.backends import is_remote
from loader.model_inputs import LayoutName, missing_fields
from loader.stages.features import BATCH_FEATURE_FIELDS
from loader.transforms.spec import TransformSpec
from loader.io.storage import StorageOptions

PACKING_MODES = ("concat", "best_fit")
MIXING_UNITS = ("sequence", "token")
BALANCE_MODES = ("attention",)  # loader.order.balance: how a global batch is spread over ranks
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


@dataclass(frozen=True)
class SourceConfig:
    """One lane-sharded dataset in the mix (an entry of ``LoaderConfig.datasets``)."""

    path: str
    weight: float = 1.0
    name: Optional[str] = None  # defaults to the manifest's source_name
    exhaustion: str = "repeat"  # "repeat": next epoch (reshuffled); "stop": drop out of the mix
    max_epochs: Optional[int] = None  # with "repeat": stop after this many epochs
    transforms: tuple[TransformSpec, ...] = ()  # this source's own, after the config's

    FIELD_RULES: ClassVar[dict[str, Rule]] = {
        "path": FilePath(),
        "weight": Number(minimum=0),
        "name": OrAbsent(Text()),
        "exhaustion": Text(choices=EXHAUSTION_POLICIES),
        "max_epochs": OrAbsent(Integer(minimum=1)),
        "transforms": ListOf(Record(TransformSpec)),
    }

    # One entry per field: what it means, for the configuration reference (docs/reference/config.md
    # is generated from these, the rules and the defaults; a test checks every field has one).
    FIELD_DOCS: ClassVar[dict[str, str]] = {
        "path": "The dataset folder (the one holding `manifest.json`), local or `gs://`.",
        "weight": "Share of the mix, normalised over the sources to exact fractions (at least one weight > 0).",
        "name": "Source name in batches, logs and checkpoints; default: the manifest's `source_name`. Names must "
                "be unique.",
        "exhaustion": "At the end of a lane's data: `\"repeat\"` starts its next epoch in a new order, `\"stop\"` "
                      "drops the source from that lane's mix (its share goes to the others).",
        "max_epochs": "With `repeat`: stop after this many epochs.",
        "transforms": "This source's own filters and maps, run after the config's `transforms` "
                      "([Transforms](../guides/transforms.md)).",
    }

    def __post_init__(self) -> None:
        validate_instance(self, ConfigError, "datasets entry")


@dataclass(frozen=True)
class ScheduleEntry:
    """From global step ``step`` on, mix with ``weights`` (one per source, by name)."""

    step: int
    weights: dict[str, float]

    FIELD_RULES: ClassVar[dict[str, Rule]] = {"step": Integer(minimum=0), "weights": Weights()}
    FIELD_DOCS: ClassVar[dict[str, str]] = {
        "step": "The global step from which these weights apply (steps strictly increasing; a step-0 entry "
                "replaces the base weights).",
        "weights": "A table naming every source with its weight (finite, >= 0, at least one > 0).",
    }

    def __post_init__(self) -> None:
        validate_instance(self, ConfigError, "schedule entry")


# StorageOptions fields that LoaderConfig sets from its own top-level fields (the rest are
# the ``storage`` table's), as StorageOptions field -> LoaderConfig field.
STORAGE_TOP_LEVEL = {"cache_dir": "cache_dir", "cache_max_bytes": "cache_max_bytes",
                     "verify_checksums": "verify_checksums", "endpoint": "storage_endpoint"}


def _storage_options_class() -> type:
    return StorageOptions


def _storage_top_level() -> frozenset[str]:
    shared = {f.name for f in fields(_storage_options_class())} & {f.name for f in fields(LoaderConfig)}
    return frozenset(STORAGE_TOP_LEVEL) | shared


@dataclass(frozen=True)
class LoaderConfig:
    """What the loader produces: the datasets and their mix, sequences, batches, packing, workers.

    Build it from a file (:meth:`from_file`, TOML or JSON), a mapping (:meth:`from_dict`) or
    keyword arguments; every field is checked for type and range, and one :class:`ConfigError`
    names every bad field. The fields are listed in the configuration reference.
    """

    datasets: tuple[SourceConfig, ...]
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    seed: int
    tokenizer: str
    packing: str = "concat"
    best_fit_open_bins: int = 8
    # Best fit per window of this many documents of a lane and source (loader.stages.window_packing):
    # seekable, state of cursors only. None: unbounded best fit with best_fit_open_bins.
    packing_window: Optional[int] = None
    # "attention": each global batch's sequences spread over ranks and micro-batches by cost
    # (loader.order.balance); None: rank r gets global indices i = r mod W.
    balance: Optional[str] = None
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
    verify_local_files: bool = False  # sha256 of local lane files on first open
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
    # Transforms of every source, before each dataset's own, and the step
    # from which a change of them takes effect when resuming a checkpoint made with others.
    transforms: tuple[TransformSpec, ...] = ()
    transforms_from_step: Optional[int] = None
    # Image sources: policy, placeholder tokens, overflow, images per sequence. The image kind's
    # table (loader.vision.options.ImagesConfig), registered by the kind (loader.config_tables).
    images: Optional[Any] = None
    # The model family micro-batches are laid out for (loader.model_inputs: "causal_lm",
    # "qwen2_vl"): only that forward's arguments, per-document attention, M-RoPE positions and
    # num_items_in_batch (docs/guides/model-inputs.md). None: the batch_fields as they are.
    model_inputs: Optional[str] = None
    # Finite data: "fill" (every document, fill rows at the tail) or "drop" (end at the first
    # exhausted lane). See EPOCH_TAILS and docs/guides/finite-epochs.md.
    epoch_tail: str = "fill"
    # Documents longer than a best_fit sequence (conversations, pre-tokenized text): OVERLONG_CHOICES.
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
        "packing_window": OrAbsent(Integer(minimum=1, hint="docs/guides/packing-window-and-balance.md recommends 256")),
        "balance": OrAbsent(Text(choices=BALANCE_MODES)),
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
        "images": KindTable("images"),
        "model_inputs": LayoutName(),
        "epoch_tail": Text(choices=EPOCH_TAILS),
        "overlong": Text(choices=OVERLONG_CHOICES),
    }

    # One entry per field: what it means, for the configuration reference (docs/reference/config.md
    # is generated from these, FIELD_RULES and the defaults; a test checks every field has one).
    FIELD_DOCS: ClassVar[dict[str, str]] = {
        "datasets": "The sources to mix, each a table (below: `datasets` entries).",
        "seq_len": "Tokens per sequence.",
        "global_batch_size": "Sequences per optimizer step, all ranks together (`B`). The data-parallel world "
                             "size must divide it.",
        "micro_batch_size": "Sequences per yielded micro-batch; must divide `B / W`.",
        "seed": "Mixing and epoch-permutation seed. There is no default: a run names its seed.",
        "tokenizer": "A Hugging Face `tokenizer.json` (local or `gs://`): tokenizes text sources, gives the "
                     "EOS/BOS ids, and is checked against the fingerprint of pre-tokenized datasets.",
        "packing": "`concat` (documents joined and cut every `seq_len` tokens) or `best_fit` (documents never "
                   "split unless longer than `seq_len`); see [Packing](../guides/packing.md).",
        "best_fit_open_bins": "Open bins per lane and source for `best_fit`.",
        "add_bos": "Put BOS before every document.",
        "add_eos": "Put EOS after every document (`concat` needs one of BOS/EOS as a separator).",
        "eos_token": "EOS token text; default: the first of `<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>` "
                     "the tokenizer knows.",
        "bos_token": "BOS token text; default: the first of `<|begin_of_text|>`, `<s>`, `<bos>` the tokenizer "
                     "knows.",
        "pad_token": "Padding token text; default: the EOS id (labels are -100 on padding either way).",
        "num_workers": "Worker processes per rank (0: produce in the trainer's process).",
        "prefetch": "Messages a worker may have ready ahead of the trainer. Default: about 256 K tokens per "
                    "worker, at least 4 messages (fewer with image sources, whose slots hold pixels). Never "
                    "changes a batch.",
        "mixing_unit": "`sequence`: every packed sequence comes from one source; `token`: documents of all "
                       "sources share sequences ([Mixing](../guides/mixing.md)).",
        "schedule": "Weight changes at given steps, each a table (below: `schedule` entries).",
        "cache_dir": "Local cache of whole, verified copies of remote lane files (absent: ranged reads).",
        "cache_max_bytes": "Size bound of the cache; least recently used entries are evicted.",
        "verify_checksums": "Check the manifest's SHA-256 wherever a file is read whole (remote small files, "
                            "cache fills and cached copies).",
        "verify_local_files": "Check each local lane file's SHA-256 against the manifest once per file and "
                              "process, when first opened. Off by default: it costs CPU in the first epoch, and "
                              "page checksums with the footer and row-count checks catch damaged files without "
                              "it ([Reliability](../guides/reliability.md)).",
        "storage_endpoint": "Explicit GCS endpoint (else `STORAGE_EMULATOR_HOST`, else Google).",
        "storage": "Advanced storage settings: retries, timeouts, read sizes (below: the `storage` table).",
        "worker_timeout_s": "A worker that produces nothing this long raises instead of hanging.",
        "read_ahead": "Read and decode each lane's next row groups on background threads (text is tokenized "
                      "ahead too); `false` reads on demand. Never changes a batch.",
        "read_ahead_threads": "Threads per loader (and per worker process) doing the read-ahead, shared by all "
                              "its lanes and sources; `close()` ends them. Never changes a batch.",
        "batch_fields": "Per-token tensors each micro-batch holds: `input_ids` (required), `labels`, "
                        "`position_ids`, `cu_seqlens`, `token_source_ids` (token mixing only), `loss_mask` "
                        "(sources with a loss mask only). Leave out what the trainer does not use: each costs "
                        "a pass over the micro-batch. Never changes the stream.",
        "step_states_kept": "Step boundaries whose lane states are kept for `state_dict(step=t)` (frameworks "
                            "fetch ahead; the integrations need at least 2).",
        "metrics_log_every_steps": "Log `loader.metrics()` as one INFO line on logger `loader.metrics` every "
                                   "this many steps (0: never). Never changes a batch.",
        "transforms": "Filters and maps of every source, before each dataset's own "
                      "([Transforms](../guides/transforms.md)).",
        "transforms_from_step": "The step from which changed transforms take effect when resuming a checkpoint "
                                "made with others.",
        "images": "Image sources only: policy, placeholder tokens, overflow, images per sequence (below: the "
                  "`images` table; [Images](../guides/images.md)).",
        "packing_window": "With `best_fit`: pack each window of this many documents of a lane by best-fit "
                          "decreasing and flush its bins at the window's end, so a lane's state follows from "
                          "data-independent positions: restores need only cursors and `zephon audit --step N` "
                          "seeks without a checkpoint. Absent: unbounded best fit. 256 keeps >= 0.97x its "
                          "packing efficiency ([Packing windows and balance](../guides/packing-window-and-balance.md)).",
        "balance": "`attention`: assign each global batch's sequences to data-parallel ranks and micro-batches "
                   "by a cost model (sum of squared document lengths plus a linear term; images priced by the "
                   "encoder). The global batch as a set is unchanged; real ranks exchange sequences through "
                   "torch.distributed ([Packing windows and balance](../guides/packing-window-and-balance.md)).",
        "model_inputs": "The Hugging Face model family each micro-batch is laid out for (`causal_lm`, "
                        "`qwen2_vl`): only keys its `forward` takes, per-document attention, and "
                        "`num_items_in_batch`, the loss tokens of the whole optimizer step. Absent: the loader's "
                        "own batch fields ([Model inputs](../guides/model-inputs.md)).",
        "epoch_tail": "Finite data (`exhaustion = \"stop\"` or `max_epochs`): `fill` delivers every document of "
                      "every epoch, lanes that run out first giving fill rows (labels -100, `fill` true) until "
                      "the last lane is done; `drop` ends the stream at the first exhausted lane "
                      "([Finite epochs](../guides/finite-epochs.md)).",
        "overlong": "A document longer than a `best_fit` sequence: `refuse` (the loader refuses a chat dataset "
                    "whose recorded longest conversation does not fit; a text document is cut into `seq_len` "
                    "pieces, as best fit always did), `drop` (counted) or `truncate` (a conversation after its last "
                    "assistant turn that fits, pre-tokenized text to the fit), chat identical offline and online "
                    "([Finite epochs](../guides/finite-epochs.md#documents-longer-than-a-sequence-overlong)).",
    }

    def __post_init__(self) -> None:
        # Every field's type and range (loader.validation), then the checks across fields.
        validate_instance(self, ConfigError, "loader config")
        problems = self._cross_field_problems()
        if problems:
            fail(ConfigError, "loader config", problems)

    def storage_options(self):
        """The :class:`loader.io.storage.StorageOptions` for every read (manifest, tokenizer, lanes)."""
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
        problems.extend(self._window_problems())
        names = [d.name for d in self.datasets if d.name is not None]
        if len(names) != len(set(names)):
            problems.append(f"datasets: source names must be unique (got {names})")
        if sum(d.weight for d in self.datasets) <= 0:
            problems.append("datasets: at least one weight must be > 0")
        missing = missing_fields(self.model_inputs, self.batch_fields)
        if missing:
            problems.append(f"model_inputs = {self.model_inputs!r} reads batch fields {missing}, which batch_fields "
                            f"{list(self.batch_fields)} leaves out; add them (or leave batch_fields at its default)")
        last = -1
        for entry in self.schedule:
            if entry.step <= last:
                problems.append(f"schedule: steps must be strictly increasing (got {entry.step} after {last})")
            last = entry.step
        return problems

    def _window_problems(self) -> list[str]:
        """What ``packing_window`` cannot be combined with (loader.stages.window_packing)."""
        if self.packing_window is None:
            return []
        problems = []
        if self.packing != "best_fit":
            problems.append(f"packing_window = {self.packing_window} needs packing = \"best_fit\" (got packing = "
                            f"{self.packing!r}; concat packing is seekable already): set packing = \"best_fit\" "
                            "or remove packing_window")
        if self.mixing_unit == "token" and len(self.datasets) > 1:
            problems.append(f"packing_window = {self.packing_window} with mixing_unit = \"token\": a window of "
                            "one source's documents is not defined under token mixing; use mixing_unit = "
                            "\"sequence\" or remove packing_window")
        if self.images is not None and self.images.max_images_per_sequence is not None:
            problems.append(f"packing_window = {self.packing_window} with images.max_images_per_sequence = "
                            f"{self.images.max_images_per_sequence}: a window's bins are a function of lengths "
                            "alone, an image cap would make them depend on image counts; remove one of the two")
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
        return dataclasses.replace(self, **changes)

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
            # New options enter only when set, so configs without them keep their fingerprints.
            **({"packing_window": self.packing_window} if self.packing_window is not None else {}),
            **({"balance": self.balance} if self.balance is not None else {}),
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
    if is_remote(path) or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))

