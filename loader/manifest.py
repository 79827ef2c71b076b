"""The dataset manifest: the contract between the Beam job and the loader.

A lane-sharded dataset is a directory (local or ``gs://``)::

    <dataset>/manifest.json                    written last and atomically: the commit marker
    <dataset>/lane=00017/part-00003.parquet    lane 17, order-key bucket 3
    <dataset>/_rejected/rejected-00000.jsonl   bad input records, with file, index, reason

A directory without ``manifest.json`` is not a dataset and nothing reads it as one.

Lane file schema (Parquet, zstd, page checksums on, no wall-clock metadata):

=============  ================  ==========================================================
column         type              meaning
=============  ================  ==========================================================
key            string            the document key (``--id-field`` value, or path#index)
order_key      uint64            ``order_key_of(seed, key)``; rows are sorted by it
text           string            the document text
input_ids      binary            only when pre-tokenized: ``tokenizers`` ids of ``text`` as
                                 little-endian int32 bytes (``np.frombuffer(v, "<i4")``);
                                 the loader also reads ``list<int32>`` (older datasets)
num_tokens     int32             only when pre-tokenized: the number of ids in ``input_ids``
<kept field>   string            each ``--keep-fields`` value, JSON-encoded
=============  ================  ==========================================================

Concatenating a lane's part files in ``part`` order gives the lane in order-key order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from loader.errors import ZephonError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
REJECTED_DIR = "_rejected"
LANE_DIR_FORMAT = "lane={lane:05d}"
PART_FORMAT = "part-{part:05d}.parquet"

# The rejection reasons the Beam job can emit (manifest ``rejected`` keys).
REJECT_REASONS = (
    "malformed_json",
    "missing_text_field",
    "non_string_text",
    "invalid_utf8",
    "empty_text",
    "missing_id_field",
    "unreadable_file",
)


class ManifestError(ZephonError, ValueError):
    """A manifest that is missing, malformed, or does not match what it is used with."""


def lane_file_path(lane_id: int, part: int) -> str:
    """Relative path of a lane part file inside the dataset directory."""
    return f"{LANE_DIR_FORMAT.format(lane=lane_id)}/{PART_FORMAT.format(part=part)}"


@dataclass(frozen=True)
class FileEntry:
    """One lane part file. ``path`` is relative to the dataset directory."""

    path: str
    lane: int
    part: int
    rows: int
    bytes: int
    sha256: str
    tokens: Optional[int] = None  # only for pre-tokenized datasets
    row_groups: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "FileEntry":
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected an object, got {type(data).__name__}")
        problems = []
        expected = {"path": str, "lane": int, "part": int, "rows": int, "bytes": int, "sha256": str}
        for name, typ in expected.items():
            if name not in data:
                problems.append(f"missing field '{name}'")
            elif not isinstance(data[name], typ) or isinstance(data[name], bool):
                problems.append(f"field '{name}' must be {typ.__name__} (got {data[name]!r})")
        tokens = data.get("tokens")
        if tokens is not None and not isinstance(tokens, int):
            problems.append(f"field 'tokens' must be int or null (got {tokens!r})")
        if problems:
            raise ManifestError(f"{where}: " + "; ".join(problems))
        return cls(
            path=data["path"],
            lane=data["lane"],
            part=data["part"],
            rows=data["rows"],
            bytes=data["bytes"],
            sha256=data["sha256"],
            tokens=tokens,
            row_groups=int(data.get("row_groups", 0)),
        )


@dataclass(frozen=True)
class Manifest:
    """Everything the loader needs to know about a dataset, and nothing machine-specific."""

    seed: int
    num_lanes: int
    source_name: str
    schema: list[dict[str, str]]  # [{"name": ..., "type": ...}] in column order
    files: list[FileEntry]
    documents: int
    rejected: dict[str, int] = field(default_factory=dict)
    tokenizer: Optional[dict[str, Any]] = None  # {"fingerprint": ..., "vocab_size": ...} if pre-tokenized
    files_per_lane: int = 1
    format_version: int = FORMAT_VERSION
    dataset_fingerprint: str = ""

    # -- derived views -------------------------------------------------------------------
    @property
    def pretokenized(self) -> bool:
        return self.tokenizer is not None

    @property
    def total_tokens(self) -> Optional[int]:
        if not self.pretokenized:
            return None
        return sum(f.tokens or 0 for f in self.files)

    def lane_files(self, lane_id: int) -> list[FileEntry]:
        """The lane's part files in part order (the lane's order-key order)."""
        return sorted((f for f in self.files if f.lane == lane_id), key=lambda f: f.part)

    def compute_fingerprint(self) -> str:
        """SHA-256 over content entries only: no paths of the writing machine, no times."""
        content = {
            "format_version": self.format_version,
            "seed": self.seed,
            "num_lanes": self.num_lanes,
            "schema": self.schema,
            "tokenizer_fingerprint": (self.tokenizer or {}).get("fingerprint"),
            "files": sorted(
                [f.path, f.rows, f.tokens, f.sha256] for f in self.files
            ),
        }
        blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def with_fingerprint(self) -> "Manifest":
        from dataclasses import replace

        return replace(self, dataset_fingerprint=self.compute_fingerprint())

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "dataset_fingerprint": self.dataset_fingerprint or self.compute_fingerprint(),
            "seed": self.seed,
            "num_lanes": self.num_lanes,
            "files_per_lane": self.files_per_lane,
            "source_name": self.source_name,
            "schema": self.schema,
            "tokenizer": self.tokenizer,
            "documents": self.documents,
            "rejected": dict(sorted(self.rejected.items())),
            "files": [f.to_dict() for f in sorted(self.files, key=lambda f: (f.lane, f.part))],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, where: str = MANIFEST_NAME) -> "Manifest":
        """Parse and validate; every problem found is reported in one error."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a JSON object at the top level")
        problems: list[str] = []
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"{where}: format_version {version!r} is not supported by this Zephon "
                f"(supports {FORMAT_VERSION}); re-shard the data with this version's Beam job."
            )
        for name, typ in (("seed", int), ("num_lanes", int), ("source_name", str),
                          ("schema", list), ("files", list), ("documents", int)):
            if name not in data:
                problems.append(f"missing field '{name}'")
            elif not isinstance(data[name], typ) or isinstance(data[name], bool):
                problems.append(f"field '{name}' must be {typ.__name__} (got {data[name]!r:.80})")
        if problems:
            raise ManifestError(f"{where}: " + "; ".join(problems))
        files = [FileEntry.from_dict(f, f"{where}: files[{k}]") for k, f in enumerate(data["files"])]
        num_lanes = data["num_lanes"]
        for entry in files:
            if not 0 <= entry.lane < num_lanes:
                problems.append(f"file {entry.path} has lane {entry.lane} outside [0, {num_lanes})")
        if problems:
            raise ManifestError(f"{where}: " + "; ".join(problems))
        manifest = cls(
            seed=data["seed"],
            num_lanes=num_lanes,
            source_name=data["source_name"],
            schema=data["schema"],
            files=files,
            documents=data["documents"],
            rejected=dict(data.get("rejected") or {}),
            tokenizer=data.get("tokenizer"),
            files_per_lane=int(data.get("files_per_lane", 1)),
            format_version=version,
            dataset_fingerprint=data.get("dataset_fingerprint", ""),
        )
        recorded = manifest.dataset_fingerprint
        actual = manifest.compute_fingerprint()
        if recorded and recorded != actual:
            raise ManifestError(
                f"{where}: dataset_fingerprint {recorded[:16]}... does not match its content "
                f"({actual[:16]}...): the manifest was edited or is corrupt; re-run the Beam job."
            )
        return manifest

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_NAME) -> "Manifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, where)


def read_manifest(dataset_path: str, storage_options=None) -> Manifest:
    """Load ``<dataset_path>/manifest.json`` (local path or ``gs://``, read with ``storage_options``)."""
    from loader import storage

    location = storage.join(dataset_path, MANIFEST_NAME)
    if not storage.exists(location, storage_options):
        raise ManifestError(
            f"{location} does not exist: {dataset_path} is not a Zephon dataset "
            "(the Beam job writes the manifest last; an interrupted job leaves none). "
            "Run `zephon shard ... --output DATASET` to create one."
        )
    return Manifest.from_json(storage.read_bytes(location, storage_options).decode("utf-8"), location)
