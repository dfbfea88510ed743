"""A pipe config on free ports and one pipe end, for a test's or a benchmark's peer processes."""

from __future__ import annotations

from typing import Any

from harness.ports import HOST, free_port


def make_config(**overrides: Any) -> dict[str, Any]:
    """A config dict with two free ports on 127.0.0.1 (P2PHANDSHAKE, TCP unless overridden)."""
    cfg = {"prefill_url": f"{HOST}:{free_port()}", "decode_url": f"{HOST}:{free_port()}", "timeout": 10.0}
    cfg.update(overrides)
    return cfg


def open_pipe(cfg: dict[str, Any], kv_rank: int, local_rank: int = 0, device: str = "cpu"):
    """A ``MooncakePipe`` of ``cfg`` as ``kv_rank`` (kv_pipe is imported here: a peer process pays for it when used)."""
    from kv_pipe import MooncakePipe, MooncakeTransferEngineConfig

    return MooncakePipe(local_rank=local_rank, kv_rank=kv_rank, config=MooncakeTransferEngineConfig(**cfg), device=device)
