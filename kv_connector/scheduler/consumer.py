"""The consumer's scheduler side (vLLM's EngineCore process of the decode instance): decides what to load; knows
requests and block ids, never touches KV. Find before you claim: a request's first ask sends a lookup to the
workers, and vLLM hears ``None`` until every rank answered; then the request claims what was found beyond its own
prefix-cache hit as one asynchronous load under the lookup's lease (one attempt: a failed load is not retried).

The protocol, its deadlines and leases: docs/architecture.md (Find before you claim).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from kv_connector import params as kv_params
from kv_connector import prompt_blocks as blocks
from kv_connector.metadata import (
    LeaseRelease,
    LoadRequest,
    LookupRequest,
    MooncakeConnectorMetadata,
    MooncakeWorkerMetadata,
)
from kv_connector.scheduler.pool import poolable
from kv_connector.source import LoadSource, load_source

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kv_connector.config import ConnectorConfig

logger = init_logger(f"vllm.{__name__}")


ANSWER_MARGIN = 1.0  # seconds past lookup_timeout the scheduler waits for the workers' answers before giving up
CLAIM_SLACK = 3.0  # seconds an answer may still be claimed after the latest it could come (then it is asked again)
LEASE_SLACK = 5.0  # seconds a lease outlives the load it is for (the load's request reaching the producer)
MAX_LEASE = 600.0  # the producer's cap (simple_wire.MAX_LEASE_MS)
LOOKUPS_PER_STEP = 32  # lookups sent in one step at most (the others are asked again next step)


@dataclass
class _Lookup:
    """A request's lookup, from its first ask until its load starts or it ends; one lease for all of it (asking again
    renews the producer's hold on the same entry)."""

    lease: int
    source: LoadSource
    asked: float  # time.monotonic() when it was (last) sent to the workers
    answers: dict[int, int] = field(default_factory=dict)  # TP rank -> tokens its producers hold
    pool: dict[int, int] = field(default_factory=dict)  # TP rank -> tokens the KV pool holds for it


