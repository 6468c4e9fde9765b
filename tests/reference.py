"""A slow, readable, pure PyTorch/NumPy oracle of the Gefen optimizer.

It restates docs ALGORITHM.md sections 2-6 one operation at a time so that the
C core can be compared with it: periods, codebooks and codes bitwise, parameters
within fp32 tolerance. Conventions that make it match a plain C loop:

* every fp32 operation is a separate torch op on fp32 tensors (each rounded to
  fp32, no fused multiply-add); Python-float scalars are rounded to fp32 by
  torch before the op;
* two torch fp32 ops are not correctly rounded / not what they look like, so
  they are wrapped: ``torch.sqrt`` on fp32 (vectorised approximation on AVX-512
  builds) -> :func:`_sqrt32` computes in float64 and rounds once, which equals
  C's ``sqrtf``; ``scalar / tensor`` (torch computes ``reciprocal(t) * scalar``)
  -> :func:`_rdiv32` divides a full tensor;
* every float64 sum is a sequential left-to-right sum (``np.cumsum``), as a C
  loop accumulates, not torch's pairwise/vectorised reduction -- except the period
  search's sum of block variances, which the core takes exactly and rounds once
  (``math.fsum``), so that no sharding of the rows can change it.

Nothing here is fast; it is meant for tests only.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import torch

__all__ = [
    "FLT_MIN",
    "K",
    "HIST_BINS",
    "shape_rs",
    "period_candidates",
    "period_errors",
    "choose_period",
    "histogram",
    "bin_centres",
    "solve_codebook",
    "solve_segments",
    "segment_cost",
    "nearest",
    "sr_uniform",
    "stochastic",
    "RefGefen",
]

FLT_MIN = 1.1754943508222875e-38  # smallest normal fp32
K = 256  # codebook entries
HIST_BINS = 4096

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


# --------------------------------------------------------------- helpers


def _f32(x: float) -> float:
    """x rounded to the nearest fp32, as a Python float."""
    return float(np.float32(x))


def _sqrt32(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (C sqrtf)."""
    return torch.sqrt(t.double()).float()


def _rdiv32(c: float, t: torch.Tensor) -> torch.Tensor:
    """fp32 ``c / t`` as one IEEE division per element."""
    return torch.full_like(t, _f32(c)) / t


