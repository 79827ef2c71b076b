"""Blocks prepared on the prepare thread: the same tokens, and the claim hands a block over.

An online chat block read ahead is encoded on the prepare thread (``Block.prepare``) unless
the stream claims it first (``Block.claim``), and then encodes it itself. Either way the block
must hold what the stream alone would make; a claim waits for the encoding in progress and no
encoding starts after it; the prepare thread works on the blocks wanted soonest first, skips
those nobody holds any more, and survives a failing prepare. Text blocks are not prepared.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np

import pytest

from loader.io.blocks import Block, TextBlock, TokenFormat
from loader.io.owner import StreamOwner

FORMAT = TokenFormat(bos_id=1, eos_id=2)


def _texts(count: int = 400) -> list[str]:
    rng = np.random.default_rng(7)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta", "θeta", "iota", "kappa"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 400)))) for _ in range(count)]


def _chat_block():
    import json

    from loader.chat.block import OnlineChat
    from loader.chat.template import ChatTemplate
    from tests.chat.chat_factory import make_records, template_text, tokenizer as chat_tokenizer

    template = ChatTemplate.from_string(template_text("chatml_generation.jinja"))
    chat = OnlineChat(template, chat_tokenizer(), "all", 1024, "reject", "chat")
    records = [json.dumps(record) for record in make_records(3, 40)]
    return chat.block(records, FORMAT, "lane-00000.parquet", 0)


def test_text_blocks_have_nothing_to_prepare(tokenizer):
    assert TextBlock.prepare is Block.prepare  # so the lane reader never queues them
    block = TextBlock(_texts(20), tokenizer, FORMAT)
    block.prepare()
    assert not block.complete and len(block.tokens) == 0


def test_a_claim_waits_for_the_encoding_in_progress_and_none_follows(monkeypatch):
    import loader.chat.block as chat_block

    calls, entered, release = [], threading.Event(), threading.Event()
    real = chat_block.encode_conversations

    def gated(*args, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            entered.set()
            assert release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(chat_block, "encode_conversations", gated)
    block = _chat_block()
    worker = threading.Thread(target=block.prepare, name="prepare-test")
    worker.start()
    assert entered.wait(10)
    claimed = threading.Event()
    claimer = threading.Thread(target=lambda: (block.claim(), claimed.set()))
    claimer.start()
    time.sleep(0.05)
    assert not claimed.is_set(), "the claim must wait for the encoding in progress"
    release.set()
    claimer.join(10)
    worker.join(10)
    assert claimed.is_set() and block.complete and calls == ["prepare-test"]
    block.ensure(0)
    block.prepare()
    assert calls == ["prepare-test"]  # nothing encodes it again

    late = _chat_block()
    late.claim()
    late.prepare()  # a prepare after the claim does nothing: the stream encodes it
    assert not late.complete and calls == ["prepare-test"]
    late.ensure(0)
    assert late.complete and calls[-1] == threading.current_thread().name
    assert np.array_equal(late.tokens, block.tokens)


def test_a_prepared_chat_block_equals_one_encoded_by_the_stream():
    first, second = _chat_block(), _chat_block()
    worker = threading.Thread(target=first.prepare)
    worker.start()
    worker.join(30)
    first.claim()
    second.ensure(0)
    assert first.complete and second.complete
    assert np.array_equal(first.tokens, second.tokens) and np.array_equal(first.doc_starts, second.doc_starts)
    assert np.array_equal(first.features["loss_mask"], second.features["loss_mask"])
    assert first.reject_counts == second.reject_counts


@pytest.fixture
def owner():
    owner = StreamOwner("test-prepare")
    yield owner
    owner.close()


def test_prepares_run_soonest_wanted_first_and_skip_what_is_gone(owner):
    done: list[str] = []
    gate = threading.Event()

    class Item:
        def __init__(self, name: str) -> None:
            self.name = name

    def hold(item):
        assert gate.wait(10)

    blocker = Item("blocker")
    owner.prepare_later(hold, blocker, (-1, 0))  # keeps the thread busy while the others queue
    items = {name: Item(name) for name in ("e2", "e1b1", "e1b0", "gone")}
    owner.prepare_later(lambda item: done.append(item.name), items["e2"], (2, 0))
    owner.prepare_later(lambda item: done.append(item.name), items["e1b1"], (1, 1))
    owner.prepare_later(lambda item: done.append(item.name), items["gone"], (0, 5))
    owner.prepare_later(lambda item: done.append(item.name), items["e1b0"], (1, 0))
    del items["gone"]
    gc.collect()
    gate.set()
    marker = Item("marker")
    finished = threading.Event()
    owner.prepare_later(lambda item: finished.set(), marker, (9, 9))
    assert finished.wait(10)
    assert done == ["e1b0", "e1b1", "e2"]


def test_a_failing_prepare_does_not_stop_the_thread(owner):
    class Item:
        pass

    def boom(item):
        raise RuntimeError("bad row group")

    finished = threading.Event()
    first, second = Item(), Item()
    owner.prepare_later(boom, first, (0, 0))
    owner.prepare_later(lambda item: finished.set(), second, (0, 1))
    assert finished.wait(10)
    assert [t.name for t in owner.threads()] == [f"{owner.name}-prepare"]
