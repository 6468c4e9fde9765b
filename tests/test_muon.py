"""gefen.GefenMuon against the pure-PyTorch oracle (tests/reference_muon.py) and against
torch.optim.Muon; its API, validation, state layout and checkpoints.

Quantised momentum (periods, codebook, codes, block magnitudes) must be bit-identical to
the oracle; orthogonalised updates agree within bf16 rounding (UPDATE_RTOL, relative
Frobenius norm), because torch's bf16 GEMMs accumulate in their own order.
"""

import inspect
import math

import pytest
import reference_muon as rm
import torch
from bitsnap import assert_same_bits as _assert_bits_equal
from bitsnap import bits as _bits

import gefen
from gefen import _C
from gefen.muon import NS_SCHEDULES, lr_ratio, newton_schulz

UPDATE_RTOL = 1e-2
LR = 0.02


# ------------------------------------------------------------------ helpers


def _pair(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    a = [torch.nn.Parameter(t.to(dtype).clone()) for t in base]
    b = [torch.nn.Parameter(t.to(dtype).clone()) for t in base]
    return a, b, gen


def _grads(shapes, gen, step, dtype=torch.float32):
    out = []
    for s in shapes:
        g = torch.randn(s, generator=gen, dtype=torch.float64)
        if step % 2 == 0 and s[1] % 8 == 0:
            # a scale per run of 8 elements: the period search then finds P = 8 < row
            scale = torch.exp(2 * torch.randn(g.numel() // 8, generator=gen, dtype=torch.float64))
            g = g * scale.repeat_interleave(8).reshape(s)
        out.append((g * 0.1).to(dtype))
    return out


def _derived_update(before, after, lr, wd, ratio):
    """O from p_after = p_before·(1 - lr·wd) - lr·ratio·O (fp64 arithmetic)."""
    return (before.double() * (1 - lr * wd) - after.double()) / (lr * ratio)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _assert_same_quantized_state(st, so):
    assert st["period"] == so["period"]
    assert st["step"] == so["step"] and st["global_step"] == so["global_step"]
    assert torch.equal(st["codebook"], so["codebook"])
    assert torch.equal(st["codes"], so["codes"]), "codes differ"
    assert torch.equal(st["magnitude"], so["magnitude"]), "magnitudes differ"
    if "v" in so:
        torch.testing.assert_close(st["v"], so["v"], rtol=2 * UPDATE_RTOL, atol=0)
    else:
        assert "v" not in st


def _snapshot(opt, params):
    return (
        [p.detach().clone() for p in params],
        {
            i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
            for i, p in enumerate(params)
            if p in opt.state
        },
        opt._global_step,
    )


def _assert_unchanged(opt, params, snap):
    values, states, global_step = snap
    for p, v in zip(params, values):
        assert torch.equal(p.detach(), v)
    now = {i: opt.state[p] for i, p in enumerate(params) if p in opt.state and opt.state[p]}
    assert set(now) == set(states)
    for i, st in states.items():
        assert set(now[i]) == set(st)
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(now[i][k], v), k
            else:
                assert now[i][k] == v, k
    assert opt._global_step == global_step


def _run_against_oracle(shapes, steps=3, dtype=torch.float32, weight_decay=0.05, **kw):
    pa, pb, gen = _pair(shapes, dtype, seed=len(shapes) * 7 + steps)
    opt = gefen.GefenMuon(pa, lr=LR, weight_decay=weight_decay, **kw)
    oracle = rm.RefGefenMuon(pb, lr=LR, weight_decay=weight_decay, **kw)
    for step in range(steps):
        before = [p.detach().clone() for p in pa]
        for p, q, g in zip(pa, pb, _grads(shapes, gen, step, dtype)):
            p.grad = g.clone()
            q.grad = g.clone()
        opt.step()
        oracle.step()
        for p, q, b in zip(pa, pb, before):
            _assert_same_quantized_state(opt.state[p], oracle.state[q])
            ratio = rm.lr_ratio_reference(kw.get("adjust_lr_fn"), *p.shape)
            mine = _derived_update(b, p.detach(), LR, weight_decay, ratio)
            theirs = oracle.last_update[q]
            if dtype == torch.float32:
                assert _rel(mine, theirs) < UPDATE_RTOL, _rel(mine, theirs)
    return opt, oracle, pa, pb


# ------------------------------------------------------------------ oracle

CONFIGS = {
    "default": {},
    "no_nesterov": {"nesterov": False},
    "normuon": {"normuon": True},
    "tuned3_rms": {"ns_schedule": "tuned3", "adjust_lr_fn": "match_rms_adamw"},
    "tuned4_original": {"ns_schedule": "tuned4", "adjust_lr_fn": "original", "momentum": 0.9},
    "explicit_schedule": {
        "ns_schedule": [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)],
        "normuon": True,
        "normuon_beta2": 0.9,
        "normuon_eps": 0.3,  # large enough that the bias correction of v shows
    },
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (13, 29)])
def test_matches_oracle(shape, config):
    _run_against_oracle([shape], **CONFIGS[config])


def test_matches_oracle_several_parameters_with_codebook_refresh():
    # refresh at steps 3 and 5: relearn from the current gradients and remap codes
    opt, _, pa, _ = _run_against_oracle(
        [(16, 48), (8, 24), (24, 8)], steps=5, codebook_refresh_every=2, normuon=True
    )
    assert any(opt.state[p]["period"] < p.shape[1] for p in pa), "no sub-row period exercised"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_matches_oracle_other_dtypes(dtype):
    opt, oracle, pa, pb = _run_against_oracle([(16, 40), (40, 16)], dtype=dtype)
    for p, q in zip(pa, pb):
        assert p.dtype == dtype
        # parameters are rounded to dtype after updates that differ by bf16 rounding
        torch.testing.assert_close(p.detach().double(), q.detach().double(), rtol=2**-7, atol=1e-3)


# ------------------------------------------------------- torch.optim.Muon


@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (16, 16)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_unquantized_oracle_is_torch_muon(shape, nesterov, adjust_lr_fn):
    """With quantization disabled the oracle's Newton–Schulz / LR path is torch's Muon."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    kw = dict(lr=LR, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    theirs = torch.optim.Muon([a], **kw)
    oracle = rm.RefGefenMuon([b], quantize=False, **kw)
    ratio = rm.lr_ratio_reference(adjust_lr_fn, *shape)
    for _ in range(3):
        g = torch.randn(shape, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        before = a.detach().clone()
        theirs.step()
        oracle.step()
        torch.testing.assert_close(
            oracle.state[b]["momentum_buffer"], theirs.state[a]["momentum_buffer"], rtol=1e-6, atol=1e-7
        )
        theirs_update = _derived_update(before, a.detach(), LR, 0.1, ratio)
        assert _rel(oracle.last_update[b], theirs_update) < UPDATE_RTOL
        b.data.copy_(a.data)  # keep the weights identical; compare one step at a time


def test_newton_schulz_is_torch_muons():
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

    gen = torch.Generator().manual_seed(2)
    for shape in [(10, 30), (30, 10), (17, 17)]:
        x = torch.randn(shape, generator=gen)
        coeffs = (3.4445, -4.7750, 2.0315)
        assert torch.equal(newton_schulz(x, [coeffs] * 5, 1e-7), torch_ns(x, coeffs, 5, 1e-7))
        for name, sched in NS_SCHEDULES.items():
            o = newton_schulz(x, sched, 1e-7)
            assert _rel(o, rm.ns_reference(x, sched, 1e-7)) < UPDATE_RTOL, name
    zero = newton_schulz(torch.zeros(4, 6), [(3.4445, -4.7750, 2.0315)] * 5, 1e-7)
    assert not bool(zero.any())


def test_lr_ratio_is_torch_muons():
    from torch.optim._muon import _adjust_lr

    for shape in [(3, 5), (5, 3), (7, 7)]:
        for fn in [None, "original", "match_rms_adamw"]:
            assert math.isclose(lr_ratio(fn, *shape), _adjust_lr(1.0, fn, torch.Size(shape)))


def test_gefen_muon_follows_torch_muon():
    """8-bit momentum changes the update only slightly: same direction as torch's Muon."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 40, generator=gen)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    mine, theirs = gefen.GefenMuon([a], lr=LR), torch.optim.Muon([b], lr=LR)
    for _ in range(5):
        g = torch.randn(24, 40, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        theirs.step()
    da, db = (a.detach() - w).flatten().double(), (b.detach() - w).flatten().double()
    assert float(torch.dot(da, db) / (da.norm() * db.norm())) > 0.99


def test_signature_and_defaults_are_torch_muons():
    ours = inspect.signature(gefen.GefenMuon).parameters
    for name, param in inspect.signature(torch.optim.Muon).parameters.items():
        assert name in ours, name
        assert ours[name].default == param.default, name
        assert ours[name].kind == param.kind, name
    assert list(ours)[: len(inspect.signature(torch.optim.Muon).parameters)] == list(
        inspect.signature(torch.optim.Muon).parameters
    )


# ------------------------------------------------------------- validation

BAD_HPARAMS = [
    (dict(lr=-1.0), "Invalid learning rate: -1.0"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    (dict(momentum=1.0), r"Invalid momentum value: 1.0 \(must lie in \[0, 1\)\)"),
    (dict(momentum=-0.1), r"Invalid momentum value: -0.1"),
    (dict(eps=0.0), r"Invalid eps: 0.0 \(must be finite and > 0\)"),
    (dict(ns_steps=0), r"ns_steps must be an int in \[1, 100\), got 0"),
    (dict(ns_steps=100), r"ns_steps must be an int in \[1, 100\), got 100"),
    (dict(ns_coefficients=(1.0, 2.0)), r"ns_coefficients must be three finite floats"),
    (dict(adjust_lr_fn="bogus"), r"adjust_lr_fn must be one of .*got 'bogus'"),
    (dict(ns_schedule="tuned5"), r"ns_schedule must be .*got 'tuned5'"),
    (dict(ns_schedule=[]), r"an explicit ns_schedule must be a list of 1 to 99"),
    (dict(ns_schedule=[(1.0, 2.0, float("nan"))]), r"ns_schedule\[0\] must be three finite floats"),
    (dict(normuon_beta2=1.0), r"Invalid normuon_beta2 value: 1.0"),
    (dict(normuon_eps=-1.0), r"Invalid normuon_eps: -1.0"),
    (dict(sharded_mode="sometimes"), r"sharded_mode must be one of .*got 'sometimes'"),
    (dict(nesterov="yes"), r"nesterov must be a bool, got 'yes'"),
]


@pytest.mark.parametrize(
    "kw, match", BAD_HPARAMS, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(BAD_HPARAMS)]
)
def test_invalid_hyperparameters(kw, match):
    with pytest.raises(ValueError, match=match):
        gefen.GefenMuon([torch.nn.Parameter(torch.randn(4, 4))], **kw)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4), ()])
