"""PushBuffer: the producer streams an entry to the consumer while it is still being computed; the consumer stages it
until a lookup for the same tokens takes it.

The pull path (``SimpleBuffer``) moves KV only after the consumer asks; here the producer sends each piece (one layer's
new blocks) as soon as it exists, so the transfer hides under the producer's compute. Memory on the consumer is bounded
(``capacity``): the producer announces each entry's size first and only pushes when the consumer's last credit says
it fits; otherwise the caller serves that entry through the pull path. Staged entries nobody takes within ``ttl``
seconds are dropped and counted.

Messages, all on one pipe: an int64 header ``[MAGIC, VERSION, kind, k0, k1, k2, k3, a, b, c, d]`` (``k`` = the
SHA-256 of the entry's tokens, as four int64), followed by one tensor for DATA and COMMIT.

producer -> consumer
  HELLO   a=epoch                           a (re)started producer; the consumer answers with a CREDIT
  BEGIN   a=nbytes b=num_layers c=num_blocks  an entry of this size follows (sent once the credit allows it)
  DATA    a=layer b=first_block c=blocks    + a tensor: ``blocks`` blocks of one layer, from ``first_block``
  COMMIT  a=num_tokens                      + a tensor (the caller's metadata, e.g. a layout descriptor)
  PULL                                      these tokens go through the pull path: stop waiting for a push
  ABORT                                     the producer gave up on this entry
consumer -> producer
  CREDIT  a=epoch b=free_bytes c=begun      free staging bytes once the first ``begun`` BEGINs of ``epoch`` are counted

Headers are parsed and checked (magic, version, kind, ranges against the BEGIN); a bad message is logged, counted and
skipped, and the entry it belonged to is dropped. Nothing on the wire is executed.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from kv_pipe import KVPipeBase, PipeClosed, PipeError, PipeStalled, PipeTimeout

logger = logging.getLogger(__name__)

MAGIC, VERSION = 0x4D4B5642, 1  # "MKVB"
HELLO, BEGIN, DATA, COMMIT, PULL, ABORT, CREDIT = range(1, 8)
KIND_NAMES = {HELLO: "HELLO", BEGIN: "BEGIN", DATA: "DATA", COMMIT: "COMMIT", PULL: "PULL", ABORT: "ABORT",
              CREDIT: "CREDIT"}
HEADER_LEN = 11
NO_KEY = b"\0" * 32
_POLL = 0.5
_Outgoing = tuple[torch.Tensor, "torch.Tensor | None", bool, bytes]  # header, payload, is a HELLO, entry key


def entry_key(tokens: torch.Tensor | list[int]) -> bytes:
    """The key of an entry: SHA-256 of its tokens as little-endian int64."""
    t = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1).contiguous()
    return hashlib.sha256(t.numpy().tobytes()).digest()


def _header(kind: int, key: bytes = NO_KEY, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> torch.Tensor:
    words = torch.frombuffer(bytearray(key), dtype=torch.int64).tolist()
    return torch.tensor([MAGIC, VERSION, kind, *words, a, b, c, d], dtype=torch.int64)


def _parse(t: torch.Tensor | None) -> tuple[int, bytes, list[int]]:
    if t is None or t.dtype != torch.int64 or t.shape != (HEADER_LEN,):
        what = "None" if t is None else f"{t.dtype} {list(t.shape)}"
        raise ValueError(f"expected a push header (int64[{HEADER_LEN}]), got {what}")
    words = t.tolist()
    if words[0] != MAGIC or words[1] != VERSION:
        raise ValueError(f"bad push header magic/version {words[0]:#x}/{words[1]}")
    if words[2] not in KIND_NAMES:
        raise ValueError(f"unknown push message kind {words[2]}")
    if any(w < 0 for w in words[7:]):
        raise ValueError(f"negative field in a {KIND_NAMES[words[2]]} header: {words[7:]}")
    key = t[3:7].contiguous().numpy().tobytes()
    return words[2], key, words[7:]


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
    committed: bool = False


class PushBuffer:
    """One end of a push channel over ``pipe`` (a pipe of its own: the push traffic must not interleave with another
    protocol). ``role`` "producer" pushes; "consumer" stages up to ``capacity`` bytes and serves ``take``.
    ``on_count(name, n)``, if given, is told of the ``pushed_bytes`` and ``expired`` counts as they happen."""

    def __init__(self, pipe: KVPipeBase, role: Literal["producer", "consumer"], capacity: int = 1 << 30,
                 ttl: float = 60.0, on_count: Callable[[str, int], None] | None = None) -> None:
        if role not in ("producer", "consumer"):
            raise ValueError(f"role must be 'producer' or 'consumer', got {role!r}")
        if capacity <= 0 or ttl <= 0:
            raise ValueError(f"capacity and ttl must be > 0, got {capacity} bytes and {ttl} s")
        self.pipe, self.role, self.capacity, self.ttl = pipe, role, capacity, ttl
        self.on_count = on_count
        self._cv = threading.Condition()
        self._closed = threading.Event()
        self.stats = {"begun": 0, "pushed_bytes": 0, "committed": 0, "push_failed": 0, "no_credit": 0,
                      "staged": 0, "taken": 0, "rejected": 0, "expired": 0, "pulled": 0, "aborted": 0, "malformed": 0,
                      "lost": 0, "duplicates": 0}  # lost: messages that broke off mid-way (PipeStalled)
        # producer
        self._epoch = random.randrange(1, 1 << 62)
        self._sent_begins: deque[int] = deque()  # sizes of BEGINs not yet counted by the consumer's last credit
        self._begins_total = 0
        self._credit_free = 0
        self._credit_epoch = -1
        self._failed: set[bytes] = set()
        self._hello_retries = 0
        # BEGIN, PULL, ABORT and HELLO go before queued DATA and COMMIT: a consumer must learn at once that a push
        # has begun (or will not come), not after the pieces of other entries queued before it
        self._control: deque[_Outgoing] = deque()
        self._data: deque[_Outgoing] = deque()
        self._out_cv = threading.Condition()
        # consumer
        self._entries: dict[bytes, PushedEntry] = {}
        self._notices: dict[bytes, tuple[str, float]] = {}  # key -> ("pull" | "rejected" | "aborted", when)
        # keys whose staged entry is complete while the producer pushes the same prompt again (a repeated prompt):
        # the new push's messages are dropped and the staged copy kept
        self._repeats: set[bytes] = set()
        self._free = capacity
        self._producer_epoch = 0
        self._begun = 0
        self._threads: list[threading.Thread] = []
        self._reported_dead = False
        if role == "producer":
            self._start(self._send_loop, "kv-push-sender")
            self._start(self._credit_loop, "kv-push-credit")
            self._enqueue((_header(HELLO, a=self._epoch), None, True, NO_KEY), control=True)
        else:
            self._start(self._receive_loop, "kv-push-receiver")

    def _start(self, target: object, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    # ---------------------------------------------------------------- producer
    @property
    def healthy(self) -> bool:
        """Open, and every thread of this end still running (a dead one is logged once; callers fall back to pull)."""
        dead = [t.name for t in self._threads if not t.is_alive()]
        if dead and not self._closed.is_set() and not self._reported_dead:
            self._reported_dead = True
            logger.error("push channel: thread(s) %s died; this end stops pushing (entries go by pull)", dead)
            with self._cv:  # a consumer's staged entries: nobody would expire them any more
                for key in list(self._entries):
                    self._drop(key, "aborted")
        return not dead and not self._closed.is_set()

    def begin(self, key: bytes, nbytes: int, num_layers: int, num_blocks: int) -> bool:
        """Announce an entry if the consumer's credit covers it: True means push its pieces, then ``commit``;
        False means the consumer has no room (or has not been heard from): serve this entry by pull instead."""
        if not self.healthy:
            self.stats["no_credit"] += 1
            return False
        with self._cv:
            if self._credit_epoch != self._epoch or nbytes > self._credit_free - sum(self._sent_begins):
                self.stats["no_credit"] += 1
                return False
            self._sent_begins.append(nbytes)
            self._begins_total += 1
            self.stats["begun"] += 1
        self._enqueue((_header(BEGIN, key, nbytes, num_layers, num_blocks), None, False, key), control=True)
        return True

    def push(self, key: bytes, layer: int, first_block: int, blocks: torch.Tensor, num_blocks: int) -> None:
        """Queue one layer's blocks [first_block, first_block + num_blocks) (``blocks`` is not copied: do not reuse
        it). Returns at once; a sender thread moves it."""
        self._enqueue((_header(DATA, key, layer, first_block, num_blocks), blocks, False, key), control=False)

    def commit(self, key: bytes, num_tokens: int, meta: torch.Tensor | None) -> None:
        """The entry is complete: the consumer may hand it out."""
        self._enqueue((_header(COMMIT, key, num_tokens), meta, False, key), control=False)

    def notify_pull(self, key: bytes) -> None:
        """Tell the consumer not to wait for a push of these tokens."""
        self._enqueue((_header(PULL, key), None, False, key), control=True)

    def abort(self, key: bytes) -> None:
        self._enqueue((_header(ABORT, key), None, False, key), control=True)

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

    def failed(self, key: bytes) -> bool:
        """True if sending part of this entry failed (the consumer will not get it)."""
        with self._cv:
            return key in self._failed

    def _send_loop(self) -> None:
        while True:
            item = self._next_outgoing()
            if item is None:
                return
            header, payload, is_hello, key = item
            if key in self._failed and int(header[2]) not in (HELLO, PULL):
                continue  # the rest of an entry that failed (its PULL notice still goes)
            try:
                self.pipe.send_tensor(header)
                if is_hello:
                    self._hello_retries = 0
                if int(header[2]) in (DATA, COMMIT):
                    self.pipe.send_tensor(payload)
                    if payload is not None and int(header[2]) == DATA:
                        self._count("pushed_bytes", payload.numel() * payload.element_size())
                    if int(header[2]) == COMMIT:
                        self.stats["committed"] += 1
            except PipeClosed:
                return
            except Exception as e:  # a PipeError, or a bug: this entry fails, the sending goes on
                if not isinstance(e, PipeError):
                    logger.exception("push channel: sending failed unexpectedly")
                if is_hello and isinstance(e, PipeError):  # retried, less and less often (XpYd: it may not run)
                    self._hello_retries += 1
                    log = logger.info if self._hello_retries == 1 else logger.debug
                    log("push channel: the consumer is not reachable (%s); retrying, less and less often", e)
                    pause = min(30.0, 2.0 ** min(self._hello_retries - 1, 5))
                    threading.Timer(pause, self._enqueue, ((header, None, True, NO_KEY), True)).start()
                    continue
                with self._cv:
                    if key not in self._failed:
                        self._failed.add(key)
                        self.stats["push_failed"] += 1
                logger.warning("push channel: sending an entry failed (%s); the consumer will recompute it", e)

    def _credit_loop(self) -> None:
        last_hello = time.monotonic()
        while not self._closed.is_set():
            try:
                kind, _, (epoch, free, begun, _) = _parse(self.pipe.recv_tensor(timeout=_POLL))
            except PipeStalled as e:  # _POLL bounds only the wait for a message to start
                self.stats["lost"] += 1
                logger.warning("push channel: a credit from the consumer broke off (%s); its next one replaces it", e)
                continue
            except PipeTimeout:
                continue
            except PipeClosed:
                return
            except (PipeError, ValueError) as e:
                self.stats["malformed"] += 1
                logger.warning("push channel: ignored a bad message from the consumer: %s", e)
                continue
            except Exception:  # a bug must not end the credit loop for good
                self.stats["malformed"] += 1
                logger.exception("push channel: reading the consumer's credit failed; skipped")
                continue
            if kind != CREDIT:
                self.stats["malformed"] += 1
                logger.warning("push channel: unexpected %s from the consumer", KIND_NAMES[kind])
                continue
            with self._cv:
                if epoch != self._epoch:  # a consumer that has not met this producer yet (or restarted)
                    self._credit_epoch = -1
                    if time.monotonic() - last_hello > 1.0 or self.stats["begun"] == 0:
                        last_hello = time.monotonic()
                        self._begins_total = 0  # the consumer counts BEGINs from this HELLO on
                        self._sent_begins.clear()
                        self._enqueue((_header(HELLO, a=self._epoch), None, True, NO_KEY), control=True)
                    continue
                uncounted = self._begins_total - begun
                while len(self._sent_begins) > max(uncounted, 0):
                    self._sent_begins.popleft()
                self._credit_free, self._credit_epoch = free, epoch

    # ---------------------------------------------------------------- consumer
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
                    self._notices.pop(key, None)
                    return None
                if entry.committed:
                    del self._entries[key]
                    self._free += entry.nbytes
                    self.stats["taken"] += 1
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed.is_set():
                    return None
                self._cv.wait(remaining)
        self._send_credit()
        return entry

    def _send_credit(self) -> None:
        with self._cv:
            header = _header(CREDIT, a=self._producer_epoch, b=self._free, c=self._begun)
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
                self.stats["lost"] += 1
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
                kind, key, fields = _parse(header)
                self._handle(kind, key, fields)
            except (PipeError, ValueError) as e:
                self.stats["malformed"] += 1
                logger.error("push channel: ignored a bad message from the producer: %s", e)
            except Exception:  # a bug must not end the receiving for good: log it, skip this message
                self.stats["malformed"] += 1
                logger.exception("push channel: handling a message from the producer failed; skipped")
            self._expire()

    def _handle(self, kind: int, key: bytes, fields: list[int]) -> None:
        a, b, c, _ = fields
        if kind == HELLO:
            with self._cv:
                self._producer_epoch, self._begun = a, 0
                self._repeats.clear()
            self._send_credit()
        elif kind == BEGIN:
            with self._cv:
                self._begun += 1
                staged = self._entries.get(key)
                self._repeats.discard(key)  # a repeat that never ended (its producer went away) ends here
                if staged is not None and staged.committed:
                    self._repeats.add(key)  # every message of the first push came before its COMMIT
                    self.stats["duplicates"] += 1
                elif staged is not None or a > self._free or b <= 0 or c <= 0:
                    self._notices[key] = ("rejected", time.monotonic())
                    self.stats["rejected"] += 1
                    self._cv.notify_all()
                    logger.warning("push channel: refused an entry of %d bytes (%d of %d staging bytes free)", a,
                                   self._free, self.capacity)
                else:
                    self._entries[key] = PushedEntry(a, b, c)
                    self._free -= a
                    self.stats["staged"] += 1
            self._send_credit()
        elif kind == DATA:
            blocks = self.pipe.recv_tensor()
            with self._cv:
                if key in self._repeats:
                    return  # the same bytes as the staged entry's
                entry = self._entries.get(key)
                if entry is None:
                    return  # refused, expired or aborted: drop the bytes
                nbytes = 0 if blocks is None else blocks.numel() * blocks.element_size()
                if blocks is None or a >= entry.num_layers or c <= 0 or b + c > entry.num_blocks or \
                        entry.received + nbytes > entry.nbytes or entry.committed:
                    self._drop(key, "aborted")
                    raise ValueError(f"DATA (layer {a}, blocks {b}+{c}, {nbytes} bytes) does not fit its entry "
                                     f"({entry.num_layers} layers, {entry.num_blocks} blocks, {entry.received} of "
                                     f"{entry.nbytes} bytes received): entry dropped")
                entry.pieces.append((a, b, blocks))
                entry.received += nbytes
        elif kind == COMMIT:
            meta = self.pipe.recv_tensor()
            with self._cv:
                if key in self._repeats:
                    self._repeats.discard(key)
                    return
                entry = self._entries.get(key)
                if entry is not None:
                    entry.committed, entry.meta, entry.num_tokens = True, meta, a
                    self._cv.notify_all()
        elif kind in (PULL, ABORT):
            with self._cv:
                self.stats["pulled" if kind == PULL else "aborted"] += 1
                if key in self._repeats:  # the repeat will not come: the staged copy stays
                    self._repeats.discard(key)
                else:
                    self._drop(key, "pull" if kind == PULL else "aborted")
            self._send_credit()
        else:
            raise ValueError(f"unexpected {KIND_NAMES[kind]} from the producer")

    def _drop(self, key: bytes, why: str) -> None:
        """Forget a staged entry (under the lock) and leave a notice for a waiting ``take``."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._free += entry.nbytes
        self._notices[key] = (why, time.monotonic())
        self._cv.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        self.stats[name] += n
        if self.on_count is not None:
            self.on_count(name, n)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cv:
            old = [k for k, e in self._entries.items() if now - e.created > self.ttl]
            for key in old:
                self._drop(key, "expired")
                self._notices.pop(key, None)
                self._count("expired")
            for key in [k for k, (_, when) in self._notices.items() if now - when > self.ttl]:
                del self._notices[key]
        if old:
            logger.warning("push channel: dropped %d staged entr%s nobody took within %.0f s", len(old),
                           "y" if len(old) == 1 else "ies", self.ttl)
            self._send_credit()

    def has_begun(self, key: bytes) -> bool:
        """Consumer: a push of ``key`` has begun (its BEGIN arrived) and the entry was not taken or dropped."""
        with self._cv:
            return key in self._entries

    def has_producer(self) -> bool:
        """Consumer: a producer has said HELLO on this channel (before that, ``take`` does not wait)."""
        with self._cv:
            return self._producer_epoch != 0

    def staged_bytes(self) -> int:
        with self._cv:
            return self.capacity - self._free

    def __len__(self) -> int:
        with self._cv:
            return len(self._entries)

    # ---------------------------------------------------------------- closing
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
