"""Push mode: the producer streams an entry to the consumer while it is still being computed; the consumer stages it
until a lookup for the same tokens takes it.

The pull path (``SimpleBuffer``) moves KV only after the consumer asks; here the producer sends each piece (one layer's
new blocks) as soon as it exists, so the transfer hides under the producer's compute. Memory on the consumer is bounded
(``capacity``): the producer announces each entry's size first and only pushes when the consumer's last credit says
it fits; otherwise the caller serves that entry through the pull path. Staged entries nobody takes within ``ttl``
seconds are dropped and counted.

The two ends are ``PushSender`` (producer, ``push_sender``) and ``PushReceiver`` (consumer, ``push_receiver``); their
messages are defined in ``push_wire``. ``PushBuffer(pipe, role, ...)`` makes the end for a role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from kv_lookup_buffer.base import entry_key
from kv_lookup_buffer.push_receiver import PushArrivals, PushedEntry, PushReceiver
from kv_lookup_buffer.push_sender import PushSender
from kv_pipe import KVPipeBase

__all__ = ["PushArrivals", "PushBuffer", "PushEnd", "PushReceiver", "PushSender", "PushedEntry", "entry_key"]

PushEnd = PushSender | PushReceiver


def PushBuffer(pipe: KVPipeBase, role: Literal["producer", "consumer"], capacity: int = 1 << 30,
               ttl: float = 60.0, on_count: Callable[[str, int], None] | None = None,
               arrivals: PushArrivals | None = None) -> PushEnd:
    """The end of a push channel over ``pipe`` (a pipe of its own: the push traffic must not interleave with another
    protocol) for ``role``: "producer" pushes (``PushSender``); "consumer" stages up to ``capacity`` bytes for
    ``ttl`` seconds and serves ``take`` (``PushReceiver``; ``arrivals``: shared by a consumer's receivers, see
    ``PushArrivals``); ``on_count``: see ``Counts``. Named as the class both ends once were."""
    if role not in ("producer", "consumer"):
        raise ValueError(f"role must be 'producer' or 'consumer', got {role!r}")
    if capacity <= 0 or ttl <= 0:
        raise ValueError(f"capacity and ttl must be > 0, got {capacity} bytes and {ttl} s")
    return PushSender(pipe, on_count) if role == "producer" else PushReceiver(pipe, capacity, ttl, on_count, arrivals)
