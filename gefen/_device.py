"""Where a step runs: CPU calls use threads; CUDA calls use the current stream of the
parameters' device and a device copy of the quantiser's lookup table."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from ._ext import _C

T = TypeVar("T")


def stream_of(device: torch.device) -> int | None:
    """The raw handle of ``device``'s current CUDA stream (None for the CPU): the C
    extension enqueues its kernels there, ordered with PyTorch's own work."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream


def group_by_device(entries: Iterable[T], device_of: Callable[[T], torch.device]) -> dict:
    """``entries`` split by device, each list in its original order."""
    out: dict[torch.device, list[T]] = {}
    for e in entries:
        out.setdefault(device_of(e), []).append(e)
    return out


class DeviceTables:
    """Device copies of one quantiser's lookup table, made on first use per device."""

    def __init__(self, quantizer):
        self.quantizer = quantizer
        self._tables: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor | None:
        """The table on ``device`` (None for the CPU, which reads the quantiser itself)."""
        if device.type == "cpu":
            return None
        table = self._tables.get(device)
        if table is None:
            host = torch.frombuffer(bytearray(self.quantizer.table_bytes()), dtype=torch.uint8)
            table = host.to(device)
            self._tables[device] = table
        return table


def code_map(table: bytes, device: torch.device):
    """A 256-entry code map for codes on ``device``: bytes on the CPU, else a tensor."""
    if device.type == "cpu":
        return table
    return torch.frombuffer(bytearray(table), dtype=torch.uint8).to(device)


def has_cuda_kernels() -> bool:
    """Whether this build of gefen can step CUDA parameters."""
    return bool(_C.built_with_cuda())
