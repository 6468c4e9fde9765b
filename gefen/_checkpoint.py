"""Checkpoints of the quantised optimizers (DESIGN.md §5): ``state_dict`` with integrity
digests, and ``load_state_dict`` as validate → agree → convert → install.

* ``state_dict()`` returns *copies* of the state tensors (DTensors keep the parameter's
  mesh and placements), so an in-place loader such as ``torch.distributed.checkpoint``
  writes into the copies, never into live state: a bad checkpoint is found before
  anything changes.
* Every parameter's state carries ``digest_rows`` (int64, one per global row, sharded
  like the parameter: a BLAKE2b digest of that row's bytes in every row-following state
  tensor and of its global index) and ``digest`` (int64 ``[v_col, codebook]``,
  replicated). Digests reshard with the data, so after any change of topology each rank
  re-checks exactly its own rows, with no extra collective.
* Each parameter group carries ``gefen_state_count``, the number of its parameters with
  state. A load that brings fewer (what PyTorch's flattened and DCP loads do to an
  optimizer without allocated state) raises instead of silently restarting moments.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from copy import deepcopy
from itertools import chain
from typing import Any

import torch

from ._ext import _C
from ._layout import SCHEMA_VERSION, param_name
from ._state import COMMON_KEYS, DIGEST_KEYS, PREPARE_HINT, StateError, as_int, check_common_state
from ._views import ParamView, is_dtensor, local, make_replicated, make_row_state, make_view, wrap_local

#: Group header: how many of the group's parameters have state.
STATE_COUNT = "gefen_state_count"
#: Per-parameter digests (not part of the live state).
DIGEST_ROWS, DIGEST = DIGEST_KEYS
#: State tensors that follow the parameter's rows, in digest order.
ROW_FIELDS = ("codes", "magnitude", "vmean", "v_row", "v")
#: State entries that are ints in the live state (a checkpoint may hold them as floats or
#: one-element tensors, as torch.optim stores ``step``).
INT_KEYS = ("step", "global_step", "period", "factored")
#: State tensors every rank holds whole, in the order of ``digest``.
REPLICATED_FIELDS = ("v_col", "codebook")


# ------------------------------------------------------------------ digests


_LITTLE = sys.byteorder == "little"


def _digest(data) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _host_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(_C.tensor_bytes(t.detach().cpu().contiguous()))


def row_digests(fields: dict[str, torch.Tensor], row_offset: int, nrows: int) -> torch.Tensor:
    """One digest per local row over every row-following field present (local tensors
    whose dim 0 is the rows), keyed to the *global* row index: BLAKE2b of the row's
    index (int64, little-endian) followed by the row's bytes of each field in
    :data:`ROW_FIELDS` order."""
    if nrows == 0:
        return torch.empty(0, dtype=torch.int64)
    index = torch.arange(row_offset, row_offset + nrows, dtype=torch.int64)
    cols = [index.view(torch.uint8).reshape(nrows, 8)]
    for k in ROW_FIELDS:
        t = fields.get(k)
        if t is not None:
            cols.append(t.detach().cpu().contiguous().reshape(nrows, -1).view(torch.uint8))
    rows = torch.cat(cols, dim=1)  # one contiguous byte row per parameter row
    width = rows.shape[1]
    buf = _host_bytes(rows)
    blake2b = hashlib.blake2b
    digests = b"".join(blake2b(buf[i * width : (i + 1) * width], digest_size=8).digest()
                       for i in range(nrows))
    # the 8 digest bytes read as one little-endian int64, as _digest() reads them
    return torch.frombuffer(bytearray(digests), dtype=torch.int64).clone() if _LITTLE else \
        torch.tensor([int.from_bytes(digests[8 * i : 8 * i + 8], "little", signed=True) for i in range(nrows)],
                     dtype=torch.int64)


def replicated_digests(fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[digest(v_col) or 0, digest(codebook)]`` of local (whole) tensors."""
    out = []
    for k in REPLICATED_FIELDS:
        t = fields.get(k)
        out.append(0 if t is None else _digest(_host_bytes(t)))
    return torch.tensor(out, dtype=torch.int64)


