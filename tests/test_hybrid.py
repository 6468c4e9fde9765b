"""gefen.GefenMuonHybrid: routing, the composite optimizer contract (live param_groups,
state view, LR schedulers, GradScaler), all-or-nothing step and load, and the flat
state dict through torch.distributed.checkpoint's state-dict helpers on one process."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import gefen
import gefen.dcp
from gefen.hybrid import HYBRID_SCHEMA

BACKUPS = ["gefen", "adamw"]
LR = 1e-2


class TinyLM(nn.Module):
    """Every kind of parameter the routing rule distinguishes."""

    def __init__(self, vocab=24, d=8):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)  # caught by the module rule only
        self.wpe = nn.Embedding(6, d)  # caught by name
        self.blocks = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
        self.norm = nn.LayerNorm(d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.classifier = nn.Linear(d, 3)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.tokens.weight  # a tied head whose name says nothing

    def forward(self, x):
        h = self.tokens(x) + self.wpe(torch.arange(x.shape[1]))
        h = self.norm(self.blocks(h))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.out(h).logsumexp(-1).mean() + self.classifier(h).pow(2).mean()


EXPECTED_ROUTING = (
    ("tokens.weight", "backup"),
    ("wpe.weight", "backup"),
    ("blocks.0.weight", "muon"),
    ("blocks.0.bias", "backup"),
    ("blocks.2.weight", "muon"),
    ("blocks.2.bias", "backup"),
    ("norm.weight", "backup"),
    ("norm.bias", "backup"),
    ("conv.weight", "backup"),
    ("conv.bias", "backup"),
    ("classifier.weight", "backup"),
    ("classifier.bias", "backup"),
)


def _model(seed=0):
    torch.manual_seed(seed)
    return TinyLM()


def _batch(gen):
    return torch.randint(0, 24, (3, 5), generator=gen)


def _train(model, opt, gen, steps):
    for _ in range(steps):
        opt.zero_grad()
        model(_batch(gen)).backward()
        opt.step()


def _twins(backup, seed=0, **kw):
    a = _model(seed)
    b = copy.deepcopy(a)
    return a, gefen.GefenMuonHybrid(a, lr=LR, backup_optimizer=backup, **kw), b


def _params_equal(a, b):
    return all(torch.equal(p.detach(), q.detach()) for p, q in zip(a.parameters(), b.parameters()))


def _freeze(opt):
    """Everything observable about an optimizer's state and groups (deep copies)."""
    groups = [{k: (v if k == "params" else copy.deepcopy(v)) for k, v in g.items()} for g in opt.param_groups]
    state = {
        id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        for p, st in opt.state.items()
        if st
    }
    return groups, state


def _assert_frozen(opt, frozen):
    groups, state = frozen
    now_groups, now_state = _freeze(opt)
    assert len(now_groups) == len(groups)
    for g, h in zip(now_groups, groups):
        assert g.keys() == h.keys()
        for k in g:
            if k == "params":
                assert all(p is q for p, q in zip(g[k], h[k]))
            else:
                assert g[k] == h[k], k
    assert now_state.keys() == state.keys()
    for pid, st in state.items():
        assert now_state[pid].keys() == st.keys()
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(now_state[pid][k], v), k
            else:
                assert now_state[pid][k] == v, k


# ------------------------------------------------------------------ routing


def test_routing_from_module_catches_embeddings_and_tied_heads():
    model = _model()
    opt = gefen.GefenMuonHybrid(model, lr=LR)
    assert opt.parameter_routing() == EXPECTED_ROUTING
    roles = [g["role"] for g in opt.param_groups]
    assert roles == sorted(roles, key=["muon", "backup"].index)  # Muon first
    muon_params = {id(p) for g in opt.param_groups if g["role"] == "muon" for p in g["params"]}
    assert muon_params == {id(model.blocks[0].weight), id(model.blocks[2].weight)}
    assert id(model.out.weight) not in muon_params  # the tied head is the embedding
    for g in opt.param_groups:
        assert g["gefen_hybrid"] == HYBRID_SCHEMA
        expect_wd = 0.0 if any("bias" in n or "norm" in n for n in g["param_names"]) else 0.1
        assert g["weight_decay"] == expect_wd
        assert all(("bias" in n or "norm" in n) == (expect_wd == 0.0) for n in g["param_names"])


