"""Cases run on every rank of a spawned gloo group (see dist_harness.py and
test_sharded.py). Each returns plain data for the test process to assert on.

The oracle of every parity case is the same optimizer on one process: every rank
builds the full model from one seed, steps a plain-tensor copy with the full
gradients, and compares it with the sharded run (DESIGN.md §1: sharding does not
change periods, codebook or — up to reduction order — values).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import gefen

# ---------------------------------------------------------------- helpers


def make_mesh(shape: tuple[int, ...], ranks: list[int] | None = None) -> DeviceMesh:
    """A CPU mesh of ``shape`` over ``ranks`` (default: the whole world); a 2-D one is
    an HSDP mesh (replicate, shard)."""
    if ranks is None:
        names = ("replicate", "shard") if len(shape) == 2 else None
        return init_device_mesh("cpu", shape, mesh_dim_names=names)
    return DeviceMesh("cpu", torch.tensor(ranks).view(shape))


def placements_of(spec: str, ndim: int):
    """'shard' -> Shard(0) on every dim but the first of an HSDP mesh; 'replicate' ->
    Replicate() everywhere; 'hsdp' -> (Replicate(), Shard(0))."""
    if spec == "replicate":
        return (Replicate(),) * ndim
    if spec == "hsdp":
        return (Replicate(), Shard(0))
    return (Shard(0),) * 1 if ndim == 1 else (Replicate(),) * (ndim - 1) + (Shard(0),)


def full_tensors(shapes, seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(shapes):
        t = torch.randn(s, generator=gen, dtype=torch.float32)
        if len(s) >= 2:  # rows of different scales: structure for the period search
            t = t * torch.rand(s[0], *([1] * (len(s) - 1)), generator=gen) * (1 + i)
        out.append(t.to(dtype))
    return out


def as_full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def build(kind: str, params, options: dict):
    """An optimizer of ``kind`` over named parameters."""
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    if kind == "gefen":
        return gefen.Gefen(named, lr=options.get("lr", 3e-3), weight_decay=0.01,
                           **{k: v for k, v in options.items() if k != "lr"})
    if kind == "muon":
        return gefen.GefenMuon(named, lr=options.get("lr", 2e-2),
                               **{k: v for k, v in options.items() if k != "lr"})
    if kind == "adamw":
        return torch.optim.AdamW(named, lr=options.get("lr", 3e-3))
    raise ValueError(kind)


def compare_state(ref_opt, opt, ref_params, params) -> dict:
    """Differences between a one-process optimizer and a sharded one (after gathering):
    exact equality of the discrete state, the largest differences of the rest."""
    out = {"periods_equal": True, "codebook_equal": True, "codes_equal_frac": 1.0,
           "max_param_diff": 0.0, "max_state_diff": 0.0, "steps_equal": True}
    codes_total = codes_same = 0
    for rp, p in zip(ref_params, params):
        out["max_param_diff"] = max(out["max_param_diff"], float((as_full(p).float() - rp.float()).abs().max()))
        rs, st = ref_opt.state.get(rp, {}), opt.state.get(p, {})
        if set(rs) != set(st):
            out["keys"] = (sorted(rs), sorted(st))
            out["periods_equal"] = False
            continue
        for k, v in rs.items():
            w = st[k]
            if not isinstance(v, torch.Tensor):
                if k in ("period",):
                    out["periods_equal"] &= v == w
                elif k in ("step", "global_step"):
                    out["steps_equal"] &= v == w
                continue
            wf = as_full(w)
            if k == "codebook":
                out["codebook_equal"] &= torch.equal(v, wf.cpu())
            elif k == "codes":
                codes_total += v.numel()
                codes_same += int((v == wf).sum())
            else:
                if v.shape != wf.shape:
                    out["shape_mismatch"] = (k, tuple(v.shape), tuple(wf.shape))
                    continue
                out["max_state_diff"] = max(out["max_state_diff"], float((v - wf).abs().max()) if v.numel() else 0.0)
    if codes_total:
        out["codes_equal_frac"] = codes_same / codes_total
    return out


def parity(rank, world, kind, shapes, spec, steps, options, mesh_shape=None, dtype="float32"):
    """``kind`` on DTensor parameters placed by ``spec`` vs the one-process run."""
    dt = getattr(torch, dtype)
    mesh_shape = mesh_shape or (world,)
    mesh = make_mesh(tuple(mesh_shape))
    full = full_tensors(shapes, seed=1, dtype=dt)
    ref_params = [torch.nn.Parameter(t.clone()) for t in full]
    params = [
        torch.nn.Parameter(distribute_tensor(t.clone(), mesh, placements_of(spec, mesh.ndim)))
        for t in full
    ]
    ref_opt, opt = build(kind, ref_params, options), build(kind, params, options)
    for step in range(steps):
        grads = full_tensors(shapes, seed=100 + step, dtype=dt)
        for rp, p, g in zip(ref_params, params, grads):
            rp.grad = g.clone()
            p.grad = distribute_tensor(g.clone(), mesh, p.placements)
        ref_opt.step()
        opt.step()
    res = compare_state(ref_opt, opt, ref_params, params)
    res["collectives_last_step"] = opt.comm_stats.collectives if hasattr(opt, "comm_stats") else None
    res["comm_kinds_last_step"] = dict(opt.comm_stats.by_kind) if hasattr(opt, "comm_stats") else None
    res["local_rows"] = [tuple(p.to_local().shape) for p in params]
    return res


# ------------------------------------------------------------- layouts


def mixed_meshes(rank, world, kind, options):
    """Parameters on two meshes at once (a 1-D mesh over the world and an HSDP 2-D
    mesh over the same ranks) and one plain tensor, vs one process."""
    m1 = make_mesh((world,))
    m2 = make_mesh((2, world // 2))
    shapes = [(6, 4), (5, 8), (9, 4)]
    full = full_tensors(shapes, seed=3)
    ref_params = [torch.nn.Parameter(t.clone()) for t in full]
    params = [
        torch.nn.Parameter(distribute_tensor(full[0].clone(), m1, (Shard(0),))),
        torch.nn.Parameter(distribute_tensor(full[1].clone(), m2, (Replicate(), Shard(0)))),
        torch.nn.Parameter(full[2].clone()),  # plain: replicated like DDP
    ]
    ref_opt, opt = build(kind, ref_params, options), build(kind, params, options)
    for step in range(3):
        grads = full_tensors(shapes, seed=200 + step)
        for rp, p, g in zip(ref_params, params, grads):
            rp.grad = g.clone()
            p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements) if isinstance(p, DTensor) else g.clone()
        ref_opt.step()
        opt.step()
    return compare_state(ref_opt, opt, ref_params, params)


def subgroup_mesh(rank, world, kind):
    """An optimizer whose mesh covers ranks 0 and 1 only; the other ranks never step
    it (its agreement group is created among the members alone)."""
    mesh = make_mesh((2,), ranks=[0, 1])  # every rank constructs the mesh
    if rank > 1:
        return None
    shapes = [(5, 4), (3, 6)]
    full = full_tensors(shapes, seed=4)
    ref_params = [torch.nn.Parameter(t.clone()) for t in full]
    params = [torch.nn.Parameter(DTensor.from_local(t.clone().chunk(2)[rank] if t.shape[0] > 1 else t.clone(), mesh, (Shard(0),), run_check=False, shape=t.shape, stride=t.stride())) for t in full]
    ref_opt, opt = build(kind, ref_params, {}), build(kind, params, {})
    for step in range(2):
        grads = full_tensors(shapes, seed=300 + step)
        for rp, p, g in zip(ref_params, params, grads):
            rp.grad = g.clone()
            p.grad = DTensor.from_local(g.clone().chunk(2)[rank], mesh, (Shard(0),), run_check=False, shape=g.shape, stride=g.stride())
        ref_opt.step()
        opt.step()
    return compare_state(ref_opt, opt, ref_params, params)


def unsupported_placement(rank, world):
    """Shard(1) is refused with NotImplementedError naming the parameter and placement."""
    mesh = make_mesh((world,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, (Shard(1),)))
    try:
        gefen.Gefen([("w", p)], lr=1e-3)
    except NotImplementedError as exc:
        return str(exc)
    return None


def host_shards_on_an_accelerator_mesh(rank, world, kinds):
    """FSDP2's CPUOffloadPolicy: the mesh is a CUDA mesh, the shards live on the host.
    Played on CPU by relabelling a gloo mesh "cuda" once the parameters and gradients
    exist (the collectives follow the backend, not the label). Every state tensor the
    optimizer makes (step, state_dict, DCP's prepare_load) must stay beside its shard,
    where DTensor.from_local would copy it to the label's device (and fail here).
    The relabelled mesh outlives the case in torch's caches: run it in a pool of its own."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import gefen.dcp

    mesh = make_mesh((world,))
    shapes = [(5, 4), (16, 12)]

    def model_and_opt(kind):
        model = torch.nn.Module()
        for i, p in enumerate(_sharded_params(mesh, shapes, seed=11)):
            model.register_parameter(f"p{i}", p)
        return model, build(kind, list(model.parameters()), {})

    def host_devices(tensors) -> list:
        return sorted({str(t.to_local().device) for t in tensors if isinstance(t, DTensor)})

    runs = {kind: (model_and_opt(kind), model_and_opt(kind)[1]) for kind in kinds}
    grads = [[distribute_tensor(g, mesh, (Shard(0),)) for g in full_tensors(shapes, seed=400 + step)]
             for step in range(2)]
    mesh._device_type = "cuda"  # (a read-only property: its backing field)
    out = {}
    for kind, ((model, opt), fresh) in runs.items():
        for step_grads in grads:
            for p, g in zip(model.parameters(), step_grads):
                p.grad = g
            opt.step()
        gefen.dcp.prepare_load(fresh, get_optimizer_state_dict(model, opt))
        out[kind] = {
            "state": host_devices(v for st in opt.state.values() for v in st.values()),
            "exported": host_devices(v for st in opt.state_dict()["state"].values() for v in st.values()),
            "prepared": host_devices(v for st in fresh.state.values() for v in st.values()),
            "global_step": opt._global_step,
        }
    return out


# ------------------------------------------------------------ failures


def attempt(fn):
    """``fn()``'s error as (type name, message), or None when it returned."""
    try:
        fn()
    except Exception as exc:
        return (type(exc).__name__, str(exc))
    return None


def _sharded_params(mesh, shapes, seed):
    return [torch.nn.Parameter(distribute_tensor(t, mesh, (Shard(0),))) for t in full_tensors(shapes, seed)]


def _snapshot(opt, params):
    snap = {"params": [p.to_local().clone() for p in params], "state": {}, "global_step": opt._global_step}
    for i, p in enumerate(params):
        st = opt.state.get(p, {})
        snap["state"][i] = {k: (v.to_local().clone() if isinstance(v, DTensor) else
                                v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
    return snap


def _unchanged(opt, params, snap) -> bool:
    now = _snapshot(opt, params)
    if now["global_step"] != snap["global_step"]:
        return False
    if not all(torch.equal(a, b) for a, b in zip(now["params"], snap["params"])):
        return False
    for i in snap["state"]:
        a, b = snap["state"][i], now["state"][i]
        if set(a) != set(b):
            return False
        for k in a:
            if isinstance(a[k], torch.Tensor):
                if not torch.equal(a[k], b[k]):
                    return False
            elif a[k] != b[k]:
                return False
    return True


def divergence(rank, world, what, kind="gefen"):
    """One rank builds a different optimizer (order, shape, option) or gives gradients
    to different parameters: every rank raises the same RankDivergenceError before
    anything changes (after one good step, so there is state to protect)."""
    mesh = make_mesh((world,))
    shapes = [(6, 4), (4, 8)]
    params = _sharded_params(mesh, shapes, seed=5)
    named = [("a", params[0]), ("b", params[1])]
    options = {}
    if rank == 1 and what == "order":
        named = named[::-1]
    if rank == 1 and what == "option":
        options = {"factored": False} if kind == "gefen" else {"sharded_mode": "approx"}
    opt = (gefen.Gefen(named, lr=1e-3, **options) if kind == "gefen"
           else gefen.GefenMuon(named, lr=1e-2, **options))
    if what in ("order", "option"):  # differs from the start: the first step raises
        for p in params:
            p.grad = distribute_tensor(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)), mesh, (Shard(0),))
        snap = _snapshot(opt, params)
        return {"error": attempt(opt.step), "unchanged": _unchanged(opt, params, snap)}
    # what == "grad": the same optimizer, but rank 1 gives no gradient to "b"
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)), mesh, (Shard(0),))
    opt.step()
    snap = _snapshot(opt, params)
    if rank == 1:
        params[1].grad = None
    return {"error": attempt(opt.step), "unchanged": _unchanged(opt, params, snap)}


