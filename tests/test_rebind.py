"""optimizer.rebind(model): an optimizer built before fully_shard(model) adopts the
model's current parameters by fully qualified name, atomically, before its first step."""

import copy

import pytest
import torch

import gefen


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("make", [
    lambda m: gefen.Gefen(m.named_parameters(), lr=1e-2),
    lambda m: gefen.GefenMuonHybrid(m, lr=1e-2),
    lambda m: gefen.GefenMuonHybrid(m, lr=1e-2, backup_optimizer="adamw"),
])
def test_rebind_moves_to_the_new_parameters_by_name(make):
    old = _model()
    new = copy.deepcopy(old)
    opt = make(old)
    opt.rebind(new)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in new.parameters()}
    x = torch.randn(4, 6)
    new(x).square().sum().backward()
    before = [p.detach().clone() for p in old.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(old.parameters(), before))  # old untouched
    assert any(not torch.equal(a, b) for a, b in zip(new.parameters(), before))  # new stepped
    with pytest.raises(RuntimeError, match="only allowed before the optimizer's first step"):
        opt.rebind(old)



def _wrap(model, wrapper):
    if wrapper == "compiled":
        return torch.compile(model, backend="eager")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model[0] = checkpoint_wrapper(model[0])
    return model


@pytest.mark.parametrize("wrapper", ["compiled", "checkpointed"])
@pytest.mark.parametrize("make", [
    lambda m: gefen.Gefen(m.named_parameters(), lr=1e-2),
    lambda m: gefen.GefenMuonHybrid(m, lr=1e-2),
])
def test_rebind_finds_parameters_through_wrappers(make, wrapper):
    """torch.compile and activation checkpointing put ``_orig_mod.`` and
    ``_checkpoint_wrapped_module.`` into the names (rebind raised "is not a parameter of
    the model"): rebind matches the names without them and steps the wrapped model's
    parameters."""
    old = _model()
    new = _wrap(copy.deepcopy(old), wrapper)
    opt = make(old)
    opt.rebind(new)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in new.parameters()}
    twin = _wrap(copy.deepcopy(old), wrapper)
    twin_opt = make(twin)
    x = torch.randn(4, 6)
    for model, o in ((new, opt), (twin, twin_opt)):
        model(x).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(new.parameters(), twin.parameters()))

def test_rebind_errors_change_nothing():
    old = _model()
    opt = gefen.Gefen(old.named_parameters(), lr=1e-2)
    params = [p for g in opt.param_groups for p in g["params"]]
    wrong = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"'2.weight' has shape \(4, 8\) in the model but \(3, 8\)"):
        opt.rebind(wrong)
    other = torch.nn.Sequential(torch.nn.Linear(6, 8))
    with pytest.raises(ValueError, match="'2.weight' is not a parameter of the model"):
        opt.rebind(other)
    assert [p for g in opt.param_groups for p in g["params"]] == params
    unnamed = gefen.Gefen(old.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="needs parameter names"):
        unnamed.rebind(old)


def test_hybrid_rebind_checks_both_children_first():
    old = _model()
    opt = gefen.GefenMuonHybrid(old, lr=1e-2)
    before = [list(g["params"]) for g in opt.param_groups]
    bad = copy.deepcopy(old)
    bad[2] = torch.nn.Linear(8, 5)  # only a backup (bias) and a Muon (weight) change
    with pytest.raises(ValueError, match="has shape"):
        opt.rebind(bad)
    assert [list(g["params"]) for g in opt.param_groups] == before
