"""The fleets bench_pool starts, one at a time, on 127.0.0.1, each instance pinned to a core of its own: two
colocated instances without a pool (``colocated``), two ``kv_both`` instances sharing our KV pool (``pool``), two
instances sharing a pool through vLLM's own ``MooncakeStoreConnector`` (``vllm-store``), and a disaggregated pair,
producer and consumer, without and with our pool (``1p1d``, ``1p1d-pool``, and ``1p1d-pool-store-only``: its
producer stores in the pool but never looks there); a ``mooncake_master`` for the fleets with a pool. ``ask`` sends
one request the way each fleet is driven and times its first token."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.support.stacks import post, stream
from harness.ports import free_port
from harness.store import MooncakeMaster
from harness.vllm import VllmServer, connector_config, mooncake_json, start_vllm

FLEETS = ("colocated", "pool", "vllm-store", "1p1d", "1p1d-pool", "1p1d-pool-store-only")
SEGMENT = 1 << 30  # each instance's share of a pool
BUFFER = 256 << 20
SECRET = "bench-pool-secret-" + "3" * 32  # our fleets run with one, as deployed: the pool's tags are MACs under it


@dataclass
class Fleet:
    name: str
    instances: list[VllmServer]  # colocated kinds: the two a request may go to; 1p1d: [producer, consumer]
    master: MooncakeMaster | None = None

    @property
    def disaggregated(self) -> bool:
        return self.name.startswith("1p1d")

    def stop(self) -> None:
        for server in self.instances:
            server.stop()
        if self.master is not None:
            self.master.stop()


def start(kind: str, model: Path, work: Path, serve_args: list[str]) -> Fleet:
    work.mkdir(parents=True, exist_ok=True)
    master = MooncakeMaster(work).start() if kind in ("pool", "vllm-store", "1p1d-pool", "1p1d-pool-store-only") \
        else None
    store = {} if master is None else {"master_server_address": master.address, "global_segment_size": SEGMENT,
                                       "local_buffer_size": BUFFER}
    config = mooncake_json(work / "mooncake.json", timeout=30, **store)
    if kind == "colocated":
        roles: list[tuple[dict | None, Path | None]] = [(None, None), (None, None)]
    elif kind == "pool":
        roles = [(connector_config("kv_both"), config)] * 2
    elif kind == "vllm-store":
        roles = [({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}, config)] * 2
    else:  # the store-only producer stores what it computes and never looks in the pool (pool_lookups false)
        producer = connector_config("kv_producer", **({"pool_lookups": False} if kind.endswith("store-only") else {}))
        roles = [(producer, config), (connector_config("kv_consumer"), config)]
    env = {"MOONCAKE_KV_SECRET": SECRET} if kind != "vllm-store" and kind != "colocated" else None  # as deployed
    instances = [VllmServer(f"{kind}-{i}", model, free_port(), i, work, transfer, path, serve_args, env)
                 for i, (transfer, path) in enumerate(roles)]
    try:
        start_vllm(*instances)
    except BaseException:
        if master is not None:
            master.stop()
        raise
    return Fleet(kind, instances, master)


def stream_ids(url: str, body: dict[str, Any]) -> tuple[float, list[int]]:
    """A streamed completion: (seconds to its first chunk, the answer's token ids)."""
    ids: list[int] = []
    first, _, _ = stream(url, "/v1/completions", {**body, "return_token_ids": True}, ids)
    return first, ids


def ask(fleet: Fleet, route: int, tokens: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """One request: to instance ``route`` (mod 2) of a colocated fleet, or prefilled on the producer and decoded on
    the consumer (the seed's flow, with the producer's params). Its time to the first token as the client sees it
    (a disaggregated request's prefill included), and its answer's token ids."""
    body = {"model": fleet.instances[0].model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    if not fleet.disaggregated:
        return stream_ids(fleet.instances[route % 2].url, body)
    producer, consumer = fleet.instances
    start = time.perf_counter()
    answer = post(producer.url, "/v1/completions", {**body, "max_tokens": 1,
                                                   "kv_transfer_params": {"do_remote_decode": True}})
    prefilled = time.perf_counter() - start
    first, ids = stream_ids(consumer.url, {**body, "kv_transfer_params": answer["kv_transfer_params"]})
    return prefilled + first, ids
