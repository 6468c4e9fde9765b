"""Gefen's steady step (gefen/_steady.py): a CPU step's C plan kept and run again.

Every test runs the same script of steps and events on two optimizers, one that keeps
its plan and one that never does (the full path every step), and requires the same bits
in parameters and state after every step and the same error where one is raised. The
events are the ones that must send a kept plan back to the full path; the tests also
check that the kept plan really ran on the steady steps (else they compare the full path
with itself) and that it stepped none of the steps an event invalidated.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import gefen
import gefen.gefen as gefen_module
from gefen import _C, _steady


def _params(dtype=torch.float32):
    torch.manual_seed(0)
    shapes = [(24, 40), (40,), (16, 8), (8,), (33, 64), (3,)]
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


class _Side:
    """One optimizer of a comparison, with a record of its kept plan's runs."""

    def __init__(self, keep, dtype, groups, **opts):
        self.params = _params(dtype)
        self.opt = gefen.Gefen(groups(self.params), **opts)
        self.runs = []
        if not keep:
            self.opt._keep_steady = lambda plan: None

    def snapshot(self):
        out = [p.detach().clone() for p in self.params]
        for p in self.params:
            st = self.opt.state.get(p)
            if st:
                out += [v.clone() if isinstance(v, torch.Tensor) else v for _, v in sorted(st.items())]
        return out


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.reshape(-1).view(torch.uint8) if x.is_floating_point() else x,
                               y.reshape(-1).view(torch.uint8) if y.is_floating_point() else y)
        else:
            assert x == y


@pytest.fixture
def runs(monkeypatch):
    """Every SteadyStep.run's result, by optimizer."""
    seen = {}
    real = _steady.SteadyStep.run

    def run(self, opt, switches):
        ok = real(self, opt, switches)
        seen.setdefault(id(opt), []).append(ok)
        return ok

    monkeypatch.setattr(_steady.SteadyStep, "run", run)
    return seen


def _script(runs, events, steps=9, dtype=torch.float32, groups=lambda ps: ps, **opts):
    """Step both sides ``steps`` times; ``events[k](side)`` runs on both before step k
    (after the gradients are set). Returns the kept side's run results per step (None:
    no kept plan was tried)."""
    sides = [_Side(keep, dtype, groups, **opts) for keep in (True, False)]
    per_step = []
    for k in range(steps):
        for s in sides:
            _grads(s.params, k)
        outcomes = []
        for s in sides:
            before = len(runs.get(id(s.opt), []))
            if k in events:
                events[k](s)
            try:
                s.opt.step()
                outcomes.append(None)
            except Exception as exc:  # both sides must raise the same
                outcomes.append((type(exc), str(exc)))
            tried = runs.get(id(s.opt), [])[before:]
            if s is sides[0]:
                per_step.append(tried[0] if tried else None)
        assert outcomes[0] == outcomes[1], f"step {k}"
        _same(sides[0].snapshot(), sides[1].snapshot())
    assert id(sides[1].opt) not in runs  # the reference side never kept a plan
    return per_step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opts", [{}, {"factored": False}, {"stochastic_round": True},
                                  {"weight_decay": 0.1, "betas": (0.8, 0.95)}])
def test_kept_plan_steps_bit_for_bit(runs, dtype, opts):
    per_step = _script(runs, {}, dtype=dtype, lr=1e-2, **opts)
    # step 0 learns the codebook, step 1 builds the plan, the rest run it
    assert per_step[:2] == [None, None] and all(per_step[2:]), per_step


def test_kept_plan_reads_the_step_scalars_every_step(runs):
    """A schedule changing lr, betas, eps, weight decay and the rounding between steps,
    over two groups, one of them with a tensor lr."""
    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:], "lr": torch.tensor(3e-3)}]

    def change(k):
        def event(side):
            g0, g1 = side.opt.param_groups
            g0["lr"] = 1e-2 / (k + 1)
            g1["lr"].fill_(1e-3 * k)
            g0["betas"] = (0.9 - 0.01 * k, 0.999)
            g1["eps"] = 1e-8 * k
            g1["weight_decay"] = 0.01 * k
            g0["stochastic_round"] = k % 2 == 1
        return event

    per_step = _script(runs, {k: change(k) for k in range(3, 9)}, lr=1e-2, groups=groups)
    assert all(per_step[2:]), per_step


