"""The Beam sharding job: raw documents -> lane-indexed Parquet + ``manifest.json``.

Run it as ``zephon shard ...``, ``python -m beam_jobs.shard ...`` or from code with
:func:`run` / :func:`run_shard`. Job options are listed by ``--help``; every other flag is
a standard Beam pipeline option (``--runner``, ``--direct_running_mode``, ``--project``...)
and is passed through to Beam.

Pipeline (step names as they appear in the Beam UI)::

    ListInputs -> ReadFiles -+- documents -+- TextBytes -> TotalTextBytes -> FilesPerLane --+
                             |             |                                (side input)   |
                             |             +- AssignLane <----------------------------------+
                             |                  -> GroupByLaneFile -> WriteLaneFiles -> CollectFileEntries
                             |                                                               |
                             +- rejected --+- KeyRejectsByFile -> GroupRejectsByFile -> WriteRejected
                                           +- RejectReason -> CountRejects              |    |
                                                     (side inputs: counts, files written, |    v
                                                      files_per_lane) --------------> CommitManifest

Chat records (``--messages-field``): ``ReadFiles`` renders and tokenizes each conversation
(:mod:`beam_jobs.chat_records`), refused ones become rejections with their chat reason, and
``WriteLaneFiles`` writes the encodings with a ``loss_mask`` column.

Before the pipeline is built, :func:`preflight` runs every check that needs no record
(output location, existing dataset, inputs, option combinations, a lane count the input
cannot fill when its size tells): each failure is one line naming the option and the fix.

Determinism: a document's lane, part file and row position depend only on (seed, key) and
the total text bytes of all valid documents, so the lane files and the dataset fingerprint
are the same on every runner and runner mode, and for any split of the same records into
input files (given ``--id-field``). See :mod:`beam_jobs.lane_files` and
:mod:`beam_jobs.outputs` for the file-level guarantees.

Default runner: when no ``--runner`` is given the job runs on Beam's ``FnApiRunner``
in-memory (what ``DirectRunner`` falls back to when Prism is unavailable), so local runs
never try to download Prism and behave the same on every machine.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Optional, Sequence, Union

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pvalue import AsDict, AsList, AsSingleton

from beam_jobs import worker_stderr
from beam_jobs.chat_records import ChatSpec, template_fingerprint
from beam_jobs.curation import CurateDocuments
from beam_jobs.dedup import DEDUP_MODES
from beam_jobs.image_records import (
    ImageSpec,
    add_image_arguments,
    image_option_problems,
    image_spec_from_args,
    resolve_image_job,
)
from beam_jobs.inputs import FORMATS, InputFile, expand_inputs, most_documents
from beam_jobs.job_options import (  # noqa: F401  (the defaults: also importable from here)
    DEFAULT_MAX_REJECT_FRACTION,
    DEFAULT_NUM_LANES,
    DEFAULT_SEED,
    DEFAULT_TARGET_FILE_MB,
    LANE_BALANCES,
    add_job_arguments,
    field_default,
    options_fields,
)
from beam_jobs.lane_balance import BalancedLanes, balanced_lane_count
from beam_jobs.lane_count import ChooseLaneCount, lane_count_note
from beam_jobs.lane_files import (
    RESERVED_COLUMNS,
    TOKEN_COMPRESSIONS,
    AssignLaneFn,
    WriteLaneFileFn,
    files_per_lane_for,
    manifest_schema,
)
from beam_jobs.outputs import WriteRejectedFn, commit_manifest, prepare_output
from beam_jobs.progress import ShardSummary, expect, expect_lane_files, query_counters, reset_stages
from beam_jobs.readers import REJECTED_TAG, ReadDocumentsFn, RecordSpec
from beam_jobs.storage_flags import add_storage_arguments, check_storage_options, storage_options_from_args
from beam_jobs.records import registered_converters
from loader.chat import LOSS_ON_CHOICES, OVERFLOW_CHOICES, load_chat_template
from loader.cli import debug_enabled, run_command
from loader.errors import (
    ChatTemplateError,
    ConfigError,
    InputError,
    JOB_ERROR_PREFIX,
    OutputExistsError,
    ShardConfigError,
    ShardError,
    TransformError,
    ZephonError,
)
from loader.io.backends import UnsupportedSchemeError, backend_for, is_remote
from loader.io.manifest import DOCUMENT_REJECT_REASONS, Manifest, read_manifest
from loader.io.storage_options import StorageOptions
from loader.kinds.base import import_kind_modules, named_kinds
from loader.kinds.chat import REJECT_REASONS
from loader.kinds.image import IMAGE_DOCUMENT_REJECT_REASONS
from loader.stages.tokenizer import describe, load_tokenizer
from loader.transforms.spec import TransformSpec, parse_transform_arg
from loader.vision.reasons import IMAGE_REJECT_REASONS

logger = logging.getLogger(__name__)

DEFAULT_RUNNER_ARGS = ("--runner=FnApiRunner",)
MAX_TARGET_FILE_MB = 1024.0  # Arrow string arrays hold < 2 GiB; a file is built in memory


@dataclass(frozen=True)
class ShardOptions:
    """The sharding job's own options (``--help`` documents each). Validated on creation.

    Flags, help and defaults are :data:`beam_jobs.job_options.JOB_OPTIONS`; ``images`` and
    ``storage`` are made from the image and storage flags' own tables."""

    inputs: tuple[str, ...]
    output: str
    format: Optional[str] = field_default("format")
    text_field: str = field_default("text_field")
    id_field: Optional[str] = field_default("id_field")
    keep_fields: tuple[str, ...] = field_default("keep_fields")
    source_name: Optional[str] = field_default("source_name")
    num_lanes: Optional[int] = field_default("num_lanes")  # None: chosen by the job (beam_jobs.lane_count)
    lane_balance: str = field_default("lane_balance")  # "documents": lane sizes within one (beam_jobs.lane_balance)
    seed: int = field_default("seed")
    tokenizer: Optional[str] = field_default("tokenizer")
    token_compression: str = field_default("token_compression")
    target_file_mb: float = field_default("target_file_mb")
    overwrite: bool = field_default("overwrite")
    max_reject_fraction: float = field_default("max_reject_fraction")
    messages_field: Optional[str] = field_default("messages_field")
    chat_template: Optional[str] = field_default("chat_template")
    chat_loss_on: str = field_default("chat_loss_on")
    chat_max_tokens: Optional[int] = field_default("chat_max_tokens")
    chat_overflow: str = field_default("chat_overflow")
    transforms: tuple[TransformSpec, ...] = field_default("transforms")  # --transform, in order
    dedup: Optional[str] = field_default("dedup")  # --dedup: None or "exact"
    images: Optional[ImageSpec] = None  # an image job (--image-*, WebDataset input): docs/guides/images.md
    storage: StorageOptions = StorageOptions()  # --s3-*, --storage-* (beam_jobs.storage_flags), given to every I/O step
    kind: Optional[str] = None  # --kind: a named lane kind's job (loader.kinds.base; docs/guides/kinds.md)

    @property
    def chat(self) -> bool:
        """Records are conversations (``--messages-field``): rendered and tokenized offline with
        ``--tokenizer``, else validated and stored for the loader to encode online."""
        return self.messages_field is not None

    @property
    def chat_online(self) -> bool:
        """A chat job without ``--tokenizer``: the lanes hold the conversations (``conversation`` column)."""
        return self.chat and self.tokenizer is None

    def __post_init__(self) -> None:
        problems = []
        if not self.inputs:
            problems.append("--input needs at least one path or glob")
        if not self.output:
            problems.append("--output is required")
        if self.format is not None and self.format not in FORMATS:
            problems.append(f"--format must be one of {', '.join(FORMATS)} (got {self.format!r})")
        if self.num_lanes is not None and self.num_lanes <= 0:
            problems.append(f"--num-lanes must be positive (got {self.num_lanes})")
        if self.lane_balance not in LANE_BALANCES:
            problems.append(f"--lane-balance must be one of {', '.join(LANE_BALANCES)} (got {self.lane_balance!r})")
        if self.seed < 0:
            problems.append(f"--seed must be >= 0 (got {self.seed})")
        if self.token_compression not in TOKEN_COMPRESSIONS:
            problems.append(f"--token-compression must be one of {', '.join(TOKEN_COMPRESSIONS)} "
                            f"(got {self.token_compression!r})")
        if not 0 < self.target_file_mb <= MAX_TARGET_FILE_MB:
            problems.append(f"--target-file-mb must be in (0, {MAX_TARGET_FILE_MB:g}] (got {self.target_file_mb})")
        if not 0.0 <= self.max_reject_fraction <= 1.0:
            problems.append(f"--max-reject-fraction must be in [0, 1] (got {self.max_reject_fraction})")
        if not self.text_field:
            problems.append("--text-field must not be empty")
        reserved = sorted(set(self.keep_fields) & set(RESERVED_COLUMNS))
        if reserved:
            problems.append(f"--keep-fields {', '.join(reserved)}: these names are lane file columns "
                            f"({', '.join(RESERVED_COLUMNS)}); the document key is already in 'key'")
        if self.text_field in self.keep_fields:
            problems.append(f"--keep-fields must not repeat --text-field {self.text_field!r} (it is the 'text' column)")
        if len(set(self.keep_fields)) != len(self.keep_fields):
            problems.append(f"--keep-fields lists a field twice ({', '.join(self.keep_fields)})")
        if self.dedup is not None and self.dedup not in DEDUP_MODES:
            problems.append(f"--dedup must be one of {', '.join(DEDUP_MODES)} (got {self.dedup!r})")
        problems += self._chat_problems()
        problems += self._kind_problems()
        problems += image_option_problems(self)
        if problems:
            raise ShardConfigError("; ".join(problems))

    def _kind_problems(self) -> list[str]:
        if self.kind is None:
            return []
        if self.kind not in named_kinds() or self.kind not in registered_converters():
            return [f"--kind {self.kind!r} is not a registered lane kind with a record converter (registered: "
                    f"{', '.join(k for k in named_kinds() if k in registered_converters()) or 'none'}); "
                    "name the module that registers it with --kind-module"]
        given = [flag for flag, value in (("--tokenizer", self.tokenizer), ("--messages-field", self.messages_field),
                                          ("--image-*", self.images)) if value is not None]
        if given:
            return [f"--kind {self.kind} makes its own tokens from the text; it cannot be combined with {', '.join(given)}"]
        return []

    def _chat_problems(self) -> list[str]:
        problems = []
        if self.chat_loss_on not in LOSS_ON_CHOICES:
            problems.append(f"--chat-loss-on must be one of {', '.join(LOSS_ON_CHOICES)} (got {self.chat_loss_on!r})")
        if self.chat_overflow not in OVERFLOW_CHOICES:
            problems.append(f"--chat-overflow must be one of {', '.join(OVERFLOW_CHOICES)} (got {self.chat_overflow!r})")
        if self.chat_max_tokens is not None and self.chat_max_tokens < 1:
            problems.append(f"--chat-max-tokens must be positive (got {self.chat_max_tokens})")
        if not self.chat:
            given = [flag for flag, value, default in (
                ("--chat-template", self.chat_template, None), ("--chat-loss-on", self.chat_loss_on, "all"),
                ("--chat-max-tokens", self.chat_max_tokens, None), ("--chat-overflow", self.chat_overflow, "reject"),
            ) if value != default]
            if given:
                problems.append(f"{', '.join(given)} apply to chat records only; add --messages-field FIELD "
                                "(the field holding each record's messages list)")
            return problems
        if not self.messages_field:
            problems.append("--messages-field must not be empty")
        if self.chat_template is None:
            problems.append("--messages-field needs --chat-template FILE (a .jinja file or a tokenizer_config.json "
                            "with a chat_template)")
        if self.messages_field in self.keep_fields:
            problems.append(f"--keep-fields must not repeat --messages-field {self.messages_field!r}")
        return problems

    @property
    def target_file_bytes(self) -> int:
        return max(1, int(self.target_file_mb * (1 << 20)))

    @property
    def resolved_source_name(self) -> str:
        return self.source_name or os.path.basename(self.output.rstrip("/")) or "dataset"

    def record_spec(self, chat: Optional[ChatSpec] = None) -> RecordSpec:
        return RecordSpec(text_field=self.text_field, id_field=self.id_field, keep_fields=self.keep_fields,
                          chat=chat, images=self.images, storage=self.storage, kind=self.kind)

    def chat_spec(self, tokenizer_fingerprint: Optional[str], template_fingerprint: str) -> ChatSpec:
        return ChatSpec(
            messages_field=self.messages_field, template_path=self.chat_template, tokenizer_path=self.tokenizer,
            tokenizer_fingerprint=tokenizer_fingerprint, template_fingerprint=template_fingerprint,
            loss_on=self.chat_loss_on, max_tokens=self.chat_max_tokens, overflow=self.chat_overflow,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon shard",
        allow_abbrev=False,  # unknown flags are Beam's: never let a prefix of ours swallow one
        description="Shard raw documents into lane-indexed Parquet files plus manifest.json "
                    "(Apache Beam). Flags not listed here are Beam pipeline options, e.g. "
                    "--runner=DataflowRunner --project=P --region=R --temp_location=gs://... ; "
                    "without --runner the job runs locally on Beam's FnApiRunner (in-memory; add "
                    "--direct_running_mode=multi_processing --direct_num_workers=N for processes).",
    )
    add_job_arguments(parser, after_curation=lambda p: (add_image_arguments(p), add_storage_arguments(p)))
    return parser


