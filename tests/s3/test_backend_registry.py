"""The backend protocol is complete: a backend defined in this test file, registered for a
new scheme, serves a whole dataset to the loader with the local batches, and nothing in the
loader names the scheme. Plus the registry's own rules."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from dataset_factory import synthetic_texts, write_dataset
from loader.io import backends, remote_files, storage
from loader.io.backends import ObjectInfo, StorageBackend, UnsupportedSchemeError, register_backend
from loader.io.retries import RetryPolicy
from loader.io.storage import StorageNotFoundError, StorageOptions
from tests.s3.s3_testing import fingerprint_lines, loader_config


class _MemoryObject:
    def __init__(self, url: str, data: bytes) -> None:
        self.url, self.size, self._data = url, len(data), data

    def fetch(self, start: int, end: int, policy: RetryPolicy) -> bytes:
        return self._data[start:end]


class MemoryBackend(StorageBackend):
    """``mem://`` objects in a dict: the smallest complete backend."""

    scheme = "mem"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lane_opens = 0

    def _get(self, path: str) -> bytes:
        if path not in self.objects:
            raise StorageNotFoundError(f"{path} does not exist")
        return self.objects[path]

    def exists(self, path, options):
        return path in self.objects or any(k.startswith(path.rstrip("/") + "/") for k in self.objects)

    def stat(self, path, options):
        return ObjectInfo(path, len(self._get(path)), None, None)

    def read_bytes(self, path, options):
        return self._get(path)

    def open_input(self, path, options):
        return io.BytesIO(self._get(path))

    def open_lane_file(self, path, entry, options):
        self.lane_opens += 1
        return remote_files.open_remote_lane_file(path, entry, options, lambda: _MemoryObject(path, self._get(path)))

    def list_objects(self, path, options):
        return [self.stat(k, options) for k in sorted(self.objects) if k.startswith(path)]

    def write_atomically(self, path, data, options):
        self.objects[path] = bytes(data)

    def delete(self, path, options):
        self.objects.pop(path, None)


@pytest.fixture
def memory_backend():
    backend = MemoryBackend()
    register_backend(backend)
    yield backend
    del backends._registry["mem"]  # unregistered again: later tests see only the built-in schemes


def test_a_backend_registered_from_a_test_serves_the_loader(memory_backend, tmp_path):
    local = str(tmp_path / "ds")
    write_dataset(local, synthetic_texts(60, seed=2), num_lanes=2, seed=4, source_name="mem")
    for path in sorted(Path(local).rglob("*"), key=lambda p: p.name == "manifest.json"):
        if path.is_file():
            storage.write_atomically(f"mem://data/ds/{path.relative_to(local)}", path.read_bytes())
    assert "mem" in backends.supported_schemes()
    expected = fingerprint_lines(loader_config(local, seq_len=64), steps=6)
    assert fingerprint_lines(loader_config("mem://data/ds", seq_len=64), steps=6) == expected
    assert memory_backend.lane_opens >= 2  # every lane file came through the backend
    assert storage.list_prefix("mem://data/ds/lane=00000/") == [
        f"mem://data/ds/{p.relative_to(local)}" for p in sorted(Path(local, "lane=00000").iterdir())]


def test_scheme_rules():
    assert backends.scheme_of("S3://Bucket/key") == "s3" and backends.scheme_of("/abs/path") == ""
    assert backends.scheme_of("relative/dir") == "" and backends.scheme_of("s3:/one-slash") == ""
    assert backends.is_remote("az://c/x") and not backends.is_remote(os.path.join("a", "b"))
    assert backends.backend_for("relative/dir").join("a", "b") == os.path.join("a", "b")
    assert storage.join("s3://b/ds/", "lane=00001", "part-00000.parquet") == "s3://b/ds/lane=00001/part-00000.parquet"
    with pytest.raises(UnsupportedSchemeError, match="the storage scheme az:// is not supported; supported: "):
        backends.backend_for("az://c/x")
    with pytest.raises(TypeError, match="needs a StorageBackend"):
        register_backend(object())  # type: ignore[arg-type]
    with pytest.raises(storage.StorageError, match="no bucket name; write s3://BUCKET/prefix"):
        storage.read_bytes("s3:///key", StorageOptions())
