"""Every token stream of the loader implements the stream protocol (loader.stages.stream), which
the packers call without probing."""

from __future__ import annotations

import inspect

import pytest

from loader.io.blocks import TokenFormat
from loader.io.lane_reader import LaneTokenStream
from loader.io.manifest import read_manifest
from loader.io.provenance import ProvenanceStream
from loader.stages.stream import TokenStream
from loader.stages.token_mixing import MixedTokenStream

METHODS = sorted(name for name, member in vars(TokenStream).items()
                 if inspect.isfunction(member) and not name.startswith("_"))
ATTRIBUTES = sorted(TokenStream.__annotations__)


def missing_members(stream: object) -> list[str]:
    """The protocol's members ``stream`` lacks (methods not callable count as missing)."""
    absent = [name for name in ATTRIBUTES if not hasattr(stream, name)]
    return absent + [name for name in METHODS if not callable(getattr(stream, name, None))]


def test_the_protocol_declares_what_the_packers_call():
    assert set(METHODS) >= {"take", "take_rows", "rewound_state", "get_state", "set_state", "block_at"}
    assert set(ATTRIBUTES) == {"feature_names", "last_origin", "exhausted"}


@pytest.fixture(scope="module")
def lane_streams(corpus):
    manifest = read_manifest(corpus.pretokenized_path)
    options = dict(dataset_path=corpus.pretokenized_path, manifest=manifest, source_name="synthetic", lane_id=0,
                   seed=corpus.seed, token_format=TokenFormat(None, 0))
    streams = [LaneTokenStream(**options), LaneTokenStream(**options), ProvenanceStream(**options)]
    yield streams
    for stream in streams:
        stream.close()


def test_every_stream_of_the_loader_implements_it(lane_streams):
    lane, other, provenance = lane_streams
    for stream in (lane, provenance, MixedTokenStream([lane, other])):
        assert missing_members(stream) == [], type(stream).__name__
    lane.take(5)
    assert lane.last_origin == (0, 0, 0)
    assert lane.block_at(0, 0) is not None and lane.block_at(0, 10**6) is None


def test_a_stream_without_a_member_is_found():
    class Incomplete:  # a stream of the tests that forgot what the packers read
        feature_names: tuple = ()
        exhausted = False

        def take(self, n, *, within_document=False):
            return None

    assert missing_members(Incomplete()) == ["last_origin", "block_at", "get_state", "rewound_state", "set_state",
                                            "take_rows"]


def test_a_token_mix_refuses_block_at_by_name(lane_streams):
    lane, other, _ = lane_streams
    with pytest.raises(NotImplementedError, match="image_ref"):
        MixedTokenStream([lane, other]).block_at(0, 0)
