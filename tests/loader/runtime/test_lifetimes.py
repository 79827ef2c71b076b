"""Owned lifetimes: every thread a loader starts is joined by its close(), its I/O counters are
its own, and the process-wide caches stay bounded.

* Two loaders in one process (a train and an eval loader) each report their own reads.
* After ``close()`` no thread of the loader is alive (``threading.enumerate``), also after an
  error raised mid-iteration that leaves a ``with`` block.
* :class:`~loader.caches.BoundedCache` (transform chains, verified local files, chat encoders)
  never holds more than its bound.
"""

from __future__ import annotations

import hashlib
import threading

import pytest

from loader.caches import BoundedCache
from loader.io.lane_reader import LaneTokenStream
from loader.io.owner import StreamOwner
from loader.pipeline import ZephonLoader
from loader.transforms import chain as chain_module
from loader.transforms.spec import TransformSpec


def _zephon_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("zephon")}


def _take(loader: ZephonLoader, count: int) -> list[str]:
    return [hashlib.sha256(next(loader)["input_ids"].tobytes()).hexdigest() for _ in range(count)]


def test_two_loaders_in_one_process_report_their_own_reads(make_config):
    train = ZephonLoader(make_config("concat", pretokenized=True), rank=0, world_size=1, output="numpy")
    evaluation = ZephonLoader(make_config("concat", pretokenized=True), rank=0, world_size=1, output="numpy")
    with train, evaluation:
        _take(train, 3)
        train.wait_for_read_ahead()
        read_by_train = train.metrics().total.row_groups_read
        assert read_by_train > 0
        assert evaluation.metrics().total.row_groups_read == 0  # nothing read by it yet
        _take(evaluation, 1)
        evaluation.wait_for_read_ahead()
        assert 0 < evaluation.metrics().total.row_groups_read < read_by_train
        assert train.metrics().total.row_groups_read == read_by_train  # not the eval loader's reads
        assert evaluation.metrics().total.bytes_read < train.metrics().total.bytes_read


def test_close_joins_every_thread_of_the_loader(make_config):
    before = _zephon_threads()
    loader = ZephonLoader(make_config("best_fit", read_ahead=True, read_ahead_threads=3), rank=0, world_size=1,
                          output="numpy")
    first = _take(loader, 4)
    assert loader.owner.threads(), "the read-ahead ran on no thread of the loader: the check below is vacuous"
    loader.close()
    assert loader.owner.threads() == []
    assert _zephon_threads() - before == set()
    # A second loader of the same config: new threads, the same stream; joined on leaving the block.
    with ZephonLoader(make_config("best_fit", read_ahead=True, read_ahead_threads=3), rank=0, world_size=1,
                      output="numpy") as again:
        assert _take(again, 4) == first
    assert _zephon_threads() - before == set()


def test_an_error_mid_iteration_leaves_no_thread_behind(make_config, monkeypatch):
    before = _zephon_threads()
    read_block = LaneTokenStream._read_block
    reads = [0]

    def failing(self, *args, **kwargs):
        reads[0] += 1
        if reads[0] > 6:
            raise OSError("disk gone")
        return read_block(self, *args, **kwargs)

    monkeypatch.setattr(LaneTokenStream, "_read_block", failing)
    with pytest.raises(Exception, match="disk gone"):
        with ZephonLoader(make_config("concat", pretokenized=True, read_ahead=True), rank=0, world_size=1,
                          output="numpy") as loader:
            while True:
                next(loader)
    assert loader.owner.threads() == []
    assert _zephon_threads() - before == set()


def test_a_closed_owner_joins_its_helpers_and_prepare_thread():
    owner = StreamOwner("test-owner")
    done = threading.Event()
    owner.helper("chat-tokenize").submit(lambda: None).result()
    owner.read_ahead_pool(2).submit(lambda: None).result()
    owner.prepare_later(lambda item: done.set(), owner, (0, 0))
    assert done.wait(10)
    names = sorted(t.name for t in owner.threads())
    assert f"{owner.name}-prepare" in names and any("chat-tokenize" in n for n in names)
    owner.close()
    assert owner.threads() == []


def test_a_bounded_cache_forgets_the_least_recently_used():
    cache: BoundedCache[int] = BoundedCache(3)
    for key in range(10):
        cache.put(key, key)
        cache.get(0) if 0 in cache else None  # 0 kept in use: never the one forgotten
        assert len(cache) <= 3
    assert 0 in cache and 9 in cache and 5 not in cache
    assert cache.get_or_make(5, lambda: 55) == 55
    with pytest.raises(ValueError, match="max_entries=0"):
        BoundedCache(0)


def test_transform_chains_stay_bounded():
    spec = TransformSpec(function="length_chars", args={"min": 1}).resolved(pretokenized=False)
    for seed in range(chain_module._chains.max_entries + 20):
        chain_module.chain_for([spec], seed=seed, source="web", pretokenized=False)
    assert len(chain_module._chains) == chain_module._chains.max_entries
