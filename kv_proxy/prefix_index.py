"""What the proxy knows of the prompt prefixes each instance holds, without a tokenizer: ``Fingerprint`` (a request's
prompt as chained hashes of fixed-size chunks: one hash names a whole prefix), ``PrefixIndex`` (one instance's
chunks, LRU, bounded), ``CharsPerToken`` (calibrated from vLLM's ``usage.prompt_tokens``) and ``cache_info`` (an
instance's KV cache size from its /metrics). See docs/proxy.md#choosing-instances."""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

CHUNK_CHARS = 256  # characters per chunk of a text prompt (~64 tokens of English)
CHUNK_TOKENS = 64  # token ids per chunk of a prompt given as token ids (4 vLLM blocks of 16)
MAX_CHUNKS = 2048  # chunks hashed per request (~128k tokens): a huge prompt costs the proxy bounded work and memory
DEFAULT_CHARS_PER_TOKEN = 3.0  # before any calibration; below English's ~4: more tokens are assumed, fewer skipped
MIN_CHARS_PER_TOKEN, MAX_CHARS_PER_TOKEN = 1.0, 8.0  # calibration is clamped to these
DEFAULT_CACHE_TOKENS = 128 * 1024  # an instance that does not publish its cache size (a small GPU's KV cache)
CACHE_INFO = "vllm:cache_config_info"
START_TIME = "process_start_time_seconds"
_SALT = os.urandom(16)
_SEP = "\x1e"  # after each message of a chat


@dataclass(frozen=True)
class Fingerprint:
    """A request's prompt as the prefix index sees it: ``chunks`` (chained hashes, first chunk first), ``size`` (the
    whole prompt, in characters or tokens) and whether the unit is the token (exact) or the character (estimated)."""

    chunks: tuple[bytes, ...]
    size: int
    tokens: bool
    chat: bool

    @property
    def chunk_units(self) -> int:
        return CHUNK_TOKENS if self.tokens else CHUNK_CHARS


def _chain(seed: bytes, pieces: list[bytes]) -> tuple[bytes, ...]:
    hashes, previous = [], seed
    for piece in pieces:
        previous = hashlib.blake2b(piece, digest_size=8, key=previous).digest()
        hashes.append(previous)
    return tuple(hashes)


def fingerprint(payload: dict[str, Any], chat: bool) -> Fingerprint | None:
    """The prompt of a validated request (``validate.validate`` passed); None if it has none the index can use
    (``prompt_embeds``)."""
    model = payload.get("model") if isinstance(payload.get("model"), str) else ""
    seed = hashlib.blake2b(f"{'chat' if chat else 'text'}\0{model[:256]}".encode(), digest_size=16, key=_SALT).digest()
    if chat:
        try:
            text = "".join(json.dumps(m, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + _SEP
                           for m in payload["messages"])
        except (TypeError, ValueError, RecursionError):
            return None
    else:
        prompt = payload.get("prompt")
        if prompt is None:
            return None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            count = min(len(prompt) // CHUNK_TOKENS, MAX_CHUNKS)
            pieces = [",".join(map(str, prompt[i * CHUNK_TOKENS:(i + 1) * CHUNK_TOKENS])).encode() for i in range(count)]
            return Fingerprint(_chain(seed, pieces), len(prompt), True, chat)
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))
    count = min(len(text) // CHUNK_CHARS, MAX_CHUNKS)
    pieces = [text[i * CHUNK_CHARS:(i + 1) * CHUNK_CHARS].encode("utf-8", "surrogatepass") for i in range(count)]
    return Fingerprint(_chain(seed, pieces), len(text), False, chat)


class PrefixIndex:
    """The chunks one instance holds (those of the requests routed to it), least recently routed evicted first, at
    most ``capacity``. A request's first chunk is its most recent (a request's chunks are touched last to first), so
    an instance keeps a shared prefix longest, as vLLM's prefix cache does. A chunk is *pending* from the request's
    routing until the instance answered it (``confirm``): only then is its KV surely in the instance's cache."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 0)
        self._lru: OrderedDict[bytes, bool] = OrderedDict()  # chunk -> confirmed

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, chunks: tuple[bytes, ...], confirmed: bool = False) -> int:
        """How many of ``chunks``, from the first, this instance holds (``confirmed``: and has answered)."""
        held = 0
        for chunk in chunks:
            state = self._lru.get(chunk)
            if state is None or (confirmed and not state):
                break
            held += 1
        return held

    def add(self, chunks: tuple[bytes, ...]) -> None:
        for chunk in reversed(chunks[:self.capacity]):
            self._lru[chunk] = self._lru.get(chunk, False)
            self._lru.move_to_end(chunk)
        self._trim()

    def confirm(self, chunks: tuple[bytes, ...]) -> None:
        """The instance answered a request with these chunks: it has computed or loaded them."""
        for chunk in chunks:
            if chunk in self._lru:
                self._lru[chunk] = True

    def resize(self, capacity: int) -> None:
        self.capacity = max(capacity, 0)
        self._trim()

    def clear(self) -> None:
        self._lru.clear()

    def _trim(self) -> None:
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


class CharsPerToken:
    """Characters per token of the proxy's serialization, calibrated from the prompt sizes vLLM reports (a running
    mean, then an exponential one), clamped to [MIN_CHARS_PER_TOKEN, MAX_CHARS_PER_TOKEN]; ``low`` is the lowest
    ratio of the last ``LOW_WINDOW`` prompts (the most tokens a text of that many characters has been seen to hold),
    MIN_CHARS_PER_TOKEN (a character per token) before any."""

    LOW_WINDOW = 32

    def __init__(self) -> None:
        self.value = DEFAULT_CHARS_PER_TOKEN
        self.samples = 0
        self._recent: deque[float] = deque(maxlen=self.LOW_WINDOW)

    @property
    def low(self) -> float:
        return min(self._recent, default=MIN_CHARS_PER_TOKEN)

    def observe(self, chars: int, tokens: Any) -> None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0 or chars <= 0:
            return
        ratio = min(max(chars / tokens, MIN_CHARS_PER_TOKEN), MAX_CHARS_PER_TOKEN)
        self.samples += 1
        self.value += max(1.0 / self.samples, 0.05) * (ratio - self.value)
        self._recent.append(ratio)


@dataclass(frozen=True)
class CacheInfo:
    """What an instance's /metrics say about its KV cache and its process (a restart changes ``started``)."""

    tokens: int | None = None  # num_gpu_blocks * block_size
    started: float | None = None


def cache_info(metrics: str) -> CacheInfo:
    """``vllm:cache_config_info{num_gpu_blocks,block_size}`` and ``process_start_time_seconds`` of a /metrics text."""
    lines = [line for line in metrics.splitlines() if line.startswith((CACHE_INFO + "{", START_TIME + " "))]
    tokens = started = None
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except ValueError:
        return CacheInfo()
    for family in families:
        for sample in family.samples:
            if sample.name == START_TIME:
                started = sample.value
            elif sample.name == CACHE_INFO:
                blocks, size = sample.labels.get("num_gpu_blocks", ""), sample.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit() and int(blocks) * int(size) > 0:
                    tokens = int(blocks) * int(size)
    return CacheInfo(tokens, started)
