"""The sharding job's storage flags: how its steps reach ``s3://`` (and every remote store).

``--s3-endpoint-url``, ``--s3-region`` and ``--s3-profile`` are the loader's
:class:`~loader.io.storage_options.StorageOptions` fields of the same names, and the
``--storage-*`` flags its retry budget (docs/guides/s3.md), which bounds the requests of the
loader's own backends: every ``s3://`` one (the job's other ``gs://`` I/O is Beam's gcsio). Each flag left out keeps the
client library's own lookup: for S3, ``AWS_ENDPOINT_URL(_S3)``, ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, ``~/.aws/config`` and ``~/.aws/credentials``.

The options become :attr:`beam_jobs.shard.ShardOptions.storage` and are handed to every step
that does I/O as a constructor argument, so the workers of any runner get them with the
step (a module global set by the launcher would never reach another process).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from loader.errors import ConfigError, ShardConfigError
from loader.io.backends import scheme_of
from loader.io.storage_options import StorageOptions


@dataclass(frozen=True)
class StorageFlag:
    flag: str
    field: str  # of StorageOptions
    kind: Callable[[str], object]
    metavar: str
    help: str


STORAGE_FLAGS = (
    StorageFlag("--s3-endpoint-url", "s3_endpoint_url", str, "URL",
                "endpoint of an S3-compatible store (MinIO, R2, Ceph, a test server), http(s)://host:port; "
                "path-style addressing (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, the profile's "
                "endpoint_url, else AWS)"),
    StorageFlag("--s3-region", "s3_region", str, "REGION",
                "AWS region of the s3:// buckets (default: AWS_REGION / AWS_DEFAULT_REGION, else the "
                "profile's region)"),
    StorageFlag("--s3-profile", "s3_profile", str, "NAME",
                "profile of ~/.aws/config / ~/.aws/credentials whose credentials, region and endpoint_url "
                "the job uses; checked before the job starts (default: AWS_PROFILE, else boto3's credential "
                "chain: AWS_ACCESS_KEY_ID..., the default profile, instance roles)"),
    StorageFlag("--storage-retry-max-attempts", "retry_max_attempts", int, "N",
                "attempts per request to the loader's storage backends (every s3:// request; the gs:// reads of "
                "named images, --tokenizer and --chat-template: the job's other gs:// I/O is Beam's gcsio, "
                "with its own retries) on transient errors (HTTP 408/429/5xx, resets, timeouts), with "
                "exponential backoff and full jitter (default: %(default)s)"),
    StorageFlag("--storage-retry-deadline-s", "retry_deadline_s", float, "SECONDS",
                "no new attempt of such a request starts after this many seconds (default: %(default)s)"),
    StorageFlag("--storage-request-timeout-s", "request_timeout_s", float, "SECONDS",
                "read timeout of one such HTTP request (default: %(default)s)"),
)
_DEFAULTS = StorageOptions()


def _dest(flag: StorageFlag) -> str:
    return "storage_" + flag.field


def add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "storage", "how the job reaches s3:// (docs/guides/s3.md); every flag left out keeps boto3's own "
        "lookup (AWS_* variables, ~/.aws files). Given to every worker with the steps that read or write")
    for flag in STORAGE_FLAGS:
        group.add_argument(flag.flag, dest=_dest(flag), type=flag.kind, metavar=flag.metavar,
                           default=getattr(_DEFAULTS, flag.field), help=flag.help)


def storage_options_from_args(known: argparse.Namespace) -> StorageOptions:
    """The job's :class:`StorageOptions`; a bad value is a :class:`ShardConfigError` naming its flag."""
    values = {flag.field: getattr(known, _dest(flag)) for flag in STORAGE_FLAGS}
    problems = []
    for flag in STORAGE_FLAGS:
        try:
            StorageOptions(**{flag.field: values[flag.field]})
        except ConfigError as exc:
            # "StorageOptions: retry_max_attempts must be ..." -> "--storage-retry-max-attempts must be ..."
            problems.append(str(exc).replace(f"StorageOptions: {flag.field}", flag.flag, 1))
    if problems:
        raise ShardConfigError("; ".join(problems))
    return StorageOptions(**values)


def check_storage_options(storage: StorageOptions, paths: Sequence[Optional[str]]) -> None:
    """Refuse an ``--s3-profile`` that names no profile, before the job starts (on the workers it
    would fail every step). Only when an ``s3://`` path is among ``paths``: otherwise it is unused."""
    if storage.s3_profile is None or not any(path and scheme_of(path) == "s3" for path in paths):
        return
    import botocore.session  # the s3 backend's client library, slow to import: only for a job that uses s3://

    available = botocore.session.Session().available_profiles  # reads the files only: AWS_PROFILE plays no part
    if storage.s3_profile not in available:
        listed = ", ".join(sorted(available)) or "none"
        raise ShardConfigError(
            f"--s3-profile {storage.s3_profile!r} is not a profile of the AWS config files (AWS_CONFIG_FILE / "
            f"AWS_SHARED_CREDENTIALS_FILE, default ~/.aws/config and ~/.aws/credentials; profiles there: {listed}); "
            "pass one of them, or leave --s3-profile out to use AWS_PROFILE or the default credential chain")
