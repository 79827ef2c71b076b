"""Fast checks of the peer-comparison harness plumbing (no peer loader needed)."""

from __future__ import annotations

import numpy as np
import pytest

from bench import compare
from bench.peers.common import ConcatPacker, PackedBatches, Spec, batch_fingerprint, multiset_fingerprint
from bench.peers.zephon import merge_ranks


def _docs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 100, size=int(rng.integers(1, 40))) for _ in range(n)]


def test_concat_packer_keeps_every_token_in_order():
    docs = _docs(50)
    p = ConcatPacker(seq_len=16, eos=0)
    rows = [r for d in docs for r in p.feed(d)]
    stream = np.concatenate([np.append(d, 0) for d in docs])
    emitted = np.concatenate(rows)
    assert all(len(r) == 16 for r in rows)
    assert np.array_equal(emitted, stream[: len(emitted)])
    assert np.array_equal(np.asarray(p.state_dict()["carry"]), stream[len(emitted):])


class _ListDocs:
    """A resumable document source: a cursor into a list (stands in for a peer)."""

    def __init__(self, docs):
        self.docs, self.pos = docs, 0

    def make(self):
        while True:
            d = self.docs[self.pos % len(self.docs)]
            self.pos += 1
            yield d

    def state(self):
        return {"pos": self.pos}

    def load(self, s):
        self.pos = s["pos"]


@pytest.mark.parametrize("cut", [0, 1, 7, 30])
def test_packed_batches_resume_is_exact(cut):
    docs = _docs(40, seed=1)
    src = _ListDocs(docs)
    base = PackedBatches(src.make, 8, 3, 0, src.state, src.load)
    expected = [next(base) for _ in range(cut + 10)]

    src1 = _ListDocs(docs)
    first = PackedBatches(src1.make, 8, 3, 0, src1.state, src1.load)
    for _ in range(cut):
        next(first)
    state = first.state_dict()
    src2 = _ListDocs(docs)
    resumed = PackedBatches(src2.make, 8, 3, 0, src2.state, src2.load)
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(10)]
    assert [batch_fingerprint(b) for b in got] == [batch_fingerprint(b) for b in expected[cut:]]


def test_zephon_merge_interleaves_ranks_by_global_index():
    glob = np.arange(8 * 4).reshape(8, 4)
    parts = [glob[r::2] for r in range(2)]
    assert np.array_equal(merge_ranks(parts), glob)


def test_multiset_fingerprint_ignores_row_order_only():
    b = np.arange(12).reshape(3, 4)
    assert multiset_fingerprint(b) == multiset_fingerprint(b[::-1])
    assert batch_fingerprint(b) != batch_fingerprint(b[::-1])


def test_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="mode"):
        Spec(loader="x", mode="nope", data_dir="/tmp", seq_len=8, global_batch=4)
    with pytest.raises(ValueError, match="divisible"):
        Spec(loader="x", mode="pretok", data_dir="/tmp", seq_len=8, global_batch=3, world_size=2)


def test_write_section_replaces_only_its_section(tmp_path):
    out = tmp_path / "RESULTS.md"
    out.write_text("# Results\n\n## Other\nkeep me\n\n" + compare.SECTION + "\nold\n\n## Later\nkeep too\n")
    compare.write_section(str(out), compare.SECTION + "\n\nnew table\n")
    text = out.read_text()
    assert "old" not in text and "new table" in text
    assert "keep me" in text and "## Later\nkeep too" in text
    compare.write_section(str(tmp_path / "fresh.md"), compare.SECTION + "\nx\n")
    assert compare.SECTION in (tmp_path / "fresh.md").read_text()


def test_runner_reports_errors_of_a_failing_task(tmp_path):
    import sys

    r = compare.Runner(sys.executable, str(tmp_path / "log"))
    res = r.run("throughput", {"spec": {"loader": "no-such-loader", "mode": "pretok", "data_dir": str(tmp_path),
                                        "seq_len": 8, "global_batch": 2}, "seconds": 0.1}, timeout=60)
    assert "error" in res and "no-such-loader" in res["error"]
