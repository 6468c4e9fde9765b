"""``gefen.dcp.prepare_load`` and a load that fails (DESIGN.md §5), on spawned gloo groups:
a trained optimizer stays exactly as it was and its next step works (prepare_load left
it steppable: it allocated nothing); a fresh one keeps refusing to step, with the same
message, until a good load has filled the state prepare_load allocated. On one process:
the same for in-memory checkpoints, and a trained optimizer with a parameter that never
had state is guarded once prepare_load has allocated that parameter's placeholders.
Also: matching by name (an optimizer without names, with ``model=``; names through
torch.compile and activation checkpointing; another model's checkpoint; another
optimizer's), and on 2 ranks a full state dict only rank 0 holds
(``broadcast_from_rank0``) and ranks that would prepare different state (one agreement:
every rank raises)."""

import os
import re

import dist_cases as D
import dist_cases_prepare as P
import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import gefen.dcp

# Gefen; and the hybrid with an AdamW backup: GefenMuon for the matrices (the corrupt
# rows are GefenMuon's codes) and torch's AdamW, whose live moments prepare_load must keep
KINDS = ["gefen", "hybrid-adamw"]


@pytest.fixture(scope="module")
def checkpoints(gloo_pools, tmp_path_factory):
    """Per kind: a checkpoint saved on 2 ranks after 3 steps, and a copy with one
    flipped byte in the codes of a matrix."""
    root = tmp_path_factory.mktemp("prepare")
    out = {}
    for kind in KINDS:
        good, bad = os.path.join(root, f"{kind}-good"), os.path.join(root, f"{kind}-bad")
        gloo_pools(2).run(D.dcp_save, good, kind, "fsdp", {})
        gloo_pools(2).run(P.copy_and_flip, good, bad)
        out[kind] = good, bad
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_trained_optimizer_steps_after_a_failed_load(gloo_pools, checkpoints, kind):
    _, bad = checkpoints[kind]
    res = gloo_pools(2).run(P.warm_prepare_then_bad_load, bad, kind)
    for r in res:
        assert r["error"] is not None and "digest" in r["error"][1], r  # caught on every rank
        assert r["unchanged"], r
        assert not any(r["flags"]), r  # nothing was allocated: nothing to guard
        assert r["step_error"] is None, r
        assert r["same_as_twin"], r
    assert res[0]["error"] == res[1]["error"]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_fresh_optimizer_refuses_to_step_until_a_good_load(gloo_pools, checkpoints, kind):
    good, bad = checkpoints[kind]
    res = gloo_pools(2).run(P.fresh_prepare_bad_then_good, bad, good, kind)
    for r in res:
        assert r["error"] is not None and "digest" in r["error"][1], r
        assert any(r["flags"]), r
        assert r["step_error"] is not None and P.PREPARED in r["step_error"][1], r
        assert not any(r["flags_loaded"]), r
        assert r["n_mismatch"] == 0, r
        # same topology: continued training is the uninterrupted run (the hybrid's
        # Newton–Schulz in bf16 within test_checkpoint_dcp.py's tolerance)
        assert r["final_diff"] <= (0.0 if kind == "gefen" else 1e-3), r



@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_full_state_dict_broadcast_from_rank0(gloo_pools, kind):
    res = gloo_pools(2).run(P.full_state_from_rank0, kind, True)
    assert [r["held"] for r in res] == [True, False], res  # only rank 0 holds the dict
    for r in res:
        assert r["error"] is None and r["same"] and not any(r["flags"]), r


@pytest.mark.distributed
def test_prepare_load_of_different_checkpoints_raises_on_every_rank(gloo_pools):
    res = gloo_pools(2).run(P.full_state_from_rank0, "gefen", False)
    for r in res:
        assert r["error"][0] == "RankDivergenceError" and "broadcast_from_rank0=True" in r["error"][1], r
        assert r["untouched"] and not any(r["flags"]), r
    assert res[0]["error"] == res[1]["error"]

