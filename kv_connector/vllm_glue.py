"""What a worker needs of vLLM's objects, read once into plain values (``worker.WorkerSpec``): the rest of the
worker's data path never touches vLLM."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from kv_connector.worker import WorkerSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def model_fingerprint(vllm_config: VllmConfig) -> str:
    """Architecture plus a hash of the model's config (without its path): equal for the same model on any host."""
    hf = vllm_config.model_config.hf_config.to_dict()
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"):
        hf.pop(key, None)
    digest = hashlib.sha256(json.dumps(hf, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{'/'.join(hf.get('architectures') or ['?'])}:{digest}"


def worker_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> WorkerSpec:
    """This worker's ``WorkerSpec`` (inside vLLM's worker process, once its parallel state is set up)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    model = vllm_config.model_config
    return WorkerSpec(rank=get_tensor_model_parallel_rank(), block_size=vllm_config.cache_config.block_size,
                      fingerprint=model_fingerprint(vllm_config),
                      kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(), replicated=model.use_mla,
                      num_blocks=kv_cache_config.num_blocks if kv_cache_config is not None else None)
