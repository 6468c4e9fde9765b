#!/usr/bin/env python
"""Checkpoint size and time: the optimizer state of a GPT-2-small-shaped model (124.4M
parameters) saved with torch.distributed.checkpoint (``get_optimizer_state_dict`` +
``dcp.save``) and loaded into a fresh optimizer (``gefen.dcp.prepare_load`` where needed,
``dcp.load`` + ``set_optimizer_state_dict``), for gefen.Gefen (factored and block), the
GefenMuonHybrid and torch.optim.AdamW, in the same run. Reports bytes on disk per
parameter (files of the checkpoint directory; target <= 1.1 for gefen) and the median
save and load times.

  python benchmarks/checkpoint.py
  python benchmarks/checkpoint.py --optimizers adamw,gefen --repeats 3 --json ckpt.json
  python benchmarks/checkpoint.py --quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import gefen  # noqa: E402
import gefen.dcp  # noqa: E402

OPTIMIZERS = ("adamw", "gefen", "gefen-block", "hybrid-gefen")
TARGET = 1.1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--repeats", type=int, default=3, help="save/load repeats (median)")
    p.add_argument("--quick", action="store_true", help="a 4-layer d=256 model")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    C.add_common_args(p)
    return p.parse_args(argv)


def make(name: str, model):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "gefen":
        return gefen.Gefen(model.named_parameters(), lr=1e-4)
    if name == "gefen-block":
        return gefen.Gefen(model.named_parameters(), lr=1e-4, factored=False)
    if name == "hybrid-gefen":
        return gefen.GefenMuonHybrid(model, lr=1e-4)
    raise ValueError(name)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run_one(name: str, model, root: str, repeats: int) -> dict:
    opt = make(name, model)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # real state (periods, codebook, moments)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    saves, loads, path = [], [], None
    for r in range(repeats):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        path = os.path.join(root, f"{name}-{r}")
        t0 = time.perf_counter()
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        saves.append(time.perf_counter() - t0)
        for p in model.parameters():  # DCP's helpers give a fresh AdamW its state only then
            p.grad = None
        fresh = make(name, model)
        t0 = time.perf_counter()
        if name != "adamw":
            gefen.dcp.prepare_load(fresh, path)
        target = {"optim": get_optimizer_state_dict(model, fresh)}
        dcp.load(target, checkpoint_id=path)
        set_optimizer_state_dict(model, fresh, target["optim"])
        loads.append(time.perf_counter() - t0)
        if not fresh.state_dict()["state"]:
            raise RuntimeError(f"{name}: the load restored no state")
        del fresh
    size = dir_bytes(path)
    for r in range(repeats):
        shutil.rmtree(os.path.join(root, f"{name}-{r}"), ignore_errors=True)
    del opt
    for p in model.parameters():
        p.grad = None
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads), "bytes": size}


def main(argv=None):
    a = parse_args(argv)
    C.set_threads(a.threads)
    torch.manual_seed(0)
    model = C.char_transformer(n_layer=4, d_model=256, n_head=4, ctx=128) if a.quick else C.gpt2_small_shaped()
    n = C.count_params(model)
    C.print_header("optimizer checkpoint: bytes on disk and save/load time (DCP)",
                   {"params": n, "repeats": a.repeats})
    root = a.dir or tempfile.mkdtemp(prefix="gefen-ckpt-bench-")
    rows = []
    print(f"{'optimizer':<14} {'MiB on disk':>12} {'B/param':>9} {'save (s)':>9} {'load (s)':>9}  verdict")
    for name in C.parse_list(a.optimizers):
        res = run_one(name, model, root, a.repeats)
        bpp = res["bytes"] / n
        verdict = "" if name == "adamw" else ("PASS" if bpp <= TARGET else "MISS")
        rows.append({"optimizer": name, "bytes_on_disk": res["bytes"], "bytes_per_param": bpp,
                     "save_s": res["save_s"], "load_s": res["load_s"], "verdict": verdict})
        print(f"{name:<14} {res['bytes'] / 2**20:>12.1f} {bpp:>9.3f} {res['save_s']:>9.2f} "
              f"{res['load_s']:>9.2f}  {verdict}")
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    result = {"machine": C.machine_info(), "params": n, "target_bytes_per_param": TARGET, "results": rows}
    C.write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
