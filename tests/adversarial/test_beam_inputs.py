"""Truncated and odd inputs of the Beam sharding job: loud or lossless, never silently short (issue 14).

Readers are exercised directly (fast): every ``.zst`` / ``.gz`` / ``.jsonl`` / ``.txt`` /
``.parquet`` input is cut at many points (zstd at every block and frame boundary of a
multi-frame stream, gzip at member boundaries and inside members and their trailers,
Parquet at row-group boundaries), and Parquet headers, footers and pages are damaged. Each
outcome must be one of

* **loud**: the records before the damage, in order and intact, then exactly one
  ``unreadable_file`` rejection naming the file, whose record index is the first record not
  read (so records in = kept + rejected, the damaged rest counting as one), or
* **lossless**: a cut that leaves a valid, shorter file (exactly between two gzip members or
  zstd frames, or right after a newline) reads as exactly its complete records.

Then the odd records (BOM, deep nesting, JSON that is not an object, NUL bytes, CRLF, a huge
line, empty files), the job's up-front argument checks, and a few whole-job runs that check
the manifest's counts against the readers.
"""

from __future__ import annotations

import gzip
import io
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from beam_jobs import inputs, readers, shard
from beam_jobs.input_streams import ZstdFramesReader
from beam_jobs.outputs import ShardJobError, check_every_lane_has_documents
from loader.errors import ZephonError
from loader.order.hashing import lane_of_key
from loader.io.manifest import MANIFEST_NAME, read_manifest

IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]
RECORDS = [{"id": f"r{n}", "text": f"document {n} " + "word " * (n % 17)} for n in range(120)]
LINES = [json.dumps(r).encode() + b"\n" for r in RECORDS]
PLAIN = b"".join(LINES)


def _input_file(path, relative="f", fmt="jsonl", compression="none"):
    return inputs.InputFile(path=str(path), relative_path=relative, file_index=0, format=fmt, compression=compression)


def _read(tmp_path, name, data, fmt="jsonl", compression="none", spec=readers.RecordSpec()):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path), list(readers.read_records(_input_file(path, name, fmt, compression), spec))


def _loud_or_lossless(out, path, relative, records=RECORDS) -> tuple[bool, int]:
    """Check the outcome is a clean prefix, plus one naming unreadable_file if anything was lost.

    Returns ``(loud, records read)``.
    """
    docs = [element for ok, element in out if ok]
    rejects = [element for ok, element in out if not ok]
    assert all(r[3] == "unreadable_file" for r in rejects), rejects  # every input record is valid
    assert len(rejects) <= 1, rejects
    if rejects:
        (reject,) = rejects
        assert out[-1] == (False, reject)  # nothing after the failure
        assert reject[1] == path and reject[4], reject  # names the file, carries the error
        read = reject[2]
    else:
        read = len(docs)
    # Records in = kept + rejected: exactly the records before the damage, whole and in order.
    assert [d[0] for d in docs] == [f"{relative}#{i}" for i in range(read)]
    assert [d[1] for d in docs] == [r["text"] for r in records[:read]]
    return bool(rejects), read


def _complete_lines(prefix: bytes) -> int:
    """Records whose bytes are all in ``prefix`` (a last line without newline counts if whole JSON)."""
    *whole, tail = prefix.split(b"\n")
    try:
        json.loads(tail)
        return len(whole) + 1
    except ValueError:
        return len(whole)


