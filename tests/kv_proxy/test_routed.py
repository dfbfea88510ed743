"""kv_proxy/routed.py: one request's routing bookkeeping. Reservations are given back exactly once (by ``release`` while
unsent, by the exchange once sent), and each attempt's queues empty whatever order its stages end in. Real router and
balancers, no HTTP (test_app.py and the others run the same object through the proxy)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kv_proxy.balancer import Balancer
from kv_proxy.config import DECODE, PREFILL, ProxyConfig
from kv_proxy.discovery import Discovery
from kv_proxy.estimate import REMOTE
from kv_proxy.prefix_index import fingerprint
from kv_proxy.routed import Routed
from kv_proxy.routing import Router


def fleet(prefill: int = 1, decode: int = 2) -> tuple[Router, Balancer, Balancer]:
    config = ProxyConfig(prefill=tuple(f"http://p{i}:1" for i in range(prefill)),
                         decode=tuple(f"http://d{i}:1" for i in range(decode)))
    balancers = [Balancer.from_urls(role, urls, 5.0) for role, urls in ((PREFILL, config.prefill),
                                                                        (DECODE, config.decode))]
    router = Router(config, *balancers, Discovery(lambda: None, None), CollectorRegistry())  # type: ignore[arg-type]
    for upstream in balancers[0].upstreams + balancers[1].upstreams:
        upstream.cache_asked = float("inf")  # no background read of its /metrics
    return router, *balancers


def busy(balancer: Balancer) -> int:
    return sum(u.outstanding for u in balancer.upstreams)


HINT = fingerprint({"prompt": "x" * 2048}, chat=False)


def test_unsent_reservations_are_given_back_once_by_stage() -> None:
    router, prefill, decode = fleet()
    routed = Routed.open(router, HINT, "r1")
    assert routed.where == REMOTE and busy(decode) == 1
    chosen = routed.reserve_prefill()
    assert chosen is prefill.upstreams[0] and busy(prefill) == 1
    routed.release(PREFILL)  # e.g. the prefill instance's engine id could not be learned
    assert busy(prefill) == 0 and busy(decode) == 1  # the decode may still go (fallback)
    routed.release()
    routed.release()
    assert busy(decode) == 0


def test_a_sent_reservation_is_the_exchanges() -> None:
    router, prefill, decode = fleet()
    routed = Routed.open(router, HINT, "r2")
    chosen = routed.reserve_prefill()
    routed.prefill_sent(chosen)
    routed.decode_sent(routed.decode, local=False)
    routed.release()  # nothing unsent is left: the exchanges give their instances back
    assert busy(prefill) == 1 and busy(decode) == 1
    assert chosen.work.queued == 1 and routed.decode.work.queued == 1


def test_a_prefill_ending_after_a_retry_leaves_every_queue_empty() -> None:
    """Concurrent dispatch: the decode fails before its first token and is retried whole on a decode instance while
    its prefill still runs (and then fails over to another prefill instance); the prefill's stages are booked on its
    own attempt, the retry's chunks on the new one."""
    router, prefill, decode = fleet(prefill=2)
    routed = Routed.open(router, HINT, "r3")
    chosen = routed.reserve_prefill()
    routed.prefill_sent(chosen)
    first = routed.decode
    routed.decode_sent(first, local=False)
    routed.decode_ended()  # failed before its first token
    routed.retry()
    assert busy(decode) == 2  # the first decode's instance is the exchange's to give back, the retry's reserved
    retried = routed.decode
    routed.decode_sent(retried, local=True)
    assert retried.work.queued == 1
    other = next(u for u in prefill.upstreams if u is not chosen)
    routed.prefill_sent(other)  # its instance could not be reached: it went to the other one
    assert chosen.work.queued == 0 and other.work.queued == 1
    routed.prefill_ended(None)  # and failed there
    assert other.work.queued == 0 and other.work.tokens == 0
    routed.chunk()
    assert retried.work.queued == 0 and retried.work.running == 1
    routed.answered()
    assert retried.prefix.match(HINT.chunks, confirmed=True) == len(HINT.chunks)
    routed.decode_ended()
    assert retried.work.running == 0 and first.work.queued == 0 and first.work.running == 0
