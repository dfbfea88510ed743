"""Benchmark-only: vLLM's built-in MooncakeConnector, runnable on a CPU-only machine and timed.

Loaded by the ``builtin`` stack of ``benchmarks/support/stacks.py`` (bench_e2e, bench_serve) as ``kv_connector_module_path``
(with this directory on PYTHONPATH), in every vLLM process that builds the connector. It changes three things, all
outside the connector's logic:

- ``torch.accelerator.current_device_index()`` answers 0 when no accelerator exists (the worker calls it at start-up
  and would fail on a CPU-only build);
- the connector's bootstrap server binds ``VLLM_HOST_IP`` (127.0.0.1 in the benchmark) instead of 0.0.0.0;
- the KV transfer is timed: the producer logs each ``batch_transfer_sync_write`` call (bytes, wall-clock start and
  end) and the consumer each pull (request to the producer until its answer), as ``BENCH builtin ...`` lines the
  benchmark parses.

Never used by the product.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as builtin

logger = logging.getLogger("vllm.bench.builtin_mooncake_shim")

MooncakeConnector = builtin.MooncakeConnector


class _LoopbackBootstrapServer(builtin.MooncakeBootstrapServer):
    def __init__(self, host: str, port: int) -> None:
        super().__init__(os.environ.get("VLLM_HOST_IP", "127.0.0.1"), port)


builtin.MooncakeBootstrapServer = _LoopbackBootstrapServer  # type: ignore[misc]

_send_blocks = builtin.MooncakeConnectorWorker._send_blocks
_receive = builtin.MooncakeConnectorWorker.receive_kv_from_single_worker


def _timed_send_blocks(self: Any, remote_session: str, src_ptrs: list[int], dst_ptrs: list[int],
                       lengths: list[int]) -> int:
    start = time.time()
    ret = _send_blocks(self, remote_session, src_ptrs, dst_ptrs, lengths)
    logger.info("BENCH builtin send start=%.6f end=%.6f bytes=%d descs=%d ret=%d", start, time.time(), sum(lengths),
                len(lengths), ret)
    return ret


async def _timed_receive(self: Any, worker_addr: str, pull_metas: dict[str, Any]) -> None:
    start = time.time()
    try:
        await _receive(self, worker_addr, pull_metas)
    finally:
        blocks = sum(len(group) for meta in pull_metas.values() for group in meta.local_block_ids)
        logger.info("BENCH builtin recv start=%.6f end=%.6f reqs=%d blocks=%d", start, time.time(), len(pull_metas),
                    blocks)


builtin.MooncakeConnectorWorker._send_blocks = _timed_send_blocks  # type: ignore[method-assign]
builtin.MooncakeConnectorWorker.receive_kv_from_single_worker = _timed_receive  # type: ignore[method-assign]
