"""SimpleBuffer: the producer holds KV entries keyed by tokens; the consumer asks for one over a KV pipe and takes it.
vLLM v0's interface (``insert`` on the producer, ``drop_select`` on the consumer), plus lookups under leases; each
call goes to its producer half (``simple_producer.BufferProducer``: the entries, the threads answering requests) or
its consumer half (``simple_consumer.BufferConsumer``: requests in flight, the thread receiving answers).

The contract and its extensions: docs/api.md; the frames (``simple_wire``): docs/wire.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal

import torch

from kv_lookup_buffer.base import BufferClosed, Counts, KVLookupBufferBase
from kv_lookup_buffer.simple_consumer import BufferConsumer, died_error
from kv_lookup_buffer.simple_producer import BufferProducer
from kv_lookup_buffer.simple_wire import MAX_LEASE_MS, MAX_SHARES, masked_tokens
from kv_pipe import KVPipeBase, Scatter

__all__ = ["DEFAULT_TIMEOUT", "BufferClosed", "SimpleBuffer"]

DEFAULT_TIMEOUT = 30.0


class SimpleBuffer(KVLookupBufferBase):
    """A lookup buffer holding at most ``buffer_size_thresh`` bytes of tensors.

    The producer calls ``insert``; a thread serving the consumer's requests starts with the first insert (or
    ``start_serving()``). The consumer calls ``drop_select``, from as many threads as it likes. ``role`` is taken
    from the first of those calls unless given; ``close()`` uses it to tell the right side. ``timeout`` bounds every
    wait (default: the data pipe's configured timeout, else 30 s).

    Producer options: ``max_age`` (seconds; None: forever) drops entries nobody took within that time; ``evict``
    makes an insert that does not fit drop the oldest entries instead of waiting for a consumer to take some (the
    entries being sent at that moment still count, so the bytes held may pass the threshold by those). Both are
    counted in ``stats`` (``expired``, ``evicted``) and logged once per entry. ``on_count``: see ``Counts``.

    ``producer`` and ``consumer`` are its two halves (``consumer`` is None without pipes); both count into ``stats``.
    """

    def __init__(self, signal_pipe: KVPipeBase | None, data_pipe: KVPipeBase | None, buffer_size_thresh: float,
                 timeout: float | None = None, role: Literal["producer", "consumer"] | None = None, *,
                 max_age: float | None = None, evict: bool = False,
                 on_count: Callable[[str, int], None] | None = None) -> None:
        if buffer_size_thresh <= 0:
            raise ValueError(f"buffer_size_thresh must be > 0 bytes, got {buffer_size_thresh}")
        if max_age is not None and not max_age > 0:
            raise ValueError(f"max_age must be > 0 seconds or None, got {max_age}")
        if role not in (None, "producer", "consumer"):
            raise ValueError(f"role must be 'producer', 'consumer' or None, got {role!r}")
        if (signal_pipe is None or data_pipe is None) and role != "producer":
            raise ValueError("only a producer may start without pipes (it serves the links given to serve_link)")
        self.signal_pipe = signal_pipe
        self.data_pipe = data_pipe
        self.buffer_size_threshold = buffer_size_thresh
        config = getattr(data_pipe, "config", None)
        self.timeout = timeout if timeout is not None else getattr(config, "timeout", DEFAULT_TIMEOUT)
        self.max_age = max_age
        self.evict = evict
        self.role = role
        self._closed = threading.Event()
        self._died: str | None = None  # the thread of ours that ended unexpectedly (see ``healthy``)
        # requests_lost (producer) / answers_lost (consumer): requests / answers that broke off mid-way (their
        # sender froze or died after they had begun to arrive); logged too
        self.stats = Counts(("hits", "misses", "malformed", "late_hits_dropped", "abandoned_hits_dropped", "stray_frames",
                             "expired", "evicted", "lookups", "leases", "leases_expired", "leases_released",
                             "hit_bytes", "hit_key_bytes", "requests_lost", "answers_lost"), on_count)
        self.producer = BufferProducer(signal_pipe, data_pipe, buffer_size_thresh, self.timeout, max_age, evict,
                                       self._closed, self.stats, self._thread_died)
        self.consumer = None if signal_pipe is None or data_pipe is None else BufferConsumer(
            signal_pipe, data_pipe, self._closed, self.stats, self._thread_died)

    def _thread_died(self, thread: str) -> None:
        self._died = thread

    @property
    def buffer_size(self) -> int:
        """Producer: bytes held (entries in the index and the ones being sent)."""
        return self.producer.buffer_size

    def __len__(self) -> int:
        return len(self.producer)

    # ---------------------------------------------------------------- producer
    def insert(self, input_tokens: torch.Tensor, roi: torch.Tensor | None, key: torch.Tensor | None,
               value: torch.Tensor | None, hidden: torch.Tensor | None, *, copy: bool = True,
               ready: Callable[[], None] | None = None) -> None:
        """See ``KVLookupBufferBase.insert``. ``copy=False`` (an extension): keep the caller's tensors instead of
        copying them; the caller hands them over and must not touch them again (saves a copy of a fresh gather).
        ``ready`` (an extension): the tensors are still being filled (an asynchronous copy out of a device); they
        are handed over as with ``copy=False``, and the entry is served once ``ready()`` has returned (which it does
        once they are filled). With ``evict``, never waits: the oldest entries make room."""
        self._check_usable("insert")
        self._take_role("producer")
        self.producer.insert((input_tokens, roi, key, value, hidden), copy and ready is None, ready)

    def make_room(self, nbytes: int) -> bool:
        """Producer, ``evict`` (an extension): drop the oldest entries no lease holds, ``nbytes`` of them at least
        (or all); whether any was dropped. For memory the buffer's entries live in beyond its own count."""
        self._take_role("producer")
        return self.producer.make_room(nbytes)

    def start_serving(self) -> None:
        """Start answering the consumer's requests on the constructor's pipes (idempotent; insert calls it)."""
        self._take_role("producer")
        self.producer.start_serving()

    def serve_link(self, signal_pipe: KVPipeBase, data_pipe: KVPipeBase | None = None) -> None:
        """Producer (an extension for XpYd): also answer the consumer at the other end of these pipes (``data_pipe``
        defaults to ``signal_pipe``). Every consumer takes from the same entries; each gets its answers on its own
        link. Serving a link ends when its pipe is closed."""
        self._take_role("producer")
        self.producer.serve_link(signal_pipe, data_pipe if data_pipe is not None else signal_pipe)

    # ---------------------------------------------------------------- consumer
    def drop_select(self, input_tokens: torch.Tensor | None, roi: torch.Tensor | None, *,
                    key_out: torch.Tensor | Scatter | None = None, key_rows: tuple[int, int] | None = None,
                    key_part: tuple[int, int] | None = None, shares: int = 1,
                    timeout: float | None = None, deadline: float | None = None,
                    lease: int = 0) -> list[torch.Tensor | None]:
        """See ``KVLookupBufferBase.drop_select``. Extensions:

        - ``key_rows=(start, stop)``: only rows [start, stop) of the entry's key are sent (its first dimension,
          clamped to the rows it has); the entry is taken all the same.
        - ``key_part=(start, stop)``: only that range of the key's third dimension is sent (for a KV entry
          ``[blocks, layers, heads, ...]``: some heads), as a contiguous tensor.
        - ``shares``: this request takes one of that many parts of the entry (e.g. the heads of one TP rank); the
          entry stays for the others and leaves the buffer with the last of them (or when it expires).
        - ``key_out``: where the entry's key is received, through the data pipe's ``recv_tensor(out=...)``
          (``MooncakePipe``): a buffer (the key returned is then a view of it: reusing one buffer for large entries
          saves the page faults of a fresh allocation each time), or a ``Scatter`` of memory regions (the key
          returned is then a ``meta`` tensor: its bytes are in the regions). If this call raises, do not reuse a
          buffer ``key_out`` (see ``MooncakePipe.recv_tensor``).
        - ``timeout``: seconds to wait for the answer (default: the buffer's); ``TimeoutError`` after that. Once the
          entry is being received the call waits for the end of that (the pipe's own timeouts bound it), so nothing
          is written into ``key_out`` after this call returns or raises; unless
        - ``deadline`` (a ``time.monotonic()`` value) comes first: the call then raises ``AnswerAbandoned`` while the
          entry is still arriving; bytes may go on landing in ``key_out`` until its ``landed`` event is set (the
          answer is received to its end in the background and dropped).
        - ``lease``: the lease a ``lookup`` was given; the entry it holds is taken (an entry held under another lease
          that has not ended is never taken, with or without one).

        Several threads may call this at once: their requests are in flight together.
        """
        self._check_usable("drop_select")
        self._take_role("consumer")
        assert self.consumer is not None  # a buffer without pipes is a producer's
        if input_tokens is not None:
            query = masked_tokens(input_tokens, roi)  # a bad query is refused here rather than at the producer
        elif roi is not None:
            raise ValueError("roi given without input_tokens")
        else:
            query = None
        for name, span in (("key_rows", key_rows), ("key_part", key_part)):
            if span is not None and not (0 <= span[0] <= span[1]):
                raise ValueError(f"{name} must be (start, stop) with 0 <= start <= stop, got {span}")
        if isinstance(shares, bool) or not isinstance(shares, int) or not 1 <= shares <= MAX_SHARES:
            raise ValueError(f"shares must be an integer from 1 to {MAX_SHARES}, got {shares!r}")
        wait = self.timeout if timeout is None else timeout
        return self.consumer.drop_select(query, key_out, key_rows, key_part, shares, wait, deadline, _lease(lease))

    def lookup(self, input_tokens: torch.Tensor, roi: torch.Tensor | None = None, *, lease: int, lease_seconds: float,
               timeout: float | None = None) -> tuple[int, int]:
        """Consumer (an extension): how much of these tokens the producer holds, without taking anything: ``(agree,
        held)``, the best entry ``drop_select`` would take agrees with the query on its first ``agree`` tokens and
        holds ``held`` tokens ((0, 0): none). That entry is held for ``lease`` (a non-zero id the caller picks, e.g.
        at random) for ``lease_seconds`` (the producer caps it at 600 s): no expiry, eviction or request under
        another lease takes it until a ``drop_select(..., lease=lease)`` does or the lease ends (counted by the
        producer as ``leases_expired``). ``TimeoutError`` if no answer comes within ``timeout`` (default: the
        buffer's)."""
        self._check_usable("lookup")
        self._take_role("consumer")
        assert self.consumer is not None
        if not _lease(lease):
            raise ValueError("lookup needs a non-zero lease")
        if not 0 < lease_seconds <= MAX_LEASE_MS / 1e3:
            raise ValueError(f"lease_seconds must be in (0, {MAX_LEASE_MS / 1e3:g}], got {lease_seconds!r}")
        query = masked_tokens(input_tokens, roi)
        if not query.numel():
            raise ValueError("lookup needs at least one token")
        wait = self.timeout if timeout is None else timeout
        agree, held = self.consumer.lookup(query, lease, max(1, round(lease_seconds * 1e3)), wait)
        if agree > query.numel():
            raise ValueError(f"the producer's answer to a lookup of {query.numel()} tokens says {agree} agree")
        return agree, held

    def release(self, lease: int, timeout: float | None = None) -> None:
        """Consumer (an extension): no request will come under ``lease``: the producer lets the entries it holds for
        it go (expiry and eviction apply again; counted as ``leases_released``). Not answered."""
        self._check_usable("release")
        self._take_role("consumer")
        assert self.consumer is not None
        if not _lease(lease):
            raise ValueError("release needs a non-zero lease")
        self.consumer.release(lease, self.timeout if timeout is None else timeout)

    # ------------------------------------------------------------------ state
    def _check_usable(self, op: str) -> None:
        if self._closed.is_set():
            raise BufferClosed(f"{op} on a closed buffer")
        if self._died is not None:
            raise died_error(self._died)

    def _take_role(self, role: str) -> None:
        if self.role is None:
            self.role = role
        elif self.role != role:
            raise RuntimeError(f"this SimpleBuffer is the {self.role}'s end; "
                               f"{'insert' if role == 'producer' else 'drop_select'} belongs to the {role}")

    @property
    def healthy(self) -> bool:
        """Open, and its receiving thread (consumer) or the serving thread of its constructor's pipes (producer) has
        not died. A link whose serving thread died is closed instead: its consumer makes it again."""
        return not self._closed.is_set() and self._died is None

    def close(self) -> None:
        """Producer: stop serving and answer CLOSED to the consumer. Consumer: tell the producer. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.consumer is not None:
            self.consumer.close(tell=self.role == "consumer")
        self.producer.close(tell=self.role == "producer")


def _lease(lease: int) -> int:
    """``lease`` if a valid lease id (an int64; 0: none), else ``ValueError``."""
    if isinstance(lease, bool) or not isinstance(lease, int) or not -(1 << 63) <= lease < 1 << 63:
        raise ValueError(f"lease must be an int64 (0: none), got {lease!r}")
    return lease
