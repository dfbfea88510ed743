"""``kv_transfer_params``: what a request carries between the instances (vLLM's disaggregation protocol). A producer
answers with ``producer_params`` (where the KV waits, signed with a secret); ``decode_params`` reads what a decode
request's params ask of a consumer, ``push_targets`` where a producer pushes. Params come from the network: every
field is checked (``ParamsError`` names it) and, with a secret, only params whose proof verifies are used.

What the params ask of each side: docs/configuration.md (kv_transfer_params); the proofs: docs/deployment.md (Security).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from kv_connector.param_keys import (
    AWAIT_PUSH,
    DO_REMOTE_PREFILL,
    ENGINE,
    PIPE,
    POOL_ONLY,
    PROOF,
    PUSH_PROOF,
    PUSH_TO,
    PUSHED,
    REQUEST,
    TP_SIZE,
)
from kv_pipe import ConfigError, auth, join_host_port, parse_host_port

MAX_RANKS = 1024


class ParamsError(ValueError):
    """``kv_transfer_params`` that cannot be used; the message names the field."""


def producer_params(addresses: list[str], engine_id: str, request_id: str, secret: bytes = b"",
                    pushed: bool = False) -> dict[str, Any]:
    """The answer of a producer's ``request_finished`` for a request that asked for remote decode (signed if there is
    a secret). ``pushed``: the prompt went to the decoding consumer by push (or a notice to pull it did)."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, PIPE: list(addresses), ENGINE: engine_id,
              TP_SIZE: len(addresses), REQUEST: request_id}
    if pushed:
        params[PUSHED] = True
    if secret:
        params[PROOF] = _params_proof(secret, list(addresses), engine_id, request_id)
    return params


def _params_proof(secret: bytes, pipes: list[str], engine_id: str, request_id: str) -> str:
    return auth.proof(secret, "params", ",".join(pipes), engine_id, str(len(pipes)), request_id)


def push_proof(secret: bytes, pipes: list[str]) -> str:
    """A consumer's proof that ``pipes`` (its pipe address per TP rank) belong to the fleet ("" without a secret)."""
    return auth.proof(secret, "push-target", ",".join(pipes)) if secret else ""


def _check_proof(params: dict[str, Any], field: str, expected: str, what: str) -> None:
    given = params.get(field)
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), expected.encode()):
        raise ParamsError(f"{field}: {'missing' if given is None else 'does not verify'}: {what} is not proven to come "
                          "from an instance of this fleet (one that knows the secret)")


def _checked(params: Any) -> dict[str, Any]:
    """``params`` if a JSON object ({} for none)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params: expected a JSON object, got {type(params).__name__}")
    return params


def _addresses(value: Any, field: str, tp_size: int | None) -> list[str]:
    """``tp_size``: the number of addresses required (None: any)."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_RANKS:
        raise ParamsError(f"{field}: expected a list of \"host:port\" (one per TP rank), got {value!r:.200}")
    if tp_size is not None and len(value) != tp_size:
        raise ParamsError(f"{field}: {len(value)} pipe address(es) (TP {len(value)} on the other instance), but this "
                          f"instance runs TP {tp_size}: run both instances with the same tensor_parallel_size")
    try:
        return [join_host_port(*parse_host_port(a, field)) for a in value]
    except ConfigError as e:
        raise ParamsError(str(e)) from None


@dataclass(frozen=True)
class DecodeParams:
    """Consumer: what a decode request's params ask for (the keys: docs/configuration.md)."""

    load: bool = True  # False: load nothing (``do_remote_prefill: false``)
    pipes: list[str] | None = None  # the producer whose KV waits there, per its TP rank; None: mooncake.json's
    await_push: bool = False  # wait for whichever producer pushes this prompt (``pipes`` is None)
    pushed: bool = False  # the named producer pushes this prompt here (or says to pull it): wait for its news
    pool_only: bool = False  # no producer holds it: load what the KV pool holds (``mooncake_pool_only``)


def _flag(params: dict[str, Any], field: str) -> bool | None:
    """A true/false field (None: absent or null)."""
    value = params.get(field)
    if value is not None and not isinstance(value, bool):
        raise ParamsError(f"{field}: expected true or false, got {value!r:.100}")
    return value


def decode_params(params: dict[str, Any] | None, secret: bytes = b"") -> DecodeParams:
    """What a decode request's params ask of this consumer. A named producer may run another TP size than this
    instance (each rank reads the KV heads it holds from the producer ranks that hold them). With a secret the params
    naming a producer must carry its proof."""
    params = _checked(params)
    remote, await_push = _flag(params, DO_REMOTE_PREFILL), _flag(params, AWAIT_PUSH)
    if await_push and not remote:
        raise ParamsError(f"{AWAIT_PUSH}: true needs {DO_REMOTE_PREFILL}: true (got {remote!r})")
    if remote is False:
        return DecodeParams(load=False)
    if _flag(params, POOL_ONLY):
        if not remote or await_push or PIPE in params:
            raise ParamsError(f"{POOL_ONLY}: true goes with {DO_REMOTE_PREFILL}: true only (no producer named, no push "
                              "awaited)")
        return DecodeParams(pool_only=True)
    if await_push:
        if PIPE in params:  # a producer's answer and a wait for a push: which one is meant cannot be told
            raise ParamsError(f"{AWAIT_PUSH} and {PIPE} together: a decode either names the producer whose KV waits "
                              "or awaits a push, not both")
        return DecodeParams(await_push=True)
    if not remote or PIPE not in params:  # no producer named (e.g. another connector's params)
        return DecodeParams()
    remote_tp = params.get(TP_SIZE)
    if remote_tp is not None and (isinstance(remote_tp, bool) or not isinstance(remote_tp, int)):
        raise ParamsError(f"{TP_SIZE}: expected an integer, got {remote_tp!r:.100}")
    pipes = _addresses(params[PIPE], PIPE, None)
    if remote_tp is not None and remote_tp != len(pipes):
        raise ParamsError(f"{TP_SIZE} is {remote_tp} but {PIPE} names {len(pipes)} pipe address(es)")
    engine, request = params.get(ENGINE, ""), params.get(REQUEST, "")
    if not isinstance(engine, str) or not isinstance(request, str) or len(engine) > 256 or len(request) > 1024:
        raise ParamsError(f"{ENGINE} and {REQUEST} must be short strings")
    if secret:
        _check_proof(params, PROOF, _params_proof(secret, pipes, engine, request), f"the producer at {pipes[0]}")
    # not covered by the proof: a client that sets it only makes its own load wait for news (up to load_timeout)
    return DecodeParams(pipes=pipes, pushed=bool(_flag(params, PUSHED)))


def push_targets(params: dict[str, Any] | None, tp_size: int, secret: bytes = b"") -> list[str] | None:
    """Producer, push mode: the consumer the proxy chose for this request (None: the configured one; an empty list:
    no push, the request's consumer loads by pull). With a secret the consumer's proof must come with it."""
    params = _checked(params)
    if not params or PUSH_TO not in params:
        return None
    if params[PUSH_TO] == []:
        return []
    pipes = _addresses(params[PUSH_TO], PUSH_TO, tp_size)
    if secret:
        _check_proof(params, PUSH_PROOF, push_proof(secret, pipes), f"the push target {pipes[0]}")
    return pipes
