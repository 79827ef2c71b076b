"""The token stream protocol: what a packer reads documents' tokens from.

A lane's per-source stream (:class:`loader.io.lane_reader.LaneTokenStream`, and the audit's
:class:`loader.io.provenance.ProvenanceStream`) and token mixing's stream over several of them
(:class:`loader.stages.token_mixing.MixedTokenStream`) implement it; the packers
(:mod:`loader.stages.packing`, :mod:`loader.stages.window_packing`) and the mixing stream call
its members directly, with no probing, so a stream of the tests declares them too
(``feature_names = ()``, ``last_origin = None``: no features, origins not tracked).
``tests/loader/stages/test_stream_protocol.py`` holds every stream class of the loader to it.

The stream's own state is a stage state (:class:`loader.checkpoint.records.Stateful`): a
lane stream's is its cursor (record ``cursor``), a mixed stream's one cursor per source
(record ``mixed_stream``).
"""

from __future__ import annotations

from typing import Optional, Protocol

from loader.io.blocks import Block, Chunk

# (epoch, block, offset): where a token lies in a lane stream.
Origin = tuple[int, int, int]


class TokenStream(Protocol):
    """Documents' tokens in stream order, taken in chunks, with a JSON state."""

    # The per-token features of its chunks (registry order: loader.stages.features); fixed when
    # the stream is built.
    feature_names: tuple[str, ...]
    # Where the first token of the last ``take`` lies (a best-fit bin saves it per piece:
    # ``piece_origins``), or None where the stream does not track origins. Under token mixing
    # it lies in the stream of the source of that token.
    last_origin: Optional[Origin]
    # True once every token was taken (and ``take`` returns None).
    exhausted: bool

    def take(self, n: int, *, within_document: bool = False) -> Optional[Chunk]:
        """Up to ``n`` tokens (fewer only at the end of the stream, or of the current document
        with ``within_document``); None when exhausted."""

    def take_rows(self, row_len: int, max_rows: int) -> Optional[Chunk]:
        """Up to ``max_rows`` whole rows of ``row_len`` tokens that :meth:`rewound_state` can
        undo, or None (the caller then falls back to :meth:`take`)."""

    def rewound_state(self, rows: int, row_len: int) -> dict:
        """The state before the last ``rows`` rows of the last :meth:`take_rows`."""

    def get_state(self) -> dict:
        """The stream's position as JSON values (its record's keys)."""

    def set_state(self, state: dict, path: str = "stream") -> None:
        """Continue from ``state`` (checked by the checkpoint schema); ``path`` names it in errors."""

    def block_at(self, epoch: int, block_index: int) -> Optional[Block]:
        """The block an origin names, as the stream decodes it, without moving the stream; None
        when there is no such block. What a restored bin's pieces holding a feature bound to
        the data (``image_ref``) are checked against."""
