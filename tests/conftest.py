"""What every test may use: the ``device`` fixture (``cpu`` always, ``cuda`` where this process sees a GPU) and the
``cuda`` marker that selects the device cases (``pytest -m cuda``). Imports nothing but torch: the GPU machines that
run the ``cuda`` tests have neither vLLM nor Quart."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device in this process (the cuda case runs where one is: scripts/gpu_check.sh)"
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Where the tensors of a test that means something on a GPU live: ``cpu``, and ``cuda`` where present."""
    return request.param
