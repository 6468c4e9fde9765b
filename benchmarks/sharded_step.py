#!/usr/bin/env python
"""Sharded optimizer step on CPU: a GPT-2-small-shaped model (124.4M parameters) under
FSDP2 on 2 gloo ranks (one thread each), the optimizer step alone, with fixed random
gradients on the same DTensors: gefen.Gefen (factored and block) vs torch.optim.AdamW
(fused and foreach). Reports per step the median time (the slowest rank's), the
collectives and bytes gefen communicated (its own counter, ``optimizer.comm_stats``),
and the optimizer state per rank.

  python benchmarks/sharded_step.py                       # 2 ranks, 10 timed steps
  python benchmarks/sharded_step.py --ranks 2 --steps 10 --json sharded.json
  python benchmarks/sharded_step.py --quick               # a small model, seconds
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

OPTIMIZERS = ("adamw-fused", "adamw-foreach", "gefen", "gefen-block")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--quick", action="store_true", help="a 4-layer d=256 model (seconds)")
    p.add_argument("--full", action="store_true",
                   help="gefen keeps no step plan (gefen/_steady.py): every step takes the full "
                        "path, building and parsing its items and agreeing on the whole header")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def build_optimizer(name: str, model):
    import gefen

    if name == "adamw-fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if name == "adamw-foreach":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if name == "gefen":
        return gefen.Gefen(model.named_parameters(), lr=1e-4)
    if name == "gefen-block":
        return gefen.Gefen(model.named_parameters(), lr=1e-4, factored=False)
    raise ValueError(name)


def local_state_bytes(opt) -> int:
    """Bytes of this rank's optimizer state (local shards; a shared tensor once)."""
    seen, total = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                t = v._local_tensor if hasattr(v, "_local_tensor") else v
                key = (t.untyped_storage().data_ptr(), t.device.type)
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
    return total


def worker(rank: int, world: int, init: str, a, out) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    if a.quick:
        model = C.char_transformer(n_layer=4, d_model=256, n_head=4, ctx=128)
    else:
        model = C.gpt2_small_shaped()
    model = model.to(dtype)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    n_local = sum(p.to_local().numel() for p in params)
    n_global = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(1 + rank)
    grads = [DTensor.from_local(torch.randn(p.to_local().shape, generator=gen).to(dtype), mesh, p.placements,
                                run_check=False, shape=p.shape, stride=p.stride()) for p in params]
    results = {}
    for name in C.parse_list(a.optimizers):
        opt = build_optimizer(name, model)
        if a.full and name.startswith("gefen"):
            opt._keep_steady = lambda plan: None
        times = []
        for i in range(a.warmup + a.steps):
            for p, g in zip(params, grads):
                p.grad = g
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            if i >= a.warmup:
                times.append(t1 - t0)
        comm = getattr(opt, "comm_stats", None)
        results[name] = {
            "median_s": statistics.median(times),
            "state_bytes_local": local_state_bytes(opt),
            "collectives": comm.collectives if comm else 0,
            "comm_bytes": comm.bytes if comm else 0,
            "comm_kinds": dict(comm.by_kind) if comm else {},
        }
        del opt
    out.put((rank, {"results": results, "n_local": n_local, "n_global": n_global}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    a = parse_args(argv)
    C.print_header("sharded optimizer step (FSDP2, gloo, CPU)",
                   {"ranks": a.ranks, "steps": a.steps, "dtype": a.dtype,
                    "model": "4-layer d=256 GPT" if a.quick else "GPT-2-small shape (124.4M)",
                    "gefen path": "full" if a.full else "steady (kept plans after the first steps)"})
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, a.ranks, os.path.join(tmp, "rdzv"), a, out))
                 for r in range(a.ranks)]
        for p in procs:
            p.start()
        by_rank = dict(out.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join(timeout=120)
    names = list(by_rank[0]["results"])
    rows = []
    fastest_adamw = min((max(by_rank[r]["results"][n]["median_s"] for r in by_rank)
                         for n in names if n.startswith("adamw")), default=None)
    print(f"{'optimizer':<15} {'step (ms)':>10} {'/ best AdamW':>13} {'collectives':>12} "
          f"{'bytes sent':>12} {'state B/param':>14}")
    for n in names:
        t = max(by_rank[r]["results"][n]["median_s"] for r in by_rank)  # the slowest rank
        state = sum(by_rank[r]["results"][n]["state_bytes_local"] for r in by_rank)
        bpp = state / by_rank[0]["n_global"]
        res0 = by_rank[0]["results"][n]
        ratio = t / fastest_adamw if fastest_adamw else float("nan")
        rows.append({"optimizer": n, "step_ms": 1e3 * t, "ratio_to_best_adamw": ratio,
                     "collectives": res0["collectives"], "comm_bytes": res0["comm_bytes"],
                     "comm_kinds": res0["comm_kinds"], "state_bytes_total": state,
                     "state_bytes_per_rank": [by_rank[r]["results"][n]["state_bytes_local"] for r in sorted(by_rank)],
                     "bytes_per_param": bpp})
        print(f"{n:<15} {1e3 * t:>10.1f} {ratio:>13.2f} {res0['collectives']:>12} "
              f"{res0['comm_bytes']:>12,} {bpp:>14.3f}")
    result = {"machine": C.machine_info(), "config": vars(a), "params": by_rank[0]["n_global"],
              "results": rows}
    C.write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
