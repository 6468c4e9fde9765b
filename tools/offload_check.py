"""FSDP2 with CPUOffloadPolicy on a GPU machine: gefen's step runs on the host, on the
local shards, in the C core; its host memory against AdamW's; and a checkpoint saved
with offload resumes without it (and back) with the same global state.

    torchrun --standalone --nproc-per-node 1 tools/offload_check.py --out DIR
    torchrun --standalone --nproc-per-node 2 tools/offload_check.py --out DIR   # 2 ranks, 1 GPU

Needs CUDA (FSDP2 pins host memory for offloading). Writes DIR/offload_<world>.json.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import _common as C  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    faulthandler.enable()  # a crash (SIGSEGV) prints every thread's Python stack
    if not torch.cuda.is_available():
        raise SystemExit("offload_check.py needs a CUDA device: FSDP2's CPUOffloadPolicy pins host memory")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local % torch.cuda.device_count())
    # NCCL refuses two ranks on one GPU: the host side (gloo) carries the collectives then
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1)) else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import gefen
    import gefen.dcp

    mesh = init_device_mesh("cuda", (world,))
    report = {"world": world, "backend": backend, "gpu": torch.cuda.get_device_name()}

    def build(kind, offload=True):
        torch.manual_seed(0)
        model = C.char_transformer(n_layer=4, d_model=256, n_head=4, ctx=128).cuda()
        kw = {"mesh": mesh, "offload_policy": CPUOffloadPolicy()} if offload else {"mesh": mesh}
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if kind == "adamw"
               else gefen.Gefen(model.named_parameters(), lr=1e-3))
        return model, opt

    def train(model, opt, start, n):
        losses = []
        for step in range(start, start + n):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 256, (8, 128), generator=g).cuda()
            loss = model(x, torch.roll(x, -1, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    def phase(what: str) -> None:
        print(f"[rank {rank}] {what}", flush=True)  # where a crash happened, if one does

    for kind in ("adamw", "gefen"):
        phase(f"training {kind} with offload")
        model, opt = build(kind)
        t0 = time.perf_counter()
        losses = train(model, opt, 0, a.steps)
        devices = {str(v._local_tensor.device if hasattr(v, "_local_tensor") else v.device)
                   for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)}
        params_dev = {str(q.to_local().device) for q in model.parameters()}
        state = sum(v._local_tensor.untyped_storage().nbytes() if hasattr(v, "_local_tensor") else v.untyped_storage().nbytes()
                    for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        n_local = sum(q.to_local().numel() for q in model.parameters())
        report[kind] = {"losses": losses, "seconds": time.perf_counter() - t0, "state_devices": sorted(devices),
                        "param_devices": sorted(params_dev), "host_state_bytes": state,
                        "bytes_per_local_param": state / n_local}
    # a checkpoint saved with offload resumes without it (and the state is the same), and
    # back: the GPU-resident optimizer saved with dcp.async_save through a pinned-memory
    # stager resumes with CPU offload
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    qkv = "blocks.0.attn.qkv.weight"

    def saved_state(osd):
        return {k: v.full_tensor().cpu() for k, v in osd["state"][qkv].items() if hasattr(v, "full_tensor")}

    def resume(path, offload, saved, start, n):
        """A fresh model and Gefen (with or without offload) loaded from path: whether
        its state equals what was saved, where it lives, and n more steps' losses."""
        model, opt = build("gefen", offload=offload)
        gefen.dcp.prepare_load(opt, path)
        msd, osd = get_state_dict(model, opt)
        target = {"model": msd, "optim": osd}
        dcp.load(target, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
        st = opt.state[dict(model.named_parameters())[qkv]]
        return model, opt, {
            "same_state": all(torch.equal(st[k].full_tensor().cpu(), v) for k, v in saved.items() if k in st),
            "state_device": str(st["codes"].to_local().device),
            "continues": train(model, opt, start, n),
        }

    phase("checkpoint saved with offload, resumed without")
    path = os.path.join(a.out, f"offload_ckpt_{world}")
    model, opt = build("gefen", offload=True)
    train(model, opt, 0, 3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    model2, opt2, report["offload_to_gpu_checkpoint"] = resume(path, False, saved_state(osd), 3, 2)

    phase("checkpoint saved on the GPU (pinned async), resumed with offload")
    path2 = os.path.join(a.out, f"gpu_ckpt_{world}")
    msd2, osd2 = get_state_dict(model2, opt2)
    stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    res = dcp.async_save({"model": msd2, "optim": osd2}, checkpoint_id=path2, async_stager=stager)
    (getattr(res, "upload_completion", None) or res).result()
    _, _, report["gpu_to_offload_checkpoint_pinned_async"] = resume(path2, True, saved_state(osd2), 5, 2)
    if rank == 0:
        with open(os.path.join(a.out, f"offload_{world}.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "losses"})
                          for k, v in report.items()}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # skip interpreter shutdown: see exit_now in examples/fsdp2_train.py (pytorch#179291)
    sys.stdout.flush()
    os._exit(0)
