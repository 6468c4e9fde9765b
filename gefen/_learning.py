"""First-step learning shared by every gefen optimizer: periods (ALGORITHM.md §2) and the
codebook (§3). Each is phase 1 in C (exact integer statistics into one flat buffer for
all parameters), one integer all-reduce over the optimizer's ranks, then phase 2 in C.

Both statistics are exact (int64 counts, exact sums of block variances), so the
reduced buffer — and with it every period and the codebook — is the same bit for bit
for one process and for any sharding of the rows. A replicated copy of a parameter
contributes only on its primary rank (counted once); a rank with no local rows
contributes zeros but still takes part in the collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._comm import Comm
from ._device import stream_of
from ._ext import _C
from ._layout import rows_cols
from ._views import ParamView


def counts_here(view: ParamView, leader: bool) -> bool:
    """Whether this rank's rows of ``view`` count in global statistics: the primary
    copy of a DTensor's rows; a plain tensor's on the leader rank only."""
    if view.param.numel() == 0:
        return False
    return view.layout.primary if view.layout.distributed else leader


def choose_periods(
    views: Sequence[ParamView],
    modes: Sequence[str],
    nthreads: int,
    comm: Comm,
    params: Sequence[torch.Tensor],
) -> list[int]:
    """The period of each view (``mode`` "auto" or "row"), from its local gradient and
    one integer all-reduce for all of them over the group of ``params`` (all the
    optimizer's parameters)."""
    leader = comm.leader(params)
    width = _C.PERIOD_STAT_WIDTH
    plans = []  # (view, candidates or None, offset)
    total = 0
    for v, mode in zip(views, modes):
        rows, cols = rows_cols(v.shape)
        numel = rows * cols
        if numel <= 1 or cols <= 1 or mode == "row":
            plans.append((v, None, 0))
            continue
        cands = torch.tensor(_C.period_candidates(cols, numel), dtype=torch.int64)
        plans.append((v, cands, total))
        total += len(cands) * width
    stats = torch.zeros(total, dtype=torch.int64)
    for v, cands, off in plans:
        if cands is None or not counts_here(v, leader):
            continue
        n = len(cands) * width
        g = v.grad.contiguous()
        if g.device.type == "cpu":
            _C.period_stats(v.name, g, cands, stats[off : off + n], nthreads)
        else:
            dev = torch.zeros(n, dtype=torch.int64, device=g.device)
            _C.period_stats(v.name, g, cands, dev, nthreads, stream_of(g.device))
            stats[off : off + n] = dev.cpu()
    if total:
        comm.sum_int64(params, stats, "period")
    periods = []
    for (v, cands, off), mode in zip(plans, modes):
        rows, cols = rows_cols(v.shape)
        if cands is None:
            periods.append(cols if (mode == "row" and rows * cols > 1 and cols > 1) else 1)
            continue
        n = len(cands) * width
        periods.append(_C.period_choose(cols, rows * cols, len(v.shape), cands, stats[off : off + n]))
    return periods


def learn_codebook(
    items: Sequence[tuple[ParamView, int]],
    nthreads: int,
    comm: Comm,
    params: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The 256-entry codebook learned from every ``(view, period)`` pair's gradient:
    one int64 histogram, summed over devices and (once) over the optimizer's ranks."""
    leader = comm.leader(params)
    per_device: dict[torch.device, torch.Tensor] = {}
    for v, period in items:
        if not counts_here(v, leader):
            continue
        g = v.grad.contiguous()
        hist = per_device.get(g.device)
        if hist is None:
            hist = per_device[g.device] = torch.zeros(_C.HIST_BINS, dtype=torch.int64, device=g.device)
        _C.histogram(v.name, g, period, hist, nthreads, stream_of(g.device))
    hist = torch.zeros(_C.HIST_BINS, dtype=torch.int64)
    for h in per_device.values():
        hist += h.cpu()
    comm.sum_int64(params, hist, "histogram")
    if not bool(hist.any()):
        raise ValueError(
            "gefen: the codebook cannot be learned: every gradient of this step is zero or "
            "non-finite"
        )
    codebook = torch.empty(_C.CODEBOOK_SIZE, dtype=torch.float32)
    _C.codebook_solve(hist, codebook)
    return codebook
