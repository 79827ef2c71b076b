"""Seekable best fit: best-fit-decreasing inside windows of ``packing_window`` documents.

``packing = "best_fit"`` with ``packing_window = K``: the packer reads the next ``K``
documents of its stream (fewer where the stream ends), packs their pieces with
:func:`loader.order.packing_windows.best_fit_decreasing` and emits the window's bins one by
one; nothing carries over from one window to the next::

    stream   | d0 d1 ... d(K-1) | dK ... d(2K-1) | ...
    window        0 (n0 bins)        1 (n1 bins)
    outputs  b0,0 .. b0,n0-1       b1,0 .. b1,n1-1

So the state before any output is two positions, ``(window, emitted)``, plus the stream cursor
where the window starts: no bin, no token. A restore reads the window's documents again from
that cursor and skips ``emitted`` bins. Since ``n_w`` is a function of the window's document
lengths alone (:func:`~loader.order.packing_windows.window_outputs`), ``zephon audit`` places a
lane before any step by summing counts, without packing earlier windows
(:mod:`loader.commands.window_index`).

State keys (its record, ``best_fit_window``: :mod:`loader.stages.packer_records`): ``stream``
(the stream cursor at the window's first document) and ``window``
(``version``, ``index``: windows completed before it, ``emitted``: its bins handed out). At a
window boundary the state is the next window's start with ``emitted`` 0.

Memory: the window's documents (``K`` x the mean wrapped document length tokens, as views of
the blocks they lie in, per lane and source). Documents are never split except where longer
than ``seq_len``, as with unbounded best fit; padding is left at each window's end where its
last bins are partly filled (measured against unbounded best fit in
``docs/guides/packing-window-and-balance.md``).
"""

from __future__ import annotations

from typing import Optional

from loader.errors import StateError
from loader.order.packing_windows import best_fit_decreasing
from loader.stages.packer_records import EMITTED, INDEX, STREAM, WINDOW, window_packer_state
from loader.stages.packing import PackedSequence, _sequence_from_pieces


class WindowedBestFitPacker:
    """Best-fit-decreasing per window of ``window`` documents (see the module docstring)."""

    def __init__(self, stream, seq_len: int, pad_id: int, window: int, *, features: tuple[str, ...] = ()) -> None:
        if window < 1:
            raise ValueError(f"packing_window must be >= 1 (got {window})")
        self.stream = stream
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.window = window
        self.features = features
        self.index = 0  # windows completed
        self.emitted = 0  # bins of the current window handed out
        self._start: Optional[dict] = None  # stream state at the current window's start, once it began
        self._pieces: Optional[list] = None  # the current window's pieces (Chunks), once read
        self._bins: Optional[list[list[int]]] = None
        self._path = "packer"

    # -- output --------------------------------------------------------------------------
    def next_sequence(self) -> Optional[PackedSequence]:
        """The window's next bin; a new window once it is done; None when the stream has ended."""
        if self._bins is None:
            self._read_window()
        if not self._bins:  # no document left: the stream has ended
            return None
        members = self._bins[self.emitted]
        sequence = _sequence_from_pieces([self._pieces[k] for k in members], self.seq_len, self.pad_id,
                                         piece_segment_starts=True, features=self.features)
        self.emitted += 1
        if self.emitted == len(self._bins):  # the next window starts at the stream's cursor
            self.index += 1
            self.emitted = 0
            self._start = self._pieces = self._bins = None
        return sequence

    def _read_window(self) -> None:
        """Read the window's documents from the stream (at the window's start) and pack them."""
        stream, seq_len = self.stream, self.seq_len
        start = self._start if self._start is not None else stream.get_state()
        pieces = []
        documents = 0
        while documents < self.window:
            piece = stream.take(seq_len, within_document=True)
            if piece is None:
                break
            documents += 1
            while True:
                if len(piece.tokens):
                    pieces.append(piece)
                if stream.at_document_start():
                    break
                piece = stream.take(seq_len, within_document=True)
        self._start, self._pieces = start, pieces
        self._bins = best_fit_decreasing([len(p.tokens) for p in pieces], seq_len)
        if self.emitted > len(self._bins) or (self.emitted == len(self._bins) and self._bins):
            raise StateError(f"{self._path}.window.emitted: window {self.index} of this lane has "
                             f"{len(self._bins)} outputs, so a restore cannot have handed out {self.emitted} of "
                             "them: the checkpoint is not of this dataset or packing_window (or was edited)")

    # -- state ---------------------------------------------------------------------------
    def get_state(self) -> dict:
        stream_state = self._start if self._start is not None else self.stream.get_state()
        return window_packer_state(stream_state, self.index, self.emitted)

    def snapshot(self) -> dict:
        """The state as of now (:meth:`get_state`: cursors and two counters, cheap to build)."""
        return self.get_state()

    def set_state(self, state: dict, path: str = "packer") -> None:
        """``state`` as checked by ``loader.checkpoint.schema``; the window is read again
        on the next output (and ``emitted`` checked against its bins then)."""
        window = state[WINDOW]
        self.stream.set_state(state[STREAM], path=f"{path}.{STREAM}")
        self.index, self.emitted = int(window[INDEX]), int(window[EMITTED])
        self._start = state[STREAM] if self.emitted else None
        self._pieces = self._bins = None
        self._path = path
