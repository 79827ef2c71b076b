"""The whole loader on ``gs://``: the same global batches as from local disk, or a clear error.

Small lane datasets (a text one and a pre-tokenized one, 4 lanes, 2 files per lane) are
written locally by :mod:`tests.dataset_factory`, copied object by object to the emulator,
and read through :func:`loader.commands.fingerprints.collect_fingerprints`. The reference is the
local dataset's fingerprints (W=1, no workers): the loader's guarantee is that every
topology, worker count and storage gives those same bytes.

Requests for lane files go through the fault proxy where the test says so (config
``storage_endpoint``); the manifest is read through ``STORAGE_EMULATOR_HOST``. Lane files
here are ~10 KB, so they are fetched whole (sha256-checked) unless a test lowers
``whole_file_max_bytes`` to exercise the ranged reader under the loader.

Spawned workers take several seconds each to start on 2 cores (they import torch), so only
three tests use them (4 processes in all).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import re
import time
from pathlib import Path
from urllib.parse import quote

import pyarrow.parquet as pq
import pytest

from dataset_factory import synthetic_texts, write_dataset
from loader.io import gcs
from loader.config import LoaderConfig
from loader.commands.fingerprints import collect_fingerprints
from loader.io.integrity import LaneDataError
from loader.pipeline import WorkerError, ZephonLoader
from loader.io.storage import StorageError, StorageNotFoundError
from tests.gcs.faults import Fault

pytestmark = [pytest.mark.gcs, pytest.mark.timeout(60)]

TOKENIZER = str(Path(__file__).resolve().parents[2] / "beam_jobs" / "assets" / "tokenizer.json")
STEPS = 12  # x 8 x 256 tokens: lanes cross files; pre-tokenized alone, every lane wraps to epoch 1
KINDS = {"text": ("text",), "pretokenized": ("pretokenized",), "mix": ("text", "pretokenized")}
FIRST_FILE = "lane=00000/part-00000.parquet"  # read first: global index 0 is lane 0's


# -- datasets ----------------------------------------------------------------------------
def upload_dataset(local_dir: str, remote_dir: str) -> None:
    """Copy a local dataset to gs://, lane files first and the manifest last (like the Beam job)."""
    files = sorted(str(p.relative_to(local_dir)) for p in Path(local_dir).rglob("*") if p.is_file())
    files.sort(key=lambda rel: rel == "manifest.json")
    for rel in files:
        gcs.write_bytes(f"{remote_dir}/{rel}", (Path(local_dir) / rel).read_bytes())


