"""``gefen.GefenMuonHybrid``: GefenMuon for hidden matrices, Gefen or AdamW for the rest
(ALGORITHM.md §8), behaving as one ``torch.optim.Optimizer``.

The hybrid owns two children and no state of its own. ``param_groups`` is the live
concatenation of the children's groups (Muon first) and ``state`` a live view over both
children's state, so LR schedulers, ``GradScaler`` and the DCP state-dict helpers see one
ordinary optimizer. ``state_dict()`` is one flat standard dict; ``load_state_dict``
validates both halves before either child changes; ``step()`` checks every gradient of
both children before either mutates.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from itertools import chain
from numbers import Real
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from . import _checkpoint
from ._base import (
    _QuantizedOptimizer,
    agree_on_load,
    agreed_rebind_plans,
    eager_under_compile,
    install_rebind,
)
from ._checkpoint import PREPARE_HINT, STATE_COUNT, clone_state_tensor, run_hooks, update_state_counts
from ._comm import Comm
from ._layout import check_no_self_overlap, check_param, check_plain_grads, overlaps_itself, param_name
from ._views import layout_text, local, mesh_ranks, meshes_of
from .gefen import Gefen
from .muon import STANDARD_COEFFICIENTS, GefenMuon

__all__ = [
    "GefenMuonHybrid",
    "HYBRID_SCHEMA",
    "ROLES",
    "MUON_EXCLUDED_NAME_SUBSTRINGS",
    "DEFAULT_NO_DECAY_SUBSTRINGS",
    "is_muon_parameter",
]

#: Version of the hybrid header written into every parameter group.
HYBRID_SCHEMA = 1

#: The role every parameter group carries, in the order of ``param_groups``.
ROLES = ("muon", "backup")

#: A parameter whose name contains one of these (case-insensitive) never goes to Muon.
MUON_EXCLUDED_NAME_SUBSTRINGS = ("embed", "wte", "wpe", "lm_head", "classifier", "score")

#: Parameters whose name contains one of these (case-insensitive) get no weight decay.
DEFAULT_NO_DECAY_SUBSTRINGS = ("bias", "norm", "ln_")

_BACKUPS = ("gefen", "adamw")
_LOAD_HOOKS = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def is_muon_parameter(
    name: str, param: torch.Tensor, embedding_weights: Iterable[torch.Tensor] = ()
) -> bool:
    """The routing rule of ALGORITHM.md §8: 2-D, a name free of
    :data:`MUON_EXCLUDED_NAME_SUBSTRINGS` (case-insensitive), and not one of
    ``embedding_weights`` (the weights of ``nn.Embedding``/``nn.EmbeddingBag`` modules,
    which also catches output heads tied to them)."""
    if param.dim() != 2:
        return False
    lowered = name.lower()
    if any(s in lowered for s in MUON_EXCLUDED_NAME_SUBSTRINGS):
        return False
    return not any(param is w for w in embedding_weights)


class _HybridState(MutableMapping):
    """``optimizer.state`` of the hybrid: parameter → that parameter's state in whichever
    child owns it. Reading a parameter without state creates an empty entry, as a
    ``torch.optim`` ``defaultdict`` does; ``in`` and ``get`` never create one."""

    def __init__(self, hybrid: "GefenMuonHybrid"):
        self._hybrid = hybrid

    def _child(self, p) -> Optimizer:
        child = self._hybrid._owner_of(p)
        if child is None:
            raise KeyError(p)
        return child

    def __getitem__(self, p):
        return self._child(p).state[p]

    def __setitem__(self, p, value) -> None:
        self._child(p).state[p] = value

    def __delitem__(self, p) -> None:
        del self._child(p).state[p]

    def __contains__(self, p) -> bool:
        child = self._hybrid._owner_of(p)
        return child is not None and p in child.state

    def get(self, p, default=None):
        """The state of ``p`` if it has an entry, else ``default`` (creates nothing)."""
        child = self._hybrid._owner_of(p)
        return default if child is None else child.state.get(p, default)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return chain.from_iterable(list(c.state) for c in self._hybrid._children)

    def __len__(self) -> int:
        return sum(len(c.state) for c in self._hybrid._children)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} parameters)"


class GefenMuonHybrid(Optimizer):
    r"""Muon for hidden matrices, Gefen or AdamW for everything else, as one optimizer.

    A parameter goes to the :class:`gefen.GefenMuon` child iff it is 2-D, its name
    (case-insensitive) contains none of ``embed, wte, wpe, lm_head, classifier, score``
    and, when a module is given, it is not the weight of an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` (which catches output heads tied to an embedding). Everything
    else — norms, biases, convolutions, embeddings, heads — goes to the backup child:
    :class:`gefen.Gefen` with ``factored=False`` (``backup_optimizer="gefen"``) or
    ``torch.optim.AdamW`` (``"adamw"``).

    Three ways to say which parameters:

    * ``GefenMuonHybrid(model, lr=...)`` — an ``nn.Module``: its trainable
      ``named_parameters()`` routed by the rule above;
    * ``GefenMuonHybrid(model.named_parameters(), lr=...)`` — ``(name, tensor)`` pairs,
      routed by shape and name only;
    * ``GefenMuonHybrid(muon_params, backup_params, lr=...)`` — explicit lists (tensors or
      ``(name, tensor)`` pairs); every Muon parameter must be 2-D.

    ``param_groups`` is the live concatenation of the children's groups, Muon first,
    each with ``"role"`` ``"muon"`` or ``"backup"`` and a ``"gefen_hybrid"`` header; a
    parameter with fewer than two dimensions (biases, norm gains) or whose name contains
    one of ``no_decay_substrings`` is placed in its role's no-decay group
    (``weight_decay=0``). Changing a group's ``lr`` (e.g. by an LR
    scheduler) changes the child's.

    Args:
        params: a module, ``(name, tensor)`` pairs, or the Muon list of the explicit form.
        backup_params: the backup list of the explicit form (else None).
        lr (float or Tensor): learning rate of both children unless overridden.
        muon_lr, backup_lr: per-child learning rates (default ``lr``).
        weight_decay (float): decoupled weight decay of both children unless overridden.
        muon_weight_decay, backup_weight_decay: per-child weight decay.
        no_decay_substrings (sequence of str): names containing one of these
            (case-insensitive) get ``weight_decay=0``.
        backup_optimizer (str): ``"gefen"`` or ``"adamw"``.
        betas, eps: the backup's Adam coefficients.
        momentum, nesterov, ns_coefficients, ns_steps, adjust_lr_fn, ns_schedule,
        normuon, normuon_beta2, normuon_eps, sharded_mode: GefenMuon's options (hybrid
            defaults ``ns_schedule="standard"``, ``normuon=True``,
            ``adjust_lr_fn="match_rms_adamw"``, so one ``lr`` suits both children).
        muon_eps (float): GefenMuon's ``eps`` (Newton–Schulz normalisation floor).
        codebook_refresh_every (int): passed to the quantised children.
    """

    def __init__(
        self,
        params,
        backup_params=None,
        *,
        lr: float | torch.Tensor,
        muon_lr: float | torch.Tensor | None = None,
        backup_lr: float | torch.Tensor | None = None,
        weight_decay: float = 0.1,
        muon_weight_decay: float | None = None,
        backup_weight_decay: float | None = None,
        no_decay_substrings: Sequence[str] = DEFAULT_NO_DECAY_SUBSTRINGS,
        backup_optimizer: str = "gefen",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = STANDARD_COEFFICIENTS,
        muon_eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        ns_schedule="standard",
        normuon: bool = True,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        sharded_mode: str = "exact",
        codebook_refresh_every: int = 0,
    ):
        if backup_optimizer not in _BACKUPS:
            raise ValueError(f"backup_optimizer must be one of {_BACKUPS}, got {backup_optimizer!r}")
        if isinstance(no_decay_substrings, str) or not all(isinstance(s, str) for s in no_decay_substrings):
            raise TypeError("no_decay_substrings must be a sequence of strings")
        no_decay = tuple(s.lower() for s in no_decay_substrings)
        muon_named, backup_named, routing = _route(params, backup_params)

        self.defaults = dict(
            lr=lr,
            muon_lr=lr if muon_lr is None else muon_lr,
            backup_lr=lr if backup_lr is None else backup_lr,
            weight_decay=weight_decay,
            muon_weight_decay=weight_decay if muon_weight_decay is None else muon_weight_decay,
            backup_weight_decay=weight_decay if backup_weight_decay is None else backup_weight_decay,
            no_decay_substrings=no_decay,
            backup_optimizer=backup_optimizer,
        )
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

        muon = backup = None
        if muon_named:
            muon = GefenMuon(
                _groups(muon_named, "muon", self.defaults["muon_weight_decay"], no_decay),
                lr=self.defaults["muon_lr"],
                weight_decay=self.defaults["muon_weight_decay"],
                momentum=momentum,
                nesterov=nesterov,
                ns_coefficients=ns_coefficients,
                eps=muon_eps,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn,
                ns_schedule=ns_schedule,
                normuon=normuon,
                normuon_beta2=normuon_beta2,
                normuon_eps=normuon_eps,
                sharded_mode=sharded_mode,
                codebook_refresh_every=codebook_refresh_every,
            )
        if backup_named:
            groups = _groups(backup_named, "backup", self.defaults["backup_weight_decay"], no_decay)
            common = dict(lr=self.defaults["backup_lr"], betas=betas, eps=eps,
                          weight_decay=self.defaults["backup_weight_decay"])
            if backup_optimizer == "gefen":
                backup = Gefen(
                    groups, factored=False, codebook_refresh_every=codebook_refresh_every, **common
                )
            else:
                backup = torch.optim.AdamW(groups, **common)
        self._muon = muon
        self._backup = backup
        self._children = tuple(c for c in (muon, backup) if c is not None)
        self._routing = tuple(routing)
        self._owner: dict[torch.Tensor, Optimizer] = {}
        self._state_view = _HybridState(self)
        self._comm = Comm()
        self._warned_capturable_if_run_uncaptured = True

    # ------------------------------------------------------------ views

    @property
    def muon(self) -> GefenMuon | None:
        """The GefenMuon child (None when no parameter was routed to Muon)."""
        return self._muon

    @property
    def backup(self) -> Optimizer | None:
        """The backup child, Gefen or AdamW (None when every parameter went to Muon)."""
        return self._backup

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The children's parameter groups, Muon's first: the same dict objects, so
        changing a value here changes the child."""
        return [g for c in self._children for g in c.param_groups]

    @param_groups.setter
    def param_groups(self, value) -> None:
        raise AttributeError(
            "GefenMuonHybrid.param_groups is the live concatenation of its children's groups "
            "and cannot be replaced; change the groups' values instead"
        )

    @property
    def state(self) -> _HybridState:
        """Parameter → state, over both children (a live view)."""
        return self._state_view

    @state.setter
    def state(self, value) -> None:
        raise AttributeError("GefenMuonHybrid.state is a view of its children's state")

    def parameter_routing(self) -> tuple[tuple[str, str], ...]:
        """The ``(name, role)`` of every parameter, as routed at construction (frozen).
        Unnamed parameters of the explicit form are called ``muon_params[i]`` /
        ``backup_params[i]``."""
        return self._routing

    def _owner_of(self, p) -> Optimizer | None:
        if not isinstance(p, torch.Tensor):
            return None
        child = self._owner.get(p)
        if child is None:  # groups may have been added to a child since: rebuild
            self._owner = {q: c for c in self._children for g in c.param_groups for q in g["params"]}
            child = self._owner.get(p)
        return child

    def contract(self):
        """The frozen, versioned description of the hybrid's state (both children's
        fields) and checkpoint transitions (:class:`gefen.contract.Contract`)."""
        from ._layout import SCHEMA_VERSION
        from .contract import contract_for

        return contract_for("gefen_muon_hybrid", SCHEMA_VERSION)

    def rebind(self, model: nn.Module) -> None:
        """Point both children at ``model``'s current parameters by fully qualified
        name (e.g. after ``fully_shard(model)``); only before the first step. Both
        children are checked before either changes. Under sharding every rank calls it
        (one agreement collective): an error on one rank is raised on every rank
        (docs/distributed.md)."""
        plans = agreed_rebind_plans(self._children, model, self._comm)
        for child, params in zip(self._children, plans):
            install_rebind(child, params)
            if isinstance(child, _QuantizedOptimizer):
                child._header_cache = {}
                child._layout_cache = {}
                child._codebook_copies = {}
        self._owner = {}
        self.__dict__.pop("_plain_headers", None)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: the routing is fixed at construction. Add the group to
        ``hybrid.muon`` or ``hybrid.backup`` instead (it then appears in
        ``param_groups``; give it ``"role"`` and ``"gefen_hybrid"`` so checkpoints load)."""
        raise RuntimeError(
            "GefenMuonHybrid routes parameters at construction; add a group to hybrid.muon or "
            "hybrid.backup instead"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_plain_headers", None)  # (keyed by parameter; rebuilt on use)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------ step

    @eager_under_compile
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step of both children.

        Every gradient of both children is checked (and each quantised child's kernel
        inputs pre-validated) before either child mutates anything.

        Args:
            closure (Callable, optional): re-evaluates the model and returns the loss.
        """
        if self.__dict__.get("_prepared"):
            raise RuntimeError(
                "gefen.dcp.prepare_load() allocated this optimizer's state for a checkpoint "
                "that has not been loaded yet; load it before stepping"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = _prepare_all(self._children, self._comm, self._all_params(), self._plain_header_cache())
        for child, plan in zip(self._children, plans):
            if isinstance(child, _QuantizedOptimizer):
                if plan is not None:
                    child._apply_step(plan)
            else:
                child.step()
        return loss

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """One flat standard ``torch.optim`` state dict: ``state`` keyed by the index of
        the parameter in the concatenated ``param_groups`` (Muon first), and
        ``param_groups`` carrying each group's ``role``, the hybrid header and the
        children's headers. Parameters without state are omitted."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state: dict[int, dict] = {}
        groups = []
        offset = 0
        for child in self._children:
            update_state_counts(child)
            if isinstance(child, _QuantizedOptimizer):
                csd = _checkpoint.state_dict(child)  # copies and digests
            else:  # copies, so that an in-place loader (DCP) never writes into live state
                csd = child.state_dict()
                csd["state"] = {
                    i: {k: (clone_state_tensor(v) if isinstance(v, torch.Tensor) else v)
                        for k, v in st.items()}
                    for i, st in csd["state"].items()
                }
            for i, st in csd["state"].items():
                if st:
                    state[offset + i] = st
            for group in csd["param_groups"]:
                group["params"] = [offset + i for i in group["params"]]
                groups.append(group)
            offset += sum(len(g["params"]) for g in child.param_groups)
        return run_hooks(self._optimizer_state_dict_post_hooks, self, {"state": state, "param_groups": groups})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict produced by :meth:`state_dict` (parameter ids may be any
        hashable, e.g. the fully qualified names DCP uses).

        The groups must match this hybrid's (count, order, role, backup kind, sizes).
        The dict is split by role and both halves are fully loaded into scratch copies of
        the children first; only when both succeed are the children updated, so a bad
        half leaves both children exactly as they were. Hyper-parameters are restored
        from the saved groups, as ``torch.optim`` does.
        """
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        state_dict = run_hooks(self._optimizer_load_state_dict_pre_hooks, self, state_dict)
        # every check of both halves first, one agreement for all ranks, then install
        loaded, error = [], None
        try:
            halves = self._split(state_dict)
            offset = 0
            for child, half in zip(self._children, halves):
                if isinstance(child, _QuantizedOptimizer):
                    loaded.append(child._validate_load(half))
                else:
                    loaded.append(_loaded_scratch(child, half, offset))
                offset += len(child.param_groups)
        except Exception as exc:
            error = exc
        params = self._all_params()
        header = [self._hybrid_header()]
        if error is None and self._comm.distributed(params):
            # what each half will install is the same on every rank, or no rank installs:
            # a gefen child's live header and incoming replicated state, the AdamW half's
            # saved groups' hyper-parameters and each parameter's state and step
            try:
                offset = 0
                for child, done in zip(self._children, loaded):
                    if isinstance(child, _QuantizedOptimizer):
                        header += child._load_agreement(done)
                    else:
                        header += _plain_header(done, offset, self._plain_header_cache()["static"], grads=False)
                    offset += len(child.param_groups)
            except Exception as exc:
                error = exc
        agree_on_load(self._comm, params, header, error)
        for child, done in zip(self._children, loaded):
            if isinstance(child, _QuantizedOptimizer):
                child._install_load(done)
            else:
                _adopt(child, done)
                update_state_counts(child)
        self._owner = {}
        self._prepared = False
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _plain_header_cache(self) -> dict:
        """``"static"``: parameter -> the static part of its entry in the AdamW half's
        header; ``"covers"``: whether the Muon child's agreement reaches AdamW's ranks."""
        return self.__dict__.setdefault("_plain_headers", {"static": {}, "covers": None})

    def _hybrid_header(self) -> str:
        """The hybrid's own part of a load's agreement: schema, backup kind, groups."""
        groups = ",".join(f"{g.get('role')}:{len(g['params'])}" for g in self.param_groups)
        return (f"hybrid|schema={HYBRID_SCHEMA}|backup={self.defaults.get('backup_optimizer')!r}|"
                f"groups={groups}")

    def _split(self, state_dict) -> list[dict[str, Any]]:
        """The children's halves of a flat state dict, after the hybrid-level checks."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("a state dict needs 'state' and 'param_groups'")
        saved = state_dict["param_groups"]
        live = self.param_groups
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            n = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
            raise ValueError(f"loaded state dict has {n} parameter groups, the hybrid {len(live)}"
                             + _checkpoint.foreign_hint(state_dict))
        owner_of_id: dict[Any, int] = {}
        halves = []
        gi = 0
        for ci, child in enumerate(self._children):
            groups = []
            for _ in child.param_groups:
                sg, g = saved[gi], live[gi]
                if not isinstance(sg, dict):
                    raise ValueError(f"parameter group {gi}: expected a dict, got {type(sg).__name__}")
                if sg.get("gefen_hybrid") != HYBRID_SCHEMA:
                    raise ValueError(
                        f"parameter group {gi}: not a GefenMuonHybrid state dict of schema "
                        f"{HYBRID_SCHEMA} (group header 'gefen_hybrid' is {sg.get('gefen_hybrid')!r})"
                        + _checkpoint.foreign_hint(state_dict)
                    )
                if sg.get("role") != g["role"]:
                    raise ValueError(
                        f"parameter group {gi}: role {sg.get('role')!r} in the state dict, "
                        f"{g['role']!r} in this hybrid"
                    )
                if sg.get("gefen_kind") != g.get("gefen_kind"):
                    raise ValueError(
                        f"parameter group {gi} ({g['role']}): saved by a {_kind_name(sg)} child, "
                        f"but this hybrid's is {_kind_name(g)}"
                    )
                ids = sg.get("params")
                if not isinstance(ids, (list, tuple)) or len(ids) != len(g["params"]):
                    raise ValueError(
                        f"parameter group {gi}: the loaded state dict has "
                        f"{len(ids) if isinstance(ids, (list, tuple)) else ids!r} parameters, "
                        f"the hybrid {len(g['params'])}"
                    )
                for pid in ids:
                    if pid in owner_of_id:
                        raise ValueError(f"parameter id {pid!r} appears in more than one place")
                    owner_of_id[pid] = ci
                groups.append(sg)
                gi += 1
            halves.append({"state": {}, "param_groups": groups})
        saved_state = state_dict["state"]
        if not isinstance(saved_state, dict):
            raise ValueError(f"'state' must be a dict, got {type(saved_state).__name__}")
        for pid, st in saved_state.items():
            if pid not in owner_of_id:
                raise ValueError(f"loaded state refers to parameter id {pid!r}, which no group holds")
            if isinstance(st, dict) and not st:
                continue  # an empty entry is "no state" (DCP creates them when it reads state)
            halves[owner_of_id[pid]]["state"][pid] = st
        for ci, child in enumerate(self._children):
            if isinstance(child, _QuantizedOptimizer):
                continue  # the child checks its own count
            ids = {pid for g in halves[ci]["param_groups"] for pid in g["params"]}
            want = sum(g.get(STATE_COUNT) or 0 for g in halves[ci]["param_groups"])
            got = sum(1 for pid in halves[ci]["state"] if pid in ids)
            if want > got:
                raise ValueError(
                    f"the checkpoint holds {type(child).__name__} state for {want} parameter(s) "
                    f"but {got} arrived -- the load dropped optimizer state; " + PREPARE_HINT
                )
        return halves


# ---------------------------------------------------------------- helpers


def _kind_name(group: dict) -> str:
    kind = group.get("gefen_kind")
    return repr(kind) if kind is not None else "non-gefen (AdamW)"


def _named(items, label: str) -> list[tuple[str, torch.Tensor]]:
    """Tensors or (name, tensor) pairs → (name, tensor) pairs; unnamed get ``label[i]``."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append(item)
        elif isinstance(item, torch.Tensor):
            out.append((f"{label}[{i}]", item))
        elif isinstance(item, dict):
            raise TypeError(
                "GefenMuonHybrid builds its own parameter groups; pass tensors or (name, tensor) "
                "pairs, not group dicts"
            )
        else:
            raise TypeError(
                f"{label}[{i}]: expected a tensor or a (name, tensor) pair, got {type(item).__name__}"
            )
    return out


def _route(params, backup_params):
    """(muon pairs, backup pairs, routing table); each pair keeps whether it was named."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be a module, (name, tensor) pairs or a list of tensors, not a tensor")
    if isinstance(params, nn.Module):
        if backup_params is not None:
            raise TypeError("backup_params is only for the explicit (muon_params, backup_params) form")
        embeddings = [
            m.weight for m in params.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        ]
        named = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
        muon, backup, routing = [], [], []
        for name, p in named:
            check_param(p, name)
            role = "muon" if is_muon_parameter(name, p, embeddings) else "backup"
            (muon if role == "muon" else backup).append(((name, p), True))
            routing.append((name, role))
    elif backup_params is not None:
        muon_items, backup_items = list(params), list(backup_params)
        muon, backup, routing = [], [], []
        for items, label, dest in (
            (muon_items, "muon_params", muon),
            (backup_items, "backup_params", backup),
        ):
            for item, pair in zip(items, _named(items, label)):
                check_param(pair[1], pair[0])
                dest.append((pair, isinstance(item, tuple)))
                routing.append((pair[0], "muon" if dest is muon else "backup"))
    else:
        items = list(params)
        if items and not all(isinstance(i, tuple) for i in items):
            raise TypeError(
                "GefenMuonHybrid routes by name: pass a module, named_parameters() pairs, or the "
                "explicit form GefenMuonHybrid(muon_params, backup_params, ...)"
            )
        muon, backup, routing = [], [], []
        for name, p in _named(items, "params"):
            check_param(p, name)
            role = "muon" if is_muon_parameter(name, p) else "backup"
            (muon if role == "muon" else backup).append(((name, p), True))
            routing.append((name, role))
    seen: dict[torch.Tensor, str] = {}
    for (name, p), _ in chain(muon, backup):
        if p in seen:
            raise ValueError(f"parameter '{name}' is the same tensor as '{seen[p]}'; pass each once")
        seen[p] = name
    if not muon and not backup:
        raise ValueError("optimizer got an empty parameter list")
    return muon, backup, routing


def _groups(named, role: str, weight_decay, no_decay: tuple[str, ...]) -> list[dict]:
    """The decay and no-decay groups of one child (empty ones left out)."""
    decay, plain = [], []
    for (name, p), keep_name in named:
        entry = (name, p) if keep_name else p
        no_wd = p.dim() < 2 or any(s in name.lower() for s in no_decay)
        (plain if no_wd else decay).append(entry)
    groups = []
    for entries, wd in ((decay, weight_decay), (plain, 0.0)):
        if entries:
            groups.append(
                {"params": entries, "weight_decay": wd, "role": role, "gefen_hybrid": HYBRID_SCHEMA,
                 STATE_COUNT: 0}
            )
    return groups


def _prepare_all(children, comm: Comm, all_params: list, cache: dict) -> list:
    """Every check each child's ``step()`` makes before it mutates anything, for all
    children before any applies: a gefen child's prepared (validated, agreed, not yet
    applied) step; for ``torch.optim.AdamW``, the gradient checks (sparse, complex,
    shape, dtype, device) and :func:`_check_adamw_step` (its groups' hyper-parameters,
    the state of every parameter with a gradient, no self-overlapping parameter), all
    metadata only.

    Under sharding AdamW's verdict and its header (:func:`_plain_header`: its groups'
    hyper-parameters, which parameters have gradients, each parameter's state and step)
    join the first gefen child's agreement when that child's group covers AdamW's
    ranks, else one agreement of their own (``comm``, over ``all_params``) before any
    child prepares; so a divergent AdamW half makes every rank raise the same error
    before either child mutates."""
    plain_error = None
    extra: list[str] = []
    plain_params: list[torch.Tensor] = []
    offset = 0
    for child in children:
        if not isinstance(child, _QuantizedOptimizer):
            try:
                check_plain_grads(child.param_groups)
                if isinstance(child, torch.optim.Adam):
                    _check_adamw_step(child, offset)
            except Exception as exc:
                plain_error = exc
            params = [p for g in child.param_groups for p in g["params"]]
            if Comm.distributed(params):
                plain_params += params
                if plain_error is None:  # (a failed rank's header is never compared)
                    try:
                        extra += _plain_header(child, offset, cache["static"], grads=True)
                    except Exception as exc:
                        plain_error = exc
        offset += len(child.param_groups)
    host = next((c for c in children if isinstance(c, _QuantizedOptimizer)), None)
    fold = bool(plain_params) and host is not None and _covers(host, plain_params, cache)
    if plain_params and not fold:  # no gefen agreement reaches AdamW's ranks: its own
        comm.stats.reset_step()
        comm.agree_without_flags(all_params, extra, plain_error)  # raises on every rank
    plans = []
    for child in children:
        if isinstance(child, _QuantizedOptimizer):
            child._comm.stats.reset_step()
            plans.append(child._prepare_step(plain_error, extra if child is host and fold else ()))
            plain_error = None  # agreed (raised) by that child
        else:
            plans.append(None)
    if plain_error is not None:
        raise plain_error
    return plans


def _mesh_ranks(params) -> set[int]:
    """Every rank of every mesh of ``params`` (their DTensors')."""
    return mesh_ranks(meshes_of(params).values())


def _covers(host: _QuantizedOptimizer, params: list, cache: dict) -> bool:
    """Whether ``host``'s step agreement reaches every rank of ``params``' meshes
    (remembered in ``cache["covers"]`` for these very parameter lists)."""
    own = [p for g in host.param_groups for p in g["params"]]
    key = (tuple(map(id, params)), tuple(map(id, own)))
    known = cache.get("covers")
    if known is None or known[0] != key:
        known = cache["covers"] = (
            key, host._comm.distributed(own) and _mesh_ranks(params) <= _mesh_ranks(own)
        )
    return known[1]


def _plain_value(value) -> str:
    """A hyper-parameter as ranks compare it: numbers (and one-element tensors) as
    floats, so a tensor lr and a float lr of the same value agree; containers item by
    item; callables and objects whose ``repr`` is their address by type; anything else
    by ``repr``."""
    if type(value) is float:
        return repr(value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return repr(value)
    if isinstance(value, torch.Tensor):
        t = local(value)
        if t.numel() == 1 and not t.is_complex() and not t.is_meta:
            return repr(float(t.item()))
        return f"tensor{tuple(t.shape)}:{t.dtype}"
    if isinstance(value, Real):
        return repr(float(value))
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(map(_plain_value, value)) + ")"
    if callable(value) or type(value).__repr__ is object.__repr__:  # (an address: per process)
        return f"<{type(value).__qualname__}>"
    return repr(value)


def _plain_header(child: Optimizer, offset: int, cache: dict, grads: bool) -> list[str]:
    """What every rank must agree on about a ``torch.optim`` half (DESIGN.md §4): each
    group's hyper-parameters (lr as a float), each parameter's name, global shape, dtype
    and placements, whether it has a gradient (``grads``), which state it holds and its
    ``step`` (a float; the step tensors of a capturable or fused AdamW, on the device,
    are read once per device). ``cache``: parameter -> the static part of its entry."""
    out: list[str] = []
    on_device: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    state = child.state
    for gi, group in enumerate(child.param_groups):
        hyper = "|".join(f"{k}={_plain_value(v)}" for k, v in sorted(group.items())
                         if k != "params" and k != "param_names")
        out.append(f"{_group_label(child, gi, offset)}|{hyper}")
        for i, p in enumerate(group["params"]):
            static = cache.get(p)
            if static is None:
                static = cache[p] = (
                    f"parameter '{param_name(group, gi, i)}'|{tuple(p.shape)}|{p.dtype}|{layout_text(p)}"
                )
            st = state.get(p)
            held = ",".join(sorted(map(str, st))) if isinstance(st, dict) else type(st).__name__
            grad = f"|grad={p.grad is not None}" if grads else ""
            entry = f"{static}{grad}|state={held}|step="
            step = st.get("step") if isinstance(st, dict) else None
            t = local(step) if isinstance(step, torch.Tensor) else None
            if t is None or t.numel() != 1 or t.is_complex() or t.is_meta:
                out.append(entry + _plain_value(step))
            elif t.device.type == "cpu":
                out.append(entry + repr(float(t.item())))
            else:
                on_device.setdefault(t.device, []).append((len(out), entry, t))
                out.append(entry)
    for entries in on_device.values():
        values = torch.stack([t.reshape(()).to(torch.float64) for _, _, t in entries]).cpu().tolist()
        for (at, entry, _), v in zip(entries, values):
            out[at] = entry + repr(float(v))
    return out


def _loaded_scratch(child: Optimizer, half: dict, offset: int = 0) -> Optimizer:
    """A shallow copy of ``child`` with ``half`` loaded into it; ``child`` is untouched.
    An AdamW half is checked first (:func:`_check_adamw_half`) and the loaded groups
    after (``offset``: the index of the child's first group in the hybrid's)."""
    adam = isinstance(child, torch.optim.Adam)
    if adam:
        _check_adamw_half(child, half)
    scratch = object.__new__(type(child))
    scratch.__dict__.update(child.__dict__)
    scratch.param_groups = [dict(g) for g in child.param_groups]
    scratch.state = defaultdict(dict)
    for name in _LOAD_HOOKS:
        setattr(scratch, name, OrderedDict())
    type(child).load_state_dict(scratch, half)
    if adam:
        _check_adamw_groups(scratch, offset)
    return scratch


def _adopt(child: Optimizer, scratch: Optimizer) -> None:
    """Install what a successful load put into ``scratch`` into ``child``."""
    for key, value in scratch.__dict__.items():
        if key not in _LOAD_HOOKS:
            setattr(child, key, value)


# ------------------------------------------------------- the AdamW half

_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _moment_keys(group: dict) -> tuple[str, ...]:
    return _ADAM_MOMENTS + (("max_exp_avg_sq",) if group.get("amsgrad") else ())


def _overlaps_itself(t: torch.Tensor) -> bool:
    """:func:`overlaps_itself` of ``t``'s local shard."""
    return overlaps_itself(local(t))


def _group_label(child: Optimizer, gi: int, offset: int) -> str:
    group = child.param_groups[gi]
    names = [param_name(group, gi, i) for i in range(min(3, len(group["params"])))]
    more = ", ..." if len(group["params"]) > 3 else ""
    return f"parameter group {offset + gi} ({group.get('role', 'backup')}: " + \
        ", ".join(f"'{n}'" for n in names) + more + ")"


def _scalar(value, what: str, label: str) -> float | None:
    """A hyper-parameter's value as a float (None for a tensor off the CPU: reading it
    would wait for the device); TypeError/ValueError naming ``label`` when it is not a
    real number or a one-element real tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(
                f"{label}: {what} must be a real number or a one-element real tensor, got a "
                f"{value.dtype} tensor of shape {tuple(value.shape)}"
            )
        if value.is_meta or value.device.type != "cpu":
            return None
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{label}: {what} must be a real number, got {value!r}")
    return float(value)


def _adamw_uses_foreach(group: dict, lr) -> bool:
    """Whether ``torch.optim.adam`` will run this group's foreach implementation."""
    if group.get("fused"):
        return False
    foreach = group.get("foreach")
    if foreach is None:  # torch's default: foreach for device tensors, unless lr is a tensor
        return not isinstance(lr, torch.Tensor) and any(
            local(p).device.type not in ("cpu", "meta") for p in group["params"]
        )
    return bool(foreach)


def _check_adamw_group(child: Optimizer, gi: int, offset: int) -> None:
    """The hyper-parameters of one AdamW group, as torch's constructor and step need them."""
    group = child.param_groups[gi]
    label = _group_label(child, gi, offset)
    missing = [k for k in child.defaults if k not in group]
    if missing:
        raise ValueError(f"{label}: the AdamW group lacks {', '.join(map(repr, missing))}")
    lr, betas = group["lr"], group["betas"]
    values = {"lr": _scalar(lr, "lr", label)}
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{label}: betas must be a pair of numbers, got {betas!r}")
    for i, beta in enumerate(betas):
        values[f"betas[{i}]"] = _scalar(beta, f"betas[{i}]", label)
    for key in ("eps", "weight_decay"):
        values[key] = _scalar(group[key], key, label)
    for key, v in values.items():
        if v is None:
            continue
        ok = 0.0 <= v < 1.0 if key.startswith("betas") else 0.0 <= v < float("inf")
        if not ok:
            rule = "in [0, 1)" if key.startswith("betas") else "finite and >= 0"
            raise ValueError(f"{label}: invalid {key} {v!r} (must be {rule})")
    if not group["capturable"] and _adamw_uses_foreach(group, lr):
        for what, v in (("lr", lr), ("betas[0]", betas[0]), ("betas[1]", betas[1])):
            if isinstance(v, torch.Tensor):
                raise ValueError(
                    f"{label}: {what} as a tensor is not supported with foreach=True and "
                    "capturable=False"
                )


def _check_adamw_groups(child: Optimizer, offset: int) -> None:
    for gi in range(len(child.param_groups)):
        _check_adamw_group(child, gi, offset)


def _check_adamw_state(st, p: torch.Tensor, name: str, group: dict) -> None:
    """Live AdamW state of ``p`` (non-empty): every moment a tensor of the parameter's
    shape, dtype and device that does not overlap itself, and ``step`` a one-element
    real tensor. Metadata only."""
    if not isinstance(st, dict):
        raise TypeError(f"parameter '{name}': AdamW state must be a dict, got {type(st).__name__}")
    for key in ("step",) + _moment_keys(group):
        if key not in st:
            raise ValueError(f"parameter '{name}': AdamW state lacks '{key}'")
    step = st["step"]
    if (not isinstance(step, torch.Tensor) or step.numel() != 1 or step.is_complex()
            or step.dtype == torch.bool):
        what = (f"a {step.dtype} tensor of shape {tuple(step.shape)}"
                if isinstance(step, torch.Tensor) else repr(step))
        raise TypeError(f"parameter '{name}': AdamW state 'step' must be a one-element real tensor, got {what}")
    dist = hasattr(p, "_local_tensor")
    for key in _moment_keys(group):
        t = st[key]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"parameter '{name}': AdamW state '{key}' must be a tensor, got {type(t).__name__}")
        if t.layout != torch.strided or hasattr(t, "_local_tensor") != dist:
            raise TypeError(f"parameter '{name}': AdamW state '{key}' has layout {t.layout} / "
                            f"{type(t).__name__}, the parameter {p.layout} / {type(p).__name__}")
        if t.shape != p.shape:
            raise ValueError(f"parameter '{name}': AdamW state '{key}' has shape {tuple(t.shape)}, "
                             f"the parameter {tuple(p.shape)}")
        if t.dtype != p.dtype:
            raise TypeError(f"parameter '{name}': AdamW state '{key}' has dtype {t.dtype}, "
                            f"the parameter {p.dtype}")
        if t.device != p.device:
            raise ValueError(f"parameter '{name}': AdamW state '{key}' is on {t.device}, "
                             f"the parameter on {p.device}")
        if _overlaps_itself(t):
            raise ValueError(f"parameter '{name}': AdamW state '{key}' has elements that share "
                             "memory (e.g. an expand()-ed tensor); it cannot be updated in place")


def _check_adamw_step(child: Optimizer, offset: int) -> None:
    """What ``torch.optim.AdamW.step`` would otherwise find only while mutating (after
    the Muon half was applied): bad group hyper-parameters, state that no longer fits
    its parameter (a changed dtype or shape), a parameter whose elements share memory.
    Metadata only: no per-element work and no device reads."""
    _check_adamw_groups(child, offset)
    for gi, group in enumerate(child.param_groups):
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            name = param_name(group, gi, i)
            check_no_self_overlap(local(p), name)  # (as the gefen children's step)
            st = child.state.get(p)
            if st:
                _check_adamw_state(st, p, name, group)


def _check_adamw_half(child: Optimizer, half: dict) -> None:
    """The state of an AdamW half before torch loads it (which casts moments to the
    parameter's dtype and device, so their saved values are checked here): every entry a
    dict with ``step`` (a finite number >= 0, or a one-element tensor of one) and the
    moments its group needs, each a floating-point tensor of the parameter's shape that
    does not overlap itself, on a real device, the second moments free of negative
    values. NaN and inf moments are accepted: AdamW itself produces them from a
    non-finite gradient, and torch's own load accepts them."""
    where: dict[Any, tuple[torch.Tensor, str, dict]] = {}
    for gi, (sg, g) in enumerate(zip(half["param_groups"], child.param_groups)):
        merged = dict(g)
        merged.update((k, v) for k, v in sg.items() if k != "params")
        for i, (pid, p) in enumerate(zip(sg["params"], g["params"])):
            where[pid] = (p, param_name(g, gi, i), merged)
    for pid, st in half["state"].items():
        if pid not in where:
            continue
        p, name, group = where[pid]
        if not isinstance(st, dict):
            raise ValueError(f"parameter '{name}': saved AdamW state must be a dict, got {type(st).__name__}")
        for key in ("step",) + _moment_keys(group):
            if key not in st:
                raise ValueError(f"parameter '{name}': saved AdamW state lacks '{key}'")
        step = st["step"]
        value = _scalar(step, "saved AdamW state 'step'", f"parameter '{name}'")
        if value is None:  # a device tensor: a load may read it
            value = float(step.item())
        if not 0.0 <= value < float("inf"):
            raise ValueError(f"parameter '{name}': saved AdamW state 'step' is {value!r}, "
                             "must be finite and >= 0")
        shape = p.shape
        local_shape = local(p).shape
        for key in _moment_keys(group):
            t = st[key]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"parameter '{name}': saved AdamW state '{key}' must be a tensor, "
                                f"got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"parameter '{name}': saved AdamW state '{key}' has dtype {t.dtype}, "
                                "not a floating-point dtype")
            if t.layout != torch.strided or t.is_meta:
                raise ValueError(f"parameter '{name}': saved AdamW state '{key}' must be a dense "
                                 f"tensor with data (layout {t.layout}, device {t.device})")
            if t.shape != shape and (hasattr(t, "_local_tensor") or t.shape != local_shape):
                raise ValueError(f"parameter '{name}': saved AdamW state '{key}' has shape "
                                 f"{tuple(t.shape)}, the parameter {tuple(shape)}")
            if _overlaps_itself(t):
                raise ValueError(f"parameter '{name}': saved AdamW state '{key}' has elements "
                                 "that share memory (e.g. an expand()-ed tensor)")
            if key != "exp_avg" and bool((local(t) < 0).any()):
                raise ValueError(f"parameter '{name}': saved AdamW state '{key}' has negative "
                                 "values (a second moment is never negative)")
