"""How GefenMuon orthogonalises row-sharded matrices (DESIGN.md §4, ``sharded_mode``).

Newton–Schulz needs a whole matrix, but the momentum (and its Newton–Schulz input) is
row-sharded like the parameter. Given the local rows of several matrices, these
functions return each matrix's orthogonalised local rows:

* ``"exact"``: every rank all-gathers the rows of the matrices it shares (one
  collective per shard group for a whole chunk of matrices) and orthogonalises them
  all; the result equals one process's.
* ``"distributed"``: each matrix gets an owner rank (greedy, largest first, by the
  Newton–Schulz cost, so the work is balanced); rows go to the owner (one
  ``all_to_all``), the owner orthogonalises, and the rows come back (a second one).
  Same result as ``"exact"``, each matrix orthogonalised once.
* ``"approx"``: each rank orthogonalises its local rows alone; no communication.

Matrices that are not sharded (plain tensors, replicated DTensors) are orthogonalised
locally in every mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ._comm import Comm
from ._views import Layout, ParamView, row_range

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    dist = None

#: Newton–Schulz of one full matrix (the group's coefficients and eps bound in).
Orthogonalizer = Callable[[ParamView, torch.Tensor], torch.Tensor]


def _all_gather(comm: Comm, out: torch.Tensor, inp: torch.Tensor, group) -> None:
    comm.stats.count("all_gather", out.numel() * out.element_size())
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _all_to_all(comm: Comm, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group) -> None:
    comm.stats.count("all_to_all", (inp.numel() + out.numel()) * inp.element_size())
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def _by_group(views: Sequence[ParamView]) -> dict[int, list[int]]:
    """Indices of the sharded views, by shard group (in view order)."""
    out: dict[int, list[int]] = {}
    for i, v in enumerate(views):
        if v.layout.sharded:
            out.setdefault(id(v.layout.shard_group), []).append(i)
    return out


def orthogonalize(
    mode: str,
    views: Sequence[ParamView],
    inputs: Sequence[torch.Tensor],
    ns: Orthogonalizer,
    comm: Comm,
) -> list[torch.Tensor | None]:
    """The orthogonalised local rows of every matrix (None for a rank with no rows)."""
    out: list[torch.Tensor | None] = [None] * len(views)
    for i, (v, x) in enumerate(zip(views, inputs)):
        if not v.layout.sharded or mode == "approx":
            out[i] = ns(v, x) if x.numel() else None
    if mode == "approx":
        return out
    for idx in _by_group(views).values():
        sub_views = [views[i] for i in idx]
        sub_inputs = [inputs[i] for i in idx]
        if mode == "exact":
            res = _exact(sub_views, sub_inputs, ns, comm)
        else:
            res = _distributed(sub_views, sub_inputs, ns, comm)
        for i, r in zip(idx, res):
            out[i] = r
    return out


def _chunk_rows(rows: int, layout: Layout) -> int:
    return math.ceil(rows / layout.shard_size) if rows else 0


def _exact(views, inputs, ns, comm) -> list[torch.Tensor | None]:
    """All-gather the (padded) rows of every matrix of one shard group in one collective;
    every rank orthogonalises every matrix and keeps its rows."""
    layout = views[0].layout
    n = layout.shard_size
    segs = [_chunk_rows(v.rows, layout) * v.cols for v in views]
    total = sum(segs)
    x0 = inputs[0]
    flat = torch.zeros(total, dtype=x0.dtype, device=x0.device)
    off = 0
    for x, seg in zip(inputs, segs):
        flat[off : off + x.numel()] = x.reshape(-1)
        off += seg
    gathered = torch.empty(n * total, dtype=x0.dtype, device=x0.device)
    _all_gather(comm, gathered, flat, layout.shard_group)
    gathered = gathered.view(n, total)
    out, off = [], 0
    for v, seg in zip(views, segs):
        chunk = seg // v.cols if v.cols else 0
        full = gathered[:, off : off + seg].reshape(n * chunk, v.cols)[: v.rows]
        o = ns(v, full)
        lo, nrows = v.row_offset, v.local_rows
        out.append(o[lo : lo + nrows] if nrows else None)
        off += seg
    return out


def owners(views: Sequence[ParamView], n: int) -> list[int]:
    """The owner (rank in the shard group) of each matrix: largest Newton–Schulz cost
    first, each to the least loaded rank (ties: the lower rank, then view order).
    A function of the global shapes only, so every rank computes the same."""
    cost = [v.rows * v.cols * min(v.rows, v.cols) for v in views]
    order = sorted(range(len(views)), key=lambda i: (-cost[i], i))
    load = [0] * n
    own = [0] * len(views)
    for i in order:
        r = min(range(n), key=lambda k: (load[k], k))
        own[i] = r
        load[r] += cost[i]
    return own


def _distributed(views, inputs, ns, comm) -> list[torch.Tensor | None]:
    """Rows to each matrix's owner, Newton–Schulz there once, rows back."""
    layout = views[0].layout
    n, me, group = layout.shard_size, layout.shard_rank, layout.shard_group
    own = owners(views, n)
    x0 = inputs[0]
    dtype, device = x0.dtype, x0.device

    def rows_of(v: ParamView, r: int) -> tuple[int, int]:
        return row_range(v.rows, Layout(layout.mesh, layout.placements, layout.shard_dim, group, n, r))

    # 1. send my rows of each matrix to its owner (grouped by owner rank)
    send = [[] for _ in range(n)]
    for x, o in zip(inputs, own):
        send[o].append(x.reshape(-1))
    in_splits = [sum(t.numel() for t in s) for s in send]
    mine = [i for i, o in enumerate(own) if o == me]
    out_splits = [sum(rows_of(views[i], r)[1] * views[i].cols for i in mine) for r in range(n)]
    recv = torch.empty(sum(out_splits), dtype=dtype, device=device)
    sendbuf = torch.cat([t for s in send for t in s]) if sum(in_splits) else torch.empty(0, dtype=dtype, device=device)
    _all_to_all(comm, recv, sendbuf, out_splits, in_splits, group)
    # 2. assemble and orthogonalise the matrices I own
    pieces = list(torch.split(recv, out_splits))
    fulls = {i: [] for i in mine}
    for r in range(n):
        off = 0
        for i in mine:
            cnt = rows_of(views[i], r)[1] * views[i].cols
            fulls[i].append(pieces[r][off : off + cnt])
            off += cnt
    results = {i: ns(views[i], torch.cat(fulls[i]).view(views[i].rows, views[i].cols)) for i in mine}
    # 3. send each rank its rows of every matrix I own; receive mine from every owner
    back = []
    for r in range(n):
        for i in mine:
            lo, cnt = rows_of(views[i], r)
            back.append(results[i][lo : lo + cnt].reshape(-1))
    in2 = [sum(rows_of(views[i], r)[1] * views[i].cols for i in mine) for r in range(n)]
    out2 = [sum(rows_of(views[i], me)[1] * views[i].cols for i, o in enumerate(own) if o == r) for r in range(n)]
    # Newton–Schulz returns the input's dtype (bf16), so both exchanges carry one type
    sendbuf2 = torch.cat(back).to(dtype) if sum(in2) else torch.empty(0, dtype=dtype, device=device)
    recv2 = torch.empty(sum(out2), dtype=dtype, device=device)
    _all_to_all(comm, recv2, sendbuf2, out2, in2, group)
    pieces2 = list(torch.split(recv2, out2))
    offs = [0] * n
    out = []
    for v, o in zip(views, own):
        cnt = v.local_rows * v.cols
        if cnt == 0:
            out.append(None)
            continue
        out.append(pieces2[o][offs[o] : offs[o] + cnt].view(v.local_rows, v.cols))
        offs[o] += cnt
    return out
