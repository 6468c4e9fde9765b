#!/usr/bin/env python
"""Gefen's factored CPU step: read the gradient twice (two phases) or once (the momentum
formed in the statistics pass), and the choice Gefen makes by timing the two
(``gefen._tuning.FactoredTuner``). The bits are the same; only the time differs.

Three optimizers on three copies of the same parameter set (step_time.py's sets: one
attention block of width d) step in turn, in the order two-phase, fused, chosen, chosen,
fused, two-phase (ABBA, so a drift of the machine's speed cancels), each step timed
around ``optimizer.step()``; medians over the rounds. Both cores.

  python benchmarks/factored_plan.py                       # 16M and 64M, fp32 and bf16
  python benchmarks/factored_plan.py --sizes 16M --dtypes fp16 --rounds 12
  python benchmarks/factored_plan.py --quick                          # seconds
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
from step_time import DTYPES, build_params  # noqa: E402

import gefen  # noqa: E402
from gefen._tuning import FactoredTuner  # noqa: E402

KINDS = ("two-phase", "in-stats", "chosen")


def build(size: str, dtype: torch.dtype, kind: str, seed: int):
    """step_time.py's set (parameters and gradients) and a Gefen on it, its factored
    step's form fixed ("two-phase", "in-stats") or chosen by its own timing ("chosen")."""
    params = [p for _name, p in build_params(size, dtype, torch.device("cpu"), seed, only_2d=False)]
    opt = gefen.Gefen(params, lr=1e-4, weight_decay=0.01)
    if kind != "chosen":
        opt._tuner = FactoredTuner(choice=kind == "in-stats")
    return params, opt


def run(size: str, dtype_name: str, rounds: int, warmup: int) -> dict:
    opts = {k: build(size, DTYPES[dtype_name], k, seed=1) for k in KINDS}
    for _ in range(warmup):
        for _params, opt in opts.values():
            opt.step()
    times = {k: [] for k in KINDS}
    order = list(KINDS) + list(reversed(KINDS))
    for _ in range(rounds):
        for k in order:
            t0 = time.perf_counter()
            opts[k][1].step()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    same = all(torch.equal(a, b) for a, b in zip(opts["two-phase"][0], opts["in-stats"][0])) and \
        all(torch.equal(a, b) for a, b in zip(opts["two-phase"][0], opts["chosen"][0]))
    tuner = opts["chosen"][1]._tuner
    chose = {None: "measuring", False: "two-phase", True: "in-stats"}[tuner.choice]
    measured = "" if tuner.medians is None else \
        f" (its own medians {tuner.medians[False] * 1e3:.2f} / {tuner.medians[True] * 1e3:.2f} ms)"
    n = sum(p.numel() for p in opts["chosen"][0])
    print(f"{size:>4} {dtype_name:>5} {n:>11,}  two-phase {med['two-phase']:8.2f} ms  "
          f"in-stats {med['in-stats']:8.2f} ms ({med['in-stats'] / med['two-phase']:.3f})  "
          f"chosen {med['chosen']:8.2f} ms ({med['chosen'] / med['two-phase']:.3f}) "
          f"-> {chose}{measured}  bit-identical: {same}", flush=True)
    return {"set": size, "dtype": dtype_name, "params": n, "median_ms": med, "chosen": chose,
            "tuner_medians_ms": None if tuner.medians is None else
            {"two-phase": tuner.medians[False] * 1e3, "in-stats": tuner.medians[True] * 1e3},
            "bit_identical": same, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16M,64M")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=8, help="ABBA rounds (two steps of each per round)")
    ap.add_argument("--warmup", type=int, default=12,
                    help="steps of each before timing (the chosen one measures in its steps 3-10)")
    ap.add_argument("--quick", action="store_true", help="1M fp32, 2 rounds: seconds")
    C.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.dtypes, args.rounds = "1M", "fp32", 2
    C.set_threads(args.threads)
    C.print_header("factored CPU step: two phases, momentum in the statistics pass, chosen by timing",
                   vars(args))
    results = [run(size, dt, args.rounds, args.warmup)
               for size in C.parse_list(args.sizes) for dt in C.parse_list(args.dtypes)]
    C.write_json(args.json, {"benchmark": "factored_plan", "machine": C.machine_info(), "results": results})


if __name__ == "__main__":
    main()
