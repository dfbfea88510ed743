"""kv_proxy/estimate.py: the fits learn what work costs, and ``decide`` picks remote prefill or the whole request on the
decode instance from queues and costs (no HTTP: the decision is a pure function; test_routing.py runs it through
the proxy)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from kv_proxy.balancer import ESTIMATE, PREFIX, Balancer, Upstream
from kv_proxy.config import DECODE, PREFILL, ProxyConfig
from kv_proxy.discovery import Discovery
from kv_proxy.estimate import MIN_SAMPLES, REMOTE, Costs, LinearFit, Work, decide
from kv_proxy.prefix_index import Fingerprint, fingerprint
from kv_proxy.routing import Router


def learned(base: float, per_token: float, tokens: tuple[int, ...] = (100, 400, 800, 1600)) -> LinearFit:
    fit = LinearFit()
    for n in tokens:
        fit.observe(n, base + per_token * n)
    return fit


def costs(prefill: tuple[float, float] | None = (0.02, 0.001), load: tuple[float, float] | None = (0.01, 0.0001),
          step: float = 0.03) -> Costs:
    """An instance whose prefills cost ``base + per_token * n`` and whose loads cost likewise (None: not learned)."""
    c = Costs()
    if prefill is not None:
        c.prefill = learned(*prefill)
    if load is not None:
        c.load = learned(*load)
    for _ in range(MIN_SAMPLES):
        c.observe_step(step)
    return c


def test_a_fit_learns_a_line_and_follows_change() -> None:
    fit = learned(0.05, 0.002)
    base, per_token = fit.line()
    assert base == pytest.approx(0.05, rel=1e-6) and per_token == pytest.approx(0.002, rel=1e-6)
    assert fit.predict(1000) == pytest.approx(2.05, rel=1e-6)
    rng = random.Random(1)
    noisy = LinearFit()
    for _ in range(200):
        n = rng.randint(50, 2000)
        noisy.observe(n, (0.05 + 0.002 * n) * rng.uniform(0.9, 1.1))
    assert noisy.predict(1000) == pytest.approx(2.05, rel=0.1)
    for _ in range(60):  # the machine got 3x slower: the fit follows within a few dozen answers
        n = rng.randint(50, 2000)
        noisy.observe(n, 3 * (0.05 + 0.002 * n))
    assert noisy.predict(1000) == pytest.approx(6.15, rel=0.05)


def test_a_fit_never_goes_negative_nor_trusts_too_few_samples() -> None:
    fit = LinearFit()
    for n, seconds in ((100, 0.5), (200, 0.4), (300, 0.3)):  # noise that slopes down
        assert not fit.known
        fit.observe(n, seconds)
    assert fit.known and fit.samples == MIN_SAMPLES
    base, per_token = fit.line()
    assert base >= 0 and per_token >= 0 and fit.predict(0) >= 0
    same = LinearFit()
    for _ in range(5):  # every sample the same size: the level is all it can learn
        same.observe(512, 0.256)
    assert same.predict(512) == pytest.approx(0.256) and same.predict(1024) == pytest.approx(0.512)
    same.observe(float("nan"), 1.0)
    same.observe(100, -1.0)
    assert same.samples == 5


def test_before_the_remote_path_is_learned_the_prefill_is_remote() -> None:
    idle = Work()
    for prefill, decode in ((Costs(), costs()), (costs(), costs(load=None)), (Costs(), Costs())):
        decision = decide(prefill, idle, 10, decode, idle, 10)
        assert decision.where == REMOTE and decision.reason == "not_learned"


def test_an_idle_decode_instance_computes_a_short_uncached_part_itself() -> None:
    """A follow-up turn: most of the prompt is cached on D, 192 tokens are not (and P holds none of it). Remote:
    P prefills 1216 tokens, D loads 192; local: D prefills 192 - cheaper while D is idle."""
    p, d = costs(), costs()
    decision = decide(p, Work(), 1216, d, Work(), 192)
    assert decision.where != REMOTE and decision.reason == "faster_locally"
    assert decision.local is not None and decision.via is not None
    assert decision.local.cost < decision.via.cost


def test_a_busy_decode_instance_sends_the_prefill_away() -> None:
    """The same request, with D's core busy: 3000 tokens queued for prefill there, or 8 requests decoding that a
    local prefill would stall; P idle. The whole request on D now costs more than the remote prefill."""
    p, d = costs(), costs()
    for busy in (Work(queued=3, tokens=3000), Work(running=8)):
        decision = decide(p, Work(), 192, d, busy, 192)
        assert decision.where == REMOTE and decision.reason == "faster_remotely", busy
    assert decide(p, Work(queued=6, tokens=6000), 192, d, Work(queued=3, tokens=3000), 192).where != REMOTE


def test_a_slower_decode_instance_learns_its_own_costs() -> None:
    """Until D computed requests whole it borrows P's prefill line; once it has its own (3x slower), that counts."""
    p = costs()
    d = costs(prefill=None)
    assert decide(p, Work(), 300, d, Work(), 300).where != REMOTE
    d.prefill = learned(0.06, 0.003)
    assert decide(p, Work(), 300, d, Work(), 300).where == REMOTE


