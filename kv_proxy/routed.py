"""``Routed``: one request's routing bookkeeping, from its routing to its end, so the HTTP flow (``app``) only tells it
what happened: the instances reserved for it, where it goes, what each instance has queued because of it, and the
costs its answers teach (``--routing estimate``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kv_proxy.balancer import Balancer, Choice, Upstream
from kv_proxy.config import DECODE, PREFILL
from kv_proxy.estimate import ON_PREFILL, REMOTE
from kv_proxy.prefix_index import Fingerprint
from kv_proxy.routing import Router


@dataclass
class _Trip:
    """One attempt's way through the fleet (a retry makes a new one): the tokens each instance must compute (or
    load), and when each step started and ended (``time.monotonic()``)."""

    total: float  # the prompt's estimated tokens
    local: bool = False  # computed whole on its decode instance
    held: dict[str, tuple[Upstream, int]] = field(default_factory=dict)  # by role: the chosen instance, the prompt's
    # chunks it held when chosen (a choice records the prompt as held from then on)
    prefill: Upstream | None = None
    prefill_tokens: float = 0.0  # uncached on the prefill instance
    prefill_ahead: float = 0.0  # tokens queued there before it
    prefill_sent: float = 0.0
    prefill_done: float | None = None
    prefill_ok: bool = False  # the prefill answered (a load after it is a sample of the load's cost)
    decode: Upstream | None = None
    decode_tokens: float = 0.0  # uncached on the decode instance (computed there, or loaded)
    decode_ahead: float = 0.0
    decode_sent: float = 0.0
    first_token: float | None = None
    last_chunk: float = 0.0
    ended: bool = False


class Routed:
    """One request's routing, made by ``open``. Its stages, as the HTTP flow meets them:

    - ``open``: a decode instance reserved and the route decided (``where``: remote, local or on_prefill; on_prefill
      reserves the prefill instance that serves the request whole as its ``decode``);
    - ``reserve_prefill``: the prefill instance of a remote prefill;
    - ``prefill_sent`` / ``prefill_ended``: the prefill went to an instance (again if it failed over) / answered or
      failed;
    - ``decode_sent``, ``chunk``, ``answered``, ``decode_ended``: the decode went out, streamed a chunk, its instance
      answered the prompt (it holds its KV now), it ended;
    - ``retry``: the request goes again whole to a decode instance (a fresh attempt, a decode instance reserved);
    - ``release``: reservations never sent are given back (a request that ends early).

    A reservation counts the instance busy from its choice; once sent, the exchange with the instance (the proxy's
    ``send``, ``read_body`` and relays) gives it back, as it does for the instance it failed over to.
    """

    def __init__(self, router: Router, hint: Fingerprint | None, request_id: str) -> None:
        self.router = router
        self.hint = hint
        self.request_id = request_id
        self.where = REMOTE
        self._unsent: dict[str, tuple[Balancer, Upstream]] = {}  # by stage: reservations not sent yet
        self._trip = self._new_trip()
        self._prefill_trip = self._trip  # the attempt the prefill belongs to
        self.decode: Upstream  # the decode's instance (reserved by open, then sent); on_prefill: a prefill one
        self.decode_balancer: Balancer

    @classmethod
    def open(cls, router: Router, hint: Fingerprint | None, request_id: str,
             output_tokens: float | None = None) -> Routed:
        """A request routed: its decode instance reserved, and where it goes (``Router.route``)."""
        routed = cls(router, hint, request_id)
        choice = routed._reserve(DECODE)
        try:
            where, prefill = router.route(choice, hint, request_id, output_tokens)
        except BaseException:
            routed.release()
            raise
        if where == ON_PREFILL and prefill is not None:
            routed.release()  # the whole request goes to the prefill instance instead
            balancer = router.balancer(PREFILL)
            routed._trip.held[PREFILL] = (prefill, router.take(balancer, prefill, hint))
            routed.decode, routed.decode_balancer = prefill, balancer
            routed._unsent[DECODE] = (balancer, prefill)
        routed.where = where if where != ON_PREFILL or prefill is not None else REMOTE
        return routed

    # ---------------------------------------------------------------- reservations
    def _new_trip(self) -> _Trip:
        return _Trip(0.0 if self.hint is None else self.router.tokens(self.hint, cautious=True))

    def _reserve(self, stage: str) -> Choice:
        balancer = self.router.balancer(stage)
        choice = self.router.reserve(balancer, self.hint, self.request_id)
        self._trip.held[balancer.role] = (choice.upstream, choice.cached)
        self._unsent[stage] = (balancer, choice.upstream)
        if stage == DECODE:
            self.decode, self.decode_balancer = choice.upstream, balancer
        return choice

    def reserve_prefill(self) -> Upstream:
        """The prefill instance of a remote prefill, reserved."""
        self._prefill_trip = self._trip  # the prefill belongs to this attempt, even if it ends after a retry began
        return self._reserve(PREFILL).upstream

    def release(self, stage: str | None = None) -> None:
        """Give back the reservations of ``stage`` (prefill or decode; None: both) that were never sent."""
        for key in [stage] if stage is not None else [PREFILL, DECODE]:
            if (reserved := self._unsent.pop(key, None)) is not None:
                balancer, upstream = reserved
                balancer.release(upstream)

    def retry(self) -> None:
        """The request goes again, whole, to a decode instance: a fresh attempt (the failed one is off every queue)
        and a decode instance reserved."""
        self._trip = self._new_trip()
        self._reserve(DECODE)

    # ---------------------------------------------------------------- queues and costs
    def _to_compute(self, trip: _Trip, upstream: Upstream, pooled: bool = False) -> float:
        """The prompt's tokens ``upstream`` did not hold when it was chosen (all of them on an instance failed over
        to); ``pooled``: nor its KV pool holds (it loads those from the pool: as ``Router.uncached`` counts them)."""
        if self.hint is None:
            return 0.0
        chosen, chunks = trip.held.get(upstream.role, (None, 0))
        chunks = chunks if chosen is upstream else 0
        if pooled:
            chunks = max(chunks, self.router.pool_held(upstream, self.hint))
        held = self.router.tokens(self.hint, chunks * self.hint.chunk_units, cautious=True)
        return max(trip.total - held, 0.0)

    def prefill_sent(self, upstream: Upstream) -> None:
        """The prefill went to ``upstream`` (its reservation is the exchange's now): queued there until answered."""
        self._unsent.pop(PREFILL, None)
        trip = self._prefill_trip
        if trip.prefill is not None:  # it failed over to another instance
            trip.prefill.work.remove(trip.prefill_tokens)
        trip.prefill = upstream
        trip.prefill_tokens = self._to_compute(trip, upstream, pooled=True)  # a producer looks in its pool always
        trip.prefill_ahead = upstream.work.tokens
        trip.prefill_sent = time.monotonic()
        upstream.work.add(trip.prefill_tokens)

    def prefill_ended(self, answer: dict[str, Any] | None) -> None:
        """The prefill answered (``answer``, its JSON) or failed (None): off the queue; an answer is a sample of its
        prefill cost and calibrates the token estimates."""
        trip = self._prefill_trip
        upstream = trip.prefill
        if upstream is not None and trip.prefill_done is None:
            now = time.monotonic()
            trip.prefill_done = now
            upstream.work.remove(trip.prefill_tokens)
            trip.prefill_ok = answer is not None
            if answer is not None and self.hint is not None:
                upstream.costs.prefill.observe(trip.prefill_ahead + trip.prefill_tokens, now - trip.prefill_sent)
                self.router.publish(upstream)
                self.router.pool_answered(upstream, self.hint)  # a member stores the prompt it computed there
        if answer is not None:
            self.router.calibrate(self.hint, answer)

    def decode_sent(self, upstream: Upstream, local: bool, pooled: bool = False) -> None:
        """The decode request went to ``upstream`` (``local``: it computes the prompt itself; ``pooled``: all but
        what its KV pool holds); its reservation is the exchange's now."""
        self._unsent.pop(DECODE, None)
        self.decode = upstream
        trip = self._trip
        if trip.decode is not None:  # it failed over to another instance
            self._off_queue(trip)
        # on_prefill: a producer looks its prompts up in its pool whatever the params say
        pooled = local and (pooled or upstream.role == PREFILL)
        trip.decode, trip.local = upstream, local
        trip.decode_tokens = self._to_compute(trip, upstream, pooled)
        trip.decode_ahead = upstream.work.tokens
        trip.decode_sent = time.monotonic()
        upstream.work.add(trip.decode_tokens if local else 0.0)  # a load is no prefill work there

    @staticmethod
    def _off_queue(trip: _Trip) -> None:
        assert trip.decode is not None
        trip.decode.work.remove(trip.decode_tokens if trip.local else 0.0)

    def chunk(self) -> None:
        """A streamed chunk of the decode's answer came: the first one ends the prefill (or load) there, the next
        ones time its decode steps."""
        trip = self._trip
        if trip.decode is None or trip.ended:
            return
        now = time.monotonic()
        if trip.first_token is None:
            self._first_token(trip, now)
        else:
            trip.decode.costs.observe_step(now - trip.last_chunk)
        trip.last_chunk = now

    def _first_token(self, trip: _Trip, now: float) -> None:
        upstream = trip.decode
        assert upstream is not None
        trip.first_token = now
        self._off_queue(trip)
        upstream.work.running += 1
        if self.hint is None:
            return
        if trip.local:  # (pooled: the tokens it computed, the time with its load from the pool, as a producer's)
            upstream.costs.prefill.observe(trip.decode_ahead + trip.decode_tokens, now - trip.decode_sent)
        elif trip.prefill_ok and trip.prefill_done is not None:
            upstream.costs.load.observe(trip.decode_tokens, now - max(trip.decode_sent, trip.prefill_done))
        self.router.publish(upstream)

    def answered(self) -> None:
        """The decode's instance answered the prompt: it holds the prompt's KV now (and its KV pool, if any, once the
        request ends)."""
        upstream = self._trip.decode
        if upstream is not None and self.hint is not None:
            upstream.prefix.confirm(self.hint.chunks)
            self.router.pool_answered(upstream, self.hint)

    def decode_ended(self, answer: dict[str, Any] | None = None) -> None:
        """The decode's answer ended (``answer``: a whole answer's JSON, if it was not streamed). A whole answer gives
        its first token's time as its end less its other tokens' steps, if the instance's step is known."""
        trip = self._trip
        if trip.decode is None or trip.ended:
            return
        upstream = trip.decode
        if trip.first_token is None:
            usage = answer.get("usage") if isinstance(answer, dict) else None
            produced = usage.get("completion_tokens") if isinstance(usage, dict) else None
            now = time.monotonic()
            if isinstance(produced, int) and produced >= 1 and upstream.costs.steps:
                self._first_token(trip, max(now - (produced - 1) * upstream.costs.step, trip.decode_sent))
            else:  # no first token known: off the queue, never counted as running
                trip.ended = True
                self._off_queue(trip)
                return
        trip.ended = True
        upstream.work.running -= 1
