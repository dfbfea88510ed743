"""What the scheduler-side connector tells the worker-side connector each step (pickled by vLLM between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class SaveRequest:
    """Producer: the prompt of ``req_id`` is complete in these blocks after this step; insert it into the buffer."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class LoadRequest:
    """Consumer: take the producer's entry for these tokens and write it into ``block_ids`` (from ``start_block``)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start_block: int
    num_tokens: int  # tokens claimed, for the stats
    corrupt: bool = False  # test-only: flip the KV before writing it (see ConnectorOptions.allow_test_corruption)


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


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveRequest] = field(default_factory=list)
    loads: list[LoadRequest] = field(default_factory=list)
    pushes: list[PushStep] = field(default_factory=list)
    idle: bool = False  # nothing to compute in this step (the engine only waits for loads)