@pytest.fixture(scope="module")
def datasets(emulator, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """kind -> (local directory, gs:// URL): the same bytes in both places."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("loader-ds")
    found = {}
    for kind, tokenizer, source, seed in [("text", None, "web", 5),
                                          ("pretokenized", Tokenizer.from_file(TOKENIZER), "code", 6)]:
        local = str(root / kind)
        write_dataset(local, synthetic_texts(160, seed=seed), num_lanes=4, seed=11, files_per_lane=2,
                      source_name=source, tokenizer=tokenizer)
        remote = emulator.url(f"loader/{kind}")
        upload_dataset(local, remote)
        found[kind] = (local, remote)
    return found


@pytest.fixture
def copy_of_text_dataset(datasets, emulator, request) -> tuple[str, str]:
    """A private gs:// copy of the text dataset, for tests that damage objects."""
    local, _ = datasets["text"]
    remote = emulator.url(f"loader/damaged/{request.node.name}".replace("[", "-").replace("]", ""))
    upload_dataset(local, remote)
    return local, remote


def make_config(paths, **overrides) -> LoaderConfig:
    fields = dict(datasets=[{"path": p} for p in paths], seq_len=256, global_batch_size=8,
                  micro_batch_size=2, seed=3, tokenizer=TOKENIZER, num_workers=0, worker_timeout_s=30.0)
    fields.update(overrides)
    return LoaderConfig(**fields)


def fingerprints(config: LoaderConfig, world_size: int = 1, steps: int = STEPS) -> list[str]:
    results, _ = collect_fingerprints(config, world_size=world_size, end_step=steps)
    return [r.line() for r in results]


@pytest.fixture(scope="module")
def reference(datasets):
    """Fingerprints of the local datasets (W=1, no workers, no cache), computed once per kind."""

    @functools.cache
    def of(kind: str) -> tuple[str, ...]:
        return tuple(fingerprints(make_config([datasets[k][0] for k in KINDS[kind]])))

    return of


def remote_paths(datasets, kind: str) -> list[str]:
    return [datasets[k][1] for k in KINDS[kind]]


# -- knobs the loader config does not expose ---------------------------------------------
@pytest.fixture
def quick_backoff(monkeypatch):
    """Retries in this process wait ~1/50 of the default backoff (full jitter kept)."""
    original = gcs.RetryPolicy.backoff_s
    monkeypatch.setattr(gcs.RetryPolicy, "backoff_s", lambda self, index: original(self, index) / 50)


@pytest.fixture
def ranged_reads(monkeypatch):
    """Make the loader read every remote lane file through ``RangedReader`` (4 KiB windows).

    Equivalent to ``storage = {whole_file_max_bytes = 0, readahead_bytes = 4096}`` in every
    config the test builds (the options travel to spawned workers inside the spec).
    """
    original = LoaderConfig.storage_options
    monkeypatch.setattr(LoaderConfig, "storage_options", lambda self: dataclasses.replace(
        original(self), whole_file_max_bytes=0, readahead_bytes=4096))


def lane_file_requests(proxy) -> list:
    return [r for r in proxy.log if "/o/" in r.path and "part-" in r.path]


# -- same batches ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
def test_gcs_dataset_gives_the_local_batches(datasets, reference, kind):
    got = fingerprints(make_config(remote_paths(datasets, kind)))
    assert got == list(reference(kind))
    assert len({line.split()[1] for line in got}) == STEPS


def test_ranged_reads_give_the_local_batches(datasets, reference, proxy, ranged_reads):
    got = fingerprints(make_config(remote_paths(datasets, "mix"), storage_endpoint=proxy.endpoint))
    assert got == list(reference("mix"))
    gets = proxy.media_gets("part-")
    # RangedReader at work: 4 KiB windows, several GETs per ~10 KB object, footer first.
    assert len(gets) > 2 * len({r.path for r in gets})
    assert any(not (r.range or "").startswith("bytes=0-") for r in gets)


def test_cache_cold_then_warm(datasets, reference, proxy, tmp_path):
    config = make_config(remote_paths(datasets, "mix"), storage_endpoint=proxy.endpoint,
                         cache_dir=str(tmp_path / "cache"))
    assert fingerprints(config) == list(reference("mix"))
    cold = proxy.media_gets("part-")
    assert cold, "the cold run read nothing through the proxy"
    assert len({r.path for r in cold}) == len(cold)  # each file downloaded exactly once
    proxy.reset_log()
    assert fingerprints(config) == list(reference("mix"))
    assert lane_file_requests(proxy) == []  # warm: not even a metadata request


@pytest.mark.timeout(90)
def test_workers_and_two_ranks_share_a_cold_cache(datasets, reference, proxy, tmp_path):
    """W=2, a spawned worker per rank: 2 processes fill one cache from the emulator (2 workers
    per rank work the same and cost ~8 s more here; test_transient_faults_in_workers runs 2).

    No ``storage_endpoint``: the workers find the emulator only through the
    ``STORAGE_EMULATOR_HOST`` they inherit (without it they would look for Google
    credentials and fail). A warm run through the proxy then makes no request at all, so the
    workers' copies are complete and verified.
    """
    assert os.environ.get("STORAGE_EMULATOR_HOST")
    cache_dir = str(tmp_path / "cache")
    config = make_config(remote_paths(datasets, "mix"), num_workers=1, cache_dir=cache_dir)
    assert fingerprints(config, world_size=2) == list(reference("mix"))
    warm = config.replace(num_workers=0, storage_endpoint=proxy.endpoint)
    assert fingerprints(warm) == list(reference("mix"))
    assert lane_file_requests(proxy) == []
    assert os.listdir(os.path.join(cache_dir, "zephon-cache-v1", "tmp")) == []


# -- transient faults --------------------------------------------------------------------
TRANSIENT = [
    Fault("status", status=503, match="metadata"),
    Fault("status", status=503),
    Fault("status", status=429),
    Fault("reset"),
    Fault("truncate"),  # full Content-Length, half the body, then a reset
    Fault("status", status=429, match="metadata"),
    Fault("reset", match="metadata"),
]


@pytest.mark.parametrize("reads", ["whole", "ranged"])
def test_transient_faults_leave_batches_unchanged(datasets, reference, proxy, quick_backoff, request, reads):
    if reads == "ranged":
        request.getfixturevalue("ranged_reads")
    proxy.inject(*[Fault(f.kind, match=f.match, status=f.status) for f in TRANSIENT])
    got = fingerprints(make_config(remote_paths(datasets, "mix"), storage_endpoint=proxy.endpoint))
    assert got == list(reference("mix"))
    assert proxy.pending() == 0  # every fault was hit, and survived
    assert len([r for r in proxy.log if r.fault]) == len(TRANSIENT)


@pytest.mark.timeout(90)
def test_transient_faults_in_workers(datasets, reference, proxy):
    """Spawned workers retry with the default backoff (0.5 s cap before the first retry)."""
    proxy.inject(Fault("status", status=503, match="metadata"), Fault("truncate"),
                 Fault("status", status=429, match="metadata"), Fault("reset"))
    config = make_config(remote_paths(datasets, "text"), num_workers=2, storage_endpoint=proxy.endpoint)
    assert fingerprints(config) == list(reference("text"))
    assert proxy.pending() == 0


# -- permanent failures ------------------------------------------------------------------
def delete_object(url: str) -> None:
    loc = gcs.GcsPath.parse(url)
    gcs.client().bucket(loc.bucket).blob(loc.name).delete()


def test_deleted_lane_object_in_process(copy_of_text_dataset, tmp_path):
    _, remote = copy_of_text_dataset
    url = f"{remote}/{FIRST_FILE}"
    delete_object(url)
    for cache_dir in (None, str(tmp_path / "cache")):
        start = time.monotonic()
        with pytest.raises(StorageNotFoundError, match=re.escape(f"{url} does not exist")) as caught:
            fingerprints(make_config([remote], cache_dir=cache_dir))
        assert "re-run the Beam job or restore" in str(caught.value)
        assert time.monotonic() - start < 5  # a 404 is permanent: no retry budget spent


@pytest.mark.timeout(90)
def test_deleted_lane_object_in_a_worker(copy_of_text_dataset):
    _, remote = copy_of_text_dataset
    url = f"{remote}/{FIRST_FILE}"
    delete_object(url)
    start = time.monotonic()
    with ZephonLoader(make_config([remote], num_workers=1)) as loader:  # one worker: ~4 s less than two
        loader.wait_for_workers(30)  # the worker path, not the trainer's warm start
        with pytest.raises(StorageNotFoundError) as caught:  # the worker's own exception (issue 28)
            for _ in range(STEPS * loader.topology.micro_steps_per_step):
                next(loader)
    text = str(caught.value)
    assert text.startswith("loader worker 0: ") and f"{url} does not exist" in text
    assert isinstance(caught.value.__cause__, WorkerError) and "StorageNotFoundError" in str(caught.value.__cause__)
    # Well below worker_timeout_s (30 s here): the error is reported, not waited out.
    assert time.monotonic() - start < 25


def corrupt_last_byte_of_column(data: bytes, column: str) -> bytes:
    """Flip the last byte of ``column``'s chunk in row group 0: page payload, under a page CRC."""
    metadata = pq.ParquetFile(io.BytesIO(data)).metadata
    names = [metadata.schema.column(i).name for i in range(metadata.num_columns)]
    chunk = metadata.row_group(0).column(names.index(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    offset = start + chunk.total_compressed_size - 1
    forged = bytearray(data)
    forged[offset] ^= 0xFF
    return bytes(forged)


@pytest.mark.parametrize("reads,verify", [("whole", True), ("cache", True), ("whole", False), ("ranged", True)])
def test_corrupted_lane_object(copy_of_text_dataset, proxy, quick_backoff, request, tmp_path, reads, verify):
    """Same size, different bytes: the manifest sha256 catches it where a file is read whole,
    the Parquet page checksums where it is not (ranged reads, or verify_checksums=False)."""
    local, remote = copy_of_text_dataset
    url = f"{remote}/{FIRST_FILE}"
    original = (Path(local) / FIRST_FILE).read_bytes()
    forged = corrupt_last_byte_of_column(original, "text")
    assert len(forged) == len(original) and forged != original
    with pytest.raises(OSError, match="(?i)checksum"):  # precondition: pyarrow alone notices
        pq.ParquetFile(io.BytesIO(forged), page_checksum_verification=True).read_row_group(0, columns=["text"])
    gcs.write_bytes(url, forged)
    if reads == "ranged":
        request.getfixturevalue("ranged_reads")
    config = make_config([remote], storage_endpoint=proxy.endpoint, verify_checksums=verify,
                         cache_dir=str(tmp_path / "cache") if reads == "cache" else None)
    if verify and reads != "ranged":
        with pytest.raises(StorageError, match=re.escape(f"{url}: content does not match the manifest")):
            fingerprints(config)
        assert len(proxy.media_gets(quote(FIRST_FILE, safe=""))) == 2  # fetched again once, then refused
    else:
        with pytest.raises(LaneDataError, match=re.escape(f"{url}: row group 0 cannot be read") + "(?i:.*checksum)"):
            fingerprints(config)
    if reads == "cache":
        # Nothing bad was cached (other lanes' good files may be: a run reads every lane's first
        # row group ahead, so they can be fetched before the bad one fails the run).
        cached = [p.read_bytes() for p in Path(tmp_path / "cache").rglob("*.parquet")]
        assert forged not in cached and len(cached) < len(list(Path(local).rglob("*.parquet")))


# -- known gap ---------------------------------------------------------------------------
def test_storage_endpoint_alone_is_enough(datasets, reference, proxy, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    got = fingerprints(make_config(remote_paths(datasets, "text"), storage_endpoint=proxy.endpoint))
    assert got == list(reference("text"))
