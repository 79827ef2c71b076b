"""The dataset manifest: the contract between the Beam job and the loader.

A lane-sharded dataset is a directory (local, ``gs://`` or ``s3://``)::

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
loss_mask      binary            optional, pre-tokenized only: one byte (0 or 1) per id of
                                 ``input_ids``, 1 where the token is a training target (chat /
                                 SFT); ``labels`` are -100 where it is 0 and micro-batches hold
                                 it as ``loss_mask`` (``list<uint8>`` is read too). A per-token
                                 feature of ``loader.stages.features``: its presence in ``schema`` is
                                 what makes the loader read it
conversation   string            only for chat data tokenized online (``--messages-field``
                                 without ``--tokenizer``): the validated conversation as
                                 compact JSON, ``{"messages": [...], "tools": [...]}``
                                 (``tools`` only when the record has them; keys in the
                                 record's order, ``null`` values of messages dropped, non-
                                 ASCII kept). ``text`` holds its plain render. The loader
                                 renders, tokenizes and masks it with the manifest's ``chat``
dropped_by     int16             only with ``--transform``: -1 for a document, else the
                                 position in the manifest's ``transforms`` of the transform
                                 that dropped it (a *tombstone*: key, order key, empty text,
                                 no tokens, null kept fields); the loader skips it as it
                                 skips a document dropped online, and ``documents`` +
                                 ``tombstones`` is the sum of the files' ``rows``
<kept field>   string            each ``--keep-fields`` value, JSON-encoded
=============  ================  ==========================================================

Image datasets (``--image-field``, or WebDataset input; docs/guides/images.md)
add these columns after ``text`` (and before kept fields); ``text`` then holds the
document's text segments concatenated, nothing inserted between them. Element ``k`` of each
``image_*`` list is the document's ``k``-th image:

===================  =============  ===================================================
column               type           meaning
===================  =============  ===================================================
segments             list<int32>    the document in order: an entry ``e >= 0`` is a text
                                    segment ending at UTF-8 byte ``e`` of ``text`` (starting
                                    where the previous one ended), ``-1`` is the next image
                                    (``loader.vision.segments.decode_segments``)
num_images           int32          images in the document (the ``-1`` entries)
image_bytes          list<binary>   each image's encoded bytes exactly as read (no
                                    re-encoding; stored without a Parquet codec)
image_format         list<string>   ``JPEG``, ``PNG`` or ``WEBP`` (sniffed and decoded)
image_width          list<int32>    width as stored (EXIF orientation not applied)
image_height         list<int32>    height as stored
image_sha256         list<string>   hex SHA-256 of ``image_bytes``
image_visual_tokens  list<int32>    only when the job had ``--image-policy``: each image's
                                    visual tokens under the manifest's ``images.policy``
===================  =============  ===================================================

They record ``images`` in the manifest (:class:`loader.vision.record.ImagesRecord`): the
number of images, the limits every image was checked against and the image-processing
policy of ``image_visual_tokens`` with its fingerprint (or nulls). It is part of the dataset
fingerprint; text datasets have no ``images`` entry and keep their manifests and fingerprints.

Chat datasets (``--messages-field``) record ``chat`` in the manifest (:class:`loader.chat.record.ChatRecord`): the
messages field, whether the lanes are tokenized (``input_ids`` + ``loss_mask``) or hold
conversations, ``loss_on``, ``max_tokens``, ``overflow``, the template's fingerprint and, for
online data, the template itself (its Jinja sources, special tokens, variables, name), so that
the loader renders with exactly what the job validated. ``chat`` (all but ``template_origin``,
a path of the writing machine) is part of the dataset fingerprint: a dataset re-sharded with
another template or option is another dataset, and a checkpoint of the old one is refused.

Pre-tokenized text datasets record ``longest_tokens``, their longest document in tokens (tokenized
chat records it as ``chat.longest_tokens``), so that the loader knows exactly whether every
document fits a ``best_fit`` sequence (``loader.overlong``). Both are statistics of the lane
files, outside the dataset fingerprint; a manifest without them (sharded before they were
recorded) reads as before, and ``zephon record-longest`` adds them from the lane files.

Concatenating a lane's part files in ``part`` order gives the lane in order-key order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from loader.errors import ManifestError
from loader.io import storage
from loader.io.names import CONVERSATION_COLUMN, DOCUMENT_REJECT_REASONS, TOMBSTONE_COLUMN  # noqa: F401  (also importable from here)
from loader.io.storage_options import SHA256_HEX
from loader.kinds.base import manifest_entries

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
REJECTED_DIR = "_rejected"
LANE_DIR_FORMAT = "lane={lane:05d}"
PART_FORMAT = "part-{part:05d}.parquet"



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
        """Parse one ``files[k]`` entry; every problem of the entry is reported in one error."""
        problems = cls.type_problems(data) or cls.value_problems(data)
        if problems:
            raise ManifestError(f"{where}: " + "; ".join(problems))
        return cls._of(data)

    @classmethod
    def _of(cls, data: dict) -> "FileEntry":
        """The entry of a dict without ``type_problems`` (its values unchecked)."""
        return cls(path=data["path"], lane=data["lane"], part=data["part"], rows=data["rows"],
                   bytes=data["bytes"], sha256=data["sha256"], tokens=data.get("tokens"),
                   row_groups=data.get("row_groups", 0))

    @staticmethod
    def type_problems(data: Any) -> list[str]:
        """Missing fields and wrong types of one entry."""
        if not isinstance(data, dict):
            return [f"expected an object, got {type(data).__name__}"]
        problems = []
        expected = {"path": str, "lane": int, "part": int, "rows": int, "bytes": int, "sha256": str}
        for name, typ in expected.items():
            if name not in data:
                problems.append(f"missing field '{name}'")
            elif not isinstance(data[name], typ) or isinstance(data[name], bool):
                problems.append(f"field '{name}' must be {typ.__name__} (got {data[name]!r:.80})")
        tokens = data.get("tokens")
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool)):
            problems.append(f"field 'tokens' must be an int or null (got {tokens!r:.80})")
        row_groups = data.get("row_groups", 0)
        if not isinstance(row_groups, int) or isinstance(row_groups, bool):
            problems.append(f"field 'row_groups' must be an int (got {row_groups!r:.80})")
        return problems

    @staticmethod
    def value_problems(data: dict) -> list[str]:
        """What is wrong with the values of one well-typed entry on its own (the manifest
        checks the entries together).

        ``rows >= 1``: the Beam job writes no file for an empty bucket (``lane_files``), so an
        entry without rows was edited in, and the loader would drop it. ``path`` must be the
        canonical ``lane_file_path(lane, part)``: the dataset fingerprint covers the path, so
        this is what makes it cover ``lane`` and ``part`` too (see ``compute_fingerprint``).
        """
        problems = []
        for name in ("tokens", "row_groups"):
            if (data.get(name) or 0) < 0:
                problems.append(f"field '{name}' must be >= 0 (got {data[name]})")
        for name, low in (("lane", 0), ("part", 0), ("rows", 1), ("bytes", 0)):
            if data[name] < low:
                problems.append(f"field '{name}' must be >= {low} (got {data[name]})")
        if not SHA256_HEX.fullmatch(data["sha256"]):
            problems.append(f"field 'sha256' must be 64 lowercase hex digits (got {data['sha256']!r:.80})")
        if data["lane"] >= 0 and data["part"] >= 0:
            canonical = lane_file_path(data["lane"], data["part"])
            if data["path"] != canonical:
                problems.append(f"path {data['path']!r} is not the path of lane {data['lane']}, part "
                                f"{data['part']} ({canonical!r})")
        return problems


LANE_ASSIGNMENTS = ("balanced",)  # the manifest's lane_assignment values (absent: by hash)


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
    # Entries a kind adds (loader.kinds: parsed by the kind's registered ManifestEntry):
    chat: Optional[Any] = None  # chat datasets: a loader.chat.record.ChatRecord (module docstring)
    images: Optional[Any] = None  # image datasets: a loader.vision.record.ImagesRecord (module docstring)
    tombstones: int = 0  # rows of documents dropped by --transform (schema has TOMBSTONE_COLUMN)
    # The "transforms" entry (spec and counts per --transform) a tombstone's dropped_by points into;
    # kept (and written by to_dict) only for datasets with tombstones.
    transforms: tuple[dict, ...] = ()
    # How documents were dealt to lanes: None (``H(seed, key) mod L``, every dataset before the
    # entry) or "balanced" (``zephon shard --lane-balance documents``: the document of rank r in
    # hash order goes to lane r mod L, so lane sizes differ by at most one; beam_jobs.lane_balance).
    # In the fingerprint only when present. The loader reads lanes alike either way.
    lane_assignment: Optional[str] = None
    # The lane kind of a dataset of a named (non-built-in) kind (loader.kinds.base.LaneKind.named,
    # ``zephon shard --kind NAME``): the loader decodes its lanes with the kind registered under
    # that name. Absent for every built-in kind, and in the fingerprint only when present.
    kind: Optional[str] = None
    # Tokens of the longest document of a pre-tokenized text dataset (chat datasets record theirs
    # as ``chat.longest_tokens``): with it the loader knows whether every document fits one
    # best_fit sequence (loader.overlong). A statistic of the lane files, which the fingerprint
    # covers already (their SHA-256s), so it is outside the fingerprint: a dataset sharded before
    # the entry keeps its fingerprint, and ``zephon record-longest`` adds it without re-sharding.
    longest_tokens: Optional[int] = None

    # -- derived views -------------------------------------------------------------------
    @property
    def pretokenized(self) -> bool:
        return self.tokenizer is not None

    @property
    def tombstone_transforms(self) -> tuple[str, ...]:
        """The functions of the ``--transform`` list, in the order ``dropped_by`` counts them."""
        return tuple(t["function"] for t in self.transforms)

    @property
    def has_tombstones(self) -> bool:
        """The lane files hold a ``dropped_by`` column (sharded with ``--transform``)."""
        return any(c.get("name") == TOMBSTONE_COLUMN for c in self.schema)

    @property
    def online_chat(self) -> bool:
        """The lanes hold conversations, rendered and tokenized by the loader."""
        return self.chat is not None and not self.chat.tokenized

    @property
    def total_tokens(self) -> Optional[int]:
        if not self.pretokenized:
            return None
        return sum(f.tokens or 0 for f in self.files)

    def lane_files(self, lane_id: int) -> list[FileEntry]:
        """The lane's part files in part order (the lane's order-key order)."""
        return sorted((f for f in self.files if f.lane == lane_id), key=lambda f: f.part)

    def compute_fingerprint(self) -> str:
        """SHA-256 over content entries only: no paths of the writing machine, no times.

        Unchanged since format version 1 (changing it would change every dataset's
        fingerprint). Every field the loader uses to order or read data is covered, directly
        or through a check on load: ``lane`` and ``part`` through ``path``, which
        :meth:`from_dict` requires to be ``lane_file_path(lane, part)``; ``row_groups`` and
        ``rows`` (covered) are checked against each file's Parquet footer when it is opened,
        and every row group read against the footer (:mod:`loader.io.lane_reader`); ``bytes``
        against the file's size. ``documents`` must be the sum of ``rows``. The manifest's
        ``seed`` is covered but not used to read (the loader's config has its own).
        """
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
        if self.chat is not None:  # only then: every other dataset keeps its fingerprint
            content["chat"] = self.chat.fingerprint_content()
        if self.images is not None:  # likewise
            content["images"] = self.images.to_dict()
        if self.lane_assignment is not None:  # likewise
            content["lane_assignment"] = self.lane_assignment
        if self.kind is not None:  # likewise
            content["kind"] = self.kind
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
            **({"tombstones": self.tombstones, "transforms": [dict(t) for t in self.transforms]}
               if self.has_tombstones else {}),
            "rejected": dict(sorted(self.rejected.items())),
            "files": [f.to_dict() for f in sorted(self.files, key=lambda f: (f.lane, f.part))],
            **({"chat": self.chat.to_dict()} if self.chat is not None else {}),
            **({"images": self.images.to_dict()} if self.images is not None else {}),
            **({"lane_assignment": self.lane_assignment} if self.lane_assignment is not None else {}),
            **({"kind": self.kind} if self.kind is not None else {}),
            **({"longest_tokens": self.longest_tokens} if self.longest_tokens is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, where: str = MANIFEST_NAME) -> "Manifest":
        """Parse and validate; every problem found is reported in one error.

        Besides types and the fingerprint, the structure is checked (what the Beam job
        always writes): each entry's path is its lane and part's canonical path, no path or
        (lane, part) is listed twice, lanes lie in ``[0, num_lanes)``, ``rows >= 1``,
        ``documents`` is the sum of the rows, and ``tokens`` is set exactly when the dataset
        is pre-tokenized. A lane may hold no file (fewer documents than lanes); the loader
        refuses such a lane when it reads it.
        """
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
        for name, typ in (("tokenizer", dict), ("rejected", dict)):
            if data.get(name) is not None and not isinstance(data[name], typ):
                problems.append(f"field '{name}' must be {typ.__name__} or absent (got {data[name]!r:.80})")
        # Required: without it an edited manifest would skip the comparison below.
        if not isinstance(data.get("dataset_fingerprint"), str) or not SHA256_HEX.fullmatch(data["dataset_fingerprint"]):
            problems.append("field 'dataset_fingerprint' must be 64 lowercase hex digits (got "
                            f"{data.get('dataset_fingerprint', '<missing>')!r:.80})")
        files_per_lane = data.get("files_per_lane", 1)
        if not isinstance(files_per_lane, int) or isinstance(files_per_lane, bool) or files_per_lane < 1:
            problems.append(f"field 'files_per_lane' must be an int >= 1 (got {files_per_lane!r:.80})")
        # The entries a kind adds (chat's "chat", images' "images"): parsed by the kind that owns them.
        entries: dict[str, Any] = {}
        for entry in manifest_entries():
            record = None
            if data.get(entry.key) is not None:
                try:
                    record = entry.parse(data[entry.key])
                except ManifestError as exc:
                    problems.append(str(exc))
                else:
                    problems += entry.check(record, data) if entry.check is not None else []
            entries[entry.key] = record
        if data.get("lane_assignment") not in (None,) + LANE_ASSIGNMENTS:
            problems.append(f"field 'lane_assignment' must be absent or one of {list(LANE_ASSIGNMENTS)} "
                            f"(got {data['lane_assignment']!r:.80})")
        if "kind" in data and (not isinstance(data["kind"], str) or not data["kind"]):
            problems.append(f"field 'kind' must be absent or a lane kind's name (got {data['kind']!r:.80})")
        elif "kind" in data and (data.get("tokenizer") is not None or any(data.get(e.key) is not None
                                                                         for e in manifest_entries())):
            problems.append(f"field 'kind' ({data['kind']!r}) names a lane kind of its own, so the dataset can "
                            "have no 'tokenizer' nor any kind's entry (" + ", ".join(e.key for e in manifest_entries()) + ")")
        longest = data.get("longest_tokens")
        if longest is not None and (not isinstance(longest, int) or isinstance(longest, bool) or longest < 1):
            problems.append(f"field 'longest_tokens' must be a positive int or absent (got {longest!r:.80})")
        elif longest is not None and (data.get("tokenizer") is None or data.get("chat") is not None):
            problems.append("field 'longest_tokens' belongs to a pre-tokenized text dataset (a 'tokenizer' and no "
                            "'chat' entry; chat records chat.longest_tokens)")
        if problems:
            raise ManifestError(f"{where}: " + "; ".join(problems))
        num_lanes = data["num_lanes"]
        if num_lanes < 1:
            problems.append(f"field 'num_lanes' must be >= 1 (got {num_lanes})")
        pretokenized = data.get("tokenizer") is not None
        files: list[FileEntry] = []
        first_of_path: dict[str, int] = {}
        first_of_lane_part: dict[tuple[int, int], int] = {}
        for k, raw in enumerate(data["files"]):
            name = f"files[{k}]" + (f" ({raw['path']})" if isinstance(raw, dict) and isinstance(raw.get("path"), str) else "")
            type_problems = FileEntry.type_problems(raw)
            if type_problems:
                problems.extend(f"{name}: {p}" for p in type_problems)
                continue
            problems.extend(f"{name}: {p}" for p in FileEntry.value_problems(raw))
            entry = FileEntry._of(raw)
            files.append(entry)
            if not entry.lane < num_lanes:
                problems.append(f"{name}: lane {entry.lane} is outside [0, {num_lanes}) (num_lanes)")
            if pretokenized and entry.tokens is None:
                problems.append(f"{name}: field 'tokens' is missing; a pre-tokenized dataset records each file's tokens")
            if not pretokenized and entry.tokens is not None:
                problems.append(f"{name}: field 'tokens' is set ({entry.tokens}) but the dataset is not "
                                "pre-tokenized (no 'tokenizer')")
            if entry.path in first_of_path:
                problems.append(f"{name}: duplicates files[{first_of_path[entry.path]}] (same path)")
            elif (entry.lane, entry.part) in first_of_lane_part:
                problems.append(f"{name}: duplicates files[{first_of_lane_part[entry.lane, entry.part]}] "
                                f"(same lane {entry.lane} and part {entry.part})")
            first_of_path.setdefault(entry.path, k)
            first_of_lane_part.setdefault((entry.lane, entry.part), k)
        tombstones, tombstone_transforms = _tombstones_of(data, problems)
        if len(files) == len(data["files"]) and data["documents"] + tombstones != sum(f.rows for f in files):
            problems.append(f"field 'documents' is {data['documents']}" +
                            (f" and 'tombstones' {tombstones}" if tombstones else "") +
                            f" but the files hold {sum(f.rows for f in files)} rows")
        manifest = None
        if len(files) == len(data["files"]):  # the fingerprint needs every entry parsed
            manifest = cls(
                seed=data["seed"],
                num_lanes=num_lanes,
                source_name=data["source_name"],
                schema=data["schema"],
                files=files,
                documents=data["documents"],
                rejected=dict(data.get("rejected") or {}),
                tokenizer=data.get("tokenizer"),
                files_per_lane=files_per_lane,
                format_version=version,
                dataset_fingerprint=data["dataset_fingerprint"],
                **entries,
                tombstones=tombstones,
                transforms=tombstone_transforms,
                lane_assignment=data.get("lane_assignment"),
                kind=data.get("kind"),
                longest_tokens=data.get("longest_tokens"),
            )
            recorded = manifest.dataset_fingerprint
            actual = manifest.compute_fingerprint()
            if recorded != actual:
                problems.insert(0,
                    f"dataset_fingerprint {recorded[:16]}... does not match its content "
                    f"({actual[:16]}...): the manifest was edited or is corrupt"
                )
        if problems or manifest is None:
            raise ManifestError(
                f"{where}: " + "; ".join(problems) + ". Re-run the Beam job (or restore the manifest)."
            )
        return manifest

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_NAME) -> "Manifest":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ManifestError(f"{where}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, where)


def _tombstones_of(data: dict, problems: list[str]) -> tuple[int, tuple[dict, ...]]:
    """``(tombstones, transforms entry)`` of a manifest whose schema has :data:`TOMBSTONE_COLUMN`
    (``(0, ())`` otherwise): ``tombstones`` must be the sum of the transforms' ``dropped``."""
    schema = data.get("schema")
    if not isinstance(schema, list) or not any(isinstance(c, dict) and c.get("name") == TOMBSTONE_COLUMN
                                               for c in schema):
        return 0, ()
    tombstones, transforms = data.get("tombstones"), data.get("transforms")
    if not isinstance(tombstones, int) or isinstance(tombstones, bool) or tombstones < 0:
        problems.append(f"field 'tombstones' must be an int >= 0 when the schema has a {TOMBSTONE_COLUMN!r} column "
                        f"(got {tombstones!r:.80})")
        return 0, ()
    if not isinstance(transforms, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), str)
                                                   and isinstance(t.get("dropped"), int) for t in transforms):
        problems.append(f"field 'transforms' must list the transforms (function, dropped, ...) when the schema has "
                        f"a {TOMBSTONE_COLUMN!r} column (got {transforms!r:.80})")
        return 0, ()
    dropped = sum(t["dropped"] for t in transforms)
    if dropped != tombstones:
        problems.append(f"field 'tombstones' is {tombstones} but the transforms dropped {dropped} documents")
    return tombstones, tuple(dict(t) for t in transforms)


def read_manifest(dataset_path: str, storage_options=None) -> Manifest:
    """Load ``<dataset_path>/manifest.json`` (local path or ``gs://``, read with ``storage_options``)."""
    location = storage.join(dataset_path, MANIFEST_NAME)
    if not storage.exists(location, storage_options):
        raise ManifestError(
            f"{location} does not exist: {dataset_path} is not a Zephon dataset "
            "(the Beam job writes the manifest last; an interrupted job leaves none). "
            "Run `zephon shard ... --output DATASET` to create one."
        )
    raw = storage.read_bytes(location, storage_options)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{location} is not UTF-8 text (byte {exc.start}: {exc.reason}): the Beam job writes "
                            "it as UTF-8 JSON, so it is damaged or not a manifest; re-run the Beam job or restore "
                            "it") from None
    return Manifest.from_json(text, location)
