"""MooncakeStore: a lookup buffer over Mooncake Store, the fleet's KV pool (vLLM v0's store-backed buffer of the same
name). Every instance puts KV blocks in and gets them out; an object is one block of one TP rank (every layer), keyed
by content (``block_keys``), so the same prefix computed on any instance is the same object.

A pool is written by many, so every object carries a tag: a random nonce and an AES-GMAC of its key and bytes under
a key of that object's own, derived (BLAKE3) from the fleet's secret and the nonce. With a secret that is a MAC (an
object forged, altered or put under another key fails its check); without one the derivation's key is public and
the tag catches corruption only. A get checks each object before it counts; one that fails is counted, removed from
the pool (its key can be put again) and ends the batch there.

The store's calls block (a frozen master holds one until the engine's own RPC timeout): each runs in a thread of this
buffer's own and is waited for until its timeout, then reported as ``StoreTimeout``; the memory it reads or writes
stays the caller's to keep until ``StoreTimeout.done`` (the call really ended).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import blake3
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kv_lookup_buffer.base import Counts, KVStoreBufferBase
from kv_lookup_buffer.store_config import StoreConfig
from kv_pipe import ConfigError, parse_host_port

logger = logging.getLogger(__name__)

TAG = 32  # bytes of an object's tag, after its KV bytes: its nonce, then its MAC
NONCE = 16
KEY_PREFIX = "mkv2"  # v1's tags were BLAKE3 hashes: its objects are not read (nor removed as forged)
TAG_CONTEXT = "mooncake-kv-transfer pool object tag v2"
# each object's MAC key is its own (its nonce's, 128 random bits, never reused): one IV for all is safe. GMAC, not
# BLAKE3, as it checks ~1.7x as fast on one core (AES-NI and carry-less multiplication): the check is on the load path
MAC_IV = bytes(12)
MAX_TAGS = 8192  # objects in flight at once (their tags live in one registered array)
THREADS = 8
JOIN_WAIT = 10.0  # seconds the constructor waits for the client to join the pool (then it joins in the background)
JOIN_RETRY = 5.0  # seconds between attempts to join a pool whose master did not take the client
PROBE_TIMEOUT = 2.0  # seconds to connect to the master before an attempt to join
PROBE_SETUP_TIMEOUT = 20.0  # seconds a trial client in a process of its own may take to join (a frozen master: never)
PUT_ATTEMPTS = 3
# the store's error codes a caller may meet (Mooncake's ErrorCode)
CODES = {-200: "segment not mounted (the master restarted?)", -600: "buffer too small", -704: "object not found",
         -800: "invalid parameters (a shorter object)", -900: "master unreachable",
         -901: "request to the master timed out", -1010: "no space in the pool"}
WRONG_SIZE = (-600, -800)  # what a get into a block and its tag answers for a longer / a shorter object
COUNTS = ("put_objects", "put_bytes", "got_objects", "got_bytes", "rejected", "missing", "errors", "timeouts")


class StoreError(RuntimeError):
    """The pool could not do what was asked (master or holder unreachable, an error code)."""


class StoreTimeout(StoreError, TimeoutError):
    """A call did not end in time; it may still read or write its memory until ``done`` completes."""

    def __init__(self, message: str, done: Future[Any]) -> None:
        super().__init__(message)
        self.done = done


def block_keys(namespace: str, tokens: Sequence[int], block_size: int, first: int = 0,
               count: int | None = None) -> list[str]:
    """The keys of the full blocks of ``tokens`` (blocks ``first`` .. ``first + count - 1``; default all): each is
    the namespace (what the KV's bytes depend on besides the tokens: the model, the layout, the rank's heads) and a
    chained hash of every token up to the end of its block, so that a key names one prefix."""
    full = len(tokens) // block_size
    end = full if count is None else min(full, first + count)
    chain = hashlib.sha256(namespace.encode()).digest()
    keys = []
    ids = torch.as_tensor(list(tokens[:end * block_size]), dtype=torch.int64).numpy().tobytes()
    step = block_size * 8
    for i in range(end):
        chain = hashlib.sha256(chain + ids[i * step:(i + 1) * step]).digest()
        if i >= first:
            keys.append(f"{KEY_PREFIX}/{namespace}/{chain[:16].hex()}")
    return keys


def _describe(code: int) -> str:
    return f"{code} ({CODES[code]})" if code in CODES else str(code)


def _register_with(client: Any, memory: torch.Tensor) -> int:
    """Register ``memory`` with a store client; its return code."""
    return client.register_buffer(memory.data_ptr(), memory.numel() * memory.element_size())


class MooncakeStore(KVStoreBufferBase):
    """A client of the pool at ``config.master_server_address``. ``local_hostname``: this host's address as the
    other clients reach it (its segment's data moves over the store's own Transfer Engine); ``metadata_server``,
    ``protocol``, ``device_name``: as the pipe's (mooncake.json's). ``secret``: the fleet's (tags are MACs); b"": tags
    that catch corruption only. Rows put or got must lie in memory given to ``register``. ``on_count``: see ``Counts``.
    ``local_first``: puts go to this client's own segment while it has room (else: where the master places them,
    Mooncake's default)."""

    def __init__(self, config: StoreConfig, local_hostname: str, metadata_server: str, protocol: str = "tcp",
                 device_name: str = "", secret: bytes = b"", on_count: Callable[[str, int], None] | None = None,
                 client: Any = None, join_wait: float = JOIN_WAIT, local_first: bool = False) -> None:
        self.config = config
        self.local_first = local_first
        self.stats = Counts(COUNTS, on_count)
        self._key = blake3.blake3(secret, derive_key_context=TAG_CONTEXT).digest()  # no secret: a public key
        self._calls = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="mooncake-pool")
        self._lock = threading.Condition()
        self._closed = False
        self._registered: list[torch.Tensor] = []
        self._tags = torch.zeros(MAX_TAGS * TAG, dtype=torch.uint8)
        self._free_tags = list(range(MAX_TAGS))
        self._client: Any = None
        self._placement: Any = None
        self._joined = threading.Event()
        self.register(self._tags)
        if client is not None:
            self._became(client)
            return
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname.rsplit(":", 1)[0].strip("[]"))
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ConfigError(f"cannot import Mooncake Store ({e}): install the Mooncake Transfer Engine wheel, which "
                              "ships it") from e
        kwargs = {} if config.tenant_id == "default" else {"tenant_id": config.tenant_id}
        setup = (local_hostname, metadata_server, config.global_segment_size, config.local_buffer_size, protocol,
                 device_name, config.master_server_address)
        threading.Thread(target=self._join, args=(MooncakeDistributedStore, setup, kwargs), name="mooncake-pool-join",
                         daemon=True).start()
        if not self._joined.wait(join_wait):
            logger.warning("not in the KV pool yet (master %s did not take this client within %.0f s): requests are "
                           "computed without it until it does", config.master_server_address, join_wait)

    @property
    def joined(self) -> bool:
        return self._joined.is_set()

    def _join(self, client_cls: type, setup: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Join the pool, trying again every ``JOIN_RETRY`` seconds until it works (a master that is down when the
        instance starts, or not up yet). One attempt at a time: the engine's setup waits long for a master that does
        not answer."""
        failures = 0
        while not self._closed:
            rc = self._master_answers(setup)
            if rc == 0:
                client = client_cls()
                rc = client.setup(*setup, **kwargs)
            if rc == 0:
                self._became(client)
                if failures:
                    logger.info("joined the KV pool at master %s", self.config.master_server_address)
                return
            failures += 1
            (logger.warning if failures == 1 else logger.debug)(
                "could not join the KV pool at master %s (setup returned %s): is mooncake_master running there, and "
                "metadata_server %r the one the pool's clients use? Trying again every %.0f s", setup[6],
                _describe(rc), setup[1], JOIN_RETRY)
            with self._lock:
                self._lock.wait_for(lambda: self._closed, timeout=JOIN_RETRY)

    def _master_answers(self, setup: tuple[Any, ...]) -> int:
        """0 if a client of the master in a process of its own could join it just now, else -900 (unreachable) or
        -901 (no answer in time). Asked before each attempt to join: the engine's setup holds the GIL (this whole
        process stops) while it waits for a master, long for one that is down, for ever for one frozen."""
        host, port = parse_host_port(self.config.master_server_address, "master_server_address")
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()
        except OSError:
            return -900
        local, metadata, _segment, _buffer, protocol, device, master = setup
        probe = ("import sys\nfrom mooncake.store import MooncakeDistributedStore\nclient = MooncakeDistributedStore()\n"
                 f"ok = client.setup({local!r}, {metadata!r}, {16 << 20}, {16 << 20}, {protocol!r}, {device!r}, "
                 f"{master!r}) == 0\nclient.close()\nsys.exit(0 if ok else 1)\n")
        try:
            done = subprocess.run([sys.executable, "-c", probe], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=PROBE_SETUP_TIMEOUT, env=os.environ.copy())
        except subprocess.TimeoutExpired:
            return -901
        return 0 if done.returncode == 0 else -900

    def _became(self, client: Any) -> None:
        """``client`` joined the pool: it takes over every registration made so far."""
        with self._lock:
            if self._closed:  # closed while it was joining
                threading.Thread(target=client.close, daemon=True).start()
                return
            for memory in self._registered:
                rc = _register_with(client, memory)
                if rc != 0:
                    logger.error("registering %d bytes with the KV pool's client failed (%s): the pool is off",
                                 memory.nbytes, _describe(rc))
                    return
            self._client = client
            self._placement = self._local_first(client, self.config) if self.local_first else None
            self._joined.set()

    @staticmethod
    def _local_first(client: Any, config: StoreConfig) -> Any:
        """Puts go to this client's own segment while it has room (then anywhere in the pool): each instance holds
        what it computed, and its puts never cross the network."""
        if not config.global_segment_size:
            return None
        try:
            from mooncake.store import ReplicateConfig
        except ImportError:
            return None
        placement = ReplicateConfig()
        placement.preferred_segment = client.get_hostname()
        return placement

    # ---------------------------------------------------------------- memory
    def register(self, memory: torch.Tensor) -> None:
        """Let puts read from and gets write into ``memory`` (a contiguous host tensor the caller keeps alive until
        ``close``); registered with the client now, or once it joined the pool."""
        if memory.device.type != "cpu" or not memory.is_contiguous():
            raise ValueError("only contiguous host memory can be registered with the store")
        with self._lock:
            if self._client is not None:
                rc = _register_with(self._client, memory)
                if rc != 0:
                    raise StoreError(f"registering {memory.nbytes} bytes with the store failed ({_describe(rc)})")
            self._registered.append(memory)

    def _take_tags(self, n: int, timeout: float) -> list[int]:
        with self._lock:
            if n > MAX_TAGS:
                raise ValueError(f"at most {MAX_TAGS} objects per call, got {n}")
            if not self._lock.wait_for(lambda: len(self._free_tags) >= n, timeout=max(timeout, 0.001)):
                raise StoreError("no tag slots free: too many pool calls are stuck")
            taken, self._free_tags = self._free_tags[:n], self._free_tags[n:]
            return taken

    def _give_tags(self, slots: list[int]) -> None:
        with self._lock:
            self._free_tags.extend(slots)
            self._lock.notify_all()

    # ---------------------------------------------------------------- calls
    def _call(self, method: str, *args: Any, timeout: float, after: Callable[[], None] | None = None,
              **kwargs: Any) -> Any:
        """The client's ``method(*args)`` in a thread of ours, waited for at most ``timeout`` seconds; ``after`` runs
        once it really ended (at once if it did in time)."""
        if self._closed:
            raise StoreError("the pool client is closed")
        if not self._joined.is_set():
            raise StoreError(f"not in the KV pool yet (master {self.config.master_server_address} has not taken this "
                             "client)")
        future = self._calls.submit(getattr(self._client, method), *args, **kwargs)
        if after is not None:
            future.add_done_callback(lambda _: after())
        try:
            return future.result(timeout=max(timeout, 0.001))
        except FutureTimeout:
            if future.cancel():  # it never started: nothing of it can run any more
                raise StoreTimeout(f"the pool call waited {timeout:.1f} s for a thread (the store is stuck)",
                                   future) from None
            self.stats.add("timeouts")
            raise StoreTimeout(f"the pool did not answer within {timeout:.1f} s", future) from None

    def _tag(self, key: str, row: torch.Tensor | list[torch.Tensor], nonce: bytes | None = None) -> bytes:
        """The tag of an object's bytes (``row``, or the pieces whose concatenation they are) under ``key``: its
        nonce (a new one if not given) and the GMAC of the key and the bytes under the nonce's own MAC key."""
        nonce = secrets.token_bytes(NONCE) if nonce is None else nonce
        mac = Cipher(algorithms.AES(blake3.blake3(nonce, key=self._key).digest()), modes.GCM(MAC_IV)).encryptor()
        mac.authenticate_additional_data(key.encode() + b"\0")
        for piece in row if isinstance(row, list) else [row]:
            mac.authenticate_additional_data(memoryview(piece.reshape(-1).view(torch.uint8).numpy()))
        mac.finalize()
        return nonce + mac.tag

    def _rows(self, values: torch.Tensor, n: int) -> tuple[int, int]:
        """(first row's address, bytes per row) of ``values[:n]``, which must be contiguous and lie in registered
        memory (the store's engine writes wherever it is told: a get into memory freed meanwhile corrupts the
        process)."""
        if values.device.type != "cpu" or not values.is_contiguous() or values.shape[0] < n:
            raise ValueError("rows must be a contiguous host tensor with a row per key")
        base, size = values.data_ptr(), values[0].numel() * values.element_size()
        if not any(m.data_ptr() <= base and base + n * size <= m.data_ptr() + m.nbytes for m in self._registered):
            raise ValueError("rows must lie in memory registered with the store (MooncakeStore.register)")
        return base, size

    # ---------------------------------------------------------------- the contract
    def contains(self, keys: list[str], timeout: float) -> int:
        held = 0
        for there in self.present(keys, timeout):
            if not there:
                break
            held += 1
        return held

    def present(self, keys: list[str], timeout: float) -> list[bool]:
        """Whether the pool holds each of ``keys`` now."""
        if not keys:
            return []
        found = self._call("batch_is_exist", keys, timeout=timeout)
        if any(code < 0 for code in found):
            self.stats.add("errors")
            raise StoreError("the pool could not tell whether it holds a block "
                             f"({_describe(next(c for c in found if c < 0))})")
        return [code == 1 for code in found]

    def put(self, keys: list[str], values: torch.Tensor, timeout: float) -> int:
        """``values``: a row per key, its object's bytes followed by ``TAG`` bytes this writes the tag into (one
        contiguous object each: a put from several buffers was refused by a full pool instead of evicting)."""
        if not keys:
            return 0
        base, size = self._rows(values, len(keys))
        if size <= TAG:
            raise ValueError(f"a row must hold its object and a {TAG}-byte tag")
        for key, row in zip(keys, values, strict=False):
            flat = row.reshape(-1).view(torch.uint8)
            flat[size - TAG:] = torch.frombuffer(bytearray(self._tag(key, flat[:size - TAG])), dtype=torch.uint8)
        where = () if self._placement is None else (self._placement,)
        deadline = time.monotonic() + timeout
        todo = list(range(len(keys)))
        for _attempt in range(PUT_ATTEMPTS):  # a put that met a full pool may find room once the master evicted
            codes = self._call("batch_put_from", [keys[i] for i in todo], [base + i * size for i in todo],
                               [size] * len(todo), *where, timeout=max(deadline - time.monotonic(), 0.001))
            failed = [i for i, code in zip(todo, codes, strict=False) if code != 0]
            if failed:
                logger.debug("pool puts failed: %s", ", ".join(sorted({_describe(c) for c in codes if c != 0})))
            todo = failed
            if not todo or time.monotonic() >= deadline:
                break
        stored = min(todo) if todo else len(keys)  # the leading run stored
        if todo:
            self.stats.add("errors")
        self.stats.add("put_objects", len(keys) - len(todo))
        self.stats.add("put_bytes", (len(keys) - len(todo)) * (size - TAG))
        return stored

    def get_into(self, keys: list[str], out: torch.Tensor, timeout: float, copy_to: torch.Tensor | None = None) -> int:
        """``copy_to``: rows like ``out``'s in memory the store does not know: each object is copied there before it
        is checked, and the copy is what the caller uses (the store's engine lets whoever reaches it write into
        registered memory, ``out`` among it, even after the check)."""
        if not keys:
            return 0
        return self.fetch(keys, out, timeout).check(copy_to)

    def fetch(self, keys: list[str], out: torch.Tensor, timeout: float) -> Fetched:
        """``get_into``'s first half: the objects of ``keys`` brought into ``out`` (and their tags), not checked yet:
        ``Fetched.check`` does that (a caller overlaps one fetch with the check of the last)."""
        base, size = self._rows(out, len(keys))
        slots = self._take_tags(len(keys), timeout)
        tags = self._tags.data_ptr()
        done = threading.Event()
        try:
            codes = self._call("batch_get_into_multi_buffers", keys,
                               [[base + i * size, tags + slot * TAG] for i, slot in enumerate(slots)],
                               [[size, TAG]] * len(keys), timeout=timeout, after=done.set)
        except StoreTimeout:  # the call may still write the tags: their slots go back once it ended
            threading.Thread(target=lambda: (done.wait(), self._give_tags(slots)), daemon=True).start()
            raise
        except BaseException:  # it never started
            self._give_tags(slots)
            raise
        return Fetched(self, keys, out, slots, codes, size)

    def _verify(self, keys: list[str], out: torch.Tensor, slots: list[int], codes: list[int], size: int,
                copy_to: torch.Tensor | None, where: list[list[torch.Tensor]] | None = None) -> int:
        """How many objects, from the first, arrived whole with a tag that matches their key and bytes (checked in
        ``copy_to``, if given, after copying them there; in ``where[i]``, if given: the pieces the caller copied
        object i into). Every object that arrived is checked, and each that fails, or that is not of a block's size,
        is removed from the pool (so that the fleet's next put of its key stores the real one)."""
        good, ended = 0, False
        for i, (key, slot, code) in enumerate(zip(keys, slots, codes, strict=False)):
            if code == -704 or (code < 0 and code not in WRONG_SIZE):  # not there (evicted, holder gone), unreachable
                if not ended:
                    self.stats.add("missing" if code == -704 else "errors")
                    logger.debug("pool object %s: %s", key, _describe(code))
                ended = True
                continue
            tag = bytes(self._tags[slot * TAG:(slot + 1) * TAG].numpy())
            row: torch.Tensor | list[torch.Tensor] = out[i]
            if where is not None:
                row = where[i]
            elif copy_to is not None and code == size + TAG:
                copy_to[i].copy_(out[i])
                row = copy_to[i]
            if code != size + TAG or not hmac.compare_digest(tag, self._tag(key, row, tag[:NONCE])):
                self.stats.add("rejected")
                logger.warning("a pool object failed its check (%s: %s): removed, its blocks are computed", key,
                               "not a block's size" if code != size + TAG else "forged, altered, put under another "
                               "key, or by an instance without this fleet's secret")
                self._remove_quietly(key)
                ended = True
                continue
            if not ended:
                good += 1
        self.stats.add("got_objects", good)
        self.stats.add("got_bytes", good * size)
        return good

    def _remove_quietly(self, key: str) -> None:
        try:
            self._calls.submit(self._client.remove, key, True)
        except RuntimeError:  # closed meanwhile
            pass

    def close(self) -> None:
        """Leave the pool. A client whose master is gone takes seconds to say goodbye: that runs in the
        background."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        client, calls = self._client, self._calls
        calls.shutdown(wait=False, cancel_futures=True)

        def leave() -> None:
            calls.shutdown(wait=True)  # a call still running in the client must end before the client goes
            if client is not None:
                client.close()
        threading.Thread(target=leave, name="mooncake-pool-close", daemon=True).start()


class Fetched:
    """Objects ``fetch`` brought in, to be checked once (``check``: how many, from the first, arrived whole and
    checked; ``copy_to`` as ``get_into``'s). Their tag slots are held until then."""

    def __init__(self, store: MooncakeStore, keys: list[str], out: torch.Tensor, slots: list[int], codes: list[int],
                 size: int) -> None:
        self._store, self._keys, self._out, self._slots, self._codes, self._size = store, keys, out, slots, codes, size
        self._checked = False

    def check(self, copy_to: torch.Tensor | None = None, where: list[list[torch.Tensor]] | None = None) -> int:
        """``where``: the caller copied each object, as it arrived, out of the registered memory into pieces of memory
        the store does not know (``where[i]``, in order: e.g. a block's layers in a KV cache): those are checked."""
        if self._checked:
            raise RuntimeError("fetched objects are checked once")
        self._checked = True
        try:  # the tag slots go back whatever happens
            if copy_to is not None and (copy_to.shape[0] < len(self._keys) or copy_to[0].nbytes != self._size):
                raise ValueError("copy_to must have a row of the same size per key")
            if where is not None and (len(where) < len(self._keys) or any(
                    sum(p.nbytes for p in pieces) != self._size for pieces in where[:len(self._keys)])):
                raise ValueError("where must give the pieces of a row of the same size per key")
            return self._store._verify(self._keys, self._out, self._slots, self._codes, self._size, copy_to, where)
        finally:
            self._store._give_tags(self._slots)

    @property
    def arrived_count(self) -> int:
        """How many objects, from the first, came whole (not checked yet)."""
        n = 0
        for code in self._codes:
            if code != self._size + TAG:
                break
            n += 1
        return n

    @property
    def arrived(self) -> bool:
        """Every object came, of a block's size (its check may still fail)."""
        return self.arrived_count == len(self._codes)

    def discard(self) -> None:
        """Not to be checked: its tag slots go back."""
        if not self._checked:
            self._checked = True
            self._store._give_tags(self._slots)
