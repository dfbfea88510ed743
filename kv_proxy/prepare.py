"""A client's request made ready to go upstream: parsed, checked (``validate``), fingerprinted (``prefix_index``) and
written again compactly as the decode's and the prefill's bodies (``Prepared``), so the event loop only splices the
protocol's ``kv_transfer_params`` into bytes (``with_params``). ``Preparer`` parses large bodies in worker processes
(``json`` holds the GIL: a thread would stall every client); ``BodyBudget`` bounds the bodies held at once."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from kv_proxy.errors import ProxyError
from kv_proxy.prefix_index import Fingerprint, fingerprint
from kv_proxy.protocols import prefill_payload
from kv_proxy.validate import parse_json_object, validate

INLINE_MAX = 64 << 10  # bytes: bodies up to this are prepared on the event loop (~5 ms at worst)
MAX_CONTAINERS = 1 << 18  # JSON arrays and objects in a body (a chat of 1,000 messages holds ~2,000)
_COMPACT = {"separators": (",", ":"), "ensure_ascii": False, "allow_nan": False}


@dataclass(frozen=True)
class Prepared:
    """A checked request: ``body`` (the client's, without ``kv_transfer_params``) and ``prefill`` (the prefill's
    copy of it), compact JSON objects; what routing needs to know of it."""

    body: bytes
    prefill: bytes
    stream: bool
    hint: Fingerprint | None
    output_tokens: int | None
    dropped_params: bool  # the client sent kv_transfer_params (only the proxy sets them): dropped


def output_tokens(payload: dict[str, Any]) -> int | None:
    """The tokens a request asks for at most (``max_tokens``, or a chat request's ``max_completion_tokens``), if it
    says (validated by then)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = payload.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def prepare(raw: bytes, chat: bool) -> Prepared:
    """``raw`` checked and written again; ``ProxyError`` (400) if the request is one vLLM would refuse."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_CONTAINERS:
        raise ProxyError(400, "invalid_request_error", f"request body holds {containers} JSON arrays and objects (or "
                         f"brackets in its strings); at most {MAX_CONTAINERS}")
    payload = parse_json_object(raw)
    stream = validate(payload, chat)
    dropped = "kv_transfer_params" in payload
    payload.pop("kv_transfer_params", None)
    return Prepared(_compact(payload), _compact(prefill_payload(payload, chat)), stream,
                    fingerprint(payload, chat), output_tokens(payload), dropped)


def _compact(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, **_COMPACT).encode()  # type: ignore[arg-type]


def with_params(body: bytes, params: dict[str, Any] | None) -> bytes:
    """``body`` (a compact JSON object from ``prepare``) with ``"kv_transfer_params": params`` added (None: as is)."""
    if params is None:
        return body
    added = json.dumps({"kv_transfer_params": params}, **_COMPACT).encode()  # type: ignore[arg-type]
    return added if body == b"{}" else body[:-1] + b"," + added[1:]


def _prepare_in_worker(raw: bytes, chat: bool) -> Prepared | tuple[int, str, str]:
    """``prepare`` in a worker process: a refusal comes back as data (status, kind, message)."""
    try:
        return prepare(raw, chat)
    except ProxyError as error:
        return error.status, error.kind, str(error)


class Preparer:
    """Runs ``prepare``: inline for small bodies, in ``workers`` processes for the others."""

    def __init__(self, workers: int = 2) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    async def __call__(self, raw: bytes, chat: bool) -> Prepared:
        if len(raw) <= INLINE_MAX:
            return prepare(raw, chat)
        if self._pool is None:
            # spawn: the proxy's threads (the gate's, aiohttp's) must not be forked
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._pool, _prepare_in_worker, raw, chat)
        except BrokenProcessPool:  # a worker died (e.g. killed for memory): a new pool for the next request
            self._pool = None
            raise ProxyError(503, "server_busy", "the proxy could not prepare the request; try again") from None
        if isinstance(result, tuple):
            raise ProxyError(*result)
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class BodyBudget:
    """At most ``limit`` bytes of request bodies held at once (``take`` before a body is read, ``give`` when its
    request ended)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

    def take(self, nbytes: int) -> bool:
        if self.held + nbytes > self.limit and self.held:
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.held -= nbytes
