"""The token-unit deficit rule of ``loader.stages.token_mixing.MixedTokenStream``, on fake streams.

With ``D_s = w_s * T - t_s`` (tokens of the window; ``T`` over the sources still in the mix)
and ``d_max`` the longest document, the rule guarantees at every document boundary:

* over-share: ``t_s - w_s * T <= d_max`` for every source (the picked source has the
  largest ``D_s + w_s``, so ``D_s > -1`` before its document of at most ``d_max`` tokens);
* under-share: ``w_s * T - t_s <= (n - 1) * d_max`` for ``n`` sources in the mix (the
  deficits sum to zero and none is below ``-d_max``); for two sources that is ``d_max``:
  two sources stay within one document of their target both ways.

The loader-level check on real data is in ``test_mix_loader.py``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Optional

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.io.blocks import Chunk
from loader.order.mixing import exact_weights
from loader.stages.token_mixing import MixedTokenStream


class FakeStream:
    """Documents of given lengths, the subset of the LaneTokenStream API the mixer uses.

    ``cycle=True`` repeats the lengths forever (a ``repeat`` source); otherwise the stream
    is exhausted after the last document (a ``stop`` source).
    """

    feature_names: tuple = ()  # per-token features: none
    last_origin = None  # where the last take started: not tracked

    def __init__(self, lengths: list[int], *, cycle: bool = False) -> None:
        self.lengths = lengths
        self.cycle = cycle
        self.doc = 0
        self.offset = 0
        self.exhausted = not lengths

    def at_document_start(self) -> bool:
        return self.exhausted or self.offset == 0

    def take(self, n: int, *, within_document: bool = False) -> Optional[Chunk]:
        assert within_document
        if self.exhausted:
            return None
        count = min(n, self.lengths[self.doc] - self.offset)
        starts = np.array([0] if self.offset == 0 else [], dtype=np.int64)
        self.offset += count
        if self.offset == self.lengths[self.doc]:
            self.doc, self.offset = self.doc + 1, 0
            if self.doc == len(self.lengths):
                self.doc = 0
                self.exhausted = not self.cycle
        return Chunk(tokens=np.zeros(count, dtype=np.int32), doc_starts=starts)

    def get_state(self) -> dict:
        return {"doc": self.doc, "offset": self.offset, "exhausted": self.exhausted}

    def set_state(self, state: dict, path: str = "stream") -> None:  # path: named by errors of real streams
        self.doc, self.offset, self.exhausted = state["doc"], state["offset"], state["exhausted"]


def _drain(mixer: MixedTokenStream, documents: int, check) -> None:
    """Take whole documents one at a time; ``check()`` after each (a document boundary)."""
    for _ in range(documents):
        if mixer.take(10**9, within_document=True) is None:
            return
        assert mixer.current == -1  # the whole document was taken
        check()


def _assert_within_bounds(mixer: MixedTokenStream, live: list[int], d_max: int) -> None:
    weights = [mixer.weights[s] for s in live]
    norm = sum(weights)
    weights = [w / norm for w in weights]
    total = sum(mixer.tokens[s] for s in live)
    for s, w in zip(live, weights):
        deficit = w * total - mixer.tokens[s]
        assert deficit >= -d_max, f"source {s} over-shared by {-deficit} (d_max {d_max})"
        assert deficit <= (len(live) - 1) * d_max, f"source {s} under-shared by {deficit} (d_max {d_max})"


doc_lengths = st.lists(st.integers(1, 300), min_size=1, max_size=40)
weights_st = st.lists(st.sampled_from([0.55, 0.3, 0.15, 1, 2, 3, 0.01, 7]), min_size=2, max_size=5)


@settings(max_examples=50, deadline=None)
@given(weights_st, st.data())
def test_deficit_bounds_at_every_document_boundary(raw, data) -> None:
    lengths = [data.draw(doc_lengths) for _ in raw]
    weights = exact_weights(raw)
    mixer = MixedTokenStream([FakeStream(ls, cycle=True) for ls in lengths])
    mixer.set_phase(0, weights)
    d_max = max(max(ls) for ls in lengths)
    live = list(range(len(raw)))
    _drain(mixer, 300, lambda: _assert_within_bounds(mixer, live, d_max))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(0.55, 0.45), (0.9, 0.1), (1, 1), (0.013, 0.987)]), doc_lengths, doc_lengths)
def test_two_sources_stay_within_one_document(raw, a, b) -> None:
    weights = exact_weights(raw)
    mixer = MixedTokenStream([FakeStream(a, cycle=True), FakeStream(b, cycle=True)])
    mixer.set_phase(0, weights)
    d_max = max(a + b)

    def check() -> None:
        total = sum(mixer.tokens)
        for s in (0, 1):
            assert abs(mixer.tokens[s] - weights[s] * total) <= d_max

    _drain(mixer, 300, check)


def test_first_document_of_a_window_comes_from_the_heaviest_source() -> None:
    mixer = MixedTokenStream([FakeStream([5], cycle=True) for _ in range(3)])
    mixer.set_phase(0, exact_weights([0.15, 0.55, 0.3]))
    mixer.take(5, within_document=True)
    assert mixer.tokens == [0, 5, 0]


def test_unit_documents_follow_the_weights_within_one_token() -> None:
    weights = exact_weights([0.55, 0.3, 0.15])
    mixer = MixedTokenStream([FakeStream([1], cycle=True) for _ in range(3)])
    mixer.set_phase(0, weights)
    for taken in range(1, 2001):
        mixer.take(1, within_document=True)
        assert all(abs(mixer.tokens[s] - weights[s] * taken) <= 1 for s in range(3))


def test_a_new_phase_restarts_the_window() -> None:
    mixer = MixedTokenStream([FakeStream([7], cycle=True), FakeStream([3], cycle=True)])
    mixer.set_phase(0, exact_weights([0.5, 0.5]))
    _drain(mixer, 40, lambda: None)
    assert sum(mixer.tokens) > 0
    mixer.set_phase(0, mixer.weights)  # same phase: nothing restarts
    assert sum(mixer.tokens) > 0
    mixer.set_phase(12, exact_weights([0.9, 0.1]))
    assert mixer.tokens == [0, 0] and mixer.phase_start == 12
    _drain(mixer, 200, lambda: _assert_within_bounds(mixer, [0, 1], 7))
    assert abs(mixer.tokens[0] - Fraction(9, 10) * sum(mixer.tokens)) <= 7


@settings(max_examples=25, deadline=None)
@given(doc_lengths, doc_lengths, doc_lengths, st.integers(30, 120))
def test_a_stopped_source_drops_out_and_the_rest_renormalise(a, b, c, small_docs) -> None:
    """After ``c`` runs dry, the other two share the window by 0.55 : 0.3 of *their* tokens.

    The deviation carried over at the stop is bounded (it does not grow with the tokens the
    stopped source delivered) and the rule brings it back within one document.
    """
    weights = exact_weights([0.55, 0.3, 0.15])
    small = (c * 120)[:small_docs]
    mixer = MixedTokenStream([FakeStream(a, cycle=True), FakeStream(b, cycle=True), FakeStream(small)])
    mixer.set_phase(0, weights)
    d_max = max(a + b + small)
    after_stop: list[Fraction] = []
    for _ in range(100_000):
        assert mixer.take(10**9, within_document=True) is not None
        live = [s for s in range(3) if not mixer.streams[s].exhausted]
        if len(live) == 3:
            _assert_within_bounds(mixer, live, d_max)
            continue
        deviation = abs(mixer.tokens[0] - Fraction(55, 85) * (mixer.tokens[0] + mixer.tokens[1]))
        assert deviation <= 3 * d_max
        after_stop.append(deviation)
        if len(after_stop) == 300:
            break
    assert len(after_stop) == 300
    assert max(after_stop[-100:]) <= d_max


def test_all_sources_exhausted_ends_the_stream() -> None:
    mixer = MixedTokenStream([FakeStream([3, 4]), FakeStream([5])])
    mixer.set_phase(0, exact_weights([1, 1]))
    taken = 0
    while (chunk := mixer.take(4)) is not None:
        taken += len(chunk.tokens)
        assert chunk.token_sources is not None and len(chunk.token_sources) == len(chunk.tokens)
    assert taken == 12 and mixer.exhausted


def test_state_round_trip_mid_document() -> None:
    def fresh() -> MixedTokenStream:
        mixer = MixedTokenStream([FakeStream([7, 11, 3] * 30), FakeStream([5, 2] * 40), FakeStream([13] * 20)])
        mixer.set_phase(0, exact_weights([0.55, 0.3, 0.15]))
        return mixer

    reference = fresh()
    out = [reference.take(6) for _ in range(80)]
    for cut in (1, 17, 33, 50):
        first = fresh()
        for _ in range(cut):
            first.take(6)
        resumed = fresh()
        resumed.set_state(first.get_state())
        for k in range(cut, 80):
            chunk = resumed.take(6)
            assert np.array_equal(chunk.token_sources, out[k].token_sources)
            assert np.array_equal(chunk.doc_starts, out[k].doc_starts)