def test_non_matrix_parameters_are_rejected(shape):
    params = [("w", torch.nn.Parameter(torch.randn(3, 3))), ("odd", torch.nn.Parameter(torch.randn(shape)))]
    with pytest.raises(ValueError, match="'odd'.*2-D"):
        gefen.GefenMuon(params)
    opt = gefen.GefenMuon([torch.nn.Parameter(torch.randn(3, 3))])
    with pytest.raises(ValueError, match="2-D"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(shape))]})
    assert len(opt.param_groups) == 1


def test_complex_parameters_are_rejected():
    with pytest.raises(ValueError, match="complex"):
        gefen.GefenMuon([torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))])


def _trained(normuon=False, steps=1, shapes=((6, 10), (10, 6)), **kw):
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = gefen.GefenMuon(params, lr=LR, normuon=normuon, **kw)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, params, gen


def test_sparse_gradient_fails_before_any_mutation():
    opt, params, gen = _trained()
    snap = _snapshot(opt, params)
    params[0].grad = torch.randn(params[0].shape, generator=gen)
    params[1].grad = torch.randn(params[1].shape, generator=gen).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    _assert_unchanged(opt, params, snap)


def test_invalid_group_value_set_after_construction_fails_before_mutation():
    opt, params, gen = _trained(codebook_refresh_every=1)  # the next step would remap codes
    snap = _snapshot(opt, params)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 4))], "momentum": 0.5})
    opt.param_groups[1]["params"][0].grad = torch.randn(4, 4)
    opt.param_groups[1]["momentum"] = 1.5
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    with pytest.raises(ValueError, match="momentum"):
        opt.step()
    _assert_unchanged(opt, params, snap)


