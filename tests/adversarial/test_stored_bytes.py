"""Stored bytes read back: images, chat templates and seek indexes (issue 28, class 1).

Every case ends in a :class:`loader.errors.ZephonError` naming the file, or in batches
identical to the untampered run; never a silent change.

* **Images**: a byte flipped inside many stored images (JPEG, PNG, WebP; start, middle, end
  of each) is caught by the page checksums the resolver now verifies; an image rewritten in a
  well-formed lane file (page checksums recomputed by the writer) is caught by its stored
  ``image_sha256``.
* **Templates**: an online chat manifest whose ``chat.template`` is edited, with the dataset
  fingerprint recomputed by the forger, is refused: the template must hash to its own
  ``template_fingerprint``.
* **Seek index**: an edited point re-digested with the formula the file used to carry (a plain
  SHA-256) is refused (the seal is an HMAC under the user's key); a re-sealed point naming a
  block past its lane is a :class:`SeekIndexError`, not a bare ``IndexError``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "vision"))  # the image tests' factories import each other by name
from image_loader_data import DYNAMIC, image_config, image_of, image_tokenizer, shard_images  # noqa: E402
from loader.commands import audit as audit_module  # noqa: E402
from loader.commands import seek_index  # noqa: E402
from loader.commands.audit import audit_step  # noqa: E402
from loader.commands.seek_index import SeekIndexError  # noqa: E402
from loader.errors import ZephonError  # noqa: E402
from loader.io.manifest import MANIFEST_NAME, ManifestError, read_manifest  # noqa: E402
from loader.pipeline import ZephonLoader  # noqa: E402
from loader.vision import resolve  # noqa: E402

DOCUMENTS = 60


# ---------------------------------------------------------------------------------------
# images


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stored_images")
    return {"dataset": shard_images(root, root / "counted", DOCUMENTS, DYNAMIC),
            "tokenizer": image_tokenizer(root / "tokenizer.json"), "root": root}


def image_batches(dataset: str, tokenizer: str) -> list[str]:
    """SHA-256 of every micro-batch's ids and pixels over one epoch."""
    config = image_config([{"path": dataset, "max_epochs": 1}], tokenizer, verify_local_files=False,
                          global_batch_size=4, micro_batch_size=2)
    out = []
    with ZephonLoader(config, output="numpy") as loader:
        for batch in loader:
            out.append(hashlib.sha256(batch["input_ids"].tobytes() + batch["pixel_values"].tobytes()).hexdigest())
    return out


@pytest.fixture(scope="module")
def clean_images(images) -> list[str]:
    digests = image_batches(images["dataset"], images["tokenizer"])
    assert len(digests) >= 3
    return digests


def image_sites(dataset: str) -> list[tuple[str, int, int]]:
    """``(lane file, offset, length)`` of every stored image's bytes (stored without a codec)."""
    sites = []
    for index in range(100):
        data = image_of(index)
        for lane_file in sorted(Path(dataset).glob("lane=*/part-*.parquet")):
            at = lane_file.read_bytes().find(data)
            if at >= 0:
                sites.append((str(lane_file), at, len(data)))
                break
    return sites


def image_outcome(dataset: str, tokenizer: str, clean: list[str], must_name: str) -> str:
    try:
        got = image_batches(dataset, tokenizer)
    except ZephonError as exc:
        assert must_name in str(exc), f"error does not name {must_name}: {exc}"
        return "error"
    assert got == clean, f"batches changed silently ({sum(a != b for a, b in zip(got, clean))} differ)"
    return "identical"


