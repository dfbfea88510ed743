"""What a worker needs of vLLM's objects, read once into plain values (``connector_worker.WorkerSpec``): the rest of the
worker's data path never touches vLLM."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

from kv_connector.worker.connector_worker import WorkerSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def model_fingerprint(vllm_config: VllmConfig) -> str:
    """Architecture plus a hash of the model's config (without its path), its revision and its quantization: equal
    for the same model on any host. (Fine-tunes that keep their base's config look alike: ``pool_namespace``.)"""
    model = vllm_config.model_config
    hf = model.hf_config.to_dict()
    for key in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"):
        hf.pop(key, None)
    served = {"revision": getattr(model, "revision", None), "quantization": getattr(model, "quantization", None)}
    digest = hashlib.sha256(json.dumps([hf, served], sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{'/'.join(hf.get('architectures') or ['?'])}:{digest}"


def worker_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, layer_names: list[str]) -> WorkerSpec:
    """This worker's ``WorkerSpec`` (inside vLLM's worker process, once its parallel state is set up and its model
    loaded: ``register_kv_caches`` time)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    model = vllm_config.model_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    return WorkerSpec(rank=get_tensor_model_parallel_rank(), block_size=vllm_config.cache_config.block_size,
                      fingerprint=model_fingerprint(vllm_config),
                      kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(), replicated=model.use_mla,
                      num_blocks=kv_cache_config.num_blocks if kv_cache_config is not None else None,
                      cache_dtype=cache_dtype,
                      kv_scales=kv_scales(vllm_config, layer_names) if cache_dtype.startswith("fp8") else None)


def kv_scales(vllm_config: VllmConfig, layer_names: list[str]) -> list[list[Any]]:
    """[k_scale, v_scale] of each attention layer (from the checkpoint, else vLLM's 1.0; final once the model is
    loaded): a float each, or a list of floats where the scales are per head."""
    context = vllm_config.compilation_config.static_forward_context
    out = []
    for name in layer_names:
        layer = context.get(name)
        out.append([_scale(layer, "k"), _scale(layer, "v")])
    return out


def _scale(layer: Any, which: str) -> Any:
    tensor = getattr(layer, f"_{which}_scale", None)
    if isinstance(tensor, torch.Tensor) and tensor.numel() > 1:  # per-head scales
        return [float(x) for x in tensor.detach().flatten().cpu().tolist()]
    return float(getattr(layer, f"_{which}_scale_float", 1.0))
