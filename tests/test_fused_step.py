"""The whole-step call of CPU parameters that are not row-sharded (``AdamStep.step()``, with
and without the factored momentum formed in the statistics pass, ``momentum_in_stats``, and
switching between the two as the optimizer's timing does) gives the bits of the two-phase path (``factored_stats()`` then ``update()``, the path of
sharded and CUDA parameters)."""

import pytest
import torch

import gefen
import gefen.gefen as gefen_module
from gefen import _C
from gefen._items import AdamItem


def _model(dtype):
    torch.manual_seed(0)
    # awkward shapes: row lengths that are not multiples of the vector width or of a
    # likely period, a matrix with one row, a 3-D weight, biases (block form)
    model = torch.nn.ModuleDict(
        dict(
            a=torch.nn.Linear(37, 50),
            b=torch.nn.Linear(50, 130),
            c=torch.nn.Linear(130, 1),
            d=torch.nn.Conv1d(3, 5, 7),
        )
    )
    return model.to(dtype)


class _Recording:
    """An AdamStep that records which of its calls ran."""

    calls: set = set()

    def __init__(self, items):
        self._plan = _C.AdamStep(items)

    def __getattr__(self, name):
        type(self).calls.add(name)
        return getattr(self._plan, name)

    def __setattr__(self, name, value):  # (the optimizer's timing sets momentum_in_stats)
        if name == "_plan":
            object.__setattr__(self, name, value)
        else:
            type(self).calls.add(name)
            setattr(self._plan, name, value)


def _run(mode, monkeypatch, dtype, steps=6, **opts):
    fused = mode != "two-phase"
    monkeypatch.setattr(gefen_module, "_WHOLE_CPU_STEP", fused)
    # "chosen": the optimizer's own timing (gefen._tuning) alternates the two forms of the
    # whole step on steps 3-6 (ABBA), so the bits are checked across its switches too
    monkeypatch.setattr(gefen_module, "_MOMENTUM_IN_STATS",
                        None if mode == "chosen" else mode == "momentum-in-stats")
    monkeypatch.setattr(gefen_module, "_C", type("C", (), {"AdamStep": _Recording}))
    _Recording.calls = set()
    model = _model(dtype)
    opt = gefen.Gefen(model.parameters(), lr=1e-2, weight_decay=0.1, **opts)
    gen = torch.Generator().manual_seed(1)
    for s in range(steps):
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * (1 + s)).to(dtype)
        opt.step()
    # the path asked for, and only it
    expected = {"factored_stats", "update"} if not fused else \
        {"step", "factored", "momentum_in_stats"} if mode == "chosen" else {"step"}
    assert _Recording.calls == expected
    monkeypatch.setattr(gefen_module, "_C", _C)
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
             for p in model.parameters()]
    return params, state


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [
    dict(),
    dict(stochastic_round=True),
    dict(codebook_refresh_every=2),
    dict(period="row", stochastic_round=True, codebook_refresh_every=3),
], ids=["nearest", "stochastic", "refresh", "row-period"])
@pytest.mark.parametrize("mode", ["whole", "momentum-in-stats", "chosen"])
def test_whole_step_matches_two_phases_bitwise(monkeypatch, dtype, opts, mode):
    params_f, state_f = _run(mode, monkeypatch, dtype, **opts)
    params_p, state_p = _run("two-phase", monkeypatch, dtype, **opts)
    assert any(st["factored"] for st in state_f), "the model must have factored parameters"
    for a, b in zip(params_f, params_p):
        assert torch.equal(_bits(a), _bits(b))
    for sa, sb in zip(state_f, state_p):
        assert sa.keys() == sb.keys()
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert torch.equal(_bits(sa[k]), _bits(sb[k])), k
            else:
                assert sa[k] == sb[k], k


def _factored_item(**changes):
    fields = dict(
        name="w", param=torch.randn(4, 6), grad=torch.randn(4, 6),
        codes=torch.zeros(4, 6, dtype=torch.uint8), magnitude=torch.zeros(4, 2),
        vmean=None, v_row=torch.zeros(4), v_col=torch.zeros(6),
        col_stats=torch.zeros(7, dtype=torch.float64), row_stats=torch.zeros(4, dtype=torch.float64),
        period=3, row_offset=0, global_rows=4, step=1, lr=1e-3, beta1=0.9, beta2=0.999,
        eps=1e-8, weight_decay=0.0, stochastic_round=False, seed=0, momentum_in_stats=True,
    )
    fields.update(changes)
    return AdamItem(**fields)


def test_flagged_items_take_the_whole_step_only():
    q = _C.Quantizer(torch.linspace(-1, 1, 256))
    item = _factored_item()
    before = item.param.clone()
    plan = _C.AdamStep([item])
    with pytest.raises(ValueError, match="'w'.*momentum_in_stats"):
        plan.factored_stats(1)
    with pytest.raises(ValueError, match="'w'.*momentum_in_stats"):
        plan.update(q, 1)
    assert torch.equal(item.param, before) and not item.codes.any()
    plan.step(q, 1)
    assert not torch.equal(item.param, before)
    # and the same bits as the two phases without the flag
    ref = _factored_item(param=before.clone(), grad=item.grad, momentum_in_stats=False)
    ref_plan = _C.AdamStep([ref])
    ref_plan.factored_stats(1)
    ref_plan.update(q, 1)
    for f in ("param", "codes", "magnitude", "v_row", "v_col"):
        assert torch.equal(getattr(item, f), getattr(ref, f)), f
