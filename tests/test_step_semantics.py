"""Step-level promises: a codebook refresh commits only with a successful update, and a
tensor learning rate is read once per group per step (not once per parameter)."""

import pytest
import torch
from bitsnap import assert_same_bits as _same_bits
from bitsnap import bits as _bits

import gefen
import gefen.gefen as gefen_module
from gefen import _C


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * (1 + seed)


class _FailingUpdate:
    """An AdamStep whose update fails (as an out-of-memory or a CUDA error would)."""

    def __init__(self, items):
        self._plan = _C.AdamStep(items)

    def __getattr__(self, name):  # (factored, momentum_in_stats: what the optimizer reads)
        return getattr(self._plan, name)

    def factored_stats(self, *args):
        self._plan.factored_stats(*args)

    def update(self, *args):
        raise RuntimeError("simulated failure of the update")

    def step(self, *args):  # the whole step of CPU parameters that are not row-sharded
        raise RuntimeError("simulated failure of the update")


def test_codebook_refresh_commits_only_with_a_successful_update(monkeypatch):
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-2, codebook_refresh_every=2)
    for s in range(2):
        _grads(model, s)
        opt.step()
    codebook = opt._codebook.clone()
    codes = {p: st["codes"].clone() for p, st in opt.state.items()}
    params = [p.detach().clone() for p in model.parameters()]
    _grads(model, 7)  # step 3 = 1 + 2: the codebook is relearned and the codes re-expressed
    monkeypatch.setattr(gefen_module, "_C", type("C", (), {"AdamStep": _FailingUpdate}))
    with pytest.raises(RuntimeError, match="simulated failure of the update"):
        opt.step()
    monkeypatch.undo()
    # nothing of the refresh landed: the codebook, the codes, the parameters, the counters
    assert torch.equal(opt._codebook, codebook) and opt._global_step == 2
    assert all(torch.equal(st["codes"], codes[p]) for p, st in opt.state.items())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    # and the retried step refreshes as it should
    opt.step()
    assert opt._global_step == 3 and not torch.equal(opt._codebook, codebook)
    assert all(st["codebook"] is opt._codebook for st in opt.state.values())


class _CountingLR(torch.Tensor):
    reads = 0

    def item(self):
        type(self).reads += 1
        return super().item()


@pytest.mark.parametrize("make", [
    lambda ps, lr: gefen.Gefen(ps, lr=lr),
    lambda ps, lr: gefen.GefenMuon([p for p in ps if p.dim() == 2], lr=lr),
], ids=["Gefen", "GefenMuon"])
def test_tensor_lr_is_read_once_per_group_per_step(make):
    model = _model()
    lr = torch.tensor(1e-2).as_subclass(_CountingLR)
    opt = make(list(model.parameters()), lr)
    _grads(model, 0)
    opt.step()  # the first step (learning) may read it a few times more
    _CountingLR.reads = 0
    for s in range(3):
        _grads(model, s + 1)
        opt.step()
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params >= 2
    assert _CountingLR.reads == 3 * len(opt.param_groups), _CountingLR.reads


# ------------------------------------------------------------------ robustness (audit)




@pytest.mark.parametrize("kind, shape", [("gefen", (4, 8)), ("muon", (8, 16))])
@pytest.mark.parametrize("steps", [1, 4])  # 4: Gefen has kept its steady plan
def test_self_overlapping_parameter_is_rejected_before_anything_changes(kind, shape, steps):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(*shape))
    cls = gefen.Gefen if kind == "gefen" else gefen.GefenMuon
    opt = cls([("w", w)], lr=1e-2)
    for _ in range(steps):
        w.grad = torch.randn_like(w)
        opt.step()
    w.data = torch.randn(1, shape[1]).expand(*shape)  # every row is the same memory
    w.grad = torch.randn(*shape)
    before = _bits([[w], opt.state_dict()])
    with pytest.raises(ValueError, match="parameter 'w':.*share one memory location"):
        opt.step()
    _same_bits(_bits([[w], opt.state_dict()]), before)
    w.data = w.data.clone()  # its own storage again: steps
    opt.step()


@pytest.mark.parametrize("cls", [gefen.Gefen, gefen.GefenMuon])
def test_disjoint_views_of_one_storage_are_accepted(cls):
    """Interleaved column views share a storage and their address ranges intersect, but
    no element: the exact overlap check accepts them, and they train like separate
    tensors."""
    base = torch.randn(6, 16, generator=torch.Generator().manual_seed(24))
    views = [torch.nn.Parameter(base[:, 0::2]), torch.nn.Parameter(base[:, 1::2])]
    twins = [torch.nn.Parameter(v.detach().clone()) for v in views]
    opt, twin = cls(views, lr=1e-2), cls(twins, lr=1e-2)
    gen = torch.Generator().manual_seed(25)
    for _ in range(2):
        for p, q in zip(views, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    for p, q in zip(views, twins):
        assert torch.equal(p.detach(), q.detach())


def _steps_beside_an_outlier(factored, ratio, n=256, lr=1e-3):
    """Ten steps of N(0, 1e-3^2) gradients on an n x n matrix, then one whose element
    (0, 0) is ``ratio`` times that scale: the other elements' steps of that last step,
    in units of lr."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(n, n))
    opt = gefen.Gefen([p], lr=lr, factored=factored)
    for s in range(11):
        g = torch.randn(n, n) * 1e-3
        if s == 10:
            g[0, 0] = 1e-3 * ratio
        before = p.detach().clone()
        p.grad = g
        opt.step()
    d = (p.detach() - before).abs() / lr
    d[0, 0] = 0
    return d


def test_gradient_outlier_steps_are_as_documented():
    """docs/optimizers.md ("Gradient outliers"): the factored second moment (row times
    column over the rows' mean, as Adafactor's, without its update clipping) lets one
    element far above the rest of its matrix shrink every other element's estimate and
    grow its step; the block form keeps its steps near lr. If this changes (e.g. an
    update clipping is added), the documentation must change with it."""
    assert _steps_beside_an_outlier(False, 1e6).max() < 2
    assert _steps_beside_an_outlier(True, 1e3).max() < 3
    factored = _steps_beside_an_outlier(True, 1e6)
    assert factored.max() > 100 and int((factored > 3).sum()) > 0.9 * factored.numel()