def test_routing_from_named_parameters_uses_names_and_shapes():
    model = _model()
    opt = gefen.GefenMuonHybrid(model.named_parameters(), lr=LR)
    routing = dict(opt.parameter_routing())
    # without the module the embedding is an ordinary 2-D name: that is why the
    # module form exists
    assert routing["tokens.weight"] == "muon"
    assert {k: v for k, v in routing.items() if k != "tokens.weight"} == {
        k: v for k, v in EXPECTED_ROUTING if k != "tokens.weight"
    }


def test_explicit_lists():
    model = _model()
    muon = [model.blocks[0].weight, model.blocks[2].weight]
    backup = [p for p in model.parameters() if all(p is not q for q in muon)]
    opt = gefen.GefenMuonHybrid(muon, backup, lr=LR)
    assert opt.parameter_routing()[:3] == (
        ("muon_params[0]", "muon"), ("muon_params[1]", "muon"), ("backup_params[0]", "backup"),
    )
    assert [p for g in opt.muon.param_groups for p in g["params"]] == muon
    named = gefen.GefenMuonHybrid([("a", model.conv.weight.new_zeros(4, 4).requires_grad_())], [], lr=LR)
    assert named.backup is None and named.parameter_routing() == (("a", "muon"),)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda m: gefen.GefenMuonHybrid([m.norm.weight], [m.conv.weight], lr=LR), ValueError,
         r"only supports 2-D parameters, got shape \(8,\)"),  # 1-D Muon
        (lambda m: gefen.GefenMuonHybrid(list(m.parameters()), lr=LR), TypeError,
         "routes by name"),  # no names
        (lambda m: gefen.GefenMuonHybrid([{"params": list(m.parameters())}], lr=LR), TypeError,
         "routes by name"),
        (lambda m: gefen.GefenMuonHybrid(m, lr=LR, backup_optimizer="sgd"), ValueError,
         "backup_optimizer must be one of .*got 'sgd'"),
        (lambda m: gefen.GefenMuonHybrid(m, lr=LR, no_decay_substrings="bias"), TypeError,
         "no_decay_substrings must be a sequence of strings"),
        (lambda m: gefen.GefenMuonHybrid(m, [], lr=LR), TypeError,
         "backup_params is only for the explicit"),
        (lambda m: gefen.GefenMuonHybrid([], lr=LR), ValueError, "empty parameter list"),
        (lambda m: gefen.GefenMuonHybrid(m.named_parameters(remove_duplicate=False), lr=LR), ValueError,
         "'out.weight' is the same tensor as 'tokens.weight'"),
        (lambda m: gefen.GefenMuonHybrid(m, lr=LR, ns_schedule="tuned7"), ValueError,
         "ns_schedule must be .*got 'tuned7'"),
        (lambda m: gefen.GefenMuonHybrid(m, lr=LR, betas=(0.9, 1.0)), ValueError,
         "Invalid beta parameter at index 1"),
        (lambda m: gefen.GefenMuonHybrid(m), TypeError, "'lr'"),  # lr is required
    ],
)
def test_construction_errors(make, error, match):
    with pytest.raises(error, match=match):
        make(_model())


def test_complex_parameters_are_rejected():
    p = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex"):
        gefen.GefenMuonHybrid([("w", nn.Parameter(torch.zeros(3, 3))), ("c", p)], lr=LR)


@pytest.mark.parametrize("backup", BACKUPS)
def test_children_and_options(backup):
    opt = gefen.GefenMuonHybrid(
        _model(), lr=LR, backup_optimizer=backup, muon_lr=0.05, backup_weight_decay=0.01,
        betas=(0.8, 0.95), eps=1e-6,
    )
    assert isinstance(opt, torch.optim.Optimizer)
    assert isinstance(opt.muon, gefen.GefenMuon)
    if backup == "gefen":
        assert isinstance(opt.backup, gefen.Gefen)
        assert all(g["factored"] is False for g in opt.backup.param_groups)
    else:
        assert type(opt.backup) is torch.optim.AdamW
    mg = opt.muon.param_groups[0]
    assert (mg["ns_schedule"], mg["normuon"], mg["adjust_lr_fn"]) == ("standard", True, "match_rms_adamw")
    assert mg["lr"] == 0.05 and mg["weight_decay"] == 0.1
    decayed = [g for g in opt.backup.param_groups if g["weight_decay"] != 0.0]
    assert decayed and all(g["weight_decay"] == 0.01 and g["lr"] == LR for g in decayed)
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in opt.backup.param_groups)
    with pytest.raises(RuntimeError, match="routes parameters at construction"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]})


