"""The traffic users send, in pull and in push mode: shared system prompts, repeated prompts, prompts that are prefixes
of earlier ones, prefix-cache hits on both sides, many requests at once, requests sent straight to the consumer,
requests abandoned half way.

Every answer equals the colocated reference, and the connector's own stats prove what moved: a load fetches (pull)
and writes (both) exactly the blocks the consumer lacks - from its first uncached block to the end of its claim.
The consumer claims every prompt token but the last beyond its own block-aligned prefix-cache hit, so for a prompt
of L tokens with a claim of C tokens: local hit = L - 1 - C, rows moved = ceil((L - 1) / B) - (L - 1 - C) / B.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

from kv_proxy.protocols import NO_LOAD
from tests.kv_connector.instance_stats import diff, flush, kv_stats, settled_stats, wait_idle
from tests.kv_connector.instances import BLOCK, ROW_BYTES, blocks
from tests.kv_connector.prompts import MAX_TOKENS, prompt

pytestmark = pytest.mark.vllm


def rows_moved(length: int, claimed: int) -> int:
    """Blocks a load of ``claimed`` tokens writes, for a prompt of ``length`` tokens (see the module docstring)."""
    local = length - 1 - claimed
    assert local % BLOCK == 0, f"the local hit {local} is not block aligned"
    return blocks(length - 1) - local // BLOCK


def disaggregate(pair, tokens: list[int]) -> tuple[str, dict[str, float], dict[str, float]]:
    """Prefill on the producer, decode on the consumer; the answer and the change in both instances' stats."""
    producer, consumer = pair
    before_p, before_c = kv_stats(producer), kv_stats(consumer)
    producer.complete(tokens, 1)
    answer = consumer.complete(tokens, MAX_TOKENS)
    change_c = settled_stats(consumer, before_c, 1)
    return answer, diff(kv_stats(producer), before_p), change_c


def check_moved(mode: str, tokens: list[int], change: dict[str, float]) -> int:
    """Assert that the load moved exactly the missing blocks; return the consumer's local hit in tokens."""
    claimed = int(change.get("external_hits", 0))
    rows = rows_moved(len(tokens), claimed)
    assert change.get("loaded", 0) == (1 if claimed else 0) and not change.get("load_failures"), change
    assert change.get("loaded_bytes", 0) == rows * ROW_BYTES, (rows, change)
    assert change.get("fetched_bytes", 0) == (rows * ROW_BYTES if mode == "pull" else 0), (rows, change)
    return len(tokens) - 1 - claimed


