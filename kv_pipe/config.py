"""mooncake.json: the one configuration file of the stack, validated up front.

Every mistake is reported as a ``ConfigError`` naming the field, the bad value and how to fix it, before any
socket is opened or any Transfer Engine is started (the engine itself accepts nonsense silently or aborts the
whole process, see ``_check_metadata``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from kv_pipe.addresses import is_loopback, join_host_port, parse_host_port
from kv_pipe.errors import ConfigError, unknown_keys_error

logger = logging.getLogger(__name__)

CONFIG_ENV = "MOONCAKE_CONFIG_PATH"
SECRET_ENV = "MOONCAKE_KV_SECRET"  # the side channel's shared secret; wins over mooncake.json's auth_secret
MIN_SECRET = 32  # characters: e.g. secrets.token_hex(32) gives 64; a short one could be guessed offline
P2PHANDSHAKE = "P2PHANDSHAKE"
PROTOCOLS = ("tcp", "rdma")
METADATA_BACKENDS = ("etcd", "http", "redis")
DECODE_PORT_OFFSET = 100  # Mooncake's guide: same URL for both roles -> decode listens 100 ports higher
MiB = 1 << 20
MAX_INLINE = 1 << 20  # the wire protocol's cap on a tensor carried inside its frame
EPHEMERAL = (32768, 60999)  # the Transfer Engine falls back to its default ports for a range touching these
# mooncake.json's keys of Mooncake Store (the same names Mooncake and vLLM's store connector read): the pipe leaves
# them to the store's own config (kv_lookup_buffer/store_config.py), which checks them
STORE_KEYS = frozenset({"master_server_address", "global_segment_size", "local_buffer_size", "mode",
                        "enable_offload", "tenant_id", "local_hostname"})


@lru_cache(maxsize=1)
def engine_has_redis_plugin() -> bool:
    """Whether the installed Transfer Engine was built with its redis metadata plugin.

    Without it, ``initialize`` with a redis server aborts the whole process (SIGABRT), which Python cannot catch,
    so we look for the hiredis client symbols in the engine's shared objects instead of trying.
    """
    try:
        import mooncake  # optional at config time
    except ImportError:
        return False
    for so in Path(mooncake.__file__).parent.rglob("*.so*"):
        try:
            if b"redisConnect" in so.read_bytes():
                return True
        except OSError:
            continue
    return False


def read_config_file(path: str | os.PathLike[str]) -> Any:
    """The JSON in mooncake.json at ``path`` (not yet checked: each layer checks its keys)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; copy mooncake.json.example to {path} or point "
                          f"{CONFIG_ENV} at an existing file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


@dataclass(frozen=True)
class MetadataServer:
    """Where the engines publish their segments: ``backend`` is p2p, etcd or http; ``conn`` is what the engine gets."""

    backend: str
    conn: str


def _check_metadata(server: Any, backend: Any) -> MetadataServer:
    hint = ('use "P2PHANDSHAKE" (no metadata service), "etcd://host:port[,host:port]", '
            '"http://host:port/path", or a bare "host:port" meaning etcd')
    if not isinstance(server, str) or not server.strip():
        raise ConfigError(f"metadata_server: expected a string, got {server!r}; {hint}")
    if backend is not None and backend not in METADATA_BACKENDS:
        raise ConfigError(f"metadata_backend: {backend!r} is not one of {', '.join(METADATA_BACKENDS)}; "
                          "leave it out to take the backend from metadata_server's scheme")
    server = server.strip()
    if server == P2PHANDSHAKE:
        if backend is not None:
            raise ConfigError(f"metadata_backend: {backend!r} makes no sense with metadata_server \"P2PHANDSHAKE\"; remove it")
        return MetadataServer("p2p", P2PHANDSHAKE)
    scheme, sep, rest = server.partition("://")
    if not sep:
        scheme, rest = (backend or "etcd"), server
    scheme = scheme.lower()
    if backend is not None and backend != scheme:
        raise ConfigError(f"metadata_backend {backend!r} disagrees with metadata_server {server!r} (scheme {scheme!r}); "
                          "make them agree or drop metadata_backend")
    if scheme == "redis":
        if not engine_has_redis_plugin():
            raise ConfigError(f"metadata_server {server!r}: the installed Mooncake Transfer Engine has no redis plugin "
                              "(it would abort the process); use etcd, http or P2PHANDSHAKE instead")
        parse_host_port(rest, "metadata_server")
        return MetadataServer("redis", f"redis://{rest}")
    if scheme == "etcd":
        for endpoint in rest.split(","):
            parse_host_port(endpoint, "metadata_server")
        return MetadataServer("etcd", f"etcd://{rest}")
    if scheme == "http":
        hostport, slash, path = rest.partition("/")
        parse_host_port(hostport, "metadata_server")
        if not slash or not path:
            raise ConfigError(f"metadata_server {server!r}: an http metadata server needs a path, e.g. "
                              "\"http://127.0.0.1:8080/metadata\"")
        return MetadataServer("http", f"http://{rest}")
    raise ConfigError(f"metadata_server {server!r}: unknown scheme {scheme!r}; {hint}")


