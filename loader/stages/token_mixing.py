"""Token-unit mixing: documents of several sources packed into the same sequences.

``MixedTokenStream`` is a :class:`~loader.stages.stream.TokenStream`, as a single
:class:`~loader.io.lane_reader.LaneTokenStream` is, to the packers, but chooses the source of
every *document* by a deterministic deficit rule:

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

State keys (its record, ``mixed_stream``: :mod:`loader.stages.mixed_record`): ``sources`` (each source's stream state), ``tokens`` (``t_s`` per source),
``current`` (source of the document being read, or -1), ``phase_start`` (window start step).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np

from loader.errors import StateError
from loader.stages.features import FEATURES, in_order, lay_out
from loader.io.blocks import Block, Chunk
from loader.io.lane_reader import LaneTokenStream
from loader.stages.mixed_record import CURRENT, PHASE_START, SOURCES, TOKENS
from loader.stages.stream import Origin


class MixedTokenStream:
    """Several sources' streams as one :class:`~loader.stages.stream.TokenStream` (see the module)."""

    # As LaneTokenStream.last_origin, in the stream of the source of the last take's first
    # document (the chunk's token_sources): meaningful after take(within_document=True).
    last_origin: Optional[Origin] = None

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
        self.rows_left: Optional[int] = None  # outputs of the lane left in this phase (None: no end)
        self._bulk: Optional[_BulkRows] = None  # the last take_rows, for rewound_state
        # Where take_rows last found no whole row: it cannot find one again before a block
        # or the window changes (consuming documents only shortens what is certain).
        self._no_rows_at: Optional[tuple] = None
        self._restored_path: Optional[str] = None  # a restored state whose documents are not checked yet
        # Per-token features of the mixed chunks: each token's source, and every feature of
        # any source (documents of a source without it get its default).
        own = [name for stream in self.streams for name in stream.feature_names]
        self.feature_names = in_order(["token_sources", *own])
        self._carried = self.feature_names[1:]  # the sources' own features
        self._features_of = [frozenset(stream.feature_names) for stream in self.streams]

    def set_phase(self, phase_start: int, weights: tuple[Fraction, ...], rows_left: Optional[int] = None) -> None:
        """Called by the lane before each sequence with the phase of its global index.

        ``rows_left``: how many more outputs the lane makes in this phase, so that bulk rows
        (``take_rows``) never run past a window's end.
        """
        self.rows_left = rows_left
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

    def _alive_sources(self) -> tuple[int, ...]:
        alive = self._alive
        if alive is None:  # streams only become exhausted in ``take`` or ``set_state``
            alive = tuple(s for s, stream in enumerate(self.streams) if self._positive[s] and not stream.exhausted)
            if not alive:  # only weight-0 sources left: they go on, in source order
                alive = tuple(s for s, stream in enumerate(self.streams) if not stream.exhausted)[:1]
            self._alive = alive
        return alive

    def _choose_source(self) -> int:
        alive = self._alive_sources()
        if not alive:
            return -1
        if len(alive) == 1:
            return alive[0]
        # argmax_s w_s * (T + 1) - t_s over the sources in the mix, ties to the lowest id, with
        # w_s = numerator_s / denominator: exact integer arithmetic, so every process agrees.
        # T counts the sources still in the mix only: a stopped source's tokens are not a
        # debt of the others (else their split stays off by ~t_stopped * (w_s - 1/n) tokens).
        numerators, denominator = self._scaled_weights(alive)
        return _deficit_choice(alive, numerators, denominator, self.tokens)

    def take(self, n: int, *, within_document: bool = False) -> Optional[Chunk]:
        """Up to ``n`` tokens, document by document from the chosen sources; None at the end."""
        if self._restored_path is not None:
            self._check_restored_documents()
        tokens: list[np.ndarray] = []
        doc_starts: list[np.ndarray] = []
        sources: list[int] = []
        features: list = []
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
            if not tokens:
                self.last_origin = stream.last_origin
            tokens.append(chunk.tokens)
            doc_starts.append(chunk.doc_starts)
            sources.append(source)
            features.append(chunk.features)
            taken += count
            if within_document:
                break
        if not tokens:
            return None
        lengths = [len(t) for t in tokens]
        if len(tokens) == 1:
            token_sources = np.full(taken, sources[0], dtype=np.int8)
        else:
            token_sources = np.repeat(np.array(sources, dtype=np.int8), lengths)
        mixed = {"token_sources": token_sources}  # registry order: token_sources comes first
        if self._carried:
            mixed.update(lay_out(self._carried, features, lengths, taken))
        if len(tokens) == 1:
            return Chunk(tokens=tokens[0], doc_starts=doc_starts[0], features=mixed)
        offsets = np.cumsum(lengths) - lengths  # where each piece starts in the chunk
        return Chunk(
            tokens=np.concatenate(tokens),
            doc_starts=np.concatenate(doc_starts) + np.repeat(offsets, [len(d) for d in doc_starts]),
            features=mixed,
        )

    def take_rows(self, row_len: int, max_rows: int) -> Optional[Chunk]:
        """Up to ``max_rows`` rows of ``row_len`` tokens at once: what ``take(row_len)`` would
        give row after row, while every document involved lies inside its source's view (the
        current row group and, near its end, the next one: ``LaneTokenStream.documents_ahead``)
        and the rows stay inside the phase. None when not even one row qualifies (the caller
        then uses :meth:`take`).

        The deficit rule is the same; only its evaluation differs: the documents' lengths
        are known ahead within the blocks, so the decisions are made for many documents at
        once (two sources: a merge of two sorted key sequences, see :func:`_merge_two`).
        """
        if self._restored_path is not None:
            self._check_restored_documents()
        if self.rows_left is not None:
            max_rows = min(max_rows, self.rows_left)
        alive = self._alive_sources()
        if max_rows < 1 or not alive:
            return None
        where = (self.phase_start, alive, tuple((self.streams[s].epoch, self.streams[s].block_index) for s in alive))
        if where == self._no_rows_at:
            return None
        wanted = max_rows * row_len
        views = {}
        for s in alive:
            view = self.streams[s].documents_ahead(wanted)
            if view is None:
                return None
            views[s] = view
        plan = _plan_documents(self, alive, views, wanted)
        if plan is None:
            self._no_rows_at = where
            return None
        sources, starts, ends = plan  # documents (or the current one's rest) in stream order
        lengths = ends - starts
        out_ends = np.cumsum(lengths)  # where each piece ends in the output
        rows = min(max_rows, int(out_ends[-1]) // row_len)  # max_rows >= 1 here
        if rows < 1:  # the certain documents do not fill a row
            self._no_rows_at = where
            return None
        need = rows * row_len
        pieces = int(out_ends.searchsorted(need)) + 1  # up to the piece holding the last token taken
        cut = int(out_ends[pieces - 1]) - need  # tokens of the last piece left for later
        sources, starts = sources[:pieces], starts[:pieces]
        ends, lengths, out_ends = ends[:pieces].copy(), lengths[:pieces].copy(), out_ends[:pieces].copy()
        ends[-1] -= cut
        lengths[-1] -= cut
        out_ends[-1] = need
        out_starts = out_ends - lengths
        first_is_rest = self.current >= 0
        self._bulk = _BulkRows(
            state_before=self.get_state(), views=views, sources=sources, starts=starts, ends=ends,
            out_ends=out_ends, row_len=row_len, rows=rows,
        )
        split = _SourcePieces(sources, lengths, alive)
        # The pieces of one source are consecutive in its view, so its tokens in the output
        # are one stretch of the view: one masked copy per source, not one slice per piece;
        # and its cursor moves to the stretch's end.
        token_sources = np.repeat(sources.astype(np.int8), lengths)
        tokens = np.empty(need, dtype=np.int32)
        mixed = {"token_sources": token_sources}  # registry order: token_sources comes first
        for name in self._carried:
            mixed[name] = np.full(need, FEATURES[name].default, dtype=FEATURES[name].dtype)
        for k, s in enumerate(alive):
            first = split.first_piece[k]
            if first < 0:
                continue
            begin = int(starts[first])
            end = begin + split.totals[k]
            self.streams[s].move_to(views[s], end)
            self.tokens[s] += split.totals[k]
            stretch = views[s].slices(begin, end)
            mine = token_sources == s
            tokens[mine] = stretch[0] if len(stretch) == 1 else np.concatenate(stretch)
            for name in self._carried:
                if name in self._features_of[s]:
                    stretch = views[s].slices(begin, end, feature=name)
                    mixed[name][mine] = stretch[0] if len(stretch) == 1 else np.concatenate(stretch)
        self.current = int(sources[-1]) if cut else -1
        doc_starts = out_starts[1:] if first_is_rest else out_starts  # a rest continues an earlier document
        return Chunk(tokens=tokens, doc_starts=doc_starts, features=mixed,
                     row_majority=split.row_majority(out_starts, out_ends, rows, row_len))

    def rewound_state(self, rows: int, row_len: int) -> dict:
        """The state before the last ``rows`` rows of the last ``take_rows``."""
        return self._bulk.state_at_row(self._bulk.rows - rows, self)

    def get_state(self) -> dict:
        return {
            SOURCES: [s.get_state() for s in self.streams],
            TOKENS: list(self.tokens),
            CURRENT: self.current,
            PHASE_START: self.phase_start,
        }

    def block_at(self, epoch: int, block_index: int) -> Optional[Block]:
        """Not defined under token mixing: an origin lies in the stream of one source and does
        not name it. Only features bound to the data (``image_ref``) need it, and image
        sources refuse token mixing (loader.vision.loader_options)."""
        raise NotImplementedError("a token mix's origins do not name their source's stream; features bound to "
                                  "the data (image_ref) are not supported with mixing_unit = \"token\"")

    def set_state(self, state: dict, path: str = "stream") -> None:
        """``state`` as checked by ``loader.checkpoint.schema``; ``path``: its JSON path, for errors."""
        for k, (stream, saved) in enumerate(zip(self.streams, state[SOURCES])):
            stream.set_state(saved, path=f"{path}.{SOURCES}[{k}]")
        self._alive = None
        self._no_rows_at = None
        self.tokens = [int(t) for t in state[TOKENS]]
        self.current = int(state[CURRENT])
        self.phase_start = int(state[PHASE_START])
        self._restored_path = path

    def _check_restored_documents(self) -> None:
        """A restored ``current`` must match the cursors: the open document's source stands
        inside a document, every other source at a document start (how ``take`` and
        ``take_rows`` leave them). Checked at the first read after ``set_state``, as it
        reads the cursors' blocks; else a wrong ``current`` would silently continue a
        document that has ended, or choose anew inside one."""
        path, self._restored_path = self._restored_path, None
        for s, stream in enumerate(self.streams):
            at_start = stream.at_document_start()
            if s == self.current and at_start:
                raise StateError(f"{path}.current: source {s} is the open document's, but its cursor "
                                 f"({path}.sources[{s}]) stands at a document start")
            if s != self.current and not at_start:
                raise StateError(f"{path}.current: is {self.current}, but source {s}'s cursor "
                                 f"({path}.sources[{s}]) stands inside a document, so it must be {s}")


class _SourcePieces:
    """The pieces of a bulk cut grouped by source, all sources at once (one NumPy call per
    quantity instead of one per source: the calls' fixed cost, not the arrays, is what
    these few-hundred-piece cuts pay)."""

    def __init__(self, sources: np.ndarray, lengths: np.ndarray, alive: tuple[int, ...]) -> None:
        self.alive = np.array(alive, dtype=np.int64)
        self.mine = sources == self.alive[:, None]  # [source, piece]
        # own_before[k, p]: tokens of source alive[k] in the pieces before piece p.
        self.own_before = np.zeros((len(alive), len(sources) + 1), dtype=np.int64)
        np.cumsum(np.where(self.mine, lengths, 0), axis=1, out=self.own_before[:, 1:])
        self.totals: list[int] = self.own_before[:, -1].tolist()
        has = self.mine.any(axis=1)
        self.first_piece: list[int] = np.where(has, self.mine.argmax(axis=1), -1).tolist()  # -1: none

    def row_majority(self, out_starts: np.ndarray, out_ends: np.ndarray, rows: int, row_len: int) -> list[int]:
        """Each row's majority source (most tokens, lowest id on ties), from the pieces rather
        than per token. ``C_s(x)``, the tokens of source ``s`` before output position ``x``,
        is its tokens in the pieces before the piece holding ``x`` plus the part of that
        piece before ``x`` if it is ``s``'s; a row's count is the difference of ``C_s`` at
        its two ends."""
        bounds = np.arange(0, (rows + 1) * row_len, row_len, dtype=np.int64)
        piece = np.searchsorted(out_ends, bounds, side="right")
        np.minimum(piece, len(out_ends) - 1, out=piece)
        into_piece = bounds - out_starts[piece]
        before = self.own_before[:, piece] + np.where(self.mine[:, piece], into_piece, 0)
        return self.alive[np.diff(before, axis=1).argmax(axis=0)].tolist()


def _deficit_choice(alive, numerators, denominator: int, tokens) -> int:
    """``argmax_s n_s (T + 1) - d t_s`` over ``alive`` (ties: lowest id), ``T`` = their tokens."""
    total = sum(tokens[s] for s in alive) + 1
    best, best_key = -1, None
    for s, numerator in zip(alive, numerators):
        key = numerator * total - tokens[s] * denominator
        if best_key is None or key > best_key:
            best, best_key = s, key
    return best


class _BulkRows:
    """What ``take_rows`` decided, kept to rebuild the state at any of its row boundaries."""

    def __init__(self, *, state_before: dict, views: dict, sources: np.ndarray, starts: np.ndarray,
                 ends: np.ndarray, out_ends: np.ndarray, row_len: int, rows: int) -> None:
        self.state_before, self.views = state_before, views
        self.sources, self.starts, self.ends, self.out_ends = sources, starts, ends, out_ends
        self.row_len, self.rows = row_len, rows

    def state_at_row(self, row: int, mixer: "MixedTokenStream") -> dict:
        position = row * self.row_len  # tokens of this bulk taken before that row
        out_starts = self.out_ends - (self.ends - self.starts)
        taken = np.clip(position - out_starts, 0, self.ends - self.starts)  # per piece
        state = {
            "sources": [dict(saved) for saved in self.state_before["sources"]],
            "tokens": list(self.state_before["tokens"]),
            "current": self.state_before["current"],
            "phase_start": self.state_before["phase_start"],
        }
        for s in np.unique(self.sources).tolist():
            mine = np.flatnonzero((self.sources == s) & (taken > 0))
            if len(mine):
                k = mine[-1]
                state["sources"][s] = mixer.streams[s].state_at(self.views[s], int(self.starts[k] + taken[k]))
                state["tokens"][s] += int(taken[self.sources == s].sum())
        if position > 0:
            k = int(np.searchsorted(self.out_ends, position))  # piece holding token position - 1
            inside = position < self.out_ends[k]
            state["current"] = int(self.sources[k]) if inside else -1
        return state


def _plan_documents(mixer: MixedTokenStream, alive: tuple[int, ...], views: dict, wanted: int):
    """``(sources, starts, ends)`` of the next pieces in the order the deficit rule takes
    them: first the rest of the current document (if one is open), then whole documents,
    as far as the decisions are certain (every candidate document inside its source's view)
    and until ``wanted`` tokens are covered. Positions are the views' (virtual). None if empty.
    """
    tokens = list(mixer.tokens)
    head: Optional[tuple[int, int, int]] = None  # (source, start, end) of an open document's rest
    docs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for s in alive:
        cursor, ends = views[s].cursor, views[s].ends.astype(np.int64, copy=False)
        if s == mixer.current:  # the open document's rest comes first, decided earlier
            if not len(ends):
                return None
            head = (s, cursor, int(ends[0]))
            tokens[s] += head[2] - cursor
            cursor, ends = head[2], ends[1:]
        starts = np.empty(len(ends), dtype=np.int64)
        if len(ends):
            starts[0] = cursor
            starts[1:] = ends[:-1]
        docs[s] = (starts, ends)
    if mixer.current >= 0 and head is None:
        return None  # an open document of a source that left the mix: the per-document path
    heads = 0 if head is None else 1
    if len(alive) == 1:
        (s,) = alive
        starts, ends = docs[s]
        picked = (np.full(len(starts), s, dtype=np.int64), starts, ends)
    else:
        numerators, denominator = mixer._scaled_weights(alive)
        if len(alive) == 2:
            picked = _merge_two(alive, numerators, tokens, docs, heads)
        else:
            covered = 0 if head is None else head[2] - head[1]
            picked = _decide_in_turn(alive, numerators, denominator, tokens, docs, wanted - covered)
        if picked is None:
            return None
    sources, starts, ends = picked
    if head is not None:
        if len(alive) == 2:  # the merge left index 0 for the head
            sources[0], starts[0], ends[0] = head
        else:
            sources, starts, ends = (np.concatenate(([h], a)).astype(np.int64) for h, a in zip(head, picked))
    if not len(sources):
        return None
    return sources, starts, ends


_SAFE = 1 << 62  # keys beyond this would overflow int64: use the per-document path


def _merge_two(alive, numerators, tokens, docs, heads: int = 0):
    """Two sources ``a < b`` with shares ``n_a / d``, ``n_b / d`` (``n_a + n_b = d``).

    The rule takes ``a`` iff ``n_a (T + 1) - d t_a >= n_b (T + 1) - d t_b`` with ``T = t_a +
    t_b``, which rearranges to ``2 n_b t_a <= 2 n_a t_b + n_a - n_b``: each side depends on
    one source only. So ``a``'s document ``j`` gets the key ``2 n_b`` x (its tokens before
    ``j``) and ``b``'s document ``i`` the key ``2 n_a`` x (its tokens before ``i``) + ``n_a -
    n_b``; the rule's order is the merge of the two increasing key sequences, ties to
    ``a``. The merge is certain up to the last document of either candidate list.

    The returned arrays start with ``heads`` unset entries for the caller's pieces.
    """
    a, b = alive
    n_a, n_b = numerators
    starts_a, ends_a = docs[a]
    starts_b, ends_b = docs[b]
    if not len(starts_a) or not len(starts_b):
        return None
    key_a = _tokens_before(tokens[a], ends_a - starts_a)
    key_b = _tokens_before(tokens[b], ends_b - starts_b)
    if max(2 * n_b * int(key_a[-1]), 2 * n_a * int(key_b[-1]) + abs(n_a - n_b)) >= _SAFE:
        return None
    key_a *= 2 * n_b
    key_b *= 2 * n_a
    key_b += n_a - n_b
    position_a = np.searchsorted(key_b, key_a, side="left")
    position_a += np.arange(heads, heads + len(key_a))
    position_b = np.searchsorted(key_a, key_b, side="right")
    position_b += np.arange(heads, heads + len(key_b))
    certain = min(int(position_a[-1]), int(position_b[-1])) + 1
    total = heads + len(key_a) + len(key_b)
    order = np.empty(total, dtype=np.int64)
    starts = np.empty(total, dtype=np.int64)
    ends = np.empty(total, dtype=np.int64)
    order[position_a], starts[position_a], ends[position_a] = a, starts_a, ends_a
    order[position_b], starts[position_b], ends[position_b] = b, starts_b, ends_b
    return order[:certain], starts[:certain], ends[:certain]


def _tokens_before(already: int, lengths: np.ndarray) -> np.ndarray:
    """``already`` plus the lengths before each document: exclusive prefix sums, int64."""
    before = np.cumsum(lengths)
    before -= lengths
    before += already
    return before


def _decide_in_turn(alive, numerators, denominator, tokens, docs, wanted):
    """Three or more sources: the rule one document at a time, on plain integers."""
    tokens = list(tokens)
    next_doc = {s: 0 for s in alive}
    lengths = {s: (docs[s][1] - docs[s][0]).tolist() for s in alive}
    order: list[int] = []
    picks: list[int] = []
    covered = 0
    while covered < wanted:
        best = _deficit_choice(alive, numerators, denominator, tokens)
        j = next_doc[best]
        if j == len(lengths[best]):
            break  # the rule wants a document past its block: stop, certain so far
        order.append(best)
        picks.append(j)
        next_doc[best] = j + 1
        tokens[best] += lengths[best][j]
        covered += lengths[best][j]
    if not order:
        return None
    order_arr = np.array(order, dtype=np.int64)
    starts = np.array([int(docs[s][0][j]) for s, j in zip(order, picks)], dtype=np.int64)
    ends = np.array([int(docs[s][1][j]) for s, j in zip(order, picks)], dtype=np.int64)
    return order_arr, starts, ends
