"""How blocks reach the packers: token encodings, read-ahead and bulk row cutting.

None of these may change a batch: ``input_ids`` stored as ``binary`` (what the Beam job
writes) or ``list<int32>`` (older datasets), read-ahead on or off, and concat rows cut in
bulk must give the fingerprints of the text lanes tokenized online; a checkpoint taken
while bulk-cut rows are waiting resumes exactly; a read-ahead that turns out not to be
needed cannot fail the stream; malformed token bytes name the file, row group and row.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loader.config import ConfigError
from loader.commands.fingerprints import collect_fingerprints
from loader.io.blocks import TokenFormat, pretokenized_block, wrap_documents
from loader.io.integrity import LaneDataError
from loader.io.lane_files import LaneFiles
from loader.io.lane_reader import LaneTokenStream
from loader.io.manifest import read_manifest
from loader.stages.packing import ConcatPacker
from loader.pipeline import ZephonLoader
from tests.dataset_factory import write_dataset
from tests.loader.settings import DATA_SEED, NUM_LANES, PACKINGS, SEQ_LEN

STEPS = 24  # crosses epoch boundaries (an epoch ends every ~10 steps)


@pytest.fixture(scope="module")
def list_encoded(tmp_path_factory, corpus, tokenizer) -> str:
    """The corpus pre-tokenized with ``input_ids`` as ``list<int32>``."""
    path = str(tmp_path_factory.mktemp("list") / "dataset")
    write_dataset(path, corpus.texts, keys=corpus.keys, tokenizer=tokenizer, num_lanes=NUM_LANES,
                  seed=DATA_SEED, files_per_lane=2, row_group_rows=4, token_encoding="list")
    return path


def lines(config) -> list[str]:
    return [r.line() for r in collect_fingerprints(config, end_step=STEPS)[0]]


def test_the_suite_corpus_is_binary_encoded(corpus):
    manifest = read_manifest(corpus.pretokenized_path)
    assert {c["name"]: c["type"] for c in manifest.schema}["input_ids"] == "binary"


@pytest.mark.parametrize("packing", PACKINGS)
def test_binary_and_list_token_encodings_give_the_online_batches(make_config, baseline, list_encoded, packing):
    online = baseline(packing, STEPS)
    assert lines(make_config(packing, pretokenized=True)) == online
    assert lines(make_config(packing, datasets=[{"path": list_encoded}])) == online


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("pretokenized", [False, True], ids=["text", "pretokenized"])
def test_read_ahead_does_not_change_batches(make_config, baseline, packing, pretokenized):
    one = lines(make_config(packing, pretokenized=pretokenized, read_ahead=True, read_ahead_threads=1))
    three = lines(make_config(packing, pretokenized=pretokenized, read_ahead=True, read_ahead_threads=3))
    off = lines(make_config(packing, pretokenized=pretokenized, read_ahead=False))
    assert one == three == off == baseline(packing, STEPS)


def test_read_ahead_threads_never_read_one_stream_at_once(make_config, monkeypatch):
    """Streams share the read-ahead threads, but one stream's Parquet file is read by one
    thread at a time (and the reads of several streams do overlap)."""
    active: dict[int, int] = {}
    most_per_stream = [0]
    most_overall = [0]
    lock = threading.Lock()
    read_block = LaneTokenStream._read_block

    def watched(self, *args, **kwargs):
        with lock:
            active[id(self)] = active.get(id(self), 0) + 1
            most_per_stream[0] = max(most_per_stream[0], active[id(self)])
            most_overall[0] = max(most_overall[0], sum(active.values()))
        try:
            time.sleep(0.002)  # long enough for other threads to start their reads meanwhile
            return read_block(self, *args, **kwargs)
        finally:
            with lock:
                active[id(self)] -= 1

    monkeypatch.setattr(LaneTokenStream, "_read_block", watched)
    config = make_config("concat", pretokenized=True, read_ahead_threads=4)
    expected = lines(config)
    monkeypatch.setattr(LaneTokenStream, "_read_block", read_block)
    assert expected == lines(config)
    assert most_per_stream[0] == 1
    assert most_overall[0] >= 2


def test_later_epochs_get_their_row_order_where_the_read_is_queued(corpus, monkeypatch):
    """After epoch 0 a row group's size is known, so its next epoch's row order is computed
    by the thread that queues the read (not on the read-ahead thread); the tokens are those
    of a stream that reads on demand."""
    manifest = read_manifest(corpus.pretokenized_path)
    fmt = TokenFormat(bos_id=None, eos_id=0)
    threads_computing: list[str] = []
    row_order = LaneFiles.row_order

    def watched(self, *args):
        threads_computing.append(threading.current_thread().name)
        return row_order(self, *args)

    monkeypatch.setattr(LaneFiles, "row_order", watched)

    def drain(read_ahead: bool) -> np.ndarray:
        stream = LaneTokenStream(dataset_path=corpus.pretokenized_path, manifest=manifest, source_name="s",
                                 lane_id=0, seed=5, token_format=fmt, read_ahead=read_ahead, max_epochs=3)
        pieces = []
        while (chunk := stream.take(64)) is not None:
            pieces.append(chunk.tokens)
        stream.close()
        return np.concatenate(pieces)

    expected = drain(read_ahead=False)
    assert threads_computing and set(threads_computing) == {"MainThread"}
    threads_computing.clear()
    assert np.array_equal(drain(read_ahead=True), expected)
    assert "MainThread" in threads_computing  # queued with the order


@pytest.mark.parametrize("threads", [0, -1, True, 1.5])
def test_bad_read_ahead_threads_are_named(make_config, threads):
    with pytest.raises(ConfigError, match=r"read_ahead_threads must be an integer >= 1 .*read_ahead = false"):
        make_config("concat", read_ahead_threads=threads)


def test_checkpoint_with_bulk_cut_rows_waiting_resumes_exactly(make_config, tokenizer, corpus):
    """A fill cuts many rows at once; the state must count only those handed out."""
    manifest = read_manifest(corpus.pretokenized_path)
    fmt = TokenFormat(bos_id=None, eos_id=0)

    def packer() -> ConcatPacker:
        stream = LaneTokenStream(dataset_path=corpus.pretokenized_path, manifest=manifest, source_name="s",
                                 lane_id=0, seed=5, token_format=fmt, read_ahead=True)
        return ConcatPacker(stream, 8, 0)  # short rows: every fill cuts several

    reference = packer()
    expected = [reference.next_sequence().input_ids.copy() for _ in range(120)]
    filled_states = 0
    for cut in (1, 2, 3, 7, 30, 61):
        first = packer()
        for _ in range(cut):
            first.next_sequence()
        filled_states += first._next_row < first._fill_rows
        state = first.get_state()
        first.stream.close()
        second = packer()
        second.set_state(state)
        resumed = [second.next_sequence().input_ids.copy() for _ in range(120 - cut)]
        assert all(np.array_equal(a, b) for a, b in zip(resumed, expected[cut:])), f"cut at {cut}"
        second.stream.close()
    reference.stream.close()
    assert filled_states >= 3, "the checkpoints did not fall inside fills: the test lost its subject"


def _replace_input_ids(path: str, row_group: int, row: int, value: bytes) -> None:
    parquet = pq.ParquetFile(path)
    tables = [parquet.read_row_group(g) for g in range(parquet.metadata.num_row_groups)]
    table = tables[row_group]
    ids = table.column("input_ids").to_pylist()
    ids[row] = value
    tables[row_group] = table.set_column(table.schema.get_field_index("input_ids"), "input_ids",
                                         pa.array(ids, pa.binary()))
    parquet.close()
    with pq.ParquetWriter(path, tables[0].schema, compression="zstd", write_page_checksum=True) as writer:
        for t in tables:
            writer.write_table(t, row_group_size=len(t))


def _fix_manifest(dataset: str) -> None:
    """Re-record sizes and checksums: the file is well-formed Parquet with bad content."""
    from loader.order.hashing import sha256_hex

    manifest = read_manifest(dataset)
    files = []
    for entry in manifest.files:
        data = open(os.path.join(dataset, entry.path), "rb").read()
        files.append(replace(entry, bytes=len(data), sha256=sha256_hex(data)))
    with open(os.path.join(dataset, "manifest.json"), "w") as fh:
        fh.write(replace(manifest, files=files).with_fingerprint().to_json())


def test_token_bytes_that_are_not_int32_name_file_row_group_and_row(tmp_path, corpus, make_config):
    dataset = str(tmp_path / "dataset")
    shutil.copytree(corpus.pretokenized_path, dataset)
    target = os.path.join(dataset, "lane=00000", "part-00000.parquet")
    _replace_input_ids(target, 0, 1, b"\x01\x02\x03\x04\x05")  # 5 bytes
    _fix_manifest(dataset)
    with ZephonLoader(make_config(datasets=[{"path": dataset}], seq_len=SEQ_LEN)) as loader:
        with pytest.raises(LaneDataError) as info:
            for _ in range(50):
                next(loader)
    message = str(info.value)
    assert target in message and "row group 0, row 1" in message and "5 bytes" in message


def test_a_read_ahead_that_is_never_used_cannot_fail_the_stream(tmp_path, corpus):
    """With max_epochs=1 the stream ends after its last block: nothing past it is read ahead,
    and a cursor moved by set_state drops the pending read, error and all."""
    manifest = read_manifest(corpus.pretokenized_path)
    fmt = TokenFormat(bos_id=None, eos_id=0)
    stream = LaneTokenStream(dataset_path=corpus.pretokenized_path, manifest=manifest, source_name="s",
                             lane_id=0, seed=5, token_format=fmt, read_ahead=True, max_epochs=1)
    taken = 0
    while (chunk := stream.take(64)) is not None:
        taken += len(chunk.tokens)
    assert stream.exhausted and not stream._ahead
    assert taken == sum(f.tokens for f in manifest.lane_files(0)) + sum(f.rows for f in manifest.lane_files(0))

    failing = LaneTokenStream(dataset_path=corpus.pretokenized_path, manifest=manifest, source_name="s",
                              lane_id=0, seed=5, token_format=fmt, read_ahead=True)
    failing.take(4)
    queued = failing._ahead._ahead  # the ReadAheadQueue's (key, future) pairs, in stream order
    assert [key for key, _ in queued] == [(0, 1), (0, 2)]  # READ_AHEAD_BLOCKS = 2
    for index, (key, future) in enumerate(list(queued)):
        future.result()  # let the real read finish, then stand in a failed one for it
        failed = type(future)()
        failed.set_exception(LaneDataError("the read-ahead of a block nobody needs"))
        queued[index] = key, failed
    failing.set_state({"epoch": 1, "block": 0, "offset": 0})  # elsewhere: the pending read is not wanted
    assert len(failing.take(4).tokens) == 4
    failing.close()


@pytest.mark.parametrize("binary_type", [pa.binary(), pa.large_binary()], ids=["binary", "large_binary"])
@pytest.mark.parametrize("bos_id,eos_id", [(None, 0), (1, 0), (1, None), (None, None)])
def test_bos_eos_joined_by_arrow_equal_the_numpy_wrapping(bos_id, eos_id, binary_type):
    documents = [[5, 6, 7], [], None, [8], list(range(100, 140))]  # None: a null row, an empty document
    values = pa.array([None if d is None else np.asarray(d, "<i4").tobytes() for d in documents], binary_type)
    fmt = TokenFormat(bos_id, eos_id)
    got = pretokenized_block(values.slice(1), fmt, "f.parquet", 0)  # a slice: offsets not starting at 0
    kept = [d or [] for d in documents[1:]]
    expected = wrap_documents(np.asarray([t for d in kept for t in d], np.int32),
                              np.asarray([len(d) for d in kept]), fmt)
    assert got.tokens.dtype == np.int32
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_array_equal(got.doc_starts, expected.doc_starts)


_NO_PANDAS_SCRIPT = r"""
import json, sys
import numpy as np, pyarrow as pa
from loader.config import LoaderConfig
from loader.io.blocks import TokenFormat, pretokenized_block
from loader.pipeline import ZephonLoader

