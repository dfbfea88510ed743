"""An upstream's streamed (SSE) answer relayed to the client chunk by chunk: ``StreamRelay``."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable

import aiohttp

from kv_proxy.config import DECODE
from kv_proxy.errors import ProxyError

log = logging.getLogger(__name__)

SSE_CONTENT_TYPE = "text/event-stream"
PARTIAL_MAX = 1 << 20  # bytes of an unfinished event held back at most


def _last_boundary(data: bytes) -> int:
    """Where the last complete SSE event of ``data`` ends (after its blank line); 0 if none is complete."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class StreamRelay:
    """Async iterator over an upstream SSE body, relayed chunk by chunk; frees the upstream when closed.

    Closing before the end (client disconnect, error) closes the upstream connection, which makes vLLM abort the
    request. ``close()`` is idempotent and also runs on garbage collection, so the counter is always released.
    """

    def __init__(self, response: aiohttp.ClientResponse, release: Callable[[], None], request_id: str,
                 on_end: Callable[[], None] | None = None, on_chunk: Callable[[], None] | None = None,
                 first: bytes = b""):
        self._response = response
        self._first = first  # what was read of the stream already (``first_event``): relayed first
        self._partial = b""  # the start of an event whose end has not come yet
        self._on_end = on_end  # called once the whole stream came through
        self._on_chunk = on_chunk  # called as each chunk comes
        self._release: Callable[[], None] | None = release
        self._request_id = request_id
        self._done = False

    def __aiter__(self) -> StreamRelay:
        return self

    async def __anext__(self) -> bytes:
        """The next whole events: what came up to the last event boundary (a part of an event waits for its end, so
        an error event never lands in the middle of one)."""
        if self._done:
            self.close()
            raise StopAsyncIteration
        data, self._partial, self._first = self._partial + self._first, b"", b""
        while True:
            cut = _last_boundary(data)
            if cut > 0 or len(data) > PARTIAL_MAX:  # (an "event" that never ends is passed on as it is)
                cut = cut if cut > 0 else len(data)
                self._partial = data[cut:]
                if self._on_chunk is not None:
                    self._on_chunk()
                return data[:cut]
            try:
                chunk = await self._response.content.readany()
            except (TimeoutError, aiohttp.ClientError) as error:
                kind = "upstream_timeout" if isinstance(error, TimeoutError) else "upstream_error"
                log.warning("[%s] decode stream from %s broken: %r", self._request_id, self._response.url, error)
                self._done = True
                self.close(reuse=False)
                failure = ProxyError(504 if kind == "upstream_timeout" else 502, kind, "decode stream interrupted",
                                     DECODE)
                return f"data: {json.dumps(failure.payload())}\n\n".encode()  # the broken event's part is dropped
            if not chunk:
                self.close(reuse=True)
                if self._on_end is not None:
                    self._on_end()
                if data:  # the stream ended in the middle of an event: pass on what came (its end is the end)
                    self._done = True
                    return data
                raise StopAsyncIteration
            data += chunk

    async def aclose(self) -> None:
        self.close()

    def close(self, reuse: bool = False) -> None:
        if self._release is None:
            return
        release, self._release = self._release, None
        if reuse:
            self._response.release()
        else:
            self._response.close()
        release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # e.g. the event loop is already closed
            self.close()


FIRST_EVENT_MAX = 64 << 10  # bytes of a stream read before its first token (an error event is far smaller)


def _events(data: bytes) -> list[bytes]:
    """The complete SSE events at the start of ``data`` (each a block of lines ending in a blank line)."""
    blocks = data.replace(b"\r\n", b"\n").split(b"\n\n")
    return blocks[:-1]  # the last one is not complete (or empty)


def _payload(event: bytes) -> object:
    """The JSON of an event's ``data:`` line (None if it has none, or it is not JSON, e.g. ``[DONE]``)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                return json.loads(line[5:])
            except (ValueError, UnicodeDecodeError, RecursionError):
                return None
    return None


def _says_nothing(event: bytes) -> bool:
    """An event before the first token that carries none: a comment, or a chat stream's opening role delta (vLLM
    sends it before anything is computed, so a request that fails in the engine, e.g. its KV load, streams it
    before its error)."""
    payload = _payload(event)
    if payload is None:
        return not any(line.startswith(b"data:") for line in event.split(b"\n"))  # comments, keep-alives
    if not isinstance(payload, dict) or "error" in payload:
        return False
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return False
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content") \
                or set(delta) - {"role", "content"}:
            return False
    return True


async def first_event(response: aiohttp.ClientResponse) -> bytes:
    """The start of an SSE body up to the end of its first event that says something (past a chat stream's opening
    role delta and comments), or its end, or ``FIRST_EVENT_MAX`` bytes: what ``error_event`` looks at; relayed
    first after that (``StreamRelay(first=...)``)."""
    data = b""
    while len(data) < FIRST_EVENT_MAX:
        events = _events(data)
        if events and not all(_says_nothing(event) for event in events):
            break
        chunk = await response.content.readany()
        if not chunk:
            break
        data += chunk
    return data


def error_event(data: bytes) -> str | None:
    """If the SSE stream starting with ``data`` says nothing before an error event (``data: {"error": ...}``, as vLLM
    sends one for a request that failed, e.g. its KV load) carrying a server error (a code of 500 or more, or none),
    the reason to count it under; else None (a token, or a client error the retry would meet again)."""
    for event in _events(data):
        if _says_nothing(event):
            continue
        payload = _payload(event)
        error = payload.get("error") if isinstance(payload, dict) else None
        if not isinstance(error, dict):
            return None
        code = error.get("code")
        if isinstance(code, int) and not isinstance(code, bool):
            return None if code < 500 else f"stream_error_{code}"
        return "stream_error"
    return None


KEPT = 1 << 20  # bytes of a relayed answer kept to read its usage from (if it is no larger)


class BodyRelay:
    """Async iterator over an upstream's (non-streamed) answer, relayed chunk by chunk; ``done(body)`` once it ended
    (``body``: the whole answer if at most ``KEPT`` bytes and complete, else None). Closing early closes the
    upstream connection."""

    def __init__(self, response: aiohttp.ClientResponse, done: Callable[[bytes | None], None], request_id: str):
        self._response = response
        self._done: Callable[[bytes | None], None] | None = done
        self._request_id = request_id
        self._kept: list[bytes] | None = []
        self._size = 0

    def __aiter__(self) -> BodyRelay:
        return self

    async def __anext__(self) -> bytes:
        if self._done is None:
            raise StopAsyncIteration
        try:
            chunk = await self._response.content.readany()
        except (TimeoutError, aiohttp.ClientError) as error:
            log.warning("[%s] answer from %s broken: %r", self._request_id, self._response.url, error)
            self.close()
            raise StopAsyncIteration from None
        if not chunk:
            self.close(complete=True)
            raise StopAsyncIteration
        self._size += len(chunk)
        if self._kept is not None and self._size <= KEPT:
            self._kept.append(chunk)
        else:
            self._kept = None
        return chunk

    async def aclose(self) -> None:
        self.close()

    def close(self, complete: bool = False) -> None:
        if self._done is None:
            return
        done, self._done = self._done, None
        if complete:
            self._response.release()
        else:
            self._response.close()
        done(b"".join(self._kept) if complete and self._kept is not None else None)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