def _cut_points(size: int, count: int) -> list[int]:
    return sorted({1 + (k * (size - 2)) // (count - 1) for k in range(count)})


# ---------------------------------------------------------------------------------------
# zstd: multiple frames of multiple blocks, cut everywhere that matters.


def _zstd_frames(lines, lines_per_block=3, blocks_per_frame=4) -> tuple[bytes, list[int], list[int]]:
    """``(data, block ends inside frames, frame ends)``: each block flushed on its own."""
    data = bytearray()
    block_ends, frame_ends = [], []
    compressor = zstandard.ZstdCompressor(level=3, write_checksum=True)
    per_frame = lines_per_block * blocks_per_frame
    for start in range(0, len(lines), per_frame):
        frame = compressor.compressobj()
        frame_lines = lines[start:start + per_frame]
        for block in range(0, len(frame_lines), lines_per_block):
            data += frame.compress(b"".join(frame_lines[block:block + lines_per_block]))
            data += frame.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
            block_ends.append(len(data))
        data += frame.flush()
        frame_ends.append(len(data))
    return bytes(data), [e for e in block_ends if e not in frame_ends], frame_ends


def test_zstd_cut_at_every_block_and_frame_boundary_and_inside_blocks(tmp_path):
    data, block_ends, frame_ends = _zstd_frames(LINES)
    assert len(frame_ends) == 10 and len(block_ends) == 40
    assert zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data[:block_ends[5]]),
                                                      read_across_frames=True).read()  # the old silent case
    inside = sorted(set(_cut_points(len(data), 40)) - set(frame_ends))
    cuts = {**{c: True for c in block_ends + inside + [1, 2, 5, len(data) - 1]}, **{c: False for c in frame_ends[:-1]}}
    assert len(cuts) >= 80
    for cut, must_be_loud in sorted(cuts.items()):
        path, out = _read(tmp_path, "f.jsonl.zst", data[:cut], compression="zstd")
        loud, read = _loud_or_lossless(out, path, "f.jsonl.zst")
        assert loud == must_be_loud, (cut, out[-1:])
        if not must_be_loud:  # a cut between frames is a valid file of whole frames
            assert read == 12 * (frame_ends.index(cut) + 1)
    path, out = _read(tmp_path, "f.jsonl.zst", data, compression="zstd")
    assert _loud_or_lossless(out, path, "f.jsonl.zst") == (False, len(RECORDS))


def test_zstd_frame_boundary_inside_a_line_is_loud(tmp_path):
    """Frames that split lines: a cut at a frame end leaves a partial last line: truncated, not malformed."""
    compressor = zstandard.ZstdCompressor()
    pieces = [PLAIN[k:k + 777] for k in range(0, len(PLAIN), 777)]
    frames = [compressor.compress(piece) for piece in pieces]
    for count in range(1, len(frames)):
        prefix_plain = b"".join(pieces[:count])
        path, out = _read(tmp_path, "g.jsonl.zst", b"".join(frames[:count]), compression="zstd")
        loud, read = _loud_or_lossless(out, path, "g.jsonl.zst")
        assert read == _complete_lines(prefix_plain)
        assert loud == (not prefix_plain.endswith(b"\n") and read == prefix_plain.count(b"\n"))
        if loud:
            assert "ends inside record" in out[-1][1][4]


def test_zstd_reader_matches_zstandard_on_intact_streams():
    data, _, _ = _zstd_frames(LINES)
    assert io.BufferedReader(ZstdFramesReader(io.BytesIO(data)), 100).read() == PLAIN
    skippable = b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"skip"  # a skippable frame between two
    both = zstandard.ZstdCompressor().compress(b"a\n") + skippable + zstandard.ZstdCompressor().compress(b"b\n")
    assert ZstdFramesReader(io.BytesIO(both)).read() == b"a\nb\n"
    assert ZstdFramesReader(io.BytesIO(b"")).read() == b""


BIG_RECORDS = [{"id": f"b{n}", "text": f"record {n} " + "text " * (n % 23)} for n in range(20000)]
BIG_PLAIN = b"".join(json.dumps(r).encode() + b"\n" for r in BIG_RECORDS)  # ~2 MiB: more than one 1 MiB stream buffer


@pytest.mark.parametrize("compression,compress", [
    ("zstd", zstandard.ZstdCompressor(write_checksum=True).compress),
    ("gzip", lambda data: gzip.compress(data, mtime=0)),
])
def test_corrupt_compressed_data_keeps_nothing(tmp_path, compression, compress):
    """A checksum is checked only at the end of a frame / member: a corrupt stream keeps no record."""
    data = compress(BIG_PLAIN)
    name = f"c.jsonl.{'zst' if compression == 'zstd' else 'gz'}"
    path, baseline = _read(tmp_path, name, data, compression=compression)
    assert _loud_or_lossless(baseline, path, name, BIG_RECORDS) == (False, len(BIG_RECORDS))
    outcomes = {"identical": 0, "unreadable": 0}
    for position in _cut_points(len(data), 60):
        damaged = bytearray(data)
        damaged[position] ^= 0x08
        path, out = _read(tmp_path, name, bytes(damaged), compression=compression)
        if out == baseline:  # e.g. a flip in gzip's mtime field
            outcomes["identical"] += 1
            continue
        assert len(out) == 1 and out[0][0] is False, (position, len(out))
        assert out[0][1][1:4] == (path, 0, "unreadable_file") and "nothing of the file is kept" in out[0][1][4]
        outcomes["unreadable"] += 1
    assert outcomes["unreadable"] >= 55, outcomes


