"""How the tests start real vLLM instances (tests/kv_connector/conftest.py's fixtures and the tests' own): the serving
arguments and sizes of the tiny model, a producer/consumer pair through one mooncake.json, the push links a pair
opens before measuring, and which instances the selected tests will take (to start them ahead)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from harness.netns import Host
from harness.ports import free_port
from harness.vllm import VllmServer, connector_config, mooncake_json, start_vllm
from kv_connector.param_keys import PUSH_PROOF
from tests.kv_connector.instance_stats import flush, kv_stats

SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1100", "--kv-cache-memory-bytes", "67108864",
              "--max-num-batched-tokens", "512"]
BLOCK = 128  # the CPU backend's block size
ROW_BYTES = 4 * 2 * 128 * 128 * 4  # one block of every layer of the tiny model in float32: 4 layers x [2, 128, 128]
PUSH_PAIR_SECRET = "push-pair-secret-" + "7" * 32  # the push pair's shared secret (conftest ``push_pair``)
BAD_STARTS = {  # name: (extra config, vLLM args, what the log must say): conftest ``refused_starts``, test_refused_starts.py
    "misspelled-option": ({"bufer_size": 1}, [], "kv_connector_extra_config: unknown key(s) 'bufer_size' (did you "
                          "mean 'buffer_size'?)"),
}


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def start_pair(model: Path, work: Path, name: str, consumer_extra: dict | None = None, producer_extra: dict | None = None,
               confine: bool = False, mode: str = "pull", serve_args: list[str] = SERVE_ARGS,
               hosts: tuple[Host, Host] | None = None, worker_process: bool = False, wait: bool = True,
               failure_policy: str | None = "recompute", **mooncake_extra: object) -> tuple[VllmServer, VllmServer]:
    """A producer (core 0) and a consumer (core 1, test corruption allowed) serving ``model`` in transfer ``mode``,
    paired through one mooncake.json in ``work``; both started. ``confine``: every process of an instance on its core
    (see ``VllmServer``). ``hosts``: the producer and the consumer each on a host of its own (harness/netns.py),
    their pipes on the hosts' KV link. ``worker_process``: see ``VllmServer`` (by default, vLLM's layout for one
    GPU: the connector's scheduler and worker sides in one engine core process). ``wait=False``: spawned only (the
    caller waits with ``start_vllm`` later). ``failure_policy``: the consumer's ``kv_load_failure_policy`` (None: not
    set, vLLM's default)."""
    if hosts is not None:
        mooncake_extra = {"prefill_url": f"{hosts[0].kv}:{free_port()}", "decode_url": f"{hosts[1].kv}:{free_port()}",
                          **mooncake_extra}
    config = mooncake_json(work / "mooncake.json", **mooncake_extra)
    on = [{"worker_process": worker_process, **({} if host is None else {"host": host.http, "prefix": host.prefix()})}
          for host in (hosts or (None, None))]
    producer = VllmServer(f"{name}-producer", model, free_port(), 0, work,
                          connector_config("kv_producer", transfer_mode=mode, **(producer_extra or {})), config,
                          serve_args, confine=confine, **on[0])
    consumer = VllmServer(f"{name}-consumer", model, free_port(), 1, work,
                          connector_config("kv_consumer", tamper=True, transfer_mode=mode,
                                           failure_policy=failure_policy,
                                           **{"kv_digest": "always", **(consumer_extra or {})}), config, serve_args,
                          confine=confine, **on[1])
    if wait:
        start_vllm(producer, consumer)
    return producer, consumer


def etcd_metadata(address: str) -> dict[str, str]:
    """mooncake.json's fields for Transfer Engine metadata kept in the etcd server at ``address``."""
    return {"metadata_server": f"etcd://{address}", "metadata_backend": "etcd"}


def open_push_links(producers: list[VllmServer], consumers: list[VllmServer]) -> None:
    """A producer links to a consumer it pushes to on the first request for it, and serves that request by pull
    (the link is made in the background): open every producer-to-consumer link before measuring."""
    from kv_proxy.discovery import push_target  # here: the GPU machines running this folder's cuda tests have no aiohttp

    for consumer in consumers:
        with urllib.request.urlopen(f"{consumer.url}/metrics", timeout=10) as resp:
            target = push_target(resp.read().decode())
        assert target, f"{consumer.name} does not advertise a push address on /metrics"
        pipes, proof = target
        for producer in producers:
            params = {"do_remote_decode": True, "mooncake_push_to": pipes, **({PUSH_PROOF: proof} if proof else {})}
            deadline = time.monotonic() + 20
            while True:
                before = kv_stats(producer).get("pushed", 0)
                producer.complete([5, 6, 7], 1, kv_transfer_params=params)
                flush(producer)
                if kv_stats(producer).get("pushed", 0) > before:
                    break
                assert time.monotonic() < deadline, f"{producer.name} never pushed to {consumer.name}"
                time.sleep(0.2)


def selected_params(request: pytest.FixtureRequest, fixture: str) -> set:
    """The values of the parametrized ``fixture`` that the tests of this run will take (what to start ahead)."""
    return {item.callspec.params.get(fixture) for item in request.session.items if hasattr(item, "callspec")}


def start_early(request: pytest.FixtureRequest, fixture: str) -> None:
    """Set up ``fixture`` now if a selected test of this module takes it: for an autouse module fixture that starts
    instances while the module's first tests run (they leave a core idle)."""
    if any(fixture in item.fixturenames for item in request.session.items if item.module is request.module):
        request.getfixturevalue(fixture)