# ------------------------------------------------------------------ export


def clone_state_tensor(v: torch.Tensor) -> torch.Tensor:
    """A copy with the same global layout (a DTensor stays a DTensor)."""
    if is_dtensor(v):
        return wrap_local(v._local_tensor.clone(), v.device_mesh, v.placements, v.shape, v.stride())
    return v.detach().clone()


def export_state(view: ParamView, st: dict, memo: dict | None = None, digests: bool = True) -> dict:
    """A parameter's state for a state dict: copies of its tensors, its ints, and fresh
    digests. The digests are also kept in the live state from the first state_dict() on
    (a training run that never saves does not pay for them): PyTorch's flattened load
    restores only keys the live state already has."""
    if digests or DIGEST_ROWS not in st:  # (state allocated for a load has placeholders)
        fields = {k: local(v) for k, v in st.items() if isinstance(v, torch.Tensor) and k not in DIGEST_KEYS}
        dev = view.param.device
        rows = row_digests(fields, view.row_offset, view.local_rows).to(dev)
        reps = replicated_digests(fields).to(dev)
        if DIGEST_ROWS in st and local(st[DIGEST_ROWS]).shape == rows.shape:
            local(st[DIGEST_ROWS]).copy_(rows)
            local(st[DIGEST]).copy_(reps)
        else:
            st[DIGEST_ROWS] = make_row_state(view, rows, (view.rows,))
            st[DIGEST] = make_replicated(view, reps)
    memo = {} if memo is None else memo  # one copy of a tensor shared by several states
    out = {}
    for k, v in st.items():
        if isinstance(v, torch.Tensor):
            if id(v) not in memo:
                memo[id(v)] = clone_state_tensor(v)
            out[k] = memo[id(v)]
        else:
            out[k] = v
    return out


def state_dict(opt) -> dict[str, Any]:
    """The quantised optimizer's standard state dict (see module docstring)."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    update_state_counts(opt)
    groups, state, index, memo = [], {}, 0, {}
    for gi, group in enumerate(opt.param_groups):
        packed = {k: v for k, v in group.items() if k != "params"}
        ids = []
        for i, p in enumerate(group["params"]):
            st = opt.state.get(p)
            if st:
                name = param_name(group, gi, i)
                codes = st.get("codes")
                if isinstance(codes, torch.Tensor) and tuple(codes.shape) != tuple(p.shape):
                    raise RuntimeError(
                        f"parameter '{name}': has shape {tuple(p.shape)} but its optimizer state "
                        f"was made for shape {tuple(codes.shape)} (the parameter was resized or "
                        "replaced after its first step); its state cannot be saved"
                    )
                view = make_view(p, name, group, gi, i)
                # state prepare_load allocated is a load target: its digests do not matter
                state[index] = export_state(view, st, memo, digests=not opt.__dict__.get("_prepared"))
            ids.append(index)
            index += 1
        packed["params"] = ids
        groups.append(packed)
    return run_hooks(opt._optimizer_state_dict_post_hooks, opt, {"state": state, "param_groups": groups})


def run_hooks(hooks, opt, state_dict):
    """Runs ``torch.optim``'s state-dict post-hooks or load pre-hooks in order: each is
    called with ``(opt, state_dict)`` and a non-None result replaces the state dict."""
    for hook in hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def update_state_counts(opt) -> None:
    """Write each live group's :data:`STATE_COUNT` (kept in the live groups because
    PyTorch's flattened load reads the keys of the live groups)."""
    for group in opt.param_groups:
        group[STATE_COUNT] = sum(1 for p in group["params"] if opt.state.get(p))


# ------------------------------------------------------------------ validate