# ---------------------------------------------------------------------------------------
# gzip, plain JSONL, text.


def test_gzip_cut_at_member_boundaries_inside_members_and_trailers(tmp_path):
    members = [gzip.compress(b"".join(LINES[k:k + 12]), mtime=0) for k in range(0, len(LINES), 12)]
    data = b"".join(members)
    ends = [sum(map(len, members[:k + 1])) for k in range(len(members))]
    cuts = {c: True for c in _cut_points(len(data), 40) + [1, 9, 10, ends[0] - 1, ends[0] - 8, ends[3] - 4]}
    cuts.update({c: False for c in ends[:-1]})
    assert len(cuts) >= 40
    for cut, must_be_loud in sorted(cuts.items()):
        path, out = _read(tmp_path, "f.jsonl.gz", data[:cut], compression="gzip")
        loud, read = _loud_or_lossless(out, path, "f.jsonl.gz")
        assert loud == must_be_loud, (cut, out[-1:])
        if not must_be_loud:
            assert read == 12 * (ends.index(cut) + 1)


def test_plain_jsonl_cut_anywhere_loses_nothing_silently(tmp_path):
    newline_ends = [i + 1 for i, byte in enumerate(PLAIN) if byte == 0x0A]
    cuts = _cut_points(len(PLAIN), 40) + newline_ends[:5] + [n - 1 for n in newline_ends[5:10]]  # after "}"
    for cut in sorted(set(cuts)):
        prefix = PLAIN[:cut]
        path, out = _read(tmp_path, "f.jsonl", prefix)
        loud, read = _loud_or_lossless(out, path, "f.jsonl")
        assert read == _complete_lines(prefix)
        assert loud == (read == prefix.count(b"\n") and not prefix.endswith(b"\n")), cut  # a partial last line


@pytest.mark.parametrize("compression,compress", [("zstd", zstandard.ZstdCompressor().compress),
                                                  ("gzip", gzip.compress)])
def test_truncated_compressed_text_file_is_unreadable_not_a_shorter_document(tmp_path, compression, compress):
    data = compress(("a whole text file, one document. " * 2000).encode())
    for cut in _cut_points(len(data), 20):
        path, out = _read(tmp_path, "t.txt", data[:cut], "text", compression)
        assert len(out) == 1 and out[0][0] is False, cut
        assert out[0][1][1:4] == (path, 0, "unreadable_file")


# ---------------------------------------------------------------------------------------
# Parquet: truncated, header / footer damaged, pages damaged.


def _parquet_bytes(row_group_size=15) -> bytes:
    sink = io.BytesIO()
    table = pa.table({"id": [r["id"] for r in RECORDS], "text": [r["text"] for r in RECORDS]})
    pq.write_table(table, sink, row_group_size=row_group_size, write_page_checksum=True)
    return sink.getvalue()


def test_parquet_cut_anywhere_is_unreadable(tmp_path):
    data = _parquet_bytes()
    metadata = pq.ParquetFile(io.BytesIO(data)).metadata
    group_starts = [metadata.row_group(g).column(0).data_page_offset for g in range(metadata.num_row_groups)]
    cuts = sorted(set(_cut_points(len(data), 20) + group_starts[1:] + [len(data) - 1, len(data) - 8, 4]))
    assert len(cuts) >= 25
    for cut in cuts:
        path, out = _read(tmp_path, "f.parquet", data[:cut], "parquet")
        assert _loud_or_lossless(out, path, "f.parquet") == (True, 0), cut


