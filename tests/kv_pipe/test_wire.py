"""The frame format: everything malformed, truncated or oversized is refused with a clear ProtocolError."""

from __future__ import annotations

import socket
import struct

import pytest
import torch

from kv_pipe import ProtocolError, wire
from kv_pipe.wire import Chunk, Kind

pytestmark = pytest.mark.pipes


def test_tensor_header_round_trip_for_every_dtype():
    for dtype in wire.DTYPE_TO_CODE:
        frame = wire.encode_tensor(dtype, (3, 0, 7), 0)
        kind, length = wire.decode_header(frame[:wire.HEADER.size])
        assert (kind, length) == (Kind.TENSOR, len(frame) - wire.HEADER.size)
        header = wire.decode_tensor(frame[wire.HEADER.size:], max_nbytes=1 << 30)
        assert (header.dtype, header.shape, header.nbytes, header.data) == (dtype, (3, 0, 7), 0, None)


def test_every_common_dtype_has_a_code():
    for name in ["float32", "float64", "float16", "bfloat16", "bool", "uint8", "int8", "int16", "int32", "int64",
                 "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"]:
        assert getattr(torch, name) in wire.DTYPE_TO_CODE, name


def test_unsupported_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="cannot be sent"):
        wire.encode_tensor(torch.qint8, (1,), 1)


@pytest.mark.parametrize("raw, message", [
    (b"XXXX" + bytes(8), "bad magic"),
    (struct.pack("!4sBBHI", b"MKVP", 9, 4, 0, 0), "unsupported protocol version 9"),
    (struct.pack("!4sBBHI", b"MKVP", wire.VERSION, 99, 0, 0), "unknown frame kind 99"),
    (struct.pack("!4sBBHI", b"MKVP", wire.VERSION, 6, 1, 24), "flags must be 0"),
    (struct.pack("!4sBBHI", b"MKVP", wire.VERSION, 6, 0, 1 << 30), "exceeds its limit"),
    (struct.pack("!4sBBHI", b"MKVP", wire.VERSION, 1, 0, 1 << 20), "exceeds its limit"),
    (struct.pack("!4sBBHI", b"MKVP", wire.VERSION, 10, 0, wire._DIRECT.size + 16 * wire.MAX_REGIONS + 1), "exceeds its limit"),
    (b"MKVP", "truncated frame header"),
])
def test_bad_headers(raw, message):
    with pytest.raises(ProtocolError, match=message):
        wire.decode_header(raw)


def _tensor_payload(code: int, dims: list[int], nbytes: int, ndim=None) -> bytes:
    ndim = len(dims) if ndim is None else ndim
    return struct.pack("!BB6xQ", code, ndim, nbytes) + struct.pack(f"!{len(dims)}Q", *dims)


@pytest.mark.parametrize("payload, message", [
    (b"\x01\x02", "fewer than the fixed"),
    (_tensor_payload(200, [4], 16), "unknown dtype code 200"),
    (_tensor_payload(1, [4, 4], 16), "needs 64 bytes, header says 16"),
    (_tensor_payload(1, [4], 16, ndim=3), "ndim=3 needs"),
    (_tensor_payload(1, [1 << 40], 1 << 42), "exceeds max_tensor_size"),
    (_tensor_payload(1, [0, (1 << 64) - 1], 0), "has a dimension beyond max_tensor_size"),  # was a TypeError
    (_tensor_payload(1, [1 << 62, 1 << 62, 0], 0), "has a dimension beyond"),
])
def test_bad_tensor_headers(payload, message):
    with pytest.raises(ProtocolError, match=message):
        wire.decode_tensor(payload, max_nbytes=1 << 30)


def test_direct_frames_round_trip_and_refuse_bad_offers():
    regions = ((0x7F00, 1 << 23), (0x9F00, 1 << 23))
    assert wire.decode_direct(wire.encode_direct(3, 1 << 24, regions)[wire.HEADER.size:]) == wire.Direct(3, 1 << 24, regions)
    assert wire.decode_direct(wire.encode_direct(4, 1 << 24, ())[wire.HEADER.size:]) == wire.Direct(4, 1 << 24, ())  # declined
    assert wire.decode_dchunk(wire.encode_dchunk(8, 4)[wire.HEADER.size:]) == wire.DirectChunk(8, 4)
    with pytest.raises(ProtocolError, match="empty region"):
        wire.decode_direct(wire.encode_direct(0, 16, ((0, 16),))[wire.HEADER.size:])
    with pytest.raises(ProtocolError, match="regions hold 16 bytes for a tensor of 32"):
        wire.decode_direct(wire.encode_direct(0, 32, ((0x10, 16),))[wire.HEADER.size:])
    with pytest.raises(ProtocolError, match="but 2 regions need"):
        wire.decode_direct(wire.encode_direct(0, 32, ((0x10, 16), (0x20, 16)))[wire.HEADER.size:-1])
    with pytest.raises(ProtocolError, match="DCHUNK payload has 3 bytes"):
        wire.decode_dchunk(b"abc")


@pytest.mark.parametrize("payload, schema, message", [
    (b"\xff\xfe", {"a": int}, "not valid UTF-8 JSON"),
    (b"[1]", {"a": int}, "must be a JSON object"),
    (b'{"a": 1, "b": 2}', {"a": int}, "keys"),
    (b'{"a": "1"}', {"a": int}, "wrong type"),
    (b'{"a": true}', {"a": int}, "wrong type"),
])
def test_bad_handshakes(payload, schema, message):
    with pytest.raises(ProtocolError, match=message):
        wire.decode_json(payload, schema)


def test_recv_frame_over_a_real_socket_pair():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire.encode_chunk(Chunk(8, 16, 24)) + wire.encode_ack(24) + wire.encode(Kind.NONE))
        kind, payload = wire.recv_frame(b)
        assert kind == Kind.CHUNK and wire.decode_chunk(payload) == Chunk(8, 16, 24)
        kind, payload = wire.recv_frame(b)
        assert kind == Kind.ACK and wire.decode_ack(payload) == 24
        assert wire.recv_frame(b) == (Kind.NONE, b"")
        a.sendall(wire.encode_chunk(Chunk(0, 1, 1))[:15])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError, match="closed mid-frame"):
            wire.recv_frame(b)
