"""The side-channel handshake (kv_pipe/handshake.py): what the accepting side refuses and tells a stranger, a relayed
handshake, the secret, and the connecting side's retries - against real endpoints and pipes."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

import pytest
import torch

from harness.pipes import make_config, open_pipe
from kv_pipe import ProtocolError, auth, handshake, wire
from kv_pipe.wire import Kind
from tests.kv_pipe import peers
from tests.kv_pipe.peers import Peer, open_endpoint, same
from tests.kv_pipe.side_channel import free_address, hello_fields, hello_frame, raw_connect

pytestmark = pytest.mark.pipes


@pytest.fixture
def cfg():
    return make_config()


def every_refusal_logged(caplog) -> None:
    """Refusals are told at WARNING only now and then (``handshake.Tally``), the others at DEBUG: capture those too
    (called in the test's body: pytest sets the capture level again when the body starts)."""
    caplog.set_level(logging.DEBUG, logger="kv_pipe.handshake")


def test_channel_names_and_host_names():
    assert handshake.check_channel("push") == "push"
    for bad in ("", "Kv", "1kv", "../etc", "k" * 33):
        with pytest.raises(ValueError, match="channel must be"):
            handshake.check_channel(bad)
    assert handshake.same_host("127.0.0.1", "127.0.0.1") and handshake.same_host("localhost", "127.0.0.1")
    assert not handshake.same_host("127.0.0.2", "127.0.0.1")
    assert handshake.addresses_of("no-such-host.invalid") == set()


@pytest.mark.parametrize(("fields", "message"), [
    ({"address": "127.0.0.2:4000"}, b"connects from 127.0.0.1"),
    ({"address": "no port"}, b"HELLO"),
    ({"channel": "../etc"}, b"channel must be"),
    ({"link": "not hex"}, b"the link id"),
    ({"link": 7}, b"'link' has the wrong type"),
])
def test_a_hello_that_lies_or_is_malformed_is_refused(cfg, fields, message):
    with open_endpoint(cfg, 1, free_address()) as endpoint:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as sock:
            sock.sendall(hello_frame(endpoint, **fields))
            kind, payload = wire.recv_frame(sock)
        assert kind == Kind.ERROR and message in payload, payload
        assert endpoint.links() == []


def test_an_endpoint_for_any_peer_rank_admits_another_tp_rank(cfg):
    """The connector's endpoints link TP ranks of instances with different TP sizes: any rank below 1024 is
    admitted (the kv_rank must still be the other side's); a plain endpoint admits only its own rank."""
    with open_endpoint(cfg, 1, free_address(), any_peer_rank=True) as endpoint:
        for fields, admitted in (({"local_rank": 3}, True), ({"local_rank": 5000}, False),
                                 ({"kv_rank": 1, "local_rank": 3}, False)):
            with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as sock:
                kind, payload = peers.raw_handshake(sock, _hello(endpoint, **fields))
            assert (kind == Kind.WELCOME) == admitted and (admitted or b"is not taken here" in payload), (fields, payload)


def _hello(endpoint, **fields) -> dict:
    """HELLO fields to ``endpoint`` from 127.0.0.1:1 as a producer, with ``fields`` changed (raw_handshake adds a
    nonce)."""
    return {"kv_rank": 0, "local_rank": 0, "address": "127.0.0.1:1", "to": endpoint.address, "channel": "kv",
            "link": auth.nonce(), **fields}


def _answers(endpoint, fields: dict, secret: bytes) -> tuple[list, bytes]:
    """The frame kinds ``endpoint`` answers a hand-made handshake with, and its last payload."""
    import json

    kinds = []
    with socket.create_connection((endpoint.host, endpoint.port), timeout=5) as sock:
        frame = wire.encode_json(Kind.HELLO, {**_hello(endpoint, **fields), "nonce": auth.nonce()})
        sock.sendall(frame)
        kind, payload = wire.recv_frame(sock)
        kinds.append(kind)
        if kind == Kind.CHALLENGE:
            proof = auth.proof(secret, "link", frame[wire.HEADER.size:], json.loads(payload)["nonce"], "fake:1")
            sock.sendall(wire.encode_json(Kind.AUTH, {"session": "fake:1", "proof": proof}))
            kind, payload = wire.recv_frame(sock)
            kinds.append(kind)
    return kinds, payload


@pytest.mark.parametrize("wrong", [{"address": "127.0.0.1:1"}, {"kv_rank": 1}, {"local_rank": 3}])
def test_a_stranger_cannot_tell_which_ranks_and_peers_this_pipe_takes(caplog, wrong):
    """Finding 8 and issue #37: a HELLO of a rank or address this pipe does not take was refused at once, any other
    with a CHALLENGE: which ranks and peers a pipe serves could be read from the answers. Now every well-formed HELLO
    gets a CHALLENGE, and a stranger without the secret gets the same ERROR whatever it claimed; only a peer that
    proves the secret is told what was wrong (its own log says it too)."""
    every_refusal_logged(caplog)
    allowed = free_address()
    cfg = make_config(auth_secret=SECRET)
    with open_endpoint(cfg, 1, free_address(), peers={allowed}) as endpoint:
        right = {"address": allowed}
        for secret in (b"", b"not-the-secret-at-all"):
            told = []
            for fields in ({}, wrong):
                hello = {**right, **fields}
                kinds, payload = _answers(endpoint, hello, secret)
                # the ERROR may echo the address the stranger claimed itself, nothing else of it
                told.append((kinds, payload.replace(hello["address"].encode(), b"<its address>")))
            assert told[0] == told[1], told
            kinds, payload = told[0]
            assert kinds == [Kind.CHALLENGE, Kind.ERROR] and b"does not prove that it knows" in payload, told
            assert b"configured" not in payload and b"rank" not in payload, payload
        kinds, payload = _answers(endpoint, {**right, **wrong}, SECRET.encode())
        assert kinds == [Kind.CHALLENGE, Kind.ERROR], (kinds, payload)
        assert b"is not taken here" in payload or b"is not a configured peer" in payload, payload
        assert endpoint.links() == []
    assert "this pipe takes kv_rank 0" in caplog.text or "not a configured peer" in caplog.text


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
    every_refusal_logged(caplog)
    cfg = make_config(auth_secret="r" * 40)
    with socket.create_server(("127.0.0.1", 0)) as relay, open_endpoint(cfg, 0, free_address()) as producer:
        stop = threading.Event()
        threading.Thread(target=_relay, args=(relay, (producer.host, producer.port), stop), daemon=True).start()
        try:
            outcome = Peer(peers.link_once, cfg, free_address(), f"127.0.0.1:{relay.getsockname()[1]}").result()
        finally:
            stop.set()
        assert outcome != "sent" and "meant for the pipe at" in outcome, outcome
        assert producer.links() == []
    assert "a relayed handshake" in caplog.text


def test_a_connection_to_itself_is_retried(cfg, monkeypatch):
    # Connecting to a port nobody listens on yet can, rarely, connect a socket to itself (the kernel picks that
    # very port as the source port): the pipe must not take its own HELLO for the peer's answer. Forced here once.
    real = socket.create_connection
    calls = []

    def first_to_itself(address, *args, **kwargs):
        calls.append(address)
        if len(calls) > 1:
            return real(address, *args, **kwargs)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.connect(sock.getsockname())
        return sock

    monkeypatch.setattr(socket, "create_connection", first_to_itself)
    peer = Peer(peers.echo, cfg, 0, 1)
    with open_pipe(cfg, 1) as pipe:
        pipe.send_tensor(torch.ones(3))
        assert same(pipe.recv_tensor(), torch.ones(3))
        pipe.send_tensor(None)
    assert peer.result() == 1 and len(calls) >= 2


SECRET = "0123456789abcdef0123456789abcdef-test-secret"


def test_only_a_peer_that_knows_the_secret_joins_the_pipe():
    """Hardening finding 2: a local process sent a valid HELLO as the producer before the real one: its tensor came out
    of recv_tensor, the real peer was refused, and the WELCOME gave it the engine session and the ring's address.
    With a secret: an intruder that does not know it (a wrong one, or none) gets a CHALLENGE and then an ERROR, never
    a WELCOME; the real peer, with the secret, joins afterwards and is served."""
    cfg = make_config(auth_secret=SECRET)
    with open_pipe(cfg, 1) as pipe:
        for wrong in (b"", b"not-the-secret-at-all"):
            with raw_connect(pipe) as sock:
                kind, payload = peers.raw_handshake(sock, hello_fields(pipe), secret=wrong)
            assert kind == Kind.ERROR and b"does not prove that it knows this pipe's secret" in payload, payload
            assert b"ring" not in payload and b"session" not in payload.lower().replace(b"session name", b"")
        peer = Peer(peers.echo, cfg, 0, 1)
        pipe.send_tensor(torch.arange(5))
        assert same(pipe.recv_tensor(timeout=30), torch.arange(5))
        pipe.send_tensor(None)
        assert peer.result() == 1


def test_a_peer_with_another_secret_is_told_so():
    """Both sides real: the connecting side checks the listening side's proof first and stops with a clear error."""
    listening = make_config(auth_secret=SECRET)
    connecting = {**listening, "auth_secret": "another-secret-that-is-at-least-32-characters-long"}
    peer = Peer(peers.echo, listening, 1, 1)
    with open_pipe(connecting, 0) as pipe, pytest.raises(ProtocolError, match="does not prove that it knows"):
        pipe.send_tensor(torch.ones(3), timeout=10)
    peer.kill()


def test_the_secret_can_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOONCAKE_KV_SECRET", SECRET)
    cfg = make_config()  # no auth_secret in the file: the variable is the secret (children inherit it)
    peer = Peer(peers.echo, cfg, 0, 1)
    with open_pipe(cfg, 1) as pipe:
        with raw_connect(pipe) as sock:
            kind, _ = peers.raw_handshake(sock, hello_fields(pipe), secret=b"")
        assert kind == Kind.ERROR
        pipe.send_tensor(torch.ones(2))
        assert same(pipe.recv_tensor(timeout=30), torch.ones(2))
        pipe.send_tensor(None)
    assert peer.result() == 1


def test_a_stranger_cannot_fill_the_log(caplog):
    """#46 finding 6: every malformed HELLO was logged at WARNING with the peer's values uncut, some before it
    proved the secret: one stranger wrote 30 MB of log in 20 s, lines of 65 KB of its own text. Now what a peer sent
    is cut to 300 characters, a refusal is told at WARNING the 1st, 10th, 100th time (then every 1,000th; the rest at
    DEBUG), and nothing a peer claims is logged before it proved the secret."""
    handshake.REFUSED.count = 0  # (process-wide: other tests' refusals counted too)
    cfg = make_config(auth_secret=SECRET)
    claim = "x" * 60_000
    with open_endpoint(cfg, 1, free_address(), peers={free_address()}) as endpoint:
        for i in range(30):
            fields = {"address": f"127.0.0.1:{2000 + i}", "channel": claim} if i % 2 else {"kv_rank": 7, "local_rank": i}
            _answers(endpoint, fields, b"not the secret")
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.name == "kv_pipe.handshake"]
    assert len(warnings) == 2, [r.getMessage()[:120] for r in warnings]  # the 1st and the 10th of 30
    assert all(len(r.getMessage()) < 600 for r in warnings), max(len(r.getMessage()) for r in warnings)
    assert "kv_rank 7" not in caplog.text and "this pipe takes" not in caplog.text  # claims of an unproven peer