def parse_args(argv: Sequence[str]) -> tuple[ShardOptions, list[str]]:
    """``(job options, Beam pipeline args)``; unknown flags are pipeline options."""
    known, pipeline_args = build_parser().parse_known_args(list(argv))
    try:
        import_kind_modules(known.kind_modules or ())  # --kind-module: registers the kinds --kind may name
    except ImportError as exc:
        raise ShardConfigError(f"--kind-module: {exc}; the module must be importable (on sys.path)") from exc
    options = ShardOptions(**options_fields(known, {"transforms": _transform_specs}),
                           images=image_spec_from_args(known), storage=storage_options_from_args(known))
    return options, pipeline_args


def _transform_specs(values: Optional[Sequence[str]]) -> tuple[TransformSpec, ...]:
    try:
        return tuple(parse_transform_arg(value) for value in values or ())
    except ConfigError as exc:
        raise ShardConfigError(str(exc)) from None


def offline_transforms(options: ShardOptions) -> tuple[TransformSpec, ...]:
    """``--transform`` specs imported and resolved (stage, version). Text-stage ones run before
    lanes; tokens-stage ones (docs/guides/transforms.md) right after tokenization, so they need
    ``--tokenizer`` and must follow every text-stage one."""
    pretokenized = options.tokenizer is not None and not options.chat
    try:
        specs = tuple(spec.resolved(pretokenized=pretokenized) for spec in options.transforms)
    except TransformError as exc:
        raise ShardConfigError(f"--transform: {exc}") from None
    if specs and options.images is not None:
        raise ShardConfigError("--transform cannot be used in an image job yet (a tombstone would need an empty image "
                               "payload, and the loader does not read image datasets yet); filter the records "
                               "before sharding")
    seen_tokens = None
    for spec in specs:
        if spec.stage == "records":
            raise ShardConfigError(
                f"--transform {spec.function}: records transforms run online only (the loader config's transforms "
                "of an online chat source, on each conversation before rendering); in the job a chat dataset takes "
                "text transforms, which see the rendered conversation and may drop it")
        if spec.stage == "tokens":
            if options.chat:
                raise ShardConfigError(
                    f"--transform {spec.function}: it works on tokens, and a chat job's tokens (and loss_mask) "
                    "are made before the transforms run; apply it online (the loader config's transforms, "
                    "stage \"tokens\") or use a text transform")
            if options.tokenizer is None:
                raise ShardConfigError(
                    f"--transform {spec.function}: it works on tokens, and without --tokenizer the job makes none; "
                    "pass --tokenizer (the transform then runs right after tokenization), apply it online (the "
                    "loader config's transforms), or use a text transform")
            seen_tokens = seen_tokens or spec.function
        elif seen_tokens is not None:
            raise ShardConfigError(
                f"--transform {spec.function} works on text but follows the tokens transform {seen_tokens}: the job "
                "runs text transforms before tokenization and tokens ones after it; put the text transforms first")
    return specs


