"""Test switches in the consumer's loads, kept out of the product: a request whose ``kv_transfer_params`` hold
``{CORRUPT_PARAM: true}`` has its loaded KV scrambled (proves the consumer really uses the KV it loads), or one of
``TEST_FAULTS`` made in it (faults the KV digest must catch).

vLLM instances get them by naming ``harness.tamper_connector`` in ``--kv-transfer-config``
(``harness.vllm.connector_config`` with ``tamper=True``); the data-path tests
(``harness.workers.run_loads``) install a ``Tamper`` on a worker directly. This module imports no vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kv_connector.metadata import LoadRequest
from kv_connector.worker import digest
from kv_connector.worker.connector_worker import ConnectorWorker
from kv_connector.worker.transfer import Rows, Tampered

logger = logging.getLogger(f"vllm.{__name__}")

CORRUPT_PARAM = "mooncake_corrupt_kv_for_testing"  # its value: true, or one of TEST_FAULTS
# flip a byte of what arrived; write two blocks into each other's places; write nothing (the blocks keep what they
# held); flip a byte and make the blocks' digests match (only the seal of a secret catches it)
TEST_FAULTS = ("flip_byte", "wrong_block", "stale", "forged_digest")


class Tamper:
    """The product's ``LoadTamper``: what the switch of each request (``switches``: request id -> true or a fault)
    makes of its load."""

    def __init__(self) -> None:
        self.switches: dict[str, bool | str] = {}

    def pulled(self, req: LoadRequest, kv: torch.Tensor, ids: list[int], in_place: bool, whole: bool,
               gather: Any) -> Tampered | None:
        switch = self.switches.get(req.req_id)
        if switch is None:
            return None
        if switch is True:  # not checked: it is meant
            if not whole:
                raise ValueError("test corruption is for equal TP sizes only")
            logger.warning("MooncakeConnector: corrupting the KV of request %s on purpose (test switch)", req.req_id)
            return Tampered((gather() if in_place else kv).flip(-1), ids, check=False)
        if in_place:
            raise ValueError("test faults need receive_into_cache false")
        logger.warning("MooncakeConnector: fault %s in the load of request %s on purpose (test switch)", switch,
                       req.req_id)
        if switch in ("flip_byte", "forged_digest"):  # one byte changed in flight
            return Tampered(_flip_byte(kv), ids)
        if switch == "wrong_block" and len(ids) > 1:
            return Tampered(kv, [ids[1], ids[0], *ids[2:]])
        return Tampered(kv, ids, write=switch != "stale")

    def pushed(self, req: LoadRequest, rows: Rows) -> tuple[Rows, bool] | None:
        switch = self.switches.get(req.req_id)
        if switch is None:
            return None
        if switch is True:
            logger.warning("MooncakeConnector: corrupted the KV of request %s on purpose (test switch)", req.req_id)
            return [(layer, ids, piece.flip(-1)) for layer, ids, piece in rows], False
        logger.warning("MooncakeConnector: fault %s in the load of request %s on purpose (test switch)", switch,
                       req.req_id)
        if switch == "stale":
            return [], True
        if switch in ("flip_byte", "forged_digest") and rows:
            layer, ids, piece = rows[0]
            return [(layer, ids, _flip_byte(piece)), *rows[1:]], True
        if switch == "wrong_block" and len(req.block_ids) > 1:
            a, b = req.block_ids[0], req.block_ids[1]
            swap = {a: b, b: a}
            return [(layer, [swap.get(i, i) for i in ids], piece) for layer, ids, piece in rows], True
        return rows, True

    def expected(self, req: LoadRequest, sums: torch.Tensor, positions: list[int], landed: Any) -> torch.Tensor:
        if self.switches.get(req.req_id) != "forged_digest":
            return sums
        groups = digest.groups_of(sums) or 1  # the landed blocks' digests written over the producer's
        return digest.overwrite(sums, req.first_block, positions, landed(None if groups == 1 else (0, groups)))


def _flip_byte(kv: torch.Tensor) -> torch.Tensor:
    kv = kv.clone()
    flat = kv.view(-1).view(torch.uint8)
    flat[flat.numel() // 2] ^= 0xFF
    return kv


def install(worker: ConnectorWorker, switches: dict[str, bool | str]) -> Tamper:
    """Put a ``Tamper`` with ``switches`` into a registered worker's loads (pulled, and pushed: they share it)."""
    transfer = worker.transfer
    assert transfer is not None, "the worker has no KV cache registered"
    pull = getattr(transfer, "pull", transfer)
    if pull.tamper is None:
        pull.tamper = Tamper()
    pull.tamper.switches.update(switches)
    return pull.tamper


def switch_of(params: dict | None) -> bool | str | None:
    value = (params or {}).get(CORRUPT_PARAM)
    return value if value is True or (isinstance(value, str) and value in TEST_FAULTS) else None
