"""kv_transfer_params come from the network through the proxy: every field is checked, and a producer of another TP
size is accepted (each consumer rank reads the heads it holds), while push targets must match this instance's TP. An
explicit ``do_remote_prefill: false`` loads nothing; ``mooncake_await_push`` waits for a push and names nobody."""

from __future__ import annotations

import pytest

from kv_connector import params as kv_params


def test_producer_params_round_trip():
    sent = kv_params.producer_params(["127.0.0.1:9000", "127.0.0.1:9001"], "engine-a", "req-1")
    got = kv_params.decode_params(sent)
    assert got == kv_params.DecodeParams(pipes=["127.0.0.1:9000", "127.0.0.1:9001"])


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": True}, {"do_remote_prefill": None},
                                    {"do_remote_prefill": True}, {"remote_pipe": ["127.0.0.1:1"]},
                                    {"do_remote_prefill": True, "mooncake_await_push": False}])
def test_no_params_or_no_producer_named_means_the_configured_producer(params):
    assert kv_params.decode_params(params) == kv_params.DecodeParams(load=True, pipes=None, await_push=False)


@pytest.mark.parametrize("params", [{"do_remote_prefill": False}, {"do_remote_prefill": False, "do_remote_decode": True},
                                    {"do_remote_prefill": False, "remote_pipe": ["127.0.0.1:1"]},
                                    {"do_remote_prefill": False, "remote_pipe": "garbage", "remote_tp_size": "x"},
                                    {"do_remote_prefill": False, "mooncake_await_push": False}])
def test_do_remote_prefill_false_loads_nothing(params):
    assert kv_params.decode_params(params) == kv_params.DecodeParams(load=False)
    assert kv_params.decode_params(params, SECRET) == kv_params.DecodeParams(load=False)  # nothing to prove


def test_await_push_names_no_producer_and_needs_no_proof():
    asked = kv_params.decode_params({"do_remote_prefill": True, "mooncake_await_push": True})
    assert asked == kv_params.DecodeParams(await_push=True) and asked.pipes is None and asked.load
    assert kv_params.decode_params({"do_remote_prefill": True, "mooncake_await_push": True, "do_remote_decode": False,
                                    "whatever": 1}, SECRET).await_push


@pytest.mark.parametrize("params, message", [
    ({"do_remote_prefill": True, "mooncake_await_push": 1}, "mooncake_await_push: expected true or false"),
    ({"do_remote_prefill": True, "mooncake_await_push": "true"}, "mooncake_await_push: expected true or false"),
    ({"do_remote_prefill": True, "mooncake_await_push": [True]}, "mooncake_await_push: expected true or false"),
    ({"do_remote_prefill": True, "mooncake_await_push": {}}, "mooncake_await_push: expected true or false"),
    ({"do_remote_prefill": 1, "mooncake_await_push": True}, "do_remote_prefill: expected true or false"),
    ({"do_remote_prefill": "false"}, "do_remote_prefill: expected true or false"),
    ({"do_remote_prefill": 0}, "do_remote_prefill: expected true or false"),
    ({"do_remote_prefill": [], "remote_pipe": ["127.0.0.1:1"]}, "do_remote_prefill: expected true or false"),
    ({"mooncake_await_push": True}, "needs do_remote_prefill: true"),
    ({"do_remote_prefill": False, "mooncake_await_push": True}, "needs do_remote_prefill: true"),
    ({"do_remote_prefill": None, "mooncake_await_push": True}, "needs do_remote_prefill: true"),
    ({"do_remote_prefill": True, "mooncake_await_push": True, "remote_pipe": ["127.0.0.1:1"]}, "not both"),
    ({"do_remote_prefill": True, "mooncake_await_push": True, "remote_pipe": None}, "not both"),
])
def test_hostile_await_push_and_do_remote_prefill_values_are_refused(params, message):
    with pytest.raises(kv_params.ParamsError, match=message):
        kv_params.decode_params(params)


def test_a_producer_of_another_tp_size_is_accepted_for_pull():
    got = kv_params.decode_params({"do_remote_prefill": True, "remote_pipe": ["127.0.0.1:9000"], "remote_tp_size": 1})
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
        kv_params.decode_params({"do_remote_prefill": True, **params})


