"""The connector's configuration, parsed once: the role check, and the one rule from a role to its pipe addresses
(also what /metrics publishes for the proxy)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kv_connector import params as kv_params
from kv_connector.config import ConnectorConfig, ConnectorOptions, check_kv_cache_dtype, kv_rank, role_pipe, role_pipes
from kv_connector.vllm_stats import endpoint_info
from kv_pipe import CONFIG_ENV, ConfigError
from tests.kv_connector.units import SECRET, config


@pytest.fixture(autouse=True)
def _no_secret_from_the_environment(monkeypatch):
    monkeypatch.delenv("MOONCAKE_KV_SECRET", raising=False)


def vllm_config(role: str, extra: object = None, tp: int = 1, policy: str = "recompute") -> SimpleNamespace:
    """The parts of vLLM's config the connector's configuration reads."""
    transfer = SimpleNamespace(kv_role=role, kv_connector_extra_config=extra, engine_id="e-1",
                               kv_load_failure_policy=policy)
    return SimpleNamespace(kv_transfer_config=transfer, parallel_config=SimpleNamespace(tensor_parallel_size=tp))


def test_each_role_has_its_kv_rank_and_addresses():
    mooncake = config().mooncake
    assert (kv_rank(True), kv_rank(False)) == (0, 1)
    assert role_pipes(mooncake, True, 3) == ["10.0.0.1:13003", "10.0.0.1:13004", "10.0.0.1:13005"]
    assert role_pipes(mooncake, False, 2) == ["10.0.0.2:13103", "10.0.0.2:13104"]
    assert role_pipe(mooncake, False, 1) == "10.0.0.2:13104"


def test_an_instance_knows_its_pipes_and_its_configured_peers():
    producer, consumer = config("kv_producer", tp=2), config("kv_consumer", tp=2)
    assert producer.pipes == consumer.peer_pipes == ["10.0.0.1:13003", "10.0.0.1:13004"]
    assert consumer.pipes == producer.peer_pipes == ["10.0.0.2:13103", "10.0.0.2:13104"]
    assert producer.is_producer and not consumer.is_producer


@pytest.mark.parametrize("role", ["kv_bothh", "producer", "", None])
def test_one_role_per_instance(role):
    with pytest.raises(ConfigError, match="kv_producer"):
        ConnectorConfig.from_vllm(vllm_config(role))


def test_the_pool_is_on_with_a_master_and_kv_both_needs_it(tmp_path, monkeypatch):
    path = tmp_path / "mooncake.json"
    path.write_text('{"metadata_server": "P2PHANDSHAKE"}')
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert ConnectorConfig.from_vllm(vllm_config("kv_consumer")).store is None
    with pytest.raises(ConfigError, match="kv_both.*master_server_address"):
        ConnectorConfig.from_vllm(vllm_config("kv_both"))
    # the keys and size forms vLLM's MooncakeStoreConnector reads, in the same file
    path.write_text('{"metadata_server": "P2PHANDSHAKE", "master_server_address": "127.0.0.1:50051", '
                    '"global_segment_size": "1GB", "local_buffer_size": 268435456, "protocol": "tcp"}')
    cfg = ConnectorConfig.from_vllm(vllm_config("kv_both"))
    assert cfg.is_both and cfg.loads and not cfg.has_producer and cfg.pipes == []
    assert cfg.store is not None and cfg.store.master_server_address == "127.0.0.1:50051"
    assert (cfg.store.global_segment_size, cfg.store.local_buffer_size) == (1 << 30, 256 << 20)
    assert ConnectorConfig.from_vllm(vllm_config("kv_producer")).loads  # a producer loads from the pool too
    stores_only = ConnectorConfig.from_vllm(vllm_config("kv_producer", {"pool_lookups": False}))
    assert not stores_only.loads and not stores_only.looks_in_pool and stores_only.store is not None
    assert ConnectorConfig.from_vllm(vllm_config("kv_consumer", {"pool_lookups": False})).loads  # its producer


@pytest.mark.parametrize("keys, message", [
    ({"master_server_address": "nohost"}, "master_server_address: 'nohost' has no port"),
    ({"master_server_address": "h:1", "global_segment_size": "1MB"}, "global_segment_size: expected bytes from"),
    ({"master_server_address": "h:1", "global_segment_size": "lots"}, "global_segment_size: expected a number"),
    ({"master_server_address": "h:1", "local_buffer_size": 0}, "local_buffer_size: expected bytes > 0"),
    ({"master_server_address": "h:1", "mode": "standalone-store"}, "must be 0 with mode"),
    ({"master_server_address": "h:1", "mode": "cluster"}, "mode: expected"),
    ({"master_server_address": "h:1", "tenant_id": ""}, "tenant_id: expected a non-empty string"),
    ({"global_segment_size": "4GB"}, "global_segment_size set without master_server_address"),
])
def test_pool_keys_are_checked_up_front(tmp_path, monkeypatch, keys, message):
    import json

    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(keys))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_vllm(vllm_config("kv_consumer"))


def test_the_connectors_own_config_path_wins_over_the_environment(tmp_path, monkeypatch):
    """Connectors composed in vLLM's MultiConnector share one environment: a path set for this one wins."""
    ours, shared = tmp_path / "ours.json", tmp_path / "shared.json"
    ours.write_text('{"prefill_url": "127.0.0.1:15000", "decode_url": "127.0.0.1:15100"}')
    shared.write_text('{"prefill_url": "127.0.0.1:16000", "decode_url": "127.0.0.1:16100"}')
    monkeypatch.setenv(CONFIG_ENV, str(shared))
    cfg = ConnectorConfig.from_vllm(vllm_config("kv_consumer", {"mooncake_config_path": str(ours)}))
    assert cfg.pipes == ["127.0.0.1:15100"]


