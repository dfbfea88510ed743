"""The producer's end of a push channel: announces entries the consumer's credit covers, and streams their pieces
from a sender thread while the caller computes the next ones. The messages are those of ``push_wire``."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_lookup_buffer.push_wire import (
    Abort,
    Begin,
    Commit,
    Credit,
    Data,
    Hello,
    Message,
    Pull,
    encode,
    key_of,
    parse,
    push_stats,
)
from kv_pipe import KVPipeBase, PipeClosed, PipeError, PipeStalled, PipeTimeout

logger = logging.getLogger(__name__)

_POLL = 0.5
FIRST_CREDIT_WAIT = 5.0  # seconds the first BEGIN on a new link may wait for the consumer's first credit (once a link)


@dataclass
class _Filling:
    """A DATA payload still being filled (an asynchronous copy out of a device), or a COMMIT's hidden tensor still
    being computed: sent once ``ready()`` returns."""

    tensor: torch.Tensor
    ready: Callable[[], None]


@dataclass
class _Committing:
    """A COMMIT's payload: its metadata tensor, and its hidden tensor (if any)."""

    meta: torch.Tensor | None
    hidden: torch.Tensor | _Filling | None


# a message, and what follows it: DATA's tensor, COMMIT's tensors
_Outgoing = tuple[Message, "torch.Tensor | _Filling | _Committing | None"]


