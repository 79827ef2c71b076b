"""Helpers for the s3:// tests: a moto S3 server on loopback, S3 fault injection, uploads.

The server is moto's own HTTP server (``ThreadedMotoServer``: a real S3 API over TCP on
127.0.0.1), so requests go through boto3, botocore's HTTP stack and the wire exactly as
they would against AWS; nothing inside the client is patched. Faults come from
:class:`S3FaultProxy`, the GCS tests' proxy (:mod:`tests.gcs.faults`) speaking S3's error
format, or from the server itself (stopped, objects deleted or replaced, auth switched on).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import requests
from moto.server import ThreadedMotoServer

from loader.commands.fingerprints import collect_fingerprints
from loader.config import LoaderConfig
from loader.io import s3, storage
from loader.io.retries import RetryPolicy
from loader.io.storage_options import StorageOptions
from tests.gcs.faults import Fault, FaultProxy

TOKENIZER = str(Path(__file__).resolve().parents[2] / "beam_jobs" / "assets" / "tokenizer.json")
BUCKET = "zephon-test"
REGION = "us-east-1"
# moto accepts any key unless auth is switched on (MotoS3.require_auth); these are the test's own.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "zephon-test-key", "AWS_SECRET_ACCESS_KEY": "zephon-test-secret"}
# Variables of the developer's machine that would point boto3 elsewhere during the tests.
FOREIGN_AWS_VARIABLES = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                         "AWS_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


def start_server() -> tuple[ThreadedMotoServer, str]:
    """A moto S3 server on 127.0.0.1 and a free port, and its endpoint URL."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def restart_on(endpoint: str) -> ThreadedMotoServer:
    """A new server on the port of ``endpoint`` (moto's state is per process: the objects are still there)."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(endpoint.rsplit(":", 1)[1]), verbose=False)
    server.start()
    return server


def raw_client(endpoint: str):
    """A boto3 client of the project's backend (no retries), for test set-up and damage."""
    options = StorageOptions(s3_endpoint_url=endpoint)
    return s3.client(options, RetryPolicy.from_options(options))


@dataclass(frozen=True)
class MotoS3:
    endpoint: str
    bucket: str

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def require_auth(self, on: bool) -> None:
        """Switch moto's signature and access-key checks on (every request) or off (moto's default)."""
        answer = requests.post(f"{self.endpoint}/moto-api/reset-auth", data=b"0" if on else b"inf", timeout=10)
        answer.raise_for_status()


def loader_config(path: str, *, seq_len: int, tokenizer: str = TOKENIZER, **overrides) -> LoaderConfig:
    """The tests' loader config over one dataset: global batch 8 in micro-batches of 2, no workers."""
    fields = dict(datasets=[{"path": path}], seq_len=seq_len, global_batch_size=8, micro_batch_size=2, seed=3,
                  tokenizer=tokenizer, num_workers=0, worker_timeout_s=60.0)
    fields.update(overrides)
    return LoaderConfig(**fields)


def fingerprint_lines(config: LoaderConfig, steps: int, world_size: int = 1) -> list[str]:
    results, _ = collect_fingerprints(config, world_size=world_size, end_step=steps)
    return [r.line() for r in results]


def upload_tree(local_dir: str, remote_dir: str) -> None:
    """Copy a local directory to s3://, files in name order with ``manifest.json`` last (like the Beam job)."""
    files = sorted(str(p.relative_to(local_dir)) for p in Path(local_dir).rglob("*") if p.is_file())
    files.sort(key=lambda rel: rel == "manifest.json")
    for rel in files:
        storage.write_atomically(f"{remote_dir}/{rel}", (Path(local_dir) / rel).read_bytes())


# -- faults -----------------------------------------------------------------------------
@dataclass
class S3Fault(Fault):
    """A :class:`tests.gcs.faults.Fault` for S3: ``match`` is ``get`` (object GETs), ``head``
    (object metadata) or ``any``; a ``status`` answer carries S3's XML error (``code``)."""

    MATCHES = ("get", "head", "any")
    match: str = "get"
    code: str = "SlowDown"

    def error_body(self) -> tuple[bytes, str]:
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{self.code}</Code>'
                f"<Message>injected by the test proxy</Message></Error>").encode()
        return body, "application/xml"

    def matches(self, method: str, path: str) -> bool:
        is_object = "list-type=" not in path and path.count("/") >= 2
        if self.match == "get":
            return method == "GET" and is_object
        if self.match == "head":
            return method == "HEAD"
        return True


class S3FaultProxy(FaultProxy):
    """The fault proxy in front of moto; point ``s3_endpoint_url`` at :attr:`endpoint`."""

    def object_gets(self, name_part: str = "") -> list:
        with self._lock:
            return [r for r in self.log if r.method == "GET" and "list-type=" not in r.path and name_part in r.path]


def set_test_environment(endpoint: str) -> dict:
    """Point boto3 at ``endpoint`` through the standard variables; returns what to restore."""
    wanted = {**CREDENTIALS, "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": endpoint}
    previous = {name: os.environ.get(name) for name in (*wanted, *FOREIGN_AWS_VARIABLES)}
    for name in FOREIGN_AWS_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(wanted)
    return previous


def restore_environment(previous: dict) -> None:
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
