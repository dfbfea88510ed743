"""A thin, exception-raising wrapper over the Mooncake Transfer Engine's Python binding.

The binding reports errors as return codes (-1, or batch id 0) and logs the reason through glog; this module
turns them into ``TransferError`` / ``ConfigError`` with the peer and sizes in the message. It owns one engine
and the host memory registered with it.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time

import torch

from kv_pipe.addresses import join_host_port
from kv_pipe.config import MooncakeTransferEngineConfig
from kv_pipe.errors import ConfigError, TransferError
from kv_pipe.memory import advise_huge_pages, mapped, prefault

logger = logging.getLogger(__name__)


def _import_engine() -> type:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ConfigError(
            f"cannot import the Mooncake Transfer Engine ({e}). Install 'mooncake-transfer-engine' (CUDA hosts) or "
            "'mooncake-transfer-engine-non-cuda' (CPU hosts), and the Debian/Ubuntu package libibverbs1") from e
    return TransferEngine


class MooncakeEngine:
    """One initialized Transfer Engine bound to ``host``.

    ``session`` is the name peers use to reach this engine (they learn it in the pipe's handshake): ``host:rpc_port``
    with P2PHANDSHAKE, else ``host:port#<random>``, registered under it in the metadata service.
    """

    def __init__(self, config: MooncakeTransferEngineConfig, host: str, port: int, local_rank: int = 0) -> None:
        # Read when the engine is created: its own transfer timeout follows ours (it never goes below 5 s); with a
        # metadata server it advertises the configured host rather than the first NIC it finds (this binds nothing:
        # the engine's two ports listen on every interface whatever is set, see docs/deployment.md, Security); and
        # engine_ports pins both ports into a range a firewall can name.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, math.ceil(config.timeout))))
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        if config.engine_ports is not None:
            os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = map(str, config.engine_ports)
        engine_cls = _import_engine()
        self._engine = engine_cls()
        self._lock = threading.Lock()
        self._registered: dict[int, torch.Tensor] = {}
        self.protocol = config.protocol
        metadata = config.metadata
        local_name = join_host_port(host, port)
        if metadata.backend != "p2p":
            # a name of its own each time: a peer's engine caches the descriptor it fetched under a name, and a
            # process restarted under the old name (new buffers, new ports) would get writes aimed at the old one
            local_name = f"{local_name}#{secrets.token_hex(4)}"
        device = config.device_for(local_rank)
        rc = self._engine.initialize(local_name, metadata.conn, config.protocol, device)
        if rc != 0:
            raise ConfigError(
                f"Mooncake Transfer Engine failed to initialize (local {local_name}, metadata {metadata.conn}, protocol "
                f"{config.protocol}, device {device!r}): check that the metadata server is running and reachable, "
                "and that the RDMA device exists; the engine's log above says more")
        if metadata.backend == "p2p":
            self.session = join_host_port(host, self._engine.get_rpc_port())
        else:
            self.session = local_name
        logger.debug("Transfer Engine up: session %s, metadata %s, protocol %s", self.session, metadata.conn, config.protocol)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer registered with the engine (no CUDA copy reads or writes it: device tensors are staged
        in pinned memory of their own, ``kv_pipe.devices``).

        Its pages are mapped now: a staging area is reused for every transfer, and faulting its pages in during the
        first passes made the copies in and out of it several times slower. Huge pages only for RDMA (fewer pages to
        pin): asking for them makes the kernel compact memory first, which made each new link much slower to set up
        over TCP."""
        # host memory of its own mapping: it goes back to the system when released (from the allocator's heap, freed
        # rings stayed resident)
        buf = mapped(nbytes)
        if self.protocol == "rdma":
            advise_huge_pages(buf)
        prefault(buf)
        rc = self._engine.register_memory(buf.data_ptr(), nbytes)
        if rc != 0:
            raise TransferError(f"registering {nbytes} bytes with the Transfer Engine failed (rc={rc})")
        with self._lock:
            self._registered[buf.data_ptr()] = buf
        return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._registered.pop(buf.data_ptr(), None) is None:
                return
        self.unregister_region(buf.data_ptr())

    def register_region(self, addr: int, nbytes: int) -> bool:
        """Open a caller-owned host region to peers' writes (zero-copy receive); False if the engine refuses.

        Over TCP this is cheap bookkeeping only: the engine's TCP server accepts a write only into a region
        registered here. The caller must ``unregister_region`` it before the memory is freed or reused.
        """
        engine = self._engine
        if engine is None:
            return False
        rc = engine.register_memory(addr, nbytes)
        if rc != 0:
            logger.debug("registering a %d-byte receive region failed (rc=%d)", nbytes, rc)
        return rc == 0

    def unregister_region(self, addr: int) -> None:
        engine = self._engine
        if engine is None:  # closed: the engine and its registrations are gone
            return
        rc = engine.unregister_memory(addr)
        if rc != 0:
            logger.warning("unregistering the memory at %#x from the Transfer Engine failed (rc=%d)", addr, rc)

    def write_async(self, peer: str, local_addrs: list[int], remote_addrs: list[int], lengths: list[int]) -> int:
        """Start one-sided writes (one batch); returns a batch id for ``wait``."""
        batch_id = self._engine.batch_transfer_async_write(peer, local_addrs, remote_addrs, lengths)
        if not batch_id:
            raise TransferError(f"could not start a {sum(lengths)}-byte write to {peer}: the peer's engine is "
                                "unreachable or its segment is unknown")
        return batch_id

    def wait(self, batch_id: int, peer: str, nbytes: int, timeout: float) -> None:
        """Wait for a write started by ``write_async``.

        Polls the engine's per-transfer status rather than calling its blocking batch wait: that one spins a
        core at full speed, which on a small host starves the engine's own workers and the receiving process. The
        poll backs off to 50 us naps.
        """
        deadline = time.monotonic() + timeout
        polls = 0
        while True:
            status = self._engine.transfer_check_status(batch_id)  # 1 done, 0 pending, -1 failed, -2 timed out
            if status == 1:
                return
            if status < 0:
                raise TransferError(f"a {nbytes}-byte write to {peer} {'failed' if status == -1 else 'timed out'}: "
                                    "the peer died, froze, or rejected the target region")
            polls += 1
            if polls > 64:
                if time.monotonic() > deadline:
                    raise TransferError(f"a {nbytes}-byte write to {peer} did not complete within {timeout:.1f} s")
                time.sleep(0.00005)

    def close(self) -> None:
        """Unregister every buffer and free the engine (its listeners and its metadata entry go with it).

        A call still running inside the engine holds its own reference, so this is safe under a blocked send.
        """
        with self._lock:
            bufs = list(self._registered.values())
        for buf in bufs:
            self.release(buf)
        self._engine = None