def abandon_after_first_token(server, tokens: list[int]) -> str:
    """Stream a 200-token completion, hang up once the first event arrives; its text (one token or more)."""
    body = json.dumps({"model": server.model, "prompt": tokens, "max_tokens": 200, "temperature": 0.0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                return json.loads(line[len(b"data: "):])["choices"][0]["text"]
    raise AssertionError("the stream ended without a token")


def test_shared_system_prompt_moves_only_the_questions(pair, mode, reference):
    """Four questions after one ~600-token system prompt, then the first again: after the first request the
    consumer holds the system prompt's full blocks itself, and only the rest moves."""
    system = prompt(500 if mode == "pull" else 600, 600)
    questions = [prompt(501 + i if mode == "pull" else 601 + i, 40 + 37 * i) for i in range(4)]
    prompts = [system + q for q in questions] + [system + questions[0]]
    local_hits, pushed = [], 0.0
    for tokens in prompts:
        answer, change_p, change_c = disaggregate(pair, tokens)
        assert answer == reference.complete(tokens, MAX_TOKENS)
        local_hits.append(check_moved(mode, tokens, change_c))
        pushed += change_p.get("pushed_bytes", 0)
    if mode == "push":  # the producer cannot know the consumer's cache: it pushes every prompt whole
        # Pushed bytes reach /metrics with the producer's next step, so a window holds part of the previous request's
        # (or an earlier test's one-block poke) and part of its own: over the test, all but the last prompt's.
        whole = sum(blocks(len(t)) for t in prompts) * ROW_BYTES
        assert whole - blocks(len(prompts[-1])) * ROW_BYTES - ROW_BYTES <= pushed <= whole + ROW_BYTES, pushed
    assert local_hits[0] == 0
    assert local_hits[1:4] == [4 * BLOCK] * 3  # the system prompt's 4 full blocks
    assert local_hits[4] == (len(prompts[4]) - 1) // BLOCK * BLOCK  # the repeat: all its full blocks


def test_repeated_prompt(pair, mode, reference):
    tokens = prompt(700 if mode == "pull" else 710, 700)
    for expected_local in (0, 5 * BLOCK):
        answer, _, change = disaggregate(pair, tokens)
        assert answer == reference.complete(tokens, MAX_TOKENS)
        assert check_moved(mode, tokens, change) == expected_local


def test_prompt_that_is_a_prefix_of_an_earlier_one(pair, mode, reference):
    """The producer has it cached too (its prefix cache is on): its entry gathers cached and computed blocks alike."""
    earlier = prompt(720 if mode == "pull" else 730, 800)
    disaggregate(pair, earlier)
    tokens = earlier[:300]
    answer, change_p, change = disaggregate(pair, tokens)
    assert answer == reference.complete(tokens, MAX_TOKENS)
    assert check_moved(mode, tokens, change) == 2 * BLOCK
    assert change_p.get("local_hits", 0) >= 2 * BLOCK


def test_consumer_hit_covering_the_whole_prompt_moves_nothing(pair, mode, reference):
    tokens = prompt(740 if mode == "pull" else 750, 2 * BLOCK + 1)  # all but the last token fill two blocks
    answer, _, change = disaggregate(pair, tokens)
    assert answer == reference.complete(tokens, MAX_TOKENS) and check_moved(mode, tokens, change) == 0
    producer, consumer = pair
    before = kv_stats(consumer)
    producer.complete(tokens, 1)
    assert consumer.complete(tokens, MAX_TOKENS) == answer
    change = diff(kv_stats(consumer), before)
    assert not change.get("external_hits") and not change.get("loaded") and not change.get("fetched_bytes")
    assert change.get("local_hits") == 2 * BLOCK


def test_producer_with_part_of_the_prompt_cached(pair, mode, reference):
    producer, consumer = pair
    seen = prompt(760 if mode == "pull" else 770, 600)
    producer.complete(seen, 1)  # a prefill whose decode never comes: the producer caches it
    tokens = seen[:450] + prompt(761 if mode == "pull" else 771, 200)
    answer, change_p, change = disaggregate(pair, tokens)
    assert answer == reference.complete(tokens, MAX_TOKENS)
    assert change_p.get("local_hits", 0) == 3 * BLOCK  # the producer computed only the rest
    assert check_moved(mode, tokens, change) == 0  # the consumer had none of it: every block moved


def test_many_requests_at_once_with_shared_prefixes(pair, mode, reference):
    """16 requests in flight together, in four families sharing a prefix each; whatever the consumer already holds
    when each is scheduled, the bytes moved add up to the blocks claimed."""
    producer, consumer = pair
    base = 800 if mode == "pull" else 900
    families = [prompt(base + f, 300) for f in range(4)]
    prompts = [families[i % 4] + prompt(base + 10 + i, 50 + 23 * i) for i in range(16)]
    before = kv_stats(consumer)

    def one(tokens: list[int]) -> str:
        producer.complete(tokens, 1)
        return consumer.complete(tokens, MAX_TOKENS)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, prompts))
    change = settled_stats(consumer, before, 16)
    assert answers == [reference.complete(tokens, MAX_TOKENS) for tokens in prompts]
    assert change.get("loaded") == 16 and not change.get("load_failures") and not change.get("load_misses"), change
    claimed = change["external_hits"]
    rows = sum(blocks(len(t) - 1) for t in prompts) - (sum(len(t) - 1 for t in prompts) - claimed) / BLOCK
    assert change["loaded_bytes"] == rows * ROW_BYTES
    assert change.get("fetched_bytes", 0) == (rows * ROW_BYTES if mode == "pull" else 0)