def test_parsed_from_vllms_config_and_mooncake_json(tmp_path, monkeypatch):
    path = tmp_path / "mooncake.json"
    path.write_text('{"prefill_url": "127.0.0.1:15000", "decode_url": "127.0.0.1:15100"}')
    monkeypatch.setenv(CONFIG_ENV, str(path))
    cfg = ConnectorConfig.from_vllm(vllm_config("kv_consumer", {"transfer_mode": "push"}, tp=2))
    assert cfg.push_mode and cfg.engine_id == "e-1" and cfg.tp_size == 2 and not cfg.fail_loads
    assert ConnectorConfig.from_vllm(vllm_config("kv_consumer", policy="fail")).fail_loads  # vLLM's own default
    assert cfg.pipes == ["127.0.0.1:15100", "127.0.0.1:15101"]
    with pytest.raises(ConfigError, match="unknown key"):
        ConnectorConfig.from_vllm(vllm_config("kv_consumer", {"transfer_modes": "push"}))
    monkeypatch.delenv(CONFIG_ENV)
    with pytest.raises(ConfigError, match=CONFIG_ENV):
        ConnectorConfig.from_vllm(vllm_config("kv_consumer"))


def test_endpoint_info_publishes_the_pipes_and_a_consumers_push_proof():
    info = endpoint_info(config("kv_consumer", tp=2, secret=SECRET, mode="push"))
    assert info == {"kv_role": "kv_consumer", "transfer_mode": "push", "pipes": "10.0.0.2:13103,10.0.0.2:13104",
                    "kv_engine_id": "engine-1",
                    "push_proof": kv_params.push_proof(SECRET.encode(), ["10.0.0.2:13103", "10.0.0.2:13104"]),
                    "kv_pool": ""}
    assert endpoint_info(config("kv_producer"))["push_proof"] == ""
    assert endpoint_info(config("kv_consumer"))["push_proof"] == ""  # no secret: nothing to prove


def test_sleep_mode_is_supported_under_both_hook_names():
    """vLLM 0.33 calls unregister_kv_caches / restore_kv_caches around sleep mode (and refuses to start with sleep mode
    on if supports_sleep_mode says no); its newer releases call the first release_kv_caches. (What they do:
    test_data_path.py's sleep test.)"""
    from kv_connector.mooncake_connector import MooncakeConnector

    assert MooncakeConnector.supports_sleep_mode(None) is True
    assert MooncakeConnector.release_kv_caches is MooncakeConnector.unregister_kv_caches


def test_push_mode_asks_vllm_for_piecewise_cuda_graphs():
    """A replayed full CUDA graph runs no Python: push mode's ``save_kv_layer`` would never be called. vLLM asks
    the connector class with the extra config only (no role), before it exists."""
    from kv_connector.mooncake_connector import MooncakeConnector

    assert MooncakeConnector.requires_piecewise_for_cudagraph({"transfer_mode": "push"}) is True
    for extra in ({"transfer_mode": "pull"}, {}, None, ["push"]):
        assert MooncakeConnector.requires_piecewise_for_cudagraph(extra) is False


def test_a_run_without_metadata_saves_nothing():
    """vLLM's warm-up and CUDA graph capture runs call the attention layers' ``save_kv_layer`` with no metadata
    bound: nothing to save, and no error."""
    import torch

    from kv_connector.mooncake_connector import MooncakeConnector

    connector = MooncakeConnector.__new__(MooncakeConnector)  # only the facade's own guard is under test here
    connector._connector_metadata = None
    connector._worker = None  # reaching the worker would raise
    connector.save_kv_layer("model.layers.0.self_attn.attn", torch.zeros(1), None)


@pytest.mark.parametrize("device_type, option, holds", [
    ("cuda", "auto", True), ("cpu", "auto", False), ("cpu", "always", True), ("cuda", "always", True),
])
def test_a_producer_holds_finished_requests_blocks_where_its_copies_are_asynchronous(device_type, option, holds):
    from kv_connector.config import ConnectorOptions
    from kv_connector.mooncake_connector import holds_blocks

    cfg = config("kv_producer")
    cfg = ConnectorConfig(cfg.kv_role, ConnectorOptions(hold_blocks=option), cfg.mooncake, 1, "e")
    assert holds_blocks(SimpleNamespace(device_config=SimpleNamespace(device_type=device_type)), cfg) is holds


# ---------------------------------------------------------------- the connector's options (kv_connector_extra_config)
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
    ({"pool_placement": "nearest"}, "pool_placement: expected \"spread\" .* or \"local\""),
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


@pytest.mark.parametrize("master, secret, allowed, refused", [
    ("10.0.0.9:50051", "", False, True),  # beyond loopback, no secret: refused
    ("10.0.0.9:50051", "s" * 40, False, False),
    ("10.0.0.9:50051", "", True, False),  # allow_unauthenticated
    ("127.0.0.1:50051", "", False, False),  # all on this host
])
def test_a_pool_beyond_loopback_needs_the_secret(tmp_path, monkeypatch, master, secret, allowed, refused):
    import json

    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": master, "auth_secret": secret,
                                "allow_unauthenticated": allowed}))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    if refused:
        with pytest.raises(ConfigError, match="KV pool reaches beyond this host.*no secret"):
            ConnectorConfig.from_vllm(vllm_config("kv_both"))
    else:
        assert ConnectorConfig.from_vllm(vllm_config("kv_both")).store is not None
