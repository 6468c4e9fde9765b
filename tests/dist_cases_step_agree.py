"""Cases for test_step_agreement.py (they run inside the spawned gloo ranks): one rank's
optimizer differs from the others' in something the step's agreement must cover -- the
codebook refresh setting, a parameter's step counter, a group option -- on the full path
and on the kept-plan (steady) path. Every rank must raise the same RankDivergenceError
naming it, change nothing, and step normally once the difference is undone."""

from __future__ import annotations

import torch
from dist_cases import _sharded_params, _snapshot, _unchanged, attempt, make_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import gefen

GEFEN_SHAPES = [(6, 4), (4, 8), (8,)]
MUON_SHAPES = [(6, 4), (4, 8)]


def _grads(params, mesh, gen) -> None:
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), mesh, (Shard(0),))


def _diverge(opt, params, what: str):
    """Make rank 1's optimizer differ; returns the undo."""
    group = opt.param_groups[0]
    if what in ("refresh", "refresh_due", "refresh_bad"):
        before = opt.codebook_refresh_every
        # after 3 steps the next is step 4: every 2 is not due then, every 3 is
        opt.codebook_refresh_every = {"refresh": 2, "refresh_due": 3, "refresh_bad": "2"}[what]
        return lambda: setattr(opt, "codebook_refresh_every", before)
    if what == "step":
        opt.state[params[0]]["step"] += 1

        def undo():
            opt.state[params[0]]["step"] -= 1
        return undo
    if what in ("factored", "period"):
        key, value = {"factored": ("factored", False), "period": ("period", "row")}[what]
        before = group[key]
        group[key] = value
        return lambda: group.__setitem__(key, before)
    raise ValueError(what)


def diverge(rank, world, kind, what, steady=True):
    """Three good steps (the second keeps its plan, the third runs it), then rank 1
    differs (``what``) before the fourth: its outcome on this rank, whether anything
    changed, and the outcome of two good steps once the difference is undone.
    ``steady=False``: no plan is kept (every step takes the full path)."""
    mesh = make_mesh((world,))
    params = _sharded_params(mesh, GEFEN_SHAPES if kind == "gefen" else MUON_SHAPES, seed=5)
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    opt = gefen.Gefen(named, lr=1e-3) if kind == "gefen" else gefen.GefenMuon(named, lr=1e-2)
    if not steady:
        opt._keep_steady = lambda plan: None
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        _grads(params, mesh, gen)
        opt.step()
    kept = opt.__dict__.get("_steady") is not None
    _grads(params, mesh, gen)
    undo = _diverge(opt, params, what) if rank == 1 else (lambda: None)
    snap = _snapshot(opt, params)
    error = attempt(opt.step)
    unchanged = _unchanged(opt, params, snap)
    undo()
    after = []
    for _ in range(2):
        _grads(params, mesh, gen)
        after.append(attempt(opt.step))
    return {"kept": kept, "error": error, "unchanged": unchanged, "after": after,
            "global_step": opt._global_step}