def _incoming_local(view: ParamView, key: str, v: torch.Tensor, row_field: bool) -> torch.Tensor:
    """The local part of an incoming state tensor for this rank: a DTensor placed like
    the parameter gives its local tensor; a plain (whole) tensor is sliced to this
    rank's rows when it follows the rows of a sharded parameter."""
    if is_dtensor(v):
        if not view.layout.distributed:
            raise StateError(
                f"parameter '{view.name}': state '{key}' is a DTensor but the parameter is not"
            )
        want = view.layout.placements if row_field else None
        if want is not None and (tuple(v.placements) != tuple(want) or v.device_mesh != view.layout.mesh):
            raise StateError(
                f"parameter '{view.name}': state '{key}' has placements {tuple(v.placements)}, "
                f"the parameter {tuple(want)}"
            )
        lt = v._local_tensor
        # a DTensor's global metadata says nothing of its local shard: check it too
        rows = row_field and view.layout.sharded and v.dim() > 0
        want_shape = (view.local_rows, *v.shape[1:]) if rows else tuple(v.shape)
        if tuple(lt.shape) != tuple(want_shape) or lt.dtype != v.dtype:
            raise StateError(
                f"parameter '{view.name}': state '{key}' (global shape {tuple(v.shape)}) has a "
                f"local shard of shape {tuple(lt.shape)} and dtype {lt.dtype} on this rank, "
                f"expected {tuple(want_shape)} and {v.dtype}"
            )
        return lt
    if row_field and view.layout.sharded and v.dim() > 0:
        return v[view.row_offset : view.row_offset + view.local_rows]
    return v


def localize(view: ParamView, st: dict) -> dict:
    """An incoming (validated) state entry with every tensor replaced by this rank's part."""
    out = {}
    for k, v in st.items():
        if isinstance(v, torch.Tensor):
            out[k] = _incoming_local(view, k, v, k in ROW_FIELDS or k == DIGEST_ROWS)
        else:
            out[k] = v
    return out


def check_digests(view: ParamView, st_local: dict) -> None:
    """Recompute this rank's row digests and the replicated ones; raise on a mismatch."""
    for key in DIGEST_KEYS:
        if key not in st_local:
            raise StateError(
                f"parameter '{view.name}': state has no '{key}' (a gefen state dict carries "
                "integrity digests; this one was not made by gefen's state_dict())"
            )
    rows, reps = st_local[DIGEST_ROWS], st_local[DIGEST]
    if rows.dtype != torch.int64 or tuple(rows.shape) != (view.local_rows,):
        raise StateError(f"parameter '{view.name}': state '{DIGEST_ROWS}' has the wrong dtype or shape")
    if reps.dtype != torch.int64 or tuple(reps.shape) != (len(REPLICATED_FIELDS),):
        raise StateError(f"parameter '{view.name}': state '{DIGEST}' has the wrong dtype or shape")
    fields = {k: v for k, v in st_local.items() if isinstance(v, torch.Tensor) and k not in DIGEST_KEYS}
    got = row_digests(fields, view.row_offset, view.local_rows)
    bad = (got != rows.cpu()).nonzero()
    if len(bad):
        r = view.row_offset + int(bad[0])
        raise StateError(
            f"parameter '{view.name}': state row {r} does not match its digest (the checkpoint "
            f"is corrupt or was not written by this optimizer; {len(bad)} bad row(s) on this rank)"
        )
    if not torch.equal(replicated_digests(fields), reps.cpu()):
        raise StateError(
            f"parameter '{view.name}': state 'v_col' or 'codebook' does not match its digest "
            "(the checkpoint is corrupt)"
        )


def foreign_hint(state_dict: dict[str, Any]) -> str:
    """A sentence for a load whose groups carry no gefen header: whose state dict it looks
    like (e.g. torch.optim.AdamW's, by its state keys) and that gefen cannot take it over.
    Empty where the first group has a gefen header."""
    groups = state_dict.get("param_groups")
    first = groups[0] if isinstance(groups, (list, tuple)) and groups else None
    if isinstance(first, dict) and ("gefen_schema" in first or "gefen_hybrid" in first):
        return ""
    state = state_dict.get("state")
    keys = sorted({str(k) for st in state.values() if isinstance(st, dict) for k in st}
                  if isinstance(state, dict) else ())
    held = f" (its state holds {', '.join(map(repr, keys))})" if keys else ""
    return (f"; this is not a gefen state dict{held}: another optimizer's state cannot be "
            "loaded into a gefen optimizer, which learns its own state on its first step")


