"""bench_xpyd's processes: every producer and consumer is a child process ("spawn", its own Transfer Engine) that
walks through the run's phases when the parent says so (start, link, fetch, check, close) and reports each; the
parent (``Run``) collects the reports with a deadline per phase and fails the run at once when a child dies."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import statistics
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.support import procs
from benchmarks.support.xpyd_stacks import CONSUMERS, PRODUCERS, TOKENS, BenchError, Spec, exact

logger = logging.getLogger("bench_xpyd")

SWITCH_INTERVAL = 0.0001  # the connector's gil_switch_interval default
SETTLE = 1.0  # seconds between setting up the links and timing anything else on them
RTT_PROBES = 5
HARNESS_MARGIN = 15.0  # seconds the harness waits for a phase beyond the children's own deadline (--timeout)


# ----------------------------------------------------------------------------- child processes
class Mailbox:
    """A child's side of the harness: messages in (JSON strings on ``inbox``), reports out (on ``outbox``)."""

    def __init__(self, role: str, index: int, inbox: Any, outbox: Any, timeout: float) -> None:
        self.role, self.index, self.inbox, self.outbox, self.timeout = role, index, inbox, outbox, timeout

    def wait(self, kind: str) -> dict[str, Any]:
        try:
            msg = json.loads(self.inbox.get(timeout=self.timeout))
        except queue.Empty:
            raise TimeoutError(f"no '{kind}' from the harness within {self.timeout:.0f} s") from None
        if msg["kind"] != kind:
            raise BenchError(f"expected '{kind}' from the harness, got '{msg['kind']}'")
        return msg

    def report(self, kind: str, **data: Any) -> None:
        self.outbox.put(json.dumps({"role": self.role, "index": self.index, "kind": kind, **data}))