def test_request_sent_straight_to_the_consumer_is_a_quick_miss(pair, mode, reference):
    """Nothing was prefilled for it: its lookup finds nothing at once, nothing is claimed or loaded, and the consumer
    computes the prompt itself. "At once" is checked against the waits a miss must not take (lookup_timeout 2 s,
    push_wait 5 s, load_timeout 10 s), not in milliseconds: on a quiet box the whole request takes ~0.1 s, under the
    suite's load up to ~0.8 s was seen."""
    _, consumer = pair
    tokens = prompt(950 if mode == "pull" else 960, 200)
    before = kv_stats(consumer)
    start = time.monotonic()
    answer = consumer.complete(tokens, 1)
    elapsed = time.monotonic() - start
    assert answer == reference.complete(tokens, 1)
    said = [line for line in consumer.log_text().splitlines() if "MooncakeConnector" in line]
    assert elapsed < 2.5, f"a request nobody prefilled took {elapsed:.2f} s; the consumer logged: {said[-3:]}"
    change = settled_stats(consumer, before, 1)
    assert change.get("lookup_misses") == 1 and not change.get("external_hits"), change
    assert not {"loaded", "load_misses", "load_failures", "loaded_bytes"} & change.keys(), change


def test_requests_abandoned_half_way(pair, mode, reference):
    """Clients that give up during the consumer's load or decode (it aborts them) and prefills whose decode never
    comes: later requests still load and answer right."""
    producer, consumer = pair
    abandoned = [prompt(970 + i if mode == "pull" else 980 + i, 900) for i in range(3)]
    for tokens in abandoned[:2]:  # gone 50 ms after sending: most likely during the load
        producer.complete(tokens, 1)
        try:
            answer = consumer.complete(tokens, 200, timeout=0.05)
        except (TimeoutError, urllib.error.URLError):
            continue
        # The consumer was quicker than the client's patience (a busy client process): still the right text.
        assert answer == reference.complete(tokens, 200)
    wait_idle(consumer)
    producer.complete(abandoned[2], 1)
    generated = consumer.metric("vllm:generation_tokens_total")
    first = abandon_after_first_token(consumer, abandoned[2])  # certainly during the decode
    # A busy API server merges the tokens it has not yet streamed into one event, so the first may hold several.
    assert first and reference.complete(abandoned[2], 200).startswith(first), first
    wait_idle(consumer)  # else an abandoned request's claim may land in the stats of the next one
    assert consumer.metric("vllm:generation_tokens_total") - generated < 200, "the consumer decoded for nobody"
    for tokens in (prompt(990 if mode == "pull" else 995, 400), abandoned[0][:500]):
        answer, _, change = disaggregate(pair, tokens)
        assert answer == reference.complete(tokens, MAX_TOKENS)
        check_moved(mode, tokens, change)


def test_a_request_served_whole_on_the_producer_keeps_nothing(pair, mode, reference):
    """A request whose params say ``do_remote_decode: false`` (the proxy's NO_LOAD) on the producer: the reference's
    answer, and neither a save nor a push (in push mode mooncake.json names a consumer to push to)."""
    producer, consumer = pair
    tokens = prompt(1100 if mode == "pull" else 1110, 700)
    flush(producer)
    before_p, before_c = kv_stats(producer), kv_stats(consumer)
    assert producer.complete(tokens, MAX_TOKENS, kv_transfer_params=NO_LOAD) == reference.complete(tokens, MAX_TOKENS)
    flush(producer)
    kept = diff(kv_stats(producer), before_p)
    assert not any(kept.get(k) for k in ("saved", "saved_bytes", "pushed", "pushed_bytes")), kept
    assert not diff(kv_stats(consumer), before_c).get("loaded_bytes")
    producer.complete(tokens, 1)  # the same prompt without those params is kept for a consumer
    flush(producer)
    assert diff(kv_stats(producer), before_p).get("saved" if mode == "pull" else "pushed") == 1
    assert consumer.complete(tokens, MAX_TOKENS) == reference.complete(tokens, MAX_TOKENS)  # and taken: none left over
    assert settled_stats(consumer, before_c, 1).get("loaded") == 1
