"""The connector composed with vLLM's own ``MooncakeStoreConnector`` inside vLLM's ``MultiConnector``, as users
compose them: one producer runs both (the store connector reads the Mooncake Store file ``MOONCAKE_CONFIG_PATH``
names, with its store keys; ours is given its own file with ``mooncake_config_path``, which wins over the shared
environment), and a plain consumer loads the producer's hand-off. Real vLLM, a real ``mooncake_master``; the bytes
the consumer loaded and the colocated text are asserted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.store import MooncakeMaster
from harness.vllm import VllmServer, connector_config, mooncake_json, start_vllm
from tests.kv_connector.instance_stats import kv_stats, settled_stats
from tests.kv_connector.instances import ROW_BYTES, SERVE_ARGS, blocks
from tests.kv_connector.prompts import MAX_TOKENS, prefill, prompt

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def composed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    work = tmp_path_factory.mktemp("multi")
    with MooncakeMaster(work) as master:
        ours = mooncake_json(work / "pd.json")
        shared = work / "store.json"  # the file vLLM's store connector reads: store keys beside the engine's
        shared.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": "",
                                      "master_server_address": master.address, "global_segment_size": "32MB",
                                      "local_buffer_size": "32MB"}))
        ours_config = {k: v for k, v in connector_config("kv_producer", mooncake_config_path=str(ours)).items()
                       if k != "kv_load_failure_policy"}
        multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "connectors": [ours_config, {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}]}}
        producer = VllmServer("multi-producer", tiny_model, free_port(), 0, work, multi, shared, SERVE_ARGS,
                              worker_process=False)
        consumer = VllmServer("multi-consumer", tiny_model, free_port(), 1, work, connector_config("kv_consumer"),
                              ours, SERVE_ARGS, worker_process=False)
        try:
            start_vllm(producer, consumer)
            yield producer, consumer
        finally:
            producer.stop()
            consumer.stop()


def test_beside_vllms_store_connector_the_hand_off_moves_kv(composed, reference):
    producer, consumer = composed
    tokens = prompt(9900, 400)
    params = prefill(producer, tokens)
    ours = json.loads((Path(producer.log).parent / "pd.json").read_text())
    assert params["remote_pipe"] == [ours["prefill_url"]]  # our file, not the shared environment's
    before = kv_stats(consumer)
    assert consumer.complete(tokens, MAX_TOKENS, kv_transfer_params=params) == reference.complete(tokens, MAX_TOKENS)
    change = settled_stats(consumer, before, 1)
    assert change.get("loaded") == 1 and change.get("fetched_bytes") == blocks(len(tokens) - 1) * ROW_BYTES, change
    assert "MooncakeStoreConnector" in producer.log_text() and "saved request" in producer.log_text()
