"""Token-unit mixing: documents of several sources packed into the same sequences.

``MixedTokenStream`` looks like a single :class:`~loader.lane_reader.LaneTokenStream` to the
packers, but chooses the source of every *document* by a deterministic deficit rule:

    next document's source = argmax_s ( w_s * (T + 1) - t_s )     (ties: lowest source id)

over the sources still in the mix (not exhausted, weight > 0), with ``w_s`` their weights
renormalised over them, and, inside the current *window*, ``t_s`` the tokens of source ``s``
and ``T`` the sum of ``t_s`` over the sources in the mix. (The ``+ 1`` only breaks the tie
of an empty window towards the heaviest source.) A window is one lane over one schedule
phase: the counters restart with the lane's first sequence of a new phase; a document
already begun runs on and counts in the new window.

Guarantee, at every document boundary of a window, with ``d_max`` the longest document
(tokens, BOS/EOS included) drawn in it and ``n`` sources in the mix:

    t_s - w_s * T <= d_max               no source runs ahead by more than one document
    w_s * T - t_s <= (n - 1) * d_max     so two sources stay within one document both ways

(the chosen source always has the largest deficit, which is > -1 before its document; the
deficits sum to zero). With three or more sources a source can fall behind by a little more
than one document when several lighter sources each ran ahead by most of one (see
tests/mixing/test_mix_token_deficit.py). When a source stops, its tokens leave ``T``: the
others are held to their renormalised shares of their own tokens, and the deviation they
carried (bounded as above) does not grow. When all sources are exhausted the stream ends.

The guarantee is about the documents in the order the mixer draws them, which is the order
of the lane's output for concat packing; best-fit packing reorders documents within its open
bins (at most ``best_fit_open_bins x seq_len`` tokens).

State keys: ``sources`` (each source's stream state), ``tokens`` (``t_s`` per source),
``current`` (source of the document being read, or -1), ``phase_start`` (window start step).
"""

from __future__ import annotations

import math
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
        # Derived from ``self.weights`` (reset when it changes): which weights are > 0, and
        # (sources in the mix) -> their weights renormalised over them, as integer numerators
        # over one common denominator.
        self._positive: tuple[bool, ...] = ()
        self._scaled: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}
        self._alive: Optional[tuple[int, ...]] = None  # sources in the mix; None: recompute

    def set_phase(self, phase_start: int, weights: tuple[Fraction, ...]) -> None:
        """Called by the lane before each sequence with the phase of its global index."""
        if phase_start != self.phase_start:
            self.phase_start = phase_start
            self.tokens = [0] * len(self.streams)
        if weights is not self.weights and weights != self.weights:
            self._positive = tuple(w > 0 for w in weights)
            self._scaled = {}
            self._alive = None
        self.weights = weights

    @property
    def exhausted(self) -> bool:
        return all(s.exhausted for s in self.streams)

    def _scaled_weights(self, alive: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        scaled = self._scaled.get(alive)
        if scaled is None:
            norm = sum(self.weights[s] for s in alive)
            shares = [self.weights[s] / norm for s in alive]
            denominator = math.lcm(*(f.denominator for f in shares))
            scaled = tuple(f.numerator * (denominator // f.denominator) for f in shares), denominator
            self._scaled[alive] = scaled
        return scaled

    def _choose_source(self) -> int:
        alive = self._alive
        if alive is None:  # streams only become exhausted in ``take`` or ``set_state``
            alive = tuple(s for s, stream in enumerate(self.streams) if self._positive[s] and not stream.exhausted)
            if not alive:  # only weight-0 sources left: they go on, in source order
                alive = tuple(s for s, stream in enumerate(self.streams) if not stream.exhausted)[:1]
                if not alive:
                    return -1
            self._alive = alive
        if len(alive) == 1:
            return alive[0]
        # argmax_s w_s * (T + 1) - t_s over the sources in the mix, ties to the lowest id, with
        # w_s = numerator_s / denominator: exact integer arithmetic, so every process agrees.
        # T counts the sources still in the mix only: a stopped source's tokens are not a
        # debt of the others (else their split stays off by ~t_stopped * (w_s - 1/n) tokens).
        numerators, denominator = self._scaled_weights(alive)
        tokens = self.tokens
        total = sum(tokens[s] for s in alive) + 1
        best, best_key = -1, None
        for s, numerator in zip(alive, numerators):
            key = numerator * total - tokens[s] * denominator
            if best_key is None or key > best_key:
                best, best_key = s, key
        return best

    def take(self, n: int, *, within_document: bool = False) -> Optional[Chunk]:
        """Up to ``n`` tokens, document by document from the chosen sources; None at the end."""
        tokens: list[np.ndarray] = []
        doc_starts: list[np.ndarray] = []
        sources: list[int] = []
        taken = 0
        while taken < n:
            if self.current < 0:
                self.current = self._choose_source()
                if self.current < 0:
                    break
            source = self.current
            stream = self.streams[source]
            want = n - taken
            chunk = stream.take(want, within_document=True)
            if chunk is None:  # this source stopped mid-choice: choose again
                self.current = -1
                self._alive = None
                continue
            count = len(chunk.tokens)
            self.tokens[source] += count
            # A stream returns fewer tokens than asked only at a document end (or when it is
            # exhausted); a full chunk may or may not end one.
            if count < want or stream.at_document_start():
                self.current = -1
            if stream.exhausted:
                self._alive = None
            tokens.append(chunk.tokens)
            doc_starts.append(chunk.doc_starts)
            sources.append(source)
            taken += count
            if within_document:
                break
        if not tokens:
            return None
        if len(tokens) == 1:
            return Chunk(tokens=tokens[0], doc_starts=doc_starts[0],
                         token_sources=np.full(taken, sources[0], dtype=np.int8))
        lengths = [len(t) for t in tokens]
        offsets = np.cumsum(lengths) - lengths  # where each piece starts in the chunk
        return Chunk(
            tokens=np.concatenate(tokens),
            doc_starts=np.concatenate(doc_starts) + np.repeat(offsets, [len(d) for d in doc_starts]),
            token_sources=np.repeat(np.array(sources, dtype=np.int8), lengths),
        )

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
        self._alive = None
        self.tokens = [int(t) for t in state["tokens"]]
        self.current = int(state["current"])
        self.phase_start = int(state["phase_start"])
