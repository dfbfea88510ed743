"""The pipe's side-channel wire format: the versioned, length-checked frames of the handshake and of each tensor
(whose bytes the Transfer Engine writes; a frame only says where they are), built, parsed and validated here only.
Nothing on it is ever executed; a malformed frame raises ``ProtocolError`` with a message naming what is wrong.

Frame layout, kinds and payloads: docs/wire.md.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from kv_pipe.config import MAX_INLINE as MAX_INLINE_BYTES
from kv_pipe.errors import ProtocolError

MAGIC = b"MKVP"
VERSION = 5  # 5: authenticated handshake (CHALLENGE, AUTH)
HEADER = struct.Struct("!4sBBHI")
MAX_NDIM = 64
MAX_JSON = 64 << 10
MAX_INLINE = MAX_INLINE_BYTES  # protocol cap; each receiver announces its own (smaller) limit in WELCOME


class Kind(IntEnum):
    HELLO = 1
    WELCOME = 2
    ERROR = 3
    TENSOR = 4
    NONE = 5
    CHUNK = 6
    ACK = 7
    BYE = 8
    TENSOR_INLINE = 9
    DIRECT = 10
    DCHUNK = 11
    CHALLENGE = 12
    AUTH = 13


_CHUNK = struct.Struct("!QQQ")
_TENSOR_HEAD = struct.Struct("!BB6xQ")
_ACK = struct.Struct("!Q")
_DIRECT = struct.Struct("!QQI4x")
_REGION = struct.Struct("!QQ")
MAX_REGIONS = 1 << 16
_DCHUNK = struct.Struct("!QQ")
_MAX_PAYLOAD = {
    Kind.HELLO: MAX_JSON, Kind.WELCOME: MAX_JSON, Kind.ERROR: 4096, Kind.CHALLENGE: 1024, Kind.AUTH: 2048,
    Kind.TENSOR: _TENSOR_HEAD.size + 8 * MAX_NDIM,
    Kind.NONE: 0, Kind.CHUNK: _CHUNK.size, Kind.ACK: _ACK.size, Kind.BYE: 0,
    Kind.TENSOR_INLINE: _TENSOR_HEAD.size + 8 * MAX_NDIM + MAX_INLINE,
    Kind.DIRECT: _DIRECT.size + _REGION.size * MAX_REGIONS, Kind.DCHUNK: _DCHUNK.size,
}

# The wire code of every dtype is fixed forever; dtypes this torch lacks are simply absent.
_DTYPE_CODES = {
    1: "float32", 2: "float64", 3: "float16", 4: "bfloat16", 5: "bool",
    6: "uint8", 7: "int8", 8: "int16", 9: "int32", 10: "int64",
    11: "complex64", 12: "complex128", 13: "complex32",
    14: "uint16", 15: "uint32", 16: "uint64",
    17: "float8_e4m3fn", 18: "float8_e5m2", 19: "float8_e4m3fnuz", 20: "float8_e5m2fnuz", 21: "float8_e8m0fnu",
}
CODE_TO_DTYPE: dict[int, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in _DTYPE_CODES.items()
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_TO_CODE: dict[torch.dtype, int] = {dtype: code for code, dtype in CODE_TO_DTYPE.items()}


@dataclass(frozen=True)
class Chunk:
    """A piece of a tensor in the receiver's ring: bytes [offset, offset+length).

    ``end`` is the absolute ring position just after it (positions only grow; offsets wrap).
    """

    offset: int
    length: int
    end: int


@dataclass(frozen=True)
class DirectChunk:
    """Bytes [pos, pos+length) of the current tensor, written straight into the receiver's result."""

    pos: int
    length: int


@dataclass(frozen=True)
class Direct:
    """The receiver's offer: write the rest of tensor ``seq`` (``nbytes`` in all) into ``regions`` ((address, length)
    pairs filled in order); no regions: no offer."""

    seq: int
    nbytes: int
    regions: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TensorHeader:
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    data: memoryview | None = None  # an inline tensor's bytes; None when CHUNK / DCHUNK frames carry them


def encode(kind: Kind, payload: bytes = b"") -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, 0, len(payload)) + payload


def decode_header(raw: bytes) -> tuple[Kind, int]:
    """Validate a frame header and return (kind, payload length)."""
    if len(raw) != HEADER.size:
        raise ProtocolError(f"truncated frame header: {len(raw)} of {HEADER.size} bytes")
    magic, version, kind, flags, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} (expected {MAGIC!r}): the peer does not speak this pipe's protocol")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this end speaks {VERSION}); "
                            "run the same release on both ends")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if flags:
        raise ProtocolError(f"frame flags must be 0, got {flags:#x}")
    if length > _MAX_PAYLOAD[kind]:
        raise ProtocolError(f"{kind.name} frame of {length} bytes exceeds its limit of {_MAX_PAYLOAD[kind]} bytes")
    return kind, length


