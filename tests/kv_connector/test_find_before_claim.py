"""Find before you claim (#45), on real vLLM: the ``default_pair`` runs as a user starts it from the README, under
vLLM's default ``kv_load_failure_policy`` (none set: ``fail``). The seed's flow - a ``max_tokens=1`` prefill straight
to the producer, then the request straight to the consumer, no ``kv_transfer_params`` - moves each prompt's KV (bytes
counted by the connector, not vLLM's hit counter) and answers as the colocated reference does; a prompt no producer
holds, a producer that is down or frozen: the consumer asked first, claimed nothing, and computed the prompt itself,
with no error, within the lookup's deadline."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
import urllib.error

import pytest

from harness.vllm import VllmServer, start_vllm
from tests.kv_connector.instance_stats import LOADS, diff, kv_stats, looked_up, settled_stats
from tests.kv_connector.instances import ROW_BYTES, blocks
from tests.kv_connector.prompts import MAX_TOKENS, prompt

pytestmark = pytest.mark.vllm

LOOKUP_TIMEOUT = 2.0  # the connector's default lookup_timeout


def seed_flow(producer: VllmServer, consumer: VllmServer, tokens: list[int]) -> str:
    """What the seed's proxy (and the README's by-hand section) does: the prefill, then the decode, no params."""
    producer.complete(tokens, 1)
    return consumer.complete(tokens, MAX_TOKENS)


def test_the_seeds_flow_moves_each_prompts_kv_under_the_default_policy(default_pair, reference):
    """Six prompts of 150-1,000 tokens, three of them behind a shared 300-token system prompt, then one repeated:
    every answer is the reference's, each prompt loaded exactly the blocks the consumer lacked (its own prefix cache
    holds the system prompt's full blocks after the first), and nothing failed."""
    producer, consumer = default_pair
    start_vllm(producer, consumer)
    system = prompt(9300, 300)
    prompts = [prompt(9301, 150), system + prompt(9302, 200), prompt(9303, 1000), system + prompt(9304, 450),
               prompt(9305, 601), system + prompt(9306, 700)]
    before = kv_stats(consumer)
    answers = [seed_flow(producer, consumer, tokens) for tokens in prompts]
    assert answers == [reference.complete(tokens, MAX_TOKENS) for tokens in prompts]
    moved = settled_stats(consumer, before, len(prompts))
    cached = [0, 0, 0, 2, 0, 2]  # blocks of the consumer's own prefix cache: the system prompt's two full blocks
    expected = sum(blocks(len(t) - 1) - c for t, c in zip(prompts, cached, strict=True)) * ROW_BYTES
    print(f"seed flow: {moved.get('fetched_bytes', 0) / 2**20:.1f} MiB loaded for {sum(map(len, prompts))} prompt "
          f"tokens; stats change {moved}")
    assert moved.get("loaded") == len(prompts) and not moved.get("load_failures"), moved
    assert moved.get("fetched_bytes") == expected and moved.get("loaded_bytes") == expected, (moved, expected)
    assert moved.get("lookup_hits") == len(prompts) and not moved.get("lookup_errors"), moved
    # a repeat: its full blocks are in the consumer's own cache; what is left of it is found and loaded
    before = kv_stats(consumer)
    assert seed_flow(producer, consumer, prompts[2]) == answers[2]
    repeat = looked_up(consumer, before, 1)
    assert not repeat.get("load_failures") and not repeat.get("lookup_errors"), repeat


def test_a_prompt_no_producer_holds_is_computed_here_with_no_load(default_pair, reference):
    """Straight to the consumer (no prefill anywhere), no params, under ``fail``: the right text and no error; the
    lookup found nothing, so nothing was claimed, no load started, no KV moved."""
    _, consumer = default_pair
    start_vllm(*default_pair)
    tokens = prompt(9400, 500)
    before = kv_stats(consumer)
    assert consumer.complete(tokens, MAX_TOKENS) == reference.complete(tokens, MAX_TOKENS)
    looked_up(consumer, before, 1)
    time.sleep(0.5)  # a load's outcome would reach /metrics with a later step: none may come
    change = diff(kv_stats(consumer), before)
    assert change.get("lookup_misses") == 1 and not set(LOADS) & change.keys(), change
    assert not change.get("fetched_bytes") and not change.get("external_hits"), change


