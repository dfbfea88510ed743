"""Connector options are validated when vLLM creates the connector; mistakes stop the start-up with a clear message."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.vllm import VllmServer, connector_config, mooncake_json
from kv_connector.options import ConnectorOptions
from kv_pipe import ConfigError
from tests.kv_connector.conftest import SERVE_ARGS


def test_defaults():
    opts = ConnectorOptions.from_extra_config({})
    assert opts.buffer_size == 2 << 30 and opts.entry_ttl == 30.0 and not opts.allow_test_corruption
    assert opts.load_concurrency == 4 and opts.load_timeout == 10.0
    assert opts.gil_switch_interval == 0.0001


@pytest.mark.parametrize("extra, message", [
    ({"bufer_size": 1}, "unknown key.*bufer_size.*known keys: allow_test_corruption, buffer_size"),
    ({"buffer_size": -5}, "buffer_size: expected a positive number of bytes"),
    ({"buffer_size": "1GiB"}, "buffer_size: expected a positive number of bytes"),
    ({"entry_ttl": 0}, "entry_ttl: expected seconds > 0"),
    ({"load_timeout": float("nan")}, "load_timeout: expected seconds > 0"),
    ({"load_concurrency": 0}, "load_concurrency: expected a positive integer"),
    ({"allow_test_corruption": "yes"}, "allow_test_corruption: expected true or false"),
    ({"gil_switch_interval": 1}, "gil_switch_interval: expected seconds between 1e-6 and 0.1"),
    ({"gil_switch_interval": -0.001}, "gil_switch_interval: expected seconds"),
    ({"recompute_tokens": -1}, "recompute_tokens: expected an integer from 1 to 4096"),
    ({"recompute_tokens": True}, "recompute_tokens: expected an integer"),
    ([1], "must be a JSON object"),
])
def test_bad_options(extra, message):
    with pytest.raises(ConfigError, match=message):
        ConnectorOptions.from_extra_config(extra)


BAD_STARTS = {  # name: (extra config, vLLM args, what the log must say)
    "misspelled-option": ({"bufer_size": 1}, [], "kv_connector_extra_config: unknown key(s) bufer_size"),
    "fp8-kv-cache": ({}, ["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: MooncakeConnector moves the KV cache in "
                                                      "the model's own dtype only"),
}


def test_vllm_refuses_to_start_with_a_bad_option(tiny_model: Path, tmp_path: Path):
    """Each on a core of its own, at once (a refused start-up still imports vLLM: ~30 s)."""
    config = mooncake_json(tmp_path / "mooncake.json")
    servers = {name: VllmServer(f"bad-option-{name}", tiny_model, free_port(), core, tmp_path,
                                connector_config("kv_consumer", **extra), config, [*SERVE_ARGS, *args])
               for core, (name, (extra, args, _)) in enumerate(BAD_STARTS.items())}
    try:
        for name, server in servers.items():
            try:
                server.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name}: vLLM kept running with a connector configuration it must refuse")
    finally:
        for server in servers.values():
            server.stop()
    for name, server in servers.items():
        assert server.proc.returncode != 0, name
        assert BAD_STARTS[name][2] in server.log_text(), name
