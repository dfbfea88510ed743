"""Long prompts, in pull and in push mode: 8k, 16k and 32k tokens of the `long` model (40k context), prefilled in
chunks of 2048, loaded whole; also while both cores are kept busy by other
processes, so that the consumer's request (its 8k+ tokens ride in a Transfer Engine write, not inside the frame) and
the KV arrive late. Every answer equals a fresh prefill on the producer, and the whole prompt's KV moved.

One pair in push mode serves both modes: a pull prefill carries ``mooncake_push_to: []`` (see test_architectures).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import time
from collections.abc import Iterator

import pytest

from harness.ports import free_port
from harness.vllm import VllmServer, build_model, connector_config, mooncake_json, start_vllm
from tests.kv_connector.instance_stats import kv_stats, settled_stats

pytestmark = pytest.mark.vllm

LENGTHS = [8192, 16384, 32768]
BLOCK = 128
ROW_BYTES = 2 * 2 * 1 * BLOCK * 64 * 4  # 2 layers x (K, V) x 1 KV head x 128 tokens x head_dim 64, float32
MAX_TOKENS = 8
ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "40960", "--kv-cache-memory-bytes",
        str(160 << 20), "--max-num-batched-tokens", "2048"]


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    model = build_model("long")
    work = tmp_path_factory.mktemp("long")
    config = mooncake_json(work / "mooncake.json", timeout=30)
    producer = VllmServer("long-producer", model, free_port(), 0, work,
                          connector_config("kv_producer", transfer_mode="push"), config, ARGS,
                          env={"VLLM_SERVER_DEV_MODE": "1"}, worker_process=False)
    consumer = VllmServer("long-consumer", model, free_port(), 1, work,
                          connector_config("kv_consumer", transfer_mode="push", load_timeout=60), config, ARGS,
                          worker_process=False)
    start_vllm(producer, consumer)
    yield producer, consumer
    producer.stop()
    consumer.stop()


def _spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


@contextlib.contextmanager
def busy_cpu(seconds: float) -> Iterator[None]:
    """Two processes spinning (one per core) for at most ``seconds``."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_spin, args=(time.monotonic() + seconds,), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join(5)


def check_long(mode: str, producer: VllmServer, consumer: VllmServer, length: int, seed: int) -> None:
    tokens = [random.Random(seed).randrange(3, 5999) for _ in range(length)]
    producer.post("/reset_prefix_cache", {})
    extra = {"kv_transfer_params": {"mooncake_push_to": []}} if mode == "pull" else {}
    expected = producer.complete(tokens, MAX_TOKENS, timeout=300, **extra)  # a fresh prefill, which also leaves the KV
    before = kv_stats(consumer)
    assert consumer.complete(tokens, MAX_TOKENS, timeout=300) == expected, f"{mode}, {length} tokens"
    change = settled_stats(consumer, before, 1, timeout=30)
    rows = -(-(length - 1) // BLOCK)
    assert change.get("loaded") == 1 and not change.get("load_failures") and not change.get("load_misses"), change
    assert change.get("loaded_bytes") == rows * ROW_BYTES, change
    assert change.get("fetched_bytes", 0) == (rows * ROW_BYTES if mode == "pull" else 0), change


MODES = pytest.mark.parametrize("mode", ["pull", "push"])


@MODES
@pytest.mark.parametrize("length", LENGTHS)
def test_long_prompt(long_pair, mode, length):
    producer, consumer = long_pair
    check_long(mode, producer, consumer, length, seed=length + (mode == "push"))


@MODES
def test_long_prompt_with_the_cpu_busy(long_pair, mode):
    producer, consumer = long_pair
    with busy_cpu(120):
        check_long(mode, producer, consumer, LENGTHS[-1], seed=7 + (mode == "push"))