def test_parquet_header_footer_and_page_damage_is_loud_or_identical(tmp_path):
    data = _parquet_bytes()
    path, baseline = _read(tmp_path, "f.parquet", data, "parquet")
    assert _loud_or_lossless(baseline, path, "f.parquet") == (False, len(RECORDS))
    footer_length = int.from_bytes(data[-8:-4], "little")
    footer = range(len(data) - 8 - footer_length, len(data))
    # Header magic, footer length and magic byte by byte, then spread over footer and pages.
    positions = [0, 1, 2, 3, *range(len(data) - 8, len(data))]
    positions += list(footer)[:: max(1, footer_length // 25)]
    positions += list(range(4, footer.start, max(1, footer.start // 40)))
    loud = 0
    for position in sorted(set(positions)):
        damaged = bytearray(data)
        damaged[position] ^= 0x10
        path, out = _read(tmp_path, "f.parquet", bytes(damaged), "parquet")
        if out == baseline:
            continue
        loud += 1
        # Not identical: there is a rejection, and what was kept is the intact prefix.
        assert any(not ok for ok, _ in out), position
        kept = [e for ok, e in out if ok]
        unreadable = [e for ok, e in out if not ok and e[3] == "unreadable_file"]
        if unreadable:
            assert len(unreadable) == 1 and unreadable[0][1] == path and out[-1] == (False, unreadable[0])
            assert kept == [e for ok, e in baseline[:len(kept)]], position
    assert loud >= 12  # every header/footer magic and length flip at least


def test_parquet_row_group_that_decodes_short_is_unreadable(tmp_path, monkeypatch):
    """A damaged page header can make a row group decode as zero rows: the footer's count catches it."""
    data = _parquet_bytes()
    original = pq.ParquetFile.iter_batches

    def drop_group_3(self, *args, row_groups=None, **kwargs):
        batches = original(self, *args, row_groups=row_groups, **kwargs)
        return iter(()) if row_groups == [3] else batches

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", drop_group_3)
    path, out = _read(tmp_path, "f.parquet", data, "parquet")
    assert _loud_or_lossless(out, path, "f.parquet") == (True, 45)
    assert "row group 3 decoded as 0 rows but the footer promises 15" in out[-1][1][4]


def test_empty_and_tiny_files(tmp_path):
    assert _read(tmp_path, "e.jsonl", b"")[1] == []
    assert _read(tmp_path, "e.jsonl.gz", b"", compression="gzip")[1] == []
    assert _read(tmp_path, "e.jsonl.gz", gzip.compress(b""), compression="gzip")[1] == []
    assert _read(tmp_path, "e.jsonl.zst", b"", compression="zstd")[1] == []
    assert _read(tmp_path, "e.jsonl.zst", zstandard.ZstdCompressor().compress(b""), compression="zstd")[1] == []
    assert _read(tmp_path, "e.jsonl", b"\n \r\n\t\n")[1] == []  # whitespace-only lines are not records
    for data in (b"", b"PAR1", b"PAR1PAR1"):
        out = _read(tmp_path, "e.parquet", data, "parquet")[1]
        assert [(r[2], r[3]) for _, r in out] == [(0, "unreadable_file")]
    assert [r[3] for _, r in _read(tmp_path, "e.txt", b"", "text")[1]] == ["empty_text"]


# ---------------------------------------------------------------------------------------
# Odd records.


def test_byte_order_mark_at_file_start_is_dropped(tmp_path):
    bom = b"\xef\xbb\xbf"
    for name, compression, compress in (("b.jsonl", "none", bytes), ("b.jsonl.gz", "gzip", gzip.compress),
                                        ("b.jsonl.zst", "zstd", zstandard.ZstdCompressor().compress)):
        path, out = _read(tmp_path, name, compress(bom + PLAIN), compression=compression)
        assert _loud_or_lossless(out, path, name) == (False, len(RECORDS))
    path, out = _read(tmp_path, "b.txt", bom + "text with a BOM\n".encode(), "text")
    assert out == [(True, ("b.txt#0", "text with a BOM\n", 16, ()))]
    # Anywhere else a BOM is data: in the middle of a JSONL file it is not JSON.
    out = _read(tmp_path, "m.jsonl", LINES[0] + bom + LINES[1])[1]
    assert [ok for ok, _ in out] == [True, False] and out[1][1][3] == "malformed_json"


def test_deep_nesting_is_one_rejection_with_a_fixed_limit(tmp_path):
    deep = b'{"text": "ok", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    deep_objects = b'{"text": "ok", "x": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}\n"
    at_limit = b'{"text": "ok", "x": ' + b"[" * 255 + b"]" * 255 + b"}\n"  # 256 levels with the record
    over_limit = b'{"text": "ok", "x": ' + b"[" * 256 + b"]" * 256 + b"}\n"
    brackets_in_a_string = b'{"text": "' + b"[" * 100_000 + b'"}\n'
    out = _read(tmp_path, "d.jsonl", LINES[0] + deep + deep_objects + at_limit + over_limit + brackets_in_a_string
                + LINES[1])[1]
    assert [(ok, e[3] if not ok else None) for ok, e in out] == [
        (True, None), (False, "malformed_json"), (False, "malformed_json"), (True, None),
        (False, "malformed_json"), (True, None), (True, None)]
    assert "nested 100001 arrays/objects deep, more than the limit of 256" in out[1][1][4]
    assert "nested 257 arrays/objects deep" in out[4][1][4]
    assert out[5][1][1] == "[" * 100_000


def test_deep_nesting_under_a_deep_stack_is_still_a_rejection(tmp_path):
    """If the caller's stack is already deep the parser's RecursionError is a rejection, not a crash."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok", "x": ' + b"[" * 250 + b"]" * 250 + b"}\n")

    def read_at_depth(depth):
        if depth:
            return read_at_depth(depth - 1)
        return list(readers.read_records(_input_file(path), readers.RecordSpec()))

    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:  # leave 150 frames: enough to open and read the file, not for 250 JSON levels
        out = read_at_depth(1000 - 150 - depth)
    finally:
        sys.setrecursionlimit(limit)
    assert [(e[3], "too deeply" in e[4]) for _, e in out] == [("malformed_json", True)]


def test_odd_lines_are_named_rejections_or_correct_records(tmp_path):
    lines = [
        b"[1, 2, 3]",                          # 0 malformed_json: an array
        b"42",                                 # 1 malformed_json: a number
        b'"a string"',                         # 2 malformed_json
        b"null",                               # 3 malformed_json
        b'{"text": "raw \x00 nul"}',           # 4 malformed_json: a raw control character
        b"\x00\x00\x00",                       # 5 malformed_json
        b'{"text": "escaped \\u0000 nul"}',    # 6 kept: NUL is a character
        b'{"text": "crlf line"}\r',            # 7 kept: CRLF
        b'{"text": "bad \xff byte"}',          # 8 invalid_utf8
        b'{"text": "lone \r cr"}',             # 9 malformed_json: a raw CR inside a JSON string
    ]
    zstd = zstandard.ZstdCompressor().compress(b"\n".join(lines) + b"\n")
    out = _read(tmp_path, "o.jsonl.zst", zstd, compression="zstd")[1]
    assert [(e[2], e[3]) for ok, e in out if not ok] == [
        (0, "malformed_json"), (1, "malformed_json"), (2, "malformed_json"), (3, "malformed_json"),
        (4, "malformed_json"), (5, "malformed_json"), (8, "invalid_utf8"), (9, "malformed_json")]
    assert "got list" in out[0][1][4] and "got int" in out[1][1][4] and "got null" in out[3][1][4]
    kept = [e for ok, e in out if ok]
    assert [(k[0], k[1]) for k in kept] == [("o.jsonl.zst#6", "escaped \x00 nul"), ("o.jsonl.zst#7", "crlf line")]
    assert len(out) == len(lines)  # one outcome per line


def test_crlf_file_reads_like_lf_and_trailing_nul_padding_is_truncation(tmp_path):
    crlf = PLAIN.replace(b"\n", b"\r\n")
    path, out = _read(tmp_path, "c.jsonl", crlf)
    assert _loud_or_lossless(out, path, "c.jsonl") == (False, len(RECORDS))
    path, out = _read(tmp_path, "p.jsonl", PLAIN[:5000] + b"\x00" * 4096)  # a crash left zeroed blocks
    loud, read = _loud_or_lossless(out, path, "p.jsonl")
    assert loud and read == PLAIN[:5000].count(b"\n")


def test_huge_single_line_is_one_document(tmp_path):
    text = "x" * (12 << 20) + "end"  # far above the 1 MiB stream buffer
    data = zstandard.ZstdCompressor().compress(json.dumps({"text": text}).encode() + b"\n" + LINES[0])
    out = _read(tmp_path, "h.jsonl.zst", data, compression="zstd")[1]
    assert [ok for ok, _ in out] == [True, True] and out[0][1][1] == text and out[0][1][2] == len(text)


# ---------------------------------------------------------------------------------------
# Job arguments: refused before the pipeline starts, one line each.


def _refused(capsys, argv, code=2) -> str:
    assert shard.main([*argv, *IN_MEMORY]) == code
    error = capsys.readouterr().err.strip()
    assert error.startswith("zephon shard: error: ") and "\n" not in error, error
    return error


def test_bad_arguments_are_refused_up_front_in_one_line(tmp_path, capsys, monkeypatch):
    import apache_beam as beam

    monkeypatch.setattr(beam, "Pipeline", lambda *a, **k: pytest.fail("the pipeline must not start"))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(PLAIN)
    (tmp_path / "in" / "empty.jsonl").write_bytes(b"")
    (tmp_path / "afile").write_text("x")
    good_input = ["--input", f"{tmp_path}/in/a.jsonl"]
    out = str(tmp_path / "out")

    assert "is an existing file, not a folder" in _refused(capsys, [*good_input, "--output", str(tmp_path / "afile")])
    assert "afile is a file" in _refused(capsys, [*good_input, "--output", str(tmp_path / "afile" / "ds")])
    assert "matches no files" in _refused(capsys, ["--input", f"{tmp_path}/in/nothing-*.jsonl", "--output", out])
    assert "matches no files" in _refused(capsys, ["--input", f"{tmp_path}/missing/a.jsonl", "--output", out])
    assert "matches only empty files" in _refused(capsys, ["--input", f"{tmp_path}/in/empty.jsonl", "--output", out])
    error = _refused(capsys, [*good_input, "--output", out, "--num-lanes", "100000"])
    assert "--num-lanes 100000 is more than the at most" in error and "documents the 1 input files can hold" in error
    assert "inside --output" in _refused(capsys, ["--input", f"{tmp_path}/in/*", "--output", str(tmp_path / "in")])
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / MANIFEST_NAME).write_text("{}")
    assert "--overwrite" in _refused(capsys, [*good_input, "--output", str(tmp_path / "done")], code=1)
    assert not (tmp_path / "out").exists()
    for error_type in (shard.ShardConfigError, shard.ShardError, inputs.InputError, ShardJobError):
        assert issubclass(error_type, ZephonError)


def test_every_lane_check_suggests_an_exact_lane_count():
    keys = [f"k{n}" for n in range(40)]
    lanes = {lane_of_key(0, key, 64) for key in keys}
    with pytest.raises(ShardJobError) as caught:
        check_every_lane_has_documents(lanes, 64, len(keys))
    message = str(caught.value)
    suggested = int(message.split("--num-lanes ")[1].split()[0])
    assert f"only {len(lanes)} of the 64 lanes received a document (40 documents in all)" in message
    assert 64 % suggested == 0 and suggested > 1
    assert {lane_of_key(0, key, suggested) for key in keys} == set(range(suggested))  # it really fills them
    assert {lane_of_key(0, key, suggested * 2) for key in keys} != set(range(suggested * 2))  # and is the largest
    check_every_lane_has_documents(range(8), 8, 8)  # every lane filled: fine


# ---------------------------------------------------------------------------------------
# Whole-job runs (each a few seconds): the manifest's counts agree with the readers.


def _damaged_inputs(root) -> dict[str, bytes]:
    zstd_data, block_ends, _ = _zstd_frames(LINES)
    members = b"".join(gzip.compress(b"".join(LINES[k:k + 12]), mtime=0) for k in range(0, len(LINES), 12))
    parquet = _parquet_bytes()
    deep = b'{"id": "deep", "text": "x", "v": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    flipped = bytearray(gzip.compress(BIG_PLAIN, mtime=0))
    flipped[len(flipped) // 2] ^= 0x08
    files = {
        "flip.jsonl.gz": bytes(flipped),                            # corrupt, not cut: nothing kept
        "cut.jsonl.zst": zstd_data[:block_ends[20]],               # at a block boundary: the old silent case
        "cut.jsonl.gz": members[:len(members) // 2 + 40],          # inside a member
        "cut.parquet": parquet[:len(parquet) // 2],
        "header.parquet": b"PAR0" + parquet[4:],
        "bom.jsonl": b"\xef\xbb\xbf" + b"".join(line.replace(b'"r', b'"bom-r') for line in LINES),
        "odd.jsonl": b"[1]\n42\n" + deep + b'{"id": "crlf", "text": "crlf"}\r\n' + b'{"id": "nul", "text": "a\x00b"}\n',
        "partial.jsonl": b"".join(line.replace(b'"r', b'"p-r') for line in LINES[:30]) + b'{"id": "p-r30", "te',
    }
    (root / "in").mkdir()
    for name, data in files.items():
        (root / "in" / name).write_bytes(data)
    return files


def test_whole_job_counts_every_damaged_file_and_record(tmp_path, capsys):
    files = _damaged_inputs(tmp_path)
    out = tmp_path / "out"
    spec = readers.RecordSpec(id_field="id")
    expected_docs, expected_rejects = 0, {}
    for input_file in inputs.expand_inputs([f"{tmp_path}/in/*"]):
        for ok, element in readers.read_records(input_file, spec):
            expected_docs += ok
            if not ok:
                expected_rejects[element[3]] = expected_rejects.get(element[3], 0) + 1
    assert expected_rejects["unreadable_file"] == 6  # zst, two gz, two parquet, the partial last line

    code = shard.main(["--input", f"{tmp_path}/in/*", "--output", str(out), "--id-field", "id", "--num-lanes", "2",
                       "--max-reject-fraction", "0.2", *IN_MEMORY])
    assert code == 0, capsys.readouterr().err
    manifest = read_manifest(str(out))
    assert manifest.documents == expected_docs
    assert {k: v for k, v in manifest.rejected.items() if v} == expected_rejects
    rejected = [json.loads(line) for path in sorted((out / "_rejected").glob("*.jsonl")) for line in path.read_text().splitlines()]
    assert len(rejected) == sum(expected_rejects.values())
    unreadable = sorted(r["input_file"].rsplit("/", 1)[1] for r in rejected if r["reason"] == "unreadable_file")
    assert unreadable == ["cut.jsonl.gz", "cut.jsonl.zst", "cut.parquet", "flip.jsonl.gz", "header.parquet",
                          "partial.jsonl"]
    keys = {k for f in manifest.files for k in pq.read_table(out / f.path, columns=["key"]).column("key").to_pylist()}
    assert "bom-r0" in keys and "crlf" in keys and "p-r29" in keys and "p-r30" not in keys
    assert not any(key.startswith("b") and key[1:].isdigit() for key in keys)  # nothing of the corrupt file
    assert len(keys) == manifest.documents
    assert len(files) == len({r["input_file"] for r in rejected} | {"bom.jsonl"})


def test_whole_job_with_too_many_lanes_fails_with_an_exact_suggestion(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(PLAIN))  # size says nothing
    out = tmp_path / "out"
    base = ["--input", f"{tmp_path}/in/*", "--output", str(out), "--id-field", "id", *IN_MEMORY]
    assert shard.main([*base, "--num-lanes", "512"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("zephon shard: error: only ") and "of the 512 lanes received a document (120 documents" in error
    assert not (out / MANIFEST_NAME).exists()
    suggested = error.split("--num-lanes ")[1].split()[0]
    assert shard.main([*base, "--num-lanes", suggested, "--overwrite"]) == 0
    manifest = read_manifest(str(out))
    assert {f.lane for f in manifest.files} == set(range(int(suggested))) and manifest.documents == 120
