"""vLLM's ``kv_load_failure_policy``, honoured (issue #37), on real vLLM: under ``fail`` a request whose KV load fails
ends with an error the client sees (HTTP 500, no text) and nothing is computed from KV that did not arrive; a request
without params names no producer, so it is computed here (no load of it can fail). Under ``recompute`` (every other
module's consumer: harness ``connector_config``) the same failure is recomputed with the right text
(tests/kv_connector/test_faults.py)."""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Iterator

import pytest

from harness.vllm import VllmServer, start_vllm
from kv_connector.metadata import CORRUPT_PARAM
from tests.kv_connector.conftest import diff, kv_stats, log_mark, settled_stats, warnings_since
from tests.kv_connector.test_mooncake_connector import MAX_TOKENS, prompt
from tests.kv_connector.test_tensor_parallel import prefill


@pytest.fixture(scope="module", autouse=True)
def fail_consumer_stops_with_the_module(fail_consumer: VllmServer) -> Iterator[None]:
    """The consumer is spawned early, for the session (conftest ``spawn_early``), but serves only this module."""
    yield
    fail_consumer.stop()


def test_a_failed_load_ends_its_request_with_an_error_under_fail(fail_consumer, pd_pair, reference):
    producer, _ = pd_pair
    start_vllm(fail_consumer)
    said = fail_consumer.log_text()
    assert "kv_load_failure_policy=fail: a KV load that fails ends its request with an error" in said
    # params of prompt a, sent with prompt b: the producer they name holds no KV of b, so its load fails
    a, b = prompt(9100, 300), prompt(9101, 300)
    params = prefill(producer, a)
    before, mark = kv_stats(fail_consumer), log_mark(fail_consumer)
    with pytest.raises(urllib.error.HTTPError) as failed:
        fail_consumer.complete(b, MAX_TOKENS, kv_transfer_params=params)
    assert failed.value.code == 500, failed.value.read()
    change = settled_stats(fail_consumer, before, 1)
    assert change.get("load_misses", 0) + change.get("load_failures", 0) == 1 and not change.get("loaded"), change
    assert b"its request fails (kv_load_failure_policy fail)" in fail_consumer.log.read_bytes()[mark:], \
        warnings_since(fail_consumer, mark)
    # the same instance goes on serving: a request without params is computed here, with no load attempted
    before = kv_stats(fail_consumer)
    assert fail_consumer.complete(b, MAX_TOKENS) == reference.complete(b, MAX_TOKENS)
    time.sleep(1.0)  # a load's outcome reaches /metrics with a later engine step: none may come
    change = {k: v for k, v in diff(kv_stats(fail_consumer), before).items() if v}
    assert not {"loaded", "load_misses", "load_failures"} & change.keys(), change
    # and a load its params name, which the producer holds, is loaded and answers right
    c = prompt(9102, 400)
    params = prefill(producer, c)
    before = kv_stats(fail_consumer)
    assert fail_consumer.complete(c, MAX_TOKENS, kv_transfer_params=params) == reference.complete(c, MAX_TOKENS)
    change = settled_stats(fail_consumer, before, 1)
    assert change.get("loaded") == 1 and change.get("fetched_bytes", 0) > 0, change


def test_a_kv_digest_mismatch_fails_the_load_recomputed_or_refused(fail_consumer, pd_pair, reference):
    """Issue #37: a byte of the KV flipped after it left the producer (a test switch of the consumer's load). The
    consumer's digest check catches it before vLLM runs the request: under ``recompute`` the answer is the
    reference's (recomputed), under ``fail`` the client gets an error, never text computed from the bad KV; both
    log the request's mismatch and count it on /metrics."""
    producer, consumer = pd_pair
    start_vllm(fail_consumer)
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
    # a clean load on the same instance is checked and used
    tokens = prompt(9112, 500)
    before = kv_stats(fail_consumer)
    params = prefill(producer, tokens)
    assert fail_consumer.complete(tokens, MAX_TOKENS, kv_transfer_params=params) == reference.complete(tokens, MAX_TOKENS)
    change = settled_stats(fail_consumer, before, 1)
    assert change.get("loaded") == 1 and change.get("digest_checks") == 1, change