def _seqsum(a: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Sequential (left-to-right) float64 sum along axis, like a C loop."""
    a = np.asarray(a, dtype=np.float64)
    if axis is None:
        a = a.reshape(-1)
        axis = 0
    if a.shape[axis] == 0:
        return np.sum(a, axis=axis)
    return np.take(np.cumsum(a, axis=axis), -1, axis=axis)


def shape_rs(shape) -> tuple[int, int]:
    """(R, S): R = dim 0 (1 for 0-D), S = product of the other dims (1 for 0-D/1-D)."""
    shape = tuple(shape)
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), int(math.prod(shape[1:]))


# ---------------------------------------------------------------- period (§2)


def period_candidates(S: int, numel: int) -> list[int]:
    """Every divisor d of S with d < numel, ascending."""
    out = []
    d = 1
    while d * d <= S:
        if S % d == 0:
            out.append(d)
            if d * d != S:
                out.append(S // d)
        d += 1
    return sorted(x for x in out if x < numel)


def period_errors(g: torch.Tensor, cands: list[int]) -> list[float]:
    """err(d) of §2 for each candidate d (float64)."""
    x = g.detach().float().reshape(-1)
    x = (x * x).double().numpy()  # squared in fp32, then exact in float64
    errs = []
    for d in cands:
        blocks = x.reshape(-1, d)
        nb = blocks.shape[0]
        mean = _seqsum(blocks, axis=1) / d
        dev = blocks - mean[:, None]
        var = _seqsum(dev * dev, axis=1) / d
        # the sum over blocks is exact, rounded once (order- and sharding-independent)
        total = math.fsum(var.tolist())
        errs.append(math.sqrt(total / nb))
    return errs


def _fallback_period(S: int, ndim: int) -> int:
    if S >= 8 and ndim == 2:
        return S
    best = max(d for d in period_candidates(S, S + 1) if d <= 2048)
    return best if best >= 8 else 1


def choose_period(g: torch.Tensor, mode: str = "auto") -> int:
    """The period P of ALGORITHM.md §2 for a parameter whose gradient is g."""
    R, S = shape_rs(g.shape)
    numel = g.numel()
    if numel <= 1 or S == 1:
        return 1
    if mode == "row":
        return S
    if mode != "auto":
        raise ValueError(f"unknown period mode {mode!r}")
    cands = period_candidates(S, numel)
    errs = period_errors(g, cands)
    scores = [1e-12] + [errs[i] - errs[i - 1] for i in range(1, len(cands))]
    pick = cands[int(np.argmin(scores))]  # first minimum: ties to the smaller d
    if pick < 8:
        return _fallback_period(S, g.dim())
    return pick


# -------------------------------------------------------------- codebook (§3)


def _nan_max(x: torch.Tensor) -> torch.Tensor:
    """max over the last dim of x >= 0 (fp32) where NaN never wins; 0 if all NaN/empty."""
    return torch.where(torch.isnan(x), torch.zeros_like(x), x).amax(dim=-1, keepdim=True)


def _block_normalised(g: torch.Tensor, period: int) -> torch.Tensor:
    """u = g / max|g| per block (fp32), 0 where the block's max is 0; shape (blocks, P)."""
    x = g.detach().float().reshape(-1, period)
    a = _nan_max(x.abs())
    u = torch.where(a > 0, x / a, torch.zeros_like(x))
    return u


def histogram(items: Iterable[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """int64 (4096,) histogram of block-normalised gradients, summed over items."""
    hist = torch.zeros(HIST_BINS, dtype=torch.int64)
    for g, period in items:
        if g.numel() == 0:
            continue
        u = _block_normalised(g, int(period)).reshape(-1)
        # non-finite gradients (unspecified by §3) are not counted, as in the C core:
        # a block max ignores NaN, and a u outside [-1, 1] (NaN from inf/inf or NaN) is dropped
        u = u[(u >= -1.0) & (u <= 1.0)]
        t = torch.floor((u + 1.0) * 2048.0)
        b = t.clamp(max=float(HIST_BINS - 1)).long()
        hist += torch.bincount(b, minlength=HIST_BINS)
    return hist


def bin_centres() -> np.ndarray:
    """float64 centre of every histogram bin: -1 + (i + 0.5) / 2048."""
    return -1.0 + (np.arange(HIST_BINS, dtype=np.float64) + 0.5) / 2048.0


def _prefix(hist):
    h = torch.as_tensor(hist).reshape(-1).to(torch.int64).numpy()
    if h.shape[0] != HIST_BINS:
        raise ValueError(f"histogram must have {HIST_BINS} bins")
    if (h < 0).any():
        raise ValueError("negative histogram count")
    idx = np.nonzero(h > 0)[0]
    x = bin_centres()[idx]
    w = h[idx].astype(np.float64)
    wx = w * x
    wxx = wx * x
    zero = np.zeros(1)
    # prefix sums from 0, sequential; W[k] covers bins 0..k-1 (W[0] = 0)
    W = np.concatenate([zero, np.cumsum(w)])
    S1 = np.concatenate([zero, np.cumsum(wx)])
    S2 = np.concatenate([zero, np.cumsum(wxx)])
    return x, W, S1, S2


def segment_cost(W, S1, S2, s: int, e: int, kind: str = "mid") -> float:
    """Cost of the segment of active bins s..e (0-based, inclusive)."""
    w = W[e + 1] - W[s]
    s1 = S1[e + 1] - S1[s]
    s2 = S2[e + 1] - S2[s]
    if kind == "first":
        return (s2 + 2.0 * s1) + w
    if kind == "last":
        return (s2 - 2.0 * s1) + w
    return s2 - (s1 * s1) / w


def _cost_matrix(W, S1, S2) -> np.ndarray:
    """cost[e, s] of the interior segment s..e (inf where s > e), float64."""
    N = W.shape[0] - 1
    cost = np.full((N, N), np.inf)
    chunk = 256
    for e0 in range(0, N, chunk):
        e1 = min(N, e0 + chunk)
        e = np.arange(e0, e1)
        s = np.arange(0, e1)
        w = W[e + 1][:, None] - W[s][None, :]
        s1 = S1[e + 1][:, None] - S1[s][None, :]
        s2 = S2[e + 1][:, None] - S2[s][None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            c = s2 - (s1 * s1) / w
        c[s[None, :] > e[:, None]] = np.inf
        cost[e0:e1, :e1] = c
    return cost


def solve_segments(hist) -> tuple[list[tuple[int, int]], float]:
    """Optimal segmentation of the N >= 256 active bins into 256 runs (§3 DP).

    Returns the (s, e) runs (0-based indices into the active bins, inclusive)
    and the optimal total cost. Naive O(N^2 K): every admissible start is tried
    for every end, the smallest start wins ties."""
    _, W, S1, S2 = _prefix(hist)
    N = W.shape[0] - 1
    if N < K:
        raise ValueError(f"the DP needs at least {K} active bins, got {N}")
    B = N - K + 1  # cluster c (0-based) starts and ends in bins c .. c + B - 1
    cost = _cost_matrix(W, S1, S2)

    # dp indexed by e - c for cluster c; cluster 0 covers bins 0..e, pinned at -1
    e = np.arange(B)
    dp = (S2[e + 1] + 2.0 * S1[e + 1]) + W[e + 1]
    choice = np.zeros((K, B), dtype=np.int64)
    chunk = 64
    for c in range(1, K - 1):
        new = np.empty(B)
        # start s = c + a needs dp[c-1][s-1], whose index is (s-1) - (c-1) = a
        for b0 in range(0, B, chunk):
            b1 = min(B, b0 + chunk)
            tot = cost[c + b0 : c + b1, c : c + b1] + dp[None, :b1]
            arg = np.argmin(tot, axis=1)  # first minimum: the smallest start wins
            choice[c, b0:b1] = arg
            new[b0:b1] = tot[np.arange(b1 - b0), arg]
        dp = new
    # last cluster: bins s..N-1, pinned at +1
    s = (K - 1) + np.arange(B)
    w = W[N] - W[s]
    s1 = S1[N] - S1[s]
    s2 = S2[N] - S2[s]
    tot = dp + ((s2 - 2.0 * s1) + w)
    arg = int(np.argmin(tot))
    best = float(tot[arg])

    runs = []
    start, end = (K - 1) + arg, N - 1
    runs.append((start, end))
    for c in range(K - 2, -1, -1):
        end = start - 1
        start = 0 if c == 0 else c + int(choice[c, end - c])
        runs.append((start, end))
    runs.reverse()
    return runs, best


def solve_codebook(hist) -> torch.Tensor:
    """The 256-entry fp32 codebook of §3 from a 4096-bin histogram."""
    x, W, S1, S2 = _prefix(hist)
    N = x.shape[0]
    if N == 0:
        raise ValueError("empty histogram: nothing to learn a codebook from")
    if N < K:
        c = [float(v) for v in x]  # one centre per active bin, ascending
        entries = [-1.0] + c + [1.0]
        if len(entries) > K:  # N == 255
            entries = [-1.0] + c[1:] + [1.0]
        while len(entries) < K:
            entries.insert(len(entries) - 1, c[-1])
        return torch.tensor(np.asarray(entries, dtype=np.float64).astype(np.float32))
    runs, _ = solve_segments(hist)
    cb = np.empty(K, dtype=np.float64)
    for i, (s, e) in enumerate(runs):
        cb[i] = (S1[e + 1] - S1[s]) / (W[e + 1] - W[s])
    out = cb.astype(np.float32)
    out[0] = -1.0
    out[-1] = 1.0
    return torch.from_numpy(out)


# ------------------------------------------------------------- quantiser (§3, §6)


def _bracket(u: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """r = first index with C[r] >= u (none for NaN) clamped to 255, l = max(r - 1, 0)."""
    r = torch.searchsorted(C.contiguous(), u.contiguous(), side="left")
    r = torch.where(torch.isnan(u), torch.full_like(r, K), r)
    r = r.clamp(max=K - 1)
    l = (r - 1).clamp(min=0)
    return l, r


def nearest(u: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """Nearest code of each fp32 value (ties low, NaN -> 255)."""
    u = u.float()
    C = C.float()
    l, r = _bracket(u.reshape(-1), C)
    uf = u.reshape(-1)
    dl = (uf - C[l]).abs()
    dr = (uf - C[r]).abs()
    code = torch.where(dl <= dr, l, r)
    code = torch.where(torch.isnan(uf), torch.full_like(code, K - 1), code)
    return code.to(torch.uint8).reshape(u.shape)


def sr_uniform(seed: int, index) -> torch.Tensor:
    """U in [0, 1) of §6 for each global flat index (fp32, exact)."""
    idx = torch.as_tensor(index, dtype=torch.int64)
    shape = idx.shape
    i = np.atleast_1d(idx.reshape(-1).numpy()).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(int(seed) % 2**64) + np.uint64(_GOLDEN) * (i + np.uint64(1))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z = z ^ (z >> np.uint64(31))
    top = (z >> np.uint64(40)).astype(np.float32)  # < 2**24: exact
    U = top * np.float32(2.0**-24)
    return torch.from_numpy(np.ascontiguousarray(U)).reshape(shape)


def stochastic(u: torch.Tensor, C: torch.Tensor, seed: int, index) -> torch.Tensor:
    """Stochastic rounding of §6: code r if U < p_up else l.

    Taken literally for NaN: r = 255, l = 254, p_up = NaN, U < NaN is false -> 254
    (the C core's binary search gives the same)."""
    u = u.float()
    C = C.float()
    uf = u.reshape(-1)
    l, r = _bracket(uf, C)
    cl, cr = C[l], C[r]
    span = cr - cl
    with torch.no_grad():
        p_up = torch.where(span == 0, torch.zeros_like(uf), (uf - cl) / span)
    U = sr_uniform(seed, torch.as_tensor(index).reshape(-1))
    code = torch.where(U < p_up, r, l)
    return code.to(torch.uint8).reshape(u.shape)


# ------------------------------------------------------------ optimizer (§4-§6)


class RefGefen(torch.optim.Optimizer):
    """Reference Gefen: slow, one parameter at a time, state as the real optimizer's."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        factored=True,
        period="auto",
        codebook_refresh_every=0,
        stochastic_round=False,
        fp32_hyperparameters=False,
    ):
        if period not in ("auto", "row"):
            raise ValueError(f"period must be 'auto' or 'row', got {period!r}")
        if not isinstance(codebook_refresh_every, int) or codebook_refresh_every < 0:
            raise ValueError("codebook_refresh_every must be an int >= 0")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.factored = bool(factored)
        self.period_mode = period
        self.codebook_refresh_every = codebook_refresh_every
        self.stochastic_round = bool(stochastic_round)
        # False: lr, betas, eps, weight_decay are Python doubles; 1 - beta, 1 - lr*wd
        # and the bias corrections are formed in double and rounded once when
        # used (the brief's rule). True: round lr, betas, eps, weight_decay to
        # fp32 first (the C core's gefen_adam_item holds them as float), then
        # the same double formulas, e.g. omb1 = fp32(1 - (double)fp32(beta1)).
        self.fp32_hyperparameters = bool(fp32_hyperparameters)
        self.codebook: torch.Tensor | None = None
        self.global_step = 0

    # -- helpers
    def _active(self):
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.numel() > 0:
                    out.append((group, p))
        return out

    def _init_state(self, p: torch.Tensor) -> None:
        R, S = shape_rs(p.shape)
        P = choose_period(p.grad, self.period_mode)
        factored = self.factored and p.dim() >= 2
        st = self.state[p]
        st["step"] = 0
        st["period"] = P
        st["factored"] = 1 if factored else 0
        st["codes"] = torch.zeros(p.shape, dtype=torch.uint8)
        st["magnitude"] = torch.zeros(R, S // P, dtype=torch.float32)
        if factored:
            st["v_row"] = torch.zeros(R, dtype=torch.float32)
            st["v_col"] = torch.zeros(S, dtype=torch.float32)
        else:
            st["vmean"] = torch.zeros(R, S // P, dtype=torch.float32)
        st["global_step"] = self.global_step
        if self.codebook is not None:
            st["codebook"] = self.codebook

    def _learn(self, active) -> torch.Tensor:
        items = [(p.grad, self.state[p]["period"]) for _, p in active]
        return solve_codebook(histogram(items))

    # -- the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = self._active()
        if not active:
            return loss
        # §5: zero learning rate and all-zero gradients -> nothing at all
        if all(float(g["lr"]) == 0.0 for g in self.param_groups) and all(
            bool((p.grad == 0).all()) for _, p in active
        ):
            return loss

        for _, p in active:
            if p not in self.state or len(self.state[p]) == 0:
                self._init_state(p)

        t = self.global_step + 1  # this real step, 1-based
        n = self.codebook_refresh_every
        if self.codebook is None:
            self.codebook = self._learn(active)
        elif n > 0 and t > 1 and (t - 1) % n == 0:
            old = self.codebook.clone()
            new = self._learn(active)
            remap = nearest(old, new).long()  # old code c -> nearest new entry of old[c]
            for st in self.state.values():
                if "codes" in st:
                    st["codes"].copy_(remap[st["codes"].long()].to(torch.uint8))
            self.codebook.copy_(new)
        for st in self.state.values():
            if "codes" in st:
                st["codebook"] = self.codebook

        seed = self.global_step
        for group, p in active:
            self._update(group, p, seed)

        self.global_step += 1
        for st in self.state.values():
            if "codes" in st:
                st["global_step"] = self.global_step
        return loss

    def _update(self, group, p: torch.Tensor, seed: int) -> None:
        st = self.state[p]
        R, S = shape_rs(p.shape)
        P = st["period"]
        nb = R * S // P
        lr = float(group["lr"])
        b1, b2 = (float(b) for b in group["betas"])
        eps = float(group["eps"])
        wd = float(group["weight_decay"])
        if self.fp32_hyperparameters:
            lr, b1, b2, eps, wd = (_f32(v) for v in (lr, b1, b2, eps, wd))
        omb1 = 1.0 - b1
        omb2 = 1.0 - b2
        C = self.codebook

        g = p.grad.detach().float().reshape(nb, P)
        sq = g * g  # fp32

        # 1. second moment
        if st["factored"]:
            sq64 = sq.reshape(R, S).double().numpy()
            rowmean = torch.from_numpy(_seqsum(sq64, axis=1) / S).float()
            colmean = torch.from_numpy(_seqsum(sq64, axis=0) / R).float()
            v_row = b2 * st["v_row"] + omb2 * rowmean
            v_col = b2 * st["v_col"] + omb2 * colmean
            st["v_row"].copy_(v_row)
            st["v_col"].copy_(v_col)
            mu = _f32(float(_seqsum(v_row.double().numpy())) / R)
            denom = max(mu, FLT_MIN)
        else:
            mean_b = torch.from_numpy(_seqsum(sq.double().numpy(), axis=1) / P).float()
            vmean = b2 * st["vmean"].reshape(nb) + omb2 * mean_b
            st["vmean"].copy_(vmean.reshape(st["vmean"].shape))

        # 2. bias corrections (double)
        st["step"] += 1
        k = st["step"]
        bc1 = 1.0 - b1**k
        bc2 = 1.0 - b2**k

        # 3. step size
        if st["factored"]:
            vhat = (v_row[:, None] * v_col[None, :]) / denom
            s = _rdiv32(1.0 / bc1, _sqrt32(vhat / _f32(bc2)) + eps)
            s = s.reshape(nb, P)
        else:
            s = _rdiv32(1.0 / bc1, _sqrt32(vmean) * _f32(1.0 / math.sqrt(bc2)) + eps)
            s = s.reshape(nb, 1)

        # 4. momentum from the stored codes
        codes = st["codes"].reshape(nb, P).long()
        mag = st["magnitude"].reshape(nb, 1)
        m = b1 * (C[codes] * mag) + omb1 * g

        # 5. new block magnitude (NaN never wins)
        mag_new = _nan_max(m.abs())

        # 6. requantise
        u = torch.where(mag_new > 0, m / mag_new, torch.zeros_like(m))
        if self.stochastic_round:
            index = torch.arange(R * S, dtype=torch.int64).reshape(nb, P)
            new_codes = stochastic(u, C, seed, index)
        else:
            new_codes = nearest(u, C)
        mq = C[new_codes.long()] * mag_new
        st["codes"].copy_(new_codes.reshape(p.shape))
        st["magnitude"].copy_(mag_new.reshape(st["magnitude"].shape))

        # 7. decoupled weight decay, then the update; one rounding into p
        upd = (mq * s).reshape(p.shape)
        if p.dtype == torch.float64:
            p64 = p.detach().double() * (1.0 - lr * wd)
            p64 = p64 - lr * upd.double()
            p.copy_(p64)
        else:
            p32 = p.detach().float() * _f32(1.0 - lr * wd)
            p32 = p32 - lr * upd
            p.copy_(p32)