def token_stage_args(options: ShardOptions, specs: Sequence[TransformSpec]) -> Optional[dict]:
    """The arguments of the job's :class:`beam_jobs.transform_steps.TokenStage`, or None."""
    first = next((k for k, spec in enumerate(specs) if spec.stage == "tokens"), None)
    if first is None:
        return None
    return {"specs": tuple(specs[first:]), "first_position": first, "seed": options.seed,
            "source": options.resolved_source_name, "keep_fields": options.keep_fields,
            "with_text": first > 0}  # online, a pre-tokenized document has text only with a text transform


def with_default_runner(pipeline_args: Sequence[str]) -> list[str]:
    args = list(pipeline_args)
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        args += DEFAULT_RUNNER_ARGS
    return args


class ShardDataset(beam.PTransform):
    """``PBegin`` -> the committed manifest dict (one element). See the module docstring."""

    def __init__(self, options: ShardOptions, input_files: Sequence[InputFile],
                 tokenizer_info: Optional[dict] = None, label: Optional[str] = None,
                 chat: Optional[ChatSpec] = None, chat_record: Optional[dict] = None):
        super().__init__(label)
        self.options = options
        self.input_files = list(input_files)
        self.tokenizer_info = tokenizer_info  # describe(tokenizer).to_dict() when pre-tokenizing
        self.chat = chat  # set for a chat job: ReadFiles encodes, WriteLaneFiles writes the encodings
        self.chat_record = chat_record  # the manifest's "chat" entry (ChatRecord.to_dict()) of a chat job
        self.transforms = offline_transforms(options)  # imported here: a bad one fails before the job starts
        if (chat is None) == options.chat:
            raise ShardConfigError("a chat job (--messages-field) needs its ChatSpec, and only a chat job has one")

    def expand(self, pbegin):
        opts = self.options
        pretokenized = self.tokenizer_info is not None
        read = (
            pbegin
            | "ListInputs" >> beam.Create([f.to_tuple() for f in self.input_files])
            | "ReadFiles" >> beam.ParDo(ReadDocumentsFn(opts.record_spec(self.chat))).with_outputs(
                REJECTED_TAG, main="documents")
        )
        documents, rejections = read.documents, read[REJECTED_TAG]
        curation = None
        if self.transforms or opts.dedup:  # --transform, --dedup (beam_jobs.curation)
            documents, curation = documents | "Curate" >> CurateDocuments(
                self.transforms, opts.dedup, seed=opts.seed, source=opts.resolved_source_name,
                keep_fields=opts.keep_fields, output=opts.output, text_is_fixed=opts.chat,
                storage_options=opts.storage)

        # Without --num-lanes the lane count comes from the keys (beam_jobs.lane_count).
        balanced = opts.lane_balance == "documents"
        if opts.num_lanes is not None:
            num_lanes = opts.num_lanes
        elif balanced:  # every lane fills once there are as many documents as lanes
            num_lanes = AsSingleton(documents | "CountDocuments" >> beam.combiners.Count.Globally()
                                    | "BalancedLaneCount" >> beam.Map(balanced_lane_count))
        else:
            num_lanes = AsSingleton(documents | "ChooseLaneCount" >> ChooseLaneCount(opts.seed))
        # Files per lane come from the content (total text bytes), never from input sizes.
        files_per_lane = (
            documents
            | "TextBytes" >> beam.Map(itemgetter(2))
            | "TotalTextBytes" >> beam.CombineGlobally(sum)
            | "FilesPerLane" >> beam.Map(lambda total, lanes, target: files_per_lane_for(total, max(lanes, 1), target),
                                         num_lanes, opts.target_file_bytes)
            | "ExpectLaneFiles" >> beam.Map(expect_lane_files, num_lanes)  # progress lines' total
        )
        if balanced:
            assigned = documents | "BalanceLanes" >> BalancedLanes(opts.seed, num_lanes, files_per_lane)
        else:
            assigned = documents | "AssignLane" >> beam.ParDo(
                AssignLaneFn(opts.seed, opts.num_lanes), AsSingleton(files_per_lane),
                **({} if opts.num_lanes is not None else {"num_lanes": num_lanes}))
        file_entries = (
            assigned
            | "GroupByLaneFile" >> beam.GroupByKey()
            | "WriteLaneFiles" >> beam.ParDo(WriteLaneFileFn(
                opts.output, opts.keep_fields, None if opts.chat else opts.tokenizer,
                self.tokenizer_info["fingerprint"] if pretokenized and not opts.chat else None,
                opts.token_compression, encoded=opts.chat and not opts.chat_online,
                conversations=opts.chat_online, images=opts.images is not None,
                visual_tokens=opts.images is not None and opts.images.policy is not None,
                tombstones=bool(self.transforms), token_stage=token_stage_args(opts, self.transforms),
                storage_options=opts.storage))
        )
        rejected_files = (
            rejections
            | "KeyRejectsByFile" >> beam.Map(_keyed_by_input_file)
            | "GroupRejectsByFile" >> beam.GroupByKey()
            | "WriteRejected" >> beam.ParDo(WriteRejectedFn(opts.output, storage_options=opts.storage))
        )
        reject_counts = (
            rejections
            | "RejectReason" >> beam.Map(itemgetter(3))
            | "CountRejects" >> beam.combiners.Count.PerElement()
        )
        return (
            file_entries
            | "CollectFileEntries" >> beam.combiners.ToList()
            | "CommitManifest" >> beam.Map(
                commit_manifest,
                output=opts.output,
                storage_options=opts.storage,
                seed=opts.seed,
                num_lanes=num_lanes,
                source_name=opts.resolved_source_name,
                schema=manifest_schema(pretokenized, opts.keep_fields, loss_mask=opts.chat and pretokenized,
                                       conversation=opts.chat_online, images=opts.images is not None,
                                       visual_tokens=opts.images is not None and opts.images.policy is not None,
                                       tombstones=bool(self.transforms)),
                tokenizer=self.tokenizer_info,
                max_reject_fraction=opts.max_reject_fraction,
                files_per_lane=AsSingleton(files_per_lane),
                reject_counts=AsDict(reject_counts),
                rejected_files=AsList(rejected_files),
                reject_reasons=(REJECT_REASONS + IMAGE_REJECT_REASONS if opts.chat and opts.images else
                                REJECT_REASONS if opts.chat else IMAGE_DOCUMENT_REJECT_REASONS if opts.images
                                else DOCUMENT_REJECT_REASONS),
                chat=self.chat_record,
                images=opts.images.manifest_record(0).to_dict() if opts.images is not None else None,
                curation=AsSingleton(curation) if curation is not None else None,
                lane_assignment="balanced" if balanced else None,
                kind=opts.kind,
            )
        )


