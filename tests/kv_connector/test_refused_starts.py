"""A real `vllm serve` with a connector mistake refuses to start, saying what is wrong on a line of its own (the
options' checks themselves: test_config.py)."""

from __future__ import annotations

import subprocess

import pytest

from harness.vllm import VllmServer
from tests.kv_connector.instances import BAD_STARTS

pytestmark = pytest.mark.vllm


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