# ------------------------------------------------------------------ one process


def _opt(kind, model):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind == "gefen-muon":
        return gefen.GefenMuon([(n, p) for n, p in model.named_parameters() if p.dim() == 2], lr=1e-2)
    return D._ckpt_opt(kind, model, {})


def _trained(kind, steps=2, skip=None):
    model = D._tiny_gpt()
    opt = _opt(kind, model)
    for step in range(steps):
        opt.zero_grad()
        D._loss(model, step).backward()
        if skip is not None:
            dict(model.named_parameters())[skip].grad = None  # never gets state
        opt.step()
    return model, opt


def _flags(opt):
    return [bool(c.__dict__.get("_prepared")) for c in (opt, *getattr(opt, "_children", ()))]


@pytest.mark.parametrize("kind", ["gefen", "gefen-muon", "hybrid-adamw", "hybrid-gefen"])
def test_prepare_load_leaves_a_trained_optimizer_as_it_was(kind):
    """Live state of the saved layout: nothing allocated, nothing zeroed (the hybrid's
    AdamW moments were), no guard set; the next steps are a twin's."""
    model, opt = _trained(kind)
    twin, twin_opt = _trained(kind)
    osd = get_optimizer_state_dict(model, opt)  # its own checkpoint, in memory
    before = D._full_state(opt)
    gefen.dcp.prepare_load(opt, osd)
    after = D._full_state(opt)
    assert before.keys() == after.keys() and all(D._same(before[k], after[k]) for k in before)
    assert not any(_flags(opt))
    D._train_steps(model, opt, 2, 2)
    D._train_steps(twin, twin_opt, 2, 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("kind, skip", [("gefen", "lm_head.weight"), ("hybrid-adamw", "blocks.0.ln1.weight")])
def test_placeholders_for_a_parameter_without_state_are_guarded(kind, skip):
    """A trained optimizer with one parameter that never had state: prepare_load
    allocates that one's saved layout, so the optimizer refuses to step until a load."""
    model, opt = _trained(kind, skip=skip)
    twin, twin_opt = _trained(kind)
    osd = get_optimizer_state_dict(twin, twin_opt)
    gefen.dcp.prepare_load(opt, osd)
    assert any(_flags(opt))
    with pytest.raises(RuntimeError, match=re.escape(P.PREPARED)):
        D._train_steps(model, opt, 2, 1)
    model.load_state_dict(twin.state_dict())
    set_optimizer_state_dict(model, opt, osd)
    assert not any(_flags(opt))
    D._train_steps(model, opt, 2, 2)
    D._train_steps(twin, twin_opt, 2, 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))



def _unnamed_twin(kind, model, opt):
    """An optimizer of ``kind`` over ``model`` built without names: the parameters as
    ``opt`` holds them (the hybrid: its routing as two lists)."""
    if kind == "gefen":
        return gefen.Gefen(model.parameters(), lr=3e-3, weight_decay=0.1)
    if kind == "gefen-muon":
        return gefen.GefenMuon([p for p in model.parameters() if p.dim() == 2], lr=1e-2)
    params = dict(model.named_parameters())
    routes = dict(opt.parameter_routing())
    muon = [params[n] for n in params if routes[n] == "muon"]
    backup = [params[n] for n in params if routes[n] == "backup"]
    return gefen.GefenMuonHybrid(muon, backup, lr=1e-2, backup_optimizer=kind.split("-")[1])