def child_main(role: str, index: int, spec_json: str, inbox: Any, outbox: Any, parent: int) -> None:
    """Entry point of every child: runs the producer or consumer protocol, reports any failure with its traceback."""
    procs.watch_parent(parent)
    spec = Spec(**json.loads(spec_json))
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s {role}{index} %(name)s %(levelname)s %(message)s")
    sys.setswitchinterval(SWITCH_INTERVAL)
    torch.set_num_threads(1)
    # the harness's own deadlines (spec.timeout per phase) come first and name the culprit; this one only ends a
    # child the harness forgot
    mail = Mailbox(role, index, inbox, outbox, 3 * spec.timeout + 60)
    try:
        (run_producer if role == "producer" else run_consumer)(spec, index, mail)
    except BaseException as e:
        mail.report("error", error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
        time.sleep(0.5)  # let the queue's feeder thread deliver it
        raise SystemExit(1) from None


def run_producer(spec: Spec, index: int, mail: Mailbox) -> None:
    start = time.monotonic()
    side = PRODUCERS[spec.stack](spec, index)
    try:
        mail.report("ready", info=side.info(), seconds=time.monotonic() - start)
        mail.wait("finish")
        mail.report("result", **side.left())
        mail.wait("close")
    finally:
        side.close()


def run_consumer(spec: Spec, index: int, mail: Mailbox) -> None:
    start = time.monotonic()
    side = CONSUMERS[spec.stack](spec, index)
    try:
        mail.report("started", seconds=time.monotonic() - start)
        infos = mail.wait("producers")["infos"]
        mail.report("linked", links=set_up_links(side, infos, spec.timeout))
        mail.wait("go")
        records, failures = fetch_all(side, spec, index)
        mail.report("result", **check(spec, index, records, failures))
        mail.wait("close")
        side.release()
        mail.report("released")
        mail.wait("exit")
    finally:
        side.close()


def set_up_links(side: Any, infos: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """Make each producer link (one thread per producer, all at once) and time it: link + first request answered
    (set-up), and the same request right after (second). Then, once ``SETTLE`` seconds let background work of the
    set-up end (ours: spare staging rings made again), the median of ``RTT_PROBES`` more (later RTT)."""
    links: list[dict[str, Any]] = [{} for _ in infos]

    def link(p: int) -> None:
        t0 = time.monotonic()
        side.connect(p, infos[p])
        side.probe(p)
        t1 = time.monotonic()
        side.probe(p)
        links[p] = {"producer": p, "setup_ms": (t1 - t0) * 1e3, "second_ms": (time.monotonic() - t1) * 1e3}

    errors: list[str] = []

    def guarded(p: int) -> Callable[[], None]:
        def run() -> None:
            try:
                link(p)
            except Exception as e:  # reported below with the producer it concerns
                errors.append(f"link to producer {p}: {type(e).__name__}: {e}")
        return run

    procs.run_threads([guarded(p) for p in range(len(infos))], timeout, "link")
    if errors:
        raise BenchError("; ".join(errors))
    time.sleep(SETTLE)
    for p, link_stats in enumerate(links):
        rtts = []
        for _ in range(RTT_PROBES):
            t0 = time.monotonic()
            side.probe(p)
            rtts.append((time.monotonic() - t0) * 1e3)
        link_stats["rtt_ms"] = statistics.median(rtts)
    return links


@dataclass
class Record:
    p: int
    i: int
    start: float
    end: float
    got: tuple[torch.Tensor | None, ...] | None = None  # None: the request failed
    error: str = ""


def fetch_all(side: Any, spec: Spec, c: int) -> tuple[list[Record], list[str]]:
    """Every entry this consumer expects, by ``spec.threads`` threads taking (producer, i) round-robin."""
    items = deque((p, i) for i in range(spec.per_pair) for p in range(len(spec.producers)))
    lock = threading.Lock()
    records: list[Record] = []

    def worker() -> None:
        while True:
            with lock:
                if not items:
                    return
                p, i = items.popleft()
            start = time.monotonic()
            try:
                record = Record(p, i, start, 0.0, side.fetch(p, i, spec.uid(p, c, i)))
            except Exception as e:  # counted as a failed request, the others go on
                record = Record(p, i, start, 0.0, None, f"entry {i} from producer {p}: {type(e).__name__}: {e}")
            record.end = time.monotonic()
            with lock:
                records.append(record)

    procs.run_threads([worker] * spec.threads, spec.timeout, "fetch")
    return records, [r.error for r in records if r.error]


def check(spec: Spec, c: int, records: list[Record], failures: list[str]) -> dict[str, Any]:
    """Verify every answer (after the timed phase) and summarise this consumer's run."""
    counts: Counter[str] = Counter()
    seen: Counter[int] = Counter()
    nbytes = 0
    for r in records:
        if r.got is None:
            counts["failed"] += 1
            continue
        tokens, key, value = r.got
        if key is None:
            counts["missing"] += 1
            continue
        nbytes += sum(t.numel() * t.element_size() for t in (key, value) if t is not None)
        if tokens is not None and tokens.numel():
            seen[int(tokens[0]) // TOKENS] += 1
        counts["exact" if exact(spec, spec.uid(r.p, c, r.i), r.got) else "wrong"] += 1
    asked = {(r.p, r.i) for r in records}
    return {"exact": counts["exact"], "wrong": counts["wrong"], "missing": counts["missing"],
            "failed": counts["failed"], "duplicates": sum(n - 1 for n in seen.values() if n > 1),
            "not_asked": len(spec.producers) * spec.per_pair - len(asked), "bytes": nbytes,
            "first": min(r.start for r in records), "last": max(r.end for r in records),
            "fetch_ms": [(r.end - r.start) * 1e3 for r in records], "errors": failures[:5]}


# ----------------------------------------------------------------------------- the harness
@dataclass
class Child:
    role: str
    index: int
    proc: Any
    inbox: Any
    done: bool = False  # exited as planned


@dataclass
class Run:
    """One (stack, shape): spawns the children and walks them through the phases; every wait has a deadline and a
    dead child fails the run at once, with its own error if it sent one."""

    spec: Spec
    outbox: Any = field(default_factory=procs.SPAWN.Queue)
    children: list[Child] = field(default_factory=list)
    backlog: list[dict[str, Any]] = field(default_factory=list)

    def start(self) -> None:
        spec_json = json.dumps(dataclasses.asdict(self.spec))
        for role, n in (("producer", len(self.spec.producers)), ("consumer", len(self.spec.consumers))):
            for index in range(n):
                inbox = procs.SPAWN.Queue()
                proc = procs.SPAWN.Process(target=child_main, args=(role, index, spec_json, inbox, self.outbox, os.getpid()),
                                    daemon=True, name=f"xpyd-{role}{index}")
                proc.start()
                self.children.append(Child(role, index, proc, inbox))

    def of(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

    def send(self, role: str, kind: str, **data: Any) -> None:
        for child in self.of(role):
            child.inbox.put(json.dumps({"kind": kind, **data}))

    def collect(self, role: str, kind: str, timeout: float) -> list[dict[str, Any]]:
        """Each ``role`` child's ``kind`` report, in index order (reports of other phases that arrive meanwhile are
        kept for their own ``collect``)."""
        want = len(self.of(role))
        got: dict[int, dict[str, Any]] = {}
        for msg in [m for m in self.backlog if m["role"] == role and m["kind"] == kind]:
            self.backlog.remove(msg)
            got[msg["index"]] = msg
        deadline = time.monotonic() + timeout
        while len(got) < want:
            try:
                msg = json.loads(procs.get(self.outbox, deadline - time.monotonic(), self._check_alive, kind))
            except TimeoutError:
                late = sorted(set(range(want)) - set(got))
                raise BenchError(f"{self.spec.stack} {self.spec.shape}: {role}s {late} did not report '{kind}' "
                                 f"within {timeout:.0f} s") from None
            self._raise_if_error(msg)
            if msg["role"] == role and msg["kind"] == kind:
                got[msg["index"]] = msg
            else:
                self.backlog.append(msg)
        return [got[i] for i in range(want)]

    def _raise_if_error(self, msg: dict[str, Any]) -> None:
        if msg["kind"] == "error":
            raise BenchError(f"{self.spec.stack} {self.spec.shape}: {msg['role']} {msg['index']} failed: "
                             f"{msg['error']}\n{msg['trace']}")

    def _check_alive(self) -> None:
        for child in self.children:
            code = child.proc.exitcode
            if code is None or child.done:
                continue
            try:  # it may have reported why just before it died
                self._raise_if_error(json.loads(self.outbox.get(timeout=1.0)))
            except queue.Empty:
                pass
            hint = " (SIGKILL: out of memory, or killed by hand)" if code == -9 else ""
            raise BenchError(f"{self.spec.stack} {self.spec.shape}: {child.role} {child.index} (pid {child.proc.pid}) "
                             f"exited with code {code}{hint} in the middle of the run")

    def stop(self, clean: bool) -> None:
        """After a clean run: consumers close their buffers first (they tell the producers), then the producers
        close, then the consumers' endpoints, so that nobody logs a peer that went away; whoever is still there after
        30 s is killed. After a failure: everyone is told to close and killed after 5 s."""
        deadline = time.monotonic() + (30.0 if clean else 5.0)
        self.send("consumer", "close")
        if clean:
            try:
                self.collect("consumer", "released", deadline - time.monotonic())
            except BenchError as e:
                logger.warning("shutting down anyway: %s", e)
        for role, kind in (("producer", "close"), ("consumer", "exit")):
            self.send(role, kind)
            for child in self.of(role):
                child.proc.join(max(0.1, deadline - time.monotonic()))
                child.done = child.proc.exitcode == 0
        for child in self.children:
            if child.proc.is_alive():
                logger.warning("killing %s %d (pid %d): it did not exit", child.role, child.index, child.proc.pid)
                child.proc.kill()
                child.proc.join(5)


def run_once(spec: Spec) -> dict[str, Any]:
    """One (stack, shape) end to end; the children are always gone when this returns."""
    run = Run(spec)
    t0 = time.monotonic()
    wait = spec.timeout + HARNESS_MARGIN  # a child's own deadline of a phase (spec.timeout) ends first: its report is clearer
    ok = False
    try:
        run.start()
        # every process is up (and the producers hold their entries) before any link is made: link set-up is then
        # not timed against other processes' start-up
        ready = run.collect("producer", "ready", wait)
        run.collect("consumer", "started", wait)
        logger.info("%s %s: all processes up in %.1f s (each producer inserted %d entries)", spec.stack, spec.shape,
                    time.monotonic() - t0, len(spec.consumers) * spec.per_pair)
        for child in run.of("consumer"):
            child.inbox.put(json.dumps({"kind": "producers", "infos": [r["info"] for r in ready]}))
        linked = run.collect("consumer", "linked", wait)
        run.send("consumer", "go")
        consumers = run.collect("consumer", "result", wait)
        run.send("producer", "finish")
        producers = run.collect("producer", "result", wait)
        ok = True
    finally:
        run.stop(clean=ok)
    result = summarize(spec, linked, consumers, producers)
    result["seconds"] = time.monotonic() - t0
    return result


def summarize(spec: Spec, linked: list[dict[str, Any]], consumers: list[dict[str, Any]],
              producers: list[dict[str, Any]]) -> dict[str, Any]:
    links = [link for c in linked for link in c["links"]]
    first, last = min(c["first"] for c in consumers), max(c["last"] for c in consumers)
    total = sum(c["bytes"] for c in consumers)
    expected = len(spec.producers) * len(spec.consumers) * spec.per_pair
    lost = {k: sum(c[k] for c in consumers) for k in ("wrong", "missing", "failed", "duplicates", "not_asked")}
    lefts = [p["left"] for p in producers if p["left"] is not None]
    served = [p["served"] for p in producers if p["served"] is not None]
    lost["left_in_producers"] = sum(lefts)
    exact_n = sum(c["exact"] for c in consumers)
    intact = exact_n == expected and not any(lost.values()) and (not served or sum(served) == expected)
    return {
        "stack": spec.stack, "shape": spec.shape, "producers": len(spec.producers), "consumers": len(spec.consumers),
        "per_pair": spec.per_pair, "entries": expected, "bytes": total, "exact": exact_n, "lost": lost,
        "served": sum(served) if served else None, "intact": intact,
        "setup_ms": [round(link["setup_ms"], 2) for link in links], "rtt_ms": [round(link["rtt_ms"], 3) for link in links],
        "second_ms": [round(link["second_ms"], 3) for link in links],
        "fetch_ms_p50": statistics.median(ms for c in consumers for ms in c["fetch_ms"]),
        "per_consumer_gbps": [c["bytes"] / (c["last"] - c["first"]) / 1e9 for c in consumers],
        "aggregate_gbps": total / (last - first) / 1e9, "window_s": last - first,
        "errors": [e for c in consumers for e in c["errors"]][:5],
    }