def test_module_switches_are_read_on_every_step(runs, monkeypatch):
    """The internal switches (tests flip them) are part of what a kept plan was built with."""
    def flip(side):
        monkeypatch.setattr(gefen_module, "_MOMENTUM_IN_STATS", True)
    per_step = _script(runs, {4: flip}, lr=1e-2)
    assert per_step[4] is False and all(per_step[6:]), per_step


def _swap_storage(side):
    p = side.params[0]
    p.data = p.detach().clone()  # the same values in new memory


def _half(side):
    for p in side.params:
        p.data = p.data.to(torch.float64)
        p.grad = p.grad.to(torch.float64)


def _drop_grad(side):
    side.params[2].grad = None


def _transposed_grad(side):
    g = side.params[0].grad
    side.params[0].grad = g.t().contiguous().t()  # same values, column-major


def _wrong_dtype_grad(side):
    p = side.params[4]
    p.grad_dtype = None  # torch refuses the assignment otherwise
    p.grad = p.grad.double()


def _wrong_shape_grad(side):
    side.params[1].grad.set_(torch.zeros(41))  # (torch refuses the assignment)


def _sparse_grad(side):
    side.params[1].grad = side.params[1].grad.to_sparse()


def _bad_eps(side):
    side.opt.param_groups[0]["eps"] = -1.0


def _zero_lr(side):
    side.opt.param_groups[0]["lr"] = 0.0


def _new_group(side):
    extra = torch.nn.Parameter(torch.linspace(-1, 1, 48).reshape(6, 8))
    side.params.append(extra)
    side.opt.add_param_group({"params": [extra], "lr": 5e-3})
    extra.grad = torch.full_like(extra, 0.25)


def _reload(side):
    side.opt.load_state_dict(side.opt.state_dict())


def _refresh_now(side):
    side.opt.codebook_refresh_every = 5  # due at step 6 (global step 5 done)


def _overlap(side):
    side.params[3].data = side.params[1].data[:8]


def _replace_state(name, key, make, which=0):
    """An event replacing one state entry of parameter ``which``: the kept plan still
    holds the old one, so the step must take the full path, which checks the new one."""
    def event(side):
        st = side.opt.state[side.params[which]]
        st[key] = make(st[key])
    event.__name__ = name
    return event


# valid replacements (the full path updates the new tensors), then invalid ones
_state_clone = _replace_state("_state_clone", "magnitude", torch.clone)
_state_block_clone = _replace_state("_state_block_clone", "vmean", torch.clone, which=1)
_state_factored = _replace_state("_state_factored", "v_col", torch.clone)
_state_period = _replace_state("_state_period", "period", lambda _: 3)  # 3 does not divide 40
_state_codes = _replace_state("_state_codes", "codes", lambda c: c[:, :4].clone())
_state_dtype = _replace_state("_state_dtype", "magnitude", lambda m: m.double())


@pytest.mark.parametrize("event, lasting, fast_after", [
    (_swap_storage, False, True), (_half, False, True), (_drop_grad, False, True),
    (_new_group, False, True), (_reload, False, True), (_refresh_now, False, True),
    (_transposed_grad, True, False), (_zero_lr, True, False),
    (_wrong_dtype_grad, True, False), (_wrong_shape_grad, True, False),
    (_sparse_grad, True, False), (_bad_eps, True, False), (_overlap, True, False),
    (_state_clone, False, True), (_state_block_clone, False, True),
    (_state_factored, False, True), (_state_period, False, False),
    (_state_codes, False, False), (_state_dtype, False, False),
])
def test_events_take_the_full_path_with_its_result(runs, event, lasting, fast_after):
    """Each event at step 5 (and, when ``lasting``, again before every later step)
    invalidates the kept plan: that step takes the full path (the same bits, or the same
    error with nothing changed): the plan is tried and refuses (False), or was dropped
    by the event (None: add_param_group, loads). Once the steps are steady again a new
    plan is kept and runs (``fast_after``)."""
    events = {k: event for k in (range(5, 9) if lasting else (5,))}
    per_step = _script(runs, events, lr=1e-2)
    assert all(per_step[2:5]), per_step
    assert per_step[5] is (None if event in (_new_group, _reload) else False), per_step
    if fast_after:
        assert any(per_step[7:]), per_step
    else:
        assert not any(per_step[6:]), per_step