@pytest.mark.parametrize("kind", ["gefen", "gefen-muon", "hybrid-adamw"])
def test_checkpoint_under_names_the_optimizer_lacks_raises(kind):
    """A checkpoint keyed by the model's names into an optimizer built without names
    (``model.parameters()``): prepare_load used to match nothing and return, and the load
    then asked for the prepare_load that had just run. It raises, naming ``model=``, before
    anything changes; with ``model=`` the load restores the state exactly."""
    model, opt = _trained(kind)
    osd = get_optimizer_state_dict(model, opt)
    twin = D._tiny_gpt()
    twin.load_state_dict(model.state_dict())
    fresh = _unnamed_twin(kind, twin, opt)
    with pytest.raises(ValueError, match=r"without parameter names .*pass model="):
        gefen.dcp.prepare_load(fresh, osd)
    assert len(fresh.state) == 0 and not any(_flags(fresh))
    gefen.dcp.prepare_load(fresh, osd, model=twin)
    set_optimizer_state_dict(twin, fresh, osd)
    assert not any(_flags(fresh))
    D._train_steps(model, opt, 2, 2)
    D._train_steps(twin, fresh, 2, 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_checkpoint_of_another_model_raises_in_prepare_load():
    """A named optimizer and a checkpoint with no name in common: raises there."""
    model, opt = _trained("gefen")
    osd = get_optimizer_state_dict(model, opt)
    renamed = torch.nn.ModuleDict({"other": D._tiny_gpt()})
    fresh = gefen.Gefen(renamed.named_parameters(), lr=3e-3)
    with pytest.raises(ValueError, match="another model"):
        gefen.dcp.prepare_load(fresh, osd)
    assert len(fresh.state) == 0 and not any(_flags(fresh))


@pytest.mark.parametrize("kind", ["gefen", "gefen-muon", "hybrid-gefen"])
def test_another_optimizers_checkpoint_raises_naming_it(kind):
    """torch AdamW's checkpoint of the same model into a gefen optimizer (swapping the
    optimizer and resuming): the names match but the state is another kind's. It used to
    say the names did not match ("another model?"); it says whose state it is, before
    anything changes."""
    model, adamw = _trained("adamw")
    osd = get_optimizer_state_dict(model, adamw)
    fresh = _opt(kind, model)
    with pytest.raises(ValueError, match=r"another optimizer's state .*torch's AdamW"):
        gefen.dcp.prepare_load(fresh, osd, model=model)
    assert len(fresh.state) == 0 and not any(_flags(fresh))


def test_gefen_checkpoint_into_torch_adamw_raises_naming_it():
    model, opt = _trained("gefen")
    osd = get_optimizer_state_dict(model, opt)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"another optimizer's state .*a gefen optimizer"):
        gefen.dcp.prepare_load(adamw, osd, model=model)
    assert len(adamw.state) == 0


def _wrapped_mlp(wrapper):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    if wrapper == "checkpointed":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model[0] = checkpoint_wrapper(model[0])
    elif wrapper == "compiled":
        model = torch.compile(model, backend="eager")
    return model


@pytest.mark.parametrize("saved, loaded", [("compiled", "compiled"), ("plain", "compiled"),
                                           ("checkpointed", "checkpointed"), ("compiled", "plain")])
@pytest.mark.parametrize("names", ["named", "model="])
def test_prepare_load_matches_names_through_wrappers(saved, loaded, names):
    """torch.compile (``_orig_mod.``) and activation checkpointing
    (``_checkpoint_wrapped_module.``) add components to ``named_parameters()`` that DCP's
    state-dict helpers drop: prepare_load matches the checkpoint's names all the same, from
    the optimizer's names or through ``model=`` (torch's own mapping), and training goes on
    bit for bit. Before, a fresh optimizer of a compiled or checkpoint-wrapped model could
    not be prepared ("another model?")."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    def step(model, opt):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    model = _wrapped_mlp(saved)
    opt = gefen.Gefen(model.named_parameters(), lr=1e-2)
    for _ in range(3):
        step(model, opt)
    msd, osd = get_state_dict(model, opt)
    twin = _wrapped_mlp(loaded)
    fresh = gefen.Gefen(twin.named_parameters() if names == "named" else twin.parameters(), lr=1e-2)
    gefen.dcp.prepare_load(fresh, osd, model=twin if names == "model=" else None)
    set_state_dict(twin, fresh, model_state_dict=msd, optim_state_dict=osd)
    for _ in range(2):
        step(model, opt)
        step(twin, fresh)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