def rank_fails(rank, world, where, kind="gefen"):
    """One rank fails inside step (a bad gradient, or an error in the statistics phase):
    every rank raises, nobody hangs, nothing changes."""
    mesh = make_mesh((world,))
    params = _sharded_params(mesh, [(6, 4), (4, 8)], seed=6)
    opt = (gefen.Gefen([("a", params[0]), ("b", params[1])], lr=1e-3) if kind == "gefen"
           else gefen.GefenMuon([("a", params[0]), ("b", params[1])], lr=1e-2))
    gen = torch.Generator().manual_seed(10)
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), mesh, (Shard(0),))
    opt.step()
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), mesh, (Shard(0),))
    snap = _snapshot(opt, params)
    if rank == 1 and where == "grad":  # a gradient not sharded like its parameter
        params[1].grad = DTensor.from_local(torch.randn(params[1].shape), mesh, (Replicate(),), run_check=False)
    if rank == 1 and where == "stats":
        from gefen import _C

        class Broken:
            def __init__(self, items):
                self._plan = _C.AdamStep(items)

            def __getattr__(self, name):  # (factored, momentum_in_stats)
                return getattr(self._plan, name)

            def factored_stats(self, *a):
                raise RuntimeError("simulated failure in the statistics phase")

            def update(self, *a):
                self._plan.update(*a)

            def step(self, *a):
                self._plan.step(*a)

        import gefen.gefen as gg
        gg._C = type("C", (), {"AdamStep": Broken})
    try:
        error = attempt(opt.step)
    finally:
        if where == "stats":
            import gefen.gefen as gg
            from gefen import _C
            gg._C = _C
    return {"error": error, "unchanged": _unchanged(opt, params, snap)}


