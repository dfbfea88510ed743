"""vLLM's ``kv_load_failure_policy``, honoured (issues #37, #45), on real vLLM: under ``fail`` (vLLM's default: the
``default_pair``'s consumer sets none) a request whose KV load was found and then failed ends with an error the
client sees (HTTP 500, no text) and nothing is computed from KV that did not arrive; a request whose producer holds
nothing of its prompt claims nothing (it asked first) and is computed here, without an error. Under ``recompute``
(every other module's consumer: harness ``connector_config``) the same failure is recomputed with the right text
(tests/kv_connector/test_faults.py)."""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Iterator

import pytest

from harness.tamper import CORRUPT_PARAM
from harness.vllm import VllmServer, start_vllm
from tests.kv_connector.instance_stats import LOADS, diff, kv_stats, log_mark, looked_up, settled_stats, warnings_since
from tests.kv_connector.prompts import MAX_TOKENS, prefill, prompt

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def default_pair_stops_with_the_module(default_pair: tuple[VllmServer, VllmServer]) -> Iterator[None]:
    """The pair is spawned early, for the session (conftest ``spawn_early``); this module is the last to use it
    (test_find_before_claim.py runs before it)."""
    yield
    for server in default_pair:
        server.stop()


def test_under_fail_a_request_whose_producer_holds_nothing_is_computed_without_an_error(default_pair, pd_pair,
                                                                                         reference):
    producer, _ = pd_pair
    _, consumer = default_pair
    start_vllm(*default_pair)
    said = consumer.log_text()
    assert "kv_load_failure_policy=fail: each request asks its producer how much of its prompt it holds" in said
    # params of prompt a, sent with prompt b: the producer they name holds nothing of b: asked, nothing claimed
    a, b = prompt(9100, 300), prompt(9101, 300)
    params = prefill(producer, a)
    before = kv_stats(consumer)
    assert consumer.complete(b, MAX_TOKENS, kv_transfer_params=params) == reference.complete(b, MAX_TOKENS)
    change = looked_up(consumer, before, 1)
    time.sleep(0.5)  # a load's outcome would reach /metrics with a later step: none may come
    change = diff(kv_stats(consumer), before)
    assert change.get("lookup_misses") == 1 and not set(LOADS) & change.keys(), change
    assert not change.get("fetched_bytes") and not change.get("external_hits"), change
    # and a load its params name, which the producer holds, is loaded and answers right
    c = prompt(9102, 400)
    params = prefill(producer, c)
    before = kv_stats(consumer)
    assert consumer.complete(c, MAX_TOKENS, kv_transfer_params=params) == reference.complete(c, MAX_TOKENS)
    change = settled_stats(consumer, before, 1)
    assert change.get("loaded") == 1 and change.get("fetched_bytes", 0) > 0 and change.get("lookup_hits") == 1, change


def test_a_kv_digest_mismatch_fails_the_load_recomputed_or_refused(default_pair, pd_pair, reference):
    """Issue #37: a byte of the KV flipped after it left the producer (a test switch of the consumer's load). The
    consumer's digest check catches it before vLLM runs the request: under ``recompute`` the answer is the
    reference's (recomputed), under ``fail`` the client gets an error, never text computed from the bad KV; both
    log the request's mismatch and count it on /metrics."""
    producer, consumer = pd_pair
    _, fail_consumer = default_pair
    start_vllm(*default_pair)
    for server, tokens in ((consumer, prompt(9110, 500)), (fail_consumer, prompt(9111, 500))):
        params = {**prefill(producer, tokens), CORRUPT_PARAM: "flip_byte"}
        before, mark = kv_stats(server), log_mark(server)
        if server is consumer:
            assert server.complete(tokens, MAX_TOKENS, kv_transfer_params=params) == \
                reference.complete(tokens, MAX_TOKENS)
        else:
            with pytest.raises(urllib.error.HTTPError) as failed:
                server.complete(tokens, MAX_TOKENS, kv_transfer_params=params)
            assert failed.value.code == 500, failed.value.read()
        change = settled_stats(server, before, 1)
        assert change.get("digest_mismatches") == 1 and change.get("load_failures") == 1, change
        assert not change.get("loaded") and not change.get("digest_checks"), change
        said = server.log.read_bytes()[mark:]
        assert b"KV digest mismatch: 1 of" in said and b"flip_byte" in said, warnings_since(server, mark)
        if server is fail_consumer:
            assert b"its request fails (kv_load_failure_policy fail)" in said, warnings_since(server, mark)
    # a clean load on the same instance is checked and used
    tokens = prompt(9112, 500)
    before = kv_stats(fail_consumer)
    params = prefill(producer, tokens)
    assert fail_consumer.complete(tokens, MAX_TOKENS, kv_transfer_params=params) == reference.complete(tokens, MAX_TOKENS)
    change = settled_stats(fail_consumer, before, 1)
    assert change.get("loaded") == 1 and change.get("digest_checks") == 1, change
