#!/usr/bin/env python
"""Optimizer step time on a GPU at GPT-2-family sizes: every parameter shape of a
124M (GPT-2 small), 350M (GPT-2 medium) and 1.3B (d=2048, 24 layers) model, with fixed
random gradients, for gefen.Gefen (factored, block), torch.optim.AdamW (fused,
foreach), and the Muon family on the hidden matrices: GefenMuon and torch.optim.Muon
(whole step), and their momentum stage alone. Bytes moved per step over the measured
device-to-device copy bandwidth (ALGORITHM.md §9's floor; the formula of step_time.py).
Fused AdamW and Gefen's block form are also timed on one matrix of the same number of
elements: the difference, over the number of tensors, is the cost per tensor. Gefen is
also timed with its step plans kept across steps for CUDA parameters (``kept-plans``;
``gefen.gefen._KEEP_CUDA_PLANS``, off by default until checked on a GPU).

  python benchmarks/gpu_step.py                           # needs CUDA
  python benchmarks/gpu_step.py --sizes 124M --dtypes bf16 --json gpu.json
  python benchmarks/gpu_step.py --quick                   # the script's logic on the CPU (CI)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import step_time as ST  # noqa: E402
import torch  # noqa: E402

#: (layers, width, vocab, ctx) of each size; MLP 4 x width; tied head (GPT-2).
SIZES = {"124M": (12, 768, 50257, 1024), "350M": (24, 1024, 50257, 1024),
         "1.3B": (24, 2048, 50257, 2048), "tiny": (2, 64, 256, 64)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ADAM_LIKE = ("adamw-fused", "adamw-foreach", "gefen", "gefen-block")
ONE_TENSOR = ("adamw-fused", "gefen-block")  # also timed on one matrix of the same size
KEPT_PLANS = ("gefen", "gefen-block")  # also timed with gefen.gefen._KEEP_CUDA_PLANS


def gpt_shapes(size: str) -> list[tuple[int, ...]]:
    layers, d, vocab, ctx = SIZES[size]
    out = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        out += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,),
                (d, 4 * d), (d,)]
    return out + [(d,), (d,)]


def params_of(size: str, dtype, device, only_matrices: bool, one_tensor: bool = False):
    """Named parameters of every shape of ``size`` with random gradients (the hidden
    matrices only, for Muon), or one matrix of the model's width with as many elements."""
    g = torch.Generator(device=device).manual_seed(0)
    named = []
    shapes = gpt_shapes(size)
    if one_tensor:
        width = SIZES[size][1]
        shapes = [(sum(math.prod(s) for s in shapes) // width, width)]
    for i, s in enumerate(shapes):
        if only_matrices and (len(s) != 2 or i < 2):  # Muon: hidden matrices only
            continue
        p = torch.nn.Parameter(torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype) * 0.02)
        p.grad = torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype)
        named.append((f"p{i}", p))
    return named


def momentum_stage(named, steps: int, device) -> dict:
    """torch.optim.Muon's momentum (lerp + Nesterov blend into the bf16 Newton–Schulz
    input) against GefenMuon's C/CUDA momentum writing the same bf16 input."""
    import gefen

    bufs = [torch.zeros_like(p, dtype=torch.float32) for _, p in named]
    outs = [torch.empty_like(p, dtype=torch.bfloat16) for _, p in named]

    def torch_momentum():
        for (_, p), b, o in zip(named, bufs, outs):
            b.lerp_(p.grad.float(), 0.05)
            o.copy_(p.grad.float().lerp(b, 0.95))

    opt = gefen.GefenMuon(named, lr=1e-4)
    opt.step()  # periods and codebook
    plan = opt._prepare_step()
    (dev, chunks), = plan.payload
    table = opt._device_table(plan.quantizer, device)
    stream = torch.cuda.current_stream(device).cuda_stream

    def gefen_momentum():
        for _, _, step in chunks:
            step.momentum(plan.quantizer, 0, stream, table)

    return {"torch_s": _median(torch_momentum, steps, device), "gefen_s": _median(gefen_momentum, steps, device)}


def time_kept_plans(named, ta, device) -> dict:
    """Median step seconds of each of :data:`KEPT_PLANS` with its step plans kept across
    steps for CUDA parameters (``gefen.gefen._KEEP_CUDA_PLANS``, off by default until
    checked on a GPU; no effect on the CPU)."""
    import gefen.gefen as gefen_module

    saved, gefen_module._KEEP_CUDA_PLANS = gefen_module._KEEP_CUDA_PLANS, True
    try:
        return {name: ST.time_one(name, named, ta, device)["median_s"] for name in KEPT_PLANS}
    finally:
        gefen_module._KEEP_CUDA_PLANS = saved