def test_core_precheck_rejects_bad_items_without_writing():
    from gefen._items import MuonItem

    g = torch.randn(4, 6)
    codes = torch.full((4, 6), 7, dtype=torch.uint8)
    mag = torch.ones(4, 1)
    out = torch.zeros(4, 6, dtype=torch.bfloat16)

    def item(**changes):
        fields = dict(name="w", grad=g, codes=codes, magnitude=mag, out=out, period=6,
                      beta=0.9, nesterov=True)
        fields.update(changes)
        return MuonItem(**fields)

    _C.MuonStep([item()])
    def bad(**changes):  # a second item with its own output unless it says otherwise
        return item(**{"out": torch.zeros(4, 6, dtype=torch.bfloat16), **changes})

    bad_items = [
        (bad(period=4), ValueError, "'w'.*period 4 does not divide 6"),
        (bad(out=torch.zeros(4, 5, dtype=torch.bfloat16)), ValueError,
         "'w'.*momentum output has 20 elements, expected 24"),
        (bad(out=torch.zeros(4, 6, dtype=torch.float16)), TypeError,
         "'w'.*momentum output must be float32 or bfloat16"),
        (bad(beta=1.0), ValueError, "'w'.*momentum"),
        (bad(magnitude=torch.ones(4, 2)), ValueError, "'w'.*magnitude.*8 elements, expected 4"),
        (item(name="v"), ValueError, "'[wv]' and '[wv]' overlap in memory"),  # one output twice
    ]
    for bad, kind, message in bad_items:
        with pytest.raises(kind, match=message):
            _C.MuonStep([item(), bad])
    assert bool((codes == 7).all()) and bool((mag == 1).all()) and not bool(out.any())