# ------------------------------------------------------------------- step


@pytest.mark.parametrize("backup", BACKUPS)
def test_step_is_the_children_stepping(backup):
    a, hybrid, b = _twins(backup)
    by_name = dict(b.named_parameters())
    children = []
    for child in hybrid._children:
        groups = [
            {"params": [by_name[n] for n in g["param_names"]], "weight_decay": g["weight_decay"]}
            for g in child.param_groups
        ]
        if child is hybrid.muon:
            children.append(gefen.GefenMuon(groups, lr=LR, ns_schedule="standard", normuon=True,
                                            adjust_lr_fn="match_rms_adamw"))
        elif backup == "gefen":
            children.append(gefen.Gefen(groups, lr=LR, factored=False))
        else:
            children.append(torch.optim.AdamW(groups, lr=LR))
    ga, gb = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(3):
        hybrid.zero_grad()
        a(_batch(ga)).backward()
        loss = hybrid.step(closure=lambda: torch.tensor(1.5))
        assert float(loss) == 1.5
        for c in children:
            c.zero_grad()
        b(_batch(gb)).backward()
        for c in children:
            c.step()
    assert _params_equal(a, b)
    assert not _params_equal(a, _model())


@pytest.mark.parametrize("backup", BACKUPS)
def test_param_groups_are_live_and_lr_schedulers_work(backup):
    model = _model()
    opt = gefen.GefenMuonHybrid(model, lr=LR, backup_optimizer=backup, muon_lr=0.04)
    children_groups = opt.muon.param_groups + opt.backup.param_groups
    assert all(g is h for g, h in zip(opt.param_groups, children_groups))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for _ in range(2):
            _train(model, opt, gen, 1)
            sched.step()
    assert all(abs(g["lr"] - 0.01) < 1e-12 for g in opt.muon.param_groups)
    assert all(abs(g["lr"] - LR / 4) < 1e-12 for g in opt.backup.param_groups)
    calls = []
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(o))
    _train(model, opt, gen, 1)
    assert calls == [opt]
    with pytest.raises(AttributeError, match="cannot be replaced"):
        opt.param_groups = []


@pytest.mark.parametrize("backup", BACKUPS)
def test_state_is_a_view_over_both_children(backup):
    model = _model()
    opt = gefen.GefenMuonHybrid(model, lr=LR, backup_optimizer=backup)
    assert len(opt.state) == 0 and not opt.state
    _train(model, opt, torch.Generator().manual_seed(0), 1)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(opt.state) == len(params) and set(map(id, opt.state)) == set(map(id, params))
    w = model.blocks[0].weight
    assert opt.state[w] is opt.muon.state[w] and "codes" in opt.state[w]
    assert opt.state[model.conv.weight] is opt.backup.state[model.conv.weight]
    stranger = nn.Parameter(torch.zeros(2))
    assert stranger not in opt.state and opt.state.get(stranger) is None
    with pytest.raises(KeyError, match="Parameter containing"):  # the key itself
        opt.state[stranger]


def _step_after_warmup(backup, seed=0):
    model = _model(seed)
    opt = gefen.GefenMuonHybrid(model, lr=LR, backup_optimizer=backup)
    gen = torch.Generator().manual_seed(0)
    _train(model, opt, gen, 1)
    opt.zero_grad()
    model(_batch(gen)).backward()
    return model, opt


@pytest.mark.parametrize("backup", BACKUPS)
def test_bad_backup_gradient_stops_both_children(backup):
    model, opt = _step_after_warmup(backup)
    frozen = [_freeze(c) for c in opt._children]
    values = [p.detach().clone() for p in model.parameters()]
    model.conv.bias.grad = model.conv.bias.grad.to_sparse()  # the backup's, checked last
    with pytest.raises(RuntimeError, match="conv.bias.*sparse"):
        opt.step()
    for c, f in zip(opt._children, frozen):
        _assert_frozen(c, f)
    assert all(torch.equal(p.detach(), v) for p, v in zip(model.parameters(), values))


