"""What the tests send to real vLLM instances: unique prompts, the answer length, a prefill on the producer and a
disaggregated request (prefill there, decode here), and the counter that shows a load."""

from __future__ import annotations

import random

from harness.vllm import VllmServer

PROMPT_LENGTHS = [150, 233, 317, 401, 512, 600, 713, 800, 901, 1000]
MAX_TOKENS = 16
HITS = "vllm:external_prefix_cache_hits_total"
AWAIT = {"do_remote_prefill": True, "mooncake_await_push": True}  # a push-mode consumer's params: wait for the push


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 5000) for _ in range(length)]  # unique prompts: no prefix cache can hide anything


def disaggregated(producer: VllmServer, consumer: VllmServer, tokens: list[int], **extra: object) -> str:
    producer.complete(tokens, 1)  # the prefill: the producer's connector saves the prompt's KV
    return consumer.complete(tokens, MAX_TOKENS, **extra)


def prefill(producer: VllmServer, tokens: list[int]) -> dict:
    """A prefill on ``producer`` for a remote decode: the kv_transfer_params its answer carries."""
    body = {"model": producer.model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    return producer.post("/v1/completions", body, 120.0)["kv_transfer_params"]
