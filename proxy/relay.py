"""An upstream's streamed (SSE) answer relayed to the client chunk by chunk: ``StreamRelay``."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable

import aiohttp

from proxy.config import DECODE
from proxy.errors import ProxyError

log = logging.getLogger(__name__)

SSE_CONTENT_TYPE = "text/event-stream"


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
        self._on_end = on_end  # called once the whole stream came through
        self._on_chunk = on_chunk  # called as each chunk comes
        self._release: Callable[[], None] | None = release
        self._request_id = request_id
        self._done = False

    def __aiter__(self) -> StreamRelay:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            self.close()
            raise StopAsyncIteration
        if self._first:
            chunk, self._first = self._first, b""
            if self._on_chunk is not None:
                self._on_chunk()
            return chunk
        try:
            chunk = await self._response.content.readany()
        except (TimeoutError, aiohttp.ClientError) as error:
            kind = "upstream_timeout" if isinstance(error, TimeoutError) else "upstream_error"
            log.warning("[%s] decode stream from %s broken: %r", self._request_id, self._response.url, error)
            self._done = True
            self.close(reuse=False)
            failure = ProxyError(504 if kind == "upstream_timeout" else 502, kind, "decode stream interrupted", DECODE)
            return f"data: {json.dumps(failure.payload())}\n\n".encode()
        if not chunk:
            self.close(reuse=True)
            if self._on_end is not None:
                self._on_end()
            raise StopAsyncIteration
        if self._on_chunk is not None:
            self._on_chunk()
        return chunk

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


FIRST_EVENT_MAX = 64 << 10  # bytes of a stream read to find its first event (an error event is far smaller)


async def first_event(response: aiohttp.ClientResponse) -> bytes:
    """The start of an SSE body up to the end of its first event (or its end, or ``FIRST_EVENT_MAX`` bytes): what
    ``error_event`` looks at; relayed first after that (``StreamRelay(first=...)``)."""
    data = b""
    while b"\n\n" not in data and b"\r\n\r\n" not in data and len(data) < FIRST_EVENT_MAX:
        chunk = await response.content.readany()
        if not chunk:
            break
        data += chunk
    return data


def error_event(data: bytes) -> str | None:
    """If the SSE stream starting with ``data`` starts with an error event (``data: {"error": ...}``, as vLLM sends
    one for a request that failed, e.g. its KV load) carrying a server error (a code of 500 or more, or none), the
    reason to count it under; else None (a token, or a client error the retry would meet again)."""
    line = data.split(b"\n", 1)[0].strip()
    if not line.startswith(b"data:"):
        return None
    try:
        event = json.loads(line[5:])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    error = event.get("error") if isinstance(event, dict) else None
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and code < 500:
        return None
    return f"stream_error_{code}" if isinstance(code, int) and not isinstance(code, bool) else "stream_error"
