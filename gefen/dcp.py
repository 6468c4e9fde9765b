"""Checkpoints of gefen optimizers with ``torch.distributed.checkpoint`` (DCP).

The native flow works unchanged — ``get_state_dict`` / ``get_optimizer_state_dict``
(plain or flattened), ``dcp.save`` / ``dcp.async_save``, ``dcp.load``,
``set_state_dict`` — and reshards between any world sizes and layouts, because every
state tensor lives on its parameter's global grid (DESIGN.md §1).

One step is gefen's own: a *fresh* optimizer (no step taken) does not know the layout
of the state in a checkpoint (its periods, its representation), and DCP loads only into
state that already exists. :func:`prepare_load` reads the checkpoint's metadata and
allocates that state, after which the plain DCP load applies::

    opt = gefen.Gefen(model.named_parameters(), lr=3e-4)
    gefen.dcp.prepare_load(opt, "ckpt/step1000")
    dcp.load({"app": app_state}, checkpoint_id="ckpt/step1000")

A load into an unprepared optimizer whose checkpoint holds state raises instead of
silently restarting the moments. An optimizer for which prepare_load allocated state
(placeholders, not moments) refuses to step until a load has filled it, also after a
failed load; an optimizer whose state already has the checkpoint's layout is left as it
is, so a failed load into it leaves it exactly as it was, able to step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._base import _QuantizedOptimizer, block_state, row_vector
from ._checkpoint import update_state_counts
from ._comm import Comm, RankDivergenceError
from ._layout import canonical_name, param_name, rows_cols
from ._views import local, make_replicated, make_row_state, make_view

__all__ = ["prepare_load", "checkpoint_entries"]

#: The state fields whose presence tells a gefen parameter's saved layout.
_GEFEN_FIELDS = ("codes", "magnitude", "vmean", "v_row", "v_col", "v", "codebook", "digest_rows",
                 "digest", "step", "global_step", "period", "factored")
_ADAMW_FIELDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
#: The field whose presence says a checkpoint holds a parameter's state, per kind.
_GEFEN_PROBE, _ADAMW_PROBE = "codes", "exp_avg"


@dataclass(frozen=True)
class Entry:
    """One entry of a checkpoint: a tensor's global shape and dtype, or a non-tensor."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None

    @property
    def tensor(self) -> bool:
        return self.shape is not None


def checkpoint_entries(checkpoint) -> dict[str, Entry]:
    """Every entry of a checkpoint by its dotted key, from a DCP checkpoint directory
    (a path), a DCP ``StorageReader``, or a state dict in memory (nested or flattened,
    as ``get_optimizer_state_dict`` returns it or ``torch.load`` reads it back)."""
    if isinstance(checkpoint, Mapping):
        out: dict[str, Entry] = {}
        _flatten(checkpoint, "", out)
        return out
    if isinstance(checkpoint, (str, os.PathLike)):
        from torch.distributed.checkpoint import FileSystemReader

        reader = FileSystemReader(os.fspath(checkpoint))
    else:
        reader = checkpoint
    if not hasattr(reader, "read_metadata"):
        raise TypeError(
            "prepare_load needs a checkpoint directory, a torch.distributed.checkpoint "
            f"StorageReader or a state dict, got {type(checkpoint).__name__}"
        )
    metadata = reader.read_metadata()
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        size = getattr(md, "size", None)
        if size is not None:
            out[key] = Entry(tuple(size), md.properties.dtype)
        else:
            out[key] = Entry(None, None)
    return out


def _flatten(obj, prefix: str, out: dict) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}{k}.", out)
    elif isinstance(obj, (list, tuple)) and not prefix.endswith("params."):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}{i}.", out)
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = Entry(tuple(obj.shape), obj.dtype)
    else:
        out[prefix[:-1]] = Entry(None, None)


def _children(optimizer) -> list:
    return list(getattr(optimizer, "_children", (optimizer,)))


