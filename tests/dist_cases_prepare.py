"""Cases for tests/test_prepare_load.py, run on every rank of a spawned gloo group
(dist_harness.py): ``gefen.dcp.prepare_load`` followed by a load that fails, into a
trained optimizer (it must stay exactly as it was, able to step) and into a fresh one (it
must keep refusing to step until a good load)."""

from __future__ import annotations

import shutil

import torch
import torch.distributed as dist
from dist_cases import (
    _App,
    _ckpt_opt,
    _full_state,
    _layout_model,
    _same,
    _storage_item,
    _train_steps,
    as_full,
)

import gefen.dcp

CODES = "app.optim.state.blocks.0.attn.qkv.weight.codes"
PREPARED = "prepare_load() allocated this optimizer's state for a checkpoint that has not been loaded yet"


def _error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)[:600]


def copy_and_flip(rank, world, path, bad):
    """Rank 0 copies the checkpoint at ``path`` (saved by dist_cases.dcp_save) to ``bad``
    and flips one byte inside the saved codes of a matrix there."""
    if rank == 0:
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(path, bad)
        f, off, length = _storage_item(bad, CODES)
        codes = torch.load(path + ".ref", weights_only=False)["saved"][("blocks.0.attn.qkv.weight", "codes")]
        raw = codes.contiguous().view(-1).numpy().tobytes()
        with open(f, "r+b") as fh:
            fh.seek(off)
            item = fh.read(length)
            at = off + item.index(raw[:256]) + 100  # inside the tensor's data, row 3
            fh.seek(at)
            b = fh.read(1)
            fh.seek(at)
            fh.write(bytes([b[0] ^ 0x10]))
    dist.barrier()
    return True


def _flags(opt) -> list:
    return [bool(c.__dict__.get("_prepared")) for c in (opt, *getattr(opt, "_children", ()))]


def warm_prepare_then_bad_load(rank, world, bad, kind):
    """A trained optimizer, prepare_load, a load of a corrupt checkpoint: the load raises,
    the optimizer is as it was, and its next step is the step of a twin that never saw
    the load (given the same weights: DCP writes the model's in place before it fails)."""
    import torch.distributed.checkpoint as dcp

    model, twin = _layout_model("fsdp", world), _layout_model("fsdp", world)
    opt, twin_opt = _ckpt_opt(kind, model, {}), _ckpt_opt(kind, twin, {})
    _train_steps(model, opt, 0, 2)
    _train_steps(twin, twin_opt, 0, 2)
    before = _full_state(opt)
    error = None
    try:
        gefen.dcp.prepare_load(opt, bad)
        dcp.load({"app": _App(model, opt, False)}, checkpoint_id=bad)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        error = _error(exc)
    after = _full_state(opt)
    unchanged = before.keys() == after.keys() and all(_same(before[k], after[k]) for k in before)
    flags = _flags(opt)
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters()):
            q.copy_(p)
    step_error = None
    try:
        _train_steps(model, opt, 2, 2)
    except Exception as exc:
        step_error = _error(exc)
    _train_steps(twin, twin_opt, 2, 2)
    a, b = _full_state(opt), _full_state(twin_opt)
    return {"error": error, "unchanged": unchanged, "flags": flags, "step_error": step_error,
            "same_as_twin": step_error is None and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
            and all(torch.equal(as_full(p), as_full(q)) for p, q in zip(model.parameters(), twin.parameters()))}


def fresh_prepare_bad_then_good(rank, world, bad, good, kind, steps=3, more=2):
    """A fresh optimizer, prepare_load, a load of a corrupt checkpoint: it keeps refusing
    to step (the same message); a load of the good checkpoint then restores the saved
    state and training continues as the uninterrupted run (dist_cases.dcp_save's)."""
    import torch.distributed.checkpoint as dcp

    model = _layout_model("fsdp", world)
    opt = _ckpt_opt(kind, model, {})
    gefen.dcp.prepare_load(opt, bad)
    error = None
    try:
        dcp.load({"app": _App(model, opt, False)}, checkpoint_id=bad)
    except BaseException as exc:
        error = _error(exc)
    flags = _flags(opt)
    step_error = None
    try:
        _train_steps(model, opt, steps, 1)
    except Exception as exc:
        step_error = _error(exc)
    dcp.load({"app": _App(model, opt, False)}, checkpoint_id=good)
    flags_loaded = _flags(opt)
    ref = torch.load(good + ".ref", weights_only=False)
    loaded = _full_state(opt)
    mismatch = [k for k in ref["saved"] if k not in loaded or not _same(ref["saved"][k], loaded[k])]
    _train_steps(model, opt, steps, more)
    final = [as_full(p).detach().cpu() for p in model.parameters()]
    diff = max(float((a - b).abs().max()) for a, b in zip(final, ref["final"]))
    return {"error": error, "flags": flags, "step_error": step_error, "flags_loaded": flags_loaded,
            "n_mismatch": len(mismatch), "final_diff": diff}


def full_state_from_rank0(rank, world, kind, broadcast):
    """A full state dict that only rank 0 holds (``get_state_dict`` with
    ``full_state_dict=True, cpu_offload=True``), loaded into a fresh sharded model and
    optimizer with ``broadcast_from_rank0=True``. prepare_load(broadcast_from_rank0=True)
    gives every rank rank 0's layout, and training goes on bit for bit; without it (rank
    0 prepares, the others see an empty dict) every rank raises together, nothing
    changed (before: the ranks prepared different state, and torch's load then hung in a
    step only the unprepared ranks ran)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _layout_model("fsdp", world)
    opt = _ckpt_opt(kind, model, {})
    _train_steps(model, opt, 0, 3)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    held = bool(osd)
    twin = _layout_model("fsdp", world)
    fresh = _ckpt_opt(kind, twin, {})
    try:
        gefen.dcp.prepare_load(fresh, osd, broadcast_from_rank0=broadcast)
    except Exception as exc:
        return {"held": held, "error": _error(exc), "untouched": not any(fresh.state.values()),
                "flags": _flags(fresh)}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(twin, msd, options=options)
    set_optimizer_state_dict(twin, fresh, osd, options=options)
    _train_steps(model, opt, 3, 2)
    _train_steps(twin, fresh, 3, 2)
    return {"held": held, "error": None, "flags": _flags(fresh),
            "same": all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(model.parameters(), twin.parameters()))}
