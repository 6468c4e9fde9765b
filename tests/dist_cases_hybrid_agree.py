"""Cases for test_hybrid_agreement.py, run on every rank of a spawned gloo group: a
``GefenMuonHybrid(backup_optimizer="adamw")`` whose AdamW half differs on one rank (a
learning rate, a missing gradient, a step counter; a loaded state dict's lr or step)
makes every rank raise the same error before anything changes, and the next good step
(or load) works on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from bitsnap import bits, same_bits
from dist_cases import _layout_model, _loss, _sharded_params, _train_steps, attempt, make_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import gefen


def _hybrid(model):
    return gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer="adamw", sharded_mode="exact")


def _snapshot(opt):
    """Parameters, both children's state, hyper-parameters, global step and codebook."""
    out = []
    for child in opt._children:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in child.param_groups]
        params = [p for g in child.param_groups for p in g["params"]]
        out.append({
            "params": [bits(p) for p in params],
            "state": [bits(dict(child.state[p])) if p in child.state else None for p in params],
            "groups": bits(groups),
            "global_step": getattr(child, "_global_step", None),
            "codebook": bits(getattr(child, "_codebook", None)),
        })
    return out


def _same_across_ranks(params) -> bool:
    """Whether every rank holds the same (full) parameters."""
    sums = torch.tensor([float(p.detach().full_tensor().double().sum()) for p in params], dtype=torch.float64)
    every = [torch.zeros_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(every, sums)
    return all(torch.equal(every[0], s) for s in every)


def step_divergence(rank, world, what):
    """FSDP2 tiny GPT: after two good steps rank 1's AdamW half differs ("lr": its
    group's lr, "grad": a missing gradient, "step": a state step counter). Every rank
    raises; nothing changes; once rank 1 is put back, the step works everywhere."""
    model = _layout_model("fsdp", world)
    opt = _hybrid(model)
    _train_steps(model, opt, 0, 2)
    opt.zero_grad()
    _loss(model, 2).backward()
    group = opt.backup.param_groups[0]
    p = group["params"][0]
    saved = (group["lr"], p.grad, opt.backup.state[p]["step"])
    if rank == 1:
        if what == "lr":
            group["lr"] = 5e-2
        elif what == "grad":
            p.grad = None
        elif what == "step":
            opt.backup.state[p]["step"] = saved[2] + 1
    before = _snapshot(opt)
    error = attempt(opt.step)
    unchanged = same_bits(before, _snapshot(opt))
    group["lr"], p.grad, opt.backup.state[p]["step"] = saved  # put back
    ahead = _snapshot(opt)
    next_error = attempt(opt.step)
    return {"error": error, "unchanged": unchanged, "next_error": next_error,
            "next_stepped": not same_bits(ahead, _snapshot(opt)),
            "same_across_ranks": _same_across_ranks(list(model.parameters())),
            "name": group["param_names"][0],
            # the AdamW header rides on the Muon child's agreement: no collective of its own
            "hybrid_collectives": opt._comm.stats.total_collectives}


def adamw_only_missing_grad(rank, world):
    """A hybrid whose parameters all go to AdamW (no gefen child whose agreement could
    carry AdamW's header), DTensor parameters: a gradient missing on rank 1 only makes
    every rank raise; nothing changes; the next good step works."""
    mesh = make_mesh((world,))
    params = _sharded_params(mesh, [(6, 4), (5,)], seed=3)
    opt = gefen.GefenMuonHybrid([], [("embed.weight", params[0]), ("norm.bias", params[1])], lr=1e-2,
                                backup_optimizer="adamw")
    gen = torch.Generator().manual_seed(4)

    def grads():
        for q in params:
            q.grad = distribute_tensor(torch.randn(q.shape, generator=gen), mesh, (Shard(0),))

    grads()
    opt.step()
    grads()
    saved = params[1].grad
    if rank == 1:
        params[1].grad = None
    before = _snapshot(opt)
    error = attempt(opt.step)
    unchanged = same_bits(before, _snapshot(opt))
    params[1].grad = saved
    ahead = _snapshot(opt)
    next_error = attempt(opt.step)
    return {"error": error, "unchanged": unchanged, "next_error": next_error,
            "next_stepped": not same_bits(ahead, _snapshot(opt)),
            "same_across_ranks": _same_across_ranks(params), "name": "norm.bias"}


def load_divergence(rank, world, what):
    """FSDP2: rank 1 loads an AdamW half that differs ("lr": the saved backup groups'
    lr, "step": one parameter's saved step), or a Muon half that differs ("muon_lr",
    "muon_step"). Every rank raises the same error before
    either child changes; then the agreed state dict loads and the next step works."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    ma, mb = _layout_model("fsdp", world), _layout_model("fsdp", world)
    oa, ob = _hybrid(ma), _hybrid(mb)
    _train_steps(ma, oa, 0, 3)
    _train_steps(mb, ob, 0, 2)
    sd = get_optimizer_state_dict(ma, oa)
    # the parameter the error must name: AdamW's embedding, or the Muon child's first matrix
    name = "tok_embed.weight" if not what.startswith("muon") else min(
        k for k, st in sd["state"].items() if "codes" in st)
    if rank == 1:
        if what == "lr":
            for g in sd["param_groups"]:
                if g.get("role") == "backup":
                    g["lr"] = 0.5
        elif what == "step":
            st = sd["state"]["tok_embed.weight"]
            st["step"] = st["step"] + 5
        elif what == "muon_step":  # the Muon child's half: one matrix's saved step (one
            st = sd["state"][name]  # step fewer than the global step is valid on its own)
            st["step"] = st["step"] - 1
        elif what == "muon_lr":
            for g in sd["param_groups"]:
                if g.get("role") == "muon":
                    g["lr"] = 0.5
    before = _snapshot(ob)
    error = attempt(lambda: set_optimizer_state_dict(mb, ob, sd))
    unchanged = same_bits(before, _snapshot(ob))
    good_load = attempt(lambda: set_optimizer_state_dict(mb, ob, get_optimizer_state_dict(ma, oa)))
    ahead = _snapshot(ob)
    next_error = attempt(lambda: _train_steps(mb, ob, 3, 1))
    return {"error": error, "unchanged": unchanged, "good_load": good_load, "next_error": next_error,
            "next_stepped": not same_bits(ahead, _snapshot(ob)),
            "same_across_ranks": _same_across_ranks(list(mb.parameters())),
            "name": name if what != "muon_lr" else "group 0 lr"}