def test_push_targets_must_match_this_instances_tp_size():
    assert kv_params.push_targets({"mooncake_push_to": ["127.0.0.1:1", "127.0.0.1:2"]}, 2) == \
        ["127.0.0.1:1", "127.0.0.1:2"]
    assert kv_params.push_targets({}, 2) is None
    assert kv_params.push_targets({"mooncake_push_to": []}, 2) == []  # no push: kept for pull
    with pytest.raises(kv_params.ParamsError, match="same tensor_parallel_size"):
        kv_params.push_targets({"mooncake_push_to": ["127.0.0.1:1"]}, 2)


SECRET = b"s" * 40


def test_with_a_secret_params_load_only_with_the_producers_proof():
    params = kv_params.producer_params(["127.0.0.1:5000", "127.0.0.1:5001"], "e1", "r1", SECRET)
    assert kv_params.decode_params(params, SECRET).pipes == ["127.0.0.1:5000", "127.0.0.1:5001"]
    assert kv_params.decode_params(params).pipes  # a consumer without a secret does not check
    for forged in ({**params, "remote_pipe": ["6.6.6.6:1", "127.0.0.1:5001"]}, {**params, "remote_request_id": "r2"},
                   {**params, "remote_engine_id": "e2"}, {k: v for k, v in params.items() if k != kv_params.PROOF},
                   {**params, kv_params.PROOF: 7}):
        with pytest.raises(kv_params.ParamsError, match="mooncake_proof.*not proven to come from an instance"):
            kv_params.decode_params(forged, SECRET)
    with pytest.raises(kv_params.ParamsError, match="does not verify"):
        kv_params.decode_params(params, b"t" * 40)  # another fleet's secret


def test_with_a_secret_push_targets_need_the_consumers_proof():
    pipes = ["127.0.0.1:6000"]
    proof = kv_params.push_proof(SECRET, pipes)
    assert kv_params.push_targets({"mooncake_push_to": pipes, "mooncake_push_proof": proof}, 1, SECRET) == pipes
    assert kv_params.push_targets({"mooncake_push_to": []}, 1, SECRET) == []  # pull needs no proof
    with pytest.raises(kv_params.ParamsError, match="mooncake_push_proof: missing"):
        kv_params.push_targets({"mooncake_push_to": pipes}, 1, SECRET)
    with pytest.raises(kv_params.ParamsError, match="does not verify"):
        kv_params.push_targets({"mooncake_push_to": ["127.0.0.1:6001"], "mooncake_push_proof": proof}, 1, SECRET)
    assert kv_params.push_proof(b"", pipes) == ""


@pytest.mark.parametrize("params", [["remote_pipe"], "do_remote_prefill", 7, True])
def test_params_that_are_not_an_object_are_refused(params):
    with pytest.raises(kv_params.ParamsError, match="expected a JSON object"):
        kv_params.decode_params(params)
    with pytest.raises(kv_params.ParamsError, match="expected a JSON object"):
        kv_params.push_targets(params, 1)


@pytest.mark.parametrize("params, message", [
    ({"remote_pipe": [None]}, "remote_pipe"),
    ({"remote_pipe": [["127.0.0.1", 1]]}, "remote_pipe"),
    ({"remote_pipe": [{"host": "127.0.0.1"}]}, "remote_pipe"),
    ({"remote_pipe": ["127.0.0.1:-1"]}, "remote_pipe"),
    ({"remote_pipe": ["127.0.0.1:0x10"]}, "remote_pipe"),
    ({"remote_pipe": ["127.0.0.1:1"] * 10**5}, "expected a list"),
    ({"remote_pipe": {"0": "127.0.0.1:1"}}, "expected a list"),
    ({"remote_pipe": ["127.0.0.1:1"], "remote_tp_size": -1}, "remote_tp_size is -1"),
    ({"remote_pipe": ["127.0.0.1:1"], "remote_tp_size": 1.0}, "expected an integer"),
    ({"remote_pipe": ["127.0.0.1:1"], "remote_tp_size": "1"}, "expected an integer"),
    ({"remote_pipe": ["127.0.0.1:1"], "remote_tp_size": 2**70}, "remote_tp_size is"),
    ({"remote_pipe": ["127.0.0.1:1"], "remote_engine_id": None}, "short strings"),
    ({"remote_pipe": ["127.0.0.1:1"], "remote_request_id": 5}, "short strings"),
    ({"remote_pipe": ["127.0.0.1:1"], "remote_request_id": "r" * 5000}, "short strings"),
])
def test_more_hostile_decode_params_are_refused(params, message):
    with pytest.raises(kv_params.ParamsError, match=message):
        kv_params.decode_params({"do_remote_prefill": True, **params})


