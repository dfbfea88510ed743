"""PipeEndpoint: one process's (one TP rank's) place in the network - a Transfer Engine, a side-channel listener on the
instance's own address, and ``MooncakePipe`` links to any number of peer endpoints (see ``kv_pipe.node`` for how).
"""

from __future__ import annotations

import torch

from kv_pipe.config import MooncakeTransferEngineConfig
from kv_pipe.mooncake_pipe import MooncakePipe
from kv_pipe.node import Node


class PipeEndpoint(Node[MooncakePipe]):
    """The node whose links are ``MooncakePipe``s: ``link(peer, channel)`` and ``on_link`` hand out pipes. ``kv_rank``
    0 (producer) or 1 (consumer): links join a producer and a consumer with the same ``local_rank`` (TP rank), or any
    ranks with ``any_peer_rank`` (instances of different TP sizes). ``peers``: the only peer endpoints (``host:port``)
    admitted, None for any. ``link_idle``: seconds after which an unused link is closed (None: never).
    ``start=False``: accept nothing until ``start()``."""

    def __init__(self, config: MooncakeTransferEngineConfig, host: str, port: int, *, kv_rank: int, local_rank: int = 0,
                 device: str | torch.device = "cpu", peers: set[str] | None = None,
                 link_idle: float | None = None, start: bool = True, any_peer_rank: bool = False) -> None:
        super().__init__(config, host, port, link=MooncakePipe.linked, kv_rank=kv_rank, local_rank=local_rank,
                         device=device, peers=peers, link_idle=link_idle, start=start, any_peer_rank=any_peer_rank)
