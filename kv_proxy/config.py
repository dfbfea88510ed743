"""The proxy's options: ``ProxyConfig`` (validated on construction), the command line that builds it, and the
normalization of upstream URLs."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import kv_proxy

PREFILL = "prefill"  # the roles, as the command line and the clients' errors name them
DECODE = "decode"
PROTOCOLS = ("params", "bootstrap")
DISPATCH_MODES = ("concurrent", "sequential")
DEFAULT_BOOTSTRAP_PORT = 8998  # vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default
ADMIN_TOKEN_ENV = "MOONCAKE_PROXY_ADMIN_TOKEN"  # the admin token, if --admin-token is not given
MIN_ADMIN_TOKEN = 16  # characters
DEFAULT_BALANCE_SLACK = 4
DEFAULT_SKIP_PREFILL_BELOW = 0  # never skip: a fixed threshold lost on slower boxes (benchmarks/results/NOTES.md)
ROUTING_RULES = ("prefix", "estimate")
DEFAULT_PREFIX_INDEX_ENTRIES = 200_000  # chunks, all instances together (~150 bytes each)
# A tail this short (8 blocks of 16 tokens) is a small part of one forward pass on a pool member, while a remote
# prefill would compute the same tail and move the KV the pool holds once more (not measured: a round number).
DEFAULT_POOL_TAIL = 128  # tokens


class ConfigError(ValueError):
    """An invalid proxy option (bad upstream URL, non-positive timeout, ...)."""


def normalize_upstream_url(url: str) -> str:
    """Check that ``url`` is ``http(s)://host:port`` (an optional trailing ``/``) and return it without the slash."""
    expected = f"invalid upstream URL {url!r}: expected http://host:port or https://host:port"
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as error:
        raise ConfigError(f"{expected} ({error})") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{expected} (scheme must be http or https)")
    if not parts.hostname:
        raise ConfigError(f"{expected} (missing host)")
    if port is None:
        raise ConfigError(f"{expected} (missing port)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"{expected} (no path, query, fragment or credentials allowed)")
    return f"{parts.scheme}://{parts.netloc}"


def default_bootstrap_url(prefill_url: str) -> str:
    """A prefill instance's bootstrap server when none is given: port 8998 on its host."""
    parts = urlsplit(prefill_url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"http://{host}:{DEFAULT_BOOTSTRAP_PORT}"


@dataclass(frozen=True)
class ProxyConfig:
    """Options of the proxy; URLs are validated and normalized on construction."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    timeout: float = 300.0  # seconds: a whole prefill / non-streaming decode; between two chunks of a stream
    connect_timeout: float = 10.0  # seconds to connect to an upstream (then the next instance is tried)
    cooldown: float = 5.0  # seconds an instance that failed is skipped
    health_timeout: float = 2.0  # seconds for each upstream's /health probe
    max_connections: int = 1024  # the shared client pool, all upstreams together
    max_clients: int = 1024  # client connections at once (see ClientGate)
    client_timeout: float = 30.0  # seconds a client may take for a request's head, and for its body
    # A request's body at most: a 128k-token prompt is ~0.5 MiB of English text (~4 characters a token), ~1.5 MiB of
    # Chinese or of text JSON-escaped to \uXXXX, ~0.9 MiB as token ids; chat histories and tool schemas add little.
    # (Multimodal requests carrying images inline need more: raise --max-body-bytes.)
    max_body_bytes: int = 4 * 1024 * 1024
    protocol: str = "params"  # see docs/proxy.md#protocols
    bootstrap: tuple[str, ...] = ()  # protocol "bootstrap": each prefill instance's bootstrap server, in order
    balance_slack: int = DEFAULT_BALANCE_SLACK  # outstanding requests an instance may have beyond the least loaded
    # one and still be preferred for the prefix it holds
    skip_prefill_below: int = DEFAULT_SKIP_PREFILL_BELOW  # estimated uncached tokens below which no remote prefill
    # (--routing estimate: from which a request is never computed on its decode instance)
    routing: str = "prefix"  # the rule choosing instances and skips (kv_proxy.routing)
    decode_on_prefill: bool = False  # --routing estimate: a request may also be served whole on a prefill instance
    prefix_index_entries: int = DEFAULT_PREFIX_INDEX_ENTRIES  # prefix chunks indexed, all instances (0: no index)
    pool_tail: int = DEFAULT_POOL_TAIL  # --routing prefix: a KV pool member computes an uncached part below this
    # many tokens itself, loading the rest from the pool (0: off)
    admin_token: str = field(default="", repr=False)  # "": no admin endpoints
    dispatch: str = "concurrent"  # push mode: the decode goes out with the prefill ("sequential": after it)
    fallback: bool = True  # no prefill instance could take a request: its decode instance computes it whole

    def __post_init__(self) -> None:
        for role in (PREFILL, DECODE):
            urls = tuple(normalize_upstream_url(url) for url in getattr(self, role))
            if not urls:
                raise ConfigError(f"at least one --{role} URL is required")
            if len(set(urls)) != len(urls):
                raise ConfigError(f"duplicate --{role} URL in {list(urls)}")
            object.__setattr__(self, role, urls)
        for name in ("timeout", "health_timeout", "connect_timeout", "client_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 86400):
                raise ConfigError(f"{name} must be seconds > 0 (and at most a day), got {value!r}")
        if not self.cooldown >= 0:
            raise ConfigError(f"cooldown must be >= 0, got {self.cooldown!r}")
        if self.max_connections < 1 or self.max_body_bytes < 1 or self.max_clients < 1:
            raise ConfigError("max_connections, max_clients and max_body_bytes must be positive")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.routing not in ROUTING_RULES:
            raise ConfigError(f"routing must be one of {', '.join(ROUTING_RULES)}, got {self.routing!r}")
        if self.decode_on_prefill and self.routing != "estimate":
            raise ConfigError("--decode-on-prefill needs --routing estimate (it is a choice the estimate makes)")
        if self.dispatch not in DISPATCH_MODES:
            raise ConfigError(f"dispatch must be one of {', '.join(DISPATCH_MODES)}, got {self.dispatch!r}")
        if self.bootstrap and self.protocol != "bootstrap":
            raise ConfigError("--bootstrap is used only with --protocol bootstrap (vLLM's built-in MooncakeConnector)")
        if self.bootstrap and len(self.bootstrap) != len(self.prefill):
            raise ConfigError(f"give one --bootstrap URL per --prefill URL, in the same order (got {len(self.bootstrap)} "
                              f"for {len(self.prefill)})")
        object.__setattr__(self, "bootstrap", tuple(normalize_upstream_url(url) for url in self.bootstrap))
        for name, top in (("balance_slack", 1 << 20), ("skip_prefill_below", 1 << 24), ("prefix_index_entries", 1 << 26),
                          ("pool_tail", 1 << 24)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                raise ConfigError(f"{name} must be an integer from 0 to {top}, got {value!r}")
        if self.admin_token and (len(self.admin_token) < MIN_ADMIN_TOKEN or not self.admin_token.isprintable()
                                 or not self.admin_token.isascii() or " " in self.admin_token):
            raise ConfigError(f"the admin token must be at least {MIN_ADMIN_TOKEN} printable ASCII characters, no "
                              "spaces")

    def bootstrap_url(self, prefill_url: str) -> str:
        """The bootstrap server of a prefill instance: given in order, else port 8998 on its host."""
        if self.bootstrap:
            return self.bootstrap[self.prefill.index(prefill_url)]
        return default_bootstrap_url(prefill_url)


def parse_args(argv: list[str] | None = None) -> ProxyConfig:
    """The command line's options (and the process's logging set-up); exits with the usage on a bad option."""
    parser = argparse.ArgumentParser(description=(kv_proxy.__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill instance, http(s)://host:port (repeat for several)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode instance, http(s)://host:port (repeat for several)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds for a prefill or a non-streaming decode, and between two chunks of a stream")
    parser.add_argument("--connect-timeout", type=float, default=10.0,
                        help="seconds to connect to an upstream before the next instance is tried (default 10)")
    parser.add_argument("--cooldown", type=float, default=5.0, help="seconds a failed instance is skipped")
    parser.add_argument("--health-timeout", type=float, default=2.0, help="seconds for each upstream /health probe")
    parser.add_argument("--max-connections", type=int, default=1024, help="upstream connection pool size (default "
                        "1024, lowered to a quarter of what the open-file limit leaves)")
    parser.add_argument("--max-clients", type=int, default=1024,
                        help="client connections at once (default 1024, lowered to what the process's open-file "
                             "limit holds): when full, a new one takes the place of the slowest sender with no request "
                             "under way or a body still coming")
    parser.add_argument("--client-timeout", type=float, default=30.0,
                        help="seconds a client may take to send a request's head, and its body; an idle client "
                             "connection is closed after as long (default 30)")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, metavar="BYTES",
                        help="largest request body accepted (413 above it, before it is parsed; default 4 MiB: a "
                             "128k-token prompt is 0.5-1.5 MiB as text, ~0.9 MiB as token ids); the proxy holds at most "
                             "32 times this in bodies at once (503 beyond)")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="params",
                        help="how the instances are told where the KV goes: params (this project's "
                             "MooncakeConnector; default) or bootstrap (vLLM's built-in MooncakeConnector)")
    parser.add_argument("--bootstrap", action="append", default=[], metavar="URL",
                        help="--protocol bootstrap: a prefill instance's bootstrap server, one per --prefill in the same "
                             f"order (default http://<prefill host>:{DEFAULT_BOOTSTRAP_PORT})")
    parser.add_argument("--balance-slack", type=int, default=DEFAULT_BALANCE_SLACK, metavar="N",
                        help="an instance holding a longer prompt prefix is preferred unless it has more than N "
                             f"outstanding requests beyond the least loaded one (default {DEFAULT_BALANCE_SLACK})")
    parser.add_argument("--routing", choices=ROUTING_RULES, default="prefix",
                        help="prefix (default): the instance holding the longest prompt prefix, within "
                             "--balance-slack, and --skip-prefill-below as a fixed threshold; estimate: the instances, "
                             "and whether the decode instance computes the request whole, chosen by the estimated time "
                             "to its first token (what each instance has queued, what work cost there, learned from "
                             "its answers)")
    parser.add_argument("--skip-prefill-below", type=int, default=DEFAULT_SKIP_PREFILL_BELOW, metavar="TOKENS",
                        help="--routing prefix: send a request straight to the decode instance when the part of its "
                             "prompt that instance does not hold is estimated below TOKENS (default "
                             f"{DEFAULT_SKIP_PREFILL_BELOW}: always prefill remotely). --routing estimate: a bound, "
                             "from TOKENS uncached tokens up a request is always prefilled remotely (0: no bound)")
    parser.add_argument("--pool-tail", type=int, default=DEFAULT_POOL_TAIL, metavar="TOKENS",
                        help="--routing prefix: a decode instance that shares a KV pool (its /metrics say so) computes "
                             "a request itself, loading what the pool holds, when the part of its prompt neither it "
                             f"nor the pool holds is estimated below TOKENS (default {DEFAULT_POOL_TAIL}; 0: off)")
    parser.add_argument("--decode-on-prefill", action="store_true",
                        help="--routing estimate: a request may also be served whole (prefill and decode) on a prefill "
                             "instance, when the estimate says it ends sooner there: the decode instances' learned "
                             "decode steps grow as their cores saturate (off by default)")
    parser.add_argument("--prefix-index-entries", type=int, default=DEFAULT_PREFIX_INDEX_ENTRIES, metavar="N",
                        help="prompt prefix chunks the proxy remembers, all instances together (default "
                             f"{DEFAULT_PREFIX_INDEX_ENTRIES}; 0: no prefix routing)")
    parser.add_argument("--admin-token", default=None, metavar="TOKEN",
                        help=f"enables /admin/instances, guarded by this bearer token (or set {ADMIN_TOKEN_ENV}, "
                             "which other users cannot read from the process list)")
    parser.add_argument("--dispatch", choices=DISPATCH_MODES, default="concurrent",
                        help="for a decode instance that takes pushed KV: send the decode request together with the "
                             "prefill (concurrent; default), or after the prefill answered (sequential). Pull-mode "
                             "instances always get it after the prefill (they need its answer)")
    parser.add_argument("--no-fallback", action="store_true",
                        help="answer 502 when no prefill instance can take a request (all down or cooling down, or "
                             "their prefill failed with a server error); by default its decode instance then computes "
                             "it whole, as a colocated instance would")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ProxyConfig(prefill=tuple(args.prefill), decode=tuple(args.decode), host=args.host, port=args.port,
                           timeout=args.timeout, connect_timeout=args.connect_timeout, cooldown=args.cooldown,
                           health_timeout=args.health_timeout,
                           max_connections=args.max_connections, max_clients=args.max_clients,
                           client_timeout=args.client_timeout, max_body_bytes=args.max_body_bytes,
                           protocol=args.protocol,
                           bootstrap=tuple(args.bootstrap), balance_slack=args.balance_slack,
                           skip_prefill_below=args.skip_prefill_below, routing=args.routing,
                           decode_on_prefill=args.decode_on_prefill,
                           prefix_index_entries=args.prefix_index_entries, pool_tail=args.pool_tail,
                           admin_token=args.admin_token if args.admin_token is not None
                           else os.environ.get(ADMIN_TOKEN_ENV, ""), dispatch=args.dispatch,
                           fallback=not args.no_fallback)
    except ConfigError as error:
        parser.error(str(error))