def _median(fn, steps: int, device) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        ST.sync(device)
        t0 = time.perf_counter()
        fn()
        ST.sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="124M,350M,1.3B")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--muon-steps", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda",
                   help="cuda (the benchmark); cpu runs the script's logic, its numbers mean nothing")
    p.add_argument("--quick", action="store_true",
                   help="the script's logic on the CPU: size tiny, fp32, 2 steps (CI smoke run)")
    a = p.parse_args(argv)
    if a.quick:
        a.device, a.sizes, a.dtypes, a.steps, a.muon_steps = "cpu", "tiny", "fp32", 2, 1
    on_cuda = a.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_step.py needs a CUDA device (torch.cuda.is_available() is False)")
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device(a.device)
    peak = ST.copy_bandwidth(device)
    C.print_header("optimizer step on the GPU (GPT-2-family shapes)",
                   {"sizes": a.sizes, "dtypes": a.dtypes,
                    "device": torch.cuda.get_device_name(device) if on_cuda else str(device),
                    "copy bandwidth GB/s": round(peak / 1e9, 1)})
    rows = []
    for size in C.parse_list(a.sizes):
        for dt in C.parse_list(a.dtypes):
            dtype = DTYPES[dt]
            named = params_of(size, dtype, device, only_matrices=False)
            n = sum(p.numel() for _, p in named)
            ta = argparse.Namespace(lr=1e-4, weight_decay=0.01, warmup=3, steps=a.steps)
            times = {}
            for name in ADAM_LIKE:
                r = ST.time_one(name, named, ta, device)
                moved = ST.bytes_per_step(n, dtype.itemsize, dtype.itemsize, r["state_bytes"])
                times[name] = r["median_s"]
                rows.append({"size": size, "dtype": dt, "params": n, "optimizer": name,
                             "step_ms": 1e3 * r["median_s"], "bytes_per_step": moved,
                             "fraction_of_copy_bw": moved / r["median_s"] / peak,
                             "state_bytes": r["state_bytes"]})
            for name, t in time_kept_plans(named, ta, device).items():
                ratio = t / times["adamw-fused"]
                rows.append({"size": size, "dtype": dt, "params": n, "optimizer": name + "/kept-plans",
                             "step_ms": 1e3 * t, "ratio_to_fused_adamw": ratio})
                print(f"{size:>5} {dt:>5} {name:<14} kept plans {1e3 * t:9.2f} ms  "
                      f"{ratio:5.2f}x fused AdamW", flush=True)
            n_tensors = len(named)
            del named
            one = params_of(size, dtype, device, only_matrices=False, one_tensor=True)
            for name in ONE_TENSOR:
                r = ST.time_one(name, one, ta, device)
                per_tensor = (times[name] - r["median_s"]) / n_tensors
                rows.append({"size": size, "dtype": dt, "params": sum(q.numel() for _, q in one),
                             "optimizer": name + "/one-tensor", "step_ms": 1e3 * r["median_s"],
                             "tensors_in_model": n_tensors, "per_tensor_us": 1e6 * per_tensor})
                print(f"{size:>5} {dt:>5} {name:<14} one tensor {1e3 * r['median_s']:9.2f} ms: "
                      f"{1e6 * per_tensor:6.1f} us per tensor of the model's {n_tensors}", flush=True)
            del one
            matrices = params_of(size, dtype, device, only_matrices=True)
            tm = argparse.Namespace(lr=1e-4, weight_decay=0.01, warmup=1, steps=a.muon_steps)
            for name in ("muon", "gefenmuon"):
                r = ST.time_one(name, matrices, tm, device)
                rows.append({"size": size, "dtype": dt, "params": sum(q.numel() for _, q in matrices),
                             "optimizer": name, "step_ms": 1e3 * r["median_s"], "state_bytes": r["state_bytes"]})
            mom = momentum_stage(matrices, a.steps, device) if on_cuda else None  # (CUDA streams)
            if mom is not None:
                rows.append({"size": size, "dtype": dt, "optimizer": "momentum-stage",
                             "torch_muon_ms": 1e3 * mom["torch_s"], "gefenmuon_ms": 1e3 * mom["gefen_s"],
                             "ratio": mom["gefen_s"] / mom["torch_s"]})
            del matrices
            if on_cuda:
                torch.cuda.empty_cache()
            fused = times["adamw-fused"]
            for r in rows:
                if r.get("size") == size and r.get("dtype") == dt and r["optimizer"] in ADAM_LIKE:
                    r["ratio_to_fused_adamw"] = r["step_ms"] / (1e3 * fused)
                    print(f"{size:>5} {dt:>5} {r['optimizer']:<14} {r['step_ms']:9.2f} ms  "
                          f"{r['ratio_to_fused_adamw']:5.2f}x fused AdamW  "
                          f"{100 * r['fraction_of_copy_bw']:5.1f}% of copy bandwidth")
            if mom is not None:
                print(f"{size:>5} {dt:>5} momentum stage: torch Muon {1e3 * mom['torch_s']:.2f} ms, "
                      f"GefenMuon {1e3 * mom['gefen_s']:.2f} ms ({mom['gefen_s'] / mom['torch_s']:.2f}x)",
                      flush=True)
    C.write_json(a.json, {"machine": C.machine_info(), "copy_bandwidth": peak, "results": rows})


if __name__ == "__main__":
    main()