def _keyed_by_input_file(rejection: tuple) -> tuple[int, tuple]:
    return rejection[0], rejection


# A traceback's last line naming a Zephon error: "loader.chat.template.ChatTemplateError: message".
_RAISED_LINE = re.compile(r"^((?:loader|beam_jobs)(?:\.\w+)+)\.([A-Z]\w*): (.+?)(?: \[while running .*)?$", re.MULTILINE)


def _job_error_message(exc: BaseException) -> Optional[str]:
    """The message of a :class:`ShardJobError` raised on a worker, wherever the runner put it;
    else of any other :class:`~loader.errors.ZephonError` a worker raised (the runner in
    ``multi_processing`` mode hands back only its traceback text); None for anything else."""
    text = str(exc)
    # Runners may repeat the prefix when they wrap the error: skip every copy of it.
    match = re.search(f"(?:{re.escape(JOB_ERROR_PREFIX)})+" + r"(.*?)(?: \[while running|\\n|\n|$)", text)
    if match:
        return match.group(1)
    if isinstance(exc, ZephonError):
        return str(exc)
    for module_name, class_name, message in reversed(_RAISED_LINE.findall(text)):
        try:
            raised = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        if isinstance(raised, type) and issubclass(raised, ZephonError):
            return message
    return None


def _normalize_output(output: str) -> str:
    return output if is_remote(output) else os.path.abspath(os.path.expanduser(output))


