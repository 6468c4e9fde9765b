#!/usr/bin/env python
"""The momentum stage of Muon alone (no Newton-Schulz): torch.optim.Muon's fp32 momentum
(`buf.lerp_(g, 1 - beta)` then the Nesterov blend `g.lerp(buf, beta)` into bf16) against
GefenMuon's 8-bit momentum in C (the `momentum()` of the step plan `gefen._C.MuonStep`
that GefenMuon builds: dequantise, update, requantise, write the bf16 Newton-Schulz input),
on the 2-D matrices of an attention block.

    python benchmarks/muon_momentum.py [--sizes 1M,16M,64M] [--steps 10]
    python benchmarks/muon_momentum.py --quick          # 1M, 2 steps: seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402

import gefen  # noqa: E402
from gefen import _C  # noqa: E402
from gefen._items import MuonItem  # noqa: E402

WIDTH = {"1M": 512, "16M": 2048, "64M": 4096}


def median_ms(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(size: str, beta: float, steps: int) -> tuple[int, float, float]:
    """(parameters, torch ms, GefenMuon ms) for one parameter set."""
    d = WIDTH[size]
    gen = torch.Generator().manual_seed(0)
    shapes = [(3 * d, d), (d, d)]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    bufs = [torch.zeros_like(g) for g in grads]
    outs = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]

    def torch_momentum():
        for g, buf, out in zip(grads, bufs, outs):
            buf.lerp_(g, 1 - beta)
            out.copy_(g.lerp(buf, beta))

    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = gefen.GefenMuon(params, lr=1e-3, momentum=beta)
    for q, g in zip(params, grads):
        q.grad = g
    # The setup step learns the periods and the codebook; its Newton-Schulz output is not
    # used or timed, so it is skipped (on a CPU without AVX512-BF16, torch's bfloat16
    # matrix products take minutes at 16M: measured on a Zen 3 host, 2026-12-03).
    opt._newton_schulz = lambda view, x: x
    opt.step()
    del opt._newton_schulz
    items = [MuonItem(name=f"w{i}", grad=g, codes=opt.state[q]["codes"],
                      magnitude=opt.state[q]["magnitude"], out=out,
                      period=int(opt.state[q]["period"]), beta=beta, nesterov=True)
             for i, (q, g, out) in enumerate(zip(params, grads, outs))]
    step = _C.MuonStep(items)  # validated once, as GefenMuon does per step and device
    nthreads = torch.get_num_threads()

    def gefen_momentum():
        step.momentum(opt._quantizer, nthreads)

    n = sum(g.numel() for g in grads)
    t_torch = median_ms(torch_momentum, steps)
    for out in outs:  # both write the same outputs: clear them, so that a call writing
        out.zero_()  # nothing would show below
    t_gefen = median_ms(gefen_momentum, steps)
    if not all(bool(out.float().abs().sum() > 0) for out in outs):
        raise RuntimeError("GefenMuon's momentum left its Newton-Schulz inputs zero")
    return n, t_torch, t_gefen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,16M,64M")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="1M only, 2 timed steps")
    C.add_common_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.steps = "1M", 2
    C.set_threads(a.threads)
    C.print_header("Muon momentum stage: torch fp32 vs GefenMuon 8-bit (no Newton-Schulz)",
                   {"sizes": a.sizes, "steps": a.steps})
    print(f"\n{'set':>4} {'params':>11} {'torch Muon ms':>14} {'GefenMuon ms':>13} {'ratio':>6}")
    results = []
    for size in C.parse_list(a.sizes):
        n, t_torch, t_gefen = measure(size, 0.95, a.steps)
        print(f"{size:>4} {n:>11,} {t_torch:>14.3f} {t_gefen:>13.3f} {t_gefen / t_torch:>6.2f}")
        results.append({"set": size, "params": n, "torch_ms": t_torch, "gefen_ms": t_gefen})
    C.write_json(a.json, {"benchmark": "muon_momentum", "machine": C.machine_info(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
