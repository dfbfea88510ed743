"""kv_connector/worker/lookups.py, the worker's lookups in flight, on their own: answers for every lookup whatever its look
does, a deadline from when a thread takes it, and the back-off: only a producer that could not be reached is skipped
for a while, never one that was slow to answer. (Over real pipes: test_data_path.py; on real vLLM:
test_find_before_claim.py.)"""

from __future__ import annotations

import threading
import time

from kv_connector.metadata import LeaseRelease, LookupRequest
from kv_connector.source import LoadSource
from kv_connector.stats import StatsRecorder
from kv_connector.worker.lookups import Lookups
from kv_pipe import PipeTimeout

SOURCE = LoadSource(["10.0.0.1:13003"], from_params=False, same_tp=True)


def lookups(look, backoff: float = 60.0, timeout: float = 2.0) -> tuple[Lookups, StatsRecorder]:
    stats = StatsRecorder()
    return Lookups(look, lambda req: list(req.source.pipes), lambda release: None, 0, timeout, stats, backoff), stats


def ask(made: Lookups, *req_ids: str) -> dict[str, tuple[int, str]]:
    for i, req_id in enumerate(req_ids):
        made.start(LookupRequest(req_id, 100 + i, list(range(50)), SOURCE, 30.0))
    answers: dict[str, tuple[int, str]] = {}
    deadline = time.monotonic() + 10
    while len(answers) < len(req_ids) and time.monotonic() < deadline:
        answers.update({a.req_id: (a.tokens, a.error) for a in made.collect()})
        time.sleep(0.01)
    return answers


def test_an_unreachable_producer_is_skipped_for_the_back_off_a_slow_one_is_not():
    calls = []

    def unreachable(req, deadline):
        calls.append(req.req_id)
        raise PipeTimeout("could not reach the peer pipe")

    made, stats = lookups(unreachable)
    try:
        assert ask(made, "a")["a"][0] == 0
        answer = ask(made, "b")["b"]
        assert answer[0] == 0 and "not asked again" in answer[1] and calls == ["a"]
    finally:
        made.close()

    def slow(req, deadline):
        calls.append(req.req_id)
        raise TimeoutError("no answer to lookup request 1 within 2.0 s")

    calls.clear()
    made, stats = lookups(slow)
    try:
        ask(made, "c")
        ask(made, "d")
        assert calls == ["c", "d"]  # asked again: a link that is up but slow is no dead producer
        assert stats.take().data["lookup_errors"] == 2
    finally:
        made.close()


def test_every_lookup_is_answered_and_its_deadline_runs_from_when_a_thread_takes_it():
    gate = threading.Event()
    deadlines = {}

    def look(req, deadline):
        deadlines[req.req_id] = deadline - time.monotonic()
        if req.req_id.startswith("block"):
            gate.wait(5)
        if req.req_id == "bad":
            raise ValueError("malformed answer")
        return 42

    made, stats = lookups(look, timeout=2.0)
    try:
        blockers = [f"block{i}" for i in range(8)]  # every thread busy
        for i, req_id in enumerate(blockers):
            made.start(LookupRequest(req_id, i + 1, [1], SOURCE, 30.0))
        made.start(LookupRequest("queued", 99, [1], SOURCE, 30.0))
        time.sleep(0.5)  # the queued one waits for a thread
        gate.set()
        answers = ask(made, "bad")
        deadline = time.monotonic() + 5
        while len(answers) < 10 and time.monotonic() < deadline:
            answers.update({a.req_id: (a.tokens, a.error) for a in made.collect()})
            time.sleep(0.01)
        assert answers["bad"][0] == 0 and "malformed" in answers["bad"][1]
        assert answers["queued"] == (42, "") and deadlines["queued"] > 1.9  # not shortened by its wait in the queue
        data = stats.take().data
        assert data["lookups"] == 10 and data["lookup_hits"] == 9 and data["lookup_hit_tokens"] == 9 * 42
    finally:
        made.close()


def test_a_release_that_fails_is_quiet():
    def release(r: LeaseRelease) -> None:
        raise PipeTimeout("down")

    stats = StatsRecorder()
    made = Lookups(lambda req, deadline: 0, lambda req: [], release, 0, 2.0, stats, 60.0)
    try:
        made.release(LeaseRelease(5, SOURCE))
        time.sleep(0.2)
        assert made.collect() == []
    finally:
        made.close()
