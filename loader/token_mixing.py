"""Token-unit mixing: documents of several sources packed into the same sequences.

``MixedTokenStream`` looks like a single :class:`~loader.lane_reader.LaneTokenStream` to the
packers, but chooses the source of every *document* by a deterministic deficit rule:

    next document's source = argmax_s ( w_s * T - t_s )     (ties: lowest source id)

where, inside the current *window*, ``T`` is the lane's tokens so far and ``t_s`` those of
source ``s``. A window is one lane over one schedule phase: counters restart when the
weights change. Because whole documents are drawn by largest deficit, every source's token
count stays within one document of ``w_s * T`` at every document boundary of the window
(README "Mixing", token unit). Sources that have stopped drop out and the remaining weights
renormalise.

State keys: ``sources`` (each source's stream state), ``tokens`` (``t_s`` per source),
``current`` (source of the document being read, or -1), ``phase_start`` (window start step).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Optional, Sequence

import numpy as np

from loader.lane_reader import Chunk, LaneTokenStream


class MixedTokenStream:
    def __init__(self, streams: Sequence[LaneTokenStream]) -> None:
        self.streams = list(streams)
        self.tokens = [0] * len(self.streams)
        self.current = -1
        self.phase_start = 0
        self.weights: tuple[Fraction, ...] = ()

    def set_phase(self, phase_start: int, weights: tuple[Fraction, ...]) -> None:
        """Called by the lane before each sequence with the phase of its global index."""
        if phase_start != self.phase_start:
            self.phase_start = phase_start
            self.tokens = [0] * len(self.streams)
        self.weights = weights

    @property
    def exhausted(self) -> bool:
        return all(s.exhausted for s in self.streams)

    def _choose_source(self) -> int:
        total = sum(self.tokens)
        alive = [s for s, stream in enumerate(self.streams) if not stream.exhausted and self.weights[s] > 0]
        if not alive:
            alive = [s for s, stream in enumerate(self.streams) if not stream.exhausted]
            if not alive:
                return -1
            return alive[0]
        norm = sum(self.weights[s] for s in alive)
        # Deficit in exact arithmetic so that every process picks the same source.
        return max(alive, key=lambda s: (self.weights[s] / norm * (total + 1) - self.tokens[s], -s))

    def take(self, n: int, *, within_document: bool = False) -> Optional[Chunk]:
        pieces: list[Chunk] = []
        taken = 0
        while taken < n:
            if self.current < 0:
                self.current = self._choose_source()
                if self.current < 0:
                    break
            source = self.current
            chunk = self.streams[source].take(n - taken, within_document=True)
            if chunk is None:  # this source stopped mid-choice: choose again
                self.current = -1
                continue
            self.tokens[source] += len(chunk.tokens)
            if self._document_finished(source, chunk):
                self.current = -1
            pieces.append(Chunk(
                tokens=chunk.tokens, doc_starts=chunk.doc_starts + taken,
                token_sources=np.full(len(chunk.tokens), source, dtype=np.int8),
            ))
            taken += len(chunk.tokens)
            if within_document:
                break
        if not pieces:
            return None
        if len(pieces) == 1:
            return pieces[0]
        return Chunk(
            tokens=np.concatenate([p.tokens for p in pieces]),
            doc_starts=np.concatenate([p.doc_starts for p in pieces]),
            token_sources=np.concatenate([p.token_sources for p in pieces]),
        )

    def _document_finished(self, source: int, chunk: Chunk) -> bool:
        """True when the stream's cursor now sits at a document start (or the stream ended)."""
        return self.streams[source].at_document_start()

    def get_state(self) -> dict:
        return {
            "sources": [s.get_state() for s in self.streams],
            "tokens": list(self.tokens),
            "current": self.current,
            "phase_start": self.phase_start,
        }

    def set_state(self, state: dict) -> None:
        for stream, saved in zip(self.streams, state["sources"]):
            stream.set_state(saved)
        self.tokens = [int(t) for t in state["tokens"]]
        self.current = int(state["current"])
        self.phase_start = int(state["phase_start"])