def _dcp_name(name: str, model: torch.nn.Module | None = None) -> str:
    """The name DCP keys a parameter's state by: with the model, torch's own mapping
    (which also drops DDP's ``module``); without it, the name without the wrappers'
    components (an optimizer built from a compiled model's ``named_parameters()`` holds
    ``_orig_mod.``-prefixed names)."""
    if model is not None:
        from torch.distributed.checkpoint.state_dict import _get_fqns  # DCP's own mapping

        fqns = _get_fqns(model, name)
        if len(fqns) == 1:
            return next(iter(fqns))
    return canonical_name(name)


def _fqns(children, model) -> list[list[list[str]]]:
    """Each child's groups' parameters' checkpoint names: the names DCP keys them by (from
    the ``model`` given, whose names are mapped once, or from the names the optimizer was
    built with), else their indices within the child."""
    by_param = {}
    if model is not None:
        for n, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in by_param:
                by_param[id(p)] = _dcp_name(n, model)
    return [_child_fqns(child, model, by_param) for child in children]


def _child_fqns(opt, model, by_param: dict) -> list[list[str]]:
    """One optimizer's names (:func:`_fqns`; ``by_param``: the model's, by parameter id)."""
    out, index = [], 0
    for gi, group in enumerate(opt.param_groups):
        names = []
        for i, p in enumerate(group["params"]):
            if model is not None:
                if id(p) not in by_param:
                    raise ValueError(f"prepare_load: parameter {param_name(group, gi, i)} is not in the model")
                names.append(by_param[id(p)])
            elif group.get("param_names") is not None:
                names.append(_dcp_name(str(group["param_names"][i])))
            else:
                names.append(str(index))
            index += 1
        out.append(names)
    return out


def _find_prefix(entries: dict[str, Entry], names: list[str], probe: str) -> str | None:
    """The prefix under which the checkpoint keeps this optimizer's ``state`` (e.g.
    ``"app.optim."``): the one prefix for which ``<prefix>state.<name>.<probe>`` exists."""
    prefixes = set()
    for name in names:
        suffix = f"state.{name}.{probe}"
        for key in entries:
            if key.endswith(suffix):
                pre = key[: -len(suffix)]
                if pre == "" or pre.endswith("."):
                    prefixes.add(pre)
    if len(prefixes) > 1:
        raise ValueError(
            f"prepare_load: the checkpoint holds optimizer state under several prefixes "
            f"{sorted(prefixes)}; pass prefix= to choose one"
        )
    return prefixes.pop() if prefixes else None


def _fields(entries: dict[str, Entry], prefix: str, name: str, fields) -> dict[str, Entry]:
    return {f: entries[k] for f in fields if (k := f"{prefix}state.{name}.{f}") in entries}


def _foreign(entries: dict[str, Entry], prefix: str, names: set[str], probe: str) -> list[str]:
    """Parameters the checkpoint holds state for under ``prefix`` that are not ours."""
    head = f"{prefix}state."
    out = []
    for key in entries:
        if key.startswith(head) and key.endswith("." + probe):
            name = key[len(head) : -len(probe) - 1]
            if name not in names:
                out.append(name)
    return out