def check_output_location(output: str) -> None:
    """Refuse a local ``--output`` that can never become a dataset folder, or a remote one no backend serves."""
    if is_remote(output):
        try:
            backend_for(output)
        except UnsupportedSchemeError as exc:
            raise ShardConfigError(f"--output {exc}") from exc
        return
    if os.path.exists(output) and not os.path.isdir(output):
        raise ShardConfigError(f"--output {output} is an existing file, not a folder; pass the path of a "
                               "folder (it is created if missing).")
    ancestor = output
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ShardConfigError(f"--output {output} cannot be created: {ancestor} is a file; choose another --output.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ShardConfigError(f"--output {output} cannot be written: no write permission on {ancestor}; "
                               "choose another --output.")


def check_inputs_against_options(options: ShardOptions, input_files: Sequence[InputFile]) -> None:
    """Refuse option/input combinations that can be known to fail before any record is read."""
    text_files = [f.path for f in input_files if f.format == "text"]
    if text_files and options.chat:
        raise ShardConfigError(
            f"--messages-field {options.messages_field!r} cannot apply to text input (e.g. {text_files[0]}): a "
            "text file is one document without fields; give the conversations as JSONL or Parquet records."
        )
    if text_files and options.id_field is not None:
        raise ShardConfigError(
            f"--id-field {options.id_field!r} cannot apply to text input (e.g. {text_files[0]}): a text file "
            "is one document without fields; drop --id-field (the key is then the file's relative path) "
            "or convert the input to JSONL."
        )
    output_prefix = options.output.rstrip("/") + "/"
    inside_output = [f.path for f in input_files if f.path.startswith(output_prefix)]
    if inside_output:
        raise ShardConfigError(f"--input matches {len(inside_output)} files inside --output {options.output} "
                               f"(e.g. {inside_output[0]}); write the dataset outside the input folders.")
    most = most_documents(input_files, options.messages_field if options.chat else options.text_field)
    if most is not None and options.num_lanes is not None and most < options.num_lanes:
        raise ShardConfigError(
            f"--num-lanes {options.num_lanes} is more than the at most {most} documents the "
            f"{len(input_files)} input files can hold, and every lane needs a document; pass a --num-lanes "
            f"well below {max(most, 1)}, or leave --num-lanes out: the job then picks the largest of 64, 32, 16, "
            "8 whose every lane receives a document.")


