"""A slow, readable, pure-PyTorch oracle of GefenMuon (ALGORITHM.md §7).

Periods, codebook and nearest-code search come from ``reference.py`` (§2–§3). The
momentum is restated one fp32 operation at a time, like the C loop, so codes and block
magnitudes must match the core bit for bit. Newton–Schulz is written with separate
matmul / scale / add operations in bf16 (``torch.optim.Muon`` and gefen fuse them into
``addmm``), so orthogonalised updates agree within bf16 rounding, not bitwise.

``quantize=False`` keeps the momentum as a dense fp32 buffer instead: the algorithm
then is ``torch.optim.Muon``'s (plus the optional NorMuon and schedules), which
test_unquantized_oracle_is_torch_muon compares with torch.optim.Muon; gefen itself has no
such switch.
"""

from __future__ import annotations

import math

import numpy as np
import reference as ref
import torch

__all__ = ["NS_SCHEDULES", "STANDARD", "ns_reference", "lr_ratio_reference", "RefGefenMuon"]

STANDARD = (3.4445, -4.7750, 2.0315)
NS_SCHEDULES = {
    "tuned3": [(5.0067, -14.4125, 10.6001), (3.7534, -6.8083, 3.3840), (3.2080, -4.3501, 2.0330)],
    "tuned4": [
        (5.4261, -15.5285, 11.2657),
        (3.0766, -4.9701, 2.1297),
        (3.0008, -6.4486, 4.3696),
        (2.8386, -4.1421, 2.5758),
    ],
}


def _f32(x: float) -> float:
    return float(np.float32(x))


def schedule_of(ns_schedule, ns_coefficients, ns_steps):
    """The (a, b, c) of every iteration (§7)."""
    if ns_schedule is None or ns_schedule == "standard":
        return [tuple(ns_coefficients)] * ns_steps
    if isinstance(ns_schedule, str):
        return NS_SCHEDULES[ns_schedule]
    return [tuple(t) for t in ns_schedule]


def ns_reference(g: torch.Tensor, schedule, eps: float) -> torch.Tensor:
    """Newton–Schulz of §7. Every matrix is stored in bf16 (as gefen and torch.optim.Muon
    store them); each product or combination is computed from those bf16 values in
    float64 and rounded once to bf16 — what a bf16 GEMM with wide accumulation does."""

    def bf16(t):
        return t.to(torch.bfloat16)

    x = bf16(g.float())
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    norm = bf16(x.double().pow(2).sum().sqrt())  # a bf16 scalar, as torch's bf16 norm
    x = bf16(x.double() / max(float(norm), eps))
    for a, b, c in schedule:
        xd = x.double()
        A = bf16(xd @ xd.T)
        Ad = A.double()
        B = bf16(b * Ad + c * (Ad @ Ad))
        x = bf16(a * xd + B.double() @ xd)
    if tall:
        x = x.T
    return x


def lr_ratio_reference(adjust_lr_fn, rows: int, cols: int) -> float:
    """§7 learning-rate ratio."""
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    assert adjust_lr_fn == "match_rms_adamw"
    return 0.2 * math.sqrt(max(rows, cols))


