"""The consumer's end of a push channel: stages the entries a producer pushes (at most ``capacity`` bytes, announced
by credits) until a load for the same tokens takes them; entries nobody takes within ``ttl`` seconds are dropped and
counted. The messages are those of ``push_wire``; a bad one is logged, counted and skipped, and the entry it belonged
to is dropped.

A load may also wait for a push nobody has begun yet (the decode sent together with its prefill): the receivers of
one consumer share a ``PushArrivals`` that wakes such a load whenever something arrives on any of them, and each
remembers for a while which entries its producer sent by pull or gave up (``look``), since that may come before the
load asks."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kv_lookup_buffer.push_wire import Abort, Begin, Commit, Credit, Data, Hello, Message, Pull, encode, parse, push_stats
from kv_pipe import KVPipeBase, PipeClosed, PipeError, PipeStalled, PipeTimeout

logger = logging.getLogger(__name__)

_POLL = 0.5
MAX_NOTICES = 4096  # keys whose push ended without an entry, remembered for a load that has not asked yet
STAGED, PULL, DROPPED = "staged", "pull", "dropped"  # what ``look`` says about a key


class PushArrivals:
    """Wakes loads waiting for a push on any of a consumer's push links: each receiver calls ``notify`` when a
    BEGIN, COMMIT, PULL or ABORT arrives or an entry is dropped. A waiter reads ``seq``, looks at the receivers, then
    ``wait``s for a notice after that ``seq`` (so none that came while it looked is missed)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._seq = 0

    @property
    def seq(self) -> int:
        with self._cv:
            return self._seq

    def notify(self) -> None:
        with self._cv:
            self._seq += 1
            self._cv.notify_all()

    def wait(self, seq: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a notice after the one ``seq`` was read at; True if one came."""
        with self._cv:
            return self._cv.wait_for(lambda: self._seq != seq, max(timeout, 0.0))


@dataclass
class PushedEntry:
    """A staged entry: ``pieces`` are (layer, first_block, tensor of that layer's blocks) in arrival order."""

    nbytes: int
    num_layers: int
    num_blocks: int
    created: float = field(default_factory=time.monotonic)
    pieces: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    received: int = 0
    num_tokens: int = 0
    meta: torch.Tensor | None = None
    hidden: torch.Tensor | None = None  # what the producer's commit carried besides ``meta`` (e.g. KV digests)
    committed: bool = False
    held_until: float = 0.0  # a lookup found it: kept from expiry until then (``hold``)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PushReceiver:
    """The consumer's end of a push channel over ``pipe`` (a pipe of its own): stages up to ``capacity`` bytes and
    serves ``take``. ``on_count``: see ``Counts``; ``arrivals``: shared with the consumer's other receivers."""

    role = "consumer"

    def __init__(self, pipe: KVPipeBase, capacity: int = 1 << 30, ttl: float = 60.0,
                 on_count: Callable[[str, int], None] | None = None, arrivals: PushArrivals | None = None) -> None:
        if capacity <= 0 or ttl <= 0:
            raise ValueError(f"capacity and ttl must be > 0, got {capacity} bytes and {ttl} s")
        self.pipe, self.capacity, self.ttl = pipe, capacity, ttl
        self._cv = threading.Condition()
        self._closed = threading.Event()
        self.stats = push_stats(on_count)
        self._entries: dict[bytes, PushedEntry] = {}
        self._arrivals = arrivals or PushArrivals()
        # keys whose push ended without an entry to take: PULL (served by pull) or DROPPED, and when
        self._notices: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        # keys whose staged entry is complete while the producer pushes the same prompt again (a repeated prompt):
        # the new push's messages are dropped and the staged copy kept
        self._repeats: set[bytes] = set()
        self._free = capacity
        self._producer_epoch = 0
        self._begun = 0
        self._reported_dead = False
        self._thread = threading.Thread(target=self._receive_loop, name="kv-push-receiver", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        """Open, and the receiving thread still running. A dead one is logged once and the entries it staged are
        released (nobody would expire them any more): loads go by pull."""
        dead = not self._thread.is_alive()
        if dead and not self._closed.is_set() and not self._reported_dead:
            self._reported_dead = True
            logger.error("push channel: thread(s) %s died; this end stops pushing (entries go by pull)",
                         [self._thread.name])
            with self._cv:
                for key in list(self._entries):
                    self._drop(key)
        return not dead and not self._closed.is_set()

    def take(self, key: bytes, timeout: float) -> PushedEntry | None:
        """Take the entry of ``key`` once it is committed, waiting up to ``timeout`` s if its push has begun (its
        BEGIN arrived) but is not complete yet; its memory leaves the staging budget. None at once if no push of it
        has begun (never announced, refused, aborted, sent by pull), and None if it is not committed in time."""
        deadline = time.monotonic() + timeout
        if not self.healthy:
            return None
        with self._cv:
            while True:
                entry = self._entries.get(key)
                if entry is None:
                    return None
                if entry.committed:
                    del self._entries[key]
                    self._free += entry.nbytes
                    self.stats.add("taken")
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed.is_set():
                    return None
                self._cv.wait(remaining)
        self._send_credit()
        return entry

    def hold(self, key: bytes, seconds: float) -> bool:
        """Keep the staged entry of ``key`` (a push of it began, not taken or dropped) from expiring for ``seconds``
        (a lookup found it; its load comes next): True if there is one."""
        with self._cv:
            entry = self._entries.get(key)
            if entry is None:
                return False
            entry.held_until = max(entry.held_until, time.monotonic() + seconds)
            return True

    def look(self, key: bytes) -> str | None:
        """What this link knows of ``key``: ``STAGED`` (a push of it began, not taken or dropped), ``PULL`` (its
        producer serves it by pull), ``DROPPED`` (refused, aborted, broken or expired before anyone took it), or None
        (nothing)."""
        with self._cv:
            if key in self._entries:
                return STAGED
            notice = self._notices.get(key)
            return None if notice is None else notice[0]

    def take_notice(self, key: bytes) -> str | None:
        """``PULL`` or ``DROPPED`` if that is what this link last heard of ``key``, forgetting it (a load acts on it)."""
        with self._cv:
            notice = self._notices.pop(key, None)
            return None if notice is None else notice[0]

    def _notice(self, key: bytes, what: str) -> None:
        """Remember how the push of ``key`` ended (under the lock)."""
        self._notices.pop(key, None)
        self._notices[key] = (what, time.monotonic())
        while len(self._notices) > MAX_NOTICES:
            self._notices.popitem(last=False)

    def has_producer(self) -> bool:
        """A producer has said HELLO on this channel (before that, ``take`` does not wait)."""
        with self._cv:
            return self._producer_epoch != 0

    def staged_bytes(self) -> int:
        with self._cv:
            return self.capacity - self._free

    def __len__(self) -> int:
        with self._cv:
            return len(self._entries)

    def _send_credit(self) -> None:
        with self._cv:
            header = encode(Credit(self._producer_epoch, self._free, self._begun))
        try:
            self.pipe.send_tensor(header, timeout=5.0)
        except PipeError as e:
            logger.info("push channel: could not send a credit to the producer: %s", e)

    def _receive_loop(self) -> None:
        self._send_credit()  # tells a producer already running that this consumer exists
        while not self._closed.is_set():
            try:
                header = self.pipe.recv_tensor(timeout=_POLL)  # _POLL bounds only the wait for a message to start
            except PipeStalled as e:
                self.stats.add("lost")
                logger.warning("push channel: a message from the producer broke off (%s); an entry it belonged to "
                               "is not committed: it expires", e)
                self._expire()
                continue
            except PipeTimeout:
                self._expire()
                continue
            except PipeClosed:
                return
            except PipeError as e:
                logger.warning("push channel: receive failed (%s)", e)
                self._expire()
                continue
            try:
                self._handle(parse(header))
            except (PipeError, ValueError) as e:
                self.stats.add("malformed")
                logger.error("push channel: ignored a bad message from the producer: %s", e)
            except Exception:  # a bug must not end the receiving for good: log it, skip this message
                self.stats.add("malformed")
                logger.exception("push channel: handling a message from the producer failed; skipped")
            self._expire()

    def _handle(self, message: Message) -> None:
        if isinstance(message, Hello):
            with self._cv:
                self._producer_epoch, self._begun = message.epoch, 0
                self._repeats.clear()
            self._send_credit()
        elif isinstance(message, Begin):
            self._begin(message)
            self._arrivals.notify()
            self._send_credit()
        elif isinstance(message, Data):
            self._data(message, self.pipe.recv_tensor())
        elif isinstance(message, Commit):
            meta = self.pipe.recv_tensor()
            hidden = self.pipe.recv_tensor() if message.hidden else None
            with self._cv:
                if message.key in self._repeats:
                    self._repeats.discard(message.key)
                    return
                entry = self._entries.get(message.key)
                extra = 0 if entry is None or hidden is None else _nbytes(hidden)
                if entry is not None and entry.received + extra > entry.nbytes:  # staged in the room BEGIN announced
                    self._drop(message.key, DROPPED)
                    self._arrivals.notify()
                    raise ValueError(f"COMMIT's hidden tensor ({extra} bytes) does not fit what its BEGIN announced "
                                     f"({entry.received} of {entry.nbytes} bytes received): entry dropped")
                if entry is not None:
                    entry.committed, entry.meta, entry.num_tokens = True, meta, message.num_tokens
                    entry.hidden = hidden
                    entry.received += extra
                    self._cv.notify_all()
            self._arrivals.notify()
        elif isinstance(message, (Pull, Abort)):
            with self._cv:
                self.stats.add("pulled" if isinstance(message, Pull) else "aborted")
                if message.key in self._repeats:  # the repeat will not come: the staged copy stays
                    self._repeats.discard(message.key)
                else:
                    self._drop(message.key, PULL if isinstance(message, Pull) else DROPPED)
            self._arrivals.notify()
            self._send_credit()
        else:
            raise ValueError(f"unexpected {type(message).__name__.upper()} from the producer")

    def _begin(self, begin: Begin) -> None:
        key = begin.key
        with self._cv:
            self._begun += 1
            staged = self._entries.get(key)
            self._repeats.discard(key)  # a repeat that never ended (its producer went away) ends here
            if staged is not None and staged.committed:
                self._repeats.add(key)  # every message of the first push came before its COMMIT
                self.stats.add("duplicates")
            elif staged is not None or begin.nbytes > self._free or begin.num_layers <= 0 or begin.num_blocks <= 0:
                self.stats.add("rejected")
                if staged is None:
                    self._notice(key, DROPPED)
                self._cv.notify_all()
                logger.warning("push channel: refused an entry of %d bytes (%d of %d staging bytes free)",
                               begin.nbytes, self._free, self.capacity)
            else:
                self._notices.pop(key, None)  # a new push of these tokens: what became of an older one is past
                self._entries[key] = PushedEntry(begin.nbytes, begin.num_layers, begin.num_blocks)
                self._free -= begin.nbytes
                self.stats.add("staged")

    def _data(self, data: Data, blocks: torch.Tensor | None) -> None:
        with self._cv:
            if data.key in self._repeats:
                return  # the same bytes as the staged entry's
            entry = self._entries.get(data.key)
            if entry is None:
                return  # refused, expired or aborted: drop the bytes
            nbytes = 0 if blocks is None else blocks.numel() * blocks.element_size()
            if blocks is None or data.layer >= entry.num_layers or data.num_blocks <= 0 or \
                    data.first_block + data.num_blocks > entry.num_blocks or entry.received + nbytes > entry.nbytes or \
                    entry.committed:
                self._drop(data.key, DROPPED)
                self._arrivals.notify()
                raise ValueError(f"DATA (layer {data.layer}, blocks {data.first_block}+{data.num_blocks}, {nbytes} "
                                 f"bytes) does not fit its entry ({entry.num_layers} layers, {entry.num_blocks} "
                                 f"blocks, {entry.received} of {entry.nbytes} bytes received): entry dropped")
            entry.pieces.append((data.layer, data.first_block, blocks))
            entry.received += nbytes

    def _drop(self, key: bytes, notice: str | None = None) -> None:
        """Forget a staged entry (under the lock) and wake a waiting ``take``; ``notice``: remember that (``look``)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._free += entry.nbytes
        if notice is not None:
            self._notice(key, notice)
        self._cv.notify_all()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cv:
            old = [k for k, e in self._entries.items() if now - e.created > self.ttl and e.held_until <= now]
            for key in old:
                self._drop(key)
                self.stats.add("expired")
            while self._notices and now - next(iter(self._notices.values()))[1] > self.ttl:
                self._notices.popitem(last=False)
        if old:
            logger.warning("push channel: dropped %d staged entr%s nobody took within %.0f s", len(old),
                           "y" if len(old) == 1 else "ies", self.ttl)
            self._send_credit()

    def close(self) -> None:
        """Stop the receiving thread (the pipe is the caller's to close). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._cv:
            self._cv.notify_all()
        self._thread.join(timeout=2.0)
