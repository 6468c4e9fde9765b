"""gefen.Gefen as a torch.optim optimizer: construction, groups, schedulers, closures,
GradScaler, checkpoints (bitwise continuation, fail-before-mutation loads) and bad input."""

import copy
import math

import numpy as np
import pytest
import torch
from bitsnap import assert_same_bits as _same_bits
from bitsnap import bits as _bits
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import gefen
import gefen.dcp


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3)
    )


_TEACHER = torch.randn(12, 3, generator=torch.Generator().manual_seed(1234))


def _batch(seed):
    """A learnable regression task: y = tanh(x W) + noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 12, generator=gen)
    return x, torch.tanh(x @ _TEACHER) + 0.05 * torch.randn(64, 3, generator=gen)


def _train(model, opt, steps, start=0):
    for i in range(start, start + steps):
        x, y = _batch(i)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    return params, state


def _assert_same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert torch.equal(sa[key], sb[key]), key
            else:
                assert sa[key] == sb[key], key


# ----------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(lr=-1.0), ValueError, "learning rate"),
        (dict(lr=float("nan")), ValueError, "learning rate"),
        (dict(betas=(1.0, 0.999)), ValueError, "beta parameter at index 0"),
        (dict(betas=(0.9, -0.1)), ValueError, "beta parameter at index 1"),
        (dict(eps=0.0), ValueError, "epsilon"),
        (dict(eps=float("inf")), ValueError, "epsilon"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (dict(period="block"), ValueError, "period"),
        (dict(codebook_refresh_every=-1), ValueError, "codebook_refresh_every"),
        (dict(codebook_refresh_every=1.5), TypeError, "codebook_refresh_every"),
        (dict(fused=False), ValueError, "fused"),
        (dict(lr=torch.tensor([1.0, 2.0])), ValueError, "one-element"),
    ],
)
def test_constructor_rejects_bad_hyperparameters(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        gefen.Gefen([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_constructor_rejects_bad_params():
    with pytest.raises(ValueError, match="empty parameter list"):
        gefen.Gefen([])
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        gefen.Gefen(torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(TypeError, match="Tensor"):
        gefen.Gefen([1.0, 2.0])
    with pytest.raises(ValueError, match="'w'.*complex"):
        gefen.Gefen([("w", torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64)))])
    with pytest.raises(ValueError, match="floating-point"):
        gefen.Gefen([torch.zeros(3, dtype=torch.int64)])


@pytest.mark.parametrize("option", ["amsgrad", "foreach", "maximize", "capturable", "differentiable"])
@pytest.mark.parametrize("make", [
    lambda **kw: gefen.Gefen([torch.nn.Parameter(torch.zeros(3))], **kw),
    lambda **kw: gefen.GefenMuon([torch.nn.Parameter(torch.zeros(3, 3))], **kw),
    lambda **kw: gefen.GefenMuonHybrid(torch.nn.Linear(3, 3), lr=1e-3, **kw),
], ids=["Gefen", "GefenMuon", "GefenMuonHybrid"])
def test_torch_optim_options_without_meaning_here_are_not_accepted(make, option):
    for value in (True, False):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{option}'"):
            make(**{option: value})


def test_named_parameters_and_groups():
    model = _model()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-3)
    assert opt.param_groups[0]["param_names"][0] == "0.weight"
    opt = gefen.Gefen(
        [
            {"params": model[0].parameters(), "lr": 1e-2, "weight_decay": 0.1},
            {"params": model[3].parameters(), "factored": False},
        ],
        lr=1e-3,
    )
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[1]["lr"] == 1e-3
    opt.add_param_group({"params": model[2].parameters(), "lr": 5e-3})
    assert len(opt.param_groups) == 3
    with pytest.raises(ValueError, match="learning rate"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -1})
    assert len(opt.param_groups) == 3  # a rejected group is not kept
    _train(model, opt, 3)
    assert opt.state[model[0].weight]["factored"] == 1
    assert opt.state[model[3].weight]["factored"] == 0
    assert "vmean" in opt.state[model[3].weight]


def test_gefen_trains_like_adamw():
    model_a, model_g = _model(1), _model(1)
    adamw = torch.optim.AdamW(model_a.parameters(), lr=3e-3)
    gef = gefen.Gefen(model_g.parameters(), lr=3e-3)
    _train(model_a, adamw, 60)
    _train(model_g, gef, 60)
    x, y = _batch(1000)
    la = torch.nn.functional.mse_loss(model_a(x), y).item()
    lg = torch.nn.functional.mse_loss(model_g(x), y).item()
    x0 = torch.nn.functional.mse_loss(_model(1)(x), y).item()
    assert lg < 0.3 * x0, (lg, x0)
    assert lg < 1.25 * la, (lg, la)


# ----------------------------------------------------------------- step behaviour


def test_tensor_lr_and_scheduler_change_the_update():
    p = torch.nn.Parameter(torch.ones(4, 8))
    opt = gefen.Gefen([p], lr=torch.tensor(0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    deltas = []
    for _ in range(3):
        before = p.detach().clone()
        p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
        deltas.append((before - p.detach()).abs().max().item())
    # constant gradient: Adam's step is ~lr each time, so the steps halve with lr
    assert deltas[1] == pytest.approx(deltas[0] / 2, rel=0.05)
    assert deltas[2] == pytest.approx(deltas[0] / 4, rel=0.05)


def test_closure_and_params_without_grad():
    model = _model()
    frozen = model[3].bias
    opt = gefen.Gefen(model.parameters(), lr=1e-2)
    x, y = _batch(0)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        frozen.grad = None
        return loss

    before = frozen.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert torch.equal(frozen.detach(), before)
    assert frozen not in opt.state


def test_zero_grad_zero_lr_step_learns_nothing():
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    assert len(opt.state) == 0 and opt._codebook is None and opt._global_step == 0
    for g in opt.param_groups:
        g["lr"] = torch.tensor(0.0)  # what get_optimizer_state_dict uses for tensor lrs
    opt.step()
    assert len(opt.state) == 0
    for g in opt.param_groups:
        g["lr"] = 1e-2
    _train(model, opt, 1)
    assert len(opt.state) == len(list(model.parameters()))
    assert all(st["step"] == 1 and st["global_step"] == 1 for st in opt.state.values())


def _gefen_internals(opt):
    """gefen's own bookkeeping outside the state dict's tensors."""
    cb = opt._codebook
    return (None if cb is None else cb.clone()), opt._global_step, opt._quantizer


@pytest.mark.parametrize("inf_at", [0, 2], ids=["first_step", "third_step"])
def test_grad_scaler_inf_step_leaves_everything_untouched(inf_at):
    """A GradScaler step with an inf gradient leaves the parameters, every state tensor,
    the shared codebook, the quantiser and the global step as they were (on the first step
    too: no codebook is learned from it), and the training that follows is bit for bit the
    training without that step (the unscaled gradients are exact: scales are powers of 2)."""
    steps = 5
    model = _model(2)
    ref_model = copy.deepcopy(model)
    opt = gefen.Gefen(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref = gefen.Gefen(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    for i in range(steps):
        x, y = _batch(i)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if i == inf_at:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)  # the usual place for gradient clipping
        params, state = _snapshot(model, opt)
        internals = _gefen_internals(opt)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if i == inf_at:
            for p, q in zip(model.parameters(), params):
                assert torch.equal(p.detach(), q)
            _assert_same_state(opt.state_dict(), state)
            codebook, global_step, quantizer = _gefen_internals(opt)
            assert global_step == internals[1] == i
            assert quantizer is internals[2]
            assert (codebook is None) == (internals[0] is None) == (i == 0)
            assert codebook is None or torch.equal(codebook, internals[0])
            assert scaler.get_scale() == scale / 2
            continue
        # the reference never sees the skipped step
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref_model(x), y).backward()
        ref.step()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p.detach(), q.detach())
        _assert_same_state(opt.state_dict(), ref.state_dict())
    assert opt._global_step == ref._global_step == steps - 1
    assert torch.equal(opt._codebook, ref._codebook)


def test_weight_decay_is_decoupled():
    p = torch.nn.Parameter(torch.full((4, 4), 2.0))
    opt = gefen.Gefen([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros_like(p)
    p.grad[0, 0] = 1.0  # a non-zero gradient so this is a real step
    opt.step()
    # elements with zero gradient and zero momentum move only by the decay
    assert p[1, 1].item() == pytest.approx(2.0 * (1 - 0.1 * 0.5), rel=1e-6)


def test_results_do_not_depend_on_the_thread_count():
    outs = []
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            p = torch.nn.Parameter(torch.randn(300, 257, generator=torch.Generator().manual_seed(0)))
            opt = gefen.Gefen([p], lr=1e-2)
            for i in range(3):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i + 1))
                opt.step()
            outs.append((p.detach().clone(), copy.deepcopy(opt.state_dict())))
        finally:
            torch.set_num_threads(old)
    assert torch.equal(outs[0][0], outs[1][0])
    _assert_same_state(outs[0][1], outs[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_non_contiguous_params_and_grads_are_updated_correctly(dtype):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(10, 6, generator=gen).to(dtype)
    p_t = torch.nn.Parameter(base.t().clone().t().contiguous().t())  # shape (6, 10), strided
    p_t.data = base.t()  # a transposed, non-contiguous view
    p_c = torch.nn.Parameter(base.t().contiguous())
    assert not p_t.is_contiguous() and torch.equal(p_t.detach(), p_c.detach())
    opt_t = gefen.Gefen([p_t], lr=1e-2)
    opt_c = gefen.Gefen([p_c], lr=1e-2)
    for _ in range(3):
        g = torch.randn(10, 6, generator=gen).to(dtype)
        p_t.grad = g.t()  # non-contiguous gradient too
        p_c.grad = g.t().contiguous()
        opt_t.step()
        opt_c.step()
    assert torch.equal(p_t.detach(), p_c.detach())
    assert torch.equal(opt_t.state[p_t]["codes"], opt_c.state[p_c]["codes"])


# ----------------------------------------------------------------- bad input at step


def _assert_untouched(model, opt, params, state):
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p.detach(), q)
    _assert_same_state(opt.state_dict(), state)


def test_sparse_gradient_is_rejected_before_mutation():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    lin = torch.nn.Linear(4, 2)
    model = torch.nn.ModuleList([lin, emb])
    opt = gefen.Gefen(model.named_parameters(), lr=1e-2)
    lin.weight.grad = torch.randn_like(lin.weight)
    lin.bias.grad = torch.randn_like(lin.bias)
    emb(torch.tensor([1, 2])).sum().backward()
    params, state = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match="'1.weight'.*sparse"):
        opt.step()
    _assert_untouched(model, opt, params, state)


def test_overlapping_parameters_are_rejected_before_mutation():
    base = torch.zeros(16)
    p1 = torch.nn.Parameter(base[:10])
    p2 = torch.nn.Parameter(base[6:])
    p1.grad, p2.grad = torch.ones(10), torch.ones(10)
    opt = gefen.Gefen([("a", p1), ("b", p2)], lr=1e-2)
    with pytest.raises(ValueError, match="'a' and 'b' overlap"):
        opt.step()
    assert torch.equal(base, torch.zeros(16))
    assert len(opt.state) == 0


def test_meta_device_parameters_are_rejected():
    p = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    p.grad = torch.empty(4, 4, device="meta")
    opt = gefen.Gefen([("w", p)], lr=1e-2)
    with pytest.raises(RuntimeError, match="'w'.*meta"):
        opt.step()
    assert len(opt.state) == 0


def test_gradient_checks_name_the_parameter():
    # torch refuses to assign a gradient of another shape or dtype, so exercise the
    # check directly.
    from gefen._layout import check_grad

    p = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="'w'.*shape"):
        check_grad(p, torch.zeros(4, 3), "w")
    with pytest.raises(TypeError, match="'w'.*dtype"):
        check_grad(p, torch.zeros(3, 4, dtype=torch.float64), "w")
    with pytest.raises(TypeError, match="'w'.*complex"):
        check_grad(p, torch.zeros(3, 4, dtype=torch.complex64), "w")


def _adam_item(**changes):
    from gefen._items import AdamItem

    fields = dict(
        name="w", param=torch.zeros(4, 6), grad=torch.zeros(4, 6),
        codes=torch.zeros(4, 6, dtype=torch.uint8), magnitude=torch.zeros(4, 1),
        vmean=torch.zeros(4, 1), v_row=None, v_col=None, col_stats=None, row_stats=None,
        period=6, row_offset=0, global_rows=4, step=1, lr=1e-3, beta1=0.9, beta2=0.999,
        eps=1e-8, weight_decay=0.0, stochastic_round=False, seed=0,
    )
    fields.update(changes)
    return AdamItem(**fields)


def test_cpu_plan_allocates_the_factored_statistics_it_is_not_given():
    """A CPU factored item may leave col_stats/row_stats None (Gefen's whole-step items):
    the plan allocates them, with the same bits as buffers handed in, through step() and
    through factored_stats() + update()."""
    from gefen import _C

    torch.manual_seed(0)
    p0 = torch.nn.Parameter(torch.randn(12, 40))
    opt = gefen.Gefen([p0], lr=1e-3)
    p0.grad = torch.randn_like(p0)
    opt.step()
    quantizer = _C.Quantizer(opt._codebook)

    def items(given):
        torch.manual_seed(1)
        out = []
        for i, (rows, cols) in enumerate(((12, 40), (7, 9), (1, 64))):
            out.append(_adam_item(
                name=f"w{i}", param=torch.randn(rows, cols), grad=torch.randn(rows, cols),
                codes=torch.randint(0, 256, (rows, cols), dtype=torch.uint8),
                magnitude=torch.rand(rows, 1), vmean=None, v_row=torch.rand(rows),
                v_col=torch.rand(cols), period=cols, global_rows=rows, step=3,
                col_stats=torch.full((cols + 1,), 7.0, dtype=torch.float64) if given else None,
                row_stats=torch.full((rows,), 7.0, dtype=torch.float64) if given else None,
            ))
        return out

    def state(its):
        return [t.clone() for it in its for t in (it.param, it.codes, it.magnitude, it.v_row, it.v_col)]

    for phased in (False, True):
        runs = []
        for given in (True, False):
            its = items(given)
            plan = _C.AdamStep(its)
            assert plan.factored
            for _ in range(2):
                if phased:
                    plan.factored_stats(1)
                    plan.update(quantizer, 1)
                else:
                    plan.step(quantizer, 2)
            runs.append(state(its))
        assert all(torch.equal(a, b) for a, b in zip(*runs))
        assert not torch.equal(runs[0][0], items(True)[0].param)  # the step changed something


def test_c_extension_checks_state_tensors():
    from gefen import _C

    plan = _C.AdamStep([_adam_item()])
    assert plan.size == 1 and not plan.factored
    with pytest.raises(TypeError, match="'w'.*codes.*uint8"):
        _C.AdamStep([_adam_item(codes=torch.zeros(4, 6, dtype=torch.int64))])
    with pytest.raises(ValueError, match="'w'.*magnitude.*8 elements, expected 4"):
        _C.AdamStep([_adam_item(magnitude=torch.zeros(4, 2))])
    with pytest.raises(ValueError, match="period 4 does not divide 6"):
        _C.AdamStep([_adam_item(period=4)])
    with pytest.raises(ValueError, match="'w'.*betas"):
        _C.AdamStep([_adam_item(beta2=1.0)])
    with pytest.raises(ValueError, match="'w'.*vmean.*contiguous"):
        _C.AdamStep([_adam_item(vmean=torch.zeros(4, 2)[:, 0])])  # strided
    with pytest.raises(ValueError, match="'w'.*rows \\[2, 6\\) lie outside the 4 global rows"):
        _C.AdamStep([_adam_item(row_offset=2)])
    with pytest.raises(TypeError, match="needs a field 'seed'"):
        _C.AdamStep([_Missing(_adam_item(), "seed")])
    with pytest.raises(TypeError, match="'w'.*'step' must be an int"):
        _C.AdamStep([_adam_item(step="1")])
    p = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="'w' and 'v' overlap in memory"):
        _C.AdamStep([_adam_item(param=p), _adam_item(name="v", param=p)])


class _Missing:
    """An item without one field (the extension names it)."""

    def __init__(self, item, missing: str):
        self._item, self._missing = item, missing

    def __getattr__(self, name):
        if name == self._missing:
            raise AttributeError(name)
        return getattr(self._item, name)


# ----------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("factored", [True, False])
def test_state_dict_round_trip_continues_bitwise(factored):
    model_a = _model(3)
    opt_a = gefen.Gefen(model_a.parameters(), lr=5e-3, weight_decay=0.01, factored=factored)
    _train(model_a, opt_a, 4)
    sd = copy.deepcopy(opt_a.state_dict())
    model_b = copy.deepcopy(model_a)
    _train(model_a, opt_a, 4, start=4)

    opt_b = gefen.Gefen(model_b.parameters(), lr=1.0, factored=factored)
    opt_b.load_state_dict(sd)
    assert opt_b.param_groups[0]["lr"] == 5e-3  # hyper-parameters restored like torch.optim
    _train(model_b, opt_b, 4, start=4)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    _assert_same_state(opt_a.state_dict(), opt_b.state_dict())
    # one codebook tensor shared by every parameter's state
    cbs = {id(st["codebook"]) for st in opt_b.state.values()}
    assert len(cbs) == 1


def test_state_dict_survives_torch_save(tmp_path):
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    opt2 = gefen.Gefen(_model().parameters(), lr=1e-2)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    _assert_same_state(opt.state_dict(), opt2.state_dict())


def _corruptions():
    def first(sd):
        return sd["state"][0]

    yield "schema", lambda sd: sd["param_groups"][0].update(gefen_schema=99), "schema version"
    yield "kind", lambda sd: sd["param_groups"][0].update(gefen_kind="adamw"), "optimizer kind"
    yield "groups", lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])), "parameter groups"
    yield "missing", lambda sd: first(sd).pop("magnitude"), "'0.weight'.*missing"
    yield "extra", lambda sd: first(sd).update(exp_avg=torch.zeros(1)), "'0.weight'.*unknown keys"
    yield "shape", lambda sd: first(sd).update(v_row=torch.zeros(7)), "'0.weight'.*v_row.*shape"
    yield "dtype", lambda sd: first(sd).update(codes=first(sd)["codes"].long()), "'0.weight'.*codes.*dtype"
    yield "negative", lambda sd: first(sd)["v_col"].__setitem__(0, -1.0), "'0.weight'.*negative"
    yield "-inf", lambda sd: first(sd)["magnitude"].__setitem__(0, float("-inf")), "'0.weight'.*negative"
    # NaN is a value a step can write (a non-finite gradient): only its digest gives it away
    yield "nan", lambda sd: first(sd)["magnitude"].__setitem__(0, float("nan")), "'0.weight'.*digest"
    yield "period", lambda sd: first(sd).update(period=5), "'0.weight'.*period 5"
    yield "step", lambda sd: first(sd).update(step=-1), "'0.weight'.*step"
    yield "factored", lambda sd: first(sd).update(factored=0), "'0.weight'.*missing \\['vmean'\\]"

    def unsorted(sd):
        cb = first(sd)["codebook"].clone()
        cb[10], cb[11] = cb[11].item(), cb[10].item()
        for st in sd["state"].values():
            st["codebook"] = cb

    yield "unsorted", unsorted, "'0.weight'.*codebook.*invalid"

    def ends(sd):
        cb = first(sd)["codebook"].clone()
        cb[0] = -0.5
        for st in sd["state"].values():
            st["codebook"] = cb

    yield "ends", ends, "codebook.*invalid"

    def differ(sd):
        cb = sd["state"][1]["codebook"].clone()
        cb[100] += 1e-3
        sd["state"][1]["codebook"] = cb

    yield "differ", differ, "'0.bias'.*codebook.*differs"
    yield "unknown id", lambda sd: sd["state"].update({99: first(sd)}), "parameter id 99"


@pytest.mark.parametrize("name, corrupt, match", list(_corruptions()), ids=[c[0] for c in _corruptions()])
def test_corrupt_state_dict_is_rejected_and_nothing_changes(name, corrupt, match):
    model = _model()
    opt = gefen.Gefen(model.named_parameters(), lr=1e-2)
    _train(model, opt, 2)
    good = copy.deepcopy(opt.state_dict())
    params, state = _snapshot(model, opt)
    bad = copy.deepcopy(good)
    corrupt(bad)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    _assert_untouched(model, opt, params, state)
    # the optimizer still works and still loads a good state dict
    opt.load_state_dict(good)
    _train(model, opt, 1, start=2)


@pytest.mark.parametrize("kind", ["gefen", "gefen-muon", "hybrid"])
def test_another_optimizers_state_dict_is_refused_naming_it(kind):
    """torch AdamW's state dict (an optimizer swapped mid-run, resumed from the old
    checkpoint) is refused as another optimizer's, naming its state keys, and nothing
    changes; before, the error spoke of schema version None (the hybrid's, of group counts)."""
    model = _matrix_model(0) if kind == "gefen-muon" else _model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, adamw, 1)
    if kind == "gefen":
        opt = gefen.Gefen(model.named_parameters(), lr=1e-2)
    elif kind == "gefen-muon":
        opt = gefen.GefenMuon(model.named_parameters(), lr=1e-2)
    else:
        opt = gefen.GefenMuonHybrid(model.named_parameters(), lr=1e-2)
    _train(model, opt, 2)
    params, state = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"not a gefen state dict \(its state holds 'exp_avg', 'exp_avg_sq', "):
        opt.load_state_dict(adamw.state_dict())
    _assert_untouched(model, opt, params, state)


