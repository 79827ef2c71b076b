"""``s3://`` on boto3: the ``s3`` storage backend (:mod:`loader.io.backends`).

Guarantees, the same as ``gs://``'s (:mod:`loader.io.gcs`):

* **Pinned at open.** A metadata request (HEAD) records the object's ETag and, in a
  versioned bucket, its version id; every ranged GET after it names that version
  (``VersionId``) and sends ``If-Match: <ETag>``. An object replaced mid-run either keeps
  being read from the version that was opened (versioned bucket: identical bytes) or fails
  the next read with HTTP 412, raised as a :class:`StorageError` naming the object: bytes of
  two versions are never mixed. A deleted object fails with :class:`StorageNotFoundError`.
* **Verified.** Lane files are checked against the manifest: the size before any data
  moves; the store's own SHA-256 when the object has one (``ChecksumSHA256``, which the
  Beam job asks for on every upload) before any data moves; the manifest's SHA-256 when
  read whole or through the cache; Parquet page checksums on ranged reads. Other whole
  objects (manifests, tokenizers, templates, images) are checked by boto3 against the
  object's own checksum in transit (``ChecksumMode``).
* **Retries with a budget.** botocore's own retries are off; every request goes through
  :func:`loader.io.retries.run_with_retries` (HTTP 408/429/5xx, ``SlowDown``, resets,
  timeouts, truncated bodies), so one budget (``retry_*``) bounds ``gs://`` and ``s3://``.
  Permanent errors (missing bucket or object, access denied, bad credentials) are raised at
  once, naming the object and the fix.
* **Writes are atomic.** One ``PutObject`` per object (an object appears whole or not at
  all), with ``ChecksumAlgorithm=SHA256`` so S3 verifies the upload and keeps the digest.

Credentials and endpoint: boto3's own chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``~/.aws/config`` and
``credentials``, SSO, instance and container roles), ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL`` for S3-compatible stores, ``AWS_DEFAULT_REGION`` (or ``AWS_REGION``);
:class:`StorageOptions` ``s3_endpoint_url``, ``s3_region`` and ``s3_profile`` take
precedence. One client per process and configuration, re-created after ``fork``.
"""

from __future__ import annotations

import base64
import http.client
import os
from dataclasses import dataclass
from typing import BinaryIO, Callable, Optional, TypeVar

import boto3
import botocore.config
import botocore.exceptions as boto_exceptions
import urllib3

from loader.io import remote_files
from loader.io.backends import ObjectInfo, StorageBackend, register_backend, split_bucket_path
from loader.io.clients import PerProcessClients
from loader.io.remote_files import RangedReader
from loader.io.retries import TRANSIENT_STATUS, RetryPolicy, TruncatedRead, run_with_retries
from loader.errors import StorageError, StorageNotFoundError
from loader.io.storage_options import StorageOptions

T = TypeVar("T")
SCHEME = "s3://"
MAX_PUT_BYTES = 5 * 1024**3  # S3's limit for one PutObject
_TRANSIENT_CODES = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                              "ThrottlingException", "RequestLimitExceeded", "RequestThrottled",
                              "RequestTimeTooSkewed", "OperationAborted"})
_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                               "TokenRefreshRequired", "AuthorizationHeaderMalformed"})
CREDENTIALS_HINT = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary "
                    "credentials), or AWS_PROFILE / StorageOptions.s3_profile naming a profile of ~/.aws/config")


# -- paths ------------------------------------------------------------------------------
@dataclass(frozen=True)
class S3Path:
    bucket: str
    key: str  # may be "" (the bucket itself) or a prefix

    @classmethod
    def parse(cls, path: str) -> "S3Path":
        return cls(*split_bucket_path(path, "s3"))

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


# -- one client per process and configuration -------------------------------------------
@dataclass(frozen=True)
class ClientKey:
    endpoint_url: Optional[str]
    region: Optional[str]
    profile: Optional[str]
    connect_timeout_s: float
    read_timeout_s: float

    @classmethod
    def of(cls, options: StorageOptions, policy: RetryPolicy) -> "ClientKey":
        connect, read = policy.timeout
        return cls(endpoint_url(options), region(options), options.s3_profile, connect, read)


