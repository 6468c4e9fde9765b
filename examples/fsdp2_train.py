"""Train the loss benchmark's byte-level GPT sharded with FSDP2 and a gefen optimizer,
checkpoint with torch.distributed.checkpoint, and resume on any number of ranks.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --optimizer gefen --steps 20
    torchrun --nproc-per-node 4 examples/fsdp2_train.py --hsdp 2          # 2 x 2 HSDP mesh
    torchrun --nproc-per-node 2 examples/fsdp2_train.py --steps 20 --save-every 10 --ckpt ckpt
    torchrun --nproc-per-node 3 examples/fsdp2_train.py --steps 20 --resume ckpt/step10
    python examples/fsdp2_train.py --steps 20                             # one process

CPU ranks talk over gloo; with GPUs each rank takes one and NCCL (``--cpu-offload``
keeps the sharded parameters, gradients and the optimizer step on the host, which
needs a GPU: FSDP2 pins host memory). Every rank reads its slice of one global batch,
so any number of ranks trains the same model as one process (up to reduction order).
``--json`` writes the per-step losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import _common as C  # noqa: E402

import gefen  # noqa: E402
import gefen.dcp  # noqa: E402

OPTIMIZERS = ("gefen", "gefen-block", "hybrid-gefen", "hybrid-adamw", "adamw")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="gefen")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=None, help="default: 3e-3 (1.6e-2 for Muon ones)")
    p.add_argument("--batch", type=int, default=12, help="global batch (split over the ranks)")
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--hsdp", type=int, default=0, metavar="R",
                   help="an (R, world/R) HSDP mesh: R replicas of world/R-way sharding")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPUOffloadPolicy (needs a GPU)")
    p.add_argument("--sharded-mode", default="exact", choices=("exact", "distributed", "approx"))
    p.add_argument("--save-every", type=int, default=0, help="save a DCP checkpoint every K steps")
    p.add_argument("--ckpt", default="ckpt", help="checkpoint root (one folder per step)")
    p.add_argument("--async-save", action="store_true", help="dcp.async_save instead of dcp.save")
    p.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    p.add_argument("--json", default=None, help="write {step: loss} here (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def setup():
    """Process group (when launched by torchrun) and this rank's device."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cpu")
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl")
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def make_optimizer(name: str, model, lr: float, sharded_mode: str):
    if name == "gefen":
        return gefen.Gefen(model.named_parameters(), lr=lr, weight_decay=0.1)
    if name == "gefen-block":
        return gefen.Gefen(model.named_parameters(), lr=lr, weight_decay=0.1, factored=False)
    if name.startswith("hybrid-"):
        return gefen.GefenMuonHybrid(model, lr=lr, backup_optimizer=name.split("-")[1],
                                     sharded_mode=sharded_mode)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


class TrainState(Stateful):
    """Model, optimizer and step as one DCP ``Stateful``: the plain state-dict helpers
    of torch.distributed.checkpoint do the (re)sharding."""

    def __init__(self, model, optimizer, step: int = 0):
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        self.step = int(sd["step"])


def batch_for(train: torch.Tensor, step: int, a, rank: int, world: int, device):
    """This rank's rows of the global batch of ``step`` (the same for every world size)."""
    gen = torch.Generator().manual_seed(a.seed * 100003 + step)
    starts = torch.randint(0, len(train) - a.ctx - 1, (a.batch,), generator=gen)
    per = a.batch // world
    starts = starts[rank * per: (rank + 1) * per]
    seq = train[starts[:, None] + torch.arange(a.ctx + 1)].long().to(device)
    return seq[:, :-1], seq[:, 1:]


def main(argv=None) -> dict:
    a = parse_args(argv)
    rank, world, device = setup()
    if a.batch % world:
        raise SystemExit(f"--batch {a.batch} must be divisible by the {world} ranks")
    if a.cpu_offload and device.type != "cuda":
        raise SystemExit("--cpu-offload needs a GPU: FSDP2's CPUOffloadPolicy pins host memory")
    train, _, _ = C.load_corpus(max_bytes=1 << 20)
    torch.manual_seed(a.seed)
    model = C.char_transformer(n_layer=a.layers, d_model=a.d_model, n_head=a.heads, ctx=a.ctx).to(device)
    if world > 1 or "WORLD_SIZE" in os.environ:
        kind = device.type
        mesh = (init_device_mesh(kind, (a.hsdp, world // a.hsdp), mesh_dim_names=("replicate", "shard"))
                if a.hsdp else init_device_mesh(kind, (world,)))
        kw = {"mesh": mesh}
        if a.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    lr = a.lr or (1.6e-2 if "hybrid" in a.optimizer else 3e-3)
    opt = make_optimizer(a.optimizer, model, lr, a.sharded_mode)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: C.lr_factor(s, a.steps, max(1, a.steps // 10)))
    app = TrainState(model, opt)
    if a.resume:
        gefen.dcp.prepare_load(opt, a.resume)  # a fresh optimizer learns the saved layout
        state = {"app": app}
        dcp.load(state, checkpoint_id=a.resume)
        for _ in range(app.step):
            sched.step()
        if rank == 0:
            print(f"resumed at step {app.step} from {a.resume} on {world} rank(s)")
    losses = {}
    pending = None
    t0 = time.time()
    for step in range(app.step, a.steps):
        x, y = batch_for(train, step, a, rank, world, device)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        app.step = step + 1
        total = loss.detach().float().clone()
        if dist.is_initialized():  # the global batch's mean loss
            dist.all_reduce(total)
            total /= world
        losses[step] = float(total)
        if rank == 0:
            print(f"step {step:4d}  loss {losses[step]:.4f}", flush=True)
        if a.save_every and app.step % a.save_every == 0:
            path = os.path.join(a.ckpt, f"step{app.step}")
            if pending is not None:
                pending.result()
            if a.async_save:
                pending = dcp.async_save({"app": app}, checkpoint_id=path)
            else:
                dcp.save({"app": app}, checkpoint_id=path)
            if rank == 0:
                print(f"saved {path}")
    if pending is not None:
        pending.result()
    if rank == 0:
        print(f"{a.optimizer}: {a.steps - (app.step - len(losses))} steps on {world} rank(s) in "
              f"{time.time() - t0:.1f} s")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"losses": losses, "world": world}, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    return losses


def exit_now(code: int = 0) -> None:
    """Ends a distributed process without interpreter shutdown. A gloo worker thread frees
    a finished collective's tensors only once it holds the GIL; when that happens after
    Python began shutting down, the process aborts ("terminate called without an active
    exception", a PyTorch race: pytorch/pytorch#179291; measured here in about 1 of 15
    2-rank runs, also after a barrier). Everything this script writes is closed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
    exit_now()