# --------------------------------------------------------------- FSDP2


def _tiny_gpt(seed: int = 0):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import _common as C

    torch.manual_seed(seed)
    return C.char_transformer(n_layer=2, d_model=32, n_head=2, ctx=16)


def _batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 256, (4, 16), generator=gen)
    return x, torch.roll(x, -1, dims=1)


def _loss(model, step):
    x, y = _batch(step)
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _make_opt(kind: str, model):
    if kind == "gefen":
        return gefen.Gefen(model.named_parameters(), lr=3e-3, weight_decay=0.1)
    if kind == "gefen-block":
        return gefen.Gefen(model.named_parameters(), lr=3e-3, weight_decay=0.1, factored=False)
    if kind.startswith("hybrid"):
        return gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer=kind.split("-")[1],
                                     sharded_mode="exact")
    raise ValueError(kind)


def fsdp_training(rank, world, kind, steps, mesh_shape=None):
    """A small GPT under FSDP2 (per block and root) vs the same model on one process,
    identical batches on every rank: losses and parameters."""
    from torch.distributed.fsdp import fully_shard

    ref = _tiny_gpt()
    model = copy.deepcopy(ref)
    mesh = make_mesh(tuple(mesh_shape or (world,)))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ref_opt, opt = _make_opt(kind, ref), _make_opt(kind, model)
    ref_losses, losses = [], []
    for step in range(steps):
        for m, o, out in ((ref, ref_opt, ref_losses), (model, opt, losses)):
            o.zero_grad()
            loss = _loss(m, step)
            loss.backward()
            o.step()
            out.append(float(loss))
    diffs = [float((p.full_tensor() - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters())]
    return {"ref_losses": ref_losses, "losses": losses, "max_param_diff": max(diffs)}



def fsdp_mixed_precision_training(rank, world, kind, steps):
    """FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (the usual
    setting) vs one process that does the same by hand: float32 master parameters
    stepped by the optimizer, a bfloat16 copy of them for the forward and backward, its
    gradients cast to float32. Identical batches on every rank: the averaged float32
    gradients are one process's, so losses and parameters must be equal bit for bit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    master = _tiny_gpt()
    model = copy.deepcopy(master)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = make_mesh((world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    ref_opt, opt = _make_opt(kind, master), _make_opt(kind, model)
    ref_losses, losses = [], []
    for step in range(steps):
        half = copy.deepcopy(master).to(torch.bfloat16)
        loss = _loss(half, step)
        loss.backward()
        for p, q in zip(master.parameters(), half.parameters()):
            p.grad = q.grad.float()
        ref_opt.step()
        ref_losses.append(float(loss))
        opt.zero_grad()
        loss = _loss(model, step)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    same = all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), master.parameters()))
    dtypes = sorted({str(p.grad.dtype) for p in model.parameters()} | {str(p.dtype) for p in model.parameters()})
    return {"ref_losses": ref_losses, "losses": losses, "same": same, "dtypes": dtypes}

def fsdp_grads_are_averaged(rank, world):
    """With identical batches on every rank, FSDP2's reduced gradient equals one
    process's (NCCL and, in torch 2.13, gloo average); a summing backend would give
    world_size times it. Gefen's parity tests rely on this."""
    from torch.distributed.fsdp import fully_shard

    ref = _tiny_gpt()
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=make_mesh((world,)))
    _loss(ref, 0).backward()
    _loss(model, 0).backward()
    ratios = []
    for p, q in zip(model.parameters(), ref.parameters()):
        g, h = p.grad.full_tensor(), q.grad
        ratios.append(float(g.norm() / h.norm()) if float(h.norm()) > 0 else 1.0)
    return ratios