def _matrix_model(seed):
    """Bias-free: every parameter is 2-D, so GefenMuon can take the whole model."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32, bias=False), torch.nn.GELU(),
                               torch.nn.Linear(32, 3, bias=False))


@pytest.mark.parametrize("cls", [gefen.Gefen, gefen.GefenMuon], ids=["Gefen", "GefenMuon"])
def test_load_into_a_stepped_optimizer_replaces_its_codebook(cls):
    model, other = _matrix_model(1), _matrix_model(2)
    opt, target = cls(model.parameters(), lr=1e-2), cls(other.parameters(), lr=1e-2)
    _train(model, opt, 2)
    _train(other, target, 1, start=50)  # its own, different codebook
    assert not torch.equal(opt._codebook, target._codebook)
    target.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(st["codebook"] is target._codebook for st in target.state.values())
    _assert_same_state(target.state_dict(), opt.state_dict())


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("cls", [gefen.Gefen, gefen.GefenMuon], ids=["Gefen", "GefenMuon"])
def test_dcp_state_dict_helpers_on_one_process(cls, flatten):
    """torch.distributed.checkpoint's get/set_optimizer_state_dict on a plain Gefen or
    GefenMuon (the hybrid's are in test_hybrid.py): the loaded copy continues bitwise."""
    assert not torch.distributed.is_initialized()
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model = _matrix_model(5)
    opt = cls(model.parameters(), lr=5e-3, weight_decay=0.1)
    _train(model, opt, 2)
    osd = get_optimizer_state_dict(model, opt, options=options)
    assert ("state.0.weight.codes" in osd) if flatten else ("0.weight" in osd["state"])
    twin = _matrix_model(6)
    twin_opt = cls(twin.parameters(), lr=1.0)
    if flatten:  # a flattened load restores only keys the live optimizer has (DESIGN.md §5)
        with pytest.raises(ValueError, match="holds state for 2 parameter.*but 0 arrived.*prepare_load"):
            set_optimizer_state_dict(twin, twin_opt, osd, options=options)
        gefen.dcp.prepare_load(twin_opt, osd, model=twin)
    twin.load_state_dict(model.state_dict())
    set_optimizer_state_dict(twin, twin_opt, osd, options=options)
    assert twin_opt.param_groups[0]["lr"] == 5e-3 and twin_opt._global_step == 2
    _train(model, opt, 2, start=2)
    _train(twin, twin_opt, 2, start=2)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    _assert_same_state(opt.state_dict(), twin_opt.state_dict())


def test_load_into_fresh_optimizer_then_step():
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-2)
    _train(model, opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    fresh = gefen.Gefen(model.parameters(), lr=1e-2)
    fresh.load_state_dict(sd)
    assert fresh._global_step == 3
    _train(model, fresh, 1, start=3)
    assert all(st["global_step"] == 4 for st in fresh.state.values())


def test_codebook_refresh_changes_the_codebook_and_keeps_values():
    p = torch.nn.Parameter(torch.randn(32, 64))
    opt = gefen.Gefen([p], lr=1e-3, codebook_refresh_every=2)
    gen = torch.Generator().manual_seed(0)
    p.grad = torch.randn(32, 64, generator=gen)
    opt.step()
    cb1 = opt._codebook.clone()
    p.grad = torch.randn(32, 64, generator=gen)
    opt.step()
    assert torch.equal(opt._codebook, cb1)  # step 2: no refresh
    p.grad = torch.randn(32, 64, generator=gen) ** 3  # a very different distribution
    opt.step()  # step 3 = 1 + 2: refresh
    assert not torch.equal(opt._codebook, cb1)
    assert opt.state[p]["codebook"] is opt._codebook


def test_state_bytes_per_parameter_is_about_one():
    p = torch.nn.Parameter(torch.randn(1024, 1024))
    opt = gefen.Gefen([p])
    p.grad = torch.randn_like(p)
    opt.step()
    st = opt.state[p]
    nbytes = sum(v.numel() * v.element_size() for k, v in st.items()
                 if isinstance(v, torch.Tensor) and k != "codebook")
    assert nbytes / p.numel() <= 1.02
    # codes, magnitude per block, v_row, v_col
    expected = 1 + 4 / st["period"] + 4 / 1024 + 4 / 1024
    assert math.isclose(nbytes / p.numel(), expected, rel_tol=1e-9)
    opt.state_dict()  # from the first state_dict() on, the integrity digests live too
    nbytes = sum(v.numel() * v.element_size() for k, v in st.items()
                 if isinstance(v, torch.Tensor) and k != "codebook")
    assert math.isclose(nbytes / p.numel(), expected + 8 / 1024 + 16 / p.numel(), rel_tol=1e-9)


def test_deepcopy_and_pickle_keep_training_identically():
    import pickle

    model = _model(4)
    opt = gefen.Gefen(model.parameters(), lr=5e-3, codebook_refresh_every=3, deterministic=True)
    _train(model, opt, 2)
    twin_model, twin = copy.deepcopy((model, opt))  # one memo: the copy steps the copied model
    assert twin.codebook_refresh_every == 3 and twin.deterministic
    assert twin.param_groups[0]["params"][0] is next(twin_model.parameters())
    _train(model, opt, 3, start=2)
    _train(twin_model, twin, 3, start=2)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    restored = pickle.loads(pickle.dumps(opt))
    assert restored._global_step == opt._global_step
    assert torch.equal(restored._codebook, opt._codebook) and restored._quantizer is not None


def test_empty_state_entries_are_ignored():
    model = _model()
    opt = gefen.Gefen(model.parameters(), lr=1e-2)
    frozen = model[3].bias
    for i in range(2):
        x, y = _batch(i)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        frozen.grad = None
        opt.step()
    _ = opt.state[frozen]  # a lookup (as DCP's helpers do) creates an empty entry
    sd = opt.state_dict()
    assert len(sd["state"]) == len(list(model.parameters())) - 1
    index = [id(p) for p in model.parameters()].index(id(frozen))
    sd["state"][index] = {}  # an empty entry in a loaded dict is "never stepped"
    fresh = gefen.Gefen(model.parameters(), lr=1e-2)
    fresh.load_state_dict(sd)
    assert frozen not in fresh.state or not fresh.state[frozen]
    # but a stepped parameter's state that went missing on the way is an error
    sd["state"][0] = {}
    with pytest.raises(ValueError, match="holds state for 5 parameter.*but 4 arrived.*prepare_load"):
        gefen.Gefen(model.parameters(), lr=1e-2).load_state_dict(sd)


def test_dlpack_protocol_fallback_for_producers_without_the_exchange_api():
    """numpy arrays have __dlpack__ but no C exchange table: the extension reads them
    through the capsule protocol (the path older PyTorch versions take)."""
    from gefen import _C

    p = torch.nn.Parameter(torch.randn(16, 32))
    opt = gefen.Gefen([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    cb = opt._codebook
    assert not hasattr(type(cb.numpy()), "__dlpack_c_exchange_api__")
    quantizer = _C.Quantizer(cb.numpy())
    assert quantizer.codebook() == tuple(cb.tolist())
    bad = cb.numpy().copy()
    bad[0] = -0.5
    with pytest.raises(ValueError, match="codebook"):
        _C.codebook_validate(bad)
    # a read-only producer is refused where the core would write
    codes = opt.state[p]["codes"].numpy().copy()
    codes.setflags(write=False)
    st = opt.state[p]
    item = _adam_item(
        param=p.detach(), grad=p.grad, codes=codes, magnitude=st["magnitude"], vmean=None,
        v_row=st["v_row"], v_col=st["v_col"], col_stats=torch.empty(33, dtype=torch.float64),
        row_stats=torch.empty(16, dtype=torch.float64), period=st["period"], global_rows=16,
        step=2, seed=1,
    )
    with pytest.raises(ValueError, match="'w'.*codes.*read-only"):
        _C.AdamStep([item])


def test_parameters_that_require_grad_cross_the_protocol_fallback_detached():
    """The optimizer hands plain parameters to the extension as they are (no detach per
    step): DLPack's exchange table reads them; a tensor type without it goes through
    __dlpack__(), which torch refuses for a tensor that requires grad, so the extension
    detaches it first. Same bits either way."""

    class NoExchange(torch.nn.Parameter):
        __dlpack_c_exchange_api__ = None  # the extension falls back to __dlpack__()

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(16, 32))
    b = NoExchange(a.detach().clone())
    assert b.requires_grad and type(b).__dlpack_c_exchange_api__ is None
    opts = [gefen.Gefen([p], lr=1e-2) for p in (a, b)]
    for _ in range(3):
        g = torch.randn(16, 32)
        for p, opt in zip((a, b), opts):
            p.grad = g.clone()
            opt.step()
    assert torch.equal(a.detach(), b.detach())


def test_deterministic_is_a_documented_no_op():
    """deterministic= is accepted and changes nothing (gefen is always deterministic)."""
    runs = []
    for flag in (False, True):
        model = _model()
        opt = gefen.Gefen(model.parameters(), lr=1e-2, deterministic=flag)
        _train(model, opt, 3)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize(
    "make",
    [lambda m: gefen.Gefen(m.parameters(), lr=1e-2), lambda m: gefen.GefenMuonHybrid(m, lr=1e-2)],
    ids=["Gefen", "GefenMuonHybrid"],
)
def test_state_dict_hooks_follow_torch_optim(make):
    """torch.optim's hook protocol: state_dict pre-hooks see the optimizer, post-hooks may
    replace the returned dict; load pre-hooks may replace the dict being loaded, post-hooks
    run after the load -- each in registration order."""
    model = _model()
    opt = make(model)
    _train(model, opt, 2)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd pre", o is opt)))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append(("sd post 1", "marked" in sd)))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "marked": True})
    opt.register_state_dict_post_hook(lambda o, sd: calls.append(("sd post 3", sd.get("marked"))))
    sd = opt.state_dict()
    assert sd["marked"] is True
    assert calls == [("sd pre", True), ("sd post 1", False), ("sd post 3", True)]

    # a load pre-hook that swaps in another state dict: the swapped one is what loads
    other_model = _model(seed=1)
    other = make(other_model)
    _train(other_model, other, 3, start=5)
    wanted = other.state_dict()
    calls.clear()
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load pre 1", "marked" in sd)))
    opt.register_load_state_dict_pre_hook(lambda o, sd: wanted)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load post", o is opt)))
    opt.load_state_dict(sd)
    assert calls == [("load pre 1", True), ("load post", True)]
    loaded = opt.state_dict()
    loaded.pop("marked")
    _assert_same_state(loaded, wanted)


# ----------------------------------------------------------------- audit: robustness




def _stepped(cls=None, shape=(4, 8), steps=1, **opts):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(*shape))
    opt = (cls or gefen.Gefen)([("w", w)], lr=1e-2, **opts)
    for _ in range(steps):
        w.grad = torch.randn_like(w)
        opt.step()
    return opt, w


@pytest.mark.parametrize("kind, opts, value", [
    ("gefen", {}, float("nan")), ("gefen", {"factored": False}, float("inf")),
    ("gefen", {"factored": False}, float("nan")), ("muon", {}, float("inf")),
])
def test_state_after_a_non_finite_gradient_loads_back(kind, opts, value):
    """A step accepts a NaN/inf gradient (as torch.optim does) and writes non-finite
    moments: the optimizer's own state dict must still load, bit for bit."""
    cls, shape = (gefen.Gefen, (4, 8)) if kind == "gefen" else (gefen.GefenMuon, (8, 16))
    opt, w = _stepped(cls, shape, **opts)
    w.grad = torch.randn_like(w)
    w.grad[0, 0] = value
    opt.step()
    sd = opt.state_dict()
    floats = [v for v in sd["state"][0].values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert not all(bool(torch.isfinite(v).all()) for v in floats)  # the case in point
    opt2, _ = _stepped(cls, shape, steps=0, **opts)
    opt2.load_state_dict(sd)
    _same_bits(_bits(opt2.state_dict()), _bits(sd))


def _load_rejected(opt, w, sd, exc_type, match):
    """``load_state_dict(sd)`` raises ``exc_type`` matching ``match``; nothing changes."""
    before = _bits([[w], opt.state_dict()])
    with pytest.raises(exc_type, match=match):
        opt.load_state_dict(sd)
    _same_bits(_bits([[w], opt.state_dict()]), before)


@pytest.mark.parametrize("value", [2**53 + 1, 2**63 - 2, 5.0, torch.tensor(7.0), torch.tensor(2**62),
                                   np.int64(2**62 + 1), np.float32(3.0)])
def test_step_counters_load_exactly_up_to_int64(value):
    opt, w = _stepped()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = sd["state"][0]["global_step"] = value
    opt2, w2 = _stepped()
    opt2.load_state_dict(sd)
    want = int(value)
    assert opt2.state[w2]["step"] == want and opt2._global_step == want
    w2.grad = torch.randn_like(w2)
    opt2.step()  # the extension takes the counter
    assert opt2.state[w2]["step"] == want + 1


@pytest.mark.parametrize("value, match", [
    (2**63 - 1, "'step' 9223372036854775807 is out of range"), (2**63, "'step' .* out of range"),
    (2**70, "'step' .* out of range"), (float("nan"), "'step' must be an integer, got nan"),
    (float("inf"), "'step' must be an integer, got inf"), (2.5, "'step' must be an integer"),
])
def test_bad_step_counters_are_rejected_naming_the_parameter(value, match):
    opt, w = _stepped()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = sd["state"][0]["global_step"] = value
    _load_rejected(opt, w, sd, ValueError, "parameter 'w': state " + match)


def _bad_loads():
    def codes(make):
        return lambda sd: sd["state"][0].update(codes=make(sd["state"][0]["codes"]))

    yield "sparse", codes(lambda c: c.to_sparse()), "parameter 'w': state 'codes' must be a dense"
    yield "meta", codes(lambda c: torch.empty_like(c, device="meta")), "parameter 'w': state 'codes' is on the meta"
    for key in ("lr", "betas", "eps"):
        yield f"no {key}", (lambda k: lambda sd: sd["param_groups"][0].pop(k))(key), \
            f"parameter group 0: the saved group has no '{key}'"


@pytest.mark.parametrize("name, corrupt, match", list(_bad_loads()), ids=[c[0] for c in _bad_loads()])
def test_unclear_load_errors_name_the_parameter_or_group(name, corrupt, match):
    opt, w = _stepped()
    sd = copy.deepcopy(opt.state_dict())
    corrupt(sd)
    _load_rejected(opt, w, sd, ValueError, match)


@pytest.mark.parametrize("dtype", [d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")) if d is not None])
def test_unsupported_float_dtype_is_rejected_at_construction(dtype):
    p = torch.nn.Parameter(torch.randn(4, 8).to(dtype), requires_grad=False)
    with pytest.raises(ValueError, match=f"parameter 'w': dtype {dtype} is not supported"):
        gefen.Gefen([("w", p)], lr=1e-2)
    opt = gefen.Gefen([("v", torch.nn.Parameter(torch.randn(4, 8)))], lr=1e-2)
    with pytest.raises(ValueError, match="parameter 'w'"):
        opt.add_param_group({"params": [p], "param_names": ["w"]})
    assert len(opt.param_groups) == 1


def test_state_dict_of_a_resized_parameter_names_it():
    opt, w = _stepped()
    w.data = torch.randn(8, 8)
    before = _bits([w.detach(), dict(opt.state[w])])
    with pytest.raises(RuntimeError, match=r"parameter 'w': has shape \(8, 8\).*\(4, 8\)"):
        opt.state_dict()
    _same_bits(_bits([w.detach(), dict(opt.state[w])]), before)


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_parameter_listed_twice_is_named_by_each_entry():
    r = torch.nn.Parameter(torch.randn(4, 8))
    opt = gefen.Gefen([("a", r), ("b", r)], lr=1e-2)
    r.grad = torch.randn(4, 8)
    before = _bits([r.detach(), opt.state_dict()])
    for _ in range(2):
        with pytest.raises(ValueError, match="parameters 'a' and 'b' are the same tensor"):
            opt.step()
    _same_bits(_bits([r.detach(), opt.state_dict()]), before)


@pytest.mark.parametrize("option, value, match", [
    ("factored", "no", "factored must be a bool"), ("stochastic_round", "no", "stochastic_round must be a bool"),
    ("deterministic", 2, "deterministic must be a bool"), ("fused", "yes", "fused must be None or a bool"),
])
def test_on_off_options_are_not_coerced(option, value, match):
    """Strings and other ints are refused (bools, numpy bools and 0/1 are taken:
    test_on_off_options_take_bools_and_zero_one)."""
    with pytest.raises(TypeError, match=match):
        gefen.Gefen([torch.nn.Parameter(torch.randn(4, 8))], lr=1e-2, **{option: value})
    if option in ("factored", "stochastic_round"):  # a group's own value too
        with pytest.raises(TypeError, match=match):
            gefen.Gefen([{"params": [torch.nn.Parameter(torch.randn(4, 8))], option: value}], lr=1e-2)
        opt, w = _stepped()
        opt.param_groups[0][option] = value  # changed between steps: the step refuses
        w.grad = torch.randn_like(w)
        before = _bits([w.detach(), opt.state_dict()])
        with pytest.raises(TypeError, match=match):
            opt.step()
        _same_bits(_bits([w.detach(), opt.state_dict()]), before)


@pytest.mark.parametrize("trained", [False, True])
def test_overlapping_non_contiguous_parameters_are_rejected(trained):
    """Gefen's C plan checks contiguous parameters for overlap; views that are not
    contiguous (here two column slices of one matrix sharing columns 4-7) are checked
    in Python before anything changes (disjoint interleaved views still train:
    test_step_semantics.py::test_disjoint_views_of_one_storage_are_accepted)."""
    gen = torch.Generator().manual_seed(31)
    base = torch.randn(4, 12, generator=gen)
    a, b = torch.nn.Parameter(base[:, 0:8]), torch.nn.Parameter(base[:, 4:12])
    c = torch.nn.Parameter(torch.randn(4, 8, generator=gen))
    opt = gefen.Gefen([("c", c), ("a", a), ("b", b)], lr=1e-2)
    if trained:  # a and b have no gradient yet: not stepped, not checked
        c.grad = torch.randn(c.shape, generator=gen)
        opt.step()
    before, sd = _bits([c, a, b]), _bits(opt.state_dict())
    for p in (c, a, b):
        p.grad = torch.randn(p.shape, generator=gen)
    with pytest.raises(ValueError, match="'a' and 'b' overlap in memory"):
        opt.step()
    _same_bits(_bits([c, a, b]), before)
    _same_bits(_bits(opt.state_dict()), sd)


@pytest.mark.parametrize("value", [True, 0, 1, np.bool_(True), np.bool_(False)])
def test_on_off_options_take_bools_and_zero_one(value):
    w = torch.nn.Parameter(torch.randn(4, 8))
    opt = gefen.Gefen([w], lr=1e-2, factored=value, stochastic_round=value, deterministic=value)
    w.grad = torch.randn_like(w)
    opt.step()
    assert opt.state[w]["step"] == 1


@pytest.mark.parametrize("cls", [gefen.Gefen, gefen.GefenMuon])
def test_a_state_dict_loads_again_after_a_load_and_a_deepcopy(cls):
    """torch.optim's __setstate__ (run by a load's install and by unpickling) adds
    "differentiable" to the defaults; a later load must not ask the saved groups for it."""
    w = torch.nn.Parameter(torch.randn(4, 8))
    opt = cls([("w", w)], lr=1e-2)
    w.grad = torch.randn_like(w)
    opt.step()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    opt.load_state_dict(sd)
    copy.deepcopy(opt).load_state_dict(opt.state_dict())
    _same_bits(_bits(opt.state_dict()), _bits(sd))


def test_flattened_load_into_a_trained_optimizer_without_digests_names_prepare_load():
    """PyTorch's flattened load keeps only the keys the live state has: a trained
    optimizer that never called state_dict() has no digests yet. The error says what to
    do (gefen.dcp.prepare_load adds them), and that flow then loads exactly."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    ma, mb = _model(0), _model(1)
    oa, ob = gefen.Gefen(ma.named_parameters(), lr=1e-2), gefen.Gefen(mb.named_parameters(), lr=1e-2)
    _train(ma, oa, 2)
    _train(mb, ob, 2)
    sd = get_optimizer_state_dict(ma, oa, options=flat)
    before = _bits(dict(ob.state))
    with pytest.raises(ValueError, match=r"missing 'digest_rows'.*gefen\.dcp\.prepare_load"):
        set_optimizer_state_dict(mb, ob, sd, options=flat)
    _same_bits(_bits(dict(ob.state)), before)
    gefen.dcp.prepare_load(ob, sd)
    set_optimizer_state_dict(mb, ob, sd, options=flat)
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(oa.state[p]["codes"], ob.state[q]["codes"])
