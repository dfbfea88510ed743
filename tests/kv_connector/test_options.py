"""Connector options are validated when vLLM creates the connector; mistakes stop the start-up with a clear message."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from harness.vllm import VllmServer
from kv_connector.config import ConnectorOptions, check_kv_cache_dtype
from kv_pipe import ConfigError
from tests.kv_connector.instances import BAD_STARTS

pytestmark = pytest.mark.vllm


def test_defaults():
    opts = ConnectorOptions.from_extra_config({})
    assert opts.buffer_size == 2 << 30 and opts.entry_ttl == 30.0 and not opts.receive_into_cache
    assert opts.load_concurrency == 4 and opts.load_timeout == 10.0
    assert opts.gil_switch_interval == 0.0001


@pytest.mark.parametrize("extra, message", [
    ({"bufer_size": 1}, "unknown key.*'bufer_size' \\(did you mean 'buffer_size'\\?\\); known keys: buffer_size, "
                        "entry_ttl"),
    ({"lookup_timeuot": 1, "zzz": 2}, "'lookup_timeuot' \\(did you mean 'lookup_timeout'\\?\\), 'zzz'; known"),
    ({"buffer_size": -5}, "buffer_size: expected a positive number of bytes"),
    ({"buffer_size": "1GiB"}, "buffer_size: expected a positive number of bytes"),
    ({"entry_ttl": 0}, "entry_ttl: expected seconds > 0"),
    ({"load_timeout": float("nan")}, "load_timeout: expected seconds > 0"),
    ({"load_concurrency": 0}, "load_concurrency: expected a positive integer"),
    ({"allow_test_corruption": True}, "unknown key.*'allow_test_corruption'"),  # the tests' switches: harness/tamper.py
    ({"receive_into_cache": 1}, "receive_into_cache: expected true or false"),
    ({"gil_switch_interval": 1}, "gil_switch_interval: expected seconds between 1e-6 and 0.1"),
    ({"gil_switch_interval": -0.001}, "gil_switch_interval: expected seconds"),
    ({"recompute_tokens": -1}, "recompute_tokens: expected an integer from 1 to 4096"),
    ({"recompute_tokens": True}, "recompute_tokens: expected an integer"),
    ({"hold_blocks": "never"}, "hold_blocks: expected \"auto\" or \"always\""),
    ([1], "must be a JSON object"),
])
def test_bad_options(extra, message):
    with pytest.raises(ConfigError, match=message):
        ConnectorOptions.from_extra_config(extra)


@pytest.mark.parametrize("cache_dtype", ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_kv_cache_dtypes_moved_as_bytes_are_accepted(cache_dtype):
    check_kv_cache_dtype(SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype)))


@pytest.mark.parametrize("cache_dtype", ["fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla", "turboquant_k8v4"])
def test_other_quantized_kv_caches_are_refused_with_what_to_use(cache_dtype):
    with pytest.raises(ConfigError, match=f"--kv-cache-dtype {cache_dtype}: MooncakeConnector moves a KV cache in the "
                                          "model's dtype or in fp8, fp8_e4m3, fp8_e5m2"):
        check_kv_cache_dtype(SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype)))


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_with_scales_vllm_estimates_later_is_refused_naming_the_flag(cache_dtype):
    """vLLM releases that still have ``--calculate-kv-scales`` (0.32 has none) estimate the scales from the first
    batch, after the connector read them at start-up: refused, with what to do. Unquantized caches ignore the flag."""
    with pytest.raises(ConfigError, match="--calculate-kv-scales with --kv-cache-dtype .*drop --calculate-kv-scales"):
        check_kv_cache_dtype(SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype,
                                                                          calculate_kv_scales=True)))
    check_kv_cache_dtype(SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype,
                                                                      calculate_kv_scales=False)))
    check_kv_cache_dtype(SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto", calculate_kv_scales=True)))


def test_vllm_refuses_to_start_with_a_bad_option(refused_starts: dict[str, VllmServer]):
    """Spawned early (conftest ``refused_starts``: a refused start-up still imports vLLM, ~20 s of a core). The
    mistake is logged on a line of its own before vLLM's traceback. (An fp8 KV cache, once refused here, is served:
    test_fp8.py.)"""
    for name, server in refused_starts.items():
        try:
            server.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name}: vLLM kept running with a connector configuration it must refuse")
    for name, server in refused_starts.items():
        assert server.proc.returncode != 0, name
        log = server.log_text()
        said = log.find(f"MooncakeConnector: configuration error: {BAD_STARTS[name][2]}")
        assert said >= 0, name
        assert "Traceback" not in log[:said], f"{name}: the mistake is said only after a traceback"
