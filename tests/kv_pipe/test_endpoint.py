"""PipeEndpoint: links to any number of peers (XpYd), channels, idle links, and the handshake's checks - with real
processes, each with its own Transfer Engine."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

from kv_pipe import ConfigError, PipeClosed, auth, wire
from kv_pipe.wire import Kind
from tests.kv_pipe import peers
from tests.kv_pipe.peers import Peer, make_config, open_endpoint
from tests.servers import free_port


def _address() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def cfg():
    return make_config()


def test_producers_and_consumers_in_any_combination(cfg):
    """2 producer endpoints x 3 consumer endpoints, each consumer linked to both producers, all at once: every
    answer comes back on the link that asked, nothing lost."""
    servers = [_address(), _address()]
    clients = [_address() for _ in range(3)]
    rounds = 5
    producers = [Peer(peers.endpoint_server, cfg, s, len(clients)) for s in servers]
    time.sleep(0.5)
    consumers = [Peer(peers.endpoint_client, cfg, c, servers, float(10 * (i + 1)), rounds)
                 for i, c in enumerate(clients)]
    for i, consumer in enumerate(consumers):
        assert consumer.result() == [10.0 * (i + 1) + 1] * (rounds * len(servers))
    assert [p.result() for p in producers] == [rounds * len(clients)] * len(servers)


def test_channels_are_separate_fifos(cfg):
    server = _address()
    producer = Peer(peers.endpoint_server, cfg, server, 2)  # each channel is a link of its own: two "consumers"
    with open_endpoint(cfg, 1, _address()) as endpoint:
        kv, push = endpoint.link(server, "kv"), endpoint.link(server, "push")
        assert kv is not push and endpoint.link(server, "kv") is kv
        kv.send_tensor(torch.tensor([1.0]))
        push.send_tensor(torch.tensor([100.0]))
        assert float(push.recv_tensor()[0]) == 101.0
        assert float(kv.recv_tensor()[0]) == 2.0
        kv.send_tensor(None)
        push.send_tensor(None)
    assert producer.result() == 2


def test_an_idle_link_is_closed_and_made_again_on_next_use(cfg):
    server = _address()
    producer = Peer(peers.endpoint_server, cfg, server, 1)
    with open_endpoint(cfg, 1, _address(), link_idle=1.0) as endpoint:
        first = endpoint.link(server)
        first.send_tensor(torch.tensor([1.0]))
        assert float(first.recv_tensor()[0]) == 2.0
        deadline = time.monotonic() + 10
        while not first.closed and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.closed, "the idle link was not closed"
        with pytest.raises(PipeClosed):
            first.send_tensor(torch.tensor([0.0]))
        again = endpoint.link(server)
        assert again is not first
        again.send_tensor(torch.tensor([5.0]))
        assert float(again.recv_tensor()[0]) == 6.0
        again.send_tensor(None)
    assert producer.result() == 2  # both on the producer's one link: the consumer came back to it


def test_links_only_to_admitted_peers_and_never_to_itself(cfg):
    allowed = _address()
    with open_endpoint(cfg, 1, _address(), peers={allowed}) as endpoint:
        with pytest.raises(ConfigError, match="not a peer"):
            endpoint.link(_address())
    with open_endpoint(cfg, 1, allowed) as endpoint, pytest.raises(ConfigError, match="own address"):
        endpoint.link(allowed)


def _hello(endpoint, **fields) -> bytes:
    hello = {"kv_rank": 0, "local_rank": 0, "address": "127.0.0.1:1", "to": endpoint.address, "channel": "kv",
             "nonce": auth.nonce(), **fields}
    return wire.encode_json(Kind.HELLO, hello)


@pytest.mark.parametrize(("fields", "message"), [
    ({"address": "127.0.0.2:4000"}, b"connects from 127.0.0.1"),
    ({"address": "no port"}, b"HELLO"),
    ({"channel": "../etc"}, b"channel must be"),
    ({"local_rank": 3}, b"local_rank 3"),
])
def test_a_hello_that_lies_or_is_malformed_is_refused(cfg, fields, message):
    with open_endpoint(cfg, 1, _address()) as endpoint:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as sock:
            sock.sendall(_hello(endpoint, **fields))
            kind, payload = wire.recv_frame(sock)
        assert kind == Kind.ERROR and message in payload, payload
        assert endpoint.links() == []


def test_an_endpoint_for_any_peer_rank_admits_another_tp_rank(cfg):
    """The connector's endpoints link TP ranks of instances with different TP sizes: any rank below 1024 is
    admitted (the kv_rank must still be the other side's); a plain endpoint admits only its own rank."""
    with open_endpoint(cfg, 1, _address(), any_peer_rank=True) as endpoint:
        for rank, admitted in ((3, True), (5000, False)):
            with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as sock:
                sock.sendall(_hello(endpoint, local_rank=rank))
                kind, payload = wire.recv_frame(sock)
            assert (kind != Kind.ERROR) == admitted, (rank, kind, payload)
        with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as sock:
            sock.sendall(_hello(endpoint, kv_rank=1, local_rank=3))
            kind, payload = wire.recv_frame(sock)
        assert kind == Kind.ERROR and b"kv_rank 1" in payload


def test_a_stranger_is_not_told_who_the_configured_peers_are(cfg):
    """Before a peer proved that it knows the secret, an ERROR says what was wrong with its own HELLO, never what
    this endpoint is configured with."""
    allowed = _address()
    with open_endpoint(cfg, 1, _address(), peers={allowed}) as endpoint:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as sock:
            sock.sendall(_hello(endpoint))
            kind, payload = wire.recv_frame(sock)
    assert kind == Kind.ERROR and b"127.0.0.1:1 is not a configured peer" in payload, payload
    assert allowed.encode() not in payload and allowed.split(":")[1].encode() not in payload


@pytest.mark.parametrize("fields", [{"kv_rank": 1}, {"local_rank": 3}])
def test_a_stranger_is_not_told_which_ranks_this_pipe_takes(cfg, caplog, fields):
    """Finding 8: a HELLO of the wrong role or rank was told "expected kv_rank 0 local_rank 0" before proving
    anything; only this pipe's log says what it takes."""
    with open_endpoint(cfg, 1, _address()) as endpoint:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as sock:
            sock.sendall(_hello(endpoint, **fields))
            kind, payload = wire.recv_frame(sock)
    claimed = {"kv_rank": 0, "local_rank": 0, **fields}
    # only what the stranger said itself comes back
    assert payload.startswith(f"kv_rank {claimed['kv_rank']} local_rank {claimed['local_rank']} is not taken here".encode())
    assert kind == Kind.ERROR and b"expected" not in payload and b"takes" not in payload.split(b"(")[0], payload
    assert "this pipe takes kv_rank 0 local_rank 0" in caplog.text


def _real_peer_round_trip(cfg, endpoint, server: str, address: str | None = None) -> None:
    """A real peer process (listening at ``address``) links to ``endpoint`` (at ``server``) and a tensor goes each
    way."""
    address = address or _address()
    client = Peer(peers.endpoint_client, cfg, address, [server], 1.0, 1)
    start, link = time.monotonic(), None
    while link is None and time.monotonic() - start < 30:
        link = next((p for p in endpoint.links() if p.peer == address and p.has_ring), None)
        time.sleep(0.01)
    assert link is not None and float(link.recv_tensor(timeout=20)[0]) == 1.0
    link.send_tensor(torch.tensor([2.0]))
    assert link.recv_tensor(timeout=20) is None
    assert client.result() == [2.0]


def test_silent_connections_do_not_hold_up_a_real_peer(cfg):
    """Hardening finding 3: with one accept thread and blocking handshakes, three silent connections locked a
    reconnecting peer out and ten filled the listen backlog of 8. Handshakes now run side by side (backlog 128):
    ten connections that send nothing do not delay a real peer's."""
    server = _address()
    with open_endpoint(cfg, 0, server, start=False) as endpoint:
        endpoint.on_link(lambda pipe: None)
        endpoint.start()
        silent = [socket.create_connection((endpoint.host, endpoint.port)) for _ in range(10)]
        try:
            start = time.monotonic()
            _real_peer_round_trip(cfg, endpoint, server)
            assert time.monotonic() - start < 8.0  # one after the other, the silent ones would take 10 x 3 s
        finally:
            for s in silent:
                s.close()


def _closed_by_the_endpoint(sock: socket.socket) -> bool:
    """Whether the endpoint closed ``sock`` (whatever it sent first is read), without waiting."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def test_one_hosts_flood_of_silent_connections_leaves_room_for_the_others(cfg):
    """Hardening: 70 connections from one host (127.0.0.2) that send nothing: 16 are held (the per-host cap), 54
    closed at once (with the overall cap of 64 alone, 64 would be held and nobody else could start a handshake);
    a real peer (127.0.0.1: the same machine, so it takes the place of the oldest silent one) links; the held ones
    are closed within seconds (a HELLO is due as soon as a peer connected)."""
    server = _address()
    with open_endpoint(cfg, 0, server, start=False) as endpoint:
        endpoint.on_link(lambda pipe: None)
        endpoint.start()
        silent = [socket.create_connection((endpoint.host, endpoint.port), source_address=("127.0.0.2", 0))
                  for _ in range(70)]
        try:
            time.sleep(0.5)  # the endpoint has accepted them all (well before the HELLO timeout)
            closed = [_closed_by_the_endpoint(s) for s in silent]
            assert sum(closed) == 54, closed
            _real_peer_round_trip(cfg, endpoint, server)
            deadline = time.monotonic() + 10
            while not all(closed) and time.monotonic() < deadline:
                time.sleep(0.2)
                closed = [c or _closed_by_the_endpoint(s) for c, s in zip(closed, silent, strict=True)]
            assert all(closed), f"{closed.count(False)} silent connections still held"
        finally:
            for sock in silent:
                sock.close()


def test_an_endpoint_without_a_secret_says_so(monkeypatch, caplog):
    """Finding 1: with no secret nothing said that anyone reaching the port could join."""
    monkeypatch.delenv("MOONCAKE_KV_SECRET", raising=False)
    with caplog.at_level("WARNING"), open_endpoint(make_config(), 0, _address()):
        pass
    assert "runs WITHOUT a secret" in caplog.text and "auth_secret" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"), open_endpoint(make_config(auth_secret="s" * 40), 0, _address()):
        pass
    assert "WITHOUT a secret" not in caplog.text


def _pump(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _relay(listener: socket.socket, target: tuple[str, int], stop: threading.Event) -> None:
    """An intruder: every connection made to ``listener`` is forwarded to ``target``, bytes both ways."""
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        up = socket.create_connection(target, timeout=5)
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def test_a_relayed_handshake_is_refused(caplog):
    """Finding 3: an intruder on the consumer's host that got a secret-holding consumer to link to it relayed the
    handshake to the real producer and got WELCOME (then injected its own frames). The HELLO now names the endpoint
    it was meant for, under both proofs: the producer refuses a HELLO meant for the relay."""
    cfg = make_config(auth_secret="r" * 40)
    with socket.create_server(("127.0.0.1", 0)) as relay, open_endpoint(cfg, 0, _address()) as producer:
        stop = threading.Event()
        threading.Thread(target=_relay, args=(relay, (producer.host, producer.port), stop), daemon=True).start()
        try:
            outcome = Peer(peers.link_once, cfg, _address(), f"127.0.0.1:{relay.getsockname()[1]}").result()
        finally:
            stop.set()
        assert outcome != "sent" and "meant for the pipe at" in outcome, outcome
        assert producer.links() == []
    assert "a relayed handshake" in caplog.text


def test_a_flood_from_many_loopback_addresses_and_silent_hellos_do_not_lock_a_peer_out(cfg, caplog):
    """Finding 5: one process using 127.0.0.2-5 counted as four hosts and took all 64 places, each with a valid
    HELLO and then silence, which held its place for the whole 10 s handshake deadline: a real peer waited
    4.6-8.3 s instead of 0.2 s. Now all of 127/8 is one host group whose newest connection takes the place of its
    oldest unfinished handshake, and an AUTH is due within 3 s of the CHALLENGE."""
    server = _address()
    assert Peer(peers.ready).result()  # the forkserver is up: what is timed below is the link
    with open_endpoint(cfg, 0, server, start=False) as endpoint:
        endpoint.on_link(lambda pipe: None)
        endpoint.start()
        flood = []
        for i in range(64):
            source = f"127.0.0.{2 + i % 4}"
            sock = socket.create_connection((endpoint.host, endpoint.port), source_address=(source, 0))
            sock.sendall(_hello(endpoint, kv_rank=1, address=f"{source}:1"))
            flood.append(sock)
        try:
            time.sleep(0.5)  # every HELLO was answered with a CHALLENGE; the flood stays silent
            start = time.monotonic()
            _real_peer_round_trip(cfg, endpoint, server)
            waited = time.monotonic() - start
            assert waited < 4.0, f"the real peer waited {waited:.1f} s"  # its start-up and link: ~1 s
        finally:
            for sock in flood:
                sock.close()
    assert "to make room for a newer connection (too many at once from 127.0.0.0/8)" in caplog.text


def test_a_connection_naming_a_peer_does_not_lock_the_real_peer_out(cfg, caplog):
    """Finding 5: a process that handshook first naming the real consumer's address held the link's inbound
    connection, and the real consumer was refused ("already has a live connection from it"); so was a peer whose
    host vanished without a FIN, until link_idle. A newer connection that proved the same now replaces the older."""
    server, consumer = _address(), _address()
    with open_endpoint(cfg, 0, server, start=False) as endpoint:
        endpoint.on_link(lambda pipe: None)
        endpoint.start()
        with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as impostor:
            kind, _ = peers.raw_handshake(impostor, {"kv_rank": 1, "local_rank": 0, "address": consumer,
                                                     "to": endpoint.address, "channel": "kv"})
            assert kind == Kind.WELCOME  # no secret here: the impostor got in, and stays silent
            client = Peer(peers.endpoint_client, cfg, consumer, [server], 1.0, 1)
            deadline = time.monotonic() + 30
            while not _closed_by_the_endpoint(impostor):  # the real consumer's connection took its place
                assert time.monotonic() < deadline, "the real consumer was locked out"
                time.sleep(0.05)
            link = next(p for p in endpoint.links() if p.peer == consumer)
            assert float(link.recv_tensor(timeout=20)[0]) == 1.0
            link.send_tensor(torch.tensor([2.0]))
            assert link.recv_tensor(timeout=20) is None
            assert client.result() == [2.0]
    assert "its older connection from" in caplog.text


def test_the_engine_ports_stay_in_the_configured_range():
    """Finding 7: the Transfer Engine's two ports listen on every interface whatever host is configured (the engine
    has no option to bind one address: docs/deployment.md says what to firewall); ``engine_ports`` pins them into a
    range a firewall rule can name. The side channel binds the configured host only."""
    address = _address()
    # outside the engine's default range (15000-17000) and the ports tests hand out (20000-32000)
    got = Peer(peers.listening_sockets, make_config(engine_ports=[17100, 17200]), address).result()
    side = [s for s in got if s[1] == int(address.split(":")[1])]
    engine = [s for s in got if s not in side]
    assert side == [("127.0.0.1", int(address.split(":")[1]))], got
    assert len(engine) == 2 and all(17100 <= port <= 17200 for _, port in engine), got
    assert all(ip in ("0.0.0.0", "::") for ip, _ in engine), (
        f"the engine now binds {engine}: update docs/deployment.md (Security) and the README")


def test_many_links_do_not_pin_a_ring_each(caplog):
    """Finding 4: each new (address, channel) got a fresh, prefaulted staging ring, kept until link_idle: 40
    handshakes in 1.2 s took RSS from 334 to 662 MB with 8 MiB rings (~2.5 GiB with the 64 MiB default). At most
    ``max_links`` links hold a ring now; beyond that the least recently used one not in use is closed."""
    import psutil

    mib = 1 << 20
    cfg = make_config(staging_buffer_size=8 * mib, chunk_size=2 * mib, max_links=8)
    server = _address()
    with open_endpoint(cfg, 0, server, start=False) as endpoint:
        endpoint.on_link(lambda pipe: None)
        endpoint.start()
        base = psutil.Process().memory_info().rss
        for _ in range(40):
            with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as sock:
                kind, _ = peers.raw_handshake(sock, {"kv_rank": 1, "local_rank": 0, "address": _address(),
                                                     "to": endpoint.address, "channel": "kv"})
                assert kind == Kind.WELCOME
        grown = (psutil.Process().memory_info().rss - base) / mib
        assert sum(p.has_ring for p in endpoint.links()) <= 8 and grown < 120, f"{grown:.0f} MiB"
        _real_peer_round_trip(cfg, endpoint, server)
    assert "to make room for a new one (max_links 8)" in caplog.text


def test_idle_links_are_closed_sooner_when_memory_is_short(monkeypatch):
    """Finding 4: a link's ring was held until link_idle whatever the memory left. When less than a tenth of the RAM
    is available, links unused for a tenth of link_idle are closed (their rings freed)."""
    from kv_pipe import node

    cfg = make_config()
    server = _address()
    with open_endpoint(cfg, 0, server, start=False, link_idle=8.0) as endpoint:
        endpoint.on_link(lambda pipe: None)
        endpoint.start()
        _real_peer_round_trip(cfg, endpoint, server)
        time.sleep(2.5)
        assert endpoint.links(), "closed before link_idle with memory to spare"
        monkeypatch.setattr(node, "memory_short", lambda: True)
        deadline = time.monotonic() + 5
        while endpoint.links() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not endpoint.links()
    monkeypatch.undo()
    # the real reading: some RAM is available on this machine, and less than all of it
    assert node.memory_short(fraction=1.0) and not node.memory_short(fraction=0.0)