@pytest.mark.parametrize(
    "backup, role, key, value, match",
    [
        ("gefen", "backup", "betas", (0.9, 1.5), "beta"),
        ("adamw", "muon", "momentum", 1.0, "momentum"),
        ("gefen", "muon", "ns_schedule", "tuned9", "ns_schedule"),
    ],
)
def test_bad_group_value_stops_both_children(backup, role, key, value, match):
    model, opt = _step_after_warmup(backup)
    next(g for g in opt.param_groups if g["role"] == role)[key] = value
    frozen = [_freeze(c) for c in opt._children]
    values = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        opt.step()
    for c, f in zip(opt._children, frozen):
        _assert_frozen(c, f)
    assert all(torch.equal(p.detach(), v) for p, v in zip(model.parameters(), values))


def test_core_precheck_of_the_backup_runs_before_muon_steps():
    # two backup parameters sharing memory: only Gefen's C pre-check (adam_validate) sees it
    storage = torch.zeros(10)
    b1, b2 = nn.Parameter(storage[:6]), nn.Parameter(storage[4:])
    w = nn.Parameter(torch.randn(4, 6))
    opt = gefen.GefenMuonHybrid([("w", w)], [("b1", b1), ("b2", b2)], lr=LR)
    for p in (w, b1, b2):
        p.grad = torch.randn_like(p)
    before = w.detach().clone()
    with pytest.raises(ValueError, match="overlap"):
        opt.step()
    assert torch.equal(w.detach(), before) and len(opt.state) == 0
    assert opt.muon._global_step == 0 and opt.muon._codebook is None


@pytest.mark.parametrize("backup", BACKUPS)
def test_grad_scaler_overflow_skips_both_children(backup):
    model = _model()
    opt = gefen.GefenMuonHybrid(model, lr=LR, backup_optimizer=backup)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    gen = torch.Generator().manual_seed(0)
    values = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    scaler.scale(model(_batch(gen))).backward()
    model.norm.bias.grad[0] = float("inf")  # a backup gradient overflows
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < 2.0**8
    assert all(torch.equal(p.detach(), v) for p, v in zip(model.parameters(), values))
    assert len(opt.state) == 0
    opt.zero_grad()
    scaler.scale(model(_batch(gen))).backward()
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(p.detach(), v) for p, v in zip(model.parameters(), values))
    assert opt.muon._global_step == 1


# ------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("backup", BACKUPS)
def test_flat_state_dict(backup):
    model = _model()
    opt = gefen.GefenMuonHybrid(model, lr=LR, backup_optimizer=backup)
    _train(model, opt, torch.Generator().manual_seed(0), 2)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    assert ids == list(range(len(EXPECTED_ROUTING)))
    assert sorted(sd["state"]) == ids
    params = [p for g in opt.param_groups for p in g["params"]]
    digests = {"digest_rows", "digest"}
    for i, p in enumerate(params):
        gefen_state = "codes" in opt.state[p]
        assert sd["state"][i].keys() == opt.state[p].keys() | (digests if gefen_state else set())
        for k, v in opt.state[p].items():  # copies: an in-place loader cannot touch live state
            if isinstance(v, torch.Tensor):
                assert torch.equal(sd["state"][i][k], v) and sd["state"][i][k] is not v
    kinds = [(g["role"], g.get("gefen_kind")) for g in sd["param_groups"]]
    backup_kind = "gefen" if backup == "gefen" else None
    assert kinds == [("muon", "gefen_muon")] + [("backup", backup_kind)] * (len(kinds) - 1)
    assert all(g["gefen_hybrid"] == HYBRID_SCHEMA for g in sd["param_groups"])


@pytest.mark.parametrize("backup", BACKUPS)
def test_state_dict_round_trip_continues_identically(backup):
    a, opt_a, _ = _twins(backup)
    gen = torch.Generator().manual_seed(0)
    _train(a, opt_a, gen, 2)
    sd = copy.deepcopy(opt_a.state_dict())
    b = copy.deepcopy(a)
    opt_b = gefen.GefenMuonHybrid(b, lr=1.0, backup_optimizer=backup)  # lrs come from sd
    opt_b.load_state_dict(sd)
    assert [g["lr"] for g in opt_b.param_groups] == [g["lr"] for g in opt_a.param_groups]
    ga, gb = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    _train(a, opt_a, ga, 2)
    _train(b, opt_b, gb, 2)
    assert _params_equal(a, b)


