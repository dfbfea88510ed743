"""The consumer half of ``SimpleBuffer``: ``drop_select`` sends a request and waits for its answer; one receiving
thread reads every answer and hands it to the request with its ``seq``, so that several threads may have requests in
flight at once. The frames are those of ``simple_wire``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kv_lookup_buffer.base import AnswerAbandoned, BufferClosed, Counts
from kv_lookup_buffer.simple_wire import (
    CLOSED,
    HIT,
    LOOKED,
    MISS,
    OP_CLOSE,
    OP_DROP_SELECT,
    OP_LOOKUP,
    OP_RELEASE,
    read_answer,
    request_frame,
)
from kv_pipe import KVPipeBase, PipeClosed, PipeError, PipeStalled, PipeTimeout, Scatter

logger = logging.getLogger(__name__)

_POLL = 0.5  # how often the receiving thread looks at close()


def died_error(thread: str) -> BufferClosed:
    return BufferClosed(f"this buffer's {thread} thread died (see the log): use a new buffer")


@dataclass
class _Pending:
    """A consumer request waiting for its answer."""

    key_out: torch.Tensor | Scatter | None
    receiving: bool = False  # its entry is being received (into key_out): the caller waits for the end of it
    abandoned: bool = False  # the caller gave up at its deadline while it was being received
    done: threading.Event = field(default_factory=threading.Event)
    landed: threading.Event = field(default_factory=threading.Event)  # nothing more can be written into key_out
    result: list[torch.Tensor | None] | None = None
    looked: tuple[int, int] | None = None  # a lookup's answer: (tokens that agree, tokens held)
    error: BaseException | None = None


class _AnswerBrokeOff(PipeError):
    """The entry of a HIT answer did not arrive whole."""


class BufferConsumer:
    """The consumer's side of a ``SimpleBuffer`` over ``signal_pipe`` (requests) and ``data_pipe`` (answers).

    ``closed`` and ``stats`` are the buffer's own (shared with it); ``died(thread)`` is called if the receiving thread
    ends while the buffer is open.
    """

    def __init__(self, signal_pipe: KVPipeBase, data_pipe: KVPipeBase, closed: threading.Event,
                 stats: Counts, died: Callable[[str], None]) -> None:
        self.signal_pipe, self.data_pipe = signal_pipe, data_pipe
        self.stats = stats
        self._closed = closed
        self._died = died
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._seq = 0  # the request counter
        self._pending: dict[int, _Pending] = {}  # requests in flight, by seq
        # after an answer broke off, how long writes the producer started may still land in its key_out
        self._late_writes = getattr(getattr(data_pipe, "config", None), "timeout", 30.0) + 5.0

    def drop_select(self, query: torch.Tensor | None, key_out: torch.Tensor | Scatter | None,
                    key_rows: tuple[int, int] | None, key_part: tuple[int, int] | None, shares: int,
                    wait: float, deadline: float | None = None, lease: int = 0) -> list[torch.Tensor | None]:
        """``SimpleBuffer.drop_select`` with its arguments checked (``query``: the roi-masked tokens)."""
        pending = self._ask(lambda seq: request_frame(OP_DROP_SELECT, seq, query, key_rows, key_part, shares, lease),
                            _Pending(key_out), wait, deadline, "drop_select")
        assert pending.result is not None
        return pending.result

    def lookup(self, query: torch.Tensor, lease: int, lease_ms: int, wait: float) -> tuple[int, int]:
        """``SimpleBuffer.lookup`` with its arguments checked."""
        pending = self._ask(lambda seq: request_frame(OP_LOOKUP, seq, query, lease=lease, lease_ms=lease_ms),
                            _Pending(None), wait, None, "lookup")
        if pending.looked is None:
            raise ValueError("the producer answered a lookup with an entry: it runs another version of this project")
        return pending.looked

    def release(self, lease: int, wait: float) -> None:
        """``SimpleBuffer.release`` with its arguments checked."""
        self.signal_pipe.send_tensor(request_frame(OP_RELEASE, -1, lease=lease), timeout=wait)

    def _ask(self, frame: Callable[[int], torch.Tensor], pending: _Pending, wait: float,
             deadline: float | None, what: str) -> _Pending:
        """Send the request ``frame(seq)`` and wait for its answer (see ``SimpleBuffer.drop_select`` for ``wait`` and
        ``deadline``); ``pending`` holds it once it came."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._pending[seq] = pending
            if self._thread is None:
                self._thread = threading.Thread(target=self._receive_guarded, name="kv-buffer-receiver", daemon=True)
                self._thread.start()
        try:
            self.signal_pipe.send_tensor(frame(seq), timeout=wait)
            if not pending.done.wait(wait):
                with self._lock:
                    receiving = pending.receiving
                    if not receiving:
                        self._pending.pop(seq, None)  # a late answer is dropped, never received into key_out
                if not receiving:
                    raise TimeoutError(f"no answer to {what} request {seq} within {wait:.1f} s")
                if deadline is None:
                    pending.done.wait()
                elif not pending.done.wait(max(deadline - time.monotonic(), 0.0)):
                    with self._lock:
                        pending.abandoned = not pending.done.is_set()
                    if pending.abandoned:
                        raise AnswerAbandoned(f"the answer to drop_select request {seq} was still arriving at the "
                                              "deadline", pending.landed)
        finally:
            with self._lock:
                self._pending.pop(seq, None)
        if pending.error is not None:
            raise pending.error
        return pending

    def _receive_guarded(self) -> None:
        """``_receive_loop``, and if it ever ends while the buffer is open (only something like SystemExit can end
        it): the buffer is unhealthy, the requests in flight and every later one fail with a clear error."""
        try:
            self._receive_loop()
        finally:
            if not self._closed.is_set():
                self._died("receiving")
                logger.error("the buffer's receiving thread ended unexpectedly: drop_select fails from now on")
                self.fail_pending(died_error("receiving"))

    def _receive_loop(self) -> None:
        """Receive every answer and hand it to its request."""
        while not self._closed.is_set():
            try:
                frame = self.data_pipe.recv_tensor(timeout=_POLL)  # _POLL: the wait for an answer to start only
                try:
                    status, seq, looked = read_answer(frame, (HIT, MISS, CLOSED, LOOKED), "answer")
                except ValueError as e:  # e.g. the rest of an answer that broke off, resent on a new connection
                    self.stats.add("stray_frames")
                    logger.warning("skipped a frame that starts no answer: %s", e)
                    continue
                if status == CLOSED:
                    self.fail_pending(BufferClosed("the producer closed the buffer"))
                    continue
                with self._lock:
                    pending = self._pending.get(seq)
                    if pending is not None and status == HIT:
                        pending.receiving = True
                if status == LOOKED:
                    if pending is not None:
                        pending.looked = looked
                    result: list[torch.Tensor | None] = [None] * 5
                elif status == MISS:
                    result = [None] * 5
                else:
                    try:
                        result = self._receive_entry(pending.key_out if pending is not None else None)
                    except Exception as e:  # whatever broke it, the rest of the entry is still coming
                        if pending is not None:  # writes the producer started may land in key_out a while yet
                            threading.Timer(self._late_writes, pending.landed.set).start()
                        self.data_pipe.abandon_receive(f"answer {seq} broke off: {e}")
                        raise _AnswerBrokeOff(f"the answer to drop_select request {seq} broke off: {e}") from e
                    if pending is None:
                        self.stats.add("late_hits_dropped")
                        logger.warning("dropped a late answer to drop_select request %d (its caller gave up)", seq)
                    elif pending.abandoned:
                        self.stats.add("abandoned_hits_dropped")
                        logger.warning("dropped the answer to drop_select request %d: it came whole only after its "
                                       "caller's deadline", seq)
                if pending is not None:
                    pending.landed.set()
                    pending.result = result
                    pending.done.set()
            except PipeTimeout as e:
                if not isinstance(e, PipeStalled):
                    continue  # idle
                self._answers_lost(e, broke_off=True)  # an answer's header broke off: never mistaken for idleness
            except PipeClosed:
                self.fail_pending(BufferClosed("the buffer was closed"))
                return
            except (PipeError, ValueError) as e:  # the answers in flight are lost with the connection
                self._answers_lost(e, broke_off=isinstance(e, _AnswerBrokeOff))
            except Exception as e:  # a bug must not leave callers waiting forever: fail them and go on
                logger.exception("drop_select answers lost")
                self.fail_pending(e)

    def _answers_lost(self, error: BaseException, broke_off: bool) -> None:
        """The connection answers come on failed (``broke_off``: in the middle of an answer, which is counted): the
        requests in flight fail now (their answers are lost with it) rather than at their timeout."""
        if broke_off:
            with self._lock:
                self.stats.add("answers_lost")
        logger.warning("drop_select answers lost: %s", error)
        self.fail_pending(error)
        self._closed.wait(0.01)

    def fail_pending(self, error: BaseException) -> None:
        """Fail every request in flight; they leave ``_pending`` at once, so that an answer to one of them arriving
        later is dropped as late, never received into its ``key_out``."""
        with self._lock:
            waiting = list(self._pending.values())
            self._pending.clear()
        for pending in waiting:
            if not pending.done.is_set():
                pending.error = error
                pending.done.set()

    def _receive_entry(self, key_out: torch.Tensor | Scatter | None) -> list[torch.Tensor | None]:
        tokens, roi = self.data_pipe.recv_tensor(), self.data_pipe.recv_tensor()
        key = self.data_pipe.recv_tensor() if key_out is None else self.data_pipe.recv_tensor(out=key_out)  # type: ignore[call-arg]
        return [tokens, roi, key, self.data_pipe.recv_tensor(), self.data_pipe.recv_tensor()]

    def close(self, tell: bool) -> None:
        """The buffer is closed (``closed`` is set): fail the requests in flight, wait for the receiving thread, and
        if ``tell``, say goodbye to the producer."""
        self.fail_pending(BufferClosed("the buffer was closed"))
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        if not tell:
            return
        try:
            self.signal_pipe.send_tensor(request_frame(OP_CLOSE, -1), timeout=1.0)
        except PipeError as e:
            logger.info("could not tell the producer that the buffer closed: %s", e)