def test_kept_plan_holds_no_gradient(runs):
    """The kept plan references no gradient, neither the one it was built with nor those
    it ran with: zero_grad() frees them all."""
    params = _params()
    opt = gefen.Gefen(params, lr=1e-2)
    refs = []
    for k in range(4):  # full, full (the plan is built), kept, kept
        _grads(params, k)
        refs += [weakref.ref(p.grad) for p in params]
        opt.step()
    assert runs[id(opt)] == [True, True]
    opt.zero_grad()
    gc.collect()
    assert all(r() is None for r in refs)


def test_rebind_refuses_what_it_did_not_parse():
    """AdamStep.rebind takes nothing and returns False when a tensor differs from the
    plan (parameter, state and plan unchanged: the next rebind steps the bits of the full
    path); it raises for lists of the wrong length; it holds the gradients it took until
    unbind()."""
    params, twin = _params()[:1], _params()[:1]
    opt, ref_opt = gefen.Gefen(params, lr=1e-2), gefen.Gefen(twin, lr=1e-2)
    ref_opt._keep_steady = lambda plan: None
    for k in range(3):
        for ps, o in ((params, opt), (twin, ref_opt)):
            _grads(ps, k)
            o.step()
    plan = opt._steady.whole[0][1]  # (the one plan of plain CPU parameters)
    p = params[0]
    st = opt.state[p]

    def snapshot():
        return [p.detach().clone()] + [st[k].clone() for k in ("codes", "magnitude", "v_row", "v_col")]

    before = snapshot()
    hyper = [_steady.group_hyper(opt.param_groups[0], 1e-2)]
    for grad in (p.grad.double(), p.grad[:-1], p.grad.t(), torch.zeros(24 * 40)):
        assert plan.rebind([p], [grad], [4], hyper, 3) is False
    assert plan.rebind([p.detach().clone()], [p.grad], [4], hyper, 3) is False
    assert plan.rebind([p], [p.grad], ["four"], hyper, 3) is False
    assert plan.rebind([p], [p.grad], [4], [(1e-2, 0.9)], 3) is False
    with pytest.raises(ValueError, match="one entry each"):
        plan.rebind([p, p], [p.grad], [4], hyper, 3)
    _same(snapshot(), before)
    _grads(params, 3)
    _grads(twin, 3)
    grad = p.grad
    p.grad = None
    ref = weakref.ref(grad)
    assert plan.rebind([p], [grad], [4], hyper, 3) is True
    del grad
    gc.collect()
    assert ref() is not None  # bound
    plan.step(opt._quantizer, 1)
    ref_opt.step()  # the full path, the same step
    rs = ref_opt.state[twin[0]]
    _same(snapshot(), [twin[0].detach().clone()] + [rs[k].clone() for k in ("codes", "magnitude", "v_row", "v_col")])
    plan.unbind()
    gc.collect()
    assert ref() is None


def test_state_dict_of_a_steady_optimizer_round_trips(runs):
    """Pickling and state dicts ignore the kept plan (it is no state)."""
    import copy
    import pickle

    params = _params()
    opt = gefen.Gefen(params, lr=1e-2)
    for k in range(4):
        _grads(params, k)
        opt.step()
    assert "_steady" in opt.__dict__
    clone = copy.deepcopy(opt)
    assert "_steady" not in clone.__dict__
    pickle.loads(pickle.dumps(opt))
    sd = opt.state_dict()
    assert all(not isinstance(v, _C.AdamStep) for st in sd["state"].values() for v in st.values())