def endpoint_url(options: StorageOptions) -> Optional[str]:
    """``s3_endpoint_url``, else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, else None (AWS).

    Resolved here rather than left to botocore so that a custom endpoint also gets path-style
    addressing (``http://host/bucket/key``: what MinIO, Ceph and emulators expect).
    """
    chosen = (options.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
              or os.environ.get("AWS_ENDPOINT_URL") or None)
    if chosen and "://" not in chosen:
        chosen = "https://" + chosen
    return chosen.rstrip("/") if chosen else None


def region(options: StorageOptions) -> Optional[str]:
    """``s3_region``, else ``AWS_DEFAULT_REGION`` (botocore reads it), else ``AWS_REGION``, else
    None (botocore: the profile's region)."""
    if options.s3_region:
        return options.s3_region
    if os.environ.get("AWS_DEFAULT_REGION"):
        return None  # botocore reads it (and a profile's region) itself
    return os.environ.get("AWS_REGION") or None


def client(options: StorageOptions, policy: RetryPolicy):
    """The process's boto3 S3 client for this configuration (boto3 clients are thread-safe)."""
    return _clients.get(ClientKey.of(options, policy))


def _make_client(key: ClientKey):
    try:
        session = boto3.session.Session(profile_name=key.profile)  # Sessions are not thread-safe: one each
    except boto_exceptions.ProfileNotFound as exc:
        raise StorageError(f"s3:// access: the AWS profile {key.profile!r} is not in ~/.aws/config or "
                           f"~/.aws/credentials ({exc}); fix AWS_PROFILE / StorageOptions.s3_profile") from exc
    config = botocore.config.Config(
        retries={"total_max_attempts": 1},  # one retry loop, with the project's budget: ours
        connect_timeout=key.connect_timeout_s, read_timeout=key.read_timeout_s,
        max_pool_connections=32,  # read-ahead threads of one process share the client
        # botocore hashes a response only where asked (ChecksumMode): read_bytes asks, lane-file
        # reads do not, their bytes being hashed against the manifest or checked page by page
        # already (a second SHA-256 of each whole-object GET cost 2-3x its time on loopback).
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"} if key.endpoint_url else None,
    )
    return session.client("s3", endpoint_url=key.endpoint_url, region_name=key.region, config=config)


_clients: PerProcessClients[ClientKey, object] = PerProcessClients(_make_client)


# -- errors -----------------------------------------------------------------------------
def _status(exc: BaseException) -> Optional[int]:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, boto_exceptions.ClientError):
        return _code(exc) in _TRANSIENT_CODES or _status(exc) in TRANSIENT_STATUS
    return isinstance(exc, (
        TruncatedRead,
        boto_exceptions.FlexibleChecksumError,  # the body's checksum failed in transit: fetch again
        boto_exceptions.EndpointConnectionError,  # refused, unreachable (a store restarting)
        boto_exceptions.ConnectionClosedError,
        boto_exceptions.ReadTimeoutError,
        boto_exceptions.ConnectTimeoutError,
        boto_exceptions.IncompleteReadError,
        boto_exceptions.ResponseStreamingError,  # broken mid-body
        boto_exceptions.ProxyConnectionError,
        urllib3.exceptions.ProtocolError,
        http.client.IncompleteRead,
        ConnectionError,
        TimeoutError,
    ))


def _where(options: StorageOptions) -> str:
    endpoint = endpoint_url(options)
    return f"endpoint {endpoint}" if endpoint else "AWS (no AWS_ENDPOINT_URL / s3_endpoint_url)"


