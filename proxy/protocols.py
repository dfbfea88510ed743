"""What each request tells the instances (``--protocol``), and what the proxy learns from them to say it.

- ``ParamsProtocol``: vLLM's disaggregation protocol as this project's MooncakeConnector answers it; a push-mode
  consumer's pipe addresses, read from its /metrics (``push_target``), go on the prefill.
- ``BootstrapProtocol``: vLLM's built-in MooncakeConnector; a transfer id on both requests, and the decode names the
  prefill instance's bootstrap server and engine id (``bootstrap_engine_id``, from that server's /query).

Both build the ``kv_transfer_params`` that ``prefill_payload`` and ``decode_payload`` put on the two requests.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kv_connector.protocol import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    ENDPOINT_INFO,
    KV_ROLE_LABEL,
    PIPES_LABEL,
    PUSH_PROOF,
    PUSH_PROOF_LABEL,
    PUSH_TO,
    TRANSFER_MODE_LABEL,
)
from proxy.balancer import Upstream
from proxy.config import PREFILL
from proxy.errors import ProxyError

if TYPE_CHECKING:
    from proxy.app import Proxy

log = logging.getLogger(__name__)

METRICS_TOPIC = "metrics"  # Proxy.learn's topics: what an instance's /metrics say (see routing.InstanceInfo)
ENGINE_TOPIC = "engine"  # a prefill instance's engine id, from its bootstrap server


def prefill_payload(payload: dict[str, Any], chat: bool, kv_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill copy: one token, not streamed, with the protocol's kv_transfer_params; everything else
    unchanged."""
    copy = dict(payload)
    copy["max_tokens"] = 1
    if chat:
        copy["max_completion_tokens"] = 1
    copy["stream"] = False
    copy.pop("stream_options", None)
    copy["kv_transfer_params"] = dict(kv_params)
    return copy


def decode_payload(payload: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The original request plus the protocol's kv_transfer_params (where the KV waits)."""
    return {**payload, "kv_transfer_params": dict(kv_params)}


def json_answer(body: bytes) -> dict[str, Any] | None:
    """An upstream's answer as a JSON object, None if it is not one."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def answer_params(answer: dict[str, Any] | None) -> dict[str, Any] | None:
    """``kv_transfer_params`` of a prefill answer, None if absent or not an object."""
    params = answer.get("kv_transfer_params") if answer is not None else None
    return params if isinstance(params, dict) else None


def kv_transfer_params(body: bytes) -> dict[str, Any] | None:
    """``kv_transfer_params`` of a prefill answer, None if absent, not an object, or the body is not JSON."""
    return answer_params(json_answer(body))


NO_LOAD = {DO_REMOTE_PREFILL: False, DO_REMOTE_DECODE: False}  # a decode whose prefill was skipped (see the package
# docstring: our connector still looks for the prompt at its configured producer; vLLM's connectors load nothing)


def push_target(metrics: str) -> tuple[list[str], str] | None:
    """A decode instance's pipe addresses and their proof ("" without a secret) if its /metrics text says it runs
    our connector as a push-mode consumer."""
    lines = [line for line in metrics.splitlines() if line.startswith(ENDPOINT_INFO + "{")]
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            labels = sample.labels
            if (labels.get(KV_ROLE_LABEL) == "kv_consumer" and labels.get(TRANSFER_MODE_LABEL) == "push"
                    and labels.get(PIPES_LABEL)):
                return labels[PIPES_LABEL].split(","), labels.get(PUSH_PROOF_LABEL, "")
    return None


def push_address(metrics: str) -> list[str] | None:
    """The pipe addresses of ``push_target``."""
    target = push_target(metrics)
    return None if target is None else target[0]


def bootstrap_engine_id(answer: Any) -> str:
    """The engine id in a bootstrap server's ``/query`` answer ({dp_rank: {"engine_id", "worker_addr"}})."""
    entries = list(answer.values()) if isinstance(answer, dict) else []
    ids = {e.get("engine_id") for e in entries if isinstance(e, dict)}
    if len(ids) != 1 or not isinstance(engine_id := ids.pop(), str) or not engine_id:
        raise ValueError(f"expected one engine id in the bootstrap server's /query answer, got {answer!r:.200}")
    return engine_id


class ParamsProtocol:
    """vLLM's disaggregation protocol as our MooncakeConnector answers it (see the package docstring)."""

    def __init__(self, proxy: Proxy):
        self.proxy = proxy

    def new_transfer(self) -> None:
        return None

    async def prepare(self, prefill: Upstream) -> None:
        """Nothing to learn about the prefill instance: its answer says where the KV waits."""

    async def prefill_params(self, transfer: None, decode: Upstream) -> dict[str, Any]:
        params: dict[str, Any] = {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False}
        try:
            info = await self.proxy.learn(decode, self.proxy.instance_info, METRICS_TOPIC)
            target = info.push_target
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            log.debug("no push address from %s: %r", decode.url, error)  # it fails the decode too if it is down
            target = None
        # a decode instance that takes no push (or did not say) loads by pull: an empty list tells a push-mode
        # producer to keep the KV for it instead of pushing it to the consumer in its own mooncake.json
        params[PUSH_TO] = list(target[0]) if target else []
        if target and target[1]:
            params[PUSH_PROOF] = target[1]
        return params

    async def decode_params(self, transfer: None, prefill: Upstream,
                            answer: dict[str, Any] | None) -> dict[str, Any] | None:
        return answer



class BootstrapProtocol:
    """vLLM's built-in MooncakeConnector: a transfer id on both requests; the decode names the prefill instance's
    bootstrap server and engine id."""

    def __init__(self, proxy: Proxy):
        self.proxy = proxy

    def new_transfer(self) -> str:
        return uuid.uuid4().hex

    async def prepare(self, prefill: Upstream) -> None:
        """Learn the prefill instance's engine id before it prefills: if its bootstrap server cannot say, the request
        ends here (502), not after a prefill whose KV would wait for a decode that never comes."""
        await self._learned_engine_id(prefill)

    async def prefill_params(self, transfer: str, decode: Upstream) -> dict[str, Any]:
        return {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False, "transfer_id": transfer}

    async def decode_params(self, transfer: str, prefill: Upstream,
                            answer: dict[str, Any] | None) -> dict[str, Any] | None:
        engine_id = await self._learned_engine_id(prefill)  # the one it was prepared for, unless a retry moved it
        return {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, "transfer_id": transfer,
                "remote_engine_id": engine_id, "remote_bootstrap_addr": prefill.bootstrap}

    async def _learned_engine_id(self, prefill: Upstream) -> str:
        bootstrap = prefill.bootstrap
        try:
            return await self.proxy.learn(prefill, self._engine_id, ENGINE_TOPIC)
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            raise ProxyError(502, "upstream_error", f"the bootstrap server of {prefill.name} did not say its engine "
                             "id", PREFILL, prefill.name,
                             f"{bootstrap} ({error!r}) for {prefill.url}; check --bootstrap") from None

    async def _engine_id(self, prefill: Upstream) -> str:
        text = await self.proxy.get_text(prefill.bootstrap + "/query")
        return bootstrap_engine_id(json.loads(text))