# ------------------------------------------------------------------ state


@pytest.mark.parametrize("normuon", [False, True])
def test_state_layout(normuon):
    opt, params, _ = _trained(normuon=normuon, steps=2)
    group = opt.param_groups[0]
    assert group["gefen_kind"] == "gefen_muon" and isinstance(group["gefen_schema"], int)
    for p in params:
        st = opt.state[p]
        expected = {"step", "global_step", "period", "codes", "magnitude", "codebook"}
        assert set(st) == (expected | {"v"} if normuon else expected)
        assert isinstance(st["step"], int) and isinstance(st["period"], int) and st["step"] == 2
        assert st["global_step"] == 2
        assert st["codes"].dtype == torch.uint8 and st["codes"].shape == p.shape
        rows, cols = p.shape
        assert st["magnitude"].dtype == torch.float32
        assert st["magnitude"].shape == (rows, cols // st["period"])
        assert st["codebook"].shape == (256,) and st["codebook"] is opt.state[params[0]]["codebook"]
        if normuon:
            assert st["v"].dtype == torch.float32 and st["v"].shape == (rows,)


def test_zero_gradients_with_zero_lr_change_nothing():
    params = [torch.nn.Parameter(torch.randn(5, 7))]
    opt = gefen.GefenMuon(params, lr=0.0, normuon=True)
    params[0].grad = torch.zeros(5, 7)
    before = params[0].detach().clone()
    opt.step()
    assert not opt.state[params[0]] and opt._global_step == 0 and opt._codebook is None
    assert torch.equal(params[0].detach(), before)


def test_zero_element_and_gradless_parameters_are_skipped():
    params = [torch.nn.Parameter(torch.randn(0, 4)), torch.nn.Parameter(torch.randn(4, 4)),
              torch.nn.Parameter(torch.randn(3, 5))]
    opt = gefen.GefenMuon(params, lr=LR)
    params[0].grad = torch.zeros(0, 4)
    params[1].grad = torch.randn(4, 4)
    opt.step()
    assert params[0] not in opt.state and params[2] not in opt.state
    assert opt.state[params[1]]["step"] == 1


def test_non_contiguous_parameter_matches_contiguous():
    base = torch.randn(12, 8)
    a = torch.nn.Parameter(base.T.contiguous())
    b = torch.nn.Parameter(torch.empty(12, 8).copy_(base).T)  # a non-contiguous leaf
    assert not b.is_contiguous()
    oa, ob = gefen.GefenMuon([a], lr=LR), gefen.GefenMuon([b], lr=LR)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        g = torch.randn(8, 12, generator=gen)
        a.grad, b.grad = g.clone(), g.T.contiguous().T  # non-contiguous gradient too
        oa.step()
        ob.step()
    assert torch.equal(a.detach(), b.detach())


def test_sharded_modes_are_the_same_on_one_process():
    """sharded_mode decides how a *row-sharded* matrix is orthogonalised; on one process
    every matrix is whole, so the three modes must give the same bits (a mode that changed
    the single-process numbers would fail here). Their sharded behaviour -- collectives
    and results -- is tested in test_sharded.py (test_gefen_muon_modes_match_one_process,
    test_gefen_muon_approx_is_deterministic_and_sane)."""
    results = []
    for mode in ("exact", "distributed", "approx"):
        opt, params, _ = _trained(sharded_mode=mode, steps=2, normuon=True)
        assert opt.param_groups[0]["sharded_mode"] == mode
        results.append([p.detach().clone() for p in params])
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other))