def load_chat_spec(options: ShardOptions) -> ChatSpec:
    """The chat job's :class:`ChatSpec`, with the template and tokenizer loaded once here to
    refuse unusable ones before the job starts (the workers check they are still the same)."""
    try:
        template = load_chat_template(options.chat_template, storage_options=options.storage)
    except (ChatTemplateError, OSError) as exc:
        raise ShardConfigError(f"--chat-template {options.chat_template}: {exc}") from exc
    if options.tokenizer is None:  # online: the loader renders and tokenizes
        return options.chat_spec(None, template_fingerprint(template))
    tokenizer = load_tokenizer(options.tokenizer, options.storage)
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        # encode_conversation would refuse it on every record, on the workers
        raise ShardConfigError(
            f"--tokenizer {options.tokenizer} has truncation or padding enabled, which would cut or pad every "
            "conversation; save it without them (tokenizer.no_truncation(), tokenizer.no_padding()) and bound "
            "the length with --chat-max-tokens")
    return options.chat_spec(describe(tokenizer).fingerprint, template_fingerprint(template))


def preflight(options: ShardOptions) -> tuple[list[InputFile], Optional[dict]]:
    """Every check that needs no record, before the pipeline starts: ``(input files, tokenizer info)``.

    Each failure is a :class:`ShardConfigError`, :class:`InputError` or
    :class:`OutputExistsError` with a one-line message naming the option and the fix. A
    lane count that leaves a lane empty can only be known from the records in general; the
    job then fails in ``CommitManifest`` (:func:`beam_jobs.outputs.check_every_lane_has_documents`).
    """
    check_storage_options(options.storage, (*options.inputs, options.output, options.tokenizer, options.chat_template,
                                            options.images.image_root if options.images is not None else None))
    check_output_location(options.output)
    input_files = expand_inputs(options.inputs, options.format, storage_options=options.storage)
    check_inputs_against_options(options, input_files)
    tokenizer_info = None
    if options.tokenizer is not None:
        tokenizer_info = describe(load_tokenizer(options.tokenizer, options.storage)).to_dict()
    if not options.overwrite:
        prepare_output(options.output, overwrite=False, storage_options=options.storage)  # raises OutputExistsError naming what is there
    return input_files, tokenizer_info


