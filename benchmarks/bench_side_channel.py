"""Side channel: our hand-written TCP frames vs pyzmq, for the decision of issue #15 (XpYd links).

The side channel carries the pipe's small messages (hello, tensor headers, chunk notices, ACKs) and whole tensors of
up to ``inline_max`` bytes (e.g. a drop_select request or answer). What matters is the latency of one small message
between two processes, and how it holds when several senders fan in to one receiver.

Columns (each: one receiving process; ``--senders`` sending processes; every message 4 KiB; the receiver answers each
message with a 16-byte reply before the sender sends its next one, so messages never queue):

- ``socket frames``: what ``kv_pipe.connections`` does: one TCP connection per sender, a 12-byte header + payload written
  with ``sendall``, read with ``recv_into`` in a blocking thread per connection (the receiving side of a pipe reads
  its connection in the caller's thread).
- ``zmq``: a DEALER per sender connected to one ROUTER (pyzmq, the same message sizes); the receiver polls the ROUTER
  in one thread (one socket fans in every peer).
- ``zmq + CURVE``: the same with CURVE encryption and authentication on (keys generated per run).
- ``MooncakePipe``: ``send_tensor`` of a 4 KiB uint8 tensor (inline in its frame) to ``recv_tensor`` and a 16-byte
  tensor back: the whole pipe, headers parsed and validated, for scale (one sender: a pipe links two processes).

One-way latency = round trip / 2, from the sender's clock. Both processes run with the worker's GIL switch interval
(0.1 ms); with ``--pin`` the receiver runs on core 1 and every sender on core 0.

Run (from the repository root; ~1 minute)::

    .venv/bin/python benchmarks/bench_side_channel.py
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.support import baselines, common

SIZE = 4096
REPLY = 16
HEADER = struct.Struct("!4sBBHI")
SWITCH = 0.0001


def _setup(core: int | None) -> None:
    sys.setswitchinterval(SWITCH)
    if core is not None:
        os.sched_setaffinity(0, {core})


def _frame(payload: bytes) -> bytes:
    return HEADER.pack(b"MKVP", 4, 1, 0, len(payload)) + payload


# ----------------------------------------------------------------------------- socket frames
def socket_receiver(port: int, senders: int, ready: Any, core: int | None) -> None:
    _setup(core)
    server = socket.create_server(("127.0.0.1", port), backlog=64)
    ready.set()

    def serve(conn: socket.socket) -> None:
        baselines.nodelay(conn)
        try:
            while True:
                _, _, _, _, length = HEADER.unpack(baselines.recv_exact(conn, HEADER.size))
                baselines.recv_exact(conn, length)
                conn.sendall(_frame(b"\0" * REPLY))
        except (ConnectionError, OSError):
            conn.close()

    threads = []
    for _ in range(senders):
        conn, _ = server.accept()
        t = threading.Thread(target=serve, args=(conn,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()


def socket_sender(port: int, n: int, out: Any, core: int | None) -> None:
    _setup(core)
    sock = baselines.connect(("127.0.0.1", port), None)
    payload = b"x" * SIZE
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.sendall(_frame(payload))
        _, _, _, _, length = HEADER.unpack(baselines.recv_exact(sock, HEADER.size))
        baselines.recv_exact(sock, length)
        lat.append((time.perf_counter() - t0) / 2)
    sock.close()
    out.put(lat)


# ----------------------------------------------------------------------------- zmq
def zmq_receiver(port: int, senders: int, ready: Any, core: int | None, keys: dict[str, bytes] | None) -> None:
    import zmq

    _setup(core)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    if keys:
        router.curve_server = True
        router.curve_secretkey = keys["server_secret"]
        router.curve_publickey = keys["server_public"]
    router.bind(f"tcp://127.0.0.1:{port}")
    ready.set()
    done = 0
    reply = b"\0" * REPLY
    while done < senders:
        ident, msg = router.recv_multipart()
        if msg == b"bye":
            done += 1
            continue
        router.send_multipart([ident, reply])
    router.close(linger=0)
    ctx.term()


def zmq_sender(port: int, n: int, out: Any, core: int | None, keys: dict[str, bytes] | None) -> None:
    import zmq

    _setup(core)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    if keys:
        public, secret = zmq.curve_keypair()
        dealer.curve_serverkey = keys["server_public"]
        dealer.curve_publickey = public
        dealer.curve_secretkey = secret
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = b"x" * SIZE
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        dealer.send(payload)
        dealer.recv()
        lat.append((time.perf_counter() - t0) / 2)
    dealer.send(b"bye")
    dealer.close(linger=1000)
    ctx.term()
    out.put(lat)


# ----------------------------------------------------------------------------- MooncakePipe
def _pipe_config(ports: tuple[int, int]) -> Any:
    from kv_pipe import MooncakeTransferEngineConfig

    return MooncakeTransferEngineConfig(prefill_url=f"127.0.0.1:{ports[0]}", decode_url=f"127.0.0.1:{ports[1]}")


def pipe_receiver(ports: tuple[int, int], n: int, ready: Any, core: int | None) -> None:
    import torch

    from kv_pipe import MooncakePipe

    _setup(core)
    with MooncakePipe(kv_rank=1, config=_pipe_config(ports)) as pipe:
        ready.set()
        reply = torch.zeros(REPLY, dtype=torch.uint8)
        for _ in range(n + 20):
            pipe.recv_tensor()
            pipe.send_tensor(reply)
        pipe.recv_tensor()  # the sender's "done": it closes only after our last reply arrived


def pipe_sender(ports: tuple[int, int], n: int, out: Any, core: int | None) -> None:
    import torch

    from kv_pipe import MooncakePipe

    _setup(core)
    with MooncakePipe(kv_rank=0, config=_pipe_config(ports)) as pipe:
        payload = torch.ones(SIZE, dtype=torch.uint8)
        lat = []
        for i in range(n + 20):  # the first 20 set up the links (not counted)
            t0 = time.perf_counter()
            pipe.send_tensor(payload)
            pipe.recv_tensor()
            if i >= 20:
                lat.append((time.perf_counter() - t0) / 2)
        pipe.send_tensor(None)
    out.put(lat)


# ----------------------------------------------------------------------------- run
def run(kind: str, senders: int, n: int, pin: bool) -> list[float]:
    from harness.ports import free_port

    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    rcore, score = (1, 0) if pin else (None, None)
    keys = None
    if kind == "zmq_curve":
        import zmq

        public, secret = zmq.curve_keypair()
        keys = {"server_public": public, "server_secret": secret}
    if kind == "pipe":
        ports = (free_port(), free_port())
        recv = ctx.Process(target=pipe_receiver, args=(ports, n, ready, rcore))
        send_args = [(ports, n, out, score)]
        target = pipe_sender
    else:
        port = free_port()
        if kind == "socket":
            recv = ctx.Process(target=socket_receiver, args=(port, senders, ready, rcore))
            target, send_args = socket_sender, [(port, n, out, score)] * senders
        else:
            recv = ctx.Process(target=zmq_receiver, args=(port, senders, ready, rcore, keys))
            target, send_args = zmq_sender, [(port, n, out, score, keys)] * senders
    recv.start()
    if not ready.wait(60):
        raise RuntimeError(f"{kind}: the receiver did not start")
    procs = [ctx.Process(target=target, args=a) for a in send_args]
    for p in procs:
        p.start()
    lat: list[float] = []
    for _ in procs:
        lat += out.get(timeout=300)[n // 10:]  # warm-up dropped
    for p in procs:
        p.join(30)
    recv.join(30)
    if recv.is_alive():
        recv.kill()
    return lat


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=3000, help="per sender")
    parser.add_argument("--senders", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    rows = []
    for senders in args.senders:
        for kind in ("socket", "zmq", "zmq_curve", "pipe"):
            if kind == "pipe" and senders != 1:
                continue
            lat = run(kind, senders, args.messages, args.pin)
            row = {"kind": kind, "senders": senders, "n": len(lat), "p50_us": statistics.median(lat) * 1e6,
                   "p99_us": common.percentile(lat, 99) * 1e6}
            rows.append(row)
            print(json.dumps(row), flush=True)
    names = {"socket": "socket frames", "zmq": "zmq", "zmq_curve": "zmq + CURVE", "pipe": "MooncakePipe (inline tensor)"}
    lines = [common.header("Side channel: 4 KiB one-way latency, hand-written frames vs pyzmq (bench_side_channel.py)",
                           None), "",
             "Each sender sends a 4 KiB message and waits for a 16-byte reply before the next; one-way = round trip / 2. "
             f"{'Receiver on core 1, senders on core 0' if args.pin else 'No pinning'}; GIL switch interval 0.1 ms.", "",
             "| side channel | senders | messages | p50 us | p99 us |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {names[r['kind']]} | {r['senders']} | {r['n']} | {r['p50_us']:.0f} | {r['p99_us']:.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    common.write("bench_side_channel", {"rows": rows, "size": SIZE}, table, args.out_dir)
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        sys.exit(main())
