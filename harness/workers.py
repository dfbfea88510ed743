"""Connector workers without vLLM (``kv_connector.worker.connector_worker.ConnectorWorker`` over a KV cache of plain
tensors), driven in the order vLLM 0.32's model runner drives them
(``KVConnectorModelRunnerMixin._get_kv_connector_output``; a step of this connector has no synchronous load, so
``start_load_kv`` comes after the forward pass): bind the step's metadata, the forward pass (``save_layer`` per
layer), ``start_step`` (vLLM's ``start_load_kv``), ``wait_for_save``, ``transfer_results``. Loads are steps with no
forward. Finished requests a producer holds are reported in a later step's ``transfer_results`` (``finish``). For the
data-path tests and the GPU benchmark; kv_connector is imported when used (a peer process pays for it then)."""

from __future__ import annotations

import time
from typing import Any

import torch


def connector_worker(role: str, cfg: dict[str, Any], caches: dict[str, torch.Tensor], *, block_size: int,
                     kv_heads: int, replicated: bool = False, tp: int = 1, rank: int = 0, mode: str = "pull",
                     num_blocks: int | None = None, cache_dtype: str = "auto",
                     kv_scales: list[list[float]] | None = None, **options: Any) -> Any:
    """A registered worker of ``role`` (kv_producer or kv_consumer), TP ``rank`` of ``tp``, for mooncake.json fields
    ``cfg`` and connector ``options``."""
    from kv_connector.config import ConnectorConfig, ConnectorOptions
    from kv_connector.worker.connector_worker import ConnectorWorker, WorkerSpec
    from kv_pipe import MooncakeTransferEngineConfig

    config = ConnectorConfig(role, ConnectorOptions(transfer_mode=mode, **options), MooncakeTransferEngineConfig(**cfg),
                             tp, f"{role}-engine")
    worker = ConnectorWorker(config)
    worker.register(caches, WorkerSpec(rank=rank, block_size=block_size, fingerprint="harness:worker",
                                       kv_heads=kv_heads, replicated=replicated, num_blocks=num_blocks,
                                       cache_dtype=cache_dtype, kv_scales=kv_scales))
    return worker


def step(worker: Any, meta: Any, layer_names: list[str] = (), forward: Any = None) -> Any:
    """One step of ``meta``, as vLLM's model runner takes it (see the module docstring): ``forward(name)`` (if
    given) writes each layer before its ``save_layer``; in inference mode, as vLLM runs it (tensors made there
    cannot be written outside it). Returns ``transfer_results``."""
    import torch

    with torch.inference_mode():
        worker.handle_preemptions(meta)
        for name in layer_names:
            if forward is not None:
                forward(name)
            worker.save_layer(name, meta)
        worker.start_step(meta)
        worker.wait_for_save(meta)
        return worker.transfer_results(idle=not layer_names)


def prefill_steps(worker: Any, layer_names: list[str], prompts: list[tuple[str, list[int], list[int]]], mode: str,
                  chunk: int, forward: Any = None) -> None:
    """Prefill ``prompts`` (request id, tokens, its blocks) in steps of ``chunk`` tokens, as vLLM's scheduler tells
    the worker to: every step pushes (push mode), the step that completes a prompt saves it (``step``)."""
    from kv_connector.metadata import MooncakeConnectorMetadata, PushStep, SaveRequest

    for req_id, tokens, block_ids in prompts:
        end = 0
        while end < len(tokens):
            start, end = end, min(end + chunk, len(tokens))
            meta = MooncakeConnectorMetadata()
            if mode == "push":
                meta.pushes.append(PushStep(req_id, block_ids, end, len(tokens), tokens if start == 0 else None))
            if end == len(tokens):
                meta.saves.append(SaveRequest(req_id, tokens, block_ids))
            step(worker, meta, layer_names, forward)


def finish(worker: Any, req_ids: list[str], timeout: float = 30.0) -> None:
    """Requests a producer's scheduler held as they finished (``hold_blocks``): steps with no forward until every
    one was reported in ``finished_sending`` - only then may their blocks be written again, as vLLM frees them."""
    from kv_connector.metadata import MooncakeConnectorMetadata

    left = set(req_ids)
    meta = MooncakeConnectorMetadata(held=list(req_ids), idle=True)
    deadline = time.monotonic() + timeout
    while left:
        left -= step(worker, meta).sending
        meta = MooncakeConnectorMetadata(idle=True)
        if left and time.monotonic() > deadline:
            raise TimeoutError(f"requests {sorted(left)} were never reported in finished_sending")
        time.sleep(0.001)


def run_loads(worker: Any, loads: list[dict[str, Any]], producers: list[str], tp: int, timeout: float = 60.0,
              pushed: bool = False) -> tuple[set[str], set[str], set[int]]:
    """Start ``loads`` (``LoadRequest`` fields but ``source``) from ``producers`` (their pipe per rank) in one step,
    then collect until they all ended: (done, failed, blocks to recompute). ``pushed``: the producers pushed these
    prompts here, as their params would say (the consumer waits for the news of each push, which its receiving
    thread may not have read yet). A load's ``corrupt`` (true) or ``fault`` is a test switch (harness/tamper.py)."""
    from kv_connector.metadata import LoadRequest, MooncakeConnectorMetadata
    from kv_connector.source import LoadSource

    source = LoadSource(producers, from_params=True, same_tp=len(producers) == tp, pushed=pushed)
    switches = {load["req_id"]: load.get("corrupt") or load["fault"] for load in loads
                if load.get("corrupt") or load.get("fault")}
    if switches:
        from harness.tamper import install

        install(worker, switches)
    fields = [{k: v for k, v in load.items() if k not in ("corrupt", "fault")} for load in loads]
    meta = MooncakeConnectorMetadata(loads=[LoadRequest(**load, source=source) for load in fields], idle=True)
    done: set[str] = set()
    failed: set[str] = set()
    bad: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(done) < len(loads) and time.monotonic() < deadline:
        finished = step(worker, meta)
        meta = MooncakeConnectorMetadata(idle=True)
        done |= finished.done
        failed |= finished.failed
        bad |= finished.bad_blocks
    return done, failed, bad


def push_link(worker: Any) -> Any:
    """A producer's push link to the consumer mooncake.json names for its rank."""
    from kv_connector.config import role_pipe

    return worker.links.push_buffer(role_pipe(worker.config.mooncake, False, worker.transfer.rank))


def wait_until(until: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)
