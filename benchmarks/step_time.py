#!/usr/bin/env python
"""Optimizer step time: median wall time of optimizer.step() (after warmup) for gefen vs
torch.optim.AdamW(fused=True) and AdamW(foreach=True), on parameter sets of ~1M, 16M and
64M elements in fp32 and bf16, with fixed random gradients.  Also GefenMuon vs
torch.optim.Muon on the 2-D matrices of a set (--optimizers muon,gefenmuon).

Parameter sets (one transformer attention block of width d: fused qkv (3d, d), output
projection (d, d), LayerNorm weight and bias (d,)), N = 4d^2 + 2d:
  1M: d=512 -> 1,049,600    16M: d=2048 -> 16,781,312    64M: d=4096 -> 67,117,056
  128M: d=5632 -> 126,887,936    256M: d=8000 -> 256,016,000    (for GPUs)
Model-shaped sets (146 tensors: 12 GPT-2 transformer layers of width d with their biases
and LayerNorms, and the final LayerNorm; no embeddings):
  12x256: 9,477,632    12x768: 85,056,000
On CUDA the achieved bytes/s is also given as a fraction of the device's measured copy
bandwidth (a 1 GiB device-to-device copy, read + write counted).

  python benchmarks/step_time.py
  python benchmarks/step_time.py --sizes 16M --dtypes bf16 --optimizers adamw-fused,gefen,gefen-block
  python benchmarks/step_time.py --optimizers muon,gefenmuon --sizes 1M
  python benchmarks/step_time.py --device cuda --json st.json
  python benchmarks/step_time.py --quick                               # seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402

WIDTH = {"1M": 512, "16M": 2048, "64M": 4096, "128M": 5632, "256M": 8000}
# Model-shaped sets: the parameters of 12 GPT-2 transformer layers of width d (per
# layer: LayerNorm weight and bias, qkv (d, 3d) and its bias, projection (d, d) and bias,
# LayerNorm, MLP (d, 4d) and (4d, d) with biases) and the final LayerNorm, no embeddings:
# 146 tensors, 98 of them 1-D, so the per-tensor costs show.
LAYERS = {"12x256": 256, "12x768": 768}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MUON_LIKE = ("muon", "gefenmuon")
# ratio column: each optimizer's time over its baseline's time for the same set
BASELINE = {"gefenmuon": "muon", "muon": "muon"}
DEFAULT_BASELINE = "adamw-fused"


def shapes(size: str) -> List[Tuple[int, ...]]:
    if size in LAYERS:
        d = LAYERS[size]
        layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),
                 (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
        return layer * 12 + [(d,), (d,)]
    d = WIDTH[size]
    return [(3 * d, d), (d, d), (d,), (d,)]


# ---- memory traffic per step ---------------------------------------------------------
# Bytes moved per step (the bandwidth floor; caches ignored):
#     bytes/step = N * (2*ps + gs) + 2 * state_bytes
#   ps, gs = element size of the parameter and of its gradient; the parameter is read and
#   written (2*ps), the gradient only read (gs); every persistent state byte is read once and
#   written once (2 * state_bytes, measured from the optimizer after the warmup steps).
# AdamW, fp32:           state 8 B/param (exp_avg, exp_avg_sq)  -> 4+4+4 + 2*8  = 28 B/param
# AdamW, bf16 params:    torch keeps exp_avg/exp_avg_sq in the parameter dtype (bf16),
#                        state 4 B/param                        -> 2+2+2 + 2*4  = 14 B/param
#                        (with fp32 state it would be 2+2+2 + 2*8 = 22 B/param)
# Gefen, fp32:           1-byte momentum codes read+write (2 B) plus the small per-block
#                        state: block magnitudes (4/P B/param), and block second moments
#                        (4/P) or factored v_row/v_col (4/S + 4/R), each read+written
#                        -> 4+4+4 + 2*(1 + 8/P)  ~ 14 B/param  (ALGORITHM §9: "about 14")
# Gefen, bf16:           2+2+2 + 2*(1 + ...)    ~  8 B/param
# Muon / GefenMuon:      the same formula (momentum 4 B or ~1 B); Newton–Schulz is
#                        matmul-bound, so their bytes/s is nominal only.
# The shared codebook (1 KiB) and step counters are counted in state_bytes but are
# negligible; bytes/s = bytes/step / median step time.


def bytes_per_step(n: int, param_elt: int, grad_elt: int, state_bytes: int) -> int:
    return n * (2 * param_elt + grad_elt) + 2 * state_bytes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizers", default="adamw-fused,adamw-foreach,gefen",
                   help="comma list from: " + ", ".join(
                       n for n in C.OPTIMIZERS if not n.startswith(("muon+", "hybrid"))))
    p.add_argument("--sizes", default=None,
                   help="comma list from " + ",".join([*WIDTH, *LAYERS])
                   + " (default 1M,16M,64M; 1M with --quick)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list from fp32,bf16,fp16")
    p.add_argument("--device", default="cpu", help="cpu or cuda (skips cleanly without CUDA)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=12,
                   help="untimed steps first (gefen learns periods/codebook on step 1 and "
                        "times the two forms of its factored CPU step on steps 3-10; was 3)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--muon-max-params", type=float, default=None,
                   help="skip muon/gefenmuon on sets larger than this (default: 4e6 on "
                        "cpu, no limit on cuda: Newton-Schulz on a CPU is slow)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="1M only (unless --sizes), 3 timed steps, 1 warmup")
    C.add_common_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.steps, a.warmup = a.sizes or "1M", 3, 1
    a.sizes = a.sizes or "1M,16M,64M"
    if a.muon_max_params is None:
        a.muon_max_params = 4e6 if a.device == "cpu" else float("inf")
    return a


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_params(size: str, dtype: torch.dtype, device: torch.device, seed: int,
                 only_2d: bool):
    g = torch.Generator().manual_seed(seed)
    named = []
    for i, shp in enumerate(shapes(size)):
        if only_2d and len(shp) != 2:
            continue
        p = torch.nn.Parameter((torch.randn(shp, generator=g) * 0.02).to(device, dtype))
        p.grad = torch.randn(shp, generator=g).to(device, dtype)
        named.append((f"block.{i}.{'weight' if len(shp) == 2 else 'ln'}", p))
    return named


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), median of 10."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times)


def time_one(name: str, named, a, device) -> Dict:
    opt = C.make_optimizer(name, named, lr=a.lr, weight_decay=a.weight_decay)
    for _ in range(a.warmup):
        opt.step()
    sync(device)
    times = []
    for _ in range(a.steps):
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    sb = C.state_bytes(opt)
    del opt
    return {"median_s": statistics.median(times), "min_s": min(times), "state_bytes": sb}


def main(argv=None) -> int:
    a = parse_args(argv)
    C.set_threads(a.threads)
    names = C.parse_list(a.optimizers)
    C.check_optimizer_names(names)
    bad = [n for n in names if n.startswith(("muon+", "hybrid"))]
    if bad:
        raise SystemExit(f"{bad} need a model; use loss_parity.py / memory.py for them")
    sizes, dtypes = C.parse_list(a.sizes), C.parse_list(a.dtypes)
    for s in sizes:
        if s not in WIDTH and s not in LAYERS:
            raise SystemExit(f"unknown size {s!r}; known: {', '.join([*WIDTH, *LAYERS])}")
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"unknown dtype {d!r}; known: {', '.join(DTYPES)}")
    cfg = {"optimizers": ",".join(names), "sizes": ",".join(sizes), "dtypes": ",".join(dtypes),
           "device": a.device, "steps": a.steps, "warmup": a.warmup, "lr": a.lr,
           "wd": a.weight_decay}
    C.print_header("gefen optimizer step time", cfg)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("SKIPPED: CUDA not available (torch.cuda.is_available() is False)")
        C.write_json(a.json, {"benchmark": "step_time", "machine": C.machine_info(),
                              "config": cfg, "skipped": "no cuda", "results": []})
        return 0
    device = torch.device(a.device)
    peak = copy_bandwidth(device) if device.type == "cuda" else None
    if peak:
        print(f"# device copy bandwidth (1 GiB, read + write): {peak / 1e9:.0f} GB/s; "
              "'of copy' = achieved bytes/s / that")

    print(f"\n{'set':>4} {'dtype':>5} {'params':>11} {'optimizer':<14} {'ms/step':>9} "
          f"{'min ms':>8} {'ratio':>6} {'vs':<12} {'B/param/step':>12} {'GB/s':>7} "
          f"{'state B/p':>9}" + (f" {'of copy':>8}" if peak else ""), flush=True)
    results = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for size in sizes:
            row_times: Dict[str, float] = {}
            for name in names:
                muon = name in MUON_LIKE
                named = build_params(size, dtype, device, a.seed, only_2d=muon)
                n = C.count_params(named)
                if muon and n > a.muon_max_params:
                    print(f"{size:>4} {dname:>5} {n:>11,} {name:<14} skipped (> "
                          f"--muon-max-params {a.muon_max_params:.0e})")
                    continue
                try:
                    r = time_one(name, named, a, device)
                finally:
                    del named
                    gc.collect()
                esize = torch.tensor([], dtype=dtype).element_size()
                bps = bytes_per_step(n, esize, esize, r["state_bytes"])
                row_times[name] = r["median_s"]
                base = BASELINE.get(name, DEFAULT_BASELINE)
                if base not in row_times:
                    base = next((b for b in ("adamw-fused", "adamw", "adamw-foreach")
                                 if b in row_times and not muon), None)
                ratio = r["median_s"] / row_times[base] if base else None
                gbs = bps / r["median_s"] / 1e9
                print(f"{size:>4} {dname:>5} {n:>11,} {name:<14} "
                      f"{r['median_s'] * 1e3:>9.3f} {r['min_s'] * 1e3:>8.3f} "
                      f"{(f'{ratio:.2f}' if ratio else '-'):>6} {(base or '-'):<12} "
                      f"{bps / n:>12.2f} {gbs:>7.2f} {r['state_bytes'] / n:>9.3f}"
                      + (f" {gbs * 1e9 / peak:>8.1%}" if peak else ""), flush=True)
                results.append({"set": size, "dtype": dname, "params": n, "optimizer": name,
                                "median_ms": r["median_s"] * 1e3, "min_ms": r["min_s"] * 1e3,
                                "ratio": ratio, "ratio_vs": base,
                                "bytes_per_step": bps, "bytes_per_param_step": bps / n,
                                "GB_per_s": gbs, "state_bytes": r["state_bytes"],
                                "fraction_of_copy_bandwidth": gbs * 1e9 / peak if peak else None})
    C.write_json(a.json, {"benchmark": "step_time", "machine": C.machine_info(),
                          "config": cfg, "shapes": {s: shapes(s) for s in sizes},
                          "copy_bandwidth_bytes_per_s": peak, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
