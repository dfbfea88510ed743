"""The worker's peer links, in one place: one ``PipeEndpoint`` per worker (TP rank) on this instance's own address,
and the buffers that talk over its links.

- ``kv`` channel (pull): a producer serves every consumer that links to it from one ``SimpleBuffer``; a consumer
  holds a consumer-side ``SimpleBuffer`` per producer it loads from, made on first use and made again once the link
  was closed (idle for ``link_idle`` seconds, or its producer gone).
- ``push`` channel: a producer holds a ``PushSender`` per consumer it pushes to (made on first use); a consumer gets
  a ``PushReceiver`` per producer that pushes to it (made when that producer links), all sharing one
  ``PushArrivals`` (``arrivals``) that wakes a load waiting for a push on any of them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_lookup_buffer import PushArrivals, PushEnd, PushReceiver, SimpleBuffer
from kv_pipe import MooncakePipe, PipeEndpoint

logger = logging.getLogger(f"vllm.{__name__}")

KV, PUSH = "kv", "push"


@dataclass
class _Linked:
    pipe: MooncakePipe
    buffer: SimpleBuffer | PushEnd


class PeerLinks:
    """See the module docstring. ``producer_buffer``: the producer's one buffer (None on a consumer);
    ``make_push``: builds the push end (sender or receiver) for a link in a role (None: no push mode);
    ``arrivals``: the one its receivers tell (a consumer in push mode)."""

    def __init__(self, endpoint: PipeEndpoint, producer_buffer: SimpleBuffer | None, buffer_size: int,
                 make_push: Callable[[MooncakePipe, str], PushEnd] | None = None,
                 arrivals: PushArrivals | None = None) -> None:
        self.endpoint = endpoint
        self.producer_buffer = producer_buffer
        self.buffer_size = buffer_size
        self.make_push = make_push
        self.arrivals = arrivals or PushArrivals()
        self._lock = threading.Lock()
        self._pull: dict[str, _Linked] = {}  # consumer: producer address -> its buffer
        self._push: dict[str, _Linked] = {}  # peer address -> its push end (producer: consumers; consumer: producers)
        endpoint.on_link(self._on_link)

    @property
    def is_producer(self) -> bool:
        return self.producer_buffer is not None

    def _on_link(self, pipe: MooncakePipe) -> None:
        """A peer made a link to us (in the endpoint's handshake thread)."""
        if pipe.channel == KV and self.producer_buffer is not None:
            self.producer_buffer.serve_link(pipe)
        elif pipe.channel == PUSH and not self.is_producer and self.make_push is not None:
            with self._lock:
                _, old = self._new_push(pipe, "consumer")
            if old is not None:
                old.buffer.close()
        # any other link (e.g. a producer's answers arriving on a consumer's kv link) is used by whoever made it

    def pull_buffer(self, producer: str) -> SimpleBuffer:
        """Consumer: the buffer that loads from the producer endpoint at ``producer``."""
        with self._lock:
            linked = self._pull.get(producer)
            if linked is not None and not linked.pipe.closed:
                if linked.buffer.healthy:
                    return linked.buffer  # type: ignore[return-value]
                linked.pipe.close()  # a thread of the buffer died (logged): a new link gets a new buffer
            pipe = self.endpoint.link(producer, KV)
            buffer = SimpleBuffer(pipe, pipe, self.buffer_size, role="consumer")
            self._pull[producer] = _Linked(pipe, buffer)
        if linked is not None:
            linked.buffer.close()
        return buffer

    def warm_up(self, producer: str, timeout: float) -> None:
        """Consumer: open the link to ``producer`` now, in the background, both directions (a request no entry can
        match: token ids are never negative), so that the first load does not wait for it to be set up."""
        def run() -> None:
            try:
                self.pull_buffer(producer).drop_select(torch.tensor([-1]), None, timeout=timeout)
            except Exception as e:  # e.g. no producer there (XpYd): the first load links on its own
                logger.debug("MooncakeConnector: no link to %s made in advance: %s", producer, e)

        threading.Thread(target=run, name="mooncake-kv-warm-up", daemon=True).start()

    def push_buffer(self, peer: str) -> PushEnd | None:
        """Producer: the PushSender that pushes to the consumer at ``peer`` (made now if needed). Consumer: the one
        the producer at ``peer`` pushes into, if it linked."""
        if self.make_push is None:
            return None
        with self._lock:
            linked = self._push.get(peer)
            if linked is not None and not linked.pipe.closed:
                return linked.buffer  # type: ignore[return-value]
            if not self.is_producer:
                return None
            buffer, old = self._new_push(self.endpoint.link(peer, PUSH), "producer")
        if old is not None:
            old.buffer.close()
        return buffer

    def push_receivers(self) -> list[tuple[str, PushReceiver]]:
        """Consumer: the push end of every producer linked to it now, with that producer's pipe address (the one it
        named in the pipe's handshake, authenticated with a secret)."""
        with self._lock:
            return [(peer, linked.buffer) for peer, linked in self._push.items()
                    if not linked.pipe.closed and isinstance(linked.buffer, PushReceiver)]

    def _new_push(self, pipe: MooncakePipe, role: str) -> tuple[PushEnd, _Linked | None]:
        """A push end for ``pipe`` in place of the peer's old one (under the lock); the caller closes the old one
        (returned) outside the lock."""
        assert self.make_push is not None
        old = self._push.get(pipe.peer)
        buffer = self.make_push(pipe, role)
        self._push[pipe.peer] = _Linked(pipe, buffer)
        return buffer, old

    def close(self) -> None:
        with self._lock:
            items = list(self._pull.values()) + list(self._push.values())
            self._pull.clear()
            self._push.clear()
        for item in items:
            item.buffer.close()
        if self.producer_buffer is not None:
            self.producer_buffer.close()
        self.endpoint.close()