@pytest.mark.parametrize("backup", BACKUPS)
def test_deepcopy_and_pickle_keep_training_identically(backup):
    import pickle

    model = _model()
    opt = gefen.GefenMuonHybrid(model, lr=LR, backup_optimizer=backup)
    _train(model, opt, torch.Generator().manual_seed(0), 2)
    twin_model, twin = copy.deepcopy((model, opt))  # one memo: the copy steps the copied model
    restored = pickle.loads(pickle.dumps(opt))
    assert [g["lr"] for g in restored.param_groups] == [g["lr"] for g in opt.param_groups]
    assert restored.muon._global_step == 2
    _train(model, opt, torch.Generator().manual_seed(4), 2)
    _train(twin_model, twin, torch.Generator().manual_seed(4), 2)
    assert _params_equal(model, twin_model)


def _bad(sd, fn):
    sd = copy.deepcopy(sd)
    fn(sd)
    return sd


def _first(sd, role):
    return next(i for g in sd["param_groups"] if g["role"] == role for i in g["params"])


LOAD_FAILURES = {
    # (backup of the saving and of the loading hybrid, corruption, message)
    "bad_backup_half": ("gefen", "gefen",
                        lambda sd: sd["state"][_first(sd, "backup")].update(magnitude=torch.zeros(1, 1)),
                        "magnitude"),
    "bad_muon_half": ("adamw", "adamw",
                      lambda sd: sd["state"][_first(sd, "muon")].pop("v"), "lacks NorMuon's row moment 'v'"),
    "role": ("gefen", "gefen", lambda sd: sd["param_groups"][0].update(role="backup"), "role"),
    "header": ("gefen", "gefen", lambda sd: sd["param_groups"][1].pop("gefen_hybrid"), "gefen_hybrid"),
    "group_count": ("gefen", "gefen", lambda sd: sd["param_groups"].pop(), "groups"),
    "unknown_id": ("gefen", "gefen", lambda sd: sd["state"].update({99: {}}), "99"),
    "backup_kind": ("gefen", "adamw", lambda sd: None, "saved by"),
    "muon_group_size": ("adamw", "adamw", lambda sd: sd["param_groups"][0]["params"].pop(), "parameters"),
}


@pytest.mark.parametrize("what", list(LOAD_FAILURES))
def test_bad_load_leaves_both_children_untouched(what):
    saving, loading, corrupt, match = LOAD_FAILURES[what]
    a = _model()
    opt_a = gefen.GefenMuonHybrid(a, lr=LR, backup_optimizer=saving)
    _train(a, opt_a, torch.Generator().manual_seed(0), 1)
    b = _model(1)
    opt_b = gefen.GefenMuonHybrid(b, lr=LR, backup_optimizer=loading)
    _train(b, opt_b, torch.Generator().manual_seed(1), 2)
    frozen = [_freeze(c) for c in opt_b._children]
    group_objects = [g for g in opt_b.param_groups]
    with pytest.raises(ValueError, match=match):
        opt_b.load_state_dict(_bad(opt_a.state_dict(), corrupt))
    for c, f in zip(opt_b._children, frozen):
        _assert_frozen(c, f)
    assert all(g is h for g, h in zip(opt_b.param_groups, group_objects))


# ------------------------------------------------------------------- DCP


@pytest.mark.parametrize("backup", BACKUPS)
@pytest.mark.parametrize("flatten", [False, True])
def test_dcp_state_dict_helpers_on_one_process(backup, flatten):
    assert not torch.distributed.is_initialized()
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    a = _model()
    opt_a = gefen.GefenMuonHybrid(a, lr=LR, backup_optimizer=backup)
    _train(a, opt_a, torch.Generator().manual_seed(0), 2)
    osd = get_optimizer_state_dict(a, opt_a, options=options)
    if flatten:
        assert "state.blocks.0.weight.codes" in osd and "param_groups.blocks.0.weight.role" in osd
    else:
        assert "blocks.0.weight" in osd["state"] and osd["param_groups"][0]["role"] == "muon"
    osd = copy.deepcopy(osd)

    b = copy.deepcopy(a)
    opt_b = gefen.GefenMuonHybrid(b, lr=1.0, backup_optimizer=backup)
    if flatten:
        # a flattened load restores only the keys the live optimizer already has
        # (DESIGN.md §5): without its layout, the load refuses instead of dropping state
        with pytest.raises(ValueError, match="holds state for .* but 0 arrived.*prepare_load"):
            set_optimizer_state_dict(b, opt_b, osd, options=options)
        gefen.dcp.prepare_load(opt_b, osd)
    set_optimizer_state_dict(b, opt_b, osd, options=options)
    assert [g["lr"] for g in opt_b.param_groups] == [g["lr"] for g in opt_a.param_groups]
    assert opt_b.muon._global_step == opt_a.muon._global_step == 2
    ga, gb = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    _train(a, opt_a, ga, 2)
    _train(b, opt_b, gb, 2)
    assert _params_equal(a, b)
    assert not torch.distributed.is_initialized()


