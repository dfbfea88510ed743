"""What each request tells the instances (``--protocol``): ``ParamsProtocol`` (vLLM's disaggregation protocol as this
project's MooncakeConnector answers it, with push targets) and ``BootstrapProtocol`` (vLLM's built-in
MooncakeConnector: a transfer id, the prefill's bootstrap server and engine id). See docs/proxy.md#protocols."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import aiohttp

from kv_connector.param_keys import AWAIT_PUSH, DO_REMOTE_DECODE, DO_REMOTE_PREFILL, POOL_ONLY, PUSH_PROOF, PUSH_TO
from kv_proxy.balancer import Upstream
from kv_proxy.config import PREFILL
from kv_proxy.discovery import Discovery
from kv_proxy.errors import ProxyError

log = logging.getLogger(__name__)

ENGINE_TOPIC = "engine"  # Discovery.learn's topic for a prefill instance's engine id, from its bootstrap server


def prefill_payload(payload: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill copy: one token of one sequence, not streamed, without kv_transfer_params (``with_params`` adds
    the protocol's); everything else unchanged."""
    copy = dict(payload)
    copy["max_tokens"] = 1
    if chat:
        copy["max_completion_tokens"] = 1
    copy["n"] = 1  # one sequence: the prefill's KV is the prompt's, whatever the decode asks for
    copy.pop("best_of", None)
    copy["stream"] = False
    copy.pop("stream_options", None)
    copy.pop("kv_transfer_params", None)
    return copy


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


NO_LOAD = {DO_REMOTE_PREFILL: False, DO_REMOTE_DECODE: False}  # a decode whose prefill was skipped: it loads nothing
POOL_ONLY_LOAD = {DO_REMOTE_PREFILL: True, POOL_ONLY: True}  # a decode whose prefill was skipped, sent to a KV pool
# member: no producer holds the prompt, it loads what the pool holds and computes the rest


def loads_kv(params: dict[str, Any] | None) -> bool:
    """Whether a decode sent with ``params`` loads its prompt's KV (else it computes the prompt itself); a pool-only
    decode does (its load from the pool can fail as any other)."""
    return bool(params and params.get(DO_REMOTE_PREFILL))


def pool_only(params: dict[str, Any] | None) -> bool:
    """Whether a decode sent with ``params`` loads from the KV pool only (and computes what the pool lacks)."""
    return bool(params and params.get(DO_REMOTE_PREFILL) and params.get(POOL_ONLY))


AWAITED_PUSH = {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, AWAIT_PUSH: True}  # a decode sent with its prefill
# to a push-mode consumer: it waits for whichever producer pushes the prompt (no producer's answer needed)


def bootstrap_engine_id(answer: Any) -> str:
    """The engine id in a bootstrap server's ``/query`` answer ({dp_rank: {"engine_id", "worker_addr"}})."""
    entries = list(answer.values()) if isinstance(answer, dict) else []
    ids = {e.get("engine_id") for e in entries if isinstance(e, dict)}
    if len(ids) != 1 or not isinstance(engine_id := ids.pop(), str) or not engine_id:
        raise ValueError(f"expected one engine id in the bootstrap server's /query answer, got {answer!r:.200}")
    return engine_id


class ParamsProtocol:
    """vLLM's disaggregation protocol as our MooncakeConnector answers it (docs/proxy.md#protocols)."""

    needs_params = True  # a prefill answer without kv_transfer_params is no use to the decode

    def __init__(self, discovery: Discovery):
        self.discovery = discovery

    def new_transfer(self) -> None:
        return None

    async def prepare(self, prefill: Upstream) -> None:
        """Nothing to learn about the prefill instance: its answer says where the KV waits."""

    async def prefill_params(self, transfer: None, decode: Upstream) -> dict[str, Any]:
        params: dict[str, Any] = {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False}
        try:
            info = await self.discovery.metrics(decode)
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

    def awaited_push(self, prefill_params: dict[str, Any]) -> dict[str, Any] | None:
        """The decode's params when it can go out with the prefill: its instance takes pushed KV (the prefill names
        it as the push target), so it needs nothing from the prefill's answer. None: it waits for that answer."""
        return dict(AWAITED_PUSH) if prefill_params.get(PUSH_TO) else None


class BootstrapProtocol:
    """vLLM's built-in MooncakeConnector: a transfer id on both requests; the decode names the prefill instance's
    bootstrap server and engine id."""

    needs_params = False  # the decode's params come from the bootstrap server, not the answer

    def __init__(self, discovery: Discovery):
        self.discovery = discovery

    def new_transfer(self) -> str:
        return uuid.uuid4().hex

    async def prepare(self, prefill: Upstream) -> None:
        """Learn the prefill instance's engine id before it prefills: if its bootstrap server cannot say, the request
        ends here (502), not after a prefill whose KV would wait for a decode that never comes."""
        await self._learned_engine_id(prefill)

    async def prefill_params(self, transfer: str, decode: Upstream) -> dict[str, Any]:
        return {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False, "transfer_id": transfer}

    def awaited_push(self, prefill_params: dict[str, Any]) -> dict[str, Any] | None:
        """Never: the decode names the engine the prefill ran on."""
        return None

    async def decode_params(self, transfer: str, prefill: Upstream,
                            answer: dict[str, Any] | None) -> dict[str, Any] | None:
        engine_id = await self._learned_engine_id(prefill)  # the one it was prepared for, unless a retry moved it
        return {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, "transfer_id": transfer,
                "remote_engine_id": engine_id, "remote_bootstrap_addr": prefill.bootstrap}

    async def _learned_engine_id(self, prefill: Upstream) -> str:
        bootstrap = prefill.bootstrap
        try:
            return await self.discovery.learn(prefill, self._engine_id, ENGINE_TOPIC)
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            raise ProxyError(502, "upstream_error", f"the bootstrap server of {prefill.name} did not say its engine "
                             "id", PREFILL, prefill.name,
                             f"{bootstrap} ({error!r}) for {prefill.url}; check --bootstrap") from None

    async def _engine_id(self, prefill: Upstream) -> str:
        text = await self.discovery.get_text(prefill.bootstrap + "/query")
        return bootstrap_engine_id(json.loads(text))
