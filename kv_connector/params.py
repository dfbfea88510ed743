"""``kv_transfer_params``: what a request carries between the instances (vLLM's disaggregation protocol).

The proxy sends the prefill with ``{"do_remote_decode": true}`` and ``"mooncake_push_to"``: the consumer's pipe
address per TP rank if it takes pushed KV, else ``[]`` (a push-mode producer then keeps the KV for pull). The
producer's ``request_finished`` answers with ``producer_params``: where the KV waits. The proxy puts those on the
decode request; the consumer loads from exactly that producer. A request without them (a proxy that forwards none,
or prefill and decode sent by hand) loads from the producer named by mooncake.json's ``prefill_url``.

Params reach us from the network through the proxy: every field is checked (``ParamsError`` says which and why) and
a request with bad params is recomputed, never loaded from a guessed place. With a secret (mooncake.json's
``auth_secret`` or ``MOONCAKE_KV_SECRET``) nobody outside the fleet can name where KV comes from or goes to: the
producer signs the params it answers with (``mooncake_proof``, an HMAC under the secret of the pipes, engine id, TP
size and request id) and a consumer loads only from params whose proof verifies; a consumer publishes a proof of its
push address beside it on /metrics, which the proxy passes on (``mooncake_push_proof``) and a producer checks before
it pushes. Proofs can be replayed, but only to name the same genuine instances.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from kv_connector.protocol import ENGINE, PIPE, PROOF, PUSH_PROOF, PUSH_TO, REQUEST, TP_SIZE
from kv_pipe import ConfigError, auth
from kv_pipe.config import join_host_port, parse_host_port

MAX_RANKS = 1024


class ParamsError(ValueError):
    """``kv_transfer_params`` that cannot be used; the message names the field."""


def producer_params(addresses: list[str], engine_id: str, request_id: str, secret: bytes = b"") -> dict[str, Any]:
    """The answer of a producer's ``request_finished`` for a request that asked for remote decode (signed if there is
    a secret)."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, PIPE: list(addresses), ENGINE: engine_id,
              TP_SIZE: len(addresses), REQUEST: request_id}
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
class RemotePrefill:
    """Consumer: a producer prefilled this request; its KV waits at ``pipes[rank]``."""

    pipes: list[str]


def remote_prefill(params: dict[str, Any] | None, secret: bytes = b"") -> RemotePrefill | None:
    """The producer named by a decode request's params; None if they name none (load from the configured one). The
    producer may run another TP size than this instance (each rank reads the KV heads it holds from the producer
    ranks that hold them). With a secret the params must carry the producer's proof."""
    params = _checked(params)
    if not params or not params.get("do_remote_prefill") or PIPE not in params:
        return None
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
    return RemotePrefill(pipes)


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
