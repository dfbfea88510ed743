"""Where a test's tensors live: ``cpu`` always, ``cuda`` where this process sees a GPU (the ``device`` fixture of
tests/conftest.py), and the marks of a case that needs a GPU. Imports nothing but torch: the GPU machines that run
the ``cuda`` tests have neither vLLM nor Quart."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device in this process (the cuda case runs where one is: scripts/gpu_check.sh)"
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
