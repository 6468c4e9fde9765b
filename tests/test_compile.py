"""torch.compile around the optimizers' steps: the step runs eagerly (a graph break) and
gives the eager numbers bit for bit, for every kind.

Before the steps were marked ``torch.compiler.disable``, Dynamo traced the Python around
the C calls and lost the optimizer's own attribute writes (the learned codebook and
quantiser, the kept plan): the second step learned a codebook again and every kind's
parameters differed from eager steps (by up to half a step of lr at lr 1e-2)."""

import warnings

import pytest
import torch
from bitsnap import assert_same_bits, bits

import gefen

KINDS = {
    "factored": lambda m: gefen.Gefen(m.parameters(), lr=1e-2, weight_decay=0.1),
    "block": lambda m: gefen.Gefen(m.parameters(), lr=1e-2, factored=False),
    "muon": lambda m: gefen.GefenMuon([p for p in m.parameters() if p.ndim == 2], lr=1e-2),
    "hybrid": lambda m: gefen.GefenMuonHybrid(m, lr=1e-2),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))


def _run(kind: str, compile_kw: dict | None, whole: bool, steps: int = 3):
    """Parameters and state after ``steps`` steps, eager (compile_kw None) or with the
    step function compiled. ``whole``: zero_grad, forward, backward and step in the
    compiled function (a training step); else fixed gradients set, then the step."""
    torch._dynamo.reset()
    model = _model()
    opt = KINDS[kind](model)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(steps, 8, 32, generator=gen)
    y = torch.randn(steps, 8, 16, generator=gen)
    grads = [[torch.randn(p.shape, generator=gen) for p in model.parameters()]
             for _ in range(steps)]

    def train_step(i):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x[i]), y[i])
        loss.backward()
        opt.step()
        return loss

    def set_and_step(gs):
        for p, g in zip(model.parameters(), gs):
            p.grad = g.clone()
        opt.step()

    fn = train_step if whole else set_and_step
    if compile_kw is not None:
        fn = torch.compile(fn, **compile_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's notes on the graph break
        for i in range(steps):
            fn(i if whole else grads[i])
    return [bits([p.detach() for p in model.parameters()]), bits(opt.state_dict())]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_compiled_step_matches_eager_steps(kind):
    # backend="eager": Dynamo traces (where the writes were lost) and runs the captured
    # graphs as they are, so a whole training step has the eager gradients too
    for whole in (False, True):
        assert_same_bits(_run(kind, {"backend": "eager"}, whole), _run(kind, None, whole))


def test_compiled_step_with_the_default_backend_matches_eager_steps():
    # inductor compiles what is around the step (the gradients' copies); the step is eager
    assert_same_bits(_run("factored", {}, whole=False), _run("factored", None, whole=False))


def test_fullgraph_names_the_eager_step():
    # fullgraph=True cannot break the graph: Dynamo's error carries the reason we give
    model = _model()
    opt = KINDS["block"](model)

    def set_and_step(g):
        for p in model.parameters():
            p.grad = torch.full_like(p, g)
        opt.step()

    torch._dynamo.reset()
    with pytest.raises(Exception, match="gefen optimizer's step runs eagerly"):
        torch.compile(set_and_step, fullgraph=True, backend="eager")(0.5)
    assert not opt.state  # nothing stepped


def test_a_compiled_model_in_the_closure_stays_compiled():
    # the step is eager, the closure (a Lightning-style training step) is the user's: a
    # torch.compile'd model called there still runs its compiled graph
    calls = []

    def counting_backend(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm.forward(*args)
        return run

    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend=counting_backend)
    opt = KINDS["factored"](model)
    x, y = torch.randn(8, 32), torch.randn(8, 16)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    assert len(calls) == 2 and len(opt.state) == 4
