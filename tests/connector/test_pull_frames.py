"""The Pull stream's hand-written chunk encoding is protobuf's, both ways."""

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.pull_frames import ChunkFrame, deserialize_response, encode_chunk, serialize_response

regions = st.integers(0, 2**32 - 1)
offsets = st.integers(0, 2**64 - 1)
payloads = st.binary(max_size=300)


def _protobuf(region: int, offset: int, data: bytes) -> bytes:
    return pb.PullResponse(chunk=pb.Chunk(region=region, offset=offset, data=data)).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(regions, offsets, payloads)
def test_encoded_chunk_is_protobufs_encoding(region, offset, data):
    assert encode_chunk(region, offset, data) == _protobuf(region, offset, data)


@settings(max_examples=300, deadline=None)
@given(regions, offsets, payloads)
def test_protobufs_chunk_reads_back_as_a_frame(region, offset, data):
    frame = deserialize_response(_protobuf(region, offset, data))
    assert isinstance(frame, ChunkFrame)
    assert (frame.region, frame.offset, bytes(frame.data)) == (region, offset, data)


def test_encode_takes_any_buffer_and_copies_it_once():
    host = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)
    raw = encode_chunk(3, 4096, host)
    assert raw == _protobuf(3, 4096, host.tobytes())
    host[0] ^= 0xFF  # the encoded message is a copy, not a view of the buffer
    assert raw == _protobuf(3, 4096, np.arange(1 << 20, dtype=np.uint32).view(np.uint8).tobytes())


def test_frame_data_views_the_received_bytes():
    raw = _protobuf(1, 2, b"abcdef" * 1000)
    frame = deserialize_response(raw)
    assert frame.data.obj is raw  # no copy of the payload


@pytest.mark.parametrize("message", [
    pb.PullResponse(prefilled=pb.PrefillDone(first_token=4, prefill_ms=2.5)),
    pb.PullResponse(done=pb.PullDone(bytes=10, regions=1, crc32=[7])),
    pb.PullResponse(),
], ids=["prefilled", "done", "empty"])
def test_other_messages_go_through_protobuf(message):
    raw = serialize_response(message)
    assert raw == message.SerializeToString()
    assert deserialize_response(raw) == message


@pytest.mark.parametrize("raw", [
    # the data field before region and offset (valid protobuf, not the canonical order)
    b"\x12" + bytes([2 + 3 + 2 + 2]) + b"\x1a\x03abc\x08\x05\x10\x07",
    # region written twice: the last one wins
    b"\x12\x0b\x08\x01\x08\x05\x10\x07\x1a\x03abc",
    # an unknown field inside the chunk
    b"\x12\x0b\x08\x05\x10\x07\x1a\x03abc\x20\x01",
], ids=["data-first", "repeated-region", "unknown-field"])
def test_non_canonical_chunks_are_read_by_protobuf(raw):
    frame = deserialize_response(raw)
    assert isinstance(frame, ChunkFrame)
    expected = pb.PullResponse.FromString(raw).chunk
    assert (frame.region, frame.offset, bytes(frame.data)) == (expected.region, expected.offset, expected.data) \
        == (5, 7, b"abc")


@pytest.mark.parametrize("raw", [b"\x12\x05\x08", b"\x12\x03\x1a\x05ab", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"],
                         ids=["short", "data-past-end", "overlong-varint"])
def test_malformed_chunks_raise_protobufs_error(raw):
    with pytest.raises(DecodeError):
        deserialize_response(raw)


def test_negative_positions_are_refused():
    with pytest.raises(ValueError, match="-1"):
        encode_chunk(-1, 0, b"")
