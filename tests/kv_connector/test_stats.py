"""The worker's stats: the buffers' counts that are the connector's too are recorded as they happen, under the
connector's names (the metric names and meanings on /metrics are checked by test_vllm_stats.py)."""

from __future__ import annotations

import time

import torch

from kv_connector.stats import COUNTERS, StatsRecorder
from kv_connector.worker.connector_worker import BUFFER_COUNTS, PUSH_COUNTS
from kv_lookup_buffer import SimpleBuffer


def test_a_buffer_count_is_recorded_under_our_name_and_others_are_ignored():
    stats = StatsRecorder()
    record = stats.counter(BUFFER_COUNTS)
    record("hit_key_bytes", 4096)
    record("hits", 1)  # the buffer's own
    record("evicted", 1)
    data = stats.take().data
    assert data["served_bytes"] == 4096 and data["evicted"] == 1 and "hits" not in data
    assert stats.take() is None  # taken: nothing new


def test_every_buffer_count_we_take_is_one_of_our_counters():
    assert set(BUFFER_COUNTS.values()) | set(PUSH_COUNTS.values()) <= set(COUNTERS)


def test_a_producer_buffer_reports_evictions_and_expirations_when_they_happen():
    stats = StatsRecorder()
    entry = torch.zeros(256, dtype=torch.float32)  # 1 KiB
    buffer = SimpleBuffer(None, None, 2500, role="producer", evict=True, max_age=0.2,
                          on_count=stats.counter(BUFFER_COUNTS))
    try:
        for i in range(3):  # the third does not fit: the oldest is evicted
            buffer.insert(torch.arange(i * 10, i * 10 + 10), None, entry, None, None)
        assert stats.take().data["evicted"] == 1
        time.sleep(0.3)
        buffer.insert(torch.arange(100, 110), None, entry, None, None)  # finds the other two expired
        assert stats.take().data["expired"] == 2
    finally:
        buffer.close()