def encode_json(kind: Kind, obj: dict[str, Any]) -> bytes:
    payload = json.dumps(obj, separators=(",", ":")).encode()
    if len(payload) > MAX_JSON:
        raise ValueError(f"{kind.name} payload too large")
    return encode(kind, payload)


def decode_json(payload: bytes, schema: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """Parse a handshake object and check that it has exactly the keys of ``schema`` with those types."""
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: also a huge integer literal
        raise ProtocolError(f"handshake is not valid UTF-8 JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"handshake must be a JSON object, got {type(obj).__name__}")
    if set(obj) != set(schema):
        raise ProtocolError(f"handshake keys {sorted(obj)} differ from the expected {sorted(schema)}")
    for key, typ in schema.items():
        if not isinstance(obj[key], typ) or isinstance(obj[key], bool) and typ is not bool:
            raise ProtocolError(f"handshake field {key!r} has the wrong type {type(obj[key]).__name__}")
    return obj


def encode_chunk(chunk: Chunk) -> bytes:
    return encode(Kind.CHUNK, _CHUNK.pack(chunk.offset, chunk.length, chunk.end))


def decode_chunk(payload: bytes) -> Chunk:
    if len(payload) != _CHUNK.size:
        raise ProtocolError(f"CHUNK payload has {len(payload)} bytes, expected {_CHUNK.size}")
    return Chunk(*_CHUNK.unpack(payload))


def encode_ack(end: int) -> bytes:
    return encode(Kind.ACK, _ACK.pack(end))


def decode_ack(payload: bytes) -> int:
    if len(payload) != _ACK.size:
        raise ProtocolError(f"ACK payload has {len(payload)} bytes, expected {_ACK.size}")
    return _ACK.unpack(payload)[0]


def encode_dchunk(pos: int, length: int) -> bytes:
    return encode(Kind.DCHUNK, _DCHUNK.pack(pos, length))


def decode_dchunk(payload: bytes) -> DirectChunk:
    if len(payload) != _DCHUNK.size:
        raise ProtocolError(f"DCHUNK payload has {len(payload)} bytes, expected {_DCHUNK.size}")
    return DirectChunk(*_DCHUNK.unpack(payload))


def encode_direct(seq: int, nbytes: int, regions: tuple[tuple[int, int], ...]) -> bytes:
    if len(regions) > MAX_REGIONS:
        raise ValueError(f"a DIRECT offer carries at most {MAX_REGIONS} regions, got {len(regions)}")
    return encode(Kind.DIRECT, _DIRECT.pack(seq, nbytes, len(regions)) + b"".join(_REGION.pack(a, n) for a, n in regions))


def decode_direct(payload: bytes) -> Direct:
    if len(payload) < _DIRECT.size:
        raise ProtocolError(f"DIRECT payload has {len(payload)} bytes, fewer than the fixed {_DIRECT.size}")
    seq, nbytes, count = _DIRECT.unpack_from(payload)
    if len(payload) != _DIRECT.size + _REGION.size * count:
        raise ProtocolError(f"DIRECT payload has {len(payload)} bytes, but {count} regions need "
                            f"{_DIRECT.size + _REGION.size * count}")
    regions = tuple(_REGION.unpack_from(payload, _DIRECT.size + _REGION.size * i) for i in range(count))
    if any(addr == 0 or n == 0 for addr, n in regions):
        raise ProtocolError("DIRECT offers an empty region")
    if regions and sum(n for _, n in regions) != nbytes:
        raise ProtocolError(f"DIRECT regions hold {sum(n for _, n in regions)} bytes for a tensor of {nbytes}")
    return Direct(seq, nbytes, regions)


def _dtype_code(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    code = DTYPE_TO_CODE.get(dtype)
    if code is None:
        raise TypeError(f"dtype {dtype} cannot be sent through the pipe (supported: {sorted(map(str, DTYPE_TO_CODE))})")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensor has {len(shape)} dimensions; the pipe carries at most {MAX_NDIM}")
    return code


def encode_tensor(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> bytes:
    payload = _TENSOR_HEAD.pack(_dtype_code(dtype, shape), len(shape), nbytes) + struct.pack(f"!{len(shape)}Q", *shape)
    return encode(Kind.TENSOR, payload)


def encode_tensor_inline(dtype: torch.dtype, shape: tuple[int, ...], data: bytes) -> bytes:
    if len(data) > MAX_INLINE:
        raise ValueError(f"an inline tensor carries at most {MAX_INLINE} bytes, got {len(data)}")
    head = _TENSOR_HEAD.pack(_dtype_code(dtype, shape), len(shape), len(data)) + struct.pack(f"!{len(shape)}Q", *shape)
    return encode(Kind.TENSOR_INLINE, head + data)


def _check_shape(code: int, shape: tuple[int, ...], nbytes: int, max_nbytes: int, limit: str) -> torch.dtype:
    dtype = CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise ProtocolError(f"unknown dtype code {code}")
    numel = math.prod(shape)
    if numel * dtype.itemsize != nbytes:
        raise ProtocolError(f"TENSOR shape {list(shape)} of {dtype} needs {numel * dtype.itemsize} bytes, header says {nbytes}")
    if nbytes > max_nbytes:
        raise ProtocolError(f"TENSOR of {nbytes} bytes exceeds {limit}={max_nbytes}; raise {limit} "
                            "in mooncake.json if this is intended")
    if any(d > max(max_nbytes, 1) for d in shape):  # no dimension of an allowed tensor is longer (even an empty one)
        raise ProtocolError(f"TENSOR shape {list(shape)[:8]} has a dimension beyond {limit}={max_nbytes}")
    return dtype


def decode_tensor(payload: bytes, max_nbytes: int) -> TensorHeader:
    """Parse and validate a TENSOR frame: known dtype, consistent shape and size, within ``max_nbytes``."""
    fixed = _TENSOR_HEAD.size
    if len(payload) < fixed:
        raise ProtocolError(f"TENSOR payload has {len(payload)} bytes, fewer than the fixed {fixed}")
    code, ndim, nbytes = _TENSOR_HEAD.unpack_from(payload)
    if ndim > MAX_NDIM or len(payload) != fixed + 8 * ndim:
        raise ProtocolError(f"TENSOR payload has {len(payload)} bytes, but ndim={ndim} needs {fixed + 8 * ndim}")
    shape = struct.unpack_from(f"!{ndim}Q", payload, fixed)
    dtype = _check_shape(code, shape, nbytes, max_nbytes, "max_tensor_size")
    return TensorHeader(dtype, tuple(shape), nbytes)


def decode_tensor_inline(payload: bytes | bytearray, max_inline: int) -> TensorHeader:
    """Parse and validate a TENSOR_INLINE frame; its data must be exactly the tensor's bytes, within ``max_inline``."""
    if len(payload) < _TENSOR_HEAD.size:
        raise ProtocolError(f"TENSOR_INLINE payload has {len(payload)} bytes, fewer than the fixed {_TENSOR_HEAD.size}")
    code, ndim, nbytes = _TENSOR_HEAD.unpack_from(payload)
    start = _TENSOR_HEAD.size + 8 * ndim
    if ndim > MAX_NDIM or len(payload) != start + nbytes:
        raise ProtocolError(f"TENSOR_INLINE payload has {len(payload)} bytes, but ndim={ndim} and nbytes={nbytes} "
                            f"need {start + nbytes}")
    shape = struct.unpack_from(f"!{ndim}Q", payload, _TENSOR_HEAD.size)
    dtype = _check_shape(code, shape, nbytes, max_inline, "inline_max")
    return TensorHeader(dtype, tuple(shape), nbytes, memoryview(payload)[start:])


def recv_exact(sock: socket.socket, n: int, keep_waiting: Callable[[], bool] | None = None,
               deadline: float | None = None) -> bytes:
    """Read exactly n bytes; EOF before that raises ConnectionError.

    On a socket timeout: re-raise ``socket.timeout`` unless ``keep_waiting()`` says to go on waiting (a reader
    thread idling between frames, or inside a frame from a slow peer, must not lose the bytes it already has).
    ``deadline`` (a ``time.monotonic()`` value): ``TimeoutError`` once it passes, however the bytes trickle in.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{got} of {n} bytes arrived before the deadline")
            sock.settimeout(remaining)
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            if keep_waiting is not None and keep_waiting():
                continue
            raise
        if k == 0:
            raise ConnectionError("connection closed by peer" if got == 0 else f"connection closed mid-frame ({got}/{n} bytes)")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, keep_waiting: Callable[[], bool] | None = None,
               deadline: float | None = None) -> tuple[Kind, bytes]:
    """Read and validate one frame; raises ProtocolError, ConnectionError or TimeoutError (see ``recv_exact``)."""
    kind, length = decode_header(recv_exact(sock, HEADER.size, keep_waiting, deadline))
    return kind, recv_exact(sock, length, keep_waiting, deadline) if length else b""