def fsdp_rebind(rank, world, kind):
    """An optimizer built from named_parameters() before fully_shard, then rebound to
    the sharded parameters, trains exactly like one built after fully_shard; a rebind
    that fails on one rank raises on every rank."""
    from torch.distributed.fsdp import fully_shard

    base = _tiny_gpt()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    opt_a = _make_opt(kind, a)  # before sharding: plain parameters
    mesh = make_mesh((world,))
    for m in (a, b):
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    opt_a.rebind(a)
    opt_b = _make_opt(kind, b)
    for step in range(3):
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(a.parameters(), b.parameters()))
    try:  # after a step: refused, nothing changes
        opt_a.rebind(a)
        late = None
    except RuntimeError as exc:
        late = str(exc)
    # rank 1 alone rebinds to a model whose names are not the optimizer's: every rank
    # raises its error (one agreement), nothing changes; before, rank 1 raised alone
    # and rank 0 went on to a step whose agreement would wait for rank 1
    opt_c = _make_opt(kind, copy.deepcopy(base))
    c = copy.deepcopy(base)
    for block in c.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(c, mesh=mesh)
    before = [list(g["params"]) for g in opt_c.param_groups]
    try:
        opt_c.rebind(c if rank == 0 else torch.nn.ModuleDict({"renamed": c}))
        one_rank = None
    except ValueError as exc:
        one_rank = str(exc)
    unchanged = all(len(g["params"]) == len(b) and all(x is y for x, y in zip(g["params"], b))
                    for g, b in zip(opt_c.param_groups, before))
    return {"same": same, "late": late, "one_rank": one_rank, "unchanged": unchanged,
            "dtensors": all(isinstance(p, DTensor) for g in opt_a.param_groups for p in g["params"])}