class ConsumerScheduler:
    """``recompute``: how many of a prompt's last tokens this instance computes itself (at least the last one).
    A lookup's answer may be claimed for ``claim_window`` seconds after it was asked (answers come within
    ``lookup_timeout`` plus a margin); a lease lasts that, plus ``load_timeout`` (the load, from the claim), plus
    ``LEASE_SLACK``, so it never ends before the load it was for. A lease no load will use is released."""

    def __init__(self, config: ConnectorConfig, block_size: int, recompute: int = 1,
                 pool_found: Callable[[str, int], None] | None = None) -> None:
        self.config = config
        self.pool_found = pool_found  # told what the pool holds of a request's prompt (``scheduler.pool``)
        self.block_size = block_size
        self.recompute = max(recompute, 1)
        self.tp = config.tp_size
        self.answer_wait = config.options.lookup_timeout + ANSWER_MARGIN
        self.claim_window = self.answer_wait + CLAIM_SLACK
        self.lease_seconds = min(self.claim_window + config.options.load_timeout + LEASE_SLACK, MAX_LEASE)
        self.lookups: dict[str, _Lookup] = {}  # asked, no load started yet
        self.to_look: list[LookupRequest] = []  # lookups to send in the next step
        self.to_release: list[LeaseRelease] = []  # leases no load will use, to release in the next step
        self.claims: dict[str, tuple[LoadSource, int, bool]] = {}  # claimed, not allocated: (source, local hit,
        # from the pool)
        self.claimed: set[str] = set()  # one load attempt per request
        self.loading: set[str] = set()  # loads started and not reported finished (``finished_recving``)
        self.loads: list[LoadRequest] = []  # loads to start in the next step

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``num_computed_tokens``: this instance's own prefix-cache hit, block aligned (vLLM passes it so)."""
        req_id = request.request_id
        prompt_len = len(request.prompt_token_ids or ())
        if blocks.claim_tokens(prompt_len, num_computed_tokens, self.recompute) <= 0 or req_id in self.claimed \
                or getattr(request, "skip_reading_prefix_cache", False):  # vLLM would drop a claim: nothing asked
            return 0, False
        try:
            source = load_source(request.kv_transfer_params, self.config)
        except kv_params.ParamsError as e:
            logger.error("MooncakeConnector: request %s: unusable kv_transfer_params (%s): recomputing its prompt",
                         req_id, e)
            self.claimed.add(req_id)
            return 0, False
        if source is None or (source.pool_only and not poolable(request)):  # nothing to load from anywhere
            self.claimed.add(req_id)
            return 0, False
        if source.await_push or source.pushed:  # its producer pushes it here: claimed now, the load waits for it
            self.claims[req_id] = (source, num_computed_tokens, False)
            return blocks.claim_tokens(prompt_len, num_computed_tokens, self.recompute), True
        answer = self._found(request, source)
        if answer is None:
            return None, False
        held, pooled = answer
        if pooled and self.pool_found is not None:
            self.pool_found(req_id, pooled)
        from_pool = pooled > held  # the longest prefix held, from where it is held
        found = max(held, pooled)
        end = min(found, prompt_len - self.recompute)
        if end < prompt_len - self.recompute:  # a prefix of the prompt: whole blocks of it only
            end -= end % self.block_size
        claim = end - num_computed_tokens
        logger.debug("MooncakeConnector: request %s: the producer holds %d of its %d tokens, the pool %d, %d in the "
                     "prefix cache: claims %d%s", req_id, held, prompt_len, pooled, num_computed_tokens, max(claim, 0),
                     " from the pool" if from_pool else "")
        if claim <= 0:
            self.claimed.add(req_id)
            self._release(req_id)
            return 0, False
        self.claims[req_id] = (source, num_computed_tokens, from_pool)
        return claim, True

    def _found(self, request: Request, source: LoadSource) -> tuple[int, int] | None:
        """Tokens of the prompt the producers hold for this request, and the pool holds (each the least any rank
        found); None while that is not known yet (a lookup is sent, or on its way)."""
        req_id = request.request_id
        now = time.monotonic()
        lookup = self.lookups.get(req_id)
        if lookup is not None and len(lookup.answers) >= self.tp:
            if now - lookup.asked <= self.claim_window:
                return min(lookup.answers.values()), min(lookup.pool.values(), default=0)
            # answered too long ago (vLLM could not schedule the request): the lease may end before a load started
            # now; asked again under the same lease, which renews the producer's hold on the same entry
            lookup.answers, lookup.pool = {}, {}
        elif lookup is not None:
            if now - lookup.asked <= self.answer_wait:
                return None
            logger.warning("MooncakeConnector: request %s: no answer to its lookup within %.1f s (%d of %d TP ranks "
                           "answered): computing its prompt here", req_id, self.answer_wait, len(lookup.answers),
                           self.tp)
            return 0, 0
        if len(self.to_look) >= LOOKUPS_PER_STEP:
            return None  # asked next step
        if lookup is None:
            lookup = self.lookups[req_id] = _Lookup(secrets.randbits(62) + 1, source, now)
        lookup.asked = now
        self.to_look.append(LookupRequest(req_id, lookup.lease, list(request.prompt_token_ids or ()), source,
                                          self.lease_seconds, pool=self.config.looks_in_pool and poolable(request)))
        return None

    def _release(self, req_id: str) -> None:
        """The request's lookup, if it sent one, will have no load: its lease is released at the producers."""
        lookup = self.lookups.pop(req_id, None)
        if lookup is not None and not lookup.source.pool_only:
            self.to_release.append(LeaseRelease(lookup.lease, lookup.source))

    def received(self, req_ids: set[str]) -> None:
        """vLLM's ``finished_recving``: these loads ended (written or failed)."""
        self.loading -= req_ids

    def answered(self, meta: MooncakeWorkerMetadata) -> None:
        """The workers' answers to lookups (vLLM's ``update_connector_output``)."""
        for answer in meta.lookups:
            lookup = self.lookups.get(answer.req_id)
            if lookup is not None and lookup.lease == answer.lease:  # else an earlier lookup's, or a forgotten one
                lookup.answers[answer.rank] = answer.tokens
                lookup.pool[answer.rank] = answer.pool_tokens

    def after_alloc(self, request: Request, kv_blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        claim = self.claims.pop(request.request_id, None)
        if claim is None or num_external_tokens <= 0:
            return  # no load (yet): a lookup stays for the next ask, or is released when the request ends
        source, local, from_pool = claim
        if from_pool:
            self._release(request.request_id)  # the producer's entry is not used: its lease ends now
            lookup = None
        else:
            lookup = self.lookups.pop(request.request_id, None)  # the load takes the entry under its lease
        self.claimed.add(request.request_id)
        first, end = blocks.load_span(local, num_external_tokens, self.block_size)
        block_ids = list(kv_blocks.get_block_ids()[0])  # every block of the request, the cached ones first
        self.loading.add(request.request_id)
        if self.pool_found is not None and not from_pool and not source.pool_only:
            # what comes from a producer's hand-off is the producer's to store (every member stores what it computed)
            self.pool_found(request.request_id, local + num_external_tokens)
        self.loads.append(LoadRequest(request.request_id, list(request.prompt_token_ids or ()), first,
                                      block_ids[first:end], num_external_tokens, source,
                                      lease=0 if lookup is None else lookup.lease, from_pool=from_pool))

    def build_meta(self, out: SchedulerOutput) -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata(loads=self.loads, lookups=self.to_look, releases=self.to_release,
                                         idle=out.total_num_scheduled_tokens == 0)
        self.loads, self.to_look, self.to_release = [], [], []
        return meta

    def finished(self, request: Request) -> dict[str, Any] | None:
        """A request ended: forget it, releasing a lease no load used (a consumer answers no params)."""
        self._release(request.request_id)
        self.claims.pop(request.request_id, None)
        self.claimed.discard(request.request_id)
        return None
