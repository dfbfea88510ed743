"""mooncake.json validation: every mistake is refused with a message naming the field and the fix."""

from __future__ import annotations

import json
import logging

import pytest

from kv_pipe import ConfigError, MooncakeTransferEngineConfig
from kv_pipe.config import CONFIG_ENV, engine_has_redis_plugin, physical_memory

pytestmark = pytest.mark.pipes

EXAMPLE = "mooncake.json.example"


def write(tmp_path, data) -> str:
    path = tmp_path / "mooncake.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_example_file_is_the_embedded_default(tmp_path, monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, EXAMPLE)
    cfg = MooncakeTransferEngineConfig.load_from_env()
    assert cfg == MooncakeTransferEngineConfig()
    assert cfg.metadata_server == "P2PHANDSHAKE" and cfg.protocol == "tcp"
    assert cfg.pipe_address(0, 0) == ("127.0.0.1", 13003)
    assert cfg.pipe_address(1, 2) == ("127.0.0.1", 13105)


def test_unset_env(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"{CONFIG_ENV} is not set"):
        MooncakeTransferEngineConfig.load_from_env()


def test_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match="no such file.*mooncake.json.example"):
        MooncakeTransferEngineConfig.load_from_env()


def test_bad_json_names_line_and_column(tmp_path):
    path = write(tmp_path, '{\n  "prefill_url": "127.0.0.1:1",\n  oops\n}')
    with pytest.raises(ConfigError, match="not valid JSON at line 3 column 3"):
        MooncakeTransferEngineConfig.from_file(path)


def test_not_an_object(tmp_path):
    with pytest.raises(ConfigError, match="expected a JSON object"):
        MooncakeTransferEngineConfig.from_file(write(tmp_path, "[1, 2]"))


def test_unknown_key_lists_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown key.*prefil_url.*known keys:.*prefill_url"):
        MooncakeTransferEngineConfig.from_file(write(tmp_path, {"prefil_url": "127.0.0.1:1"}))


@pytest.mark.parametrize("url, message", [
    ("127.0.0.1", "has no port"),
    (":13003", "has no port"),
    ("127.0.0.1:http", "not a number from 1 to 65535"),
    ("127.0.0.1:0", "not a number from 1 to 65535"),
    ("127.0.0.1:70000", "not a number from 1 to 65535"),
    ("127.0.0.1:\u0661\u0663\u0660\u0660\u0663", "not a number from 1 to 65535"),  # Arabic-Indic digits
    ("tcp://127.0.0.1:13003", "has a scheme"),
    ("::1:13003", "IPv6 address in brackets"),
    ("bad host!:13003", "neither an IP address nor a hostname"),
    (13003, "expected a string"),
    ("", "expected a string"),
])
@pytest.mark.parametrize("field", ["prefill_url", "decode_url"])
def test_malformed_url_names_the_field(field, url, message, tmp_path):
    with pytest.raises(ConfigError, match=f"{field}.*{message}"):
        MooncakeTransferEngineConfig.from_file(write(tmp_path, {field: url}))


def test_accepted_url_forms():
    cfg = MooncakeTransferEngineConfig(prefill_url="[::1]:13003", decode_url="decode-host.example:14000",
                                       auth_secret="s" * 40)
    assert cfg.pipe_address(0, 1) == ("::1", 13004)
    assert cfg.pipe_address(1, 0) == ("decode-host.example", 14000)


def test_same_url_moves_decode_port_up_by_100(caplog):
    with caplog.at_level(logging.INFO):
        cfg = MooncakeTransferEngineConfig(prefill_url="127.0.0.1:13003", decode_url="127.0.0.1:13003")
    assert cfg.decode_url == "127.0.0.1:13103"
    assert cfg.pipe_address(1, 0) == ("127.0.0.1", 13103)
    assert "uses port 13103 (+100)" in caplog.text


@pytest.mark.parametrize("protocol", ["udp", "RDMAX", "", "ib"])
def test_unknown_protocol_is_refused(protocol):
    with pytest.raises(ConfigError, match="protocol.*silently fall back to TCP"):
        MooncakeTransferEngineConfig(protocol=protocol)


def test_rdma_needs_device_name():
    with pytest.raises(ConfigError, match="device_name.*rdma.*mlx5_0"):
        MooncakeTransferEngineConfig(protocol="rdma")
    assert MooncakeTransferEngineConfig(protocol="RDMA", device_name="mlx5_0").protocol == "rdma"