def test_dcp_on_a_fresh_hybrid_learns_and_counts_nothing():
    model = _model()
    values = [p.detach().clone() for p in model.parameters()]
    opt = gefen.GefenMuonHybrid(model, lr=LR)
    osd = get_optimizer_state_dict(model, opt)
    assert osd["state"] == {} and len(osd["param_groups"]) == len(opt.param_groups)
    assert opt.muon._codebook is None and opt.backup._codebook is None
    assert opt.muon._global_step == 0 and opt.backup._global_step == 0
    assert [g["lr"] for g in opt.param_groups] == [LR] * len(opt.param_groups)
    assert all(torch.equal(p.detach(), v) for p, v in zip(model.parameters(), values))


def test_dcp_flattened_load_with_parameters_that_never_had_state():
    """DCP reads ``optim.state[p]`` for every parameter, creating empty entries for those
    without state; the hybrid treats an empty entry as "no state"."""
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model = _model()
    opt = gefen.GefenMuonHybrid(model, lr=LR)
    idle = [model.blocks[2].weight, model.classifier.bias]  # one per child
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        opt.zero_grad()
        model(_batch(gen)).backward()
        for p in idle:
            p.grad = None
        opt.step()
    assert all(p not in opt.state for p in idle)
    osd = get_optimizer_state_dict(model, opt, options=options)
    set_optimizer_state_dict(model, opt, osd, options=options)
    assert all(not opt.state.get(p) for p in idle)
    assert all(k in osd for k in ("state.blocks.0.weight.codes", "state.norm.weight.codes"))
    assert opt.state_dict()["state"].keys() == {
        i for i, p in enumerate(p for g in opt.param_groups for p in g["params"]) if opt.state.get(p)
    }
    _train(model, opt, gen, 1)


def test_one_dimensional_parameters_get_no_weight_decay():
    """Biases and norm gains are never decayed, whatever their names."""
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(8, 8), "ln1": torch.nn.LayerNorm(8),
                                 "head": torch.nn.Linear(8, 4, bias=False)})
    opt = gefen.GefenMuonHybrid(model, lr=1e-3, weight_decay=0.1)
    wd = {}
    for group in opt.param_groups:
        for p in group["params"]:
            wd[p] = group["weight_decay"]
    assert wd[model["ln1"].weight] == 0.0 and wd[model["proj"].bias] == 0.0
    assert wd[model["proj"].weight] == 0.1 and wd[model["head"].weight] == 0.1


