"""What the scheduler-side connector tells the worker-side connector each step, and what the workers answer (pickled
by vLLM between its own processes; nothing here crosses to another instance). Plain dataclasses: the worker's data
path runs without vLLM (``mooncake_connector.py`` registers ``MooncakeConnectorMetadata`` as vLLM's ``KVConnectorMetadata``
and ``MooncakeWorkerMetadata`` as its ``KVConnectorWorkerMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_connector.source import LoadSource


@dataclass
class SaveRequest:
    """Producer: the prompt of ``req_id`` is complete in these blocks (one per prompt block) after this step."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class LoadRequest:
    """Consumer: write the producer's KV for prompt blocks ``first_block`` .. ``first_block + len(block_ids) - 1``
    into ``block_ids``. The blocks before ``first_block`` are in this instance's own prefix cache already."""

    req_id: str
    token_ids: list[int]  # the whole prompt: the producer's entry is found by it
    first_block: int
    block_ids: list[int]
    num_tokens: int  # tokens claimed
    source: LoadSource  # the producer it reads from (``source.load_source``)
    lease: int = 0  # the lease under which the lookup found the producer's entry (0: none, e.g. an awaited push)
    from_pool: bool = False  # read from the KV pool (Mooncake Store), not from the producer


@dataclass
class LookupRequest:
    """Consumer: ask the producer(s) ``source`` names how much of this prompt they hold, and have them hold it for
    ``lease`` for ``lease_seconds`` (find before you claim: ``scheduler.consumer``). Every TP rank asks the producer
    ranks it would load from."""

    req_id: str
    lease: int
    token_ids: list[int]
    source: LoadSource
    lease_seconds: float
    pool: bool = True  # ask the KV pool too (if there is one): its KV is its token ids' alone (``scheduler.pool``)


@dataclass
class LeaseRelease:
    """Consumer: no load will use ``lease`` (its request ended, its prefix cache held what was found, or its lookup
    was given up): the producer(s) ``source`` names may let the entry they hold for it go."""

    lease: int
    source: LoadSource


@dataclass
class LookupAnswer:
    """Worker -> scheduler: what one TP rank's lookup found: the producer holds ``tokens`` of the prompt's tokens
    for it (0: nothing, or the lookup failed: ``error`` says why)."""

    req_id: str
    lease: int
    rank: int
    tokens: int
    error: str = ""
    pool_tokens: int = 0  # tokens of the prompt (whole blocks from its start) the KV pool holds for this rank


@dataclass
class PoolSave:
    """Any role with a KV pool: store blocks ``block_ids`` (whole blocks of computed KV of the tokens ``token_ids``)
    in the pool, from block ``first_block`` (the ones before it are known to be there). ``in_step``: the step
    completes the request's prompt: copied out after its forward pass, while the request goes on. Else the request
    ended: vLLM holds the blocks until the workers report it in ``finished_sending`` (``scheduler.pool``)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    first_block: int = 0
    in_step: bool = False


@dataclass
class MooncakeWorkerMetadata:
    """What the workers tell the scheduler-side connector each step (vLLM's ``KVConnectorWorkerMetadata``, which
    ``mooncake_connector.py`` registers this as): the answers of lookups that ended. vLLM adds up every rank's."""

    lookups: list[LookupAnswer] = field(default_factory=list)

    def aggregate(self, other: MooncakeWorkerMetadata) -> MooncakeWorkerMetadata:
        return MooncakeWorkerMetadata(self.lookups + other.lookups)


@dataclass
class PushStep:
    """Producer, push mode: this step computes prompt tokens of ``req_id`` up to ``end``. The worker pushes the blocks
    that become complete (all remaining ones when ``end`` reaches the prompt's end); ``token_ids`` (the whole prompt)
    comes with the request's first step, which also pushes the blocks of a locally cached prefix."""

    req_id: str
    block_ids: list[int]
    end: int
    prompt_len: int
    token_ids: list[int] | None = None
    push_to: list[str] | None = None  # the consumer's pipe per TP rank (from the params); None: mooncake.json's;
    # []: not pushed (the params named a consumer of another TP size): saved for pull


@dataclass
class MooncakeConnectorMetadata:
    saves: list[SaveRequest] = field(default_factory=list)
    loads: list[LoadRequest] = field(default_factory=list)
    lookups: list[LookupRequest] = field(default_factory=list)
    releases: list[LeaseRelease] = field(default_factory=list)
    pushes: list[PushStep] = field(default_factory=list)
    # producer, push mode: requests that ended before their prompt was complete (aborted mid-prefill): their pushes
    # end (the consumer frees what it staged)
    abandoned: list[str] = field(default_factory=list)
    idle: bool = False  # nothing to compute in this step (the engine only waits for loads)
    # producer: requests that ended and whose blocks vLLM holds until the workers report them in finished_sending,
    # once their copies out of the cache ended (a GPU cache: ``staging``)
    held: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # producer: requests preempted since the last step
    pool_saves: list[PoolSave] = field(default_factory=list)  # requests whose blocks go into the KV pool
