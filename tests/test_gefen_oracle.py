"""gefen.Gefen (C core) against the pure-PyTorch oracle in tests/reference.py.

Periods, codebooks, codes and block magnitudes must be identical; second moments and
parameters equal within the fp32 tolerances stated below (the core sums g^2 in another
order and factors the step size as sqrt(v_row) * sqrt(v_col / mu / bc2)).
"""

import pytest
import reference as ref
import torch

import gefen
from gefen import _C

# Tolerances: moments are sums of squares in another order (a few ulp); parameters differ
# by the resulting ~1e-7 relative change of the step size times lr.
MOMENT_RTOL = 2e-5
PARAM_ATOL = {torch.float32: 1e-6, torch.float64: 1e-6, torch.bfloat16: 0.0, torch.float16: 0.0}

SHAPES = {
    "1d": [(37,)],
    "scalar": [()],
    "one": [(1,)],
    "2d": [(16, 48)],
    "primes": [(13, 29)],
    "row": [(1, 60)],
    "col": [(24, 1)],
    "4d": [(6, 3, 3, 3)],
    "mixed": [(12, 40), (40,), (3, 4, 5), ()],
}


def _make(shapes, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    a = [torch.nn.Parameter(t.to(dtype).clone()) for t in base]
    b = [torch.nn.Parameter(t.to(dtype).clone()) for t in base]
    return a, b, gen


def _grads(shapes, dtype, gen, step):
    # block structure in some steps so periods below the row length get exercised
    out = []
    for s in shapes:
        g = torch.randn(s, generator=gen, dtype=torch.float64)
        if step % 2 == 0 and len(s) >= 1 and g.numel() > 1:
            g = g * (1 + torch.arange(g.numel(), dtype=torch.float64).reshape(s) % 3)
        out.append((g * 0.1).to(dtype))
    return out


def _compare(opt, oracle, pa, pb, dtype):
    for p, q in zip(pa, pb):
        st, so = opt.state[p], oracle.state[q]
        assert st["period"] == so["period"]
        assert st["factored"] == so["factored"]
        assert st["step"] == so["step"] and st["global_step"] == so["global_step"]
        assert torch.equal(st["codebook"], so["codebook"])
        assert torch.equal(st["codes"], so["codes"]), "codes differ"
        assert torch.equal(st["magnitude"], so["magnitude"]), "magnitudes differ"
        for key in ("vmean", "v_row", "v_col"):
            if key in so:
                torch.testing.assert_close(st[key], so[key], rtol=MOMENT_RTOL, atol=0)
        if dtype in (torch.bfloat16, torch.float16):
            # one rounding of nearly the same fp32 value: at most one ulp apart
            diff = (p.detach().float() - q.detach().float()).abs()
            ulp = torch.finfo(dtype).eps * q.detach().float().abs().clamp_min(1e-3)
            assert bool((diff <= ulp).all()), f"max diff {diff.max()}"
        else:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=PARAM_ATOL[dtype])


