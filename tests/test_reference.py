"""Sanity tests of the pure PyTorch oracle (tests/reference.py).

Expected values are derived from ALGORITHM.md by hand (or by an independent
brute force), not read back from the oracle."""

import itertools
import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import reference as ref  # noqa: E402


def _hist(bins, counts=None):
    h = torch.zeros(ref.HIST_BINS, dtype=torch.int64)
    bins = list(bins)
    counts = [1] * len(bins) if counts is None else list(counts)
    for b, c in zip(bins, counts):
        h[b] += c
    return h


def _centre(i):
    return -1.0 + (i + 0.5) / 2048.0


# ------------------------------------------------------------------ shapes


def test_shape_rs():
    assert ref.shape_rs(()) == (1, 1)
    assert ref.shape_rs((7,)) == (7, 1)
    assert ref.shape_rs((3, 4)) == (3, 4)
    assert ref.shape_rs((2, 3, 4)) == (2, 12)
    assert ref.shape_rs((0, 5)) == (0, 5)
    assert ref.FLT_MIN == float(np.finfo(np.float32).tiny)


# ------------------------------------------------------------------ period


@pytest.mark.parametrize(
    "S,numel,expected",
    [
        (12, 12, [1, 2, 3, 4, 6]),  # R = 1: S itself is the whole tensor
        (12, 24, [1, 2, 3, 4, 6, 12]),
        (1, 5, [1]),
        (1, 1, []),
        (7, 7, [1]),
        (7, 21, [1, 7]),
        (16, 16, [1, 2, 4, 8]),
        (36, 72, [1, 2, 3, 4, 6, 9, 12, 18, 36]),
        (4096, 8192, [2**k for k in range(13)]),
    ],
)
def test_period_candidates(S, numel, expected):
    assert ref.period_candidates(S, numel) == expected


def test_period_trivial_shapes():
    assert ref.choose_period(torch.tensor(3.0)) == 1  # 0-D
    assert ref.choose_period(torch.randn(100)) == 1  # 1-D: S == 1
    assert ref.choose_period(torch.randn(100, 1)) == 1  # S == 1
    assert ref.choose_period(torch.randn(1, 1)) == 1  # numel == 1
    assert ref.choose_period(torch.randn(1, 1, 1)) == 1
    assert ref.choose_period(torch.randn(4, 48), "row") == 48
    assert ref.choose_period(torch.randn(2, 3, 5), "row") == 15
    with pytest.raises(ValueError, match="unknown period mode 'bogus'"):
        ref.choose_period(torch.randn(4, 48), "bogus")