def run_shard(options: ShardOptions, pipeline_args: Sequence[str] = (), *, wait: bool = True,
              on_summary: Optional[Callable[[ShardSummary], None]] = None) -> Optional[Manifest]:
    """Shard ``options.inputs`` into ``options.output``; returns the committed manifest.

    With ``wait=False`` (e.g. a Dataflow template launch) the job is submitted and ``None``
    is returned; the job itself writes the manifest when it succeeds. Otherwise the job's
    :class:`~beam_jobs.progress.ShardSummary` goes to ``on_summary`` (default: logged at INFO).
    """
    from dataclasses import replace

    options = replace(options, output=_normalize_output(options.output))
    input_files, tokenizer_info = preflight(options)
    options = resolve_image_job(options, input_files)  # WebDataset input makes an image job
    chat = load_chat_spec(options) if options.chat else None
    chat_record = None
    if chat is not None:  # the manifest's "chat" entry (online: with the template the loader renders with)

        chat_record = chat.manifest_record(load_chat_template(chat.template_path,
                                                              storage_options=options.storage)).to_dict()
    if options.overwrite:
        prepare_output(options.output, overwrite=True, storage_options=options.storage)
    logger.info("sharding %d input files into %s lanes at %s", len(input_files),
                "an automatic count of" if options.num_lanes is None else options.num_lanes, options.output)

    started = time.monotonic()
    reset_stages()
    expect("ReadFiles", len(input_files))
    pipeline = beam.Pipeline(options=PipelineOptions(with_default_runner(pipeline_args)))
    _ = pipeline | "Shard" >> ShardDataset(options, input_files, tokenizer_info, chat=chat,
                                                  chat_record=chat_record)
    try:
        result = pipeline.run()
        if not wait:
            return None
        result.wait_until_finish()
    except Exception as exc:
        message = _job_error_message(exc)
        if message is not None:
            raise ShardError(message) from exc
        raise
    manifest = read_manifest(options.output, options.storage)
    summary = ShardSummary.of(manifest, time.monotonic() - started, query_counters(result), len(input_files),
                              sum(f.size_bytes or 0 for f in input_files),
                              lanes_note=lane_count_note(manifest.num_lanes) if options.num_lanes is None else None)
    if on_summary is None:
        logger.info("%s", summary.text())
    else:
        on_summary(summary)
    return manifest