def test_results_do_not_depend_on_the_thread_count():
    outs = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            gen = torch.Generator().manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(300, 257), (40, 600)]]
            opt = gefen.GefenMuon(params, lr=LR, normuon=True)
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
            outs.append([p.detach().clone() for p in params] + [opt.state[p]["codes"] for p in params])
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_closure_is_evaluated_and_its_loss_returned():
    p = torch.nn.Parameter(torch.randn(6, 6))
    opt = gefen.GefenMuon([p], lr=LR)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        p.grad = torch.ones(6, 6)
        return torch.tensor(3.0)

    before = p.detach().clone()
    assert opt.step(closure).item() == 3.0
    assert calls == [True]  # under enable_grad, as torch.optim does
    assert opt.state[p]["step"] == 1 and not torch.equal(p.detach(), before)


def _muon_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4, bias=False))


def _muon_batch(i):
    gen = torch.Generator().manual_seed(100 + i)
    x = torch.randn(32, 6, generator=gen)
    return x, torch.sin(x[:, :4])


@pytest.mark.parametrize("inf_at", [0, 2], ids=["first_step", "third_step"])
def test_grad_scaler_inf_step_leaves_everything_untouched(inf_at):
    """An inf step under GradScaler changes no parameter, state tensor, codebook or global
    step (no codebook is learned from it), and the steps after it are bitwise those of a
    run that never saw it (power-of-2 scales unscale exactly)."""
    model = _muon_model()
    ref_model = _muon_model()
    params, ref_params = list(model.parameters()), list(ref_model.parameters())
    opt = gefen.GefenMuon(params, lr=LR, normuon=True)
    ref = gefen.GefenMuon(ref_params, lr=LR, normuon=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    for i in range(5):
        x, y = _muon_batch(i)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if i == inf_at:
            params[1].grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        snap = _snapshot(opt, params)
        codebook = None if opt._codebook is None else opt._codebook.clone()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if i == inf_at:
            _assert_unchanged(opt, params, snap)  # parameters, state, global step
            assert (opt._codebook is None) == (codebook is None) == (i == 0)
            assert codebook is None or torch.equal(opt._codebook, codebook)
            assert scaler.get_scale() == scale / 2
            continue
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref_model(x), y).backward()
        ref.step()
        _assert_unchanged(opt, params, _snapshot(ref, ref_params))
    assert opt._global_step == ref._global_step == 4


