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
