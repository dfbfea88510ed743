"""``kv_transfer_params``: what a request carries between the instances (vLLM's disaggregation protocol).

The proxy sends the prefill with ``{"do_remote_decode": true}`` and ``"mooncake_push_to"``: the consumer's pipe
address per TP rank if it takes pushed KV, else ``[]`` (a push-mode producer then keeps the KV for pull). The
producer's ``request_finished`` answers with ``producer_params``: where the KV waits. The proxy puts those on the
decode request; the consumer loads from exactly that producer. A request without them (a proxy that forwards none,
or prefill and decode sent by hand) loads from the producer named by mooncake.json's ``prefill_url``.

Params reach us from the network through the proxy: every field is checked (``ParamsError`` says which and why) and
a request with bad params is recomputed, never loaded from a guessed place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kv_pipe import ConfigError
from kv_pipe.config import join_host_port, parse_host_port

PIPE = "remote_pipe"  # the producer's pipe address per TP rank (rank i: element i)
ENGINE = "remote_engine_id"
TP_SIZE = "remote_tp_size"
REQUEST = "remote_request_id"
PUSH_TO = "mooncake_push_to"  # prefill, push mode: the consumer's pipe address per TP rank ([]: do not push)
MAX_RANKS = 1024


class ParamsError(ValueError):
    """``kv_transfer_params`` that cannot be used; the message names the field."""


def producer_params(addresses: list[str], engine_id: str, request_id: str) -> dict[str, Any]:
    """The answer of a producer's ``request_finished`` for a request that asked for remote decode."""
    return {"do_remote_prefill": True, "do_remote_decode": False, PIPE: list(addresses), ENGINE: engine_id,
            TP_SIZE: len(addresses), REQUEST: request_id}


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
    engine_id: str
    request_id: str


def remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The producer named by a decode request's params; None if they name none (load from the configured one). The
    producer may run another TP size than this instance (each rank reads the KV heads it holds from the producer
    ranks that hold them)."""
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
    return RemotePrefill(pipes, engine, request)


def push_targets(params: dict[str, Any] | None, tp_size: int) -> list[str] | None:
    """Producer, push mode: the consumer the proxy chose for this request (None: the configured one; an empty list:
    no push, the request's consumer loads by pull)."""
    if not params or PUSH_TO not in params:
        return None
    if params[PUSH_TO] == []:
        return []
    return _addresses(params[PUSH_TO], PUSH_TO, tp_size)