def validate(opt, state_dict: dict[str, Any]) -> dict:
    """Every check of a load (mutates nothing). Returns what :func:`install` needs."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("a state dict needs 'state' and 'param_groups'")
    groups = opt.param_groups
    saved_groups = deepcopy(state_dict["param_groups"])
    if not isinstance(saved_groups, (list, tuple)) or len(groups) != len(saved_groups):
        n = len(saved_groups) if isinstance(saved_groups, (list, tuple)) else type(saved_groups).__name__
        raise ValueError(f"loaded state dict has {n} parameter groups, the optimizer {len(groups)}")
    for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
        if not isinstance(sg, dict) or not isinstance(sg.get("params"), (list, tuple)):
            raise ValueError(f"parameter group {gi}: expected a dict with a 'params' list")
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(
                f"parameter group {gi}: the loaded state dict has {len(sg['params'])} "
                f"parameters, the optimizer {len(g['params'])}"
            )
        schema = sg.get("gefen_schema")
        if schema != SCHEMA_VERSION:
            newer = isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA_VERSION
            raise ValueError(
                f"parameter group {gi}: state-dict schema version {schema!r} is not supported "
                f"(this gefen reads version {SCHEMA_VERSION}"
                + ("; the checkpoint was written by a newer gefen" if newer else "") + ")"
                + foreign_hint(state_dict)
            )
        if sg.get("gefen_kind") != opt.KIND:
            raise ValueError(
                f"parameter group {gi}: the state dict is from optimizer kind "
                f"{sg.get('gefen_kind')!r}, not {opt.KIND!r}"
            )
        # hyper-parameters come from the checkpoint (as torch.optim does); the options
        # that choose the representation and the sharded mode stay the live ones
        sg.update({k: g[k] for k in opt._LIVE_OPTIONS if k in g})
        # (torch.optim's __setstate__, run by every install and unpickling, adds
        # "differentiable" to the defaults: an option gefen neither takes nor saves)
        missing = [k for k in opt.defaults if k not in sg and k not in (STATE_COUNT, "differentiable")]
        if missing:
            raise ValueError(
                f"parameter group {gi}: the saved group has no {', '.join(map(repr, missing))} "
                "(a gefen state dict carries every option of its groups)"
            )
        merged = dict(sg, params=g["params"])
        try:
            opt._check_group(merged)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"parameter group {gi}: invalid saved hyper-parameter: {exc}") from None
        except KeyError as exc:
            raise ValueError(f"parameter group {gi}: the saved group has no {exc.args[0]!r}") from None
    id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                      chain.from_iterable(g["params"] for g in groups)))
    where = {}
    for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
        for i, pid in enumerate(sg["params"]):
            where[pid] = (gi, i, g, sg)
    saved_state = state_dict["state"]
    if not isinstance(saved_state, dict):
        raise ValueError(f"'state' must be a dict, got {type(saved_state).__name__}")
    entries, codebook, global_step = {}, None, None
    counts = [0] * len(groups)
    for pid, st in saved_state.items():
        if isinstance(st, dict) and not st:
            continue  # a parameter that was never stepped
        if pid not in id_map:
            raise ValueError(f"loaded state refers to parameter id {pid!r}, which no group holds")
        p = id_map[pid]
        gi, i, group, saved_group = where[pid]
        counts[gi] += 1
        view = make_view(p, param_name(group, gi, i), group, gi, i)
        name = view.name
        try:
            check_common_state(st, p, name)
            opt._check_state(st, p, name, saved_group)
            st_local = localize(view, st)
        except StateError as exc:
            raise ValueError(str(exc)) from None
        cb = st_local["codebook"].detach().cpu()
        if codebook is None:
            codebook = cb
            try:
                _C.codebook_validate(codebook.contiguous())
            except ValueError as exc:
                raise ValueError(f"parameter '{name}': state 'codebook' is invalid: {exc}") from None
            global_step = as_int(st, "global_step", name)
        else:
            if not torch.equal(cb, codebook):
                raise ValueError(
                    f"parameter '{name}': state 'codebook' differs from the other parameters' "
                    "(an optimizer has one codebook)"
                )
            if as_int(st, "global_step", name) != global_step:
                raise ValueError(
                    f"parameter '{name}': state 'global_step' {as_int(st, 'global_step', name)} "
                    f"differs from the other parameters' ({global_step})"
                )
        try:  # last: a value that is wrong in itself gets the more specific error above
            check_digests(view, st_local)
        except StateError as exc:
            raise ValueError(str(exc)) from None
        entries[p] = (view, st_local, saved_group)
    for gi, sg in enumerate(saved_groups):
        want = sg.get(STATE_COUNT)
        if isinstance(want, int) and not isinstance(want, bool) and want > counts[gi]:
            raise ValueError(
                f"parameter group {gi}: the checkpoint holds state for {want} parameter(s) but "
                f"{counts[gi]} arrived -- the load dropped optimizer state (PyTorch's flattened "
                "and DCP loads keep only the state an optimizer has already allocated); "
                + PREPARE_HINT
            )
    # the optimizer's own parameter order, not the state dict's: install converts in this
    # order, one collective per converted parameter, which every rank must pair alike
    entries = {p: entries[p] for p in chain.from_iterable(g["params"] for g in groups) if p in entries}
    global_step = global_step or 0
    return {"entries": entries, "codebook": codebook, "global_step": global_step,
            "saved_groups": saved_groups}


#: How each entry of :func:`incoming_agreement` starts (it ends up in the divergence error).
LOADED = "the loaded checkpoint:"


def incoming_agreement(checked: dict) -> list[str]:
    """What every rank must load alike (``checked``: what :func:`validate` returned), as text for the load's agreement (one fact per
    entry, so that a divergence error names it): everything install makes replicated --
    the codebook, the global step, the saved groups' hyper-parameters, each parameter's
    counters, form and replicated tensors (their checked digests), and the rows of a
    parameter that is not row-sharded (every rank holds them all). Not the rows of a
    sharded parameter: they differ by rank, and each rank checked its own against their
    digests."""
    entries, codebook, global_step = checked["entries"], checked["codebook"], checked["global_step"]
    cb = "none" if codebook is None else _digest(_host_bytes(codebook))
    out = [f"{LOADED} global_step={global_step}", f"{LOADED} codebook digest={cb}"]
    for gi, sg in enumerate(checked["saved_groups"]):
        out.extend(f"{LOADED} group {gi} {k}={_describe(v)}"
                   for k, v in sorted(sg.items(), key=lambda kv: str(kv[0])) if k != "params")
    for view, st, _ in entries.values():
        ints = " ".join(f"{k}={as_int(st, k, view.name)}" for k in INT_KEYS if k in st)
        fields = ",".join(sorted(k for k in st if k not in COMMON_KEYS and k not in INT_KEYS))
        out.append(f"{LOADED} parameter '{view.name}' {ints} fields=+{fields}")
        v_col, cb_digest = st[DIGEST].tolist()
        out.append(f"{LOADED} parameter '{view.name}' v_col digest={v_col} codebook digest={cb_digest}")
        if not view.layout.sharded:
            out.append(f"{LOADED} parameter '{view.name}' (not row-sharded) row digests "
                       f"digest={_digest(_host_bytes(st[DIGEST_ROWS]))}")
    return out


def _describe(value) -> str:
    """A hyper-parameter as exact text (a tensor by dtype, shape and bytes: its repr
    rounds)."""
    if isinstance(value, torch.Tensor):
        t = local(value)
        return f"tensor({t.dtype}, {tuple(t.shape)}, {_digest(_host_bytes(t))})"
    return repr(value)


# ------------------------------------------------------------------ install


def install(opt, checked: dict, convert: Callable[[ParamView, dict, dict], dict]) -> None:
    """Build the new live state (converted to the configured representation where it
    differs, as new tensors) and install it with the saved hyper-parameters."""
    from collections import defaultdict

    new_state: defaultdict = defaultdict(dict)
    for p, (view, st_local, saved_group) in checked["entries"].items():
        st = convert(view, st_local, saved_group)
        built = {}
        for k, v in st.items():
            if k == "codebook":
                continue
            if k in INT_KEYS:  # (validated: an int, an integral float or a one-element tensor)
                built[k] = int(v.item() if isinstance(v, torch.Tensor) else v)
            elif isinstance(v, torch.Tensor):
                t = _owned(v.detach(), view.param.device)
                if k in ROW_FIELDS or k == DIGEST_ROWS:
                    gshape = (view.rows, *t.shape[1:]) if k != "codes" else tuple(view.shape)
                    built[k] = make_row_state(view, t, gshape)
                else:
                    built[k] = make_replicated(view, t)
            else:
                built[k] = int(v)
        new_state[p] = built
    param_groups = []
    for g, sg in zip(opt.param_groups, checked["saved_groups"]):
        sg["params"] = g["params"]
        if "param_names" in g and "param_names" not in sg:
            sg["param_names"] = g["param_names"]
        param_groups.append(sg)
    codebook = checked["codebook"]
    opt.__setstate__({"state": new_state, "param_groups": param_groups})
    opt._codebook = None
    opt._codebook_copies = {}
    opt._quantizer = None
    if codebook is not None:
        opt._set_codebook(codebook.to(torch.float32).clone())
        for p, (view, _, _) in checked["entries"].items():
            opt.state[p]["codebook"] = opt._codebook_on(view)
    opt._global_step = checked["global_step"]
    opt._prepared = False
    update_state_counts(opt)


def _owned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of a loaded tensor for the live state (never an alias of the caller's
    state dict, which may be loaded twice), contiguous, on the parameter's device."""
    return t.to(device=device, copy=True, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------ projections


def _sum_rows(view: ParamView, t: torch.Tensor, comm) -> torch.Tensor:
    """Sum over all global rows of ``t`` (local rows in dim 0), float64, as every rank
    of the parameter's shard group sees it."""
    s = t.double().sum(dim=0)
    if view.layout.sharded:
        comm._reduce("load", s, view.layout.shard_group)
    return s


def block_to_factored(view: ParamView, vmean: torch.Tensor, period: int, comm) -> tuple:
    """``v_row[i] = mean_b vmean[i, b]``; ``v_col[j] = mean_i vmean[i, j // P]``: the
    factored statistics whose product ``v_row v_col / mean(v_row)`` reproduces a
    rank-one ``vmean`` exactly."""
    rows, cols = view.rows, view.cols
    v_row = vmean.double().mean(dim=1).float() if vmean.shape[1] else torch.zeros(vmean.shape[0])
    col_blocks = _sum_rows(view, vmean, comm) / rows
    v_col = col_blocks.repeat_interleave(period)[:cols].float()
    return v_row, v_col


def factored_to_block(view: ParamView, v_row: torch.Tensor, v_col: torch.Tensor, period: int,
                      comm) -> torch.Tensor:
    """``vmean[i, b] = v_row[i] · mean_{j in b} v_col[j] / max(mean(v_row), FLT_MIN)``: the
    block means of the factored estimate the update uses."""
    mu = float(_sum_rows(view, v_row.unsqueeze(1), comm)[0]) / view.rows
    mu = max(mu, torch.finfo(torch.float32).tiny)
    col_means = v_col.double().view(-1, period).mean(dim=1)
    return (v_row.double().unsqueeze(1) * col_means.unsqueeze(0) / mu).float()