class PushSender:
    """The producer's end of a push channel over ``pipe`` (a pipe of its own: the push traffic must not interleave
    with another protocol). ``on_count``: see ``Counts``."""

    role = "producer"

    def __init__(self, pipe: KVPipeBase, on_count: Callable[[str, int], None] | None = None,
                 first_credit_wait: float | None = None) -> None:
        self.pipe = pipe
        # a link made for a request (first use, or again after link_idle) has no credit yet: without this wait
        # that request would always go by pull
        self._first_credit_wait = FIRST_CREDIT_WAIT if first_credit_wait is None else first_credit_wait
        self._cv = threading.Condition()
        self._closed = threading.Event()
        self.stats = push_stats(on_count)
        self._epoch = random.randrange(1, 1 << 62)
        self._sent_begins: deque[int] = deque()  # sizes of BEGINs not yet counted by the consumer's last credit
        self._begins_total = 0
        self._credit_free = 0
        self._credit_epoch = -1
        self._failed: set[bytes] = set()
        self._hello_retries = 0
        # BEGIN, PULL and HELLO go before queued DATA and COMMIT: a consumer must learn at once that a push has
        # begun (or will not come), not after the pieces of other entries queued before it
        self._control: deque[_Outgoing] = deque()
        self._data: deque[_Outgoing] = deque()
        self._out_cv = threading.Condition()
        self._reported_dead = False
        self._threads = [threading.Thread(target=target, name=name, daemon=True)
                         for target, name in ((self._send_loop, "kv-push-sender"), (self._credit_loop, "kv-push-credit"))]
        for thread in self._threads:
            thread.start()
        self._enqueue((Hello(self._epoch), None), control=True)

    @property
    def healthy(self) -> bool:
        """Open, and both threads still running (a dead one is logged once; callers fall back to pull)."""
        dead = [t.name for t in self._threads if not t.is_alive()]
        if dead and not self._closed.is_set() and not self._reported_dead:
            self._reported_dead = True
            logger.error("push channel: thread(s) %s died; this end stops pushing (entries go by pull)", dead)
        return not dead and not self._closed.is_set()

    def begin(self, key: bytes, nbytes: int, num_layers: int, num_blocks: int) -> bool:
        """Announce an entry if the consumer's credit covers it: True means push its pieces, then ``commit``;
        False means the consumer has no room (or has not been heard from): serve this entry by pull instead. The
        first call on a link waits up to ``first_credit_wait`` s for the consumer's first credit."""
        if not self.healthy:
            self.stats.add("no_credit")
            return False
        with self._cv:
            if self._first_credit_wait > 0:
                self._cv.wait_for(lambda: self._credit_epoch == self._epoch or self._closed.is_set(),
                                  self._first_credit_wait)
                self._first_credit_wait = 0.0
            if self._credit_epoch != self._epoch or nbytes > self._credit_free - sum(self._sent_begins):
                self.stats.add("no_credit")
                return False
            if key in self._failed:  # its BEGIN would not be sent (nor count against this credit): pull
                return False
            self._sent_begins.append(nbytes)
            self._begins_total += 1
            self.stats.add("begun")
        self._enqueue((Begin(key, nbytes, num_layers, num_blocks), None), control=True)
        return True

    def push(self, key: bytes, layer: int, first_block: int, blocks: torch.Tensor, num_blocks: int,
             ready: Callable[[], None] | None = None) -> None:
        """Queue one layer's blocks [first_block, first_block + num_blocks) (``blocks`` is not copied: do not reuse
        it). Returns at once; a sender thread moves it. ``ready``: ``blocks`` is still being filled (an asynchronous
        copy); the sender thread calls ``ready()``, which returns once it is, before sending it."""
        payload = blocks if ready is None else _Filling(blocks, ready)
        self._enqueue((Data(key, layer, first_block, num_blocks), payload), control=False)

    def commit(self, key: bytes, num_tokens: int, meta: torch.Tensor | None, hidden: torch.Tensor | None = None,
               ready: Callable[[], None] | None = None) -> None:
        """The entry is complete: the consumer may hand it out. ``hidden``: a tensor it carries to whoever takes it
        (``PushedEntry.hidden``; e.g. digests of its pieces); ``ready``: ``hidden`` is filled by ``ready()``, which
        the sender thread calls once every piece queued before this commit is sent."""
        carried = hidden if hidden is None or ready is None else _Filling(hidden, ready)
        self._enqueue((Commit(key, num_tokens, int(hidden is not None)), _Committing(meta, carried)), control=False)

    def _forget_failed(self, key: bytes) -> None:
        """An entry that failed is over (its commit or its pull notice came): drop what is still queued of it and
        forget that it failed."""
        self._drop_queued(key)
        with self._cv:
            self._failed.discard(key)

    def _drop_queued(self, key: bytes) -> None:
        """Drop the entry's pieces (and commit) still queued."""
        with self._out_cv:
            self._data = deque(item for item in self._data if key_of(item[0]) != key)

    def abort(self, key: bytes) -> None:
        """Give up on an entry (its request ended): its pieces still queued are not sent (not marked failed: a later
        push of the same prompt goes as usual), and the consumer drops what it staged."""
        self._drop_queued(key)
        self._enqueue((Abort(key), None), control=True)

    def notify_pull(self, key: bytes) -> None:
        """Tell the consumer not to wait for a push of these tokens."""
        self._enqueue((Pull(key), None), control=True)

    def failed(self, key: bytes) -> bool:
        """True if sending part of this entry failed (the consumer will not get it)."""
        with self._cv:
            return key in self._failed

    def _enqueue(self, item: _Outgoing, control: bool) -> None:
        with self._out_cv:
            (self._control if control else self._data).append(item)
            self._out_cv.notify()

    def _next_outgoing(self) -> _Outgoing | None:
        """The next message to send, control first; None once closed."""
        with self._out_cv:
            while not self._closed.is_set():
                if self._control:
                    return self._control.popleft()
                if self._data:
                    return self._data.popleft()
                self._out_cv.wait(_POLL)
        return None

    def _send_loop(self) -> None:
        while True:
            item = self._next_outgoing()
            if item is None:
                return
            message, payload = item
            key = key_of(message)
            if key in self._failed and not isinstance(message, (Hello, Pull, Abort)):
                if isinstance(message, Commit):  # committed after it failed: nobody else tells the consumer
                    self._forget_failed(key)
                    self._enqueue((Abort(key), None), control=True)
                continue  # the rest of an entry that failed (its PULL notice still goes)
            if isinstance(message, Pull) and key in self._failed:  # its request is done with it: every piece it
                self._forget_failed(key)  # queued is queued by now: a later push of the same prompt goes as usual
            try:
                # before the header: a failure leaves the stream in step
                if isinstance(payload, _Filling):
                    payload.ready()
                    payload = payload.tensor
                if isinstance(payload, _Committing) and isinstance(payload.hidden, _Filling):
                    payload.hidden.ready()
                    payload = _Committing(payload.meta, payload.hidden.tensor)
                self.pipe.send_tensor(encode(message))
                if isinstance(message, Hello):
                    self._hello_retries = 0
                if isinstance(message, Data):
                    assert not isinstance(payload, _Committing)
                    self.pipe.send_tensor(payload)
                    if payload is not None:
                        self.stats.add("pushed_bytes", payload.numel() * payload.element_size())
                elif isinstance(message, Commit):
                    assert isinstance(payload, _Committing)
                    self.pipe.send_tensor(payload.meta)
                    if payload.hidden is not None:
                        self.pipe.send_tensor(payload.hidden)
                    self.stats.add("committed")
            except PipeClosed:
                return
            except Exception as e:  # a PipeError, or a bug: this entry fails, the sending goes on
                if not isinstance(e, PipeError):
                    logger.exception("push channel: sending failed unexpectedly")
                if isinstance(message, Hello) and isinstance(e, PipeError):  # retried, less and less often (XpYd)
                    self._hello_retries += 1
                    log = logger.info if self._hello_retries == 1 else logger.debug
                    log("push channel: the consumer is not reachable (%s); retrying, less and less often", e)
                    pause = min(30.0, 2.0 ** min(self._hello_retries - 1, 5))
                    threading.Timer(pause, self._enqueue, ((message, None), True)).start()
                    continue
                with self._cv:
                    if key not in self._failed:
                        self._failed.add(key)
                        self.stats.add("push_failed")
                if isinstance(message, Commit):  # the consumer must not wait for it until its deadline
                    self._forget_failed(key)
                    self._enqueue((Abort(key), None), control=True)
                logger.warning("push channel: sending an entry failed (%s); the consumer will recompute it", e)

    def _credit_loop(self) -> None:
        last_hello = time.monotonic()
        while not self._closed.is_set():
            try:
                message = parse(self.pipe.recv_tensor(timeout=_POLL))
            except PipeStalled as e:  # _POLL bounds only the wait for a message to start
                self.stats.add("lost")
                logger.warning("push channel: a credit from the consumer broke off (%s); its next one replaces it", e)
                continue
            except PipeTimeout:
                continue
            except PipeClosed:
                return
            except (PipeError, ValueError) as e:
                self.stats.add("malformed")
                logger.warning("push channel: ignored a bad message from the consumer: %s", e)
                continue
            except Exception:  # a bug must not end the credit loop for good
                self.stats.add("malformed")
                logger.exception("push channel: reading the consumer's credit failed; skipped")
                continue
            if not isinstance(message, Credit):
                self.stats.add("malformed")
                logger.warning("push channel: unexpected %s from the consumer", type(message).__name__.upper())
                continue
            with self._cv:
                if message.epoch != self._epoch:  # a consumer that has not met this producer yet (or restarted)
                    self._credit_epoch = -1
                    if time.monotonic() - last_hello > 1.0 or self.stats["begun"] == 0:
                        last_hello = time.monotonic()
                        self._begins_total = 0  # the consumer counts BEGINs from this HELLO on
                        self._sent_begins.clear()
                        self._enqueue((Hello(self._epoch), None), control=True)
                    continue
                uncounted = self._begins_total - message.begun
                while len(self._sent_begins) > max(uncounted, 0):
                    self._sent_begins.popleft()
                self._credit_free, self._credit_epoch = message.free_bytes, message.epoch
                self._cv.notify_all()

    def close(self) -> None:
        """Stop the threads (the pipe is the caller's to close). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._out_cv:
            self._out_cv.notify_all()
        with self._cv:
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout=2.0)
