"""Cases of test_load_agreement.py (run inside spawned gloo ranks, see dist_harness.py):
ranks whose loads differ or are malformed on one rank only. Each load must raise the
same error on every rank and leave the optimizer exactly as it was (DESIGN.md §5:
validate → agree → convert → install); a good load and a step must work after it.
"""

from __future__ import annotations

import torch
from dist_cases import _snapshot, _unchanged, attempt, make_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import gefen

#: Uneven row shards over two ranks, a 1-D parameter, and the last one replicated.
SHAPES = [(8, 6), (5, 4), (7,), (6, 6), (4, 6)]
NAMES = [f"p{i}" for i in range(len(SHAPES))]
REPLICATED = len(SHAPES) - 1


def _params(mesh, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(SHAPES):
        placement = Replicate() if i == REPLICATED else Shard(0)
        out.append(torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen), mesh, (placement,))))
    return out


def _opt(params, **options) -> gefen.Gefen:
    return gefen.Gefen(list(zip(NAMES, params)), lr=1e-2, weight_decay=0.1, **options)


def _train(opt, params, steps: int, seed: int) -> None:
    """``steps`` steps with gradients drawn from ``seed`` (the same on every rank)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
    for p in params:
        p.grad = None


def _after(opt, params, sd, snap, load) -> dict:
    """What every case reports: the load's error, whether nothing changed, and whether
    a good load (``sd``) and a step work after it."""
    error = attempt(load)
    unchanged = _unchanged(opt, params, snap)
    good = attempt(lambda: opt.load_state_dict(sd))
    step = attempt(lambda: _train(opt, params, 1, 9))
    return {"error": error, "unchanged": unchanged, "good_load": good, "step": step}


def divergent_load(rank, world, what):
    """Every rank loads a valid state dict, but rank 1's differs from rank 0's in a
    replicated part: ``data`` (another run: its codebook), ``steps`` (one more step),
    ``lr`` (a saved hyper-parameter), ``param_step`` (one parameter's step), ``v_col``
    (a factored parameter's replicated column moment), ``replicated_rows`` (the rows
    of a parameter every rank holds whole)."""
    mesh = make_mesh((world,))
    pa, pb, pc = _params(mesh), _params(mesh), _params(mesh)
    oa, ob, oc = _opt(pa), _opt(pb), _opt(pc)
    _train(oa, pa, 3, 0)
    _train(ob, pb, 4 if what == "steps" else 3, 5 if what == "data" else 0)
    _train(oc, pc, 2, 7)
    sd = oa.state_dict()
    mine = sd
    od = None
    if what in ("v_col", "replicated_rows"):  # changed in a copy (on every rank: a load agrees)
        od = _opt(_params(mesh))
        od.load_state_dict(sd)
    if rank == 1:
        if what in ("data", "steps"):
            mine = ob.state_dict()
        elif what == "lr":
            mine = oa.state_dict()
            mine["param_groups"][0]["lr"] = 2e-2
        elif what == "param_step":
            mine = oa.state_dict()
            mine["state"][0]["step"] -= 1
        elif od is not None:  # one value changed; the copy's state dict has fresh digests
            key = od.param_groups[0]["params"][0 if what == "v_col" else REPLICATED]
            local = od.state[key]["v_col" if what == "v_col" else "codes"].to_local()
            local.view(-1)[0] = local.view(-1)[0] + 1
            mine = od.state_dict()
    snap = _snapshot(oc, pc)
    return _after(oc, pc, sd, snap, lambda: oc.load_state_dict(mine))


def local_shard_shape(rank, world, field):
    """Rank 1's state dict holds a DTensor whose global shape is right but whose local
    shard is not: the right element count in another shape (``codes``, ``magnitude``,
    ``vmean``), or too few rows (``v_row``)."""
    mesh = make_mesh((world,))
    factored = field != "vmean"
    pa, pc = _params(mesh), _params(mesh)
    oa, oc = _opt(pa, factored=factored), _opt(pc, factored=factored)
    _train(oa, pa, 3, 0)
    _train(oc, pc, 2, 7)
    sd = oa.state_dict()
    mine = oa.state_dict()
    if rank == 1:
        t = mine["state"][0][field]  # p0: (8, 6), four rows on each rank
        lt = t._local_tensor
        t._local_tensor = lt.reshape(lt.shape[0] // 2, -1).clone() if lt.dim() == 2 else lt[:1].clone()
    snap = _snapshot(oc, pc)
    return _after(oc, pc, sd, snap, lambda: oc.load_state_dict(mine))


def convert_order(rank, world, order):
    """A block-form state dict loaded into a factored optimizer (a conversion: one
    reduction per parameter) where rank 1's state dict lists its entries in ``order``:
    the replicated ``v_col`` of every parameter, gathered from every rank."""
    mesh = make_mesh((world,))
    pa, pb = _params(mesh), _params(mesh)
    oa = _opt(pa, factored=False, period="row")  # one block per row: equal-sized reductions
    ob = _opt(pb, factored=True, period="row")
    _train(oa, pa, 3, 0)
    _train(ob, pb, 2, 7)
    sd = oa.state_dict()
    if order == "reverse" and rank == 1:
        sd["state"] = dict(reversed(list(sd["state"].items())))
    error = attempt(lambda: ob.load_state_dict(sd))
    v_cols = {}
    for name, p in zip(NAMES, pb):
        st = ob.state.get(p, {})
        if "v_col" in st:
            local = st["v_col"].to_local().clone()
            every = [torch.zeros_like(local) for _ in range(world)]
            torch.distributed.all_gather(every, local)
            v_cols[name] = [t.tolist() for t in every]
    step = attempt(lambda: _train(ob, pb, 1, 9))
    return {"error": error, "v_cols": v_cols, "step": step}