GiB = 1 << 30
MAX_TIMEOUT = 3600.0  # seconds: longer than any wait of the pipe should ever be
MAX_STAGING = 16 * GiB


def physical_memory() -> int:
    """Bytes of RAM of this machine (64 GiB if it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 * GiB


def default_max_tensor_size() -> int:
    """Half of this machine's RAM, at most 64 GiB: a tensor announced as larger is refused before allocating."""
    return min(64 * GiB, physical_memory() // 2)


def default_result_pool_size() -> int:
    """512 MiB, at most 1/16 of this machine's RAM: memory kept mapped for received tensors."""
    return min(512 * MiB, physical_memory() // 16)


def _positive(value: Any, field: str, kind: type, hint: str, upper: float) -> Any:
    """A finite number > 0 and <= ``upper``, of ``kind`` (int: integers only)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ConfigError(f"{field}: expected a positive {kind.__name__}, got {value!r}; {hint}")
    if (isinstance(value, float) and not math.isfinite(value)) or not 0 < value <= upper:
        raise ConfigError(f"{field}: must be > 0 and at most {upper:g}, got {value!r}; {hint}")
    return kind(value)


@dataclass(frozen=True)
class MooncakeTransferEngineConfig:
    """The validated contents of mooncake.json.

    URLs are ``host:port``; the port is the base of the pipe's side channel (port + local_rank). The Transfer Engine
    itself picks its own ports. ``staging_buffer_size`` bytes are registered per direction and per pipe; no tensor
    moves through more memory than that plus the result tensor itself. Tensors of at most ``inline_max`` bytes ride
    inside the side-channel frame that announces them (lower latency than a Transfer Engine write plus a frame).
    Received tensors of 1 MiB or more are served from up to ``result_pool_size`` bytes of memory that
    each pipe endpoint keeps and reuses once a result is dropped (see ``kv_pipe.memory.ResultPool``).
    """

    prefill_url: str = "127.0.0.1:13003"
    decode_url: str = "127.0.0.1:13103"
    metadata_server: str = P2PHANDSHAKE
    metadata_backend: str | None = None
    protocol: str = "tcp"
    device_name: str | list[str] = ""  # a list: one entry per local (TP) rank, e.g. the NIC nearest each GPU
    staging_buffer_size: int = 64 * MiB
    chunk_size: int = 4 * MiB
    max_chunks_in_flight: int = 8
    inline_max: int = 64 << 10
    huge_pages: bool = True
    zero_copy_send: bool = True
    zero_copy_recv: bool = True
    max_tensor_size: int = dataclasses.field(default_factory=default_max_tensor_size)
    result_pool_size: int = dataclasses.field(default_factory=default_result_pool_size)
    timeout: float = 30.0
    auth_secret: str = dataclasses.field(default="", repr=False)
    allow_unauthenticated: bool = False
    engine_ports: list[int] | None = None  # [first, last]: the Transfer Engine's listening ports (for a firewall)
    max_links: int = 32  # links of one endpoint holding a staging ring (staging_buffer_size each) at once
    receive_budget: int = dataclasses.field(default_factory=default_max_tensor_size)  # bytes all links may be receiving

    def __post_init__(self) -> None:
        p_host, p_port = parse_host_port(self.prefill_url, "prefill_url")
        d_host, d_port = parse_host_port(self.decode_url, "decode_url")
        if (p_host, p_port) == (d_host, d_port):
            d_port += DECODE_PORT_OFFSET
            if d_port > 65535:
                raise ConfigError(f"decode_url: equal to prefill_url, and port + {DECODE_PORT_OFFSET} = {d_port} "
                                  "is out of range; give decode_url its own port")
            logger.info("prefill_url and decode_url are both %s: the decode side uses port %d (+%d)",
                        self.prefill_url, d_port, DECODE_PORT_OFFSET)
            object.__setattr__(self, "decode_url", join_host_port(d_host, d_port))
        self.metadata  # noqa: B018 - validates metadata_server/metadata_backend
        if not isinstance(self.protocol, str) or self.protocol.lower() not in PROTOCOLS:
            raise ConfigError(f"protocol: {self.protocol!r} is not one of {', '.join(PROTOCOLS)} "
                              "(the engine would silently fall back to TCP); set \"protocol\": \"tcp\" or \"rdma\"")
        object.__setattr__(self, "protocol", self.protocol.lower())
        for flag in ("huge_pages", "zero_copy_send", "zero_copy_recv", "allow_unauthenticated"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag}: expected true or false, got {getattr(self, flag)!r}")
        names = self.device_name if isinstance(self.device_name, list) else [self.device_name]
        if not names or not all(isinstance(n, str) for n in names) or len(names) > 1024:
            raise ConfigError(f"device_name: expected a string such as \"mlx5_0\" (every rank) or a list of them (one "
                              f"per TP rank, e.g. [\"mlx5_0\", \"mlx5_1\"]), got {self.device_name!r}")
        if self.protocol == "rdma" and not all(n.strip() for n in names):
            raise ConfigError("device_name: protocol \"rdma\" needs the RDMA NIC(s) to use, e.g. \"mlx5_0\" or "
                              "\"mlx5_0,mlx5_1\" (list them with `ibv_devices`), or a list with one per TP rank")
        size_hint = "a number of bytes, e.g. 67108864 for 64 MiB"
        _positive(self.staging_buffer_size, "staging_buffer_size", int, size_hint, MAX_STAGING)
        _positive(self.chunk_size, "chunk_size", int, size_hint, MAX_STAGING // 2)
        _positive(self.max_chunks_in_flight, "max_chunks_in_flight", int, "e.g. 4", 1024)
        _positive(self.max_links, "max_links", int, "e.g. 32 (each link a peer sends on holds staging_buffer_size "
                  "bytes)", 4096)
        _positive(self.max_tensor_size, "max_tensor_size", int, f"{size_hint}; at most this machine's RAM",
                  physical_memory())
        _positive(self.receive_budget, "receive_budget", int, f"{size_hint}; at most this machine's RAM",
                  physical_memory())
        pool = self.result_pool_size
        if isinstance(pool, bool) or not isinstance(pool, int) or not 0 <= pool <= physical_memory():
            raise ConfigError(f"result_pool_size: expected a number of bytes from 0 (no pool: every received tensor "
                              f"is freshly allocated) to {physical_memory()} (this machine's RAM), got {pool!r}; "
                              "e.g. 536870912 for 512 MiB")
        if isinstance(self.inline_max, bool) or not isinstance(self.inline_max, int) or not 0 <= self.inline_max <= MAX_INLINE:
            raise ConfigError(f"inline_max: expected a number of bytes from 0 (never inline) to {MAX_INLINE}, "
                              f"got {self.inline_max!r}")
        secret = self.auth_secret
        if not isinstance(secret, str) or (secret and len(secret) < MIN_SECRET):
            raise ConfigError(f"auth_secret: expected a string of at least {MIN_SECRET} characters (or \"\" for none), "
                              f"e.g. the output of `python -c 'import secrets; print(secrets.token_hex(32))'`")
        has_secret = bool(self.secret)  # validates MOONCAKE_KV_SECRET up front too
        exposed = [h for h in (p_host, d_host) if not is_loopback(h)]
        if exposed and not has_secret and not self.allow_unauthenticated:
            raise ConfigError(
                f"prefill_url/decode_url: the pipe listens on {exposed[0]}, beyond this host, and no secret is set: "
                f"anyone who reaches it could read or plant KV. Set the same \"auth_secret\" (32+ characters, e.g. "
                f"`python -c 'import secrets; print(secrets.token_hex(32))'`) in every instance's mooncake.json or "
                f"{SECRET_ENV} in their environment; or, on a network where every host is trusted, set "
                f"\"allow_unauthenticated\": true")
        object.__setattr__(self, "timeout", _positive(self.timeout, "timeout", float, "seconds, e.g. 30", MAX_TIMEOUT))
        if self.engine_ports is not None:
            ports = self.engine_ports
            if (not isinstance(ports, (list, tuple)) or len(ports) != 2
                    or not all(isinstance(p, int) and not isinstance(p, bool) for p in ports)
                    or not 1024 <= ports[0] < ports[1] <= 65535
                    or any(EPHEMERAL[0] <= p <= EPHEMERAL[1] for p in ports)):
                raise ConfigError(f"engine_ports: expected [first, last], two ports from 1024 to 65535 with first < "
                                  f"last, outside {EPHEMERAL[0]}-{EPHEMERAL[1]} (the engine ignores such a range), "
                                  f"e.g. [15000, 15999]; got {ports!r}")
            object.__setattr__(self, "engine_ports", [int(ports[0]), int(ports[1])])
        if self.chunk_size * 2 > self.staging_buffer_size:
            raise ConfigError(f"chunk_size ({self.chunk_size}) must be at most half of staging_buffer_size "
                              f"({self.staging_buffer_size}) so that a chunk always fits; "
                              "lower chunk_size or raise staging_buffer_size")

    @property
    def secret(self) -> bytes:
        """The side channel's shared secret: MOONCAKE_KV_SECRET if set, else auth_secret (b"": none)."""
        value = os.environ.get(SECRET_ENV)
        if value and len(value) < MIN_SECRET:
            raise ConfigError(f"{SECRET_ENV}: expected at least {MIN_SECRET} characters")
        return (value if value else self.auth_secret).encode()

    @property
    def metadata(self) -> MetadataServer:
        return _check_metadata(self.metadata_server, self.metadata_backend)

    def device_for(self, local_rank: int) -> str:
        """The RDMA device(s) of one local (TP) rank: ``device_name`` itself, or its entry ``local_rank``."""
        if not isinstance(self.device_name, list):
            return self.device_name
        if not 0 <= local_rank < len(self.device_name):
            raise ConfigError(f"device_name lists {len(self.device_name)} device(s), one per TP rank, but rank "
                              f"{local_rank} runs: list one per rank, or give one string for every rank")
        return self.device_name[local_rank]

    def pipe_address(self, kv_rank: int, local_rank: int) -> tuple[str, int]:
        """The side-channel address of one pipe end: kv_rank 0 = producer (prefill_url), 1 = consumer (decode_url)."""
        if kv_rank not in (0, 1):
            raise ConfigError(f"kv_rank must be 0 (producer) or 1 (consumer), got {kv_rank!r}")
        if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
            raise ConfigError(f"local_rank must be an int >= 0, got {local_rank!r}")
        host, port = parse_host_port(self.prefill_url if kv_rank == 0 else self.decode_url, "url")
        if port + local_rank > 65535:
            raise ConfigError(f"port {port} + local_rank {local_rank} is out of range; pick a lower base port")
        return host, port + local_rank

    @classmethod
    def from_dict(cls, data: Any, source: str = "config") -> MooncakeTransferEngineConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if "transfer_mode" in data:
            raise ConfigError(f"{source}: transfer_mode is a setting of the connector now: move it to "
                              "kv_connector_extra_config.transfer_mode in --kv-transfer-config (same values, "
                              "\"pull\" or \"push\") and remove it from mooncake.json")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - STORE_KEYS)
        if unknown:
            raise unknown_keys_error(source, unknown, known | STORE_KEYS)
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MooncakeTransferEngineConfig:
        return cls.from_dict(read_config_file(path), source=str(path))

    @classmethod
    def load_from_env(cls) -> MooncakeTransferEngineConfig:
        path = os.environ.get(CONFIG_ENV)
        if not path:
            raise ConfigError(f"{CONFIG_ENV} is not set; set it to the path of your mooncake.json "
                              f"(see mooncake.json.example), e.g. {CONFIG_ENV}=mooncake.json")
        return cls.from_file(path)