def test_the_bound_keeps_long_uncached_prompts_remote() -> None:
    p, d = costs(load=(0.5, 0.01)), costs(load=(0.5, 0.01))  # a slow link: the estimate alone would keep it local
    assert decide(p, Work(), 2000, d, Work(), 2000).where != REMOTE
    decision = decide(p, Work(), 2000, d, Work(), 2000, bound=1024)
    assert decision.where == REMOTE and decision.reason == "above_bound"
    assert decide(p, Work(), 2000, d, Work(), 1000, bound=1024).where != REMOTE


def router_of(prefill: int, decode: int, **options: object) -> tuple[Router, Balancer, Balancer]:
    config = ProxyConfig(prefill=tuple(f"http://p{i}:1" for i in range(prefill)),
                         decode=tuple(f"http://d{i}:1" for i in range(decode)), routing="estimate", **options)
    balancers = [Balancer.from_urls(role, urls, 5.0) for role, urls in ((PREFILL, config.prefill),
                                                                        (DECODE, config.decode))]
    router = Router(config, *balancers, Discovery(lambda: None, None), CollectorRegistry())  # type: ignore[arg-type]
    for upstream in balancers[0].upstreams + balancers[1].upstreams:
        upstream.costs = costs()
        upstream.cache_asked = float("inf")  # no background read of its /metrics
    return router, *balancers


def test_cache_affinity_counts_as_saved_work_not_as_a_preference() -> None:
    """Two prefill instances: P0 holds the prompt's prefix (3840 of 4200 tokens). Idle, P0 wins (3.8 s of prefill
    saved); with 6000 tokens queued there, the idle P1 finishes first and wins. A candidate not learned yet: the
    prefix rule chooses."""
    hint, prefix = prompt(4200), prompt(4000)
    router, prefill, _ = router_of(2, 1)
    p0, p1 = prefill.upstreams
    p0.prefix.add(prefix.chunks)
    choice = prefill.pick(hint=hint, score=router._prefill_scores(hint))
    assert choice is not None and (choice.upstream, choice.rule) == (p0, ESTIMATE)
    p0.prefix.clear()
    p0.prefix.add(prefix.chunks)
    p0.work.tokens = 6000
    choice = prefill.pick(hint=hint, score=router._prefill_scores(hint))
    assert choice is not None and choice.upstream is p1 and choice.passed_over
    p1.costs.prefill = LinearFit()
    choice = prefill.pick(hint=hint, score=router._prefill_scores(hint))
    assert choice is not None and choice.rule == PREFIX


