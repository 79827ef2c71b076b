"""Checkpoint migrations: a state of an older format version, read as the current one.

Every format change bumps :data:`loader.checkpoint.version.STATE_VERSION` and adds one step
here; :func:`upgrade` applies them in order, so a checkpoint saved by any released Zephon
loads (``ZephonLoader.load_state_dict``, ``merge_rank_states``, ``state.loads``) and continues
the identical stream. Versions:

1. The first format (tests/golden/landed_checkpoint.json holds states of it).
2. Best-fit bins may say where each piece came from: ``piece_origins``, per piece the stream
   cursor ``[epoch, block, offset]`` of its first token (``loader.stages.packing.BestFitPacker``).
   A version-1 state becomes version 2 as it is: its bins keep no origins, which version 2
   reads as "unknown" (``zephon audit`` then replays instead of resolving the bins); the bins'
   tokens are unchanged, so the stream is too.
3. A text lane's cursor may say which document it is in: ``document``, ``{index, token_start,
   char_start}`` (``loader.io.blocks.TextBlock.document_at``), so that a restore tokenizes the row group from
   that document on instead of from its start (``loader.io.blocks.TextBlock.skip_to``). A
   version-2 state becomes version 3 as it is: a cursor without ``document`` is restored as
   before, tokenizing its block up to the offset; nothing else changed.
"""

from __future__ import annotations

from typing import Any, Callable

from loader.checkpoint.version import STATE_VERSION


def _v1_to_v2(state: dict) -> dict:
    return dict(state, version=2)  # lanes shared: a v1 bin is a v2 bin without piece_origins


def _v2_to_v3(state: dict) -> dict:
    return dict(state, version=3)  # lanes shared: a v2 cursor is a v3 cursor without document


# version -> the step that makes a state of that version the next one
MIGRATIONS: dict[int, Callable[[dict], dict]] = {1: _v1_to_v2, 2: _v2_to_v3}


def upgrade(state: Any) -> Any:
    """``state`` as a current-version state (itself if it is one; a new top-level dict if not).

    Anything that is not a state of a known older version is returned unchanged, for the
    schema to refuse with its own message (``loader.checkpoint.schema.check_format``)."""
    while isinstance(state, dict) and type(state.get("version")) is int and state["version"] in MIGRATIONS \
            and state["version"] < STATE_VERSION:
        state = MIGRATIONS[state["version"]](state)
    return state