def test_a_byte_flipped_inside_stored_images_is_an_error_or_harmless(images, clean_images, tmp_path):
    sites = image_sites(images["dataset"])
    assert len(sites) >= 20  # every kind of image of the fixture, in several lane files
    verdicts = []
    for k, (lane_file, at, length) in enumerate(sites[:20]):
        for where in (8, length // 2, length - 3):
            copy = str(tmp_path / f"flip-{k}-{where}")
            shutil.copytree(images["dataset"], copy)
            target = os.path.join(copy, os.path.relpath(lane_file, images["dataset"]))
            with open(target, "r+b") as handle:
                handle.seek(at + where)
                byte = handle.read(1)[0]
                handle.seek(at + where)
                handle.write(bytes([byte ^ 0x10]))
            verdicts.append(image_outcome(copy, images["tokenizer"], clean_images, os.path.basename(target)))
            shutil.rmtree(copy)
    assert verdicts.count("error") >= len(verdicts) // 2  # the images are read: most flips must be seen


def rewrite_image(lane_file: str, flip_at: int) -> None:
    """Rewrite the lane file with one byte of its first image changed, row groups kept: a
    well-formed Parquet file (fresh page checksums) whose ``image_sha256`` no longer fits."""
    parquet = pq.ParquetFile(lane_file)
    groups = [parquet.read_row_group(g) for g in range(parquet.metadata.num_row_groups)]
    schema = parquet.schema_arrow
    parquet.close()
    for g, table in enumerate(groups):
        images_column = table.column("image_bytes").to_pylist()
        row = next((r for r, v in enumerate(images_column) if v), None)
        if row is None:
            continue
        data = bytearray(images_column[row][0])
        data[min(flip_at, len(data) - 1)] ^= 0x01
        images_column[row][0] = bytes(data)
        at = table.schema.get_field_index("image_bytes")
        groups[g] = table.set_column(at, table.schema.field(at), pa.array(images_column, table.schema.field(at).type))
        break
    with pq.ParquetWriter(lane_file, schema, write_page_checksum=True, compression="none") as writer:
        for table in groups:
            writer.write_table(table, row_group_size=max(1, table.num_rows))


def forge_manifest(dataset: str) -> None:
    """The manifest a forger writes for rewritten lane files: sizes, SHA-256s and fingerprint updated."""
    manifest = read_manifest(dataset)
    files = [replace(f, bytes=os.path.getsize(os.path.join(dataset, f.path)),
                     sha256=hashlib.sha256(Path(dataset, f.path).read_bytes()).hexdigest()) for f in manifest.files]
    data = json.loads(Path(dataset, MANIFEST_NAME).read_text())
    data["files"] = [dict(entry, bytes=f.bytes, sha256=f.sha256) for entry, f in zip(data["files"], files)]
    data["dataset_fingerprint"] = replace(manifest, files=files).compute_fingerprint()
    Path(dataset, MANIFEST_NAME).write_text(json.dumps(data))


@pytest.mark.parametrize("flip_at", [20, 200, 10_000])
def test_an_image_rewritten_in_a_well_formed_lane_file_is_refused(images, clean_images, tmp_path, flip_at):
    copy = str(tmp_path / "rewritten")
    shutil.copytree(images["dataset"], copy)
    files = sorted(Path(copy).glob("lane=*/part-*.parquet"))
    for lane_file in files:
        rewrite_image(str(lane_file), flip_at)
    forge_manifest(copy)
    with pytest.raises(ZephonError, match=r"lane=\d+/part-\d+\.parquet.*SHA-256"):
        image_batches(copy, images["tokenizer"])


def test_the_image_check_is_what_catches_a_rewritten_image(images, clean_images, tmp_path, monkeypatch):
    """Mutation check, kept: without the SHA-256 check the rewritten image changes the pixels silently."""
    copy = str(tmp_path / "rewritten")
    shutil.copytree(images["dataset"], copy)
    for lane_file in sorted(Path(copy).glob("lane=*/part-*.parquet")):
        rewrite_image(str(lane_file), 200)
    forge_manifest(copy)
    monkeypatch.setattr(resolve, "verify_image_bytes", lambda data, stored, where: None)
    try:
        got = image_batches(copy, images["tokenizer"])
    except ZephonError:
        return  # a decoder error on the changed byte is also loud
    assert got != clean_images


# ---------------------------------------------------------------------------------------
# chat templates


@pytest.fixture(scope="module")
def online_chat(tmp_path_factory) -> str:
    from beam_jobs import shard
    from tests.chat.chat_factory import make_records
    from tests.chat.conftest import online_args
    from tests.chat.test_chat_shard import _write_jsonl

    base = tmp_path_factory.mktemp("stored_template")
    (base / "in").mkdir()
    _write_jsonl(base / "in" / "chat.jsonl", make_records(12, 5))
    shard.run(online_args([str(base / "in" / "chat.jsonl")], base / "online"))
    return str(base / "online")


TEMPLATE_EDITS = {
    "source_text": lambda t: t["sources"].update({k: v.replace("assistant", "assistent", 1)
                                                  for k, v in list(t["sources"].items())[:1]}),
    "source_appended": lambda t: t["sources"].update({k: v + "{{ '' }}" for k, v in list(t["sources"].items())[:1]}),
    "special_token": lambda t: t.setdefault("special_tokens", {}).update({"eos_token": "<|x|>"}),
    "variable_added": lambda t: t.setdefault("extra_variables", {}).update({"date_string": "1 Jan 2000"}),
    "template_name": lambda t: t.update({"template_name": "tool_use"}),
}


@pytest.mark.parametrize("edit", sorted(TEMPLATE_EDITS))
def test_an_edited_stored_template_is_refused_even_re_fingerprinted(online_chat, tmp_path, edit):
    copy = str(tmp_path / "edited")
    shutil.copytree(online_chat, copy)
    manifest = read_manifest(copy)
    data = json.loads(Path(copy, MANIFEST_NAME).read_text())
    TEMPLATE_EDITS[edit](data["chat"]["template"])
    forged = replace(manifest, chat=replace(manifest.chat, template=data["chat"]["template"]))
    data["dataset_fingerprint"] = forged.compute_fingerprint()  # the forger recomputes the dataset's
    Path(copy, MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"chat.*'template'.*template_fingerprint"):
        read_manifest(copy)


def test_the_untouched_stored_template_passes(online_chat):
    assert read_manifest(online_chat).chat.template is not None


# ---------------------------------------------------------------------------------------
# seek index


@pytest.fixture
def sealed_index(make_config, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(audit_module, "POINT_EVERY", 5)
    config = make_config("best_fit", pretokenized=True)
    index = tmp_path / "seek"
    audit_step(config, 20, seek_index=str(index))
    (path,) = [index / name for name in os.listdir(index)]
    return config, index, path


def _reseal_plain(data: dict) -> None:
    """What an editor can recompute: the digest formula in the module, without the key."""
    blob = json.dumps(data["lanes"], sort_keys=True, separators=(",", ":")).encode()
    data["hmac_sha256"] = hashlib.sha256(blob).hexdigest()


POINT_EDITS = {
    "offset+1": lambda s: s["packer"]["stream"].update(offset=s["packer"]["stream"]["offset"] + 1),
    "block+1": lambda s: s["packer"]["stream"].update(block=s["packer"]["stream"]["block"] + 1),
    "serial+1": lambda s: s["packer"].update(serial=s["packer"]["serial"] + 1),
    "stopped": lambda s: s.update(stopped=not s["stopped"]),
    "bins_dropped": lambda s: s["packer"].update(bins=[]),
}


@pytest.mark.parametrize("edit", sorted(POINT_EDITS))
def test_an_edited_seek_point_re_digested_without_the_key_is_refused(sealed_index, edit):
    config, index, path = sealed_index
    data = json.loads(path.read_text())
    for points in data["lanes"].values():
        for point in points.values():
            POINT_EDITS[edit](point["sources"][0])
    _reseal_plain(data)
    path.write_text(json.dumps(data))
    with pytest.raises(SeekIndexError, match=f"{path}.*hmac_sha256"):
        audit_step(config, 30, seek_index=str(index))


@pytest.mark.parametrize("block", [10**3, 10**6])
def test_a_re_sealed_point_past_its_lane_is_a_seek_index_error(sealed_index, block):
    config, index, path = sealed_index
    data = json.loads(path.read_text())
    for points in data["lanes"].values():
        for point in points.values():
            point["sources"][0]["packer"]["stream"]["block"] = block
    data["hmac_sha256"] = seek_index._seal(data["lanes"])  # a holder of the key: bounds still hold
    path.write_text(json.dumps(data))
    with pytest.raises(SeekIndexError, match=f"{path}.*block {block}"):
        audit_step(config, 30, seek_index=str(index))


def test_another_users_key_does_not_open_the_index(sealed_index, tmp_path, monkeypatch):
    config, index, path = sealed_index
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another-user"))
    with pytest.raises(SeekIndexError, match="another user's key"):
        audit_step(config, 30, seek_index=str(index))
    key = tmp_path / "another-user" / "zephon" / "seek-index.key"
    assert oct(key.stat().st_mode & 0o777) == "0o600"
