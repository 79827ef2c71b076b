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
from typing import Any, Optional

from loader.errors import ZephonError

PACKING_MODES = ("concat", "best_fit")
MIXING_UNITS = ("sequence", "token")
EXHAUSTION_POLICIES = ("repeat", "stop")
# Per-token tensors a micro-batch can hold. ``input_ids`` is always there; the rest cost the
# batch builder a pass over the batch each, so a trainer that derives them itself (or does
# not use them) can leave them out. Per-sequence entries (source_ids, global_indices, step,
# micro_step) are always there.
BATCH_FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "token_source_ids")


class ConfigError(ZephonError, ValueError):
    """A loader configuration value that cannot work; the message names the field."""


@dataclass(frozen=True)
class SourceConfig:
    """One lane-sharded dataset in the mix."""

    path: str
    weight: float = 1.0
    name: Optional[str] = None  # defaults to the manifest's source_name
    exhaustion: str = "repeat"  # "repeat": next epoch (reshuffled); "stop": drop out of the mix
    max_epochs: Optional[int] = None  # with "repeat": stop after this many epochs

    def __post_init__(self) -> None:
        where = f"datasets entry {self.path!r}"
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"datasets: every entry needs a non-empty 'path' (got {self.path!r})")
        if not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool) or self.weight < 0:
            raise ConfigError(f"{where}: 'weight' must be a number >= 0 (got {self.weight!r})")
        if self.exhaustion not in EXHAUSTION_POLICIES:
            raise ConfigError(
                f"{where}: 'exhaustion' must be one of {EXHAUSTION_POLICIES} (got {self.exhaustion!r})"
            )
        if self.max_epochs is not None and (not isinstance(self.max_epochs, int) or self.max_epochs <= 0):
            raise ConfigError(f"{where}: 'max_epochs' must be a positive integer or absent (got {self.max_epochs!r})")