def permanent_error(options: StorageOptions) -> Callable[[str, str, BaseException], StorageError]:
    def error(obj: str, action: str, exc: BaseException) -> StorageError:
        code, status = _code(exc), _status(exc)
        if isinstance(exc, (boto_exceptions.NoCredentialsError, boto_exceptions.PartialCredentialsError)):
            return StorageError(f"{obj}: no usable AWS credentials found while trying to {action} ({exc}); "
                                f"{CREDENTIALS_HINT}")
        if code == "NoSuchBucket":
            return StorageNotFoundError(
                f"{obj}: the bucket {S3Path.parse(obj).bucket!r} does not exist at {_where(options)} (while trying "
                f"to {action}); check the bucket name, the endpoint (AWS_ENDPOINT_URL / s3_endpoint_url) and "
                "the region (AWS_DEFAULT_REGION / s3_region)")
        if code in ("NoSuchKey", "NoSuchVersion") or status == 404:
            return StorageNotFoundError(
                f"{obj} does not exist (while trying to {action}): it was deleted, never written, or "
                "replaced while being read. If a manifest lists it, the dataset is incomplete: re-run "
                "the Beam job or restore the object.")
        if code in _CREDENTIAL_CODES:
            return StorageError(f"{obj}: the AWS credentials were refused ({code}, HTTP {status}) while trying to "
                                f"{action}: the access key is unknown or the secret is wrong for {_where(options)}; "
                                f"{CREDENTIALS_HINT}")
        if code == "AccessDenied" or status in (401, 403):
            return StorageError(
                f"{obj}: access denied ({code or 'HTTP'} {status}) while trying to {action}. The credentials in "
                "use need s3:GetObject and s3:ListBucket on the bucket (s3:PutObject to write); check "
                f"`aws sts get-caller-identity` and the bucket policy, or {CREDENTIALS_HINT}")
        if code == "PreconditionFailed" or status == 412:
            return StorageError(
                f"{obj} changed while being read (HTTP 412: its ETag is no longer the one pinned at open): "
                "something rewrote it; datasets are immutable once their manifest exists, so re-run the Beam "
                "job to a new path (or enable bucket versioning, and the opened version keeps being read).")
        return StorageError(f"{obj}: cannot {action}: {exc!r:.500} (not a transient error, not retried)")

    return error


def with_retries(obj: str, action: str, fn: Callable[[], T], options: StorageOptions,
                 policy: RetryPolicy) -> T:
    """``fn()``, retried on transient errors within ``policy``; StorageError otherwise."""
    return run_with_retries(obj, action, fn, policy, is_transient=is_transient,
                            permanent_error=permanent_error(options))


def _read_body(response, expected: Optional[int]) -> bytes:
    body = response["Body"]
    try:
        data = body.read()
    finally:
        body.close()
    if expected is not None and len(data) != expected:
        raise TruncatedRead(f"asked for {expected} bytes, got {len(data)}")
    return data


# -- ranged reads of a pinned version ---------------------------------------------------
@dataclass(frozen=True)
class S3Object:
    """One version of one object, as a HEAD saw it (a :class:`~loader.io.remote_files.PinnedObject`)."""

    url: str
    bucket: str
    key: str
    size: int
    etag: str
    version_id: Optional[str]
    sha256: Optional[str]  # hex, when S3 keeps a full-object SHA-256 checksum
    options: StorageOptions

    def fetch(self, start: int, end: int, policy: RetryPolicy) -> bytes:
        """Bytes ``[start, end)`` of this version (If-Match its ETag), retried until complete."""
        if start >= end:
            return b""
        pin = {"IfMatch": self.etag}
        if self.version_id is not None:
            pin["VersionId"] = self.version_id

        def once() -> bytes:
            response = client(self.options, policy).get_object(
                Bucket=self.bucket, Key=self.key, Range=f"bytes={start}-{end - 1}", **pin)
            return _read_body(response, end - start)

        return with_retries(self.url, f"read bytes {start}-{end - 1}", once, self.options, policy)

    def info(self) -> ObjectInfo:
        version = self.version_id if self.version_id is not None else f"etag:{self.etag}"
        return ObjectInfo(self.url, self.size, version, f"sha256:{self.sha256}" if self.sha256 else None)


def _full_object_sha256(head: dict) -> Optional[str]:
    value = head.get("ChecksumSHA256")
    if not value or "-" in value or head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None  # a multipart upload's checksum of checksums, not the object's digest
    return base64.b64decode(value).hex()


def _head(path: str, options: StorageOptions) -> S3Object:
    loc, policy = S3Path.parse(path), RetryPolicy.from_options(options)
    c = client(options, policy)

    def once() -> dict:
        try:
            return c.head_object(Bucket=loc.bucket, Key=loc.key, ChecksumMode="ENABLED")
        except boto_exceptions.ClientError as exc:
            if _status(exc) != 404:
                raise
            # A HEAD has no body to say which is missing: ask about the bucket once.
            try:
                c.list_objects_v2(Bucket=loc.bucket, MaxKeys=1)
            except boto_exceptions.ClientError as listing:
                if _code(listing) == "NoSuchBucket":
                    raise listing from exc
            raise

    head = with_retries(path, "read metadata", once, options, policy)
    return S3Object(path, loc.bucket, loc.key, int(head["ContentLength"]), head["ETag"],
                    head.get("VersionId") if head.get("VersionId") not in (None, "null") else None,
                    _full_object_sha256(head), options)


