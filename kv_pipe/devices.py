"""Devices: one notion of "this device", and the two copies between a GPU and pinned host memory the pipe makes.

``torch.device("cuda")`` and ``torch.device("cuda:0")`` name the same GPU but compare unequal, so every device the
stack keeps or compares goes through ``canonical`` first (``cuda`` -> ``cuda:<current index>``, ``cpu:0`` -> ``cpu``).

The Transfer Engine moves host memory over TCP (device memory pays only with RDMA's GPUDirect), so a device tensor
is staged through pinned host memory. Neither copy synchronizes the device or a stream: ``to_host`` waits only for an
event recorded after the copy on the caller's stream (the work queued there before it produces the tensor), and
``to_device`` is queued on the caller's stream and returns at once (torch's pinned-memory allocator keeps the host
bytes until the copy has run).
"""

from __future__ import annotations

import torch


def canonical(device: str | torch.device) -> torch.device:
    """``device`` with its index made explicit: ``cuda`` is the current CUDA device, ``cpu`` has none."""
    d = device if isinstance(device, torch.device) else torch.device(device)
    if d.type == "cpu":
        return torch.device("cpu")
    if d.type == "cuda" and d.index is None:
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!s}: CUDA is not available in this process")
        return torch.device("cuda", torch.cuda.current_device())
    return d


def same_device(a: str | torch.device, b: str | torch.device) -> bool:
    return canonical(a) == canonical(b)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host tensor with ``t``'s bytes (``t`` itself if it is on the host): for a CUDA tensor, a pinned copy made on
    the caller's current stream, returned once an event recorded after it has completed."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.device(t.device):
        stream = torch.cuda.current_stream(t.device)
        host.copy_(t, non_blocking=True)  # queued on ``t``'s device's current stream
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()
    return host


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Host memory a CUDA copy can read without staging (from torch's caching pinned-memory allocator)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def to_device(host: torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """``host``'s bytes on ``device``: in ``out``'s first bytes if it is large enough (a view of it), else in a new
    tensor. Queued on the caller's current stream: work queued there afterwards sees them."""
    nbytes = host.numel() * host.element_size()
    if out is not None and 0 < nbytes <= out.numel() * out.element_size():
        dst = out.reshape(-1).view(torch.uint8)[:nbytes].view(host.dtype).view(host.shape)
    else:
        dst = torch.empty(host.shape, dtype=host.dtype, device=device)
    if host.numel():
        dst.copy_(host, non_blocking=True)
    return dst