# ------------------------------------------------- the AdamW half, checked up front


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a, b):
    """Bit-identical nested state (tensors by dtype, shape and bytes; NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bytes(a), _bytes(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _assert_unchanged(model, opt, snap):
    values, sd = snap
    assert _same_bits([p.detach() for p in model.parameters()], values)
    assert _same_bits(opt.state_dict(), sd)


def _backup_group(opt):
    return next(g for g in opt.param_groups if g["role"] == "backup")


def _retype(p, value):  # a backup parameter whose data (and gradient) changed since its state
    p.data = value
    p.grad = torch.zeros_like(p)


ADAMW_STEP_FAILURES = {
    # corruption of a warmed-up hybrid, expected error, the name the message must hold
    "dtype": (lambda m, o: _retype(m.norm.bias, m.norm.bias.detach().double()), TypeError, "norm.bias"),
    "shape": (lambda m, o: _retype(m.conv.bias, torch.zeros(3)), ValueError, "conv.bias"),
    "self_overlap": (lambda m, o: _retype(m.norm.weight, torch.ones(1).expand(8)), ValueError, "norm.weight"),
    "betas": (lambda m, o: _backup_group(o).update(betas=(0.9, "x")), TypeError, None),
    "beta_range": (lambda m, o: _backup_group(o).update(betas=(0.9, 1.5)), ValueError, None),
    "lr": (lambda m, o: _backup_group(o).update(lr="fast"), TypeError, None),
    "step_state": (lambda m, o: o.state[m.norm.bias].update(step=3), TypeError, "norm.bias"),
    "amsgrad_late": (lambda m, o: _backup_group(o).update(amsgrad=True), ValueError, None),
}


@pytest.mark.parametrize("what", list(ADAMW_STEP_FAILURES))
def test_adamw_step_errors_come_before_either_child_mutates(what):
    corrupt, error, name = ADAMW_STEP_FAILURES[what]
    model, opt = _step_after_warmup("adamw")
    corrupt(model, opt)
    name = name or _backup_group(opt)["param_names"][0]  # group errors name its parameters
    snap = _snapshot(model, opt)
    with pytest.raises(error, match=f"'{name}'"):
        opt.step()
    _assert_unchanged(model, opt, snap)
    assert opt.muon._global_step == 1


def _backup_entry(sd):
    return sd["state"][_first(sd, "backup")]


ADAMW_LOAD_FAILURES = {
    "shape": (lambda sd: _backup_entry(sd).update(exp_avg=torch.zeros(3)), ValueError, "shape"),
    "negative_v": (lambda sd: _backup_entry(sd).update(exp_avg_sq=-_backup_entry(sd)["exp_avg_sq"] - 1),
                   ValueError, "negative"),
    "int_dtype": (lambda sd: _backup_entry(sd).update(exp_avg=_backup_entry(sd)["exp_avg"].to(torch.int32)),
                  TypeError, "dtype"),
    "missing_key": (lambda sd: _backup_entry(sd).pop("exp_avg_sq"), ValueError, "lacks 'exp_avg_sq'"),
    "step_text": (lambda sd: _backup_entry(sd).update(step="abc"), TypeError, "step"),
    "step_negative": (lambda sd: _backup_entry(sd).update(step=torch.tensor(-2.0)), ValueError, "step"),
    "self_overlap": (lambda sd: _backup_entry(sd).update(
        exp_avg=_backup_entry(sd)["exp_avg"].reshape(-1)[:1].expand(_backup_entry(sd)["exp_avg"].shape)),
        ValueError, "share memory"),
    "group_betas": (lambda sd: next(g for g in sd["param_groups"] if g["role"] == "backup").update(betas="ab"),
                    TypeError, "betas"),
}


@pytest.mark.parametrize("what", list(ADAMW_LOAD_FAILURES))
def test_corrupt_adamw_half_is_rejected_on_load(what):
    corrupt, error, match = ADAMW_LOAD_FAILURES[what]
    a = _model()
    opt_a = gefen.GefenMuonHybrid(a, lr=LR, backup_optimizer="adamw")
    _train(a, opt_a, torch.Generator().manual_seed(0), 1)
    sd = opt_a.state_dict()
    names = [n for g in opt_a.param_groups for n in g["param_names"]]
    name = names[_first(sd, "backup")]
    b = _model(1)
    opt_b = gefen.GefenMuonHybrid(b, lr=LR, backup_optimizer="adamw")
    _train(b, opt_b, torch.Generator().manual_seed(1), 2)
    snap = _snapshot(b, opt_b)
    with pytest.raises(error, match=match) as info:
        opt_b.load_state_dict(_bad(sd, corrupt))
    assert f"'{name}'" in str(info.value)
    _assert_unchanged(b, opt_b, snap)


def test_non_finite_adamw_moments_load_as_torch_does():
    # AdamW itself turns a NaN gradient into NaN moments, and torch's own load accepts them
    a = _model()
    opt_a = gefen.GefenMuonHybrid(a, lr=LR, backup_optimizer="adamw")
    _train(a, opt_a, torch.Generator().manual_seed(0), 1)
    sd = _bad(opt_a.state_dict(), lambda sd: _backup_entry(sd)["exp_avg"].fill_(float("nan")))
    b = _model(1)
    opt_b = gefen.GefenMuonHybrid(b, lr=LR, backup_optimizer="adamw")
    opt_b.load_state_dict(sd)
    assert _same_bits(opt_b.state_dict()["state"], sd["state"])