# ------------------------------------------------------------ checkpoints


def _layout_model(layout: str, world: int, mesh_shape=None):
    """The tiny GPT laid out as asked: "plain" (one process or replicas), "fsdp"
    (Shard(0) per block and root), "hsdp" (a (2, world/2) mesh), "replicate" (FSDP2 on
    a (world, 1) mesh: every rank holds every row, replicated over the world)."""
    from torch.distributed.fsdp import fully_shard

    model = _tiny_gpt()
    if layout == "plain":
        return model
    if layout == "replicate":
        mesh_shape = (world, 1)
    mesh = make_mesh(tuple(mesh_shape) if mesh_shape else ((2, world // 2) if layout == "hsdp" else (world,)))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _ckpt_opt(kind: str, model, options: dict):
    if kind == "gefen":
        return gefen.Gefen(model.named_parameters(), lr=3e-3, weight_decay=0.1, **options)
    if kind == "muon":
        return gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer="gefen", normuon=False, **options)
    if kind.startswith("hybrid"):
        return gefen.GefenMuonHybrid(model, lr=1e-2, backup_optimizer=kind.split("-")[1], **options)
    raise ValueError(kind)


class _App:
    """Model and optimizer as one DCP Stateful (as a user writes it)."""

    def __init__(self, model, opt, flatten: bool):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model, self.opt = model, opt
        self.options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        m, o = get_state_dict(self.model, self.opt, options=self.options)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=self.options)


def _train_steps(model, opt, start: int, n: int) -> None:
    for step in range(start, start + n):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def _full_state(opt) -> dict:
    """Every state tensor gathered whole (a collective on DTensors), by (fqn, key)."""
    out = {}
    children = getattr(opt, "_children", (opt,))
    for child in children:
        for group in child.param_groups:
            names = group.get("param_names") or [str(i) for i in range(len(group["params"]))]
            for name, p in zip(names, group["params"]):
                st = child.state.get(p, {})
                for k, v in sorted(st.items()):
                    if k in ("digest_rows", "digest"):
                        continue
                    out[(name, k)] = as_full(v).detach().cpu().clone() if isinstance(v, torch.Tensor) else v
    return out


def _plain_dicts(model, opt, flatten: bool) -> dict:
    """The model's and the optimizer's state dicts side by side in one dict (no Stateful)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    return {"model": m, "optim": o}


def dcp_save(rank, world, path, kind, layout, options, flatten=False, async_save=False, mesh_shape=None,
             steps=3, more=2, stateful=True):
    """Train ``steps`` on this topology, save with DCP, continue ``more`` steps (the
    uninterrupted run). Rank 0 writes the saved global state and the final parameters
    next to the checkpoint for the loading side."""
    import torch.distributed.checkpoint as dcp

    model = _layout_model(layout, world, mesh_shape)
    opt = _ckpt_opt(kind, model, options)
    _train_steps(model, opt, 0, steps)
    state = {"app": _App(model, opt, flatten)} if stateful else _plain_dicts(model, opt, flatten)
    if async_save:
        dcp.async_save(state, checkpoint_id=path).result()
    else:
        dcp.save(state, checkpoint_id=path)
    saved = _full_state(opt)
    _train_steps(model, opt, steps, more)
    final = [as_full(p).detach().cpu().clone() for p in model.parameters()]
    if rank == 0:
        torch.save({"saved": saved, "final": final}, path + ".ref")
    return True


def dcp_load(rank, world, path, kind, layout, options, flatten=False, mesh_shape=None, steps=3, more=2,
             prepare=True, stateful=True):
    """A fresh model and optimizer on this topology: prepare_load, dcp.load, compare the
    loaded global state with the saved one, continue ``more`` steps, compare with the
    uninterrupted run."""
    import torch.distributed.checkpoint as dcp

    import gefen.dcp

    model = _layout_model(layout, world, mesh_shape)
    opt = _ckpt_opt(kind, model, options)
    if prepare:
        gefen.dcp.prepare_load(opt, path)
    try:
        if stateful:
            dcp.load({"app": _App(model, opt, flatten)}, checkpoint_id=path)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            sd = _plain_dicts(model, opt, flatten)
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                           options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    except Exception as exc:
        return {"error": (type(exc).__name__, str(exc)), "state_empty": len(opt.state) == 0 or not any(opt.state.values())}
    ref = torch.load(path + ".ref", weights_only=False)
    loaded = _full_state(opt)
    mismatch = [k for k in ref["saved"] if k not in loaded or not _same(ref["saved"][k], loaded[k])]
    extra = [k for k in loaded if k not in ref["saved"]]
    _train_steps(model, opt, steps, more)
    final = [as_full(p).detach().cpu() for p in model.parameters()]
    diff = max(float((a - b).abs().max()) for a, b in zip(final, ref["final"]))
    return {"error": None, "state_mismatch": mismatch[:5], "n_mismatch": len(mismatch), "extra": extra[:5],
            "final_diff": diff}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _storage_item(path: str, key: str):
    """(file, offset, length) of a saved tensor in a DCP checkpoint directory."""
    import os

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata()
    for index, info in md.storage_data.items():
        if index.fqn == key:
            return os.path.join(path, info.relative_path), info.offset, info.length
    raise KeyError(key)


def dcp_corrupt(rank, world, path, what, kind="gefen", layout="fsdp"):
    """Damage a checkpoint saved by dcp_save (rank 0, once), then load it into a trained
    optimizer on every rank: every rank raises, no live state changes."""
    import glob
    import os

    import torch.distributed.checkpoint as dcp

    import gefen.dcp

    if rank == 0:
        if what == "flip":  # one byte of one row of the codes of a matrix
            f, off, length = _storage_item(path, "app.optim.state.blocks.0.attn.qkv.weight.codes")
            codes = torch.load(path + ".ref", weights_only=False)["saved"][("blocks.0.attn.qkv.weight", "codes")]
            raw = codes.contiguous().view(-1).numpy().tobytes()
            with open(f, "r+b") as fh:
                fh.seek(off)
                item = fh.read(length)
                at = off + item.index(raw[:256]) + 100  # inside the tensor's data, row 3
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ 0x10]))
        elif what == "truncate":
            f = sorted(glob.glob(os.path.join(path, "*.distcp")))[0]
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) // 2)
        elif what == "missing":
            os.remove(sorted(glob.glob(os.path.join(path, "*.distcp")))[-1])
    dist.barrier()
    model = _layout_model(layout, world)
    opt = _ckpt_opt(kind, model, {})
    _train_steps(model, opt, 0, 2)
    before = _full_state(opt)
    params_before = [as_full(p).detach().clone() for p in model.parameters()]
    error = None
    try:
        gefen.dcp.prepare_load(opt, path)
        dcp.load({"app": _App(model, opt, False)}, checkpoint_id=path)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        error = (type(exc).__name__, str(exc)[:600])
    after = _full_state(opt)
    same = before.keys() == after.keys() and all(_same(before[k], after[k]) for k in before)
    return {"error": error, "optimizer_unchanged": same,
            "params_unchanged": all(torch.equal(a, as_full(p).detach()) for a, p in zip(params_before, model.parameters()))}


def dcp_other_checkpoint(rank, world, path, what):
    """Loading a checkpoint of another model or another optimizer kind: prepare_load
    raises the same clear error on every rank, before anything changes."""
    import gefen.dcp

    if what == "model":
        model = _tiny_gpt()
        with torch.no_grad():  # another model: wider blocks
            model.blocks[0].mlp.fc = torch.nn.Linear(32, 48)
            model.blocks[0].mlp.proj = torch.nn.Linear(48, 32)
        from torch.distributed.fsdp import fully_shard

        mesh = make_mesh((world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = _ckpt_opt("gefen", model, {})
    else:  # a GefenMuonHybrid reading a plain Gefen checkpoint
        model = _layout_model("fsdp", world)
        opt = _ckpt_opt("hybrid-gefen", model, {})
    try:
        gefen.dcp.prepare_load(opt, path)
    except ValueError as exc:
        return {"error": str(exc), "state_empty": not any(opt.state.values())}
    return {"error": None}


def corrupt_in_memory(rank, world, what):
    """A sharded state dict with a bad value (newer schema, wrong hyper-parameter type,
    another kind), loaded with set_state_dict on every rank: every rank raises the same
    error and nothing changes."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _layout_model("fsdp", world)
    opt = _ckpt_opt("gefen", model, {})
    _train_steps(model, opt, 0, 2)
    msd, osd = get_state_dict(model, opt)
    group = osd["param_groups"][0]
    if what == "schema":
        group["gefen_schema"] = 99
    elif what == "hparam":
        group["lr"] = "fast"
    elif what == "kind":
        group["gefen_kind"] = "gefen_muon"
    elif what == "one_rank":  # only rank 1's shard of one moment is damaged
        if rank == 1:
            st = osd["state"]["blocks.0.attn.qkv.weight"]
            st["v_row"]._local_tensor[0] = float("nan")
    before = _full_state(opt)
    try:
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        error = None
    except Exception as exc:
        error = (type(exc).__name__, str(exc)[:400])
    after = _full_state(opt)
    return {"error": error, "unchanged": all(_same(before[k], after[k]) for k in before)}


def fresh_load_without_prepare(rank, world, path):
    """dcp.load into a fresh optimizer without prepare_load: a clear error, not a
    silent restart of the moments."""
    import torch.distributed.checkpoint as dcp

    model = _layout_model("fsdp", world)
    opt = _ckpt_opt("gefen", model, {})
    try:
        dcp.load({"app": _App(model, opt, False)}, checkpoint_id=path)
    except ValueError as exc:
        return {"error": str(exc), "state_empty": not any(opt.state.values())}
    return {"error": None}



def ddp_prepare_load_names(rank, world):
    """A DDP model (names ``module.``-prefixed; DCP keys the state without it): a fresh
    optimizer built from its named_parameters() is refused by prepare_load with the hint
    to pass model=, changing nothing; with model= (DCP's own name mapping) the state
    loads and training goes on bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gefen.dcp

    base = _tiny_gpt()
    model, twin = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    opt = _ckpt_opt("gefen", model, {})
    _train_steps(model, opt, 0, 2)
    msd, osd = get_state_dict(model, opt)
    fresh = _ckpt_opt("gefen", twin, {})
    error = attempt(lambda: gefen.dcp.prepare_load(fresh, osd))
    untouched = not fresh.state
    gefen.dcp.prepare_load(fresh, osd, model=twin)
    set_state_dict(twin, fresh, model_state_dict=msd, optim_state_dict=osd)
    _train_steps(model, opt, 2, 2)
    _train_steps(twin, fresh, 2, 2)
    return {"error": error, "untouched": untouched,
            "same": all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))}

def dcp_fresh_state_dict_changes_nothing(rank, world):
    """get_optimizer_state_dict on a fresh optimizer (DCP runs a zero step) does not
    change the later trajectory."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    a, b = _layout_model("fsdp", world), _layout_model("fsdp", world)
    oa, ob = _ckpt_opt("hybrid-gefen", a, {}), _ckpt_opt("hybrid-gefen", b, {})
    sd = get_optimizer_state_dict(b, ob)
    _train_steps(a, oa, 0, 3)
    _train_steps(b, ob, 0, 3)
    return {"empty": not sd["state"], "same": all(torch.equal(p.to_local(), q.to_local())
                                                   for p, q in zip(a.parameters(), b.parameters()))}


# ------------------------------------------------------------ steady steps


def steady_steps(rank, world, factored, event, steps=7):
    """Two optimizers on copies of the same sharded parameters (uneven and empty shards,
    a replicated one), one keeping its steady steps' plans (gefen/_steady.py) and one
    never: the same bits, or the same error, after every step. ``event`` happens on rank
    1 only before step 4 (and stays): every rank must leave the kept plans together.
    Returns per step the kept side's run results and outcomes, and whether both sides
    matched."""
    from gefen import _steady

    mesh = make_mesh((world,))
    shapes = [(5, 4), (1, 4), (7,), (6, 8), (3, 4, 2), (2, 3)]
    full = full_tensors(shapes, seed=1)
    sides = []
    for keep in (True, False):
        params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, (Replicate(),) if i == 5 else (Shard(0),)))
                  for i, t in enumerate(full)]
        opt = gefen.Gefen([(f"p{i}", p) for i, p in enumerate(params)], lr=1e-2, factored=factored)
        if not keep:
            opt._keep_steady = lambda plan: None
        sides.append((params, opt))
    runs = []
    real = _steady.SteadyStep.run

    def run(self, opt, switches):
        ok = real(self, opt, switches)
        runs.append(ok)
        return ok

    _steady.SteadyStep.run = run
    out = {"runs": [], "errors": [], "same": []}
    try:
        for step in range(steps):
            grads = full_tensors(shapes, seed=100 + step)
            errors = []
            for params, opt in sides:
                for p, g in zip(params, grads):
                    p.grad = distribute_tensor(g.clone(), mesh, p.placements)
                if step >= 4 and rank == 1:
                    if event == "transposed":  # a column-major local gradient: full path, same bits
                        lg = params[3].grad._local_tensor
                        params[3].grad._local_tensor = lg.t().contiguous().t()
                    elif event == "no_grad":  # a rank without a gradient: RankDivergenceError
                        params[2].grad = None
                    elif event == "lr":  # a rank with another lr: RankDivergenceError
                        opt.param_groups[0]["lr"] = 2e-2
                    elif event == "dropped":  # a rank without kept plans (after a failure of
                        opt.__dict__.pop("_steady", None)  # its own): its agreement meets the others' try
                before = len(runs)
                errors.append(attempt(opt.step))
                if opt is sides[0][1]:
                    out["runs"].append(runs[before] if len(runs) > before else None)
            out["errors"].append(errors)
            (pa, oa), (pb, ob) = sides
            out["same"].append(_same_state(oa, pa, ob, pb))
    finally:
        _steady.SteadyStep.run = real
    return out


def _same_state(oa, pa, ob, pb) -> bool:
    """Bit-equal local parameters and state of two optimizers over parallel parameters."""
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    for a, b in zip(pa, pb):
        if not torch.equal(local(a).view(torch.uint8), local(b).view(torch.uint8)):
            return False
        sa, sb = oa.state.get(a, {}), ob.state.get(b, {})
        if set(sa) != set(sb):
            return False
        for k in sa:
            x, y = sa[k], sb[k]
            if isinstance(x, torch.Tensor):
                x, y = local(x), local(y)
                if x.dtype != y.dtype or not torch.equal(x, y):
                    return False
            elif x != y:
                return False
    return oa._global_step == ob._global_step
