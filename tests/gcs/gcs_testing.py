"""Helpers for the gs:// tests: start the GCS emulator, write and upload lane files."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import requests

from loader.io import gcs
from loader.order.hashing import sha256_hex
from loader.io.manifest import FileEntry, lane_file_path

BUCKET = "zephon-test"


def die_with_parent() -> None:
    """``preexec_fn``: SIGTERM this child when the test process dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the fixture's teardown still stops it


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Emulator:
    endpoint: str
    bucket: str

    def url(self, name: str) -> str:
        return f"gs://{self.bucket}/{name}"


def start_emulator() -> tuple[subprocess.Popen, str]:
    base = [sys.executable, "-m", "gcp_storage_emulator"]  # this interpreter's package, no shim
    for _ in range(3):  # the free port can be taken between probe and bind: try another
        port = _free_port()
        proc = subprocess.Popen(
            base + ["start", "--host=127.0.0.1", f"--port={port}", "--in-memory", "-q"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent,
        )
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if requests.get(endpoint + "/", timeout=1).ok:
                    return proc, endpoint
            except requests.RequestException:
                time.sleep(0.1)
        proc.kill()
        proc.wait(5)
    raise RuntimeError("the GCS emulator did not start (is gcp-storage-emulator installed?)")


# -- lane files --------------------------------------------------------------------------
def make_lane_file(rows: int, seed: int, row_group_rows: int) -> bytes:
    """A lane-format Parquet file (zstd, page checksums), poorly compressible so it is big."""
    rng = np.random.default_rng(seed)
    keys = [f"doc-{seed}-{k:07d}" for k in range(rows)]
    noise = rng.integers(0, 2**63, size=(rows, 24), dtype=np.int64)
    texts = [" ".join(format(int(v), "x") for v in row) for row in noise]
    table = pa.table({
        "key": pa.array(keys, pa.string()),
        "order_key": pa.array(np.sort(rng.integers(0, 2**63, size=rows)).astype(np.uint64)),
        "text": pa.array(texts, pa.string()),
    })
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", row_group_size=row_group_rows, write_page_checksum=True)
    return sink.getvalue()


@dataclass(frozen=True)
class LaneFile:
    dataset: str  # gs://bucket/prefix
    local_dataset: str
    entry: FileEntry
    data: bytes

    @property
    def url(self) -> str:
        return f"{self.dataset}/{self.entry.path}"


def upload_lane_file(emulator: Emulator, local_root: str, prefix: str, data: bytes,
                     lane: int = 0, part: int = 0) -> LaneFile:
    rel = lane_file_path(lane, part)
    local_path = os.path.join(local_root, rel)
    os.makedirs(os.path.dirname(local_path), exist_ok=True)
    with open(local_path, "wb") as fh:
        fh.write(data)
    dataset = emulator.url(prefix)
    gcs.write_bytes(f"{dataset}/{rel}", data)
    metadata = pq.ParquetFile(io.BytesIO(data)).metadata
    entry = FileEntry(path=rel, lane=lane, part=part, rows=metadata.num_rows, bytes=len(data),
                      sha256=sha256_hex(data), row_groups=metadata.num_row_groups)
    return LaneFile(dataset, local_root, entry, data)
