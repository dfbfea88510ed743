"""Where a load reads from, decided in one place: nowhere for ``do_remote_prefill: false``; the producer the request's
verified params name, else the one mooncake.json names; for ``mooncake_await_push``, whichever producer pushes (push
mode; nowhere in pull mode); rank-to-rank pairing (push links) only when both instances run the same TP size."""

from __future__ import annotations

import pytest

from kv_connector import params as kv_params
from kv_connector.source import LoadSource, load_source, push_link_source
from tests.kv_connector.units import SECRET, config


@pytest.fixture(autouse=True)
def _no_secret_from_the_environment(monkeypatch):
    monkeypatch.delenv("MOONCAKE_KV_SECRET", raising=False)


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": True}, {"do_remote_prefill": True}])
def test_without_a_named_producer_the_configured_one_at_this_tp_size(params):
    source = load_source(params, config(tp=2))
    assert source == LoadSource(["10.0.0.1:13003", "10.0.0.1:13004"], from_params=False, same_tp=True)
    assert [source.peer(r) for r in (0, 1)] == ["10.0.0.1:13003", "10.0.0.1:13004"]


def test_the_producer_the_params_name_with_its_own_tp_size():
    same = load_source(kv_params.producer_params(["10.9.9.9:1", "10.9.9.9:2"], "p", "r"), config(tp=2))
    assert same == LoadSource(["10.9.9.9:1", "10.9.9.9:2"], from_params=True, same_tp=True)
    assert same.peer(1) == "10.9.9.9:2"
    other = load_source(kv_params.producer_params(["10.9.9.9:1"], "p", "r"), config(tp=2))
    assert other.pipes == ["10.9.9.9:1"] and not other.same_tp and other.peer(0) is None


def test_with_a_secret_only_proven_params_name_the_producer():
    cfg = config(secret=SECRET)
    params = kv_params.producer_params(["10.9.9.9:1"], "p", "r", SECRET.encode())
    assert load_source(params, cfg).from_params
    with pytest.raises(kv_params.ParamsError, match="does not verify"):
        load_source({**params, "remote_pipe": ["6.6.6.6:1"]}, cfg)
    with pytest.raises(kv_params.ParamsError, match="missing"):
        load_source(kv_params.producer_params(["10.9.9.9:1"], "p", "r"), cfg)
    assert not load_source(None, cfg).from_params  # no params: the configured producer, nothing to prove


def test_the_secret_may_come_from_the_environment(monkeypatch):
    params = kv_params.producer_params(["10.9.9.9:1"], "p", "r", b"e" * 40)
    monkeypatch.setenv("MOONCAKE_KV_SECRET", "e" * 40)
    assert load_source(params, config(secret=SECRET)).from_params


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_do_remote_prefill_false_loads_from_nowhere(mode):
    assert load_source({"do_remote_prefill": False}, config(mode=mode)) is None
    assert load_source({"do_remote_prefill": False, "remote_pipe": ["10.9.9.9:1"]}, config(secret=SECRET)) is None


def test_an_awaited_push_names_no_producer_and_pull_mode_loads_nothing():
    awaited = {"do_remote_prefill": True, "mooncake_await_push": True}
    source = load_source(awaited, config(tp=2, mode="push", secret=SECRET))
    assert source is not None and source.await_push and not source.from_params and source.pipes == []
    assert source.peer(0) is None and source.peer(1) is None  # no producer known before one pushes
    assert load_source(awaited, config(mode="pull")) is None
    with pytest.raises(kv_params.ParamsError, match="not both"):
        load_source({**awaited, "remote_pipe": ["10.9.9.9:1"]}, config(mode="push"))


def test_a_pull_notice_on_a_push_link_loads_from_that_links_peer_at_this_rank():
    source = push_link_source("10.9.9.9:3", 2)
    assert source.peer(2) == "10.9.9.9:3" and source.pipes[2] == "10.9.9.9:3" and not source.await_push


def test_a_producers_word_that_it_pushed_counts_in_push_mode_at_its_tp_size_only():
    pushed = kv_params.producer_params(["10.9.9.9:1"], "p", "r", pushed=True)
    assert load_source(pushed, config(mode="push")).pushed
    assert not load_source(pushed, config(mode="pull")).pushed  # nobody pushes to a pull-mode consumer
    assert not load_source(kv_params.producer_params(["10.9.9.9:1", "10.9.9.9:2"], "p", "r", pushed=True),
                           config(mode="push")).pushed  # pushes go rank to rank


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_an_instance_without_a_producer_loads_from_the_pool_only(role):
    source = load_source({"do_remote_prefill": True, "remote_pipe": ["10.0.0.5:13003"]}, config(role, pool=True))
    assert source is not None and source.pool_only and source.peer(0) is None


def test_pool_only_params_load_from_the_pool_where_there_is_one():
    params = {"do_remote_prefill": True, "mooncake_pool_only": True}
    source = load_source(params, config(pool=True))
    assert source is not None and source.pool_only
    assert load_source(params, config()) is None  # no pool: the prompt is computed here
