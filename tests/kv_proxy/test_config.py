"""kv_proxy/config.py: upstream URLs, ProxyConfig's checks and the command line."""

from __future__ import annotations

import pytest

from kv_proxy.config import ConfigError, ProxyConfig, normalize_upstream_url, parse_args

pytestmark = pytest.mark.timeout(60)


def test_url_validation() -> None:
    assert normalize_upstream_url("http://10.0.0.1:8100/") == "http://10.0.0.1:8100"
    assert normalize_upstream_url("https://[::1]:443") == "https://[::1]:443"
    for bad in ("10.0.0.1:8100", "ftp://h:1", "http://h", "http://:80", "http://h:99999", "http://h:80/v1", "http://h:x"):
        with pytest.raises(ConfigError, match="invalid upstream URL"):
            normalize_upstream_url(bad)
    with pytest.raises(ConfigError, match="--decode"):
        ProxyConfig(prefill=("http://h:1",), decode=())
    with pytest.raises(ConfigError, match="timeout"):
        ProxyConfig(prefill=("http://h:1",), decode=("http://h:2",), timeout=0)
    with pytest.raises(ConfigError, match="protocol must be one of params, bootstrap"):
        ProxyConfig(prefill=("http://h:1",), decode=("http://h:2",), protocol="nixl")
    with pytest.raises(ConfigError, match="only with --protocol bootstrap"):
        ProxyConfig(prefill=("http://h:1",), decode=("http://h:2",), bootstrap=("http://h:8998",))
    with pytest.raises(ConfigError, match="one --bootstrap URL per --prefill URL"):
        ProxyConfig(prefill=("http://h:1", "http://g:1"), decode=("http://h:2",), protocol="bootstrap",
                    bootstrap=("http://h:8998",))
    config = ProxyConfig(prefill=("http://h:1", "http://[::1]:1"), decode=("http://h:2",), protocol="bootstrap")
    assert [config.bootstrap_url(u) for u in config.prefill] == ["http://h:8998", "http://[::1]:8998"]


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    config = parse_args(["--prefill", "http://a:1", "--prefill", "http://b:2", "--decode", "http://c:3", "--port", "9"])
    assert config.prefill == ("http://a:1", "http://b:2") and config.decode == ("http://c:3",)
    assert (config.host, config.port, config.cooldown) == ("127.0.0.1", 9, 5.0)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--prefill", "a:1", "--decode", "http://c:3"])
    assert exit_info.value.code == 2
    assert "invalid upstream URL 'a:1'" in capsys.readouterr().err


def test_proxy_edges_timeouts_are_documented_options(capsys: pytest.CaptureFixture[str]) -> None:
    config = parse_args(["--prefill", "http://a:1", "--decode", "http://c:3", "--connect-timeout", "2.5"])
    assert (config.connect_timeout, config.timeout) == (2.5, 300.0)
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://a:1", "--decode", "http://c:3", "--timeout", "nan"])
    assert "timeout must be seconds > 0" in capsys.readouterr().err


def test_routing_and_admin_options(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--prefill", "http://a:1", "--decode", "http://c:3"]
    monkeypatch.delenv("MOONCAKE_PROXY_ADMIN_TOKEN", raising=False)
    config = parse_args(base)
    assert (config.balance_slack, config.skip_prefill_below, config.prefix_index_entries, config.admin_token,
            config.routing, config.pool_tail) == (4, 0, 200_000, "", "prefix", 128)
    assert parse_args([*base, "--pool-tail", "0"]).pool_tail == 0 and parse_args([*base, "--pool-tail", "512"]).pool_tail == 512
    config = parse_args([*base, "--balance-slack", "0", "--skip-prefill-below", "128", "--prefix-index-entries", "0",
                         "--admin-token", "a" * 16, "--routing", "estimate"])
    assert (config.balance_slack, config.skip_prefill_below, config.prefix_index_entries, config.routing) == \
        (0, 128, 0, "estimate")
    assert config.admin_token == "a" * 16 and "a" * 16 not in repr(config) and not config.decode_on_prefill
    assert parse_args([*base, "--routing", "estimate", "--decode-on-prefill"]).decode_on_prefill
    monkeypatch.setenv("MOONCAKE_PROXY_ADMIN_TOKEN", "from-the-environment-0123")
    assert parse_args(base).admin_token == "from-the-environment-0123"
    assert parse_args([*base, "--admin-token", ""]).admin_token == ""  # explicitly none
    for bad, message in ((["--admin-token", "short"], "at least 16"), (["--admin-token", "a b" * 8], "no spaces"),
                         (["--balance-slack", "-1"], "balance_slack must be"),
                         (["--skip-prefill-below", "-5"], "skip_prefill_below must be"),
                         (["--pool-tail", "-1"], "pool_tail must be an integer from 0 to 16777216"),
                         (["--pool-tail", str((1 << 24) + 1)], "pool_tail must be"),
                         (["--pool-tail", "1.5"], "invalid int value"),
                         (["--routing", "fastest"], "invalid choice"),
                         (["--decode-on-prefill"], "--decode-on-prefill needs --routing estimate")):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])
        assert message in capsys.readouterr().err


def test_pool_tail_is_an_integer_of_tokens() -> None:
    for bad in (True, 1.5, -1, "128", 1 << 25):
        with pytest.raises(ConfigError, match="pool_tail must be an integer"):
            ProxyConfig(prefill=("http://h:1",), decode=("http://h:2",), pool_tail=bad)  # type: ignore[arg-type]
    assert ProxyConfig(prefill=("http://h:1",), decode=("http://h:2",), pool_tail=0).pool_tail == 0