def test_lr_scheduler_and_tensor_lr():
    params = [torch.nn.Parameter(torch.randn(6, 6))]
    opt = gefen.GefenMuon(params, lr=torch.tensor(0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for _ in range(2):
        params[0].grad = torch.randn(6, 6)
        opt.step()
        sched.step()
    assert math.isclose(float(opt.param_groups[0]["lr"]), 0.025, rel_tol=1e-6)


# ------------------------------------------------------------- checkpoints


def _assert_twins_train_identically(opt, params, twin, twin_params, gen, steps):
    """Both optimizers step on the same gradients; parameters and codes stay bitwise equal."""
    for _ in range(steps):
        for p, q in zip(params, twin_params):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    for p, q in zip(params, twin_params):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(opt.state[p]["codes"], twin.state[q]["codes"])


@pytest.mark.parametrize("normuon", [False, True])
def test_state_dict_round_trip_continues_identically(normuon):
    opt, params, gen = _trained(normuon=normuon, steps=2)
    sd = opt.state_dict()
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = gefen.GefenMuon(clones, lr=1.0)  # hyper-parameters come from the state dict
    other.load_state_dict(sd)
    assert other.param_groups[0]["lr"] == LR and other.param_groups[0]["normuon"] == normuon
    _assert_twins_train_identically(opt, params, other, clones, gen, steps=2)


def test_deepcopy_and_pickle_keep_training_identically():
    import copy
    import pickle

    opt, params, gen = _trained(normuon=True, steps=2, codebook_refresh_every=2)
    twin_params, twin = copy.deepcopy((params, opt))  # one memo: the copy steps the copies
    restored = pickle.loads(pickle.dumps(opt))
    assert restored._global_step == 2 and torch.equal(restored._codebook, opt._codebook)
    assert twin.param_groups[0]["params"][0] is twin_params[0]
    _assert_twins_train_identically(opt, params, twin, twin_params, gen, steps=3)  # crosses a refresh


def _corrupt(sd, fn):
    sd = {
        "state": {k: dict(v) for k, v in sd["state"].items()},
        "param_groups": [dict(g) for g in sd["param_groups"]],
    }
    fn(sd)
    return sd


CORRUPTIONS = {
    # name: (corruption, the message load_state_dict must raise)
    "gefen_kind": (lambda sd: sd["param_groups"][0].update(gefen_kind="gefen"),
                   "optimizer kind 'gefen', not 'gefen_muon'"),
    "missing_v": (lambda sd: sd["state"][1].pop("v"), r"'param_groups\[0\]\[1\]'.*lacks NorMuon's row moment 'v'"),
    "negative_v": (lambda sd: sd["state"][1].update(v=-sd["state"][1]["v"]),
                   r"'param_groups\[0\]\[1\]'.*'v' holds negative values"),
    "codes_dtype": (lambda sd: sd["state"][0].update(codes=sd["state"][0]["codes"].int()),
                    r"'param_groups\[0\]\[0\]'.*'codes' has dtype torch.int32, expected torch.uint8"),
    "magnitude_shape": (lambda sd: sd["state"][0].update(magnitude=torch.zeros(1, 1)),
                        r"'param_groups\[0\]\[0\]'.*'magnitude' has shape \(1, 1\), expected \(6, 1\)"),
    "bad_schedule": (lambda sd: sd["param_groups"][0].update(ns_schedule="tuned9"),
                     "ns_schedule must be .*got 'tuned9'"),
    "unknown_key": (lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(1)),
                    r"'param_groups\[0\]\[0\]'.*unknown keys \['momentum_buffer'\]"),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_bad_state_dict_leaves_optimizer_untouched(what):
    corrupt, match = CORRUPTIONS[what]
    opt, params, _ = _trained(normuon=True, steps=1)
    good = opt.state_dict()
    other, oparams, _ = _trained(normuon=True, steps=2)
    snap = _snapshot(other, oparams)
    groups_before = [dict(g) for g in other.param_groups]
    with pytest.raises(ValueError, match=match):
        other.load_state_dict(_corrupt(good, corrupt))
    _assert_unchanged(other, oparams, snap)
    assert [dict(g) for g in other.param_groups] == groups_before


def test_chunked_momentum_buffer_reuse_gives_identical_results(monkeypatch):
    """The Newton–Schulz inputs of successive chunks share one buffer; splitting the
    parameters into many chunks must not change any result."""
    import gefen.muon as gm

    def run():
        gen = torch.Generator().manual_seed(11)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(12, 8), (8, 20), (16, 16)]]
        opt = gefen.GefenMuon(params, lr=0.02, normuon=True)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return [p.detach().clone() for p in params], [opt.state[p]["codes"].clone() for p in params]

    one_chunk = run()
    monkeypatch.setattr(gm, "_CHUNK_ELEMENTS", 100)  # every parameter its own chunk
    many_chunks = run()
    for a, b in zip(one_chunk[0] + one_chunk[1], many_chunks[0] + many_chunks[1]):
        assert torch.equal(a, b)


# ------------------------------------------- fail before mutation: live inputs