def prepare_load(optimizer, checkpoint, *, model: torch.nn.Module | None = None,
                 prefix: str | None = None, broadcast_from_rank0: bool = False) -> None:
    """Allocate in ``optimizer`` the state that ``checkpoint`` holds, laid out as saved
    (periods, block or factored form, NorMuon's row moment, AdamW's moments), so that
    ``dcp.load`` / ``set_state_dict`` / ``set_optimizer_state_dict`` (flattened too)
    restore it exactly, on any number of ranks.

    Args:
        optimizer: a :class:`gefen.Gefen`, :class:`gefen.GefenMuon`,
            :class:`gefen.GefenMuonHybrid` (both backups) or ``torch.optim.AdamW``.
        checkpoint: a DCP checkpoint directory, a DCP ``StorageReader``, or a state dict
            in memory (as ``get_optimizer_state_dict`` returns it, flattened or not).
            Only metadata (names, global shapes, dtypes) is read.
        model: the model whose fully qualified names key the checkpoint; needed only when
            the optimizer was built without names (from ``model.parameters()``).
        prefix: where the optimizer's ``state`` sits in the checkpoint (e.g.
            ``"app.optim."``); found automatically unless ambiguous.
        broadcast_from_rank0: only rank 0 holds the checkpoint (a full state dict, for
            ``set_state_dict(..., options=StateDictOptions(full_state_dict=True,
            broadcast_from_rank0=True))``): rank 0's metadata is broadcast over the default
            process group and the other ranks' ``checkpoint`` is ignored (``None`` or ``{}``).

    Under sharding every rank must call it (one agreement collective): ranks that would
    allocate different layouts (different checkpoints; rank 0's full state dict and the
    other ranks' empty ones without ``broadcast_from_rank0``) raise
    ``gefen._comm.RankDivergenceError`` (a ``RuntimeError``) together, and an error on
    one rank is raised on every rank, before anything changes.

    Raises ``ValueError`` for a checkpoint of another model (unknown names, other
    shapes) or of another optimizer, or for live state of another layout, before
    anything changes. Where it allocated state for a parameter that had none, the
    optimizer (the hybrid, for its AdamW backup) refuses to step until a load has
    succeeded; a failed load leaves it refusing, with its placeholders. A no-op for
    parameters without state in the checkpoint and for live state that already has the
    saved layout (at most digest placeholders are added): such an optimizer stays
    steppable, and a failed load leaves it exactly as it was.
    """
    children = _children(optimizer)
    params = [p for child in children for g in child.param_groups for p in g["params"]]
    comm = getattr(optimizer, "_comm", None) or Comm()
    entries = _entries_from_rank0(checkpoint) if broadcast_from_rank0 else None
    plans, error = [], None
    try:  # every local verdict goes into the one agreement below
        if entries is None:
            entries = checkpoint_entries(checkpoint)
        plans = _plan(children, entries, model, prefix)
    except Exception as exc:
        error = exc
    header = ["prepare_load"] + [  # what each parameter would get: the saved fields' shapes
        f"{ci}|{view.name}|" + " ".join(f"{f}{list(e.shape) if e.tensor else ''}" for f, e in sorted(fields.items()))
        for ci, view, fields, _layout, _fresh in plans]
    try:
        comm.agree_without_flags(params, header, error)
    except RankDivergenceError as exc:
        raise RankDivergenceError(
            "prepare_load: the ranks would prepare different state: every rank must call it with "
            f"the same checkpoint (with broadcast_from_rank0=True when only rank 0 holds it). {exc}"
        ) from None
    for ci, view, _fields, layout, _ in plans:  # everything checked on every rank: allocate
        children[ci].state[view.key] = layout()
    for ci, child in enumerate(children):
        mine = [fresh for c, _, _, _, fresh in plans if c == ci]
        if mine:
            child.__dict__.pop("_steady", None)  # a kept step plan holds the old state
            update_state_counts(child)
        if any(mine) and isinstance(child, _QuantizedOptimizer):
            child._prepared = True  # placeholders, not state: no step until a load fills them
    # the hybrid guards its AdamW backup's placeholders (torch's AdamW has no guard)
    if hasattr(optimizer, "_children") and any(
            fresh and not isinstance(children[ci], _QuantizedOptimizer) for ci, _, _, _, fresh in plans):
        optimizer._prepared = True


