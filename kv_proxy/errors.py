"""How a request ends early: ``ProxyError`` (the proxy's own JSON error) and ``RelayedError`` (an upstream's error
answer, relayed as is)."""

from __future__ import annotations

import json
from typing import Any

from quart import Response


class ProxyError(Exception):
    """Ends a request with ``status`` and a JSON error body (OpenAI style, plus the stage and the upstream)."""

    def __init__(self, status: int, kind: str, message: str, stage: str | None = None, upstream: str | None = None,
                 detail: str = ""):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.stage = stage
        self.upstream = upstream  # the instance's name (Upstream.name), never its URL
        self.detail = detail  # for the proxy's log only: URLs and the underlying error

    def payload(self) -> dict[str, Any]:
        error: dict[str, Any] = {"message": str(self), "type": self.kind, "code": self.status}
        if self.stage is not None:
            error["stage"] = self.stage
        if self.upstream is not None:
            error["upstream"] = self.upstream
        return {"error": error}

    def response(self) -> Response:
        return Response(json.dumps(self.payload()), status=self.status, content_type="application/json")


class RelayedError(Exception):
    """An upstream answered with an error status: relayed to the client as is."""

    def __init__(self, status: int, body: bytes, content_type: str | None):
        super().__init__(f"upstream status {status}")
        self.status = status
        self.body = body
        self.content_type = content_type or "application/json"

    def response(self) -> Response:
        return Response(self.body, status=self.status, content_type=self.content_type)
