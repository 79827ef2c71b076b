"""The sharding job on generated image datasets: JSONL + image files, Parquet bytes, WebDataset tars.

One job reads all three input forms at once, with one or more bad records per image reject
reason; the lanes are read back and every document compared with what was written.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from beam_jobs import shard
from beam_jobs.image_records import ImageOptionError
from image_datasets import write_jsonl, write_parquet, write_tar
from image_factory import FORMATS, drawn_image, encode, image_bytes
from loader.io.manifest import Manifest, ManifestError, read_manifest
from loader.kinds.image import IMAGE_DOCUMENT_REJECT_REASONS
from loader.vision.policies import DynamicResolutionPolicy
from loader.vision.reasons import IMAGE_REJECT_REASONS
from loader.vision.documents import ImageDocument

IN_MEMORY = ["--runner=FnApiRunner", "--direct_running_mode=in_memory"]
MULTI_THREADING = ["--runner=FnApiRunner", "--direct_running_mode=multi_threading", "--direct_num_workers=2"]
POLICY = DynamicResolutionPolicy(min_pixels=28 * 28, max_pixels=64 * 28 * 28)
PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # whole PNG framing around noise: undecodable, not cut
LIMIT_ARGS = ["--max-image-pixels", "250000", "--max-images-per-document", "4"]


def build_inputs(root: Path) -> tuple[list[str], dict[str, list], int]:
    """``(input paths, expected documents by key, number of records)``; a document is its parts,
    texts as str and images as their bytes."""
    root.mkdir()
    (root / "imgs").mkdir()
    expected: dict[str, list] = {}
    sizes = [(1, 1), (17, 300), (640, 48), (123, 77), (64, 64), (480, 360), (33, 1), (90, 200)]

    def stored(name: str, data: bytes) -> str:
        (root / "imgs" / name).write_bytes(data)
        return f"imgs/{name}"

    # JSONL naming image files: pairs, multi-image captions, interleaved documents.
    jsonl = []
    for i in range(18):
        size, fmt = sizes[i % len(sizes)], FORMATS[i % 3]
        data = image_bytes(*size, image_format=fmt, seed=i)
        path = stored(f"j{i}.{fmt.lower()}", data)
        if i % 3 == 0:
            second = image_bytes(20, 30, "PNG", seed=100 + i)
            jsonl.append({"image": [None, path, None, stored(f"j{i}b.png", second)],
                          "text": [f"Doc {i} starts. ", None, "Then é.", None]})
            expected[f"caps.jsonl#{i}"] = [f"Doc {i} starts. ", data, "Then é.", second]
        elif i % 3 == 1:
            jsonl.append({"image": [path, path], "text": f"twice {i}"})
            expected[f"caps.jsonl#{i}"] = [data, data, f"twice {i}"]
        else:
            jsonl.append({"image": path, "text": f"caption {i}"})
            expected[f"caps.jsonl#{i}"] = [data, f"caption {i}"]
    (root / "imgs" / "a_directory.png").mkdir()
    good_png = stored("good.png", image_bytes(10, 10, "PNG"))
    bad_jsonl = [
        ({"text": "no image field"}, "missing_image_field"),
        ({"image": {"neither": 1}, "text": "struct without bytes or path"}, "image_missing"),
        ({"image": 5, "text": "a number"}, "invalid_image_field"),
        ({"image": "imgs/gone.png", "text": "missing file"}, "image_missing"),
        ({"image": "imgs/a_directory.png", "text": "a directory"}, "image_unreadable"),
        ({"image": stored("cut.jpg", image_bytes(60, 60, "JPEG")[:300]), "text": "cut"}, "image_truncated"),
        ({"image": stored("noise.png", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4 + PNG_IEND), "text": "noise"},
         "image_undecodable"),
        ({"image": stored("anim.gif", encode(drawn_image(20, 20), "GIF")), "text": "gif"}, "image_unsupported_format"),
        ({"image": stored("big.png", image_bytes(600, 600, "PNG")), "text": "too many pixels"}, "image_too_large"),
        ({"image": stored("thin.png", image_bytes(402, 2, "PNG")), "text": "thin"}, "image_extreme_aspect_ratio"),
        ({"image": [good_png] * 5, "text": "five images"}, "too_many_images"),
        ({"image": good_png, "text": "   "}, "empty_text"),
    ]
    expected_reasons = {}
    for offset, (record, reason) in enumerate(bad_jsonl):
        jsonl.append(record)
        expected_reasons[f"caps.jsonl#{18 + offset}"] = reason
    inputs = [write_jsonl(root / "caps.jsonl", jsonl)]

    # Parquet: a binary column and the Hugging Face {bytes, path} struct.
    binary, struct_rows, texts = [], [], []
    for i in range(10):
        data = image_bytes(*sizes[(i + 3) % len(sizes)], image_format=FORMATS[(i + 1) % 3], seed=200 + i)
        binary.append(data)
        texts.append(f"parquet caption {i}")
        expected[f"pairs.parquet#{i}"] = [data, texts[-1]]
    binary.append(b"GIF89a not really")
    texts.append("unsupported")
    expected_reasons["pairs.parquet#10"] = "image_undecodable"
    inputs.append(write_parquet(root / "pairs.parquet", {"image": pa.array(binary, pa.binary()),
                                                         "text": pa.array(texts)}))
    for i in range(4):
        data = image_bytes(50 + i, 40, "PNG", seed=300 + i)
        struct_rows.append({"bytes": data, "path": None})
        expected[f"hf.parquet#{i}"] = [data, f"hf {i}"]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    inputs.append(write_parquet(root / "hf.parquet", {"image": pa.array(struct_rows, struct),
                                                      "text": pa.array([f"hf {i}" for i in range(4)])}))

    # WebDataset: .txt captions, .json captions, an interleaved .json, bad samples.
    members = []
    for i in range(10):
        data = image_bytes(*sizes[(i + 5) % len(sizes)], image_format=FORMATS[i % 3], seed=400 + i)
        ext = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}[FORMATS[i % 3]]
        members.append((f"s{i:03d}.{ext}", data))
        if i % 2:
            members.append((f"s{i:03d}.txt", f"tar caption {i}".encode()))
        else:
            members.append((f"s{i:03d}.json", json.dumps({"text": f"tar json {i}"}).encode()))
        expected[f"shard.tar#{i}"] = [data, f"tar caption {i}" if i % 2 else f"tar json {i}"]
    first, second = image_bytes(40, 40, "WEBP", seed=500), image_bytes(70, 20, "JPEG", seed=501)
    members += [("s010.0.webp", first), ("s010.1.jpg", second),
                ("s010.json", json.dumps({"image": ["0.webp", None, "1.jpg"], "text": [None, "mid", None]}).encode())]
    expected["shard.tar#10"] = [first, "mid", second]
    members += [("s011.txt", b"caption without image")]
    expected_reasons["shard.tar#11"] = "missing_image_field"
    members += [("s012.0.png", first), ("s012.1.png", first), ("s012.txt", b"unordered")]
    expected_reasons["shard.tar#12"] = "invalid_image_field"
    inputs.append(write_tar(root / "shard.tar", members))
    records = len(expected) + len(expected_reasons)
    return inputs, expected, records, expected_reasons


def run_job(inputs, output, *extra):
    return shard.run(["--input", *inputs, "--output", str(output), "--num-lanes", "4", "--image-field", "image",
                      "--max-reject-fraction", "0.5", *LIMIT_ARGS, *extra])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    inputs, expected, records, reasons = build_inputs(root / "in")
    policy = json.dumps(POLICY.to_dict())
    manifest = run_job(inputs, root / "ds", "--image-policy", policy, *IN_MEMORY)
    return root, inputs, expected, records, reasons, manifest


def lane_rows(dataset_dir: Path, manifest: Manifest) -> list[dict]:
    rows = []
    for entry in manifest.files:
        table = pq.read_table(dataset_dir / entry.path)
        assert table.num_rows == entry.rows
        rows += table.to_pylist()
    return rows


def test_every_document_is_in_the_lanes_as_given(dataset):
    root, _inputs, expected, records, _reasons, manifest = dataset
    rows = lane_rows(root / "ds", manifest)
    assert sorted(row["key"] for row in rows) == sorted(expected)
    for row in rows:
        document = ImageDocument.from_row(row)
        want = expected[row["key"]]
        assert [p if isinstance(p, str) else document.images[p].data for p in document.parts] == want, row["key"]
        assert row["num_images"] == len(document.images) == sum(not isinstance(p, str) for p in want)
        for image in document.images:
            assert image.sha256 == hashlib.sha256(image.data).hexdigest()
            decoded = Image.open(io.BytesIO(image.data))
            assert (image.format, image.width, image.height) == (decoded.format, decoded.width, decoded.height)
            assert image.visual_tokens == POLICY.visual_tokens(image.width, image.height)
    broken = dict(rows[0], num_images=rows[0]["num_images"] + 1)
    with pytest.raises(ValueError, match="inconsistent"):
        ImageDocument.from_row(broken)
    assert manifest.images.images == sum(row["num_images"] for row in rows)
    assert manifest.images.policy == POLICY.to_dict() and manifest.images.policy_fingerprint == POLICY.fingerprint()
    assert manifest.images.policy_mismatch(POLICY) is None
    other = DynamicResolutionPolicy(min_pixels=28 * 28, max_pixels=65 * 28 * 28)
    assert "max_pixels: 50176 in the manifest, 50960 given" in manifest.images.policy_mismatch(other)
    assert manifest.images.limits["max_pixels"] == 250000 and manifest.images.limits["max_images_per_document"] == 4
    names = [column["name"] for column in manifest.schema]
    assert names[:4] == ["key", "order_key", "text", "segments"] and names[-1] == "image_visual_tokens"


def test_every_reject_reason_is_counted_and_documents_in_equal_out_plus_rejected(dataset):
    root, _inputs, expected, records, reasons, manifest = dataset
    assert manifest.documents == len(expected)
    assert manifest.documents + sum(manifest.rejected.values()) == records
    assert set(manifest.rejected) == set(IMAGE_DOCUMENT_REJECT_REASONS)
    assert set(IMAGE_REJECT_REASONS) <= set(reasons.values())  # every image reason exercised
    counted = {reason: list(reasons.values()).count(reason) for reason in set(reasons.values())}
    assert {r: c for r, c in manifest.rejected.items() if c} == counted
    written = {}
    for path in sorted((root / "ds" / "_rejected").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            written[f"{Path(entry['input_file']).name}#{entry['record_index']}"] = entry["reason"]
    assert written == reasons


def test_runner_modes_give_byte_identical_lanes_and_manifest(dataset, tmp_path):
    root, inputs, _expected, _records, _reasons, manifest = dataset
    again = run_job(inputs, tmp_path / "ds", "--image-policy", json.dumps(POLICY.to_dict()), *MULTI_THREADING)
    assert again.dataset_fingerprint == manifest.dataset_fingerprint
    for entry in manifest.files:
        assert (tmp_path / "ds" / entry.path).read_bytes() == (root / "ds" / entry.path).read_bytes()
    assert (tmp_path / "ds" / "manifest.json").read_bytes() == (root / "ds" / "manifest.json").read_bytes()


def test_without_a_policy_no_visual_tokens_and_the_manifest_says_so(dataset, tmp_path):
    root, inputs, _expected, _records, _reasons, manifest = dataset
    plain = run_job(inputs[:1], tmp_path / "plain", *IN_MEMORY)
    assert "image_visual_tokens" not in [c["name"] for c in plain.schema]
    assert plain.images.policy is None and plain.images.policy_fingerprint is None
    data = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    data["images"]["images"] += 1  # an edited count no longer matches the fingerprint
    with pytest.raises(ManifestError, match="does not match its content"):
        Manifest.from_dict(data)
    data["images"] = {"images": -1, "limits": {}}
    with pytest.raises(ManifestError, match="images: field 'images' must be an int >= 0"):
        Manifest.from_dict(data)
    assert read_manifest(str(tmp_path / "plain")).images == plain.images
    from beam_jobs.inspect_dataset import render_text, summarize

    summary = summarize(plain, str(tmp_path / "plain"))
    assert summary["images"]["images"] == plain.images.images > 0
    assert f"images         {plain.images.images:,} (visual tokens: not counted offline)" in render_text(summary)


def test_webdataset_alone_is_an_image_job_and_option_errors_name_the_fix(dataset, tmp_path):
    root, inputs, *_ = dataset
    tar_only = shard.run(["--input", inputs[-1], "--output", str(tmp_path / "tar"), "--num-lanes", "2",
                          "--max-reject-fraction", "0.5", *IN_MEMORY])
    # Without --image-field the interleaved sample's .json order is not read: 2 unordered images.
    assert tar_only.documents == 10 and tar_only.rejected["invalid_image_field"] == 2
    assert tar_only.images is not None and tar_only.images.policy is None
    with pytest.raises(ImageOptionError, match="needs --image-field"):
        shard.run(["--input", *inputs, "--output", str(tmp_path / "x"), *IN_MEMORY])
    with pytest.raises(shard.ShardConfigError, match="--tokenizer with images"):
        shard.parse_args(["--input", "a.jsonl", "--output", "o", "--image-field", "image", "--tokenizer", "t.json"])
    with pytest.raises(shard.ShardConfigError, match="--keep-fields segments: these names are the image columns"):
        shard.parse_args(["--input", "a.jsonl", "--output", "o", "--image-field", "image", "--keep-fields", "segments"])
    with pytest.raises(ImageOptionError, match="kind must be one of fixed, dynamic"):
        shard.parse_args(["--input", "a.jsonl", "--output", "o", "--image-field", "image", "--image-policy", "big"])
    with pytest.raises(ImageOptionError, match="max_pixels must be a positive number"):
        shard.parse_args(["--input", "a.jsonl", "--output", "o", "--image-field", "image", "--max-image-pixels", "0"])
    with pytest.raises(ImageOptionError, match="--image-root .*nowhere is not a directory"):
        shard.run(["--input", inputs[0], "--output", str(tmp_path / "z"), "--image-field", "image",
                   "--image-root", str(tmp_path / "nowhere"), *IN_MEMORY])
    text = tmp_path / "t.txt"
    text.write_text("a text document")
    with pytest.raises(ImageOptionError, match="cannot read text input"):
        shard.run(["--input", str(text), inputs[0], "--output", str(tmp_path / "y"), "--image-field", "image",
                   *IN_MEMORY])


def test_the_loader_delivers_every_image_of_the_dataset_once_per_epoch(dataset, tmp_path):
    """Every lane drained to the end of one epoch (exhaustion "stop"): each stored image is in
    exactly one packed sequence, its pixels the policy's output for its bytes (documents in =
    out: nothing is read as captions alone, nothing twice)."""
    from image_loader_data import image_tokenizer
    from loader.config import LoaderConfig
    from loader.pipeline import ZephonLoader
    from loader.stages.lane import LaneExhausted
    from loader.stages.producer import build_lanes

    root, manifest = dataset[0], dataset[-1]
    config = LoaderConfig(datasets=({"path": str(root / "ds"), "name": "pictures", "exhaustion": "stop"},),
                          seq_len=256, global_batch_size=4, micro_batch_size=2, seed=0, packing="best_fit",
                          tokenizer=image_tokenizer(tmp_path / "tokenizer.json"))
    with ZephonLoader(config, output="numpy") as loader:
        lanes = build_lanes(loader.spec, list(range(manifest.num_lanes)), {})
    delivered = []
    for lane_id, lane in lanes.items():
        for k in range(10_000):
            try:
                _, sequence = lane.next_sequence(lane_id + k * manifest.num_lanes)
            except LaneExhausted:
                break
            delivered += [hashlib.sha256(p.tobytes()).hexdigest() for p in sequence.images.pixels]
        lane.close()
    stored = [hashlib.sha256(POLICY.process_compact(data).values.tobytes()).hexdigest()
              for row in lane_rows(root / "ds", manifest) for data in row["image_bytes"]]
    assert len(stored) == manifest.images.images
    assert sorted(delivered) == sorted(stored)
