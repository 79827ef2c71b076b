"""Image paths in records: confined, regular files only, bounded, never quoted (issue 28,
classes 4 and 8).

Every hostile path ends as a counted reject whose ``_rejected/`` record names the path and
the reason without quoting the bytes of whatever file it reached, and the job never hangs:

* relative paths that climb out of the root (``../``, ``a/../../``, ``../../etc/passwd``);
* a FIFO (opening it for a blocking read would wait forever), ``/dev/zero`` (endless),
  ``/dev/null``, a directory;
* a file larger than ``--max-image-mb``, and a text file that is not an image.
Good images beside them are kept, and absolute paths the record writes are used as given.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "vision"))  # the image tests' factories import each other by name
from image_factory import image_bytes  # noqa: E402
from beam_jobs import shard  # noqa: E402
from image_loader_data import IN_MEMORY as IN_MEMORY_RUNNER  # noqa: E402

SECRET = "root:x:0:0:zephon-secret-line"


def _rejected(output: Path) -> list[dict]:
    records = []
    for path in sorted((output / "_rejected").glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


@pytest.mark.timeout(90)
def test_hostile_image_paths_are_counted_rejects_that_quote_nothing(tmp_path):
    root = tmp_path / "in"
    (root / "imgs").mkdir(parents=True)
    outside = tmp_path / "passwd"
    outside.write_text(SECRET + "\n" * 40)
    (root / "imgs" / "fake.jpg").write_text(SECRET * 10)  # inside the root, but no image
    (root / "imgs" / "big.png").write_bytes(image_bytes(64, 64, "PNG", seed=1) + b"\0" * 1_200_000)
    os.mkfifo(root / "imgs" / "pipe.jpg")
    (root / "imgs" / "dir.jpg").mkdir()
    good = []
    for k in range(6):
        (root / "imgs" / f"ok{k}.png").write_bytes(image_bytes(32 + k, 40, "PNG", seed=k))
        good.append(f"imgs/ok{k}.png")
    (tmp_path / "abs.png").write_bytes(image_bytes(30, 30, "PNG", seed=9))
    hostile = {"../passwd": "climbs out", "imgs/../../passwd": "climbs out", "../../../../../../etc/passwd":
               "climbs out", "imgs/pipe.jpg": "not a regular file", "/dev/zero": "not a regular file",
               "/dev/null": "not a regular file", "imgs/dir.jpg": "Is a directory",
               "imgs/big.png": "above the limit", "imgs/fake.jpg": "not an image"}
    records = [{"image": name, "text": f"hostile {k}"} for k, name in enumerate(hostile)]
    records += [{"image": name, "text": f"good {k}"} for k, name in enumerate(good)]
    records.append({"image": str(tmp_path / "abs.png"), "text": "absolute, as written"})
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    output = tmp_path / "out"
    manifest = shard.run(["--input", str(root / "docs.jsonl"), "--output", str(output), "--num-lanes", "2",
                          "--image-field", "image", "--max-image-mb", "1", "--max-reject-fraction", "0.9",
                          *IN_MEMORY_RUNNER])
    assert manifest.documents == len(good) + 1
    rejected = _rejected(output)
    assert len(rejected) == len(hostile)
    text = json.dumps(rejected)
    assert "root:x:0" not in text and "zephon-secret" not in text
    for k, (name, why) in enumerate(hostile.items()):
        (record,) = [r for r in rejected if f"hostile {k}" in json.dumps(r)]
        assert why in json.dumps(record), (name, record)


def _tar(path: Path, members: list[tuple[str, bytes]], *, claim: tuple[str, int] = None) -> None:
    """A WebDataset shard of ``members``; with ``claim``, a last member whose header gives that
    size over a few bytes of data (and no end-of-archive block: the shard is cut)."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    data = buffer.getvalue()
    if claim is not None:
        data = data.rstrip(b"\0")  # the end-of-archive blocks off (the last member, text, ends in no zero)
        data += b"\0" * (-len(data) % 512)
        info = tarfile.TarInfo(claim[0])
        info.size = claim[1]
        data += info.tobuf(format=tarfile.GNU_FORMAT) + b"x" * 4096
    path.write_bytes(data)


@pytest.mark.timeout(90)
def test_a_too_large_tar_member_is_a_counted_reject_and_the_tar_goes_on(tmp_path, monkeypatch):
    import tarfile

    extracted = []  # sizes of the members read into memory (the in-memory runner: this process)
    real = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile",
                        lambda self, member: extracted.append(member.size) or real(self, member))
    root = tmp_path / "in"
    root.mkdir()
    big = image_bytes(64, 64, "PNG", seed=3) + b"\0" * 1_300_000
    members = []
    for k in range(6):
        image = big if k in (1, 4) else image_bytes(30 + k, 30, "PNG", seed=k)
        members += [(f"s{k:03d}.png", image), (f"s{k:03d}.txt", f"caption {k}".encode())]
    _tar(root / "shard-0.tar", members)
    # a member claiming 16 GiB: never read into memory; the shard is cut after it
    _tar(root / "shard-1.tar", [("t000.png", image_bytes(20, 20, "PNG", seed=8)), ("t000.txt", b"kept")],
         claim=("t001.png", 16 * 2**30))
    output = tmp_path / "out"
    manifest = shard.run(["--input", str(root / "shard-0.tar"), str(root / "shard-1.tar"), "--output", str(output),
                          "--num-lanes", "1", "--max-image-mb", "1", "--max-reject-fraction", "0.9",
                          *IN_MEMORY_RUNNER])
    rejected = _rejected(output)
    reasons = sorted(r["reason"] for r in rejected)
    assert manifest.documents == 4 + 1, reasons  # s0, s2, s3, s5 and t000: the tar goes on past s1 and s4
    assert reasons.count("image_too_large") == 2 and "unreadable_file" in reasons, reasons
    assert extracted and max(extracted) <= 2**20  # neither the 1.3 MB members nor the 16 GiB one was read
