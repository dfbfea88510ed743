"""SimpleConnector: a vLLM v1 KV connector that ships each request's prompt KV from a kv_producer instance to a
kv_consumer instance through SimpleBuffer over MooncakePipe (pull mode).

Producer: in the step where a request's prefill completes (every chunk of a chunked prefill is in the paged cache
by then), the worker gathers the prompt's blocks of every layer and ``insert``s them keyed by the prompt's token ids.
Consumer: the scheduler claims all prompt tokens but the last (vLLM recomputes that one, so no hidden states are
needed) as an asynchronous load; the worker ``drop_select``s the entry in a background thread and writes the blocks
into the paged cache while other requests keep decoding. A miss, a timeout, a dead producer or a layout mismatch is
reported as a failed load, and vLLM recomputes the prompt: the answer is the same, only slower.

Push mode (``transfer_mode: "push"``): the producer also streams each layer's newly computed blocks to the consumer
while the prefill runs (``save_kv_layer``, through a PushBuffer on a second pipe), then commits the entry when the
prompt is complete; the consumer's load finds it already staged locally. An entry the consumer has no room for is
served by pull instead, and any push failure ends in the pull path or a recompute.

Blocks are copied whole (their inside is backend specific), so both instances must run the same model with the same
KV layout; the first transfer checks layers, block shape and dtype and refuses a mismatch with a clear error.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger

from kv_connector import block_copy
from kv_connector.metadata import LoadRequest, MooncakeConnectorMetadata, PushStep, SaveRequest
from kv_connector.options import ConnectorOptions
from kv_connector.stats import MooncakeConnectorStats
from kv_lookup_buffer import BufferClosed, SimpleBuffer
from kv_lookup_buffer.push_buffer import PushBuffer, PushedEntry, entry_key
from kv_pipe import ConfigError, MooncakePipe, MooncakeTransferEngineConfig, PipeError
from kv_pipe.config import CONFIG_ENV
from kv_pipe.memory import prefault

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

IDLE_WAIT = 0.01  # seconds a step with nothing to compute may wait for a pending load (instead of spinning)
PUSH_RANK_OFFSET = 50  # the push pipe of TP rank r uses the side-channel port of rank r + 50 (see docs/deployment.md)
CORRUPT_PARAM = "mooncake_corrupt_kv_for_testing"  # kv_transfer_params key; honoured only with allow_test_corruption
logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers and level apply


class _WarmMemory:
    """Host memory kept from use to use, grown as needed and faulted in once: on this kind of host, fresh pages for
    every KV-sized entry cost more than the copies into them (measured: 20-90 ms for 32 MiB, 50-500 ms for 128 MiB
    inside vLLM). One user at a time."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None  # free the smaller one first
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
            prefault(self.buf)
        return self.buf

    def drop(self) -> None:
        """Never hand this memory out again (the next ``get`` allocates)."""
        self.buf = None


class LayoutMismatch(RuntimeError):
    """The producer's KV blocks do not fit this instance's KV cache (another model, dtype or block size)."""