@pytest.mark.parametrize("new_shape", [(8, 2, 8), (16, 8)])
def test_parameter_reshaped_between_steps_fails_before_mutation(new_shape):
    gen = torch.Generator().manual_seed(21)
    a = torch.nn.Parameter(torch.randn(8, 16, generator=gen))
    c = torch.nn.Parameter(torch.randn(16, 8, generator=gen))
    opt = gefen.GefenMuon([("a", a), ("c", c)], lr=LR, normuon=True)
    for _ in range(2):
        for p in (a, c):
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    sd, values = _bits(opt.state_dict()), _bits([a, c])
    original = a.data
    a.data = original.reshape(new_shape).clone()
    for p in (a, c):
        p.grad = torch.randn(p.shape, generator=gen)
    with pytest.raises(ValueError, match=r"parameter 'a'.*(2-D|shape changed)"):
        opt.step()
    assert torch.equal(a.detach().reshape(8, 16), original)
    a.data = original
    _assert_bits_equal(_bits([a, c]), values)
    _assert_bits_equal(_bits(opt.state_dict()), sd)


def _overlap_case(case):
    base = torch.randn(12, 8, generator=torch.Generator().manual_seed(22))
    if case == "rows":
        return torch.nn.Parameter(base[0:8]), torch.nn.Parameter(base[4:12])
    if case == "columns":  # non-contiguous views whose columns overlap
        return torch.nn.Parameter(base[:, 0:6]), torch.nn.Parameter(base[:, 2:8])
    if case == "transposed":
        return torch.nn.Parameter(base.T), torch.nn.Parameter(base[3:5, 1:4])
    p = torch.nn.Parameter(base.clone())
    return p, p  # "twice": the same parameter listed twice


@pytest.mark.parametrize("case", ["rows", "columns", "transposed", "twice"])
@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
def test_overlapping_or_duplicate_parameters_fail_before_mutation(case, trained):
    gen = torch.Generator().manual_seed(23)
    c = torch.nn.Parameter(torch.randn(6, 10, generator=gen))
    a, b = _overlap_case(case)
    opt = gefen.GefenMuon([("c", c), ("a", a), ("b", b)], lr=LR, weight_decay=0.5)
    if trained:  # a and b have no gradient yet: not stepped, not checked
        c.grad = torch.randn(c.shape, generator=gen)
        opt.step()
    sd, values = _bits(opt.state_dict()), _bits([c, a, b])
    snap = _snapshot(opt, [c, a, b])
    for p in (c, a, b):
        p.grad = torch.randn(p.shape, generator=gen)
    match = "'a' and 'b' are the same tensor" if case == "twice" else "'a' and 'b' overlap in memory"
    with pytest.raises(ValueError, match=match):
        opt.step()
    _assert_bits_equal(_bits([c, a, b]), values)
    _assert_bits_equal(_bits(opt.state_dict()), sd)
    _assert_unchanged(opt, [c, a, b], snap)


def test_duplicate_parameter_across_groups_is_rejected():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="more than one parameter group"):
        gefen.GefenMuon([{"params": [p]}, {"params": [p]}])


BAD_STEP_STATE = {
    # name: (corruption of the second parameter's state, the message)
    "step_str": (lambda st: st.update(step="1"), r"state 'step' must be an int"),
    "step_float": (lambda st: st.update(step=1.5), r"state 'step' must be an int"),
    "step_bool": (lambda st: st.update(step=True), r"state 'step' must be an int"),
    "step_negative": (lambda st: st.update(step=-1), r"state 'step' must be an int >= 0"),
    "step_missing": (lambda st: st.pop("step"), r"state 'step' must be an int"),
    "period_str": (lambda st: st.update(period="2"), r"state 'period' must be an int"),
    "period_not_divisor": (lambda st: st.update(period=4), r"state 'period' must be an int dividing 6"),
    "codes_dtype": (lambda st: st.update(codes=st["codes"].int()), r"state 'codes' is torch.int32"),
    "magnitude_missing": (lambda st: st.pop("magnitude"), r"state 'magnitude' must be a tensor"),
    "v_shape": (lambda st: st.update(v=torch.zeros(3)), r"state 'v' is torch.float32 \(3,\)"),
    "v_dtype": (lambda st: st.update(v=st["v"].double()), r"state 'v' is torch.float64"),
}


@pytest.mark.parametrize("what", list(BAD_STEP_STATE))
def test_bad_live_state_fails_before_mutation(what):
    corrupt, match = BAD_STEP_STATE[what]
    opt, params, gen = _trained(normuon=True, steps=1)
    corrupt(opt.state[params[1]])
    snap = _snapshot(opt, params)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    with pytest.raises(ValueError, match=r"parameter 'param_groups\[0\]\[1\]': " + match):
        opt.step()
    _assert_unchanged(opt, params, snap)