# -- the backend ------------------------------------------------------------------------
class S3Backend(StorageBackend):
    scheme = "s3"
    # The job reads and writes s3:// through this backend, not Beam's S3 filesystem: Beam's
    # reads are not pinned (a replaced input would mix versions), it needs --s3_* pipeline
    # options in the launcher before any pipeline exists, its rename is copy + delete, and
    # its errors do not name the fix (docs/guides/s3.md, "The Beam job").
    beam_filesystem = False

    def exists(self, path: str, options: StorageOptions) -> bool:
        loc, policy = S3Path.parse(path), RetryPolicy.from_options(options)
        c = client(options, policy)

        def probe() -> bool:
            if loc.key:
                try:
                    c.head_object(Bucket=loc.bucket, Key=loc.key)
                    return True
                except boto_exceptions.ClientError as exc:
                    if _status(exc) != 404:
                        raise
            prefix = loc.key.rstrip("/") + "/" if loc.key else ""
            return c.list_objects_v2(Bucket=loc.bucket, Prefix=prefix, MaxKeys=1).get("KeyCount", 0) > 0

        return with_retries(path, "check existence", probe, options, policy)

    def stat(self, path: str, options: StorageOptions) -> ObjectInfo:
        return _head(path, options).info()

    def read_bytes(self, path: str, options: StorageOptions) -> bytes:
        loc, policy = S3Path.parse(path), RetryPolicy.from_options(options)

        def once() -> bytes:
            response = client(options, policy).get_object(Bucket=loc.bucket, Key=loc.key, ChecksumMode="ENABLED")
            return _read_body(response, int(response["ContentLength"]))

        return with_retries(path, "download", once, options, policy)

    def open_input(self, path: str, options: StorageOptions) -> BinaryIO:
        return RangedReader(_head(path, options), RetryPolicy.from_options(options), options.readahead_bytes)

    def open_lane_file(self, path: str, entry, options: StorageOptions) -> BinaryIO:
        def pin() -> S3Object:
            obj = _head(path, options)
            if options.verify_checksums and obj.sha256 is not None and obj.sha256 != entry.sha256 \
                    and obj.size == entry.bytes:
                raise StorageError(
                    f"{path}: S3's SHA-256 of the object ({obj.sha256[:16]}...) is not the manifest's "
                    f"({entry.sha256[:16]}...; size matches): the object was overwritten after the manifest "
                    "was written; re-run the Beam job or restore the object")
            return obj

        return remote_files.open_remote_lane_file(path, entry, options, pin)

    def list_objects(self, path: str, options: StorageOptions) -> list[ObjectInfo]:
        loc, policy = S3Path.parse(path), RetryPolicy.from_options(options)

        def listing() -> list[ObjectInfo]:
            pages = client(options, policy).get_paginator("list_objects_v2").paginate(
                Bucket=loc.bucket, Prefix=loc.key)
            return sorted((ObjectInfo(f"{SCHEME}{loc.bucket}/{item['Key']}", int(item["Size"]),
                                      f"etag:{item['ETag']}", None)
                           for page in pages for item in page.get("Contents", ())), key=lambda o: o.url)

        return with_retries(path, "list objects", listing, options, policy)

    def write_atomically(self, path: str, data: bytes, options: StorageOptions) -> None:
        if len(data) > MAX_PUT_BYTES:
            raise StorageError(f"{path}: {len(data)} bytes is more than one S3 PutObject takes ({MAX_PUT_BYTES}); "
                               "write smaller lane files (zephon shard --target-file-mb)")
        loc, policy = S3Path.parse(path), RetryPolicy.from_options(options)
        # Retried as a whole: rewriting the same bytes is idempotent, and a PUT is atomic.
        with_retries(path, "upload", lambda: client(options, policy).put_object(
            Bucket=loc.bucket, Key=loc.key, Body=data, ChecksumAlgorithm="SHA256"), options, policy)

    def delete(self, path: str, options: StorageOptions) -> None:
        loc, policy = S3Path.parse(path), RetryPolicy.from_options(options)
        with_retries(path, "delete", lambda: client(options, policy).delete_object(
            Bucket=loc.bucket, Key=loc.key), options, policy)


register_backend(S3Backend())