def test_device_name_per_tp_rank():
    config = MooncakeTransferEngineConfig(protocol="rdma", device_name=["mlx5_0", "mlx5_1"])
    assert [config.device_for(r) for r in (0, 1)] == ["mlx5_0", "mlx5_1"]
    with pytest.raises(ConfigError, match="lists 2 device.*rank 2 runs"):
        config.device_for(2)
    assert MooncakeTransferEngineConfig(protocol="rdma", device_name="mlx5_0,mlx5_1").device_for(5) == "mlx5_0,mlx5_1"
    for bad in ([], ["mlx5_0", 3], ["mlx5_0", " "]):
        with pytest.raises(ConfigError, match="device_name"):
            MooncakeTransferEngineConfig(protocol="rdma", device_name=bad)


@pytest.mark.parametrize("server, backend, conn", [
    ("P2PHANDSHAKE", "p2p", "P2PHANDSHAKE"),
    ("etcd://127.0.0.1:2379", "etcd", "etcd://127.0.0.1:2379"),
    ("etcd://10.0.0.1:2379,10.0.0.2:2379", "etcd", "etcd://10.0.0.1:2379,10.0.0.2:2379"),
    ("127.0.0.1:2379", "etcd", "etcd://127.0.0.1:2379"),
    ("http://127.0.0.1:8080/metadata", "http", "http://127.0.0.1:8080/metadata"),
])
def test_metadata_forms(server, backend, conn):
    md = MooncakeTransferEngineConfig(metadata_server=server).metadata
    assert (md.backend, md.conn) == (backend, conn)


@pytest.mark.parametrize("server, backend, message", [
    ("etcd://127.0.0.1", None, "has no port"),
    ("etcd://127.0.0.1:2379,nohost", None, "has no port"),
    ("http://127.0.0.1:8080", None, "needs a path"),
    ("zookeeper://127.0.0.1:2181", None, "unknown scheme 'zookeeper'"),
    ("", None, "expected a string"),
    ("P2PHANDSHAKE", "etcd", "makes no sense"),
    ("etcd://127.0.0.1:2379", "http", "disagrees"),
    ("127.0.0.1:2379", "consul", "not one of etcd, http, redis"),
])
def test_bad_metadata_is_refused(server, backend, message):
    with pytest.raises(ConfigError, match=message):
        MooncakeTransferEngineConfig(metadata_server=server, metadata_backend=backend)


def test_bare_host_port_with_http_backend_means_http():
    md = MooncakeTransferEngineConfig(metadata_server="127.0.0.1:8080/metadata", metadata_backend="http").metadata
    assert md.conn == "http://127.0.0.1:8080/metadata"


@pytest.mark.parametrize("server, backend", [("redis://127.0.0.1:6379", None), ("127.0.0.1:6379", "redis")])
def test_redis_without_engine_plugin_is_refused(server, backend):
    if engine_has_redis_plugin():
        pytest.skip("this engine build has a redis plugin")  # the installed non-CUDA wheel has none
    with pytest.raises(ConfigError, match="no redis plugin.*abort"):
        MooncakeTransferEngineConfig(metadata_server=server, metadata_backend=backend)


def test_installed_engine_has_no_redis_plugin():
    # The fact the check above relies on for this project's CI: if a new wheel gains the plugin, this says so.
    assert engine_has_redis_plugin() is False


@pytest.mark.parametrize("field, value, message", [
    ("timeout", 0, "must be > 0"),
    ("timeout", "30", "expected a positive float"),
    ("staging_buffer_size", -1, "must be > 0"),
    ("chunk_size", 1.5, "expected a positive int"),
    ("max_chunks_in_flight", True, "expected a positive int"),
    ("zero_copy_send", "yes", "expected true or false"),
])
def test_bad_numbers(field, value, message):
    with pytest.raises(ConfigError, match=f"{field}.*{message}"):
        MooncakeTransferEngineConfig(**{field: value})


@pytest.mark.parametrize("text, field", [
    ('{"timeout": NaN}', "timeout"),
    ('{"timeout": Infinity}', "timeout"),
    ('{"timeout": 1e308}', "timeout"),
    ('{"timeout": -Infinity}', "timeout"),
    ('{"staging_buffer_size": 1125899906842624}', "staging_buffer_size"),  # 2^50
    ('{"max_tensor_size": 1125899906842624}', "max_tensor_size"),
    ('{"max_chunks_in_flight": 100000000}', "max_chunks_in_flight"),
])
def test_config_edges_are_refused_naming_the_key(text, field, tmp_path):
    """Finding 6 of the hardening issue: NaN, infinite and absurdly large numbers (JSON allows NaN and Infinity) are
    refused up front, naming the key, instead of failing later (OverflowError in settimeout, a RuntimeError when
    registering 2^50 bytes)."""
    path = tmp_path / "mooncake.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{field}: must be > 0 and at most"):
        MooncakeTransferEngineConfig.from_file(path)