@pytest.mark.parametrize("shape_key", list(SHAPES))
@pytest.mark.parametrize("factored", [True, False])
def test_matches_oracle_fp32(shape_key, factored):
    _run(SHAPES[shape_key], torch.float32, factored, weight_decay=0.1, steps=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("factored", [True, False])
def test_matches_oracle_dtypes(dtype, factored):
    _run(SHAPES["mixed"], dtype, factored, weight_decay=0.05, steps=3)


def test_matches_oracle_row_period_and_stochastic_rounding():
    _run([(8, 24), (30,)], torch.float32, True, steps=3, period="row", stochastic_round=True)


def test_matches_oracle_with_codebook_refresh():
    # refresh at steps 3 and 5 (every 2 steps): relearn and remap codes
    _run([(16, 32), (20,)], torch.float32, False, steps=5, codebook_refresh_every=2)


def test_matches_oracle_zero_element_and_no_grad():
    shapes = [(0, 5), (6, 4), (3,)]
    pa, pb, gen = _make(shapes, torch.float32, 11)
    opt = gefen.Gefen(pa, lr=1e-2)
    oracle = ref.RefGefen(pb, lr=1e-2)
    for step in range(3):
        grads = _grads(shapes, torch.float32, gen, step)
        for i, (p, q, g) in enumerate(zip(pa, pb, grads)):
            # the last parameter gets no gradient on step 1
            p.grad = None if (i == 2 and step == 1) else g.clone()
            q.grad = None if (i == 2 and step == 1) else g.clone()
        opt.step()
        oracle.step()
        _compare(opt, oracle, pa[1:], pb[1:], torch.float32)
    assert pa[0] not in opt.state


def _run(shapes, dtype, factored, steps, weight_decay=0.0, **kw):
    pa, pb, gen = _make(shapes, dtype, seed=hash((tuple(shapes), str(dtype), factored)) % 1000)
    opt = gefen.Gefen(pa, lr=3e-3, weight_decay=weight_decay, factored=factored, **kw)
    oracle = ref.RefGefen(pb, lr=3e-3, weight_decay=weight_decay, factored=factored, **kw)
    for step in range(steps):
        for p, q, g in zip(pa, pb, _grads(shapes, dtype, gen, step)):
            p.grad = g.clone()
            q.grad = g.clone()
        opt.step()
        oracle.step()
        _compare(opt, oracle, pa, pb, dtype)


def test_codebook_solver_matches_oracle_on_dense_histograms():
    gen = torch.Generator().manual_seed(3)
    for n_active, spread in [(300, 1.0), (1500, 0.3), (4096, 1.0)]:
        hist = torch.zeros(_C.HIST_BINS, dtype=torch.int64)
        bins = torch.randperm(_C.HIST_BINS, generator=gen)[:n_active]
        x = -1 + (bins.double() + 0.5) / 2048
        hist[bins] = 1 + (1000 * torch.exp(-(x / spread) ** 2)).long()
        mine = torch.empty(256)
        _C.codebook_solve(hist, mine)
        assert torch.equal(mine, ref.solve_codebook(hist))


def test_periods_match_oracle_on_many_shapes():
    gen = torch.Generator().manual_seed(5)
    from gefen._comm import Comm
    from gefen._learning import choose_periods
    from gefen._views import make_view

    views, expected = [], []
    for shape in [(8, 48), (16, 96), (4, 6, 8), (2, 2048), (30, 30), (5, 7)]:
        for _ in range(3):
            g = torch.randn(shape, generator=gen)
            g = g * torch.rand(shape[0], 1, *([1] * (len(shape) - 2)), generator=gen)
            p = torch.nn.Parameter(torch.zeros(shape))
            p.grad = g
            views.append(make_view(p, "g", {}, 0, len(views)))
            expected.append(ref.choose_period(g))
    # all parameters' statistics in one flat buffer, as a step does
    assert choose_periods(views, ["auto"] * len(views), 2, Comm(), views) == expected


def test_exact_sum_is_the_correctly_rounded_sum():
    """The period search sums block variances exactly and rounds once: the same value
    as Python's math.fsum, whatever the order or magnitude of the terms."""
    import math

    gen = torch.Generator().manual_seed(11)
    for scale in (1.0, 1e-200, 1e200):
        x = torch.rand(5000, generator=gen, dtype=torch.float64) * scale
        x = x * torch.exp2(torch.randint(-40, 40, (5000,), generator=gen).double())
        assert _C.exact_sum(x) == math.fsum(x.tolist())
        assert _C.exact_sum(x.flip(0)) == _C.exact_sum(x)
    with pytest.raises(ValueError, match="negative or not finite"):
        _C.exact_sum(torch.tensor([1.0, -1.0], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("factored", [True, False])
def test_matches_oracle_long_half_precision_rows(dtype, factored):
    # blocks of whole rows (200, 320 and 96 elements): whole groups of 64 and tails, where
    # the vectorised kernels read and write half-precision values in their own order
    # (bfloat16: the packed order of csrc/core/block_avx512_kernels.h)
    kw = {} if factored else {"period": "row"}
    _run([(6, 200), (4, 320), (96,)], dtype, factored, weight_decay=0.05, steps=3, **kw)
