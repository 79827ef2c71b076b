"""What every storage backend shares: the read options, the error types and file hashing.

Its own module so that the backends (:mod:`loader.io.backends` and its implementations
:mod:`loader.io.local`, :mod:`loader.io.gcs`, :mod:`loader.io.s3`, and :mod:`loader.io.cache`)
depend on it and not on each other: the registry imports a remote backend on first use
(google-cloud-storage and boto3 are slow to import), and none imports back.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import ClassVar, Optional

from loader import validation as rules
from loader.errors import ConfigError
from loader.errors import StorageError, StorageNotFoundError  # noqa: F401  (also importable from here)

# The form of every SHA-256 a manifest records (lowercase hex).
SHA256_HEX = re.compile(r"[0-9a-f]{64}")



_MIB = 1024**2
CHECKSUM_ATTEMPTS = 2  # a whole download whose sha256 mismatches the manifest is fetched once more, then fails


@dataclass(frozen=True)
class StorageOptions:
    """How the loader reads lane files (the loader config's ``storage`` table and top-level storage fields).

    The retry fields bound every remote request (``gs://``, ``s3://``): a request that fails with a
    transient error (HTTP 408/429/5xx, connection reset, timeout, truncated body) is retried
    with exponential backoff and full jitter, at most ``retry_max_attempts`` times and no
    longer than ``retry_deadline_s`` (plus the attempt in flight, itself bounded by
    ``request_timeout_s``). Permanent errors (404, 403, checksum mismatch) are not retried.
    """

    cache_dir: Optional[str] = None  # local cache for remote lane files (None = no cache)
    cache_max_bytes: int = 10 * 1024**3
    verify_checksums: bool = True  # compare with the manifest's sha256 where the file is read whole
    verify_local_files: bool = False  # sha256 of local lane files on first open
    endpoint: Optional[str] = None  # explicit GCS endpoint (else STORAGE_EMULATOR_HOST / Google)
    # s3:// (loader.io.s3); each None = boto3's own lookup: AWS_ENDPOINT_URL(_S3), AWS_DEFAULT_REGION
    # or AWS_REGION, AWS_PROFILE, ~/.aws/config and credentials (docs/guides/s3.md)
    s3_endpoint_url: Optional[str] = None  # an S3-compatible store (MinIO, R2, Ceph): http(s)://host:port
    s3_region: Optional[str] = None
    s3_profile: Optional[str] = None  # a profile of ~/.aws/config (credentials, region, endpoint_url)
    retry_max_attempts: int = 8  # attempts per request, the first one included
    retry_initial_backoff_s: float = 0.5  # backoff cap before the 1st retry; doubles each retry
    retry_max_backoff_s: float = 16.0  # ceiling of the backoff cap
    retry_deadline_s: float = 120.0  # no new attempt starts after this many seconds
    request_timeout_s: float = 60.0  # connect/read timeout of one HTTP request
    readahead_bytes: int = 8 * _MIB  # ranged-read window (memory per open remote file)
    whole_file_max_bytes: int = 4 * _MIB  # remote files up to this size are fetched whole + sha256-checked

    # Checked by loader.validation; the LoaderConfig ``storage`` table reuses these rules.
    FIELD_RULES: ClassVar[dict] = {
        "cache_dir": rules.OrAbsent(rules.FilePath()),
        "cache_max_bytes": rules.Integer(minimum=1),
        "verify_checksums": rules.Boolean(),
        "verify_local_files": rules.Boolean(),
        "endpoint": rules.OrAbsent(rules.Text()),
        "s3_endpoint_url": rules.OrAbsent(rules.Text()),
        "s3_region": rules.OrAbsent(rules.Text()),
        "s3_profile": rules.OrAbsent(rules.Text()),
        "retry_max_attempts": rules.Integer(minimum=1),
        "retry_initial_backoff_s": rules.Number(minimum=0),
        "retry_max_backoff_s": rules.Number(minimum=0),
        "retry_deadline_s": rules.Number(minimum=0),
        "request_timeout_s": rules.Number(minimum=0, exclusive=True,
                                           hint="a request without a timeout can hang forever"),
        "readahead_bytes": rules.Integer(minimum=1),
        "whole_file_max_bytes": rules.Integer(minimum=0),
    }
    FIELD_DOCS: ClassVar[dict[str, str]] = {
        "cache_dir": "Local directory of whole, verified copies of remote lane files; absent: ranged reads. Must "
                     "be on a local filesystem (it uses `flock`); safe to share between processes and runs.",
        "cache_max_bytes": "Size bound of completed cache entries (least recently used evicted first); a larger "
                           "file is read uncached, with a warning.",
        "verify_checksums": "Compare SHA-256 with the manifest wherever a file is read whole: remote files up to "
                            "`whole_file_max_bytes`, every cache fill and every open of a cached copy.",
        "verify_local_files": "Hash every local lane file once per process, on first open, against the manifest.",
        "endpoint": "GCS endpoint of an emulator or test server, used with anonymous credentials (the loader "
                    "config's `storage_endpoint`). Default: `STORAGE_EMULATOR_HOST`, else Google with ADC.",
        "s3_endpoint_url": "Endpoint of an S3-compatible store (MinIO, R2, Ceph), `http(s)://host:port`. Default: "
                           "`AWS_ENDPOINT_URL`, the profile's `endpoint_url`, else AWS ([S3](../guides/s3.md)).",
        "s3_region": "AWS region of `s3://` buckets. Default: `AWS_REGION` / `AWS_DEFAULT_REGION`, the profile's "
                     "region.",
        "s3_profile": "A profile of `~/.aws/config` / `~/.aws/credentials` (credentials, region, endpoint). "
                      "Default: `AWS_PROFILE`, else the standard credential chain.",
        "retry_max_attempts": "Attempts per request on transient errors (HTTP 408/429/500/502/503/504, connection "
                              "resets, timeouts, truncated bodies, checksum errors in transit).",
        "retry_initial_backoff_s": "Exponential backoff with full jitter: the wait before retry k is uniform in "
                                   "[0, min(`retry_max_backoff_s`, `retry_initial_backoff_s` x 2^k)] s.",
        "retry_max_backoff_s": "Ceiling of that backoff.",
        "retry_deadline_s": "No new attempt starts after this many seconds.",
        "request_timeout_s": "Read timeout of one HTTP request (connect timeout min(10 s, this)).",
        "readahead_bytes": "Ranged-read window: the memory per open remote lane file, and the smallest ranged GET.",
        "whole_file_max_bytes": "Remote lane files up to this size are fetched in one GET and checked against the "
                                "manifest SHA-256.",
    }

    def __post_init__(self) -> None:
        rules.validate_instance(self, ConfigError, "StorageOptions")


HASH_CHUNK_BYTES = 4 * _MIB


def sha256_of_file(handle) -> str:
    """Hex SHA-256 of ``handle`` from its position to its end, in 4 MiB chunks.

    The one way lane files are hashed after they are written: cached copies
    (:mod:`loader.io.cache`) and local lane files (``verify_local_files``). An Arrow file
    hands out its chunks without a copy (``read_buffer``); hashlib releases the GIL while
    it hashes a large chunk, so a read-ahead thread hashing a file leaves the trainer's
    thread free.
    """
    read = getattr(handle, "read_buffer", None) or handle.read
    sha = hashlib.sha256()
    while len(chunk := read(HASH_CHUNK_BYTES)):
        sha.update(chunk)
    return sha.hexdigest()