def test_a_short_secret_is_refused_up_front(monkeypatch):
    with pytest.raises(ConfigError, match="auth_secret: expected a string of at least 32"):
        MooncakeTransferEngineConfig(auth_secret="a" * 16)
    monkeypatch.setenv("MOONCAKE_KV_SECRET", "short")
    with pytest.raises(ConfigError, match="MOONCAKE_KV_SECRET: expected at least 32"):
        MooncakeTransferEngineConfig()
    monkeypatch.delenv("MOONCAKE_KV_SECRET")
    assert "s" * 40 not in repr(MooncakeTransferEngineConfig(auth_secret="s" * 40))


def test_a_400_digit_number_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="timeout: must be > 0 and at most"):
        MooncakeTransferEngineConfig(timeout=10 ** 400)


def test_default_max_tensor_size_fits_the_machine():
    assert MooncakeTransferEngineConfig().max_tensor_size <= physical_memory() // 2


@pytest.mark.parametrize("value", [-1, 1.5, True, "512MiB", None, 1 << 50])
def test_a_bad_result_pool_size_is_refused_naming_the_key(value, tmp_path):
    with pytest.raises(ConfigError, match=r"result_pool_size: expected a number of bytes from 0 \(no pool"):
        MooncakeTransferEngineConfig(result_pool_size=value)
    with pytest.raises(ConfigError, match=r"mooncake.json: result_pool_size: "):
        MooncakeTransferEngineConfig.from_file(write(tmp_path, {"result_pool_size": value}))


def test_result_pool_size_default_and_off():
    default = MooncakeTransferEngineConfig().result_pool_size
    assert 0 < default <= min(512 << 20, physical_memory() // 16)
    assert MooncakeTransferEngineConfig(result_pool_size=0).result_pool_size == 0
    assert MooncakeTransferEngineConfig.from_dict({"result_pool_size": 64 << 20}).result_pool_size == 64 << 20


def test_transfer_mode_in_mooncake_json_says_where_it_moved():
    with pytest.raises(ConfigError, match="transfer_mode is a setting of the connector now.*kv_connector_extra_config"):
        MooncakeTransferEngineConfig.from_dict({"transfer_mode": "push"})


def test_chunk_must_fit_twice_in_staging():
    with pytest.raises(ConfigError, match="chunk_size .* at most half of staging_buffer_size"):
        MooncakeTransferEngineConfig(staging_buffer_size=1 << 20, chunk_size=1 << 20)


def test_ranks_are_checked():
    cfg = MooncakeTransferEngineConfig()
    with pytest.raises(ConfigError, match="kv_rank must be 0"):
        cfg.pipe_address(2, 0)
    with pytest.raises(ConfigError, match="local_rank must be an int >= 0"):
        cfg.pipe_address(0, -1)


@pytest.mark.parametrize("urls", [{"prefill_url": "10.0.0.5:13003"}, {"decode_url": "node7:13103"},
                                  {"prefill_url": "[2001:db8::5]:13003"}])
def test_no_secret_beyond_loopback_is_refused_unless_allowed(monkeypatch, urls):
    """Finding 1: a pipe listening beyond this host ran without authentication, and nothing said so."""
    monkeypatch.delenv("MOONCAKE_KV_SECRET", raising=False)
    with pytest.raises(ConfigError, match="beyond this host, and no secret is set.*allow_unauthenticated"):
        MooncakeTransferEngineConfig(**urls)
    MooncakeTransferEngineConfig(**urls, auth_secret="s" * 40)
    MooncakeTransferEngineConfig(**urls, allow_unauthenticated=True)
    monkeypatch.setenv("MOONCAKE_KV_SECRET", "e" * 40)
    MooncakeTransferEngineConfig(**urls)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "localhost", "[::1]"])
def test_no_secret_on_loopback_is_allowed(monkeypatch, host):
    monkeypatch.delenv("MOONCAKE_KV_SECRET", raising=False)
    MooncakeTransferEngineConfig(prefill_url=f"{host}:13003", decode_url=f"{host}:13103")


def test_allow_unauthenticated_must_be_a_bool():
    with pytest.raises(ConfigError, match="allow_unauthenticated: expected true or false"):
        MooncakeTransferEngineConfig(allow_unauthenticated="yes")


@pytest.mark.parametrize("ports", [[17000], [100, 2000], [16000, 15000], [40000, 41000], "15000-16000", [True, 2000]])
def test_bad_engine_ports_are_refused(ports):
    with pytest.raises(ConfigError, match="engine_ports: expected \\[first, last\\]"):
        MooncakeTransferEngineConfig(engine_ports=ports)
