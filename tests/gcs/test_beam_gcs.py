"""Beam on gs:// against the emulator: FileSystems calls, and the sharding job itself.

Beam's ``gcsio`` would spend ~27 s per process looking for Application Default
Credentials; :func:`loader.io.gcs.beam_gcs_test_setup` gives it an anonymous emulator client
instead, so these run in seconds. They use the in-process FnApiRunner (worker processes
would not inherit the setup).
"""

from __future__ import annotations

import io
import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loader.io import gcs, storage

pytestmark = [pytest.mark.gcs, pytest.mark.beam, pytest.mark.timeout(120)]


@pytest.fixture
def beam_on_emulator(emulator):
    restore = gcs.beam_gcs_test_setup(emulator.endpoint)
    yield emulator
    restore()


def _write_part(index: int, base: str) -> str:
    # The shard job's write pattern: create "<name>.inprogress", write, close, rename.
    from apache_beam.io.filesystems import FileSystems

    table = pa.table({"lane": pa.array([index] * 1000, pa.int32()), "row": pa.array(range(1000), pa.int64())})
    path = f"{base}/lane={index:05d}/part-00000.parquet"
    handle = FileSystems.create(path + ".inprogress")
    pq.write_table(table, handle, write_page_checksum=True)
    handle.close()
    FileSystems.rename([path + ".inprogress"], [path])
    return path


def test_beam_filesystems_roundtrip_on_gcs(beam_on_emulator):
    import apache_beam as beam
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    base = beam_on_emulator.url("beam/roundtrip")
    start = time.monotonic()
    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as pipeline:
        _ = pipeline | beam.Create(range(3)) | beam.Map(_write_part, base)
    (result,) = FileSystems.match([f"{base}/lane=*/*"])
    paths = sorted(m.path for m in result.metadata_list)
    assert paths == [f"{base}/lane={i:05d}/part-00000.parquet" for i in range(3)]
    for index, path in enumerate(paths):
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as handle:
            table = pq.read_table(io.BytesIO(handle.read()))
        assert table.column("lane").to_pylist() == [index] * 1000
        assert storage.read_bytes(path)[:4] == b"PAR1"  # the loader sees the same objects
    assert not FileSystems.exists(paths[0] + ".inprogress")
    assert time.monotonic() - start < 15  # no credential lookup with its 20-30 s of backoff


def test_setup_needs_an_emulator(monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    with pytest.raises(ValueError, match="STORAGE_EMULATOR_HOST"):
        gcs.beam_gcs_test_setup()


def _corpus(path: str, count: int = 400) -> None:
    with open(path, "w") as fh:
        for k in range(count):
            words = " ".join(f"w{(k * 7 + j) % 97}" for j in range(5 + k % 40))
            fh.write(json.dumps({"id": f"doc-{k:05d}", "text": f"document {k}: {words}"}) + "\n")


def test_shard_job_writes_the_same_dataset_to_gcs_and_local(beam_on_emulator, tmp_path):
    shard = pytest.importorskip("beam_jobs.shard", reason="beam_jobs/shard.py is not there yet")
    from loader.io.manifest import read_manifest

    corpus = str(tmp_path / "corpus.jsonl")
    _corpus(corpus)
    common = ["--input", corpus, "--id-field", "id", "--num-lanes", "8", "--seed", "1",
              "--source-name", "corpus", "--target-file-mb", "0.002", "--runner=FnApiRunner"]
    local_dir = str(tmp_path / "local")
    remote_dir = beam_on_emulator.url("shard/ds")
    local = shard.run(common + ["--output", local_dir])
    remote = shard.run(common + ["--output", remote_dir])
    assert remote.dataset_fingerprint == local.dataset_fingerprint
    assert read_manifest(remote_dir).to_dict() == local.to_dict()
    assert len(remote.files) > 8  # several parts per lane: the sizes above force it
    for entry in remote.files:
        with open(os.path.join(local_dir, entry.path), "rb") as fh:
            assert gcs.read_bytes(storage.join(remote_dir, entry.path)) == fh.read(), entry.path
        handle = storage.open_lane_file(remote_dir, entry)
        assert pq.ParquetFile(handle, page_checksum_verification=True).read().num_rows == entry.rows
