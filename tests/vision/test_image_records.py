"""Image records without a pipeline: record shapes, image references, WebDataset samples, lane columns."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from beam_jobs.image_lanes import IMAGE_COLUMNS
from beam_jobs.image_records import ImageRecordConverter, ImageSpec, _Reject, document_parts, resolve_image_path
from beam_jobs.inputs import InputFile
from beam_jobs.lane_files import lane_schema, serialize_lane_file, sort_rows
from beam_jobs.readers import RecordSpec, read_records
from beam_jobs.formats.webdataset import iter_samples, split_member_name
from image_datasets import write_jsonl, write_parquet, write_tar
from image_factory import image_bytes
from loader.vision.images import ImageLimits
from loader.vision.policies import DynamicResolutionPolicy
from loader.vision.segments import decode_segments


def converter_for(path: str, fmt: str, image_field="image", policy=None, **limits) -> ImageRecordConverter:
    spec = RecordSpec(images=ImageSpec(image_field=image_field, policy=policy, limits=ImageLimits(**limits)))
    return ImageRecordConverter(spec, InputFile(path, path.rsplit("/", 1)[-1], 0, fmt, "none"))


def outcomes(path: str, fmt: str, **kwargs) -> list[tuple[bool, tuple]]:
    converter = converter_for(path, fmt, **kwargs)
    spec = converter.spec
    return list(read_records(converter.input_file, spec))


@pytest.mark.parametrize("image, text, expected", [
    ("a.png", "cap", [("image", "a.png"), "cap"]),
    (["a.png", "b.png"], "cap", [("image", "a.png"), ("image", "b.png"), "cap"]),
    ([None, "a.png", None], ["x", None, "y"], ["x", ("image", "a.png"), "y"]),
])
def test_record_shapes(image, text, expected):
    assert document_parts(image, text, "image", "text") == expected


def test_jsonl_pairs_multi_image_and_interleaved_documents(tmp_path):
    (tmp_path / "imgs").mkdir()
    sources = {}
    for name, size, fmt in [("a.png", (40, 30), "PNG"), ("b.jpg", (64, 64), "JPEG"), ("c.webp", (90, 20), "WEBP")]:
        sources[name] = image_bytes(*size, image_format=fmt, seed=len(name) + size[0])
        (tmp_path / "imgs" / name).write_bytes(sources[name])
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"image": "imgs/a.png", "text": "a caption"},
        {"image": ["imgs/b.jpg", "imgs/c.webp"], "text": "two images"},
        {"image": [None, "imgs/c.webp", None, "imgs/a.png"], "text": ["Intro é. ", None, "Middle.", None]},
    ])
    policy = DynamicResolutionPolicy(max_pixels=100 * 28 * 28)
    results = outcomes(path, "jsonl", policy=policy.to_dict())
    assert all(ok for ok, _ in results), results
    (k0, t0, n0, _, (s0, i0)), (_, t1, _, _, (s1, i1)), (_, t2, _, _, (s2, i2)) = [doc for _, doc in results]
    assert k0 == "d.jsonl#0" and decode_segments(t0, s0) == [0, "a caption"]
    assert n0 == len("a caption") + len(sources["a.png"])  # file sizing counts image bytes
    assert decode_segments(t1, s1) == [0, 1, "two images"]
    assert decode_segments(t2, s2) == ["Intro é. ", 0, "Middle.", 1]
    for images, names in ((i0, ["a.png"]), (i1, ["b.jpg", "c.webp"]), (i2, ["c.webp", "a.png"])):
        for (data, fmt, width, height, sha, tokens), name in zip(images, names):
            assert data == sources[name]  # the bytes as given
            assert sha == hashlib.sha256(data).hexdigest()
            assert tokens == policy.visual_tokens(width, height)
    assert [image[1] for image in i1] == ["JPEG", "WEBP"] and i1[1][2:4] == (90, 20)


def test_bad_records_are_rejected_with_their_reason(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "ok.png").write_bytes(image_bytes(20, 20))
    (tmp_path / "imgs" / "cut.png").write_bytes(image_bytes(20, 20)[:50])
    (tmp_path / "imgs" / "dir.png").mkdir()
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"text": "no image"},
        {"image": 7, "text": "a number"},
        {"image": ["imgs/ok.png"], "text": ["a", "b"]},
        {"image": ["imgs/ok.png", None], "text": ["a", "b"]},
        {"image": "imgs/gone.png", "text": "x"},
        {"image": "imgs/dir.png", "text": "x"},
        {"image": "imgs/cut.png", "text": "x"},
        {"image": ["imgs/ok.png"] * 3, "text": "x"},
        {"image": "imgs/ok.png", "text": "  "},
        {"image": "imgs/ok.png"},
        {"image": "imgs/ok.png", "text": 3},
        {"image": "http://example.invalid/a.png", "text": "a scheme no filesystem reads"},
    ])
    reasons = [element[3] for ok, element in outcomes(path, "jsonl", max_images_per_document=2)]
    assert reasons == ["missing_image_field", "invalid_image_field", "invalid_image_field", "invalid_image_field",
                       "image_missing", "image_unreadable", "image_truncated", "too_many_images", "empty_text",
                       "missing_text_field", "non_string_text", "image_unreadable"]


def test_parquet_binary_and_struct_columns_and_interleaved_lists(tmp_path):
    first, second = image_bytes(50, 40, "PNG", seed=1), image_bytes(30, 60, "JPEG", seed=2)
    (tmp_path / "side.png").write_bytes(first)
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pairs = write_parquet(tmp_path / "pairs.parquet", {
        "image": pa.array([{"bytes": first, "path": None}, {"bytes": None, "path": "side.png"},
                           {"bytes": b"not an image", "path": None}], struct),
        "text": pa.array(["one", "two", "three"]),
    })
    results = outcomes(pairs, "parquet")
    assert [ok for ok, _ in results] == [True, True, False]
    assert results[0][1][4][1][0][0] == first and results[1][1][4][1][0][0] == first
    assert results[2][1][3] == "image_undecodable"
    interleaved = write_parquet(tmp_path / "obelics.parquet", {
        "image": pa.array([[None, second, None], [second]], pa.list_(pa.binary())),
        "text": pa.array([["before", None, "after"], [None]], pa.list_(pa.string())),
    })
    results = outcomes(interleaved, "parquet")
    assert results[0][0] and decode_segments(results[0][1][1], results[0][1][4][0]) == ["before", 0, "after"]
    assert results[1][1][3] == "empty_text"  # an interleaved document of one image and no text


def test_webdataset_samples_group_by_key(tmp_path):
    members = [("s/000.jpg", b"1"), ("s/000.txt", b"a"), ("s/001.0.png", b"2"), ("s/001.json", b"{}"),
               ("s/000.cls", b"x")]
    with open(write_tar(tmp_path / "w.tar", members), "rb") as handle:
        samples = list(iter_samples(handle))
    # s/000 comes back after s/001: a new sample, as WebDataset reads it
    assert samples == [("s/000", {"jpg": b"1", "txt": b"a"}), ("s/001", {"0.png": b"2", "json": b"{}"}),
                       ("s/000", {"cls": b"x"})]
    assert split_member_name("a/b.c/key.Tar.JPG") == ("a/b.c/key", "tar.jpg")


def test_webdataset_documents_and_a_cut_shard(tmp_path):
    png, jpg = image_bytes(32, 32, "PNG", seed=4), image_bytes(48, 24, "JPEG", seed=5)
    members = [
        ("k0.png", png), ("k0.txt", "txt caption".encode()),
        ("k1.jpg", jpg), ("k1.json", b'{"text": "json caption", "id": 5}'),
        ("k2.0.png", png), ("k2.1.jpg", jpg),
        ("k2.json", b'{"image": ["0.png", null, "1.jpg"], "text": [null, "between", null]}'),
        ("k3.txt", b"no image"),
        ("k4.0.png", png), ("k4.1.png", png), ("k4.txt", b"two unordered"),
        ("k5.gif", b"GIF89a"), ("k5.txt", b"gif only"),
        ("k6.png", png[:-30]), ("k6.txt", b"cut image"),
    ]
    path = write_tar(tmp_path / "shard.tar", members)
    results = outcomes(path, "webdataset")
    assert [element[3] if not ok else "ok" for ok, element in results] == [
        "ok", "ok", "ok", "missing_image_field", "invalid_image_field", "missing_image_field", "image_truncated"]
    docs = [element for ok, element in results if ok]
    assert decode_segments(docs[0][1], docs[0][4][0]) == [0, "txt caption"] and docs[0][4][1][0][0] == png
    assert decode_segments(docs[1][1], docs[1][4][0]) == [0, "json caption"] and docs[1][0] == "shard.tar#1"
    assert decode_segments(docs[2][1], docs[2][4][0]) == [0, "between", 1]
    assert [image[0] for image in docs[2][4][1]] == [png, jpg]
    # Cut inside the 5th sample's members: the samples before it, then one unreadable_file.
    data = open(path, "rb").read()
    cut = write_tar(tmp_path / "cut.tar", [])
    open(cut, "wb").write(data[: data.index(b"two unordered") - 100])
    results = outcomes(cut, "webdataset")
    assert [ok for ok, _ in results] == [True, True, True, False, False]
    assert results[-1][1][3] == "unreadable_file" and results[-1][1][2] == 4
    # Cut at a member boundary (no end-of-archive block): still found, the last sample not kept.
    body = data.rstrip(b"\0")
    open(cut, "wb").write(body + bytes(-len(body) % 512))
    results = outcomes(cut, "webdataset")
    assert len(results) == 7 and results[-1][1][3] == "unreadable_file" and results[-1][1][2] == 6


def test_image_root_is_the_base_of_relative_paths(tmp_path):
    (tmp_path / "images" / "sub").mkdir(parents=True)
    data = image_bytes(16, 16, "PNG", seed=3)
    (tmp_path / "images" / "sub" / "a.png").write_bytes(data)
    (tmp_path / "meta").mkdir()
    path = write_jsonl(tmp_path / "meta" / "d.jsonl", [{"image": "sub/a.png", "text": "elsewhere"}])
    spec = RecordSpec(images=ImageSpec(image_field="image", image_root=str(tmp_path / "images")))
    ((ok, document),) = read_records(InputFile(path, "d.jsonl", 0, "jsonl", "none"), spec)
    assert ok and document[4][1][0][0] == data
    ((ok, rejection),) = outcomes(path, "jsonl")  # without the root: relative to meta/, not there
    assert not ok and rejection[3] == "image_missing" and str(tmp_path / "meta" / "sub" / "a.png") in rejection[4]


def test_resolve_image_path():
    assert resolve_image_path("/data/in", "imgs/a.jpg") == "/data/in/imgs/a.jpg"
    for climbing in ("../x/a.jpg", "imgs/../../a.jpg", "../../etc/passwd"):  # confined to the root (issue 28)
        with pytest.raises(_Reject, match="climbs out of its root"):
            resolve_image_path("/data/in", climbing)
    with pytest.raises(_Reject, match="climbs out of its root"):
        resolve_image_path("gs://b/in/", "../a.jpg")
    assert resolve_image_path("gs://b/in/", "imgs/../a.jpg") == "gs://b/in/a.jpg"
    assert resolve_image_path("gs://b/in/", "gs://c/a.jpg") == "gs://c/a.jpg"
    assert resolve_image_path("/data/in", "/abs/a.jpg") == "/abs/a.jpg"


def test_gcs_image_files_are_read_through_storage(tmp_path, monkeypatch):
    from google.cloud import storage as gcs_storage

    from tests.gcs.gcs_testing import start_emulator

    proc, endpoint = start_emulator()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
        client = gcs_storage.Client.create_anonymous_client()
        bucket = client.create_bucket("zephon-images")
        data = image_bytes(30, 20, "WEBP", seed=8)
        bucket.blob("imgs/a.webp").upload_from_string(data)
        path = write_jsonl(tmp_path / "d.jsonl", [{"image": "imgs/a.webp", "text": "from a bucket"},
                                                  {"image": "imgs/none.webp", "text": "missing"}])
        spec = RecordSpec(images=ImageSpec(image_field="image", image_root="gs://zephon-images/"))
        results = list(read_records(InputFile(path, "d.jsonl", 0, "jsonl", "none"), spec))
        assert results[0][0] and results[0][1][4][1][0][0] == data
        assert results[1][1][3] == "image_missing"
    finally:
        proc.terminate()
        proc.wait(10)


def test_lane_file_bytes_do_not_depend_on_row_arrival_even_for_duplicate_keys():
    import random

    data = [image_bytes(12, 12, "PNG", seed=i) for i in range(4)]
    rows = [((7).to_bytes(8, "big"), "same key", "same text", ('"kept"',),
             ((-1, 9), ((d, "PNG", 12, 12, hashlib.sha256(d).hexdigest(), None),))) for d in data]
    expected = serialize_lane_file(sort_rows(rows, True), ("meta",), images=True).data
    for seed in range(3):
        shuffled = rows[:]
        random.Random(seed).shuffle(shuffled)
        assert serialize_lane_file(sort_rows(shuffled, True), ("meta",), images=True).data == expected


def test_lane_file_image_columns_hold_the_bytes_and_text_rows_are_unchanged(tmp_path):
    data = [image_bytes(20 + i, 10 + i, "PNG", seed=i) for i in range(3)]
    rows = [((i).to_bytes(8, "big"), f"k{i}", f"text {i}", (),
             ((-1, 6), ((data[i], "PNG", 20 + i, 10 + i, hashlib.sha256(data[i]).hexdigest(), 7 + i),)))
            for i in range(3)]
    serialized = serialize_lane_file(sort_rows(rows, False), (), images=True, visual_tokens=True)
    table = pq.read_table(io.BytesIO(serialized.data))
    assert [n for n in table.schema.names if n in IMAGE_COLUMNS] == list(IMAGE_COLUMNS)
    assert table.column("image_bytes").to_pylist() == [[d] for d in data]
    assert table.column("image_visual_tokens").to_pylist() == [[7], [8], [9]]
    assert table.column("num_images").to_pylist() == [1, 1, 1] and serialized.images == 3
    metadata = pq.ParquetFile(io.BytesIO(serialized.data)).metadata.row_group(0)
    codecs = {metadata.column(i).path_in_schema: metadata.column(i).compression for i in range(metadata.num_columns)}
    assert codecs["image_bytes.list.element"] == "UNCOMPRESSED" and codecs["text"] == "ZSTD"
    # Text rows: no image column, and the same bytes whatever the new defaults.
    text_rows = [row[:4] for row in rows]
    assert serialize_lane_file(text_rows, ()).data == serialize_lane_file(text_rows, (), images=False).data
    assert not set(lane_schema(False, ()).names) & set(IMAGE_COLUMNS)
    assert np.array_equal(lane_schema(False, (), images=True).names[:3], ["key", "order_key", "text"])