def test_unknown_keys_are_ignored_and_only_do_remote_prefill_names_a_producer():
    got = kv_params.decode_params({"do_remote_prefill": True, "remote_pipe": ["127.0.0.1:1"], "remote_block_ids": [1],
                                    "whatever": {"deep": [1, 2]}})
    assert got == kv_params.DecodeParams(pipes=["127.0.0.1:1"])
    assert kv_params.decode_params({"remote_pipe": ["127.0.0.1:1"]}).pipes is None  # no do_remote_prefill: none named
    assert kv_params.decode_params({"do_remote_prefill": True}).pipes is None  # e.g. another connector's params


@pytest.mark.parametrize("push_to", [None, 7, "127.0.0.1:1", {}, [None], [7], ["127.0.0.1:1"] * 2000, ["x"]])
def test_hostile_push_targets_are_refused(push_to):
    with pytest.raises(kv_params.ParamsError, match="mooncake_push_to"):
        kv_params.push_targets({"mooncake_push_to": push_to}, 1)


def test_proofs_do_not_carry_over_between_kinds_or_requests():
    pipes = ["127.0.0.1:5000"]
    params = kv_params.producer_params(pipes, "e1", "r1", SECRET)
    as_push = {"mooncake_push_to": pipes, "mooncake_push_proof": params[kv_params.PROOF]}
    with pytest.raises(kv_params.ParamsError, match="does not verify"):
        kv_params.push_targets(as_push, 1, SECRET)  # a params proof is no push proof
    push = {"do_remote_prefill": True, "remote_pipe": pipes, "remote_engine_id": "e1", "remote_request_id": "r1",
            kv_params.PROOF: kv_params.push_proof(SECRET, pipes)}
    with pytest.raises(kv_params.ParamsError, match="does not verify"):
        kv_params.decode_params(push, SECRET)  # nor the other way round
    with pytest.raises(kv_params.ParamsError, match="does not verify"):
        kv_params.decode_params({**params, kv_params.PROOF: params[kv_params.PROOF].upper()}, SECRET)


def test_a_pushed_flag_comes_only_as_true_or_false():
    sent = kv_params.producer_params(["127.0.0.1:9000"], "engine-a", "req-1", pushed=True)
    assert kv_params.decode_params(sent) == kv_params.DecodeParams(pipes=["127.0.0.1:9000"], pushed=True)
    with pytest.raises(kv_params.ParamsError, match="mooncake_pushed: expected true or false"):
        kv_params.decode_params({**sent, "mooncake_pushed": "yes"})


def test_pool_only_names_no_producer_and_goes_with_do_remote_prefill_only():
    assert kv_params.decode_params({"do_remote_prefill": True, "mooncake_pool_only": True}).pool_only
    assert not kv_params.decode_params({"do_remote_prefill": True, "mooncake_pool_only": False}).pool_only
    assert not kv_params.decode_params({"do_remote_prefill": False, "mooncake_pool_only": True}).load  # nothing
    for params in ({"mooncake_pool_only": True},
                   {"do_remote_prefill": True, "mooncake_pool_only": True, "remote_pipe": ["10.0.0.1:1"]},
                   {"do_remote_prefill": True, "mooncake_pool_only": True, "mooncake_await_push": True},
                   {"do_remote_prefill": True, "mooncake_pool_only": "yes"}):
        with pytest.raises(kv_params.ParamsError):
            kv_params.decode_params(params)