def test_a_decode_instance_is_chosen_by_its_better_option() -> None:
    """Two decode instances, idle: the one holding the prefix wins (it computes 360 tokens, the other 4200). Both
    holding nothing, the one with 10 requests decoding loses (a local prefill would stall them). D0 holding the
    prefix but with 20000 tokens queued still wins when a prefill instance holds the prefix too: the remote path
    (P prefills 360 tokens, D0 loads 360) is cheap."""
    hint, prefix = prompt(4200), prompt(4000)
    router, prefill, decode = router_of(1, 2)
    d0, d1 = decode.upstreams
    d0.prefix.add(prefix.chunks)
    assert pick(decode, router._decode_scores(hint), hint) is d0
    d0.prefix.clear()
    d0.work.running = 10
    assert pick(decode, router._decode_scores(hint), hint) is d1
    for upstream in (*decode.upstreams, *prefill.upstreams):
        upstream.prefix.clear()
    d0.prefix.add(prefix.chunks)
    prefill.upstreams[0].prefix.add(prefix.chunks)
    d0.work.tokens = 20000
    assert pick(decode, router._decode_scores(hint), hint) is d0


def prompt(chars: int) -> Fingerprint:
    hint = fingerprint({"prompt": "x" * chars}, chat=False)
    assert hint is not None
    return hint


def pick(balancer: Balancer, score: Callable[[list[Upstream]], list[float] | None], hint: Fingerprint) -> Upstream:
    choice = balancer.pick(hint=hint, score=score)
    assert choice is not None and choice.rule == ESTIMATE
    upstream = choice.upstream
    upstream.prefix.clear()  # pick recorded the prompt there: undone, each case starts from what it set
    return upstream


def test_a_saturated_decode_instance_sends_whole_requests_to_an_idle_prefill_instance() -> None:
    """--decode-on-prefill: D's learned decode step is 90 ms (its core saturated), P's 30 ms: 64 tokens decode ~3.8 s
    sooner on P, far more than the load saved. Off, or with no output length, or before D's step is learned, the
    option is not offered."""
    p, d = costs(step=0.03), costs(step=0.09)
    busy_d = Work(running=6)
    decision = decide(p, Work(), 1216, d, busy_d, 1216, on_prefill=True, output_tokens=64)
    assert decision.where == "on_prefill" and decision.reason == "faster_on_prefill", decision
    assert decision.on_prefill is not None and decision.via is not None
    assert decision.on_prefill.cost < decision.via.cost
    for off in ({"on_prefill": False, "output_tokens": 64}, {"on_prefill": True, "output_tokens": None}):
        decision = decide(p, Work(), 1216, d, busy_d, 1216, **off)
        assert decision.where != "on_prefill" and decision.on_prefill is None, off
    unlearned = costs(step=0.09)
    unlearned.steps = MIN_SAMPLES - 1
    assert decide(p, Work(), 1216, unlearned, busy_d, 1216, on_prefill=True, output_tokens=64).on_prefill is None


def test_a_prefill_instance_busy_decoding_is_not_given_more() -> None:
    """P is decoding 8 requests (its step 120 ms, a prefill there stalls them), D decodes at 40 ms: the request is
    prefilled remotely or computed on D, not sent whole to P; a P that has not decoded yet borrows D's step."""
    p, d = costs(step=0.12), costs(step=0.04)
    decision = decide(p, Work(running=8), 1216, d, Work(running=2), 1216, on_prefill=True, output_tokens=64)
    assert decision.where in ("remote", "local") and decision.on_prefill is not None, decision
    fresh = costs()
    fresh.steps, fresh.step = 0, 0.0
    borrowed = decide(fresh, Work(), 1216, d, Work(running=2), 1216, on_prefill=True, output_tokens=64)
    assert borrowed.on_prefill is not None and borrowed.on_prefill.decode == 0.0  # the same step: no decode term


def test_the_bound_does_not_bound_the_prefill_instance() -> None:
    """--skip-prefill-below is a bound on computing on D: above it, the choice is remote or whole on P."""
    p, d = costs(step=0.03), costs(step=0.09)
    decision = decide(p, Work(), 1216, d, Work(running=6), 1216, bound=256, on_prefill=True, output_tokens=64)
    assert decision.where == "on_prefill" and decision.local is None
    assert decide(p, Work(), 1216, d, Work(), 1216, bound=256).reason == "above_bound"