config = LoaderConfig(**json.loads(sys.argv[1]))
with ZephonLoader(config) as loader:
    for _ in range(30):  # into epoch 1: permuted row groups
        next(loader)
    state = loader.state_dict()
with ZephonLoader(config) as resumed:
    resumed.load_state_dict(state)
    next(resumed)
# Arrays with a null row, built from buffers (pa.array would import pandas itself).
buf = lambda a: pa.py_buffer(np.asarray(a))
validity = buf(np.packbits([1, 0], bitorder="little"))
binary = pa.Array.from_buffers(pa.binary(), 2, [validity, buf(np.array([0, 12, 12], np.int32)),
                                                buf(np.arange(3, dtype="<i4"))])
lists = pa.ListArray.from_buffers(pa.list_(pa.int32()), 2, [validity, buf(np.array([0, 2, 2], np.int32))],
                                  children=[pa.Array.from_buffers(pa.int32(), 2, [None, buf(np.array([1, 2], np.int32))])])
for values in (binary, lists):
    assert values.null_count == 1
    for fmt in (TokenFormat(1, 0), TokenFormat(None, None)):
        pretokenized_block(values, fmt, "f.parquet", 0)
"""


def test_reading_and_restoring_never_import_pandas(tmp_path, make_config):
    """pyarrow imports pandas, when installed, for some conversions from Python objects
    (``pa.scalar(bytes)``, ``pa.array(ndarray)``): ~0.2 s that a restore's first batch
    would wait for. A stand-in ``pandas`` package records any attempt to import it."""
    import json
    import subprocess
    import sys

    fake = tmp_path / "fake" / "pandas"
    fake.mkdir(parents=True)
    marker = tmp_path / "pandas-imported"
    (fake / "__init__.py").write_text(
        f"import traceback\nopen({str(marker)!r}, 'w').write(''.join(traceback.format_stack()))\n"
        "raise ImportError('stand-in pandas')\n")
    config = make_config("concat", pretokenized=True)
    fields = {k: v for k, v in config.to_dict().items() if k in ("seq_len", "global_batch_size", "micro_batch_size",
                                                                  "seed", "tokenizer", "packing")}
    fields["datasets"] = [{"path": d.path} for d in config.datasets]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), os.getcwd()]))
    subprocess.run([sys.executable, "-c", _NO_PANDAS_SCRIPT, json.dumps(fields)], env=env, check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert not marker.exists(), "reading or restoring imported pandas, from:\n" + marker.read_text()


class _CountingTokenizer:
    """A tokenizer that records the characters of each ``encode_batch_fast`` call."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.call_chars: list[int] = []

    def encode_batch_fast(self, texts, add_special_tokens):
        self.call_chars.append(sum(len(t) for t in texts))
        return self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_text_blocks_tokenize_in_calls_capped_per_tokenizer_thread(tokenizer, monkeypatch, threads):
    from loader.io.blocks import MAX_TOKENIZE_CHARS_PER_THREAD, TOKENIZE_CHARS, TextBlock

    monkeypatch.setenv("RAYON_NUM_THREADS", threads)
    texts = [f"document {k} " + "lorem ipsum dolor sit amet " * 40 for k in range(600)]  # ~660 KB
    counting = _CountingTokenizer(tokenizer)
    fmt = TokenFormat(bos_id=None, eos_id=0)
    block = TextBlock(texts, counting, fmt)
    block.ensure(10 ** 9)
    cap = MAX_TOKENIZE_CHARS_PER_THREAD * int(threads)
    longest = max(len(t) for t in texts)
    assert block.complete and counting.call_chars[0] <= TOKENIZE_CHARS
    assert max(counting.call_chars) <= cap and max(counting.call_chars) > cap - longest  # grew to the cap
    assert sum(counting.call_chars) == sum(len(t) for t in texts)  # every document once
    ids = [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    whole = wrap_documents(np.concatenate([np.array(i, dtype=np.int32) for i in ids]),
                           np.array([len(i) for i in ids]), fmt)
    np.testing.assert_array_equal(block.tokens, whole.tokens)  # the calls do not change the tokens
    np.testing.assert_array_equal(block.doc_starts, whole.doc_starts)


def test_the_default_prefetch_holds_a_quarter_million_tokens_per_worker_in_small_slots_and_messages():
    from loader.config import LoaderConfig
    from loader.workers.pool import default_prefetch
    from loader.workers.shm import slot_bytes

    from loader.workers.messages import items_per_message

    lengths = (512, 2048, 4096, 8192, 32768)
    text = [default_prefetch(n, slot_bytes(n, 8, ("loss_mask",)), 8) for n in lengths]
    assert text == [64, 16, 8, 4, 4]
    assert default_prefetch(2048, 125 * 1024**2, 8) == 4  # an image source's slot (pixels): the former default
    # pre-tokenized sources ship up to 64 K tokens per message, text, chat and images 8 sequences
    per_message = [items_per_message(n, tokenizes=False, images=False) for n in lengths]
    assert per_message == [32, 32, 16, 8, 8]
    assert {items_per_message(n, tokenizes=True, images=False) for n in lengths} == {8}
    assert {items_per_message(n, tokenizes=False, images=True) for n in lengths} == {8}
    pretokenized = [default_prefetch(n, slot_bytes(n, k), k) for n, k in zip(lengths, per_message)]
    assert pretokenized == [16, 4, 4, 4, 4]
    # the same ~256 K tokens (or 4 messages) ready per worker either way
    assert [p * k * n for p, k, n in zip(pretokenized, per_message, lengths)][:3] == [256 * 1024] * 3
    assert LoaderConfig.__dataclass_fields__["prefetch"].default is None  # absent from a config: the default
