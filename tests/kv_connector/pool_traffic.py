"""What the KV pool's tests send and read: a completion with its token ids (a conversation's next turn carries the
answer's tokens), a wait for a pool counter to move (a pool save ends after its request), the blocks a request
leaves to store."""

from __future__ import annotations

import time

from harness.vllm import VllmServer
from tests.kv_connector.instance_stats import diff, flush, kv_stats
from tests.kv_connector.instances import BLOCK


def turn(server: VllmServer, tokens: list[int], max_tokens: int = 24, cache_salt: str | None = None
         ) -> tuple[str, list[int]]:
    """One completion: its text and its token ids (``cache_salt``: vLLM's, which the pool leaves alone)."""
    body = {"model": server.model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, **({"cache_salt": cache_salt} if cache_salt else {})}
    choice = server.post("/v1/completions", body)["choices"][0]
    return choice["text"], choice["token_ids"]


def settled(server: VllmServer, before: dict[str, float], name: str, at_least: float, timeout: float = 10.0
            ) -> dict[str, float]:
    """The change in the instance's stats once ``name`` grew by ``at_least`` (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        flush(server)
        change = diff(kv_stats(server), before)
        if change.get(name, 0) >= at_least or time.monotonic() > deadline:
            return change
        time.sleep(0.1)


def stored_blocks(tokens: int) -> int:
    """Whole blocks of computed KV a request of ``tokens`` (prompt and answer) leaves: all but its last token's."""
    return (tokens - 1) // BLOCK
