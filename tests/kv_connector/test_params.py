"""kv_transfer_params come from the network through the proxy: every field is checked, and a producer of another TP
size is accepted (each consumer rank reads the heads it holds), while push targets must match this instance's TP."""

from __future__ import annotations

import pytest

from kv_connector import params as kv_params


def test_producer_params_round_trip():
    sent = kv_params.producer_params(["127.0.0.1:9000", "127.0.0.1:9001"], "engine-a", "req-1")
    got = kv_params.remote_prefill(sent)
    assert got == kv_params.RemotePrefill(["127.0.0.1:9000", "127.0.0.1:9001"], "engine-a", "req-1")


def test_no_params_or_no_remote_prefill_means_the_configured_producer():
    assert kv_params.remote_prefill(None) is None
    assert kv_params.remote_prefill({"do_remote_prefill": False, "remote_pipe": ["127.0.0.1:1"]}) is None


def test_a_producer_of_another_tp_size_is_accepted_for_pull():
    got = kv_params.remote_prefill({"do_remote_prefill": True, "remote_pipe": ["127.0.0.1:9000"], "remote_tp_size": 1})
    assert got is not None and got.pipes == ["127.0.0.1:9000"]


@pytest.mark.parametrize("params, message", [
    ({"remote_pipe": "127.0.0.1:9000"}, "expected a list"),
    ({"remote_pipe": []}, "expected a list"),
    ({"remote_pipe": ["127.0.0.1:1"] * 1025}, "expected a list"),
    ({"remote_pipe": ["no-port"]}, "remote_pipe"),
    ({"remote_pipe": ["127.0.0.1:99999"]}, "remote_pipe"),
    ({"remote_pipe": ["127.0.0.1:1"], "remote_tp_size": 2}, "remote_tp_size is 2 but remote_pipe names 1"),
    ({"remote_pipe": ["127.0.0.1:1"], "remote_tp_size": True}, "remote_tp_size: expected an integer"),
    ({"remote_pipe": ["127.0.0.1:1"], "remote_engine_id": "x" * 300}, "short strings"),
])
def test_hostile_decode_params_are_refused_naming_the_field(params, message):
    with pytest.raises(kv_params.ParamsError, match=message):
        kv_params.remote_prefill({"do_remote_prefill": True, **params})


def test_push_targets_must_match_this_instances_tp_size():
    assert kv_params.push_targets({"mooncake_push_to": ["127.0.0.1:1", "127.0.0.1:2"]}, 2) == \
        ["127.0.0.1:1", "127.0.0.1:2"]
    assert kv_params.push_targets({}, 2) is None
    assert kv_params.push_targets({"mooncake_push_to": []}, 2) == []  # no push: kept for pull
    with pytest.raises(kv_params.ParamsError, match="same tensor_parallel_size"):
        kv_params.push_targets({"mooncake_push_to": ["127.0.0.1:1"]}, 2)