def run(argv: Union[Sequence[str], ShardOptions]) -> Manifest:
    """Library entry: ``run(["--input", "data/*.jsonl", "--output", "ds", ...])`` -> Manifest."""
    if isinstance(argv, ShardOptions):
        return run_shard(argv)
    options, pipeline_args = parse_args(argv)
    return run_shard(options, pipeline_args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``zephon shard`` / ``python -m beam_jobs.shard``: 0 on success, 1 on failure, 2 on bad options.

    Errors are reported by :func:`loader.cli.run_command`: ShardConfigError, InputError and
    TokenizerError exit 2; ShardError (the job ran and failed) and OutputExistsError exit 1.
    """
    return run_command("shard", argv)


class _OwnJobErrors(logging.Filter):
    """Beam logs a failing step's exception with its traceback before the runner raises it; the
    job's own errors (:class:`ShardJobError`, one sentence with the fix) are printed once, by the CLI."""

    def filter(self, record: logging.LogRecord) -> bool:
        return JOB_ERROR_PREFIX not in record.getMessage()


def command(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("beam_jobs").setLevel(logging.INFO)
    logging.getLogger("apache_beam.runners.common").addFilter(_OwnJobErrors())
    if not debug_enabled():  # Beam logs a failed job's worker tracebacks itself; ours is one line (--debug: all)
        logging.getLogger("apache_beam").setLevel(logging.CRITICAL)
    options, pipeline_args = parse_args(list(argv))
    with worker_stderr.kept_aside(not debug_enabled() and worker_stderr.runs_worker_processes(pipeline_args)):
        manifest = run_shard(options, pipeline_args, on_summary=lambda summary: print(summary.text()))
    assert manifest is not None
    tokens = f", {manifest.total_tokens} tokens" if manifest.pretokenized else ""
    rejected = sum(manifest.rejected.values())
    print(f"wrote {manifest.documents} documents{tokens} to {manifest.num_lanes} lanes in "
          f"{len(manifest.files)} files at {options.output} ({rejected} rejected); "
          f"dataset_fingerprint {manifest.dataset_fingerprint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
