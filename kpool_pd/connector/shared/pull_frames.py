"""The Pull stream's chunk messages on the wire, written and read without protobuf's copies.

A gRPC-stream pull is mostly ``PullResponse{chunk: Chunk{region, offset, data}}`` messages of
``chunk_bytes`` each. Through protobuf every chunk is copied four times on each side (into
``bytes``, into the message, into its serialisation, and back out); here the sender writes the
message's protobuf encoding around the data with one copy, and the receiver takes the data as a
view into the bytes gRPC handed over. The bytes on the wire are protobuf's own encoding of the same
message (proto3, canonical field order), so a peer that uses the generated code reads them as
usual, and anything not in that canonical form is read by protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kpool_pd.connector import prefill_api as pb

PULL_METHOD = f"/{pb.SERVICE_NAME}/Pull"
PUSH_METHOD = f"/{pb.SERVICE_NAME}/PrefillPush"  # its stream is a Pull stream's, after the grant
_RESPONSE_CHUNK_KEY = 0x12  # PullResponse field 2 (chunk), length-delimited
_REGION_KEY, _OFFSET_KEY, _DATA_KEY = 0x08, 0x10, 0x1A  # Chunk fields 1 (varint), 2 (varint), 3 (bytes)


@dataclass(frozen=True, slots=True)
class ChunkFrame:
    """A chunk as read off the wire: ``data`` is a view into the received message (no copy)."""

    region: int
    offset: int
    data: memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(raw: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; ValueError when it runs past the end or
    past 10 bytes."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(raw))):
        byte = raw[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise ValueError("truncated or overlong varint")


def encode_chunk(region: int, offset: int, data) -> bytes:
    """The protobuf encoding of ``PullResponse(chunk=Chunk(region, offset, data))``, made with one
    copy of ``data`` (any buffer: bytes, a numpy array, a memoryview of pinned host memory)."""
    if region < 0 or offset < 0:
        raise ValueError(f"region and offset must be >= 0, got {region}, {offset}")
    payload = memoryview(data).cast("B")
    inner = bytearray()
    if region:
        inner += bytes([_REGION_KEY]) + _varint(region)
    if offset:
        inner += bytes([_OFFSET_KEY]) + _varint(offset)
    if len(payload):
        inner += bytes([_DATA_KEY]) + _varint(len(payload))
    header = bytes([_RESPONSE_CHUNK_KEY]) + _varint(len(inner) + len(payload)) + bytes(inner)
    return b"".join((header, payload))


def serialize_response(message: pb.PullResponse | bytes) -> bytes:
    """The Pull handler's response serializer: messages through protobuf, chunks already encoded
    (``encode_chunk``) as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def _canonical_chunk(raw: memoryview) -> ChunkFrame | None:
    """The chunk in ``raw`` when it is in ``encode_chunk``'s form (each field at most once, in
    field order, lengths that add up), else None."""
    if len(raw) < 2 or raw[0] != _RESPONSE_CHUNK_KEY:
        return None
    size, pos = _read_varint(raw, 1)
    if pos + size != len(raw):
        return None
    region = offset = 0
    if pos < len(raw) and raw[pos] == _REGION_KEY:
        region, pos = _read_varint(raw, pos + 1)
    if pos < len(raw) and raw[pos] == _OFFSET_KEY:
        offset, pos = _read_varint(raw, pos + 1)
    if pos == len(raw):
        return ChunkFrame(region, offset, raw[pos:])
    if raw[pos] != _DATA_KEY:
        return None
    length, pos = _read_varint(raw, pos + 1)
    if pos + length != len(raw) or region >= 1 << 32 or offset >= 1 << 64:
        return None
    return ChunkFrame(region, offset, raw[pos:])


def deserialize_response(raw: bytes) -> pb.PullResponse | ChunkFrame:
    """The Pull call's response deserializer: a chunk as a ``ChunkFrame`` viewing ``raw``, any
    other message as a ``PullResponse``. A malformed message raises what protobuf raises."""
    view = memoryview(raw)
    try:
        frame = _canonical_chunk(view)
    except ValueError:
        frame = None
    if frame is not None:
        return frame
    message = pb.PullResponse.FromString(raw)
    if message.WhichOneof("message") == "chunk":
        return ChunkFrame(message.chunk.region, message.chunk.offset, memoryview(message.chunk.data))
    return message


def pull_method(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """``PrefillService.Pull`` on ``channel``, reading chunks with ``deserialize_response``."""
    return channel.unary_stream(PULL_METHOD, request_serializer=pb.PullRequest.SerializeToString,
                                response_deserializer=deserialize_response)


def push_method(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """``PrefillService.PrefillPush`` on ``channel``, reading chunks with ``deserialize_response``."""
    return channel.unary_stream(PUSH_METHOD, request_serializer=pb.PushRequest.SerializeToString,
                                response_deserializer=deserialize_response)
