"""Checkpoint migrations: a state of an older format version, read as the current one.

Every format change bumps :data:`loader.checkpoint.state.STATE_VERSION` and adds one step
here; :func:`upgrade` applies them in order, so a checkpoint saved by any released Zephon
loads (``ZephonLoader.load_state_dict``, ``merge_rank_states``, ``state.loads``) and continues
the identical stream. Versions:

1. The first format (tests/golden/landed_checkpoint.json holds states of it).
2. Best-fit bins may say where each piece came from: ``piece_origins``, per piece the stream
   cursor ``[epoch, block, offset]`` of its first token (``loader.stages.packing.BestFitPacker``).
   A version-1 state becomes version 2 as it is: its bins keep no origins, which version 2
   reads as "unknown" (``zephon audit`` then replays instead of resolving the bins); the bins'
   tokens are unchanged, so the stream is too.
"""

from __future__ import annotations

from typing import Any, Callable

from loader.checkpoint.state import STATE_VERSION


def _v1_to_v2(state: dict) -> dict:
    return dict(state, version=2)  # lanes shared: a v1 bin is a v2 bin without piece_origins


# version -> the step that makes a state of that version the next one
MIGRATIONS: dict[int, Callable[[dict], dict]] = {1: _v1_to_v2}


def upgrade(state: Any) -> Any:
    """``state`` as a current-version state (itself if it is one; a new top-level dict if not).

    Anything that is not a state of a known older version is returned unchanged, for the
    schema to refuse with its own message (``loader.checkpoint.schema.check_format``)."""
    while isinstance(state, dict) and type(state.get("version")) is int and state["version"] in MIGRATIONS \
            and state["version"] < STATE_VERSION:
        state = MIGRATIONS[state["version"]](state)
    return state