def _blocky(R, S, block, seed, noise=0.0):
    """A gradient whose |g| is constant on each run of `block` elements."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(R, S // block, generator=gen) * 9 + 1
    g = scales.repeat_interleave(block, dim=1)
    sign = torch.randint(0, 2, (R, S), generator=gen) * 2 - 1
    g = g * sign
    if noise:
        g = g * (1 + noise * torch.randn(R, S, generator=gen))
    return g


def test_period_finds_block_of_16():
    # S = 48, blocks of 16 with their own scale. err(d) = 0 for d | 16; a block
    # of 3, 6 or 12 straddling a 16-boundary always splits 1:2 (variance
    # (2/9)(a-b)^2), and there are 16, 8, 4 such blocks per row for one
    # straddler each, so err(12)^2 = 2 err(6)^2 = 4 err(3)^2. Scores:
    # s(4) = -err(3), s(8) = -err(6), s(16) = -err(12) (the minimum);
    # s(24), s(48) >= 0 (nested or increasing). -> P = 16.
    g = _blocky(8, 48, 16, seed=0)
    cands = ref.period_candidates(48, g.numel())
    errs = dict(zip(cands, ref.period_errors(g, cands)))
    for d in (1, 2, 4, 8, 16):
        assert errs[d] == 0.0
    assert errs[12] == pytest.approx(math.sqrt(2) * errs[6], rel=1e-12)
    assert errs[12] == pytest.approx(2 * errs[3], rel=1e-12)
    assert ref.choose_period(g) == 16
    # a little noise does not change the answer
    assert ref.choose_period(_blocky(64, 48, 16, seed=1, noise=0.01)) == 16
    # 3-D parameter: the same rows seen as (R, 6, 8) -- S = 48 still
    assert ref.choose_period(g.reshape(8, 6, 8)) == 16


def test_period_finds_block_of_8():
    # S = 24: err(3)^2 = e/8, err(6)^2 = e/4 (one 1:2 straddler per 8-boundary),
    # so s(8) = -err(6) < s(4) = -err(3); s(12) = err(12) > 0 and s(24) >= 0.
    assert ref.choose_period(_blocky(8, 24, 8, seed=2)) == 8


def test_period_constant_gradient_falls_back():
    # every err is 0: s(2) = 0 < s(1) = 1e-12, pick 2 < 8 -> fallback
    assert ref.choose_period(torch.ones(4, 48)) == 48  # 2-D, S >= 8 -> S
    assert ref.choose_period(torch.ones(4, 6, 8)) == 48  # not 2-D: largest divisor <= 2048
    assert ref.choose_period(torch.ones(2, 64, 64)) == 2048
    assert ref.choose_period(torch.ones(2, 3, 5000)) == 1875  # 15000 = 2^3 3 5^4
    assert ref.choose_period(torch.ones(3, 7, 1)) == 1  # S = 7 < 8
    assert ref.choose_period(torch.ones(3, 7)) == 1  # 2-D but S < 8
    assert ref.choose_period(torch.zeros(5, 12)) == 12


def test_period_iid_noise_falls_back():
    # iid entries: E err(d)^2 = var(x) (d-1)/d grows with d, every score after
    # the first is positive, pick 1 -> fallback
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(2000, 48, generator=gen)
    assert ref.choose_period(g) == 48
    assert ref.choose_period(g.reshape(2000, 6, 8)) == 48
    assert ref.choose_period(torch.randn(100, 7, 3, generator=gen)) == 21


def test_period_bf16_gradient():
    g = _blocky(8, 48, 16, seed=4).to(torch.bfloat16)
    assert ref.choose_period(g) == 16


# --------------------------------------------------------------- histogram


def test_histogram_by_hand():
    g = torch.tensor([[1.0, -1.0, 0.5, 0.0], [0.0, 0.0, -2.0, 4.0]])
    # period 4: row 0 a=1 -> u = 1, -1, .5, 0 -> bins 4095 (4096 clamped), 0, 3072, 2048
    #           row 1 a=4 -> u = 0, 0, -.5, 1 -> bins 2048, 2048, 1024, 4095
    h = ref.histogram([(g, 4)])
    assert h.dtype == torch.int64 and h.shape == (4096,)
    expected = {4095: 2, 0: 1, 3072: 1, 2048: 3, 1024: 1}
    assert {int(i): int(h[i]) for i in torch.nonzero(h).flatten()} == expected
    # period 2 on the same grad: blocks [1,-1] [.5,0] [0,0] [-2,4]
    # u: 1,-1 | 1,0 | 0,0 (a = 0) | -.5,1
    h2 = ref.histogram([(g, 2)])
    expected2 = {4095: 3, 0: 1, 2048: 3, 1024: 1}
    assert {int(i): int(h2[i]) for i in torch.nonzero(h2).flatten()} == expected2
    # items add up
    assert torch.equal(ref.histogram([(g, 4), (g, 2)]), h + h2)
    # empty parameters contribute nothing
    assert torch.equal(ref.histogram([(g, 4), (torch.zeros(0, 3), 1)]), h)


def test_histogram_non_finite_not_counted():
    inf, nan = float("inf"), float("nan")
    g = torch.tensor([[inf, 1.0, nan, -2.0], [nan, 0.5, -1.0, nan]])
    # block 0: max ignores NaN -> inf; u = nan, 0, nan, -0 -> two counts in bin 2048
    # block 1: max = 1 -> u = nan, .5, -1, nan -> bins 3072, 0
    h = ref.histogram([(g, 4)])
    assert {int(i): int(h[i]) for i in torch.nonzero(h).flatten()} == {2048: 2, 3072: 1, 0: 1}


def test_histogram_bin_edges():
    # u = -1 + k/2048 lands exactly at the lower edge of bin k
    k = torch.arange(0, 4096, 7)
    u = (-1.0 + k.double() / 2048.0).float()
    g = torch.cat([u, torch.tensor([1.0])])  # block max = 1 -> u unchanged
    h = ref.histogram([(g.reshape(1, -1), g.numel())])
    expected = torch.zeros(4096, dtype=torch.int64)
    expected[k] += 1
    expected[4095] += 1
    assert torch.equal(h, expected)
    assert int(h.sum()) == g.numel()


# ---------------------------------------------------------------- codebook


def _check_codebook(C):
    assert C.dtype == torch.float32 and C.shape == (256,)
    assert C[0].item() == -1.0 and C[-1].item() == 1.0
    assert bool((C[1:] >= C[:-1]).all())


def test_codebook_empty_raises():
    with pytest.raises(ValueError, match="empty histogram"):
        ref.solve_codebook(torch.zeros(4096, dtype=torch.int64))


def test_codebook_one_bin():
    C = ref.solve_codebook(_hist([2048], [17]))
    _check_codebook(C)
    c = _centre(2048)
    assert C[1:255].tolist() == [c] * 254


def test_codebook_three_bins_padding():
    bins = [100, 2000, 3000]
    C = ref.solve_codebook(_hist(bins, [5, 1, 9]))
    _check_codebook(C)
    expected = [-1.0, _centre(100), _centre(2000)] + [_centre(3000)] * 252 + [1.0]
    assert C.tolist() == expected


def test_codebook_254_and_255_bins():
    bins = list(range(10, 10 + 16 * 254, 16))
    C = ref.solve_codebook(_hist(bins))
    assert C.tolist() == [-1.0] + [_centre(b) for b in bins] + [1.0]
    bins = list(range(3, 3 + 16 * 255, 16))
    C = ref.solve_codebook(_hist(bins))
    # one too long: c_1 is dropped
    assert C.tolist() == [-1.0] + [_centre(b) for b in bins[1:]] + [1.0]


def test_codebook_256_bins_each_its_own_cluster():
    bins = list(range(0, 16 * 256, 16))
    C = ref.solve_codebook(_hist(bins, range(1, 257)))
    # one bin per cluster, the first and last pinned to -1 / +1
    assert C.tolist() == [-1.0] + [_centre(b) for b in bins[1:-1]] + [1.0]


def _brute_force(h, N):
    """All segmentations of N active bins into 256 runs; returns the minimum
    total cost (summed run by run in order, as the DP does) and its runs."""
    x, W, S1, S2 = ref._prefix(h)
    combos = np.array(list(itertools.combinations(range(N - 1), N - 256)), dtype=np.int64)
    cut = np.ones((combos.shape[0], N - 1), dtype=bool)  # gap i: between bins i and i + 1
    cut[np.arange(combos.shape[0])[:, None], combos] = False
    cuts = np.nonzero(cut)[1].reshape(combos.shape[0], 255)
    starts = np.concatenate([np.zeros((len(cuts), 1), np.int64), cuts + 1], axis=1)
    ends = np.concatenate([cuts, np.full((len(cuts), 1), N - 1)], axis=1)
    w = W[ends + 1] - W[starts]
    s1 = S1[ends + 1] - S1[starts]
    s2 = S2[ends + 1] - S2[starts]
    cost = s2 - (s1 * s1) / w
    cost[:, 0] = (s2[:, 0] + 2.0 * s1[:, 0]) + w[:, 0]
    cost[:, -1] = (s2[:, -1] - 2.0 * s1[:, -1]) + w[:, -1]
    totals = np.cumsum(cost, axis=1)[:, -1]  # sequential, left to right
    k = int(np.argmin(totals))
    return float(totals[k]), list(zip(starts[k].tolist(), ends[k].tolist()))


@pytest.mark.parametrize("N,seed", [(257, 0), (257, 1), (258, 2), (258, 3)])
def test_codebook_dp_matches_brute_force(N, seed):
    gen = torch.Generator().manual_seed(seed)
    bins = torch.randperm(4096, generator=gen)[:N]
    counts = torch.randint(1, 50, (N,), generator=gen)
    h = _hist(bins.tolist(), counts.tolist())
    runs, cost = ref.solve_segments(h)
    bf_cost, bf_runs = _brute_force(h, N)
    assert cost == bf_cost  # same float64 operations in the same order
    x, W, S1, S2 = ref._prefix(h)
    total = 0.0
    for k, (s, e) in enumerate(runs):
        kind = "first" if k == 0 else ("last" if k == 255 else "mid")
        total = total + ref.segment_cost(W, S1, S2, s, e, kind)
    assert total == cost
    C = ref.solve_codebook(h)
    _check_codebook(C)
    for k, (s, e) in enumerate(runs[1:-1], start=1):
        mean = (S1[e + 1] - S1[s]) / (W[e + 1] - W[s])
        assert C[k].item() == float(np.float32(mean))


def test_codebook_dp_merges_the_cheapest_pair():
    # 257 bins 15 apart except one adjacent pair: merging that pair (cost
    # w1 w2 / (w1 + w2) * (1/2048)^2) is far cheaper than any other merge.
    bins = list(range(5, 5 + 15 * 256, 15))
    bins.insert(101, bins[100] + 1)
    runs, _ = ref.solve_segments(_hist(bins))
    assert len(runs) == 256
    assert runs[100] == (100, 101)
    assert all(s == e for k, (s, e) in enumerate(runs) if k != 100)


def test_codebook_dense_locally_optimal():
    # 1200 contiguous active bins with a bell-shaped mass
    i = np.arange(4096)
    counts = (1 + 1000 * np.exp(-(((i - 2048) / 300.0) ** 2))).astype(np.int64)
    counts[:1448] = 0
    counts[2648:] = 0
    h = torch.from_numpy(counts)
    runs, cost = ref.solve_segments(h)
    C = ref.solve_codebook(h)
    _check_codebook(C)
    assert bool((C[1:] > C[:-1]).all())  # distinct runs -> strictly increasing
    x, W, S1, S2 = ref._prefix(h)
    assert runs[0][0] == 0 and runs[-1][1] == 1199
    assert all(runs[k][1] + 1 == runs[k + 1][0] for k in range(255))
    for k, (s, e) in enumerate(runs[1:-1], start=1):
        assert C[k].item() == float(np.float32((S1[e + 1] - S1[s]) / (W[e + 1] - W[s])))

    def total(rs):
        t = 0.0
        for k, (s, e) in enumerate(rs):
            kind = "first" if k == 0 else ("last" if k == 255 else "mid")
            t = t + ref.segment_cost(W, S1, S2, s, e, kind)
        return t

    assert total(runs) == cost

    def pair(k, e0):  # cost of runs k and k + 1 when run k ends at e0
        (s0, _), (_, e1) = runs[k], runs[k + 1]
        kinds = ["first" if k == 0 else "mid", "last" if k + 1 == 255 else "mid"]
        return ref.segment_cost(W, S1, S2, s0, e0, kinds[0]) + ref.segment_cost(
            W, S1, S2, e0 + 1, e1, kinds[1]
        )

    # moving any single boundary by one bin never lowers the cost
    for k in range(255):
        (s0, e0), (_, e1) = runs[k], runs[k + 1]
        here = pair(k, e0)
        for e0n in (e0 - 1, e0 + 1):
            if s0 <= e0n < e1:
                assert pair(k, e0n) >= here - 1e-12 * cost
    # density: more codes where the mass is
    centre = int(((C > -0.15) & (C < 0.15)).sum())
    assert centre > 256 // 2


# --------------------------------------------------------------- quantiser


def _dyadic_codebook():
    C = torch.tensor([-1.0 + i / 128.0 for i in range(256)], dtype=torch.float32)
    C[255] = 1.0
    return C


def test_nearest_exact_and_ties():
    C = _dyadic_codebook()
    assert torch.equal(ref.nearest(C.clone(), C), torch.arange(256).to(torch.uint8))
    mid = torch.tensor([-1.0 + 10.5 / 128.0])  # exact midpoint of C[10], C[11]
    assert ref.nearest(mid, C).item() == 10  # ties go low
    above = torch.nextafter(mid, torch.tensor(2.0))
    below = torch.nextafter(mid, torch.tensor(-2.0))
    assert ref.nearest(above, C).item() == 11
    assert ref.nearest(below, C).item() == 10
    # outside [-1, 1]
    u = torch.tensor([-5.0, -1.0000001, 1.5, 1.0, -0.0, 0.0])
    assert ref.nearest(u, C).tolist() == [0, 0, 255, 255, 128, 128]
    # between C[254] = 0.984375 and 1: midpoint 0.9921875 goes low
    assert ref.nearest(torch.tensor([0.9921875]), C).item() == 254


def test_nearest_nan_and_shape():
    C = _dyadic_codebook()
    u = torch.tensor([[float("nan"), 0.5], [-0.5, float("nan")]])
    out = ref.nearest(u, C)
    assert out.dtype == torch.uint8 and out.shape == (2, 2)
    assert out[0, 0].item() == 255 and out[1, 1].item() == 255
    assert out[0, 1].item() == 192 and out[1, 0].item() == 64


def test_nearest_duplicates():
    bins = [100, 2000, 3000]
    C = ref.solve_codebook(_hist(bins))  # c3 repeated at indices 3..254
    c3 = _centre(3000)
    assert ref.nearest(torch.tensor([c3]), C).item() == 3  # first holder
    just_above = float(np.nextafter(np.float32(c3), np.float32(2)))
    assert ref.nearest(torch.tensor([just_above]), C).item() == 254  # last holder
    mid = (c3 + 1.0) / 2  # exact in fp32
    assert ref.nearest(torch.tensor([mid]), C).item() == 254
    assert ref.nearest(torch.tensor([np.nextafter(np.float32(mid), np.float32(2))]), C).item() == 255
    assert ref.nearest(torch.tensor([c3 - 1e-4]), C).item() == 3


def _brute_nearest(u, C):
    """Nearest value, ties to the lower value; among duplicates of it the first
    index when the value is >= u, else the last."""
    out = []
    Cn = C.numpy()
    for v in u.numpy():
        if np.isnan(v):
            out.append(255)
            continue
        d = np.abs(np.float32(v) - Cn)
        val = Cn[d == d.min()].min()
        idx = np.nonzero(Cn == val)[0]
        out.append(int(idx[0] if val >= v else idx[-1]))
    return out


@pytest.mark.parametrize("which", ["dp", "padded"])
def test_nearest_matches_brute_force(which):
    gen = torch.Generator().manual_seed(5)
    if which == "dp":
        h = _hist(torch.randperm(4096, generator=gen)[:700].tolist())
    else:
        h = _hist(torch.randperm(4096, generator=gen)[:40].tolist())
    C = ref.solve_codebook(h)
    u = torch.cat([torch.rand(3000, generator=gen) * 2.2 - 1.1, C, (C[1:] + C[:-1]) / 2])
    assert ref.nearest(u, C).tolist() == _brute_nearest(u, C)


def test_sr_uniform_splitmix64_vectors():
    # seed 0: the hash is splitmix64's output sequence from state 0
    known = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    U = ref.sr_uniform(0, torch.arange(3))
    assert U.dtype == torch.float32
    assert U.tolist() == [(z >> 40) * 2.0**-24 for z in known]


def _splitmix_int(seed, i):
    M = 2**64 - 1
    z = (seed + 0x9E3779B97F4A7C15 * (i + 1)) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def test_sr_uniform_wraparound_and_determinism():
    idx = torch.tensor([0, 1, 7, 12345, 2**40 + 3, 2**62, 2**63 - 1])
    for seed in (0, 1, 999, 2**63 + 5, 2**64 - 1):
        U = ref.sr_uniform(seed, idx)
        expected = [(_splitmix_int(seed, int(i)) >> 40) * 2.0**-24 for i in idx]
        assert U.tolist() == expected
    a = ref.sr_uniform(3, torch.arange(100).reshape(10, 10))
    assert a.shape == (10, 10) and torch.equal(a, ref.sr_uniform(3, torch.arange(100)).reshape(10, 10))
    big = ref.sr_uniform(11, torch.arange(200000))
    assert 0.0 <= big.min().item() and big.max().item() < 1.0
    assert abs(big.mean().item() - 0.5) < 0.005


def test_stochastic_rounding_frequency():
    C = _dyadic_codebook()
    n = 200000
    idx = torch.arange(n)
    # u a quarter of the way from C[40] to C[41]
    u = torch.full((n,), -1.0 + 40.25 / 128.0)
    codes = ref.stochastic(u, C, seed=7, index=idx)
    assert set(codes.unique().tolist()) == {40, 41}
    frac = (codes == 41).double().mean().item()
    assert abs(frac - 0.25) < 0.005
    # deterministic in (seed, index), different for another seed
    assert torch.equal(codes, ref.stochastic(u, C, 7, idx))
    assert not torch.equal(codes, ref.stochastic(u, C, 8, idx))
    # unbiased on average over random values
    gen = torch.Generator().manual_seed(6)
    v = torch.rand(n, generator=gen) * 2 - 1
    q = C[ref.stochastic(v, C, 1, idx).long()]
    assert abs((q - v).double().mean().item()) < 2e-4
    # only the two neighbours are ever chosen
    inner = v < C[254]  # there the neighbours are v rounded down / up to the 1/128 grid
    down = torch.floor(v[inner].double() * 128) / 128
    up = torch.ceil(v[inner].double() * 128) / 128
    qi = q[inner].double()
    assert bool(((qi == down) | (qi == up)).all())
    assert bool(((q[~inner] == C[254]) | (q[~inner] == 1.0)).all())


def test_stochastic_edges():
    C = _dyadic_codebook()
    idx = torch.arange(256)
    # exact codebook values round to themselves
    assert torch.equal(ref.stochastic(C.clone(), C, 3, idx), torch.arange(256).to(torch.uint8))
    u = torch.tensor([float("nan"), -3.0, 3.0, -1.0, 1.0, float("inf")])
    # NaN taken literally: r = 255, l = 254, U < NaN is false -> l
    assert ref.stochastic(u, C, 3, torch.arange(6)).tolist() == [254, 0, 255, 0, 255, 255]
    # duplicates: empty span -> p_up = 0 -> l
    P = ref.solve_codebook(_hist([100, 2000, 3000]))
    c3 = _centre(3000)
    out = ref.stochastic(torch.full((50,), c3), P, 0, torch.arange(50))
    assert out.tolist() == [3] * 50
    # U < p_up, decided per element: compare with the variates themselves
    w = torch.full((1000,), -1.0 + 40.75 / 128.0)
    U = ref.sr_uniform(9, torch.arange(1000))
    expected = torch.where(U < 0.75, 41, 40).to(torch.uint8)
    assert torch.equal(ref.stochastic(w, C, 9, torch.arange(1000)), expected)


# --------------------------------------------------------------- optimizer


def _params():
    gen = torch.Generator().manual_seed(10)
    shapes = [(16, 48), (33,), (), (4, 6, 8), (5, 1)]
    ps = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    return ps


@pytest.mark.parametrize("factored", [True, False])
def test_state_layout(factored):
    ps = _params()
    opt = ref.RefGefen(ps, lr=1e-3, factored=factored)
    opt.step()
    cb = None
    for p in ps:
        st = opt.state[p]
        R, S = ref.shape_rs(p.shape)
        P = st["period"]
        assert isinstance(P, int) and S % P == 0
        fac = factored and p.dim() >= 2
        expected = {"step", "period", "factored", "codes", "magnitude", "codebook", "global_step"}
        expected |= {"v_row", "v_col"} if fac else {"vmean"}
        assert set(st) == expected
        assert st["step"] == 1 and st["global_step"] == 1 and st["factored"] == int(fac)
        assert st["codes"].dtype == torch.uint8 and st["codes"].shape == p.shape
        assert st["magnitude"].dtype == torch.float32 and st["magnitude"].shape == (R, S // P)
        if fac:
            assert st["v_row"].shape == (R,) and st["v_col"].shape == (S,)
            assert st["v_row"].dtype == st["v_col"].dtype == torch.float32
        else:
            assert st["vmean"].shape == (R, S // P) and st["vmean"].dtype == torch.float32
        assert st["codebook"].dtype == torch.float32 and st["codebook"].shape == (256,)
        cb = st["codebook"] if cb is None else cb
        assert st["codebook"] is cb
    assert opt.state[ps[1]]["period"] == 1 and opt.state[ps[2]]["period"] == 1
    assert opt.state[ps[4]]["period"] == 1
    # the codebook was learned from all first-step gradients with their periods
    items = [(p.grad, opt.state[p]["period"]) for p in ps]
    assert torch.equal(cb, ref.solve_codebook(ref.histogram(items)))
    ps[0].grad = None
    opt.step()
    assert opt.state[ps[0]]["step"] == 1 and opt.state[ps[1]]["step"] == 2
    assert all(opt.state[p]["global_step"] == 2 for p in ps)


def test_zero_rule():
    ps = _params()
    for p in ps:
        p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for p in ps]
    opt = ref.RefGefen([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.0}], lr=0.0)
    opt.step()
    assert len(opt.state) == 0 and opt.codebook is None and opt.global_step == 0
    assert all(torch.equal(a, p) for a, p in zip(before, ps))
    # a nonzero gradient makes it a real step (still lr = 0: params unchanged)
    ps[0].grad[0, 0] = 1.0
    opt.step()
    assert opt.global_step == 1 and opt.codebook is not None
    assert all(opt.state[p]["step"] == 1 for p in ps)
    assert all(torch.equal(a, p) for a, p in zip(before, ps))
    # zero gradients with lr > 0 are a real step too
    opt2 = ref.RefGefen(_params(), lr=1e-3)
    for p in opt2.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    opt2.step()
    assert opt2.global_step == 1


def test_empty_and_gradless_params():
    a = torch.zeros(0, 5, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    c = torch.randn(2, requires_grad=True)
    a.grad = torch.zeros(0, 5)
    b.grad = torch.randn(3, 4)
    opt = ref.RefGefen([a, b, c])
    opt.step()
    assert a not in opt.state and c not in opt.state and opt.state[b]["step"] == 1
    opt2 = ref.RefGefen([a])
    opt2.step()  # nothing to do
    assert opt2.global_step == 0


def test_first_step_is_sign_descent():
    # block of constant |g|: m = 0.1 g, magnitude 0.1|g|, u = +-1 (exact codes),
    # vmean = 0.001 g^2, s = 10 / (sqrt(0.001) |g| sqrt(1000) + eps) -> update = lr sign(g)
    gen = torch.Generator().manual_seed(12)
    p = torch.randn(8, 32, generator=gen).requires_grad_()
    sign = torch.randint(0, 2, (8, 32), generator=gen) * 2.0 - 1
    p.grad = sign * 3.0
    p0 = p.detach().clone()
    opt = ref.RefGefen([p], lr=1e-2, factored=False, weight_decay=0.5)
    opt.step()
    expected = p0 * (1 - 1e-2 * 0.5) - 1e-2 * sign
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)
    st = opt.state[p]
    C = st["codebook"]
    assert bool(((C[st["codes"].long()]).abs() == 1).all())


@pytest.mark.parametrize("fp32_hyper", [False, True])
def test_first_step_moments_exact(fp32_hyper):
    # first step from zero state: m = fp32(1 - beta1) * g, magnitude = max|m|,
    # vmean = fp32(1 - beta2) * fp32(mean g^2) (beta2 * 0 adds nothing)
    gen = torch.Generator().manual_seed(20)
    p = torch.randn(4, 32, generator=gen).requires_grad_()
    p.grad = torch.randn(4, 32, generator=gen)
    opt = ref.RefGefen([p], factored=False, period="row", fp32_hyperparameters=fp32_hyper)
    opt.step()
    st = opt.state[p]
    f32 = np.float32
    if fp32_hyper:
        omb1, omb2 = f32(1.0 - float(f32(0.9))), f32(1.0 - float(f32(0.999)))
        assert float(omb1) == 0.10000002384185791
    else:
        omb1, omb2 = f32(1.0 - 0.9), f32(1.0 - 0.999)
    g = p.grad.numpy()
    mag = np.max(np.abs(omb1 * g), axis=1)
    assert np.array_equal(st["magnitude"].numpy().reshape(-1), mag)
    meansq = np.array([f32(math.fsum(float(x) for x in f32(r * r)) / 32) for r in g])
    assert np.array_equal(st["vmean"].numpy().reshape(-1), omb2 * meansq)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_period_one_is_adamw(wd):
    # P = 1 (1-D parameters and (R, 1) matrices in block form): every element is
    # its own block, the quantiser is lossless (u = +-1) and the block second
    # moment is per element, so the trajectory is AdamW's up to rounding.
    gen = torch.Generator().manual_seed(13)
    x0 = torch.randn(64, generator=gen)
    y0 = torch.randn(16, 1, generator=gen)
    target = torch.randn(64, generator=gen)
    a = [x0.clone().requires_grad_(), y0.clone().requires_grad_()]
    b = [x0.clone().requires_grad_(), y0.clone().requires_grad_()]
    oa = ref.RefGefen(a, lr=1e-2, weight_decay=wd, factored=False)
    ob = torch.optim.AdamW(b, lr=1e-2, weight_decay=wd)
    for _ in range(30):
        for ps, o in ((a, oa), (b, ob)):
            o.zero_grad()
            loss = ((ps[0] - target) ** 2 * torch.linspace(0.1, 3, 64)).sum() + (ps[1] ** 4).sum()
            loss.backward()
            o.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quadratic_loss_decreases(factored, stochastic):
    gen = torch.Generator().manual_seed(14)
    W = torch.zeros(32, 48, requires_grad=True)
    X = torch.randn(48, 6, generator=gen)
    T = torch.randn(32, 6, generator=gen)
    opt = ref.RefGefen([W], lr=2e-2, factored=factored, stochastic_round=stochastic)

    def loss_fn():
        return ((W @ X - T) ** 2).mean()

    first = loss_fn().item()
    for _ in range(80):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    assert loss_fn().item() < 0.3 * first


def test_stochastic_round_deterministic():
    outs = []
    for _ in range(2):
        ps = _params()
        opt = ref.RefGefen(ps, stochastic_round=True)
        opt.step()
        opt.step()
        outs.append([p.detach().clone() for p in ps] + [opt.state[p]["codes"].clone() for p in ps])
    assert all(torch.equal(x, y) for x, y in zip(*outs))
    ps = _params()
    opt = ref.RefGefen(ps, stochastic_round=False)
    opt.step()
    opt.step()
    assert not all(torch.equal(x, opt.state[p]["codes"]) for x, p in zip(outs[0][5:], ps))


def test_bf16_rounds_once():
    gen = torch.Generator().manual_seed(15)
    p16 = torch.randn(8, 32, generator=gen).to(torch.bfloat16).requires_grad_()
    p32 = p16.detach().float().clone().requires_grad_()
    g = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
    p16.grad = g
    p32.grad = g.float()
    o16 = ref.RefGefen([p16], lr=3e-3, weight_decay=0.3)
    o32 = ref.RefGefen([p32], lr=3e-3, weight_decay=0.3)
    o16.step()
    o32.step()
    assert p16.dtype == torch.bfloat16
    # the fp32 computation from the same inputs, rounded once
    assert torch.equal(p16.detach(), p32.detach().to(torch.bfloat16))
    # and the state is identical
    for k in ("codes", "magnitude", "v_row", "v_col"):
        assert torch.equal(o16.state[p16][k], o32.state[p32][k])


def test_fp64_params():
    gen = torch.Generator().manual_seed(16)
    p64 = torch.randn(6, 16, generator=gen, dtype=torch.float64).requires_grad_()
    p32 = p64.detach().float().clone().requires_grad_()
    g = torch.randn(6, 16, generator=gen, dtype=torch.float64)
    p64.grad, p32.grad = g, g.float()
    o64, o32 = ref.RefGefen([p64], lr=1e-2), ref.RefGefen([p32], lr=1e-2)
    o64.step()
    o32.step()
    assert p64.dtype == torch.float64
    torch.testing.assert_close(p64.detach().float(), p32.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(o64.state[p64]["codes"], o32.state[p32]["codes"])


def test_codebook_refresh():
    gen = torch.Generator().manual_seed(17)
    p = torch.randn(16, 64, generator=gen).requires_grad_()
    opt = ref.RefGefen([p], lr=1e-3, codebook_refresh_every=2)
    grads = [torch.randn(16, 64, generator=gen) ** (k + 1) for k in range(4)]
    p.grad = grads[0]
    opt.step()
    cb = opt.codebook
    first = cb.clone()
    P = opt.state[p]["period"]
    assert torch.equal(first, ref.solve_codebook(ref.histogram([(grads[0], P)])))
    p.grad = grads[1]
    opt.step()  # t = 2: no refresh
    assert torch.equal(opt.codebook, first)
    codes, mag = opt.state[p]["codes"].clone(), opt.state[p]["magnitude"].clone()
    p.grad = grads[2]
    opt.step()  # t = 3: (3 - 1) % 2 == 0 -> relearned from this step's gradients
    new = ref.solve_codebook(ref.histogram([(grads[2], P)]))
    assert torch.equal(opt.codebook, new) and not torch.equal(new, first)
    assert opt.codebook is cb and opt.state[p]["codebook"] is cb
    # the remap sends each old code to the nearest new entry of its old value
    remap = ref.nearest(first, new)
    assert int(remap[0]) == 0 and int(remap[255]) == 255
    assert bool((remap[1:] >= remap[:-1]).all())
    del codes, mag


def test_refresh_remaps_before_update():
    # with lr = 0 and beta1 -> momentum only decays, the remapped codes are
    # visible: with beta1 = 0.999 and tiny new gradients, codes after the
    # refresh step equal nearest(new, old[codes]) almost everywhere.
    gen = torch.Generator().manual_seed(18)
    p = torch.randn(16, 64, generator=gen).requires_grad_()
    opt = ref.RefGefen([p], lr=0.0, betas=(0.999, 0.999), codebook_refresh_every=1)
    p.grad = torch.randn(16, 64, generator=gen)
    opt.step()
    old_cb = opt.codebook.clone()
    old = opt.state[p]["codes"].clone()
    p.grad = torch.randn(16, 64, generator=gen) ** 3 * 1e-9  # t = 2: refresh
    opt.step()
    new_cb = opt.codebook
    assert not torch.equal(new_cb, old_cb)
    expected = ref.nearest(old_cb, new_cb)[old.long()]
    agree = (opt.state[p]["codes"] == expected).double().mean().item()
    assert agree > 0.95


def test_param_groups_hyperparameters():
    gen = torch.Generator().manual_seed(19)
    a = torch.randn(4, 16, generator=gen).requires_grad_()
    b = torch.randn(4, 16, generator=gen).requires_grad_()
    a.grad = torch.randn(4, 16, generator=gen)
    b.grad = a.grad.clone()
    a0, b0 = a.detach().clone(), b.detach().clone()
    opt = ref.RefGefen([{"params": [a]}, {"params": [b], "lr": 0.0}], lr=1e-2)
    opt.step()
    assert torch.equal(b.detach(), b0) and not torch.equal(a.detach(), a0)
    assert opt.state[b]["step"] == 1
