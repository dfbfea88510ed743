"""A client's request checked before anything goes upstream, as vLLM would check it: a request vLLM would refuse gets
a 400 here, not after a prefill whose KV would then wait for nobody."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from kv_proxy.errors import ProxyError

MAX_COUNT = 2**31 - 1  # max_tokens: vLLM fails on larger ones only after the prefill ran
MAX_SEQUENCES = 128  # n, best_of: sequences decoded for one prompt (each one is a whole decode on the instance)
MAX_REQUEST_ID = 128  # characters of an X-Request-Id the proxy passes on (vLLM refuses much longer ones with a 400)
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:@/+=-]{{1,{MAX_REQUEST_ID}}}")


class _NonFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: Python reads it as inf, and json.dumps would send "Infinity" upstream
        raise _NonFinite(f"number {text[:40]} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise _NonFinite(f"{name} is not a JSON number")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 if it is not one, or if it holds a number JSON cannot carry (NaN,
    Infinity, or one that overflows a double): forwarded, it would reach vLLM as "NaN" or "Infinity"."""
    try:
        payload = json.loads(body, parse_float=_finite_float, parse_constant=_no_constant)
    except _NonFinite as error:
        raise ProxyError(400, "invalid_request_error", f"request body holds a non-finite number: {error}") from None
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


def request_id(header: str | None) -> str | None:
    """A client's ``X-Request-Id`` if the proxy may pass it on (at most ``MAX_REQUEST_ID`` characters of letters,
    digits and ``._:@/+=-``); None: the proxy makes a fresh one."""
    return header if header is not None and _REQUEST_ID.fullmatch(header) else None


def _positive_int(payload: dict[str, Any], field: str, most: int = MAX_COUNT) -> None:
    """An integer from 1 to ``most`` as vLLM's request model reads one (lax: 16, "16" and 16.0 are all 16), or
    absent."""
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
    if number is None or not 1 <= number <= most:
        raise ProxyError(400, "invalid_request_error", f"{field} must be an integer from 1 to {most}, got "
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
    for name in ("max_tokens", "max_completion_tokens"):
        _positive_int(payload, name)
    for name in ("n", "best_of"):
        _positive_int(payload, name, MAX_SEQUENCES)
    if payload.get("model") is not None and not isinstance(payload["model"], str):
        raise ProxyError(400, "invalid_request_error", "model must be a string")
    stream = as_bool(payload["stream"], "stream") if payload.get("stream") is not None else False
    if payload.get("stream_options") is not None and not stream:
        raise ProxyError(400, "invalid_request_error", "stream_options can only be given with stream=true")
    return stream