def model_fingerprint(vllm_config: VllmConfig) -> str:
    """Architecture plus a hash of the model's config (without its path): equal for the same model on any host."""
    hf = vllm_config.model_config.hf_config.to_dict()
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"):
        hf.pop(key, None)
    digest = hashlib.sha256(json.dumps(hf, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{'/'.join(hf.get('architectures') or ['?'])}:{digest}"


def _load_mooncake_config(options: ConnectorOptions) -> MooncakeTransferEngineConfig:
    if os.environ.get(CONFIG_ENV):
        return MooncakeTransferEngineConfig.load_from_env()
    if options.mooncake_config_path:
        return MooncakeTransferEngineConfig.from_file(options.mooncake_config_path)
    raise ConfigError(f"{CONFIG_ENV} is not set: point it at your mooncake.json (see mooncake.json.example), or set "
                      "kv_connector_extra_config.mooncake_config_path")


def _parse_layout(t: torch.Tensor | None) -> dict[str, Any]:
    """Decode and type-check a peer's layout descriptor (JSON; nothing in it is executed)."""
    try:
        if t is None or t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > 4096:
            raise ValueError("not a small 1-D uint8 tensor")
        layout = json.loads(bytes(t.tolist()).decode())
        if not (isinstance(layout, dict) and isinstance(layout.get("model"), str) and isinstance(layout.get("layers"), int)
                and isinstance(layout.get("block"), list) and isinstance(layout.get("dtype"), str)):
            raise ValueError(f"unexpected content {layout!r}")
    except (ValueError, UnicodeDecodeError) as e:
        raise LayoutMismatch(f"the producer sent no valid layout descriptor ({e}): is it running this connector?") from None
    return layout


class SimpleConnector(KVConnectorBase_V1):
    """See the module docstring. ``kv_role`` kv_producer or kv_consumer (kv_both is refused: one role per instance)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_role not in ("kv_producer", "kv_consumer"):
            raise ConfigError(f"kv_role {transfer.kv_role!r}: MooncakeConnector needs \"kv_producer\" (prefill instance) or "
                              "\"kv_consumer\" (decode instance)")
        self.is_producer = transfer.kv_role == "kv_producer"
        self.options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config)
        self.mooncake = _load_mooncake_config(self.options)  # fail at start-up, not on the first request
        self.push_mode = (self.options.transfer_mode or self.mooncake.transfer_mode) == "push"
        self.block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self.is_producer, self.block_size, self.push_mode)
            if not self.is_producer and transfer.kv_load_failure_policy != "recompute":
                # A consumer claims the prompt before it knows whether the producer holds it; a miss must recompute.
                logger.info("MooncakeConnector: setting kv_load_failure_policy=recompute (was %r) so that a failed KV "
                            "load falls back to recomputing the prompt", transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"
        else:
            self._worker = _WorkerSide(self, kv_cache_config)

    # ------------------------------------------------------------------ scheduler side (EngineCore process)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.forget(request.request_id)
        return False, None  # a save completes within its step (wait_for_save): blocks can be freed at once

    # ------------------------------------------------------------------ worker side (Worker process)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeConnectorMetadata)
        for load in meta.loads:
            self._worker.start_load(load)
        self._worker.plan_pushes(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request runs only after its load finished (get_finished)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Push mode: queue this layer's newly completed blocks for the consumer. (Pull mode saves once per request
        in wait_for_save, when every layer of the final chunk is written.)"""
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeConnectorMetadata)
        self._worker.push_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeConnectorMetadata)
        for save in meta.saves:
            self._worker.finish_prompt(save)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, MooncakeConnectorMetadata) and meta.idle
        done, failed = self._worker.collect_loads(IDLE_WAIT if idle else 0.0)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_kv_connector_stats(self) -> MooncakeConnectorStats | None:
        return self._worker.take_stats() if self.role == KVConnectorRole.WORKER else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> MooncakeConnectorStats | None:
        return MooncakeConnectorStats(data=data) if data is not None else MooncakeConnectorStats()

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._worker.close()


