"""Addresses in mooncake.json and kv_transfer_params: ``host:port`` parsed and checked, joined back, loopback told
apart."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from kv_pipe.errors import ConfigError

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


def parse_host_port(value: Any, field: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6addr]:port`` for IPv6) and validate both parts; ``field`` names the key in errors."""
    hint = 'write it as "host:port", e.g. "127.0.0.1:13003"'
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{field}: expected a string \"host:port\", got {value!r}; {hint}")
    text = value.strip()
    if "://" in text:
        raise ConfigError(f"{field}: {value!r} has a scheme; {hint} (no scheme)")
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise ConfigError(f"{field}: {value!r} is not \"[ipv6]:port\"; {hint}")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ConfigError(f"{field}: {value!r} has no port; {hint}")
        if ":" in host:
            raise ConfigError(f"{field}: {value!r}: put an IPv6 address in brackets, e.g. \"[::1]:13003\"")
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ConfigError(f"{field}: port {port_text!r} in {value!r} is not a number from 1 to 65535; {hint}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host):
            raise ConfigError(f"{field}: {host!r} in {value!r} is neither an IP address nor a hostname; {hint}") from None
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    """``host`` is this machine only: 127.0.0.0/8, ::1 or "localhost"."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
