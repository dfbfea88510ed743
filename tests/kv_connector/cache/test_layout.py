"""The KV cache's layout and the descriptor every entry carries: what two instances must agree on before a load may
use the producer's bytes (model, layers, block shape, dtype, heads, --kv-cache-dtype, an fp8 cache's k/v scales)."""

from __future__ import annotations

import pytest
import torch

from kv_connector.cache.layout import KVCacheLayout, LayoutMismatch


def layout(cache_dtype: str = "auto", kv_scales=None, dtype=torch.bfloat16, layers: int = 3, **shapes) -> KVCacheLayout:
    caches = {f"l{i}": torch.zeros(shapes.get(f"l{i}", (8, 2, 16, 64)), dtype=dtype) for i in range(layers)}
    return KVCacheLayout.from_caches(caches, 8, "Llama:abc", (0, 2), 16, cache_dtype, kv_scales)


def test_equal_layouts_agree():
    mine = layout("fp8", [[1.0, 1.0]] * 3, torch.uint8)
    mine.check(layout("fp8", [[1.0, 1.0]] * 3, torch.uint8).descriptor_tensor())
    assert mine.descriptor["kv_scales"] == {"every layer": [1.0, 1.0]} and mine.descriptor["cache_dtype"] == "fp8"


def test_other_kv_scales_are_refused_naming_them():
    theirs = layout("fp8", [[0.5, 0.25]] * 3, torch.uint8).descriptor_tensor()
    with pytest.raises(LayoutMismatch, match=r"kv_scales: producer \{'every layer': \[0.5, 0.25\]\} vs this instance "
                                             r"\{'every layer': \[1.0, 1.0\]\}.*same k/v scales"):
        layout("fp8", [[1.0, 1.0]] * 3, torch.uint8).check(theirs)


def test_per_layer_and_per_head_scales_are_compared_layer_by_layer():
    scales = [[1.0, 1.0], [[0.5, 0.75], 1.0], [1.0, 2.0]]
    layout("fp8", scales, torch.uint8).check(layout("fp8", scales, torch.uint8).descriptor_tensor())
    other = [[1.0, 1.0], [[0.5, 0.7], 1.0], [1.0, 2.0]]
    with pytest.raises(LayoutMismatch, match=r"kv_scales: producer \[\[1.0, 1.0\], \[\[0.5, 0.7\]"):
        layout("fp8", scales, torch.uint8).check(layout("fp8", other, torch.uint8).descriptor_tensor())


def test_scales_too_many_to_carry_travel_as_a_digest():
    many = [[[0.001 * i + j / 7 for j in range(128)], 1.0] for i in range(8)]
    descriptor = layout("fp8", many, torch.uint8, layers=8).descriptor
    assert set(descriptor["kv_scales"]) == {"sha256"}
    changed = [*many[:7], [[0.5] * 128, 1.0]]
    with pytest.raises(LayoutMismatch, match="kv_scales"):
        layout("fp8", many, torch.uint8, layers=8).check(layout("fp8", changed, torch.uint8, layers=8).descriptor_tensor())


def test_fp8_e4m3_and_e5m2_are_told_apart():
    """Both are uint8 tensors to vLLM: only --kv-cache-dtype tells their bytes apart."""
    with pytest.raises(LayoutMismatch, match="cache_dtype: producer fp8_e5m2 vs this instance fp8_e4m3"):
        layout("fp8_e4m3", [[1.0, 1.0]] * 3, torch.uint8).check(
            layout("fp8_e5m2", [[1.0, 1.0]] * 3, torch.uint8).descriptor_tensor())


def test_layers_of_different_layouts_are_refused_up_front():
    with pytest.raises(LayoutMismatch, match="l1: \\[8, 2, 16, 32\\].*kv_cache_dtype_skip_layers"):
        layout(l1=(8, 2, 16, 32))