class _SchedulerSide:
    """Decides what to save and load; knows requests and blocks, never touches KV."""

    def __init__(self, is_producer: bool, block_size: int, push: bool = False) -> None:
        self.is_producer = is_producer
        self.block_size = block_size
        self.push = push
        self.prompts: dict[str, list[int]] = {}  # producer: prompts still prefilling
        self.pushing: set[str] = set()  # producer, push mode: prompts whose first step was announced to the worker
        self.local_hits: dict[str, int] = {}  # consumer: locally cached tokens when the load was claimed
        self.claimed: set[str] = set()  # consumer: one load attempt per request (a failed one is recomputed, not retried)
        self.loads: list[LoadRequest] = []  # consumer: loads to start in the next step

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.is_producer:
            return 0, False
        claim = len(request.prompt_token_ids or ()) - 1 - num_computed_tokens  # vLLM recomputes the last token
        if claim <= 0 or request.request_id in self.claimed:
            return 0, False
        self.local_hits[request.request_id] = num_computed_tokens
        return claim, True

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.is_producer:
            self.prompts[request.request_id] = list(request.prompt_token_ids or ())
        elif num_external_tokens > 0:
            self.claimed.add(request.request_id)
            local = self.local_hits.pop(request.request_id, 0)
            corrupt = bool((request.kv_transfer_params or {}).get(CORRUPT_PARAM))
            self.loads.append(LoadRequest(request.request_id, list(request.prompt_token_ids or ()),
                                          list(blocks.get_block_ids()[0]), local // self.block_size, num_external_tokens,
                                          corrupt))

    def build_meta(self, out: SchedulerOutput) -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata(loads=self.loads, idle=out.total_num_scheduled_tokens == 0)
        self.loads = []
        if not self.is_producer:
            return meta
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, start in starts.items():
            prompt = self.prompts.get(req_id)
            end = start + out.num_scheduled_tokens.get(req_id, 0)
            if prompt is None or start >= len(prompt):
                continue
            block_ids = list(out.kv_connector_block_state.get_block_ids(req_id)[0][:-(-len(prompt) // self.block_size)])
            if self.push:
                first = req_id not in self.pushing
                self.pushing.add(req_id)
                meta.pushes.append(PushStep(req_id, block_ids, min(end, len(prompt)), len(prompt),
                                            prompt if first else None))
            if len(prompt) <= end:  # the step that completes this prompt
                meta.saves.append(SaveRequest(req_id, prompt, block_ids))
                del self.prompts[req_id]
                self.pushing.discard(req_id)
        return meta

    def forget(self, req_id: str) -> None:
        self.prompts.pop(req_id, None)
        self.pushing.discard(req_id)
        self.local_hits.pop(req_id, None)
        self.claimed.discard(req_id)


@dataclass
class _PushState:
    key: bytes
    num_blocks: int
    next_block: int = 0  # blocks before this one are queued


class _WorkerSide:
    """Owns the pipe, the buffer and the KV cache tensors; saves synchronously, loads in a background thread."""

    def __init__(self, connector: SimpleConnector, kv_cache_config: KVCacheConfig | None) -> None:
        self.connector = connector
        self.num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        self.layers: list[torch.Tensor] = []
        self.block_dim = 0
        self.buffer: SimpleBuffer | None = None
        self.pipe: MooncakePipe | None = None
        self.loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncake-kv-load")
        self.loading: dict[str, Future[tuple[bool, list[int]]]] = {}
        self.stats = MooncakeConnectorStats()
        self.stats_lock = threading.Lock()
        self.layout_checked = False
        self.layout: dict[str, Any] = {}  # this instance's; sent with every entry, compared on every load
        # push mode
        self.push: PushBuffer | None = None
        self.push_pipe: MooncakePipe | None = None
        self.layer_index: dict[str, int] = {}
        self.pushing: dict[str, _PushState] = {}  # producer: requests being pushed
        self.step_pushes: list[tuple[bytes, int, list[int]]] = []  # producer: (key, first block, block ids) this step
        self.planned_for: MooncakeConnectorMetadata | None = None
        self.scratch = _WarmMemory()  # producer: pull saves gather into it
        self.recv_scratch = _WarmMemory()  # consumer: pulled entries are received into it

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # noqa: PLC0415

        interval = self.connector.options.gil_switch_interval
        if interval and interval < sys.getswitchinterval():
            # The KV moves in a side thread of this process while vLLM's engine loop keeps the GIL busy (it steps
            # continuously while a load is pending): at Python's default 5 ms switch interval every hand-over of the
            # GIL to that thread costs up to 5 ms, and a transfer needs dozens (measured: 146-180 ms instead of ~40 ms
            # for 32 MiB). A short interval only matters while two threads want the GIL.
            logger.info("MooncakeConnector: Python thread switch interval %.2f ms -> %.2f ms (gil_switch_interval)",
                        sys.getswitchinterval() * 1e3, interval * 1e3)
            sys.setswitchinterval(interval)
        self.layers = list(kv_caches.values())
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        first = self.layers[0]
        num_blocks = self.num_blocks or first.shape[0]
        self.block_dim = next((d for d, n in enumerate(first.shape) if n == num_blocks), 0)
        self.block_bytes = first.numel() // first.shape[self.block_dim] * first.element_size()  # one layer's block
        self.layout = {"model": model_fingerprint(self.connector._vllm_config), "layers": len(self.layers),
                       "block": list(self._block_shape()), "dtype": str(first.dtype)}
        rank = get_tensor_model_parallel_rank()
        opts, producer = self.connector.options, self.connector.is_producer
        self.pipe = MooncakePipe(local_rank=rank, kv_rank=0 if producer else 1, config=self.connector.mooncake)
        self.buffer = SimpleBuffer(self.pipe, self.pipe, opts.buffer_size, timeout=opts.save_timeout,
                                   role="producer" if producer else "consumer")
        if producer:
            self.buffer.start_serving()
        if self.connector.push_mode:
            self.push_pipe = MooncakePipe(local_rank=rank + PUSH_RANK_OFFSET, kv_rank=0 if producer else 1,
                                          config=self.connector.mooncake)
            self.push = PushBuffer(self.push_pipe, "producer" if producer else "consumer",
                                   capacity=opts.push_staging_size, ttl=opts.push_ttl)
        logger.info("MooncakeConnector %s (TP rank %d): %d layers of %s %s, blocks along dim %d, pipe %s",
                    "producer" if producer else "consumer", rank, len(self.layers), list(first.shape), first.dtype,
                    self.block_dim, f"{self.pipe.host}:{self.pipe.port}" + (
                        f", push mode on {self.push_pipe.host}:{self.push_pipe.port}" if self.push_pipe else ""))

    def _layout_tensor(self) -> torch.Tensor:
        """The layout descriptor as JSON bytes: it rides in the entry's ``value`` slot (the blocks, K and V together as
        the backend stores them, ride in ``key``)."""
        return torch.frombuffer(bytearray(json.dumps(self.layout, sort_keys=True).encode()), dtype=torch.uint8)

    def _block_shape(self) -> tuple[int, ...]:
        shape = list(self.layers[0].shape)
        del shape[self.block_dim]
        return tuple(shape)

    # ---------------------------------------------------------------- producer
    def finish_prompt(self, req: SaveRequest) -> None:
        """The prompt of ``req`` is complete: commit its push, or save it for pull (and tell a push consumer so)."""
        state = self.pushing.pop(req.req_id, None)
        if self.push is None:
            self.save(req)
            return
        if state is not None and state.next_block < state.num_blocks:
            logger.warning("MooncakeConnector: request %s completed with %d of %d blocks pushed: serving it by pull",
                           req.req_id, state.next_block, state.num_blocks)
        elif state is not None and not self.push.failed(state.key):
            self.push.commit(state.key, len(req.token_ids), self._layout_tensor())
            self._count("pushed")
            return
        self.save(req)  # before the notice: the consumer's drop_select must find it
        self.push.notify_pull(state.key if state else entry_key(req.token_ids))

    def plan_pushes(self, meta: MooncakeConnectorMetadata) -> None:
        """Push mode: decide which blocks each layer pushes in this step (once per step, before the first layer's
        push: vLLM calls start_load_kv after the forward pass when a step has no synchronous load)."""
        if self.push is None or self.planned_for is meta:
            return
        self.planned_for = meta
        self.step_pushes = []
        for step in meta.pushes:
            if step.token_ids is not None:  # the request's first step: announce it if the consumer has room
                key = entry_key(step.token_ids)
                nblocks = -(-step.prompt_len // self.connector.block_size)
                nbytes = self._kv_bytes(nblocks)
                if self.push.begin(key, nbytes, len(self.layers), nblocks):
                    self.pushing[step.req_id] = _PushState(key, nblocks)
                else:
                    logger.info("MooncakeConnector: no push room on the consumer for request %s (%.1f MiB): pull",
                                step.req_id, nbytes / 2**20)
            state = self.pushing.get(step.req_id)
            if state is None:
                continue
            upto = state.num_blocks if step.end >= step.prompt_len else step.end // self.connector.block_size
            if upto > state.next_block:
                self.step_pushes.append((state.key, state.next_block, step.block_ids[state.next_block:upto]))
                state.next_block = upto

    def push_layer(self, layer_name: str, meta: MooncakeConnectorMetadata) -> None:
        """Push mode, after a layer's attention wrote its KV: queue that layer's blocks planned for this step."""
        if self.push is None or not meta.pushes:
            return
        self.plan_pushes(meta)
        index = self.layer_index.get(layer_name)
        if index is None:
            return
        for key, first, ids in self.step_pushes:
            piece = block_copy.gather([self.layers[index]], self.block_dim, ids)[0]
            self.push.push(key, index, first, piece, len(ids))

    def save(self, req: SaveRequest) -> None:
        assert self.buffer is not None
        start = time.perf_counter()
        # Gather into reused scratch memory, then insert copies it into memory the buffer recycles: two copies into
        # warm pages cost less than one into fresh pages (measured: ~8 ms vs ~20-90 ms for 32 MiB).
        scratch = self.scratch.get(self._kv_bytes(len(req.block_ids)))
        kv = block_copy.gather(self.layers, self.block_dim, req.block_ids, scratch)
        try:
            self.buffer.insert(torch.tensor(req.token_ids, dtype=torch.int64), None, kv, self._layout_tensor(), None)
        except (TimeoutError, BufferClosed, PipeError) as e:
            logger.warning("MooncakeConnector: dropped the KV of request %s (%d tokens): %s", req.req_id,
                           len(req.token_ids), e)
            self._count("save_dropped")
            return
        seconds = time.perf_counter() - start
        nbytes = kv.numel() * kv.element_size()
        self._record("saved", len(req.token_ids), nbytes, seconds)
        logger.info("MooncakeConnector: saved request %s: %d tokens, %d blocks, %.1f MiB in %.1f ms", req.req_id,
                    len(req.token_ids), len(req.block_ids), nbytes / 2**20, seconds * 1e3)

    # ---------------------------------------------------------------- consumer
    def start_load(self, req: LoadRequest) -> None:
        self.loading[req.req_id] = self.loader.submit(self._load, req)

    def _load(self, req: LoadRequest) -> tuple[bool, list[int]]:
        """Fetch and write one request's KV; returns (ok, block ids not written). Never raises."""
        assert self.buffer is not None
        start = time.perf_counter()
        wanted = req.block_ids[req.start_block:]
        if self.push is not None:
            entry = self.push.take(entry_key(req.token_ids), self.connector.options.push_wait)
            if entry is not None:
                return self._load_pushed(req, entry, start, time.perf_counter() - start)
        try:
            tokens = torch.tensor(req.token_ids, dtype=torch.int64)
            # One buffer from load to load (they run one at a time); a larger entry than expected still arrives
            # (the pipe then allocates for it).
            key_out = self.recv_scratch.get(self._kv_bytes(len(req.block_ids)))
            try:
                _, _, kv, layout, _ = self.buffer.drop_select(tokens, None, key_out=key_out)
            except BaseException:
                self.recv_scratch.drop()  # writes may still land in it for a while: never reuse it (the pipe holds it)
                raise
            fetched = time.perf_counter()
            if kv is None:
                logger.info("MooncakeConnector: the producer holds no KV for request %s (%d tokens): recomputing",
                            req.req_id, len(req.token_ids))
                self._count("load_misses")
                return False, wanted
            self._check_layout(kv, layout)
            n = min(kv.shape[1 + self.block_dim], len(wanted))
            if req.corrupt and self.connector.options.allow_test_corruption:
                kv = kv.flip(-1)  # test-only control: proves the consumer really uses the transferred KV
                logger.warning("MooncakeConnector: corrupting the KV of request %s on purpose (test switch)", req.req_id)
            block_copy.scatter(self.layers, self.block_dim, wanted[:n], kv)
        except LayoutMismatch as e:
            logger.error("MooncakeConnector: %s; recomputing request %s", e, req.req_id)
            self._count("load_failures")
            return False, wanted
        except (PipeError, BufferClosed, TimeoutError, ValueError) as e:
            logger.warning("MooncakeConnector: loading the KV of request %s failed (%s): recomputing", req.req_id, e)
            self._count("load_failures")
            return False, wanted
        seconds = time.perf_counter() - start
        nbytes = kv.numel() * kv.element_size()
        self._record("loaded", req.num_tokens, nbytes, seconds)
        logger.info("MooncakeConnector: loaded request %s: %d tokens, %.1f MiB in %.1f ms (%.2f GB/s; fetch %.1f ms, "
                    "copy into the KV cache %.1f ms)", req.req_id, req.num_tokens, nbytes / 2**20, seconds * 1e3,
                    nbytes / seconds / 1e9, (fetched - start) * 1e3, (start + seconds - fetched) * 1e3)
        return n == len(wanted), wanted[n:]

    def _kv_bytes(self, nblocks: int) -> int:
        """Bytes of ``nblocks`` blocks of every layer (one entry's KV)."""
        return nblocks * len(self.layers) * self.block_bytes

    def _load_pushed(self, req: LoadRequest, entry: PushedEntry, start: float, waited: float) -> tuple[bool, list[int]]:
        """Write a pushed entry's pieces into the request's blocks; the same checks and fallbacks as a pulled one."""
        wanted = req.block_ids[req.start_block:]
        end = req.start_block + len(wanted)
        covered = [0] * len(self.layers)
        jobs: list[tuple[list[torch.Tensor], list[int], torch.Tensor]] = []
        try:
            self._check_layout(None, entry.meta)
            for layer, first, blocks in entry.pieces:
                shape = list(blocks.shape)
                count = shape.pop(self.block_dim) if blocks.dim() > self.block_dim else -1
                if layer >= len(self.layers) or blocks.dtype != self.layers[0].dtype or shape != list(self._block_shape()):
                    raise LayoutMismatch(f"a pushed piece (layer {layer}, {list(blocks.shape)} {blocks.dtype}) does not "
                                         "fit this instance's KV cache")
                lo, hi = max(first, req.start_block), min(first + count, end)
                if lo >= hi:
                    continue
                if req.corrupt and self.connector.options.allow_test_corruption:
                    blocks = blocks.flip(-1)
                jobs.append(([self.layers[layer]], req.block_ids[lo:hi],
                             blocks.narrow(self.block_dim, lo - first, hi - lo).unsqueeze(0)))
                covered[layer] += hi - lo
            if any(n != len(wanted) for n in covered):
                raise ValueError(f"the pushed entry covers {min(covered)} of the {len(wanted)} blocks wanted")
            for layers, ids, blocks in jobs:  # the KV is local: what is left of the request's wait is this copy
                block_copy.scatter(layers, self.block_dim, ids, blocks)
        except LayoutMismatch as e:
            logger.error("MooncakeConnector: %s; recomputing request %s", e, req.req_id)
            self._count("load_failures")
            return False, wanted
        except ValueError as e:
            logger.warning("MooncakeConnector: the pushed KV of request %s is unusable (%s): recomputing", req.req_id, e)
            self._count("load_failures")
            return False, wanted
        if req.corrupt and self.connector.options.allow_test_corruption:
            logger.warning("MooncakeConnector: corrupted the KV of request %s on purpose (test switch)", req.req_id)
        seconds = time.perf_counter() - start
        nbytes = entry.received
        self._record("loaded", req.num_tokens, nbytes, seconds)
        self._count("push_loaded")
        logger.info("MooncakeConnector: loaded request %s (pushed): %d tokens, %.1f MiB in %.1f ms (waited %.1f ms for "
                    "the push to complete, copied from the staging area in %.1f ms)", req.req_id, req.num_tokens,
                    nbytes / 2**20, seconds * 1e3, waited * 1e3, (seconds - waited) * 1e3)
        return True, []

    def _check_layout(self, kv: torch.Tensor | None, layout: torch.Tensor | None) -> None:
        theirs = _parse_layout(layout)
        actual: dict[str, Any] = {}
        if kv is not None:
            block = list(kv.shape[1:])
            del block[self.block_dim]
            actual = {"layers": kv.shape[0], "block": block, "dtype": str(kv.dtype)}
        if any(theirs.get(k) != v for k, v in actual.items()):
            raise LayoutMismatch(f"the producer's entry contradicts its own layout ({theirs} vs tensor {actual})")
        diff = {k: (theirs.get(k), mine) for k, mine in self.layout.items() if theirs.get(k) != mine}
        if diff:
            described = ", ".join(f"{k}: producer {a} vs this instance {b}" for k, (a, b) in diff.items())
            raise LayoutMismatch(f"the producer's KV layout differs from this instance's ({described}): run the same "
                                 "model, dtype and block size on both instances")
        if not self.layout_checked:
            self.layout_checked = True
            logger.info("MooncakeConnector: the producer's KV layout matches (%s)", self.layout)

    def collect_loads(self, wait: float = 0.0) -> tuple[set[str], set[str]]:
        """Finished loads as (done, failed). ``wait``: block up to that long for one to finish (used when the step had
        nothing to compute: vLLM would otherwise spin its engine loop, taking the CPU and the GIL from the load)."""
        if wait and self.loading:
            futures_wait(list(self.loading.values()), timeout=wait, return_when=FIRST_COMPLETED)
        done, failed = set(), set()
        for req_id, future in list(self.loading.items()):
            if future.done():
                del self.loading[req_id]
                ok, _ = future.result()
                done.add(req_id)
                if not ok:
                    failed.add(req_id)
        return done, failed

    # ---------------------------------------------------------------- stats, shutdown
    def _count(self, name: str) -> None:
        with self.stats_lock:
            self.stats.count(name)

    def _record(self, name: str, tokens: int, nbytes: int, seconds: float) -> None:
        with self.stats_lock:
            self.stats.count(name)
            self.stats.record(tokens, nbytes, seconds)

    def take_stats(self) -> MooncakeConnectorStats | None:
        with self.stats_lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, MooncakeConnectorStats()
        return stats

    def close(self) -> None:
        self.loader.shutdown(wait=False, cancel_futures=True)
        if self.push is not None:
            self.push.close()
        if self.push_pipe is not None:
            self.push_pipe.close()
        if self.buffer is not None:
            self.buffer.close()
        if self.pipe is not None:
            self.pipe.close()