class FrozenListener:
    """A TCP listener on 127.0.0.1 that accepts connections and never says a word (a frozen or hostile producer)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_producer_down_or_frozen_costs_at_most_the_lookup_deadline(default_pair, reference):
    """Params naming a producer nobody runs, or one that accepts and never answers: the right text, no error, within
    lookup_timeout plus a margin; a second request naming it while it is backed off does not wait at all."""
    _, consumer = default_pair
    start_vllm(*default_pair)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    frozen = FrozenListener()
    try:
        for name, address in (("down", dead), ("frozen", frozen.address)):
            params = {"do_remote_prefill": True, "remote_pipe": [address]}
            seconds = []
            before = kv_stats(consumer)
            for seed in (9500, 9501):
                tokens = prompt(seed + (10 if name == "frozen" else 0), 400)
                start = time.monotonic()
                answer = consumer.complete(tokens, MAX_TOKENS, kv_transfer_params=params)
                seconds.append(time.monotonic() - start)
                assert answer == reference.complete(tokens, MAX_TOKENS), name
            change = looked_up(consumer, before, 2)
            print(f"producer {name}: answered in {[round(s, 2) for s in seconds]} s; stats change {change}")
            assert change.get("lookup_errors") == 2 and not set(LOADS) & change.keys(), change
            assert seconds[0] < LOOKUP_TIMEOUT + 3.0, f"{name}: the first request waited {seconds[0]:.1f} s"
            assert seconds[1] < 1.5, f"{name}: backed off, yet the second request waited {seconds[1]:.1f} s"
    finally:
        frozen.close()


def test_many_at_once_under_eviction_pressure_every_answer_is_right(default_pair, reference):
    """Four clients run the seed's flow at once with 700-token prompts into a producer buffer with room for three,
    while a fifth sends prefills whose decode never comes: entries are evicted while others are looked up and loaded.
    Under ``fail`` no request errs (what was found stays found until its load takes it; what was evicted first is
    found empty and computed here) and every answer is the reference's."""
    producer, consumer = default_pair
    start_vllm(*default_pair)
    prompts = [[prompt(9600 + 10 * k + i, 700) for i in range(4)] for k in range(4)]
    before_p, before_c = kv_stats(producer), kv_stats(consumer)
    errors: list[str] = []
    done = threading.Event()

    def orphans() -> None:
        i = 0
        while not done.is_set():
            producer.complete(prompt(9700 + i, 700), 1)
            i += 1

    def client(mine: list[list[int]]) -> list[str]:
        out = []
        for tokens in mine:
            try:
                out.append(seed_flow(producer, consumer, tokens))
            except urllib.error.HTTPError as e:
                errors.append(f"{e.code}: {e.read()[:200]!r}")
                out.append("")
        return out

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        pressure = pool.submit(orphans)
        try:
            answers = [a for got in pool.map(client, prompts) for a in got]
        finally:
            done.set()
        pressure.result()
    assert not errors, errors
    flat = [tokens for mine in prompts for tokens in mine]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda t: reference.complete(t, MAX_TOKENS), flat))
    assert answers == expected
    consumed = looked_up(consumer, before_c, len(flat))
    produced = diff(kv_stats(producer), before_p)
    print(f"16 requests, 4 at a time: consumer {consumed}; producer {produced}")
    assert consumed.get("lookups") == len(flat) and not consumed.get("load_failures"), consumed
    assert consumed.get("loaded", 0) >= 1 and consumed.get("loaded", 0) <= consumed.get("lookup_hits", 0), consumed
    assert produced.get("evicted", 0) >= 1, f"no entry was evicted: no pressure ({produced})"
