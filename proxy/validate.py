"""A client's request checked before anything goes upstream, as vLLM would check it: a request vLLM would refuse gets
a 400 here, not after a prefill whose KV would then wait for nobody."""

from __future__ import annotations

import json
from typing import Any

from proxy.errors import ProxyError

MAX_COUNT = 2**31 - 1  # max_tokens, n: vLLM fails on larger ones only after the prefill ran


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 if it is not one."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProxyError(400, "invalid_request_error", f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ProxyError(400, "invalid_request_error", "request body is nested too deeply") from None
    if not isinstance(payload, dict):
        raise ProxyError(400, "invalid_request_error", "request body must be a JSON object")
    return payload


TRUE_WORDS = {"true", "t", "yes", "y", "on", "1"}  # what vLLM's request model (pydantic, lax mode) takes as a bool
FALSE_WORDS = {"false", "f", "no", "n", "off", "0"}


def as_bool(value: Any, field: str) -> bool:
    """``value`` read as vLLM reads a boolean field (true, "true", 1, "on", ...); 400 if it is none of them."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ProxyError(400, "invalid_request_error", f"{field} must be a boolean, got {value!r:.100}")


def _positive_int(payload: dict[str, Any], field: str) -> None:
    """An integer >= 1 as vLLM's request model reads one (lax: 16, "16" and 16.0 are all 16), or absent."""
    value = payload.get(field)
    if value is None:
        return
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        number = int(value.strip())
    if number is None or not 1 <= number <= MAX_COUNT:
        raise ProxyError(400, "invalid_request_error", f"{field} must be an integer from 1 to {MAX_COUNT}, got "
                         f"{value!r:.100}")


def validate(payload: dict[str, Any], chat: bool) -> bool:
    """Refuse, before anything is sent upstream, a request vLLM would refuse (a refused decode after a prefill
    leaves the prefill's KV waiting for nobody). Returns whether the answer is streamed."""
    if chat:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ProxyError(400, "invalid_request_error", "messages must be a non-empty list of message objects")
    elif payload.get("prompt_embeds") is None:
        prompt = payload.get("prompt")
        valid = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            or all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                   for p in prompt)))
        if not valid:
            raise ProxyError(400, "invalid_request_error", "prompt must be a string, a list of strings, a list of "
                             "token ids or a list of lists of token ids")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        _positive_int(payload, name)
    if payload.get("model") is not None and not isinstance(payload["model"], str):
        raise ProxyError(400, "invalid_request_error", "model must be a string")
    stream = as_bool(payload["stream"], "stream") if payload.get("stream") is not None else False
    if payload.get("stream_options") is not None and not stream:
        raise ProxyError(400, "invalid_request_error", "stream_options can only be given with stream=true")
    return stream
