"""A text lane's cursor says which document it is in, so a restore tokenizes from there (state version 3).

* A saved state's text cursors inside a block carry ``document`` ``{index, token_start,
  char_start}``;
  restoring tokenizes each such block from that document on, never from its first document,
  and the batches after the restore are the uninterrupted run's, in-process and with worker
  processes, on the same and on another world size.
* A version-2 state (no ``document``) restores as before (its blocks tokenized from the
  start) to the same batches.
* A ``document`` that does not match the data is refused with a StateError naming its path:
  another document's index or start, a start past the cursor, an index past the block's
  documents, document 0 elsewhere than at token 0, missing keys, wrong types.
"""

from __future__ import annotations

import copy

import pytest

from loader.checkpoint.state import StateError, dumps, loads
from loader.commands.fingerprints import collect_fingerprints
from loader.io.blocks import TextBlock, cursor_document
from loader.pipeline import ZephonLoader
from tests.loader.settings import GLOBAL_BATCH, MICRO_BATCH

SAVE_STEP = 7
END_STEP = 12


def cursors(state: dict) -> list[dict]:
    """Every stream cursor of a single-source concat or best-fit state."""
    return [lane["sources"]["synthetic"]["packer"]["stream"] for lane in state["lanes"].values()]


@pytest.fixture(scope="module")
def saved(make_config) -> dict:
    """``{packing: merged state at SAVE_STEP}`` of an uninterrupted W=2 run."""
    out = {}
    for packing in ("concat", "best_fit"):
        _, state = collect_fingerprints(make_config(packing), world_size=2, end_step=SAVE_STEP + 1,
                                        save_state_step=SAVE_STEP)
        out[packing] = loads(dumps(state))
    return out


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_text_cursors_say_their_document(saved, packing):
    inside = [c for c in cursors(saved[packing]) if c["offset"] > 0 and not c["exhausted"]]
    assert inside, "no cursor inside a block: the test would prove nothing"
    assert all("document" in c for c in inside)
    assert any(c["document"]["index"] > 0 for c in inside)  # past the first document: something to skip
    assert all(0 < c["document"]["token_start"] <= c["offset"] for c in inside if c["document"]["index"] > 0)


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_a_restore_tokenizes_from_the_cursors_document(make_config, saved, packing, monkeypatch):
    state = saved[packing]
    skipped: dict[int, int] = {}  # id(block) -> document it was skipped to
    first_call: dict[int, int] = {}  # id(block) -> first document of its first tokenizer call
    skip_to, tokenize_more = TextBlock.skip_to, TextBlock._tokenize_more

    def spy_skip(block, document, start):
        skipped[id(block)] = document
        skip_to(block, document, start)

    def spy_tokenize(block):
        first_call.setdefault(id(block), block._next)
        tokenize_more(block)

    monkeypatch.setattr(TextBlock, "skip_to", spy_skip)
    monkeypatch.setattr(TextBlock, "_tokenize_more", spy_tokenize)
    with ZephonLoader(make_config(packing, read_ahead=False)) as loader:
        loader.load_state_dict(state)
        for _ in range(GLOBAL_BATCH // MICRO_BATCH):
            next(loader)
    wanted = sorted(c["document"]["index"] for c in cursors(state) if c.get("document", {}).get("index", 0) > 0)
    # Every restored lane whose cursor is past its block's first document skipped to it; a lane
    # whose first step took it into its next block skipped all the same (its restore comes first).
    assert sorted(skipped.values()) == wanted
    for block_id, document in skipped.items():
        assert first_call.get(block_id, document) == document  # never tokenized from document 0


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
@pytest.mark.parametrize("world_size,num_workers", [(1, 0), (2, 0), (1, 2), (4, 2)])
def test_resumes_from_documents_match_one_uninterrupted_run(make_config, baseline, saved, packing,
                                                            world_size, num_workers):
    expected = baseline(packing, END_STEP)[SAVE_STEP:]
    config = make_config(packing, num_workers=num_workers)
    results, _ = collect_fingerprints(config, world_size=world_size, start_step=SAVE_STEP, end_step=END_STEP,
                                      load_state=saved[packing])
    assert [r.line() for r in results] == expected


def as_version_2(state: dict) -> dict:
    old = copy.deepcopy(state)
    old["version"] = 2
    for cursor in cursors(old):
        cursor.pop("document", None)
    return old


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_a_version_2_state_restores_as_before_to_the_same_batches(make_config, baseline, saved, packing,
                                                                  monkeypatch):
    skips = []
    monkeypatch.setattr(TextBlock, "skip_to", lambda *args: skips.append(args))
    old = loads(dumps(as_version_2(saved[packing])))  # the migration: version 3, no document
    assert old["version"] == 3 and not any("document" in c for c in cursors(old))
    results, _ = collect_fingerprints(make_config(packing), world_size=2, start_step=SAVE_STEP,
                                      end_step=END_STEP, load_state=old)
    assert [r.line() for r in results] == baseline(packing, END_STEP)[SAVE_STEP:]
    assert not skips


def tampered(state: dict, change) -> tuple[dict, str]:
    """``state`` with the first cursor past its block's first document changed by ``change``."""
    state = copy.deepcopy(state)
    for lane_key, lane in state["lanes"].items():
        cursor = lane["sources"]["synthetic"]["packer"]["stream"]
        if cursor.get("document", {}).get("index", 0) > 0:
            change(cursor)
            return state, f"lanes.{lane_key}.sources.synthetic.packer.stream.document"
    raise AssertionError("no cursor past its first document")


def _next_index(cursor):
    cursor["document"]["index"] += 1  # starts kept: not where that document's text starts


def _previous_index(cursor):
    cursor["document"]["index"] -= 1


def _start_past_offset(cursor):
    cursor["document"]["token_start"] = cursor["offset"] + 1


def _index_past_documents(cursor):
    cursor["document"]["index"] = 10 ** 6


def _document_zero_elsewhere(cursor):
    cursor["document"]["index"] = 0


def _missing_key(cursor):
    del cursor["document"]["char_start"]


def _a_string(cursor):
    cursor["document"]["index"] = str(cursor["document"]["index"])


@pytest.mark.parametrize("change", [_next_index, _previous_index, _start_past_offset, _index_past_documents,
                                    _document_zero_elsewhere, _missing_key, _a_string])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_document_that_does_not_match_the_data_is_refused_by_path(make_config, saved, change, num_workers):
    state, path = tampered(saved["concat"], change)
    with ZephonLoader(make_config("concat", num_workers=num_workers)) as loader:
        with pytest.raises(StateError) as raised:
            loader.load_state_dict(state)
            for _ in range(GLOBAL_BATCH // MICRO_BATCH):
                next(loader)
    assert path in str(raised.value)


def test_cursor_document_names_the_first_of_empty_documents_and_the_next_at_a_boundary():
    import numpy as np

    starts = np.array([0, 5, 5, 5, 9, 12])  # documents 1 and 2 are empty; 12 = the block's end
    assert cursor_document(starts, 0) == (0, 0)
    assert cursor_document(starts, 4) == (0, 0)
    assert cursor_document(starts, 5) == (1, 5)  # at a boundary: the next document (the first at 5)
    assert cursor_document(starts, 8) == (1, 5)
    assert cursor_document(starts, 9) == (4, 9)
    assert cursor_document(starts, 12) == (5, 12)  # the end: past the last document
