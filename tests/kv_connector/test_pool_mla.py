"""The KV pool with an MLA model (DeepSeek-V2's layout: one latent per token and layer, blocks of 16 on the CPU),
where test_pool.py serves separate K and V: two ``kv_both`` instances of the tiny ``deepseek_mla`` model share a
pool; a conversation's next turn on the other instance loads its history from it, exactly its whole blocks' bytes,
and answers as a fresh prefill of the whole prompt does (a request with a ``cache_salt``: it misses the prefix cache
and neither looks in the pool nor stores there).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.ports import free_port
from harness.store import MooncakeMaster
from harness.vllm import VllmServer, build_model, connector_config, mooncake_json, serving
from tests.kv_connector.instance_stats import kv_stats
from tests.kv_connector.pool_traffic import settled, turn
from tests.kv_connector.prompts import MAX_TOKENS, prompt
from tests.kv_connector.test_architectures import Layout, serve_args

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def mla_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Layout, VllmServer, VllmServer]]:
    model = build_model("deepseek_mla", quiet=True)
    work = tmp_path_factory.mktemp("pool-mla")
    with MooncakeMaster(work) as master:
        config = mooncake_json(work / "mooncake.json", master_server_address=master.address,
                               global_segment_size=32 << 20, local_buffer_size=16 << 20)
        a, b = (VllmServer(name, model, free_port(), core, work, connector_config("kv_both"), config,
                           serve_args(mla=True), worker_process=False)
                for name, core in (("pool-mla-a", 0), ("pool-mla-b", 1)))
        with serving(a, b):
            yield Layout(model), a, b


def test_an_mla_conversations_next_turn_loads_its_history_from_the_pool(mla_fleet):
    layout, a, b = mla_fleet
    assert layout.mla
    tokens = prompt(9500, 300)
    before = kv_stats(a)
    _, answer = turn(a, tokens)
    history = tokens + answer
    blocks = (len(history) - 1) // layout.block  # whole blocks of computed KV: all but the last token's
    assert settled(a, before, "pool_saved_blocks", blocks).get("pool_saved_blocks") == blocks
    second = history + prompt(9501, 40)
    before = kv_stats(b)
    text, _ = turn(b, second, MAX_TOKENS)
    change = settled(b, before, "pool_loaded", 1)
    assert change.get("pool_hit_tokens") == blocks * layout.block, change
    assert change.get("pool_loaded") == 1 and change.get("pool_loaded_bytes") == blocks * layout.row_bytes, change
    assert not change.get("load_failures") and not change.get("pool_rejected"), change
    assert text == turn(a, second, MAX_TOKENS, cache_salt="fresh prefill")[0]
