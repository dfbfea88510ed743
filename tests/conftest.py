"""What every test may use: the ``device`` fixture (``cpu`` always, ``cuda`` where this process sees a GPU; the
``cuda`` marker selects the device cases: ``pytest -m cuda``), ``quick_poll``, and the hooks of the suite's tiers
(tests/tiers.py). Imports nothing but torch at start: the GPU machines that run the ``cuda`` tests have neither vLLM
nor Quart."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import tiers
from tests.devices import DEVICES


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Where the tensors of a test that means something on a GPU live: ``cpu``, and ``cuda`` where present."""
    return request.param


@pytest.fixture
def quick_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """The push sender's and receiver's threads look at close() and the clock more often: closing takes no half
    second (``pytestmark = pytest.mark.usefixtures("quick_poll")`` in the modules that run them in-process)."""
    from kv_lookup_buffer import push_receiver, push_sender

    monkeypatch.setattr(push_sender, "_POLL", 0.02)
    monkeypatch.setattr(push_receiver, "_POLL", 0.02)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A test module none of whose tests ``-m`` selects is not imported (tests/tiers.py)."""
    return True if tiers.unselected(collection_path, config) else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.check(items)