class RefGefenMuon(torch.optim.Optimizer):
    """Reference GefenMuon: one parameter at a time, state named as the real one's.

    With ``quantize=False`` the state is ``momentum_buffer`` (fp32, parameter-shaped)
    and no codebook is learned."""

    def __init__(
        self,
        params,
        lr=1e-3,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_coefficients=STANDARD,
        eps=1e-7,
        ns_steps=5,
        adjust_lr_fn=None,
        *,
        ns_schedule=None,
        normuon=False,
        normuon_beta2=0.95,
        normuon_eps=1e-8,
        codebook_refresh_every=0,
        quantize=True,
    ):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)
        super().__init__(params, defaults)
        self.schedule = schedule_of(ns_schedule, ns_coefficients, ns_steps)
        self.eps = eps
        self.adjust_lr_fn = adjust_lr_fn
        self.normuon = normuon
        self.normuon_beta2 = normuon_beta2
        self.normuon_eps = normuon_eps
        self.codebook_refresh_every = codebook_refresh_every
        self.quantize = quantize
        self.codebook = None
        self.global_step = 0
        self.last_update = {}  # param -> the O applied in the last step (fp32)

    def _active(self):
        return [
            (g, p) for g in self.param_groups for p in g["params"] if p.grad is not None and p.numel()
        ]

    def _init_state(self, p):
        st = self.state[p]
        st["step"] = 0
        if self.quantize:
            R, S = ref.shape_rs(p.shape)
            P = ref.choose_period(p.grad, "auto")
            st["period"] = P
            st["codes"] = torch.zeros(p.shape, dtype=torch.uint8)
            st["magnitude"] = torch.zeros(R, S // P, dtype=torch.float32)
            st["global_step"] = self.global_step
        else:
            st["momentum_buffer"] = torch.zeros(p.shape, dtype=torch.float32)
        if self.normuon:
            st["v"] = torch.zeros(p.shape[0], dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        active = self._active()
        if not active:
            return None
        if all(float(g["lr"]) == 0.0 for g in self.param_groups) and all(
            not bool(p.grad.any()) for _, p in active
        ):
            return None
        for _, p in active:
            if not self.state[p]:
                self._init_state(p)
        if self.quantize:
            t = self.global_step + 1
            n = self.codebook_refresh_every
            items = [(p.grad, self.state[p]["period"]) for _, p in active]
            if self.codebook is None:
                self.codebook = ref.solve_codebook(ref.histogram(items))
            elif n > 0 and t > 1 and (t - 1) % n == 0:
                new = ref.solve_codebook(ref.histogram(items))
                remap = ref.nearest(self.codebook, new).long()
                for st in self.state.values():
                    st["codes"].copy_(remap[st["codes"].long()].to(torch.uint8))
                self.codebook.copy_(new)
        for group, p in active:
            self._update(group, p)
        self.global_step += 1
        if self.quantize:
            for st in self.state.values():
                st["global_step"] = self.global_step
                st["codebook"] = self.codebook
        return None

    def _momentum(self, group, p):
        """The Newton–Schulz input (fp32) after updating the stored momentum."""
        st = self.state[p]
        beta = float(group["momentum"])
        g = p.grad.detach().float()
        if not self.quantize:
            buf = st["momentum_buffer"]
            buf.copy_(buf + (1.0 - beta) * (g - buf))
            mq = buf
            return beta * mq + (1.0 - beta) * g if group["nesterov"] else mq.clone()
        C = self.codebook
        P = st["period"]
        nb = p.numel() // P
        omb = _f32(1.0 - beta)
        gb = g.reshape(nb, P)
        mo = C[st["codes"].reshape(nb, P).long()] * st["magnitude"].reshape(nb, 1)
        m = mo + omb * (gb - mo)
        mag = ref._nan_max(m.abs())
        u = torch.where(mag > 0, m / mag, torch.zeros_like(m))
        codes = ref.nearest(u, C)
        mq = C[codes.long()] * mag
        st["codes"].copy_(codes.reshape(p.shape))
        st["magnitude"].copy_(mag.reshape(st["magnitude"].shape))
        if group["nesterov"]:
            out = _f32(beta) * mq + omb * gb
        else:
            out = mq
        return out.reshape(p.shape)

    def _update(self, group, p):
        st = self.state[p]
        ns_in = self._momentum(group, p)
        o = ns_reference(ns_in, self.schedule, self.eps).float()
        st["step"] += 1
        if self.normuon:
            b2 = self.normuon_beta2
            before = o.pow(2).sum().sqrt()
            st["v"].copy_(b2 * st["v"] + (1 - b2) * o.pow(2).mean(dim=1))
            vhat = st["v"] / (1 - b2 ** st["step"])
            o = o / (vhat.sqrt() + self.normuon_eps)[:, None]
            after = o.pow(2).sum().sqrt()
            if float(after) > 0:
                o = o * (before / after)
        self.last_update[p] = o
        lr = float(group["lr"])
        rows, cols = p.shape
        ratio = lr_ratio_reference(self.adjust_lr_fn, rows, cols)
        p.mul_(1 - lr * float(group["weight_decay"]))
        p.add_(o.to(p.dtype), alpha=-lr * ratio)
