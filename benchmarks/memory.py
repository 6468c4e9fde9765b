#!/usr/bin/env python
"""Optimizer-state memory: bytes of optimizer state per parameter on a GPT-2-small-shaped
model (124.4M params, tied head), built locally.  Target: gefen <= 1.05 B/param
(AdamW fp32: 8.0; ALGORITHM.md §4: block 1 + 8/P, factored 1 + 4/P + 4/S + 4/R).

State bytes = the nbytes of every tensor reachable from optimizer.state_dict()['state']
(recursively through dicts), a storage shared between parameters counted once, ints 0.
One model is built and reused; every parameter gets a fixed random gradient; each
optimizer takes --steps steps (lr 1e-6) and is freed before the next.

  python benchmarks/memory.py
  python benchmarks/memory.py --optimizers adamw,gefen,hybrid-gefen,hybrid-adamw --json m.json
  python benchmarks/memory.py --quick                               # small model, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402

# B/param targets (issues): Gefen <= 1.05 on the whole model, GefenMuon ~1 on the 2-D
# weights it takes, the Hybrid with a Gefen backup <= 1.1 on the whole model.
TARGETS = {"gefen": 1.05, "gefen-block": 1.05, "gefenmuon": 1.05, "hybrid-gefen": 1.1}
MATRIX_ONLY = ("muon", "gefenmuon")  # measured over the Muon-routed 2-D weights
QUICK_CFG = C.GPTConfig(vocab_size=8192, ctx=256, n_layer=2, d_model=256, n_head=4,
                        d_mlp=1024, bias=True, tie_head=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizers",
                   default="adamw,gefen,gefen-block,muon,gefenmuon,muon+adamw,hybrid-gefen,"
                           "hybrid-adamw",
                   help="comma list from: " + ", ".join(C.OPTIMIZERS))
    p.add_argument("--model", choices=["gpt2-small", "small-test"], default="gpt2-small")
    p.add_argument("--untied", action="store_true", help="untied lm_head (163.0M params)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--grad-scale", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small-test model (2x256, vocab 8192)")
    p.add_argument("--strict", action="store_true", help="exit 1 if the target is missed")
    C.add_common_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.model = "small-test"
    return a


def rss_gb() -> float:
    # ru_maxrss is KiB on Linux: the process's peak resident set so far.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv=None) -> int:
    a = parse_args(argv)
    C.set_threads(a.threads)
    names = C.parse_list(a.optimizers)
    C.check_optimizer_names(names)
    cfg = {"optimizers": ",".join(names), "model": a.model, "tied": not a.untied,
           "steps": a.steps, "lr": a.lr, "seed": a.seed}
    C.print_header("gefen optimizer-state memory (bytes per parameter)", cfg)

    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    if a.model == "gpt2-small":
        model = C.gpt2_small_shaped(tie_head=not a.untied)
    else:
        model = C.GPT(dataclasses.replace(QUICK_CFG, tie_head=not a.untied))
    n = C.count_params(model)
    g = torch.Generator().manual_seed(a.seed + 1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * a.grad_scale
    print(f"# model {a.model}: {n:,} params ({n * 4 / 2**30:.2f} GiB fp32), "
          f"{sum(1 for _ in model.parameters())} tensors; built in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    print("# theoretical: AdamW fp32 8.00 B/param (exp_avg + exp_avg_sq); "
          "Gefen block 1 + 8/P, factored 1 + 4/P + 4/S + 4/R (ALGORITHM §4)")

    emb = C._embedding_ids(model)
    matrices = [(k, p) for k, p in model.named_parameters() if C.is_muon_param(k, p, model, emb)]
    n_matrices = C.count_params(matrices)
    print(f"# {len(matrices)} hidden 2-D weights ({n_matrices:,} params) go to Muon; "
          f"{', '.join(MATRIX_ONLY)} are measured over those")

    results, misses = [], 0
    for name in names:
        t0 = time.perf_counter()
        over = matrices if name in MATRIX_ONLY else model
        n_over = n_matrices if name in MATRIX_ONLY else n
        opt = C.make_optimizer(name, over, lr=a.lr, weight_decay=0.0)
        for _ in range(a.steps):
            opt.step()
        dt = time.perf_counter() - t0
        br = C.state_breakdown(opt)
        total = sum(e["bytes"] for e in br.values())
        bpp = total / n_over
        target = TARGETS.get(name)
        verdict = ("PASS" if bpp <= target else "MISS") if target else ""
        misses += verdict == "MISS"
        print(f"\n{name}  ({C.OPTIMIZERS[name][2]}; over {n_over:,} params; {a.steps} step(s) "
              f"{dt:.1f}s, peak RSS so far {rss_gb():.2f} GB)")
        print(f"  {'state key':<28} {'tensors':>8} {'dtype':<16} {'MiB':>10} {'B/param':>8}")
        for key, e in sorted(br.items(), key=lambda kv: -kv[1]["bytes"]):
            extra = f"  (+{e['shared_skipped']} shared refs)" if e["shared_skipped"] else ""
            print(f"  {key:<28} {e['tensors']:>8} {e['dtypes']:<16} "
                  f"{e['bytes'] / 2**20:>10.2f} {e['bytes'] / n_over:>8.4f}{extra}")
        print(f"  {'TOTAL':<28} {'':>8} {'':<16} {total / 2**20:>10.2f} {bpp:>8.4f}"
              + (f"   target <= {target}: {verdict}" if verdict else ""))
        results.append({"optimizer": name, "params": n_over, "matrices_only": name in MATRIX_ONLY,
                        "state_bytes": total, "bytes_per_param": bpp,
                        "verdict": verdict or None, "seconds": dt,
                        "breakdown": br})
        del opt, br
        gc.collect()

    print(f"\nsummary ({n:,} params)")
    print(f"{'optimizer':<14} {'over':<9} {'state MiB':>10} {'B/param':>8}  verdict")
    print(f"{'(theory AdamW)':<14} {'model':<9} {8 * n / 2**20:>10.1f} {8.0:>8.4f}")
    for r in results:
        print(f"{r['optimizer']:<14} {'matrices' if r['matrices_only'] else 'model':<9} "
              f"{r['state_bytes'] / 2**20:>10.1f} {r['bytes_per_param']:>8.4f}  "
              f"{r['verdict'] or '-'}")
    print(f"# peak RSS {rss_gb():.2f} GB")
    C.write_json(a.json, {"benchmark": "memory", "machine": C.machine_info(), "config": cfg,
                          "params": n, "matrix_params": n_matrices, "targets": TARGETS,
                          "results": results})
    return 1 if (a.strict and misses) else 0


if __name__ == "__main__":
    sys.exit(main())
