"""Real vLLM instances for the connector tests: a producer pinned to core 0 and a consumer pinned to core 1.

Float32, eager, a small KV cache, a batch budget of 512 tokens (prompts up to 1000 tokens are prefilled in chunks).
The producer runs without prefix caching, so that its own full answers are an independent colocated reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import REPO, VllmServer, free_port, start_vllm

SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1100", "--kv-cache-memory-bytes", "67108864",
              "--max-num-batched-tokens", "512"]


def build_model(preset: str) -> Path:
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), "--preset", preset], check=True)
    return REPO / ".cache" / "models" / preset


def connector_config(role: str, **extra: object) -> dict:
    return {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connector.mooncake_connector",
            "kv_role": role, "kv_connector_extra_config": {"buffer_size": 512 << 20, **extra}}


def mooncake_json(path: Path, **extra: object) -> Path:
    path.write_text(json.dumps({"prefill_url": f"127.0.0.1:{free_port()}", "decode_url": f"127.0.0.1:{free_port()}",
                                "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "timeout": 5, **extra}))
    return path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_model("tiny")


def start_pair(model: Path, work: Path, name: str, consumer_extra: dict | None = None,
               **mooncake_extra: object) -> tuple[VllmServer, VllmServer]:
    """A producer (core 0, no prefix caching: its full answers are the colocated reference) and a consumer (core 1,
    test corruption allowed) serving ``model``, paired through one mooncake.json in ``work``; both started."""
    config = mooncake_json(work / "mooncake.json", **mooncake_extra)
    producer = VllmServer(f"{name}-producer", model, free_port(), 0, work, connector_config("kv_producer"), config,
                          [*SERVE_ARGS, "--no-enable-prefix-caching"])
    consumer = VllmServer(f"{name}-consumer", model, free_port(), 1, work,
                          connector_config("kv_consumer", allow_test_corruption=True, **(consumer_extra or {})), config,
                          SERVE_ARGS)
    start_vllm(producer, consumer)
    return producer, consumer


@pytest.fixture(scope="session")
def pd_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A producer and a consumer serving the tiny model, paired through one mooncake.json (pull mode)."""
    producer, consumer = start_pair(tiny_model, tmp_path_factory.mktemp("pd"), "pull")
    yield producer, consumer
    producer.stop()
    consumer.stop()


@pytest.fixture(scope="session")
def push_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """Like ``pd_pair``, in push mode (selected in mooncake.json), with chunked prefill (batch budget 512 tokens)."""
    producer, consumer = start_pair(tiny_model, tmp_path_factory.mktemp("push"), "push", transfer_mode="push")
    yield producer, consumer
    producer.stop()
    consumer.stop()
