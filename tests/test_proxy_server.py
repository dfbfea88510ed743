"""proxy_server.py, the entry point: serves in a subprocess as users run it, and loads nothing heavy."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.kv_proxy.upstreams import COMPLETION, ROOT, Environment, run, start_main

pytestmark = pytest.mark.timeout(60)


def test_main_serves_in_a_subprocess() -> None:
    """The console script's entry point: serves on --host/--port, and exits cleanly on SIGTERM."""

    async def test(env: Environment) -> None:
        process, url = await start_main(env, "--log-level", "WARNING")
        try:
            async with env.client.post(url + "/v1/completions", json=COMPLETION) as response:
                assert response.status == 200 and (await response.json())["served_by"] == "D0"
        finally:
            if process.returncode is None:
                process.terminate()
        assert await asyncio.wait_for(process.wait(), 10) == 0

    run(test)


def test_the_proxy_imports_neither_torch_nor_vllm() -> None:
    """The proxy shares the connector's protocol facts (kv_connector/param_keys.py) without loading the connector: a
    front door host need not have torch or vLLM."""
    code = "import sys, proxy_server; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'vllm'}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
