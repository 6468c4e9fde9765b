"""Gefen chooses by timing how its whole CPU step runs factored parameters
(``gefen._tuning.FactoredTuner``): the ABBA measurement, the choice and its margin, the
re-measurement, the flag reaching the C plan (``AdamStep.momentum_in_stats``), and the bits,
which are those of the two-phase step whatever is chosen."""

import logging

import pytest
import torch

import gefen
import gefen.gefen as gefen_module
from gefen import _C
from gefen._items import AdamItem
from gefen._tuning import FactoredTuner


def _feed(tuner, cost):
    """Run the tuner's measurement to its end with step times cost[flag]; the flags asked."""
    asked = []
    while tuner.choice is None:
        f = tuner.flag()
        asked.append(f)
        tuner.record(f, cost[f])
    return asked


def test_abba_order_after_the_warmup_and_the_faster_chosen():
    t = FactoredTuner(rounds=2, warmup=2)
    asked = _feed(t, {False: 1.0, True: 0.9})
    assert asked == [False, False] + [False, True, True, False] * 2
    assert t.choice is True and t.medians == {False: 1.0, True: 0.9}
    assert t.flag() is True


@pytest.mark.parametrize("fused, chosen", [(0.97, True), (0.99, False), (1.0, False), (1.5, False)])
def test_the_fused_step_must_win_by_the_margin(fused, chosen):
    t = FactoredTuner(warmup=0, margin=0.02)
    _feed(t, {False: 1.0, True: fused})
    assert t.choice is chosen


def test_medians_not_means():
    t = FactoredTuner(rounds=2, warmup=0)
    times = iter([1.0, 0.5, 0.5, 1.0, 1.0, 0.5, 50.0, 1.0])  # one outlier in the fused steps
    while t.choice is None:
        f = t.flag()
        t.record(f, next(times))
    assert t.choice is True


def test_a_step_run_with_another_flag_is_not_counted():
    t = FactoredTuner(rounds=1, warmup=0)
    t.record(True, 0.1)  # the first step asked is two-phase: ignored
    assert t._times == {False: [], True: []}
    _feed(t, {False: 1.0, True: 2.0})
    assert t.choice is False


def test_measures_again_after_retune_every_steps():
    t = FactoredTuner(rounds=1, warmup=1, retune_every=3)
    _feed(t, {False: 1.0, True: 0.5})
    assert t.choice is True
    for _ in range(2):
        t.record(True, 0.5)
    assert t.choice is True
    t.record(True, 0.5)
    assert t.choice is None  # measuring again, without a warm-up
    _feed(t, {False: 0.5, True: 1.0})
    assert t.choice is False


def test_a_given_choice_holds_without_measuring():
    for flag in (False, True):
        t = FactoredTuner(choice=flag)
        for _ in range(5000):
            assert t.flag() is flag
            t.record(flag, 1.0)
        assert t.choice is flag and t.medians is None


@pytest.mark.parametrize("kw", [dict(rounds=0), dict(warmup=-1), dict(margin=1.0), dict(retune_every=-1)])
def test_bad_settings_raise(kw):
    with pytest.raises(ValueError, match="FactoredTuner"):
        FactoredTuner(**kw)


def _item(name, shape, factored):
    rows, cols = shape
    return AdamItem(
        name=name, param=torch.randn(shape), grad=torch.randn(shape),
        codes=torch.zeros(shape, dtype=torch.uint8), magnitude=torch.zeros(rows, 2),
        vmean=None if factored else torch.zeros(rows, 2), v_row=torch.zeros(rows) if factored else None,
        v_col=torch.zeros(cols) if factored else None, col_stats=None, row_stats=None,
        period=cols // 2, row_offset=0, global_rows=rows, step=1, lr=1e-3, beta1=0.9, beta2=0.999,
        eps=1e-8, weight_decay=0.0, stochastic_round=False, seed=0)


def test_plan_flag_sets_the_factored_items_only():
    plan = _C.AdamStep([_item("w", (4, 6), True), _item("b", (3, 6), False)])
    assert plan.momentum_in_stats is False
    plan.momentum_in_stats = True
    assert plan.momentum_in_stats is True
    # the flag is what the two-phase calls refuse: it reached the factored item
    with pytest.raises(ValueError, match="'w'.*momentum_in_stats"):
        plan.factored_stats(1)
    plan.momentum_in_stats = False
    plan.factored_stats(1)
    with pytest.raises(TypeError, match="bool"):
        plan.momentum_in_stats = 1
    with pytest.raises(AttributeError):
        del plan.momentum_in_stats
    assert plan.momentum_in_stats is False  # the refused settings changed nothing
    plan.momentum_in_stats = True
    with pytest.raises(TypeError, match="bool"):
        plan.momentum_in_stats = 0
    assert plan.momentum_in_stats is True
    block_only = _C.AdamStep([_item("b", (3, 6), False)])
    block_only.momentum_in_stats = True
    assert block_only.momentum_in_stats is False  # no factored item to take it


class _Clock:
    """A clock under which a whole step costs cost[flag of the tuner's next step]."""

    def __init__(self, cost):
        self.cost, self.now, self.tuner = cost, 0.0, None

    def __call__(self):
        self.now += self.cost[self.tuner.flag()] / 2  # called before and after each step
        return self.now


def _train(monkeypatch, switch, cost=None, steps=14):
    monkeypatch.setattr(gefen_module, "_MOMENTUM_IN_STATS", switch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 70), torch.nn.Tanh(), torch.nn.Linear(70, 3))
    opt = gefen.Gefen(model.parameters(), lr=1e-2, weight_decay=0.1)
    if cost is not None:
        clock = _Clock(cost)
        opt._tuner = clock.tuner = FactoredTuner(clock=clock)
    gen = torch.Generator().manual_seed(1)
    flags = []
    for s in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * (1 + s)
        opt.step()
        steady = opt.__dict__.get("_steady")
        if steady is not None:
            flags.append(steady.whole[0][1].momentum_in_stats)
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
             for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()], state, opt, flags


@pytest.mark.parametrize("fused_faster", [True, False])
def test_the_optimizer_applies_its_choice_with_the_same_bits(monkeypatch, fused_faster):
    cost = {False: 1.0, True: 0.5 if fused_faster else 2.0}
    params, state, opt, flags = _train(monkeypatch, None, cost)
    assert opt._tuner.choice is fused_faster
    # the kept plan ran the chosen form on the steps after the measurement (steps 11-14)
    assert flags[-3:] == [fused_faster] * 3, flags
    assert True in flags and False in flags  # and both while measuring
    ref_params, ref_state, _, _ = _train(monkeypatch, False)
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    for sa, sb in zip(state, ref_state):
        for k in sa:
            assert torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k], k


def test_forced_switches_do_not_measure(monkeypatch):
    for switch in (False, True):
        _, _, opt, flags = _train(monkeypatch, switch, steps=6)
        assert "_tuner" not in opt.__dict__
        assert set(flags) == {switch}


def test_the_choice_is_logged(monkeypatch, caplog):
    with caplog.at_level(logging.DEBUG, logger="gefen"):
        _train(monkeypatch, None, {False: 1.0, True: 0.5})
    assert any("chose the momentum in the statistics pass" in r.getMessage() for r in caplog.records)
