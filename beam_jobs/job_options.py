"""The sharding job's options, written once: one table that makes the command line, the job's
:class:`~beam_jobs.shard.ShardOptions` and the Flex Template's parameters.

Each :class:`JobOption` names its flag, the :class:`ShardOptions` field it fills, its type,
default, choices and help, the ``--help`` group it is listed in, and how the parsed value
becomes the field's (``convert``). From the table:

* :func:`add_job_arguments` adds every option to the job's ``argparse`` parser
  (:func:`beam_jobs.shard.build_parser`), in table order;
* :func:`options_fields` turns the parsed namespace into :class:`ShardOptions` keyword arguments;
* :func:`field_default` gives each :class:`ShardOptions` field its default, so the dataclass
  and the parser cannot disagree;
* ``templates/shard/metadata.json`` lists a parameter per flag (the flag with underscores:
  ``--num-lanes`` is ``num_lanes``), with the table's default in its help text
  (``tests/gcs/test_template.py`` checks both ways).

The storage flags (:mod:`beam_jobs.storage_flags`) and the image flags
(:mod:`beam_jobs.image_records`) are tables of their own, added where the table says
(``AFTER_CURATION``), each made into one :class:`ShardOptions` field (``storage``, ``images``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from beam_jobs.dedup import DEDUP_MODES
from beam_jobs.inputs import FORMATS
from beam_jobs.lane_files import DEFAULT_TOKEN_COMPRESSION, TOKEN_COMPRESSIONS
from loader.chat import LOSS_ON_CHOICES, OVERFLOW_CHOICES
from loader.kinds.base import named_kinds

__all__ = ["JobOption", "JOB_OPTIONS", "add_job_arguments", "options_fields", "field_default", "table_fields",
           "template_names",
           "LANE_BALANCES", "DEFAULT_NUM_LANES", "DEFAULT_SEED", "DEFAULT_TARGET_FILE_MB",
           "DEFAULT_MAX_REJECT_FRACTION"]

LANE_BALANCES = ("hash", "documents")  # --lane-balance (beam_jobs.lane_balance)
DEFAULT_NUM_LANES = None  # None: the largest of 64, 32, 16, 8 that fills every lane (beam_jobs.lane_count)
DEFAULT_SEED = 0
DEFAULT_TARGET_FILE_MB = 64.0
DEFAULT_MAX_REJECT_FRACTION = 0.01

# --help groups: (title, description); None is the parser's own "options" list.
CHAT_GROUP = (
    "chat / SFT records", "records holding a conversation (a messages list of role/content, optional "
    "record-level 'tools'), rendered with a chat template; with --tokenizer tokenized offline into "
    "input_ids plus a loss_mask column (1 on the assistant's tokens), without it validated and stored as "
    "a 'conversation' column that the loader renders, tokenizes and masks online (same batches); the "
    "text column holds the rendered conversation either way")
CURATION_GROUP = (
    "transforms and deduplication", "applied to every valid document after reading, before lanes "
    "(docs/guides/transforms.md); dropped and removed documents are counted in the manifest apart from rejects")


def _split_fields(values: Optional[Sequence[str]]) -> tuple[str, ...]:
    return tuple(name for value in values or () for name in value.split(",") if name)


@dataclass(frozen=True)
class JobOption:
    """One job option. ``field``: the :class:`ShardOptions` field it fills (None: read by
    :func:`beam_jobs.shard.parse_args` itself, e.g. ``--kind-module``); ``dest``: the namespace
    attribute (default: ``field``); ``help``: text, or a function of nothing for text that
    names what is registered when the parser is built."""

    flag: str
    field: Optional[str]
    help: Union[str, Callable[[], str]]
    default: Any = None
    type: Optional[Callable[[str], Any]] = None
    choices: Optional[Sequence[str]] = None
    nargs: Optional[str] = None
    metavar: Optional[str] = None
    action: Optional[str] = None
    required: bool = False
    dest: Optional[str] = None
    group: Optional[tuple[str, str]] = None
    # The parsed value -> the field's value (default: as parsed).
    convert: Optional[Callable[[Any], Any]] = None

    @property
    def attribute(self) -> str:
        return self.dest or self.field

    @property
    def template_name(self) -> str:
        """The Flex Template parameter (``templates/shard/metadata.json``)."""
        return self.flag[2:].replace("-", "_")

    def add_to(self, parser: Union[argparse.ArgumentParser, Any]) -> None:
        kwargs: dict[str, Any] = {"help": self.help() if callable(self.help) else self.help, "default": self.default}
        if self.dest is not None or self.field is None or self.field != self.flag[2:].replace("-", "_"):
            kwargs["dest"] = self.attribute
        for name in ("type", "choices", "nargs", "metavar", "action"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.required:
            kwargs["required"] = True
            del kwargs["default"]
        parser.add_argument(self.flag, **kwargs)


def _kind_help() -> str:
    return ("a named lane kind (a plug-in: docs/guides/kinds.md) whose record converter reads "
            "the records and whose loader decoder makes the tokens from the text column; "
            "recorded in the manifest's 'kind' entry (registered now: "
            f"{', '.join(named_kinds()) or 'none'}; more with --kind-module) "
            "(default: none, a built-in kind chosen by the other flags)")


AFTER_CURATION = "after-curation"  # where the image and storage flags go (a marker in JOB_OPTIONS)

JOB_OPTIONS: tuple[Union[JobOption, str], ...] = (
    JobOption("--input", "inputs", nargs="+", required=True, metavar="GLOB", convert=tuple,
              help="(required) input files: one or more paths or globs, local, gs:// or s3:// (* within a "
                   "directory, ** across directories). Keys without --id-field are relative "
                   "to the longest common directory of the patterns' non-glob parts."),
    JobOption("--format", "format", choices=FORMATS, default=None,
              help="input format for every file (default: inferred per file from the name: "
                   ".jsonl/.json[.gz|.zst] -> jsonl, .parquet -> parquet, .txt[.gz|.zst] -> text, "
                   "one document per text file; .tar -> webdataset, an image job)"),
    JobOption("--text-field", "text_field", default="text",
              help="field/column holding the document text (default: %(default)s)"),
    JobOption("--id-field", "id_field", default=None,
              help="field holding a unique document id used as the key (default: none; the key "
                   "is '<path relative to the input root>#<record index>', stable for the same "
                   "input files but not for a re-split of them)"),
    JobOption("--keep-fields", "keep_fields", nargs="+", default=None, metavar="FIELD", convert=_split_fields,
              help="extra fields to keep, each as a JSON-encoded string column named like the "
                   "field; space or comma separated (default: none)"),
    JobOption("--source-name", "source_name", default=None,
              help="name of this source recorded in the manifest (default: the --output "
                   "directory's name)"),
    JobOption("--num-lanes", "num_lanes", type=int, default=DEFAULT_NUM_LANES,
              help="number of lanes L; choose it divisible by every data-parallel world size "
                   "you will train with; every lane must receive a document, or the job fails "
                   "naming a lane count that works (default: the largest of 64, 32, 16, 8 whose "
                   "every lane receives a document, recorded in the manifest and named in the "
                   "summary; 64 for all but small inputs)"),
    JobOption("--lane-balance", "lane_balance", choices=LANE_BALANCES, default="hash",
              help="how documents are dealt to lanes: 'hash' (lane = H(seed, key) mod L: a document's "
                   "lane depends on its key alone) or 'documents' (the document of rank r in hash order "
                   "goes to lane r mod L: lane sizes differ by at most one, so a finite epoch ends with "
                   "almost no fill rows; recorded in the manifest; docs/guides/finite-epochs.md) "
                   "(default: %(default)s)"),
    JobOption("--seed", "seed", type=int, default=DEFAULT_SEED,
              help="seed of the lane and in-lane order hashes, recorded in the manifest "
                   "(default: %(default)s)"),
    JobOption("--tokenizer", "tokenizer", default=None, metavar="TOKENIZER_JSON",
              help="Hugging Face tokenizer.json (local, gs:// or s3://) for offline tokenization into "
                   "input_ids/num_tokens columns, without special tokens (default: none; the "
                   "loader tokenizes online)"),
    JobOption("--token-compression", "token_compression", choices=TOKEN_COMPRESSIONS,
              default=DEFAULT_TOKEN_COMPRESSION,
              help="Parquet codec of the input_ids column with --tokenizer (other columns are "
                   "zstd): lz4 decodes fastest, which is what a CPU-bound loader replays every "
                   "epoch; zstd stores fewer bytes; none skips decompression "
                   "(default: %(default)s)"),
    JobOption("--kind", "kind", default=None, metavar="NAME", help=_kind_help),
    JobOption("--kind-module", None, dest="kind_modules", action="append", default=None, metavar="MODULE",
              help="an importable Python module that registers lane kinds (register_kind, "
                   "register_converter), imported before --kind is checked; repeatable (default: none)"),
    JobOption("--target-file-mb", "target_file_mb", type=float, default=DEFAULT_TARGET_FILE_MB,
              help="target text MiB per lane file: files_per_lane = max(1, ceil(total text bytes "
                   "/ num_lanes / target)); also bounds a writer's memory (default: %(default)s)"),
    JobOption("--messages-field", "messages_field", default=None, metavar="FIELD", group=CHAT_GROUP,
              help="field/column holding each record's messages list; makes the job a chat job "
                   "(needs --chat-template; with --tokenizer encoded offline, without it online by "
                   "the loader; --text-field is not read: the text column holds the rendered "
                   "conversation) "
                   "(default: none, records are text documents)"),
    JobOption("--chat-template", "chat_template", default=None, metavar="FILE", group=CHAT_GROUP,
              help="chat template (local, gs:// or s3://): a Jinja file, or a tokenizer_config.json whose "
                   "chat_template is used with its special tokens, or the name of a template shipped "
                   "with Zephon (chatml); rendered as transformers' "
                   "apply_chat_template does, {%% generation %%} tags marking assistant tokens "
                   "(default: none)"),
    JobOption("--chat-loss-on", "chat_loss_on", choices=LOSS_ON_CHOICES, default="all", group=CHAT_GROUP,
              help="supervise every assistant turn or the last one only (default: %(default)s)"),
    JobOption("--chat-max-tokens", "chat_max_tokens", type=int, default=None, metavar="N", group=CHAT_GROUP,
              help="longest conversation in tokens; what a longer one gets is --chat-overflow "
                   "(default: no bound)"),
    JobOption("--chat-overflow", "chat_overflow", choices=OVERFLOW_CHOICES, default="reject", group=CHAT_GROUP,
              help="a conversation above --chat-max-tokens: rejected (reason too_long, into "
                   "_rejected/) or cut to its first N tokens (default: %(default)s)"),
    # transforms: parsed into TransformSpecs by beam_jobs.shard (a bad spec is a ShardConfigError there)
    JobOption("--transform", "transforms", action="append", default=None, group=CURATION_GROUP,
              metavar="MODULE:FUNCTION[@VERSION][:JSON-ARGS]",
              help="a transform (the loader's, same seeds: seed from --seed and the key), e.g. "
                   "'drop_regex:{\"pattern\": \"lorem\"}' or 'my.filters:clean@2'; repeatable, "
                   "applied in order; text ones before tokenization, tokens ones (after the text "
                   "ones, needs --tokenizer) right after it; a dropped document stays in its lane as "
                   "a tombstone (dropped_by column) the loader skips (default: none)"),
    JobOption("--dedup", "dedup", choices=DEDUP_MODES, default=None, group=CURATION_GROUP,
              help="exact: keep one document per normalised text (NFKC, casefold, whitespace runs "
                   "as one space), the one with the smallest key; the removed ones are listed in "
                   "_dedup/removed-*.jsonl (default: off)"),
    AFTER_CURATION,
    JobOption("--output", "output", required=True,
              help="(required) dataset directory to write (local, gs:// or s3://); created if missing, "
                   "refused if it is a file"),
    JobOption("--overwrite", "overwrite", action="store_true", default=False,
              help="replace an existing dataset at --output (manifest first, then lane files and "
                   "_rejected/); without it an existing dataset is an error (default: off)"),
    JobOption("--max-reject-fraction", "max_reject_fraction", type=float, default=DEFAULT_MAX_REJECT_FRACTION,
              help="fail without writing manifest.json when rejected / (documents + rejected) is "
                   "above this (default: %(default)s)"),
)

_OPTIONS = tuple(o for o in JOB_OPTIONS if isinstance(o, JobOption))
_BY_FIELD = {o.field: o for o in _OPTIONS if o.field is not None}


def add_job_arguments(parser: argparse.ArgumentParser,
                      after_curation: Callable[[argparse.ArgumentParser], None]) -> None:
    """Every option of :data:`JOB_OPTIONS` on ``parser``, in order; ``after_curation(parser)`` adds
    the flags of the other tables (images, storage) at their place."""
    groups: dict[tuple[str, str], Any] = {}
    for option in JOB_OPTIONS:
        if option == AFTER_CURATION:
            after_curation(parser)
            continue
        if option.group is None:
            target = parser
        else:
            target = groups.get(option.group)
            if target is None:
                target = groups[option.group] = parser.add_argument_group(*option.group)
        option.add_to(target)


def options_fields(known: argparse.Namespace, convert: Optional[dict[str, Callable[[Any], Any]]] = None) -> dict:
    """:class:`ShardOptions` keyword arguments of the table's fields, from the parsed ``known``.
    ``convert``: per field, a conversion the caller owns (it may raise the job's own errors)."""
    convert = convert or {}
    fields = {}
    for field, option in _BY_FIELD.items():
        value = getattr(known, option.attribute)
        how = convert.get(field) or option.convert
        fields[field] = how(value) if how is not None else value
    return fields


def field_default(field: str) -> Any:
    """The default of the :class:`ShardOptions` field ``field``, as the table gives it (a list
    option's default none is the empty tuple)."""
    option = _BY_FIELD[field]
    if option.default is None and (option.nargs in ("+", "*") or option.action == "append"):
        return ()
    return option.default


def table_fields() -> tuple[str, ...]:
    """The :class:`ShardOptions` fields the table fills."""
    return tuple(_BY_FIELD)


def template_names() -> tuple[str, ...]:
    """The Flex Template parameters of the table's options (the image and storage flags aside)."""
    return tuple(o.template_name for o in _OPTIONS)