@dataclass(frozen=True)
class ScheduleEntry:
    """From global step ``step`` on, mix with ``weights`` (one per source, by name)."""

    step: int
    weights: dict[str, float]


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
    prefetch: int = 4
    mixing_unit: str = "sequence"
    schedule: tuple[ScheduleEntry, ...] = ()
    cache_dir: Optional[str] = None
    cache_max_bytes: int = 10 * 1024**3
    verify_checksums: bool = True
    storage_endpoint: Optional[str] = None
    storage: dict[str, Any] = field(default_factory=dict)  # advanced StorageOptions: retries, timeouts, read-ahead
    worker_timeout_s: float = 300.0
    read_ahead: bool = True
    read_ahead_threads: int = 2
    batch_fields: tuple[str, ...] = BATCH_FIELDS
    # Step boundaries whose lane states are kept for state_dict(step=t) (frameworks fetch ahead).
    step_states_kept: int = 4

    def __post_init__(self) -> None:
        datasets = tuple(
            d if isinstance(d, SourceConfig) else SourceConfig(**_only_known(SourceConfig, d, "datasets entry"))
            for d in (self.datasets or ())
        )
        object.__setattr__(self, "datasets", datasets)
        schedule = tuple(
            s if isinstance(s, ScheduleEntry) else ScheduleEntry(step=int(s["step"]), weights=dict(s["weights"]))
            for s in (self.schedule or ())
        )
        object.__setattr__(self, "schedule", schedule)
        if isinstance(self.batch_fields, (list, tuple)):
            object.__setattr__(self, "batch_fields", tuple(self.batch_fields))
        self._validate()

    def storage_options(self):
        """The :class:`loader.storage.StorageOptions` for every read (manifest, tokenizer, lanes)."""
        from loader.storage import StorageOptions

        top_level = {"cache_dir", "cache_max_bytes", "verify_checksums", "endpoint"}
        allowed = sorted({f.name for f in fields(StorageOptions)} - top_level)
        unknown = sorted(set(self.storage) - set(allowed))
        if unknown:
            raise ConfigError(
                f"storage: unknown field(s) {unknown}; valid: {allowed} (cache_dir, cache_max_bytes, "
                "verify_checksums and storage_endpoint are top-level fields)"
            )
        try:
            return StorageOptions(
                cache_dir=self.cache_dir, cache_max_bytes=self.cache_max_bytes,
                verify_checksums=self.verify_checksums, endpoint=self.storage_endpoint, **self.storage,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def _validate(self) -> None:
        if not self.datasets:
            raise ConfigError("datasets: at least one dataset is needed, e.g. datasets = [{path = \"data/web\"}]")
        for name in ("seq_len", "global_batch_size", "micro_batch_size", "best_fit_open_bins"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer (got {name}={value!r})")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0; there is no default seed (got seed={self.seed!r})")
        if self.packing not in PACKING_MODES:
            raise ConfigError(f"packing must be one of {PACKING_MODES} (got packing={self.packing!r})")
        if self.mixing_unit not in MIXING_UNITS:
            raise ConfigError(f"mixing_unit must be one of {MIXING_UNITS} (got mixing_unit={self.mixing_unit!r})")
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ConfigError(f"num_workers must be an integer >= 0 (got num_workers={self.num_workers!r})")
        if not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ConfigError(f"prefetch must be an integer >= 1 (got prefetch={self.prefetch!r})")
        if not isinstance(self.step_states_kept, int) or isinstance(self.step_states_kept, bool) \
                or self.step_states_kept < 0:
            raise ConfigError(f"step_states_kept must be an integer >= 0 (got step_states_kept={self.step_states_kept!r})")
        if not isinstance(self.read_ahead, bool):
            raise ConfigError(f"read_ahead must be true or false (got read_ahead={self.read_ahead!r})")
        if not isinstance(self.read_ahead_threads, int) or isinstance(self.read_ahead_threads, bool) \
                or self.read_ahead_threads < 1:
            raise ConfigError(f"read_ahead_threads must be an integer >= 1 (got read_ahead_threads="
                              f"{self.read_ahead_threads!r}); set read_ahead = false to read on demand")
        if (not isinstance(self.batch_fields, tuple) or "input_ids" not in self.batch_fields
                or not set(self.batch_fields) <= set(BATCH_FIELDS)):
            unknown = sorted(set(self.batch_fields) - set(BATCH_FIELDS)) if isinstance(self.batch_fields, tuple) else []
            raise ConfigError(
                f"batch_fields must be a list of names from {list(BATCH_FIELDS)} that includes 'input_ids' "
                f"(got batch_fields={self.batch_fields!r}" + (f"; unknown: {unknown})" if unknown else ")")
            )
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError("tokenizer: path to a tokenizer.json is required (it also names the EOS/BOS ids)")
        if not (self.add_eos or self.add_bos) and self.packing == "concat":
            raise ConfigError(
                "concat packing needs a document separator: set add_eos = true (recommended) or add_bos = true"
            )
        names = [d.name for d in self.datasets if d.name is not None]
        if len(names) != len(set(names)):
            raise ConfigError(f"datasets: source names must be unique (got {names})")
        if sum(d.weight for d in self.datasets) <= 0:
            raise ConfigError("datasets: at least one weight must be > 0")
        self.storage_options()
        last = -1
        for entry in self.schedule:
            if entry.step <= last:
                raise ConfigError(f"schedule: steps must be strictly increasing (got {entry.step} after {last})")
            last = entry.step

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> "LoaderConfig":
        data = dict(data)
        if "loader" in data and isinstance(data["loader"], dict):  # allow a [loader] table
            data = {**data.pop("loader"), **data}
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(
                f"{where}: unknown field(s) {unknown}; valid fields: {sorted(f.name for f in fields(cls))}"
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"{where}: {exc}") from exc

    @classmethod
    def from_file(cls, path: str, **overrides: Any) -> "LoaderConfig":
        """Load a ``.toml`` or ``.json`` file; relative dataset/tokenizer paths are relative to it."""
        with open(path, "rb") as fh:
            raw = fh.read()
        try:
            data = tomllib.loads(raw.decode()) if path.endswith(".toml") else json.loads(raw)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot parse ({exc})") from exc
        base = os.path.dirname(os.path.abspath(path))
        for entry in data.get("datasets", []):
            if isinstance(entry, dict) and "path" in entry:
                entry["path"] = _resolve(base, entry["path"])
        for key in ("tokenizer", "cache_dir"):
            if isinstance(data.get(key), str):
                data[key] = _resolve(base, data[key])
        data.update(overrides)
        return cls.from_dict(data, where=path)

    def replace(self, **changes: Any) -> "LoaderConfig":
        from dataclasses import replace

        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def stream_fields(self) -> dict[str, Any]:
        """The fields that determine the global stream (not how it is computed)."""
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "packing": self.packing,
            "best_fit_open_bins": self.best_fit_open_bins if self.packing == "best_fit" else None,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "mixing_unit": self.mixing_unit if len(self.datasets) > 1 else None,
        }

    def fingerprint(self) -> str:
        blob = json.dumps(self.stream_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def _resolve(base: str, path: str) -> str:
    if path.startswith("gs://") or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base, path))


def _only_known(cls, data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table/object, got {data!r}")
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; valid: {[f.name for f in fields(cls)]}")
    return data
