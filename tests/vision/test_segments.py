"""loader.vision.segments: the interleaved text/image layout round-trips and refuses bad lists."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loader.vision.segments import IMAGE, decode_segments, encode_segments, image_count

parts_strategy = st.lists(st.one_of(st.just(IMAGE), st.text(max_size=8)), max_size=12)


@given(parts_strategy)
def test_round_trip_keeps_order_and_boundaries(parts):
    text, segments = encode_segments(parts)
    decoded = decode_segments(text, segments)
    images = iter(range(len(parts)))
    expected = [next(images) if part is IMAGE else part for part in parts if part is IMAGE or part]
    assert decoded == expected
    assert image_count(segments) == sum(part is IMAGE for part in parts)
    assert text == "".join(p for p in parts if p is not IMAGE)


def test_example_of_the_docstring():
    text, segments = encode_segments(["A cat.", IMAGE, "It sleeps. ", "Then", IMAGE])
    assert (text, segments) == ("A cat.It sleeps. Then", [6, -1, 17, 21, -1])
    assert encode_segments(["é", IMAGE]) == ("é", [2, -1])  # bytes, not characters


@pytest.mark.parametrize("segments, message", [
    ([3, 2], r"segments\[1\] = 2"), ([9], r"segments\[0\] = 9"), ([1, -1], "splits a UTF-8 character"),
    ([-1], "rest of the text"),
])
def test_bad_segments_are_refused_naming_the_entry(segments, message):
    with pytest.raises(ValueError, match=message):
        decode_segments("éa", segments)
