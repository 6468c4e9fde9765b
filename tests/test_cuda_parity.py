"""CUDA kernels against the CPU core, through the optimizers (skipped without a GPU and
a CUDA build of gefen: `GEFEN_CUDA=1 pip install -e .` on a machine with nvcc).

Codes and block magnitudes must be identical to the CPU core's (they never depend on
the order of a float64 sum); second moments and parameters agree within fp32 tolerance
(the kernels add float64 sums in another order)."""

import copy
import os
import shutil
import subprocess
import sys

import pytest
import torch

import gefen
from gefen import _C

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and _C.cuda_available()),
        reason="needs a CUDA device and gefen built with its CUDA kernels",
    ),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pair(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().clone().cuda()) for p in cpu]
    return cpu, gpu, gen


def _grads(shapes, dtype, gen, scale=0.1):
    return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in shapes]


def _assert_states_match(opt_c, opt_g, pc, pg, exact_params=False):
    for a, b in zip(pc, pg):
        sa, sb = opt_c.state[a], opt_g.state[b]
        assert sa["period"] == sb["period"]
        assert torch.equal(sa["codebook"], sb["codebook"].cpu())
        assert torch.equal(sa["codes"], sb["codes"].cpu()), "codes differ"
        assert torch.equal(sa["magnitude"], sb["magnitude"].cpu()), "magnitudes differ"
        for key in ("vmean", "v_row", "v_col", "v"):
            if key in sa:
                torch.testing.assert_close(sb[key].cpu(), sa[key], rtol=1e-5, atol=0)
        if exact_params:
            assert torch.equal(a.detach(), b.detach().cpu())
        else:
            torch.testing.assert_close(b.detach().cpu().float(), a.detach().float(),
                                       rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.parametrize("stochastic_round", [False, True])
def test_gefen_cuda_matches_cpu(dtype, factored, stochastic_round):
    shapes = [(64, 96), (300,), (8, 3, 5, 5), (1, 640), ()]
    pc, pg, gen = _pair(shapes, dtype)
    kw = dict(lr=3e-3, weight_decay=0.01, factored=factored, stochastic_round=stochastic_round)
    oc, og = gefen.Gefen(pc, **kw), gefen.Gefen(pg, **kw)
    _step_both(oc, og, pc, pg, shapes, dtype, gen, 3)


def _step_both(oc, og, pc, pg, shapes, dtype, gen, steps: int) -> None:
    """``steps`` steps of the CPU and the CUDA optimizer on the same random gradients,
    their states compared after each."""
    for _ in range(steps):
        for a, b, g in zip(pc, pg, _grads(shapes, dtype, gen)):
            a.grad, b.grad = g.clone(), g.cuda()
        oc.step()
        og.step()
        _assert_states_match(oc, og, pc, pg)


def test_gefen_cuda_exact_on_exactly_summable_gradients():
    # gradients that are multiples of 1/64 with few terms: every float64 sum is exact,
    # so the CUDA and CPU results must be identical to the bit
    shapes = [(32, 48), (100,)]
    gen = torch.Generator().manual_seed(1)
    pc = [torch.nn.Parameter(torch.randint(-64, 64, s, generator=gen).float() / 64) for s in shapes]
    pg = [torch.nn.Parameter(p.detach().clone().cuda()) for p in pc]
    oc, og = gefen.Gefen(pc, lr=1 / 64, factored=False), gefen.Gefen(pg, lr=1 / 64, factored=False)
    for _ in range(3):
        for a, b in zip(pc, pg):
            g = torch.randint(-8, 8, a.shape, generator=gen).float() / 64
            a.grad, b.grad = g.clone(), g.cuda()
        oc.step()
        og.step()
    _assert_states_match(oc, og, pc, pg, exact_params=True)


def test_gefen_cuda_codebook_refresh_and_determinism():
    shapes = [(48, 64)]
    runs = []
    for _ in range(2):
        pc, pg, gen = _pair(shapes, torch.float32, seed=3)
        og = gefen.Gefen(pg, lr=1e-3, codebook_refresh_every=2)
        oc = gefen.Gefen(pc, lr=1e-3, codebook_refresh_every=2)
        for _ in range(5):
            for a, b, g in zip(pc, pg, _grads(shapes, torch.float32, gen)):
                a.grad, b.grad = g.clone(), g.cuda()
            oc.step()
            og.step()
        _assert_states_match(oc, og, pc, pg)
        runs.append((pg[0].detach().clone(), og.state[pg[0]]["codes"].clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_gefen_cuda_on_a_side_stream_matches_default_stream():
    shapes = [(64, 64)]
    results = []
    for use_side in (False, True):
        _, pg, gen = _pair(shapes, torch.float32, seed=5)
        og = gefen.Gefen(pg, lr=1e-3)
        side = torch.cuda.Stream()
        for _ in range(3):
            pg[0].grad = _grads(shapes, torch.float32, gen)[0].cuda()
            if use_side:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    og.step()
                torch.cuda.current_stream().wait_stream(side)
            else:
                og.step()
        torch.cuda.synchronize()
        results.append(pg[0].detach().cpu())
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("normuon", [True, False])
def test_gefen_muon_cuda_matches_cpu(nesterov, normuon):
    shapes = [(64, 32), (32, 96)]
    pc, pg, gen = _pair(shapes, torch.float32, seed=7)
    kw = dict(lr=0.02, nesterov=nesterov, normuon=normuon)
    oc, og = gefen.GefenMuon(pc, **kw), gefen.GefenMuon(pg, **kw)
    for _ in range(3):
        for a, b, g in zip(pc, pg, _grads(shapes, torch.float32, gen)):
            a.grad, b.grad = g.clone(), g.cuda()
        oc.step()
        og.step()
        for a, b in zip(pc, pg):
            sa, sb = oc.state[a], og.state[b]
            assert torch.equal(sa["codes"], sb["codes"].cpu())
            assert torch.equal(sa["magnitude"], sb["magnitude"].cpu())
            # Newton-Schulz runs through cuBLAS vs the CPU BLAS: bf16-level agreement
            torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=0, atol=2e-3)


def test_hybrid_cuda_steps_and_checkpoint_moves_to_cpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 32),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 50)).cuda()
    opt = gefen.GefenMuonHybrid(model, lr=1e-3)
    for _ in range(3):
        x = torch.randint(0, 50, (8, 16), device="cuda")
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    cpu_model = copy.deepcopy(model).cpu()
    cpu_opt = gefen.GefenMuonHybrid(cpu_model, lr=1e-3)
    cpu_opt.load_state_dict(sd)
    assert all(t.device.type == "cpu" for st in cpu_opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


def test_one_optimizer_with_cpu_and_cuda_parameters():
    """Each device gets its own kernel call; the result is that of an all-CPU optimizer
    (the CPU parameter exactly, the CUDA one with identical codes)."""
    gen = torch.Generator().manual_seed(9)
    a0, b0 = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    a, b = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone().cuda())
    ra, rb = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())
    mixed, ref = gefen.Gefen([a, b], lr=1e-2), gefen.Gefen([ra, rb], lr=1e-2)
    for _ in range(2):
        ga, gb = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
        a.grad, b.grad, ra.grad, rb.grad = ga, gb.cuda(), ga.clone(), gb.clone()
        mixed.step()
        ref.step()
    assert torch.equal(a.detach(), ra.detach())
    _assert_states_match(ref, mixed, [ra, rb], [a, b])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_level_parity_suite():
    """kernels/test/run.sh gpu: every kernel against its host emulation, bit for bit."""
    r = subprocess.run(["bash", os.path.join(ROOT, "kernels/test/run.sh"), "gpu"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


_CPU_ONLY_PROBE = """
import sys, torch, gefen
assert gefen.__file__.startswith(sys.argv[1]), gefen.__file__
assert not gefen._C.built_with_cuda()
p = torch.nn.Parameter(torch.randn(8, 8, device=sys.argv[2]))
before = p.detach().clone()
try:
    opt = gefen.Gefen([("the_weight", p)], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
except Exception as exc:
    assert torch.equal(p.detach(), before), "the parameter changed"
    print("REFUSED", type(exc).__name__, exc)
else:
    print("STEPPED")
"""


def cpu_only_probe(tmp_path, device: str) -> str:
    """The output of :data:`_CPU_ONLY_PROBE` run against a CPU-only build of gefen: the
    package copied to ``tmp_path`` with the extension of ``$GEFEN_CPU_ONLY_EXT`` (built
    elsewhere, see tools/gpu_check.sh) or one built here with ``GEFEN_CUDA=0``."""
    so = os.environ.get("GEFEN_CPU_ONLY_EXT")
    if not so:
        lib = tmp_path / "lib"
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(lib), "-t", str(tmp_path / "tmp")],
                       cwd=ROOT, env=dict(os.environ, GEFEN_CUDA="0"), check=True, capture_output=True,
                       timeout=900)
        so = str(next((lib / "gefen").glob("_C*.so")))
    pkg = tmp_path / "site" / "gefen"
    shutil.copytree(os.path.join(ROOT, "gefen"), pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(so, pkg / os.path.basename(so))
    r = subprocess.run([sys.executable, "-c", _CPU_ONLY_PROBE, str(tmp_path / "site"), device],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_cpu_only_build_rejects_cuda_parameters(tmp_path):
    out = cpu_only_probe(tmp_path, "cuda")
    assert out.startswith("REFUSED"), out
    assert "the_weight" in out and "CUDA" in out, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factored", [True, False])
def test_gefen_cuda_kept_plans_match_cpu(monkeypatch, dtype, factored):
    # the step plans kept across steps (gefen._steady) for CUDA parameters, behind
    # gefen.gefen._KEEP_CUDA_PLANS until this has passed on a GPU
    import gefen.gefen as gefen_module
    from gefen import _steady

    monkeypatch.setattr(gefen_module, "_KEEP_CUDA_PLANS", True)
    shapes = [(64, 96), (300,), (8, 3, 5, 5), (1, 640)]
    pc, pg, gen = _pair(shapes, dtype)
    kw = dict(lr=3e-3, weight_decay=0.01, factored=factored)
    oc, og = gefen.Gefen(pc, **kw), gefen.Gefen(pg, **kw)
    real, ran = _steady.SteadyStep.run, []

    def run(self, opt, switches):
        ok = real(self, opt, switches)
        if opt is og:
            ran.append(ok)
        return ok

    monkeypatch.setattr(_steady.SteadyStep, "run", run)
    _step_both(oc, og, pc, pg, shapes, dtype, gen, 6)
    assert sum(ran) >= 3, ran  # the kept plans stepped the CUDA parameters
