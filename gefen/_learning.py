"""First-step learning shared by every gefen optimizer: periods (ALGORITHM.md §2) and the
codebook (§3). Each is phase 1 in C (statistics into a flat buffer), an optional reduction
over ranks, then phase 2 in C; one process passes ``reduce=None``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._device import stream_of
from ._ext import _C
from ._layout import rows_cols

#: Called with a float64 or int64 CPU tensor to sum in place over the ranks that share it.
Reducer = Callable[[torch.Tensor], None]


def choose_period(
    name: str,
    grad: torch.Tensor,
    global_shape: torch.Size,
    mode: str,
    nthreads: int,
    reduce: Reducer | None = None,
) -> int:
    """The period of one parameter from its (local) gradient.

    ``global_shape`` is the parameter's full shape; ``grad`` may be a row shard of it.
    """
    rows, cols = rows_cols(global_shape)
    numel = rows * cols
    if numel <= 1 or cols <= 1:
        return 1
    if mode == "row":
        return cols
    cands = torch.tensor(_C.period_candidates(cols, numel), dtype=torch.int64)
    sums = torch.zeros(len(cands), dtype=torch.float64, device=grad.device)
    counts = torch.zeros(len(cands), dtype=torch.float64, device=grad.device)
    _C.period_stats(name, grad.contiguous(), cands, sums, counts, nthreads, stream_of(grad.device))
    if reduce is not None:
        reduce(sums)
        reduce(counts)
    return _C.period_choose(cols, numel, len(global_shape), cands, sums.cpu(), counts.cpu())


def learn_codebook(
    items: Sequence[tuple[str, torch.Tensor, int]],
    nthreads: int,
    reduce: Reducer | None = None,
) -> torch.Tensor:
    """The 256-entry codebook learned from ``(name, grad, period)`` items."""
    per_device: dict[torch.device, torch.Tensor] = {}
    for name, grad, period in items:
        hist = per_device.get(grad.device)
        if hist is None:
            hist = per_device[grad.device] = torch.zeros(
                _C.HIST_BINS, dtype=torch.int64, device=grad.device
            )
        _C.histogram(name, grad.contiguous(), period, hist, nthreads, stream_of(grad.device))
    hist = torch.zeros(_C.HIST_BINS, dtype=torch.int64)
    for h in per_device.values():
        hist += h.cpu()
    if reduce is not None:
        reduce(hist)
    codebook = torch.empty(_C.CODEBOOK_SIZE, dtype=torch.float32)
    _C.codebook_solve(hist, codebook)
    return codebook