def _entries_from_rank0(checkpoint) -> dict[str, Entry]:
    """Rank 0's :func:`checkpoint_entries`, broadcast over the default process group (an
    error reading it is raised on every rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("prepare_load(broadcast_from_rank0=True) needs an initialised process group")
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", checkpoint_entries(checkpoint))
        except Exception as exc:
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise ValueError(f"prepare_load: rank 0 could not read the checkpoint: {value}")
    return value


def _plan(children, entries: dict[str, Entry], model, prefix):
    """What prepare_load would allocate, checked, nothing changed: (child index, view,
    the checkpoint's fields, layout factory, fresh) per parameter."""
    plans = []
    names_of = _fqns(children, model)
    all_names = {n for names in names_of for ns in names for n in ns}
    found = False
    for ci, (child, names) in enumerate(zip(children, names_of)):
        gefen_kind = isinstance(child, _QuantizedOptimizer)
        probe = _GEFEN_PROBE if gefen_kind else _ADAMW_PROBE
        flat_names = [n for ns in names for n in ns]
        pre = prefix if prefix is not None else _find_prefix(entries, flat_names, probe)
        if pre is None:
            continue  # the checkpoint holds no state for this optimizer's parameters
        found = True
        foreign = _foreign(entries, pre, all_names, probe)
        if foreign:
            raise ValueError(
                f"prepare_load: the checkpoint holds optimizer state for parameters this "
                f"optimizer does not have: {sorted(foreign)[:5]} (a checkpoint of another model?)"
            )
        for gi, group in enumerate(child.param_groups):
            for i, (p, name) in enumerate(zip(group["params"], names[gi])):
                fields = _fields(entries, pre, name, _GEFEN_FIELDS if gefen_kind else _ADAMW_FIELDS)
                if not fields:
                    continue
                view = make_view(p, param_name(group, gi, i), group, gi, i)
                fresh = not child.state.get(view.key)  # no live state: a placeholder
                if gefen_kind:
                    layout = _gefen_layout(child, view, fields)
                else:
                    layout = _adamw_layout(child, view, fields)
                if layout is not None:
                    plans.append((ci, view, fields, layout, fresh))
    if not found:
        _check_nothing_unmatched(entries, children, model, all_names)
    return plans


def _check_nothing_unmatched(entries: dict[str, Entry], children, model, names: set[str]) -> None:
    """When none of the optimizer's parameter names keys state in the checkpoint, the
    checkpoint must hold no optimizer state at all: another optimizer's state for these
    parameters (torch AdamW's ``exp_avg`` for a gefen optimizer, gefen's ``codes`` for
    torch's AdamW), or state under other names (a checkpoint keyed by the model's names,
    for an optimizer built from ``model.parameters()`` without ``model=``; or of another
    model) raises here instead of leaving the optimizer unprepared for a load that would
    then drop it."""
    probes = (f".{_GEFEN_PROBE}", f".{_ADAMW_PROBE}")
    held = sorted(k for k in entries if k.endswith(probes) and (k.startswith("state.") or ".state." in k))
    if not held:
        return
    keyed = tuple(f"state.{n}" for n in names)
    ours = [k for k in held if k.rsplit(".", 1)[0].endswith(keyed)]
    if ours:
        field = ours[0].rsplit(".", 1)[1]
        writer = "torch's AdamW or another torch.optim optimizer" if field == _ADAMW_PROBE else "a gefen optimizer"
        raise ValueError(
            f"prepare_load: the checkpoint holds another optimizer's state for these parameters "
            f"(e.g. {ours[:2]}, written by {writer}): an optimizer cannot take over another "
            "kind's state. Load it into the kind of optimizer that wrote it, or start this one "
            "fresh (a gefen optimizer learns its state on its first step)."
        )
    unnamed = model is None and any(g.get("param_names") is None for c in children for g in c.param_groups)
    hint = (" The optimizer was built without parameter names (from model.parameters()): pass "
            "model= (the model whose names key the checkpoint), or build it from "
            "model.named_parameters()." if unnamed else
            " A checkpoint of another model? If the names differ by a wrapper's prefix (e.g. DDP's "
            "'module.'), pass model=, which maps them as DCP does.")
    raise ValueError(
        f"prepare_load: the checkpoint holds optimizer state under names this optimizer's "
        f"parameters do not have (e.g. {held[:3]}).{hint}"
    )


def _shape_error(view, key: str, got, want) -> ValueError:
    return ValueError(
        f"prepare_load: parameter '{view.name}': the checkpoint's state '{key}' has shape "
        f"{tuple(got)} but the parameter gives {tuple(want)} (a checkpoint of another model?)"
    )


def _gefen_layout(opt, view, fields: dict[str, Entry]):
    """The saved layout of one gefen parameter (checked), as a function that allocates
    it; None when the live state already has it."""
    for key in ("codes", "magnitude"):
        if key not in fields or not fields[key].tensor:
            raise ValueError(
                f"prepare_load: parameter '{view.name}': the checkpoint's state has no tensor "
                f"'{key}' (not a gefen {opt.KIND} checkpoint?)"
            )
    if fields["codes"].shape != tuple(view.shape):
        raise _shape_error(view, "codes", fields["codes"].shape, view.shape)
    rows, cols = rows_cols(view.shape)
    mshape = fields["magnitude"].shape
    if len(mshape) != 2 or mshape[0] != rows or mshape[1] < 1 or cols % mshape[1]:
        raise _shape_error(view, "magnitude", mshape, (rows, "S/P"))
    period = cols // mshape[1]
    factored = "v_row" in fields
    kind_ok = ("vmean" in fields or factored) if opt.KIND == "gefen" else ("vmean" not in fields and not factored)
    if not kind_ok:
        raise ValueError(
            f"prepare_load: parameter '{view.name}': the checkpoint's state is not a "
            f"{opt.KIND} state (fields {sorted(fields)})"
        )
    normuon = "v" in fields
    live = opt.state.get(view.key)
    if live:
        same = (int(live["period"]) == period and ("v_row" in live) == factored and ("v" in live) == normuon)
        if same:  # the layout is there; make sure the digests are too (a flattened load needs them)
            if "digest_rows" in fields and "digest_rows" not in live:
                return lambda: dict(live, **_digest_placeholders(view))
            return None
        raise ValueError(
            f"prepare_load: parameter '{view.name}' already has state of another layout; "
            "prepare_load is for an optimizer that has not been stepped"
        )

    def allocate() -> dict:
        st = block_state(view, period)
        dev = view.param.device
        if opt.KIND == "gefen":
            st["factored"] = int(factored)
            if factored:
                st["v_row"] = row_vector(view)
                st["v_col"] = make_replicated(view, torch.zeros(cols, dtype=torch.float32, device=dev))
            else:
                mag = st["magnitude"]
                st["vmean"] = make_row_state(view, torch.zeros_like(local(mag)), mag.shape)
        if normuon:
            st["v"] = row_vector(view)
        st["codebook"] = make_replicated(view, torch.zeros(256, dtype=torch.float32, device=dev))
        st.update(_digest_placeholders(view))
        return st

    return allocate


def _digest_placeholders(view) -> dict:
    """Zero digests laid out like the parameter's (filled by the load)."""
    dev = view.param.device
    return {
        "digest_rows": make_row_state(view, torch.zeros(view.local_rows, dtype=torch.int64, device=dev),
                                      (view.rows,)),
        "digest": make_replicated(view, torch.zeros(2, dtype=torch.int64, device=dev)),
    }


def _adamw_layout(opt, view, fields: dict[str, Entry]):
    """AdamW's saved state of one parameter, as a function that allocates it; None when
    the live state already has it (its moments are kept, not zeroed)."""
    for key in ("exp_avg", "exp_avg_sq"):
        if key in fields and fields[key].shape != tuple(view.shape):
            raise _shape_error(view, key, fields[key].shape, view.shape)
    live = opt.state.get(view.key)
    if live:
        if {k for k in _ADAMW_FIELDS if k in live} == set(fields):
            return None
        raise ValueError(
            f"prepare_load: parameter '{view.name}' already has state of another layout "
            f"(AdamW state {sorted(k for k in live if k in _ADAMW_FIELDS)}, the checkpoint's "
            f"{sorted(fields)}); prepare_load is for an optimizer that has not been stepped"
        )

    def allocate() -> dict:
        st: dict[str, Any] = {}
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in fields:
                st[key] = torch.zeros_like(view.key, memory_format=torch.preserve_format).detach()
        if "step" in fields:
            e = fields["step"]
            st["step"] = torch.zeros(e.shape or (), dtype=e.dtype or torch.float32) if e.tensor else 0
        return st

    return allocate

