"""Exceptions raised by the pipe layer.

Every failure a caller can see is one of these, so a caller can tell a slow peer (``PipeTimeout``; ``PipeStalled``
if a tensor had begun to arrive) from a dead one (``PeerDisconnected``), a hostile or buggy one (``ProtocolError``)
and a misconfiguration (``ConfigError``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """mooncake.json (or the arguments standing in for it) is wrong; the message says which field and how to fix it."""


def unknown_keys_error(source: str, unknown: Iterable[str], known: Iterable[str]) -> ConfigError:
    """The error for keys a config does not have: each with the nearest known key (a typo is the usual cause)."""
    known = sorted(known)
    named = []
    for key in sorted(unknown):
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        named.append(f"{key!r} (did you mean {near[0]!r}?)" if near else repr(key))
    return ConfigError(f"{source}: unknown key(s) {', '.join(named)}; known keys: {', '.join(known)}")


class PipeError(RuntimeError):
    """Base class of every runtime error of the pipe."""


class PipeTimeout(PipeError, TimeoutError):
    """A blocking call did not complete within its timeout (a frozen, slow or absent peer)."""


class PipeStalled(PipeTimeout):
    """A tensor had begun to arrive (its header came) but the rest of it did not come within the timeout: it is lost,
    with the connection that carried it (the peer's next send connects afresh). Unlike a bare ``PipeTimeout`` from
    ``recv_tensor`` (nothing arrived: the pipe is as it was, call again), this is never mere idleness."""


class PipeClosed(PipeError):
    """The pipe was closed locally (``close()``), possibly while the call was blocked."""


class PeerDisconnected(PipeError):
    """The peer closed the connection or died; what was in flight is lost."""


class ProtocolError(PipeError):
    """The peer sent a malformed, truncated or oversized frame; the connection that carried it is dropped."""


class TransferError(PipeError):
    """The Mooncake Transfer Engine reported a failed transfer (peer dead, frozen, or the region rejected)."""
