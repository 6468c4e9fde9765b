"""What every gefen optimizer shares: the one codebook, first-step learning, the
zero-gradient rule, the step's agreement across ranks, and fail-before-mutation
``load_state_dict``.

A step is *prepare* (every check, the agreement collective, first-step learning, the C
plans: nothing is mutated) then *apply* (the kernels, then the new state is installed).
Subclasses say which state a parameter has (``_new_state``, ``_check_state``) and run
the update itself (``_prepare_update``, ``_run_update``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer

from . import _checkpoint
from ._comm import FLAG_ANY_GRAD, FLAG_ANY_LR, FLAG_NO_KEEP, Comm
from ._device import DeviceTables, code_map, stream_of
from ._ext import _C
from ._layout import (
    SCHEMA_VERSION,
    as_float,
    canonical_name,
    check_grad,
    check_no_self_overlap,
    check_param,
    param_name,
    rows_cols,
)
from ._learning import choose_periods, learn_codebook
from ._views import (
    ParamView,
    check_disjoint,
    layout_of,
    layout_text,
    local,
    make_replicated,
    make_row_state,
    make_view,
    place,
)


@dataclass
class StepPlan:
    """A validated step that has not mutated anything yet (see ``_prepare_step``)."""

    views: list[ParamView]  # every parameter stepped (it has a gradient)
    params: list[torch.Tensor]  # every parameter of the optimizer (decides the group)
    lrs: dict[int, float]  # id(group) -> the group's lr, read once this step
    pending: dict = field(default_factory=dict)  # key -> new state, installed after the update
    new_codebook: torch.Tensor | None = None
    quantizer: Any = None
    new_codes: dict = field(default_factory=dict)  # key -> codes re-expressed in the new codebook
    payload: Any = None  # the kind's prepared kernel inputs
    keep: bool = False  # every rank can keep this step's plan for the next steps (agreed)

    def state_of(self, opt: "_QuantizedOptimizer", key: torch.Tensor) -> dict:
        """The state a parameter is stepped with (new or existing)."""
        if self.pending:  # empty on most steps: no lookup (a tensor key hashes in Python)
            st = self.pending.get(key)
            if st is not None:
                return st
        return opt.state[key]

    def codes_of(self, opt: "_QuantizedOptimizer", key: torch.Tensor, st: dict | None = None) -> torch.Tensor:
        """The local codes the update writes (a re-expressed copy on refresh steps);
        ``st``: the parameter's :meth:`state_of`, when the caller has it already."""
        codes = self.new_codes.get(key) if self.new_codes else None
        if codes is not None:
            return codes
        return local((st if st is not None else self.state_of(opt, key))["codes"])

    def lr(self, group: dict) -> float:
        return self.lrs[id(group)]


#: The decorator of every kind's ``step``: under torch.compile the step runs eagerly, a
#: graph break in a compiled training step. Traced by Dynamo, the Python around the C
#: calls lost the optimizer's own attribute writes (the learned codebook and quantiser,
#: the kept plan), so the next step learned a codebook again and the numbers differed
#: from eager steps (tests/test_compile.py). What it would compile is a C call (and
#: GefenMuon's Newton-Schulz products, which keep their eager numbers).
eager_under_compile = torch.compiler.disable(
    reason="a gefen optimizer's step runs eagerly (one C call): compile the model, and "
    "leave the step out of a fullgraph=True region"
)


class _QuantizedOptimizer(Optimizer):
    """Base of Gefen and GefenMuon: 8-bit block-quantised state with one shared codebook."""

    #: Written into every parameter group; checked on load.
    KIND = ""

    def __init__(self, params, defaults: dict, *, codebook_refresh_every: int):
        check_refresh_every(codebook_refresh_every)
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or "
                f"dicts, but got {torch.typename(params)}"
            )
        defaults = dict(defaults, gefen_schema=SCHEMA_VERSION, gefen_kind=self.KIND)
        defaults[_checkpoint.STATE_COUNT] = 0
        self.codebook_refresh_every = codebook_refresh_every
        self._codebook: torch.Tensor | None = None
        self._codebook_copies: dict = {}
        self._quantizer = None
        self._global_step = 0
        self._prepared = False  # gefen.dcp.prepare_load allocated state not yet loaded
        self._comm = Comm()
        self._header_cache: dict = {}
        super().__init__(params, defaults)

    # ------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (as ``torch.optim``), validating its parameters and
        hyper-parameters."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        try:
            group["gefen_schema"] = SCHEMA_VERSION
            group["gefen_kind"] = self.KIND
            group[_checkpoint.STATE_COUNT] = 0
            self._check_group(group)
            for i, p in enumerate(group["params"]):
                check_param(p, param_name(group, gi, i))
                layout_of(p, param_name(group, gi, i))  # unsupported placements raise now
        except Exception:
            self.param_groups.pop()
            raise
        self.__dict__.setdefault("_header_cache", {}).clear()
        self.__dict__.setdefault("_layout_cache", {}).clear()
        self.__dict__.pop("_steady", None)  # (a kept plan would notice; this frees it now)

    def _check_group(self, group: dict) -> None:
        """Raise for an invalid hyper-parameter of ``group`` (subclasses extend)."""

    def contract(self):
        """The frozen, versioned description of this optimizer's state and checkpoint
        transitions (:class:`gefen.contract.Contract`)."""
        from .contract import contract_for

        return contract_for(self.KIND, SCHEMA_VERSION)

    @property
    def comm_stats(self):
        """Collectives this optimizer issued: ``collectives``/``bytes`` of the last step
        and running totals (all zero for an optimizer of plain tensors)."""
        return self._comm.stats

    # ------------------------------------------------------------ rebinding

    def rebind(self, model: torch.nn.Module) -> None:
        """Point the optimizer at ``model``'s current parameters, matched by fully
        qualified name: for an optimizer built from ``model.named_parameters()`` before
        ``fully_shard(model)`` replaced them with DTensors.

        Only before the first step (and before any state is loaded). Every name must
        exist in the model with the same global shape; on any error nothing changes.
        Under sharding every rank calls it (one agreement collective over the model's
        mesh): an error on one rank is raised on every rank (docs/distributed.md).
        """
        (new_params,) = agreed_rebind_plans([self], model, self._comm)
        install_rebind(self, new_params)
        self.__dict__.pop("_steady", None)
        self._header_cache = {}
        self._layout_cache = {}
        self._codebook_copies = {}

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _nthreads() -> int:
        return torch.get_num_threads()

    def _views(self) -> list[ParamView]:
        """A view of every parameter with at least one element (global), in group order.
        Layouts (placements, shard groups, row ranges) are computed once per parameter."""
        placements = self.__dict__.setdefault("_layout_cache", {})
        views = []
        seen = set()
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                pl = placements.get(p)
                if pl is None:
                    pl = placements[p] = place(p, param_name(group, gi, i))
                elif id(p) in seen:  # listed twice: this entry's own name (for the error)
                    pl = dataclasses.replace(pl, name=param_name(group, gi, i))
                seen.add(id(p))
                if pl.rows * pl.cols == 0:
                    continue  # nothing to update, no state
                views.append(make_view(p, pl.name, group, gi, i, pl))
        return views

    def _header(self, lrs: dict[int, float]) -> list[str]:
        """What every rank must agree on before acting (DESIGN.md §4): the parameter
        list (names, global shapes, dtypes, placements), each group's hyper-parameters,
        which parameters have gradients and state (and each one's step counter), the
        codebook, the global step and the optimizer-level options that change a step's
        collectives or numbers (``codebook_refresh_every``: when the codebook is relearned;
        Gefen's ``deterministic`` changes nothing and is not compared)."""
        cache = self.__dict__.setdefault("_header_cache", {})
        out = [f"{self.KIND}|global_step={self._global_step}|codebook={self._codebook is not None}"
               f"|codebook_refresh_every={self.codebook_refresh_every!r}"]
        for gi, group in enumerate(self.param_groups):
            out.append(f"group{gi}|lr={lrs.get(id(group))!r}|{self._group_header(group)}")
            for i, p in enumerate(group["params"]):
                static = cache.get(p)
                if static is None:
                    static = cache[p] = (
                        f"{param_name(group, gi, i)}|{tuple(p.shape)}|{p.dtype}|{layout_text(p)}"
                    )
                st = self.state.get(p)
                step = st.get("step") if st else None
                out.append(f"{static}|grad={p.grad is not None}|state={bool(st)}|step={step!r}")
        return out

    def _group_header(self, group: dict) -> str:
        """The hyper-parameters of a group that every rank must share (lr aside)."""
        return "|".join(
            f"{k}={v!r}" for k, v in sorted(group.items()) if k not in ("params", "param_names", "lr")
        )

    def _read_lrs(self) -> dict[int, float]:
        """Each group's learning rate as a float: one read (one host sync for a tensor
        lr) per group per step."""
        return {id(g): as_float(g["lr"], "lr") for g in self.param_groups}

    def _codebook_on(self, view: ParamView) -> torch.Tensor:
        """The replicated copy of the codebook that lives with ``view``'s state: on the
        parameter's device and, for a DTensor, replicated on its mesh. One tensor per
        (mesh, device), shared by every parameter there; updated in place."""
        device = view.param.device
        key = (id(view.layout.mesh) if view.layout.distributed else None, device)
        copies = self.__dict__.setdefault("_codebook_copies", {})
        copy = copies.get(key)
        if copy is None:
            if key == (None, torch.device("cpu")):
                copy = self._codebook
            else:
                copy = make_replicated(view, self._codebook.to(device, copy=True))
            copies[key] = copy
        return copy

    def _set_codebook(self, codebook: torch.Tensor, quantizer=None) -> None:
        """Install a codebook: one authoritative CPU tensor, copied in place into every
        device/mesh copy the state references."""
        if quantizer is None:
            quantizer = _C.Quantizer(codebook)
        if self._codebook is None:
            self._codebook = codebook.clone()
        else:
            self._codebook.copy_(codebook)
            for copy in self.__dict__.get("_codebook_copies", {}).values():
                if copy is not self._codebook:
                    local(copy).copy_(self._codebook)
        self._quantizer = quantizer

    # ------------------------------------------------------------ first step

    def _period_mode(self, group: dict) -> str:
        return "auto"

    def _refresh_due(self) -> bool:
        n = self.codebook_refresh_every
        t = self._global_step + 1
        return n > 0 and self._codebook is not None and t > 1 and (t - 1) % n == 0

    def _learn(self, plan: StepPlan) -> None:
        """First-step learning (collectives when sharded): periods of the parameters
        stepped for the first time, then the codebook when it is due; codes are
        re-expressed (into copies) when the codebook is relearned."""
        new = [v for v in plan.views if not self.state.get(v.key)]
        if new:
            periods = choose_periods(
                new, [self._period_mode(v.group) for v in new], self._nthreads(), self._comm,
                plan.params,
            )
            for v, period in zip(new, periods):
                plan.pending[v.key] = self._new_state(v, period)
        if self._codebook is None or self._refresh_due():
            items = [(v, int(plan.state_of(self, v.key)["period"])) for v in plan.views]
            plan.new_codebook = learn_codebook(items, self._nthreads(), self._comm, plan.params)
            plan.quantizer = _C.Quantizer(plan.new_codebook)
            if self._quantizer is not None:
                self._remap_into_copies(plan)
        else:
            plan.quantizer = self._quantizer

    def _remap_into_copies(self, plan: StepPlan) -> None:
        """Codebook refresh: each stored code re-expressed as the nearest code of the new
        codebook, into a copy that the update writes and that is installed only with a
        successful update (the live codes never disagree with the live codebook)."""
        table = self._quantizer.remap_table(plan.quantizer)
        maps = {}
        for key, st in self.state.items():
            if "codes" not in st:
                continue
            codes = local(st["codes"]).clone()
            if codes.device not in maps:
                maps[codes.device] = code_map(table, codes.device)
            _C.codes_remap(codes, maps[codes.device], self._nthreads(), stream_of(codes.device))
            plan.new_codes[key] = codes

    # ------------------------------------------------------------ step

    @eager_under_compile
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step.

        Args:
            closure (Callable, optional): re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._comm.stats.reset_step()  # (a kept plan's agreement counts in this step)
        if self._steady_step():
            return loss
        plan = self._prepare_step()
        if plan is not None:
            self._apply_step(plan)
            self._keep_steady(plan)
        return loss

    def _steady_step(self) -> bool:
        """Kinds that keep a step's plan for the next steps run it here (True: stepped);
        the base keeps none."""
        return False

    def _keep_steady(self, plan: StepPlan) -> None:
        """After a full step that succeeded: a kind may keep its plan when ``plan.keep``
        (every rank can); the base keeps none."""

    def _can_keep(self, plan: StepPlan) -> bool:
        """Whether this rank could keep the prepared ``plan`` for the next steps (its
        verdict joins the step's agreement, so that every rank keeps a plan or none)."""
        return False

    def _local_checks(self) -> tuple[list[ParamView], dict[int, float]]:
        """Every check this rank can make alone: layouts, gradients, groups and the
        kind's own; raises on the first problem."""
        if self.__dict__.get("_prepared"):
            raise RuntimeError(
                "gefen.dcp.prepare_load() allocated this optimizer's state for a checkpoint "
                "that has not been loaded yet; load it (dcp.load / set_state_dict / "
                "load_state_dict) before stepping"
            )
        check_refresh_every(self.codebook_refresh_every)  # (an attribute a user may set)
        lrs = self._read_lrs()
        for group in self.param_groups:  # with the lr just read (a tensor lr: one read)
            self._check_group(dict(group, lr=lrs[id(group)]))
        all_views = self._views()
        for v in all_views:
            if v.grad is not None:
                check_grad(v.param, v.grad, v.name)
                check_no_self_overlap(v.param, v.name)
        stepped = [v for v in all_views if v.grad is not None]
        self._check_step_inputs(stepped)
        self._check_disjoint(stepped)
        return all_views, lrs

    def _check_disjoint(self, views: list[ParamView]) -> None:
        """No parameter listed twice and no two stepped parameters overlapping in memory
        (the update would be applied twice to the shared elements; Gefen's C plan sees
        only contiguous parameters, so non-contiguous views are checked here). Checked
        once per memory layout of the stepped parameters: a step whose parameters sit
        where they sat at the last successful check costs one tuple comparison."""
        signature = tuple(
            (v.param.device, v.param.data_ptr(), v.param.shape, v.param.stride(), v.param.element_size())
            for v in views
        )
        if self.__dict__.get("_disjoint_signature") == signature:
            return
        check_disjoint(views)
        self._disjoint_signature = signature

    def _prepare_step(self, outside_error: BaseException | None = None,
                      outside_header: Sequence[str] = ()) -> StepPlan | None:
        """Everything a step does before its first mutation: check every gradient, group
        and kernel input, agree with the other ranks, choose the periods of new
        parameters and learn the codebook when due. Returns None when the step has
        nothing to do (no gradients, or the zero-gradient/zero-lr step of ALGORITHM.md
        §5). Mutates nothing; on any error every rank raises (``outside_error``: a
        failed check of a composite's other part, agreed here; ``outside_header``: that
        part's header, compared with this step's). The caller starts the step's
        collective counts (``comm_stats``)."""
        error: BaseException | None = outside_error
        all_views: list[ParamView] = []
        lrs: dict[int, float] = {}
        try:
            all_views, lrs = self._local_checks()
        except Exception as exc:  # agreed below: every rank raises
            error = error or exc
        views = [v for v in all_views if v.grad is not None]
        params = [p for g in self.param_groups for p in g["params"]]
        plan = StepPlan(views, params, lrs)
        flags = [0, 0, 0, 1]  # FLAG_NO_KEEP: set unless this rank can keep the plan
        if error is None:
            flags[FLAG_ANY_LR] = int(any(lr != 0.0 for lr in lrs.values()))
            if not flags[FLAG_ANY_LR]:  # only then do zero gradients matter (§5)
                flags[FLAG_ANY_GRAD] = int(any(bool(v.grad.any()) for v in views))
        learning = error is None and (
            self._codebook is None or self._refresh_due() or any(not self.state.get(v.key) for v in views)
        )
        # what the ranks compare; a step with no DTensor parameter has no one to agree with
        header = self._header(lrs) + list(outside_header) if self._comm.distributed(params) else []
        if learning or error is not None:
            flags = self._comm.agree(params, header, flags, error)
            if not self._has_work(views, flags):
                return None
            self._learn(plan)
            try:
                self._prepare_update(plan)
            except Exception as exc:
                error = exc
            self._comm.agree(params, header, flags, error)
            return plan
        try:
            if views:
                plan.quantizer = self._quantizer
                self._prepare_update(plan)
                flags[FLAG_NO_KEEP] = int(not self._can_keep(plan))
        except Exception as exc:
            error = exc
        flags = self._comm.agree(params, header, flags, error)
        plan.keep = not flags[FLAG_NO_KEEP]
        return plan if self._has_work(views, flags) else None

    @staticmethod
    def _has_work(views: list[ParamView], flags: list[int]) -> bool:
        """Some parameter has a gradient, and the step is not the zero step of §5."""
        return bool(views) and bool(flags[FLAG_ANY_LR] or flags[FLAG_ANY_GRAD])

    def _apply_step(self, plan: StepPlan) -> None:
        """Run a prepared step, then install new state (and the new codebook and codes
        when it was relearned) and count the step."""
        self._run_update(plan)
        for v in plan.views:
            plan.state_of(self, v.key)["step"] += 1
        self._install(plan)

    def _check_step_inputs(self, views: list[ParamView]) -> None:
        """Kind-specific checks that must pass before anything is learned or mutated."""

    def _install(self, plan: StepPlan) -> None:
        """After a successful update: install new state, codes and the codebook, count
        the step."""
        if plan.new_codebook is not None:
            self._set_codebook(plan.new_codebook, plan.quantizer)
        for key, codes in plan.new_codes.items():
            local(self.state[key]["codes"]).copy_(codes)
        if plan.pending:
            for v in plan.views:
                st = plan.pending.get(v.key)
                if st is not None:
                    st["codebook"] = self._codebook_on(v)
                    self.state[v.key] = st
            _checkpoint.update_state_counts(self)  # (they change only here and on loads)
        self._count_global_step()

    def _count_global_step(self) -> None:
        """One more step of the optimizer, written into every state that records it."""
        self._global_step += 1
        for st in self.state.values():
            if "global_step" in st:
                st["global_step"] = self._global_step

    def _device_table(self, quantizer, device: torch.device):
        """The quantiser's lookup table on ``device`` (None on the CPU), cached."""
        if device.type == "cpu":
            return None
        tables = self.__dict__.get("_tables")
        if tables is None or tables.quantizer is not quantizer:
            tables = self._tables = DeviceTables(quantizer)
        return tables.get(device)

    # ------------------------------------------------------------ checkpoints

    #: Options of the live optimizer a load keeps (the rest come from the checkpoint).
    _LIVE_OPTIONS: tuple[str, ...] = ()

    def state_dict(self) -> dict[str, Any]:
        """The standard ``torch.optim`` state dict: ``state`` keyed by parameter index and
        ``param_groups``. Each parameter's state holds *copies* of its tensors (DTensors
        for DTensor parameters, laid out on the parameter's grid), its period and
        representation as ints, its step, the optimizer's global step, the shared
        codebook and integrity digests. Parameters that have never been stepped have no
        entry."""
        return _checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict produced by :meth:`state_dict` (also reassembled by
        ``torch.distributed.checkpoint`` on any topology).

        Validate → agree → convert → install. Everything is validated first (schema,
        kind, group sizes, keys, shapes, dtypes, no negative moments (NaN and +inf,
        which a step with a non-finite gradient writes, load back), a valid codebook shared by all parameters, one global step, every rank's rows against
        their digests, no state dropped on the way); every rank then agrees, on the live
        optimizer and on the incoming state's replicated parts (codebook, global step,
        saved hyper-parameters, each parameter's counters and form, replicated tensors:
        ranks that load different checkpoints raise ``RankDivergenceError`` naming what
        differs), and on any error every rank raises the same ``ValueError`` naming the
        parameter, leaving the optimizer exactly as it was. Hyper-parameters are restored
        from the saved groups as ``torch.optim`` does, except the options that choose the representation
        (Gefen's ``factored``, GefenMuon's ``sharded_mode``), which stay the live ones:
        block and factored state are converted (COMPATIBILITY.md).
        """
        params = [p for g in self.param_groups for p in g["params"]]
        checked, error = None, None
        header: list[str] = []  # (one process: no one to compare with)
        try:
            checked = self._validate_load(state_dict)
            if self._comm.distributed(params):
                header = self._load_agreement(checked)
        except Exception as exc:  # agreed: every rank raises
            error = exc
        agree_on_load(self._comm, params, header, error)
        self._install_load(checked)

    def _load_agreement(self, checked: dict) -> list[str]:
        """What a load's agreement compares: the live optimizer (:meth:`_load_header`) and
        the incoming state's replicated parts (:func:`_checkpoint.incoming_agreement` of
        what :meth:`_validate_load` returned; a rank whose validation failed builds none:
        the error flag is read first)."""
        return self._load_header() + _checkpoint.incoming_agreement(checked)

    def _validate_load(self, state_dict: dict[str, Any]) -> dict:
        """The load's pre-hooks and every local check (mutates nothing)."""
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        state_dict = _checkpoint.run_hooks(self._optimizer_load_state_dict_pre_hooks, self, state_dict)
        return _checkpoint.validate(self, state_dict)

    def _install_load(self, checked: dict) -> None:
        """Convert and install a validated (and agreed) load; run the post-hooks."""
        self.__dict__.pop("_steady", None)  # it holds the old state
        _checkpoint.install(self, checked, self._convert_loaded)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_header(self) -> list[str]:
        """What ranks must agree on before a load installs: the parameter list."""
        return self._header(self._read_lrs_safely())

    def _read_lrs_safely(self) -> dict[int, float]:
        try:
            return self._read_lrs()
        except Exception:
            return {}

    def _convert_loaded(self, view: ParamView, st: dict, saved_group: dict) -> dict:
        """A loaded state (local parts) in the live representation (kinds override)."""
        return st

    # ------------------------------------------------------------ pickling

    #: Attributes beyond torch.optim's that pickling and deepcopy must keep.
    _PICKLED = ("codebook_refresh_every", "_codebook", "_global_step", "_comm")

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in self._PICKLED:
            state[name] = getattr(self, name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # the quantiser is a C object: rebuilt from the codebook, never pickled
        codebook = getattr(self, "_codebook", None)
        self._quantizer = _C.Quantizer(codebook) if codebook is not None else None
        if "_comm" not in self.__dict__:
            self._comm = Comm()
        self._header_cache = {}
        self._layout_cache = {}
        self._codebook_copies = {}
        if codebook is not None:  # state references the codebook: re-share it
            self._codebook_copies[(None, torch.device("cpu"))] = codebook
            for st in self.state.values():
                cb = st.get("codebook") if isinstance(st, dict) else None
                if isinstance(cb, torch.Tensor) and not hasattr(cb, "device_mesh") and cb.device.type == "cpu":
                    st["codebook"] = codebook

    # ------------------------------------------------------------ subclass API

    def _new_state(self, view: ParamView, period: int) -> dict:
        raise NotImplementedError

    def _check_state(self, st: dict, p: torch.Tensor, name: str, group: dict) -> None:
        raise NotImplementedError

    def _prepare_update(self, plan: StepPlan) -> None:
        """Build and validate the kernel inputs of a step into ``plan.payload``;
        raise on any problem, mutating nothing."""
        raise NotImplementedError

    def _run_update(self, plan: StepPlan) -> None:
        """The update itself (kernels, parameter writes)."""
        raise NotImplementedError


def block_state(view: ParamView, period: int) -> dict:
    """Codes and block magnitudes (zero momentum) for a parameter with this period:
    local rows allocated, laid out on the parameter's global grid."""
    rows, cols = rows_cols(view.shape)
    nblocks = cols // period if cols else 0
    lrows = view.local_rows
    dev = view.param.device
    return {
        "step": 0,
        "global_step": 0,
        "period": int(period),
        "codes": make_row_state(view, torch.zeros(view.param.shape, dtype=torch.uint8, device=dev), view.shape),
        "magnitude": make_row_state(
            view, torch.zeros((lrows, nblocks), dtype=torch.float32, device=dev), (rows, nblocks)
        ),
    }


def row_vector(view: ParamView) -> torch.Tensor:
    """A float32 vector of one value per global row (local rows allocated)."""
    return make_row_state(
        view, torch.zeros(view.local_rows, dtype=torch.float32, device=view.param.device), (view.rows,)
    )


def rebind_plan(opt: Optimizer, model: torch.nn.Module, has_state: bool) -> list[list[torch.Tensor]]:
    """The parameters ``opt``'s groups would hold after :meth:`rebind` (validated; nothing
    changes): each group's ``param_names`` looked up in ``model.named_parameters()``."""
    if has_state:
        raise RuntimeError(
            "rebind() is only allowed before the optimizer's first step (it has state); "
            "build the optimizer after fully_shard(model), or rebind before stepping"
        )
    # by name modulo the wrappers' components: an optimizer built before torch.compile or
    # activation checkpointing rebinds to the wrapped model's parameters
    named = {canonical_name(n): p for n, p in model.named_parameters()}
    out = []
    for gi, group in enumerate(opt.param_groups):
        names = group.get("param_names")
        if names is None or len(names) != len(group["params"]):
            raise ValueError(
                f"rebind() needs parameter names: parameter group {gi} was not built from "
                "model.named_parameters()"
            )
        params = []
        for name, old in zip(names, group["params"]):
            new = named.get(canonical_name(name))
            if new is None:
                raise ValueError(f"rebind(): parameter '{name}' is not a parameter of the model")
            if tuple(new.shape) != tuple(old.shape):
                raise ValueError(
                    f"rebind(): parameter '{name}' has shape {tuple(new.shape)} in the model but "
                    f"{tuple(old.shape)} in the optimizer"
                )
            check_param(new, name)
            layout_of(new, name)
            params.append(new)
        out.append(params)
    return out


def agreed_rebind_plans(opts: Sequence[Optimizer], model: torch.nn.Module, comm: Comm) -> list:
    """:func:`rebind_plan` of each of ``opts`` (nothing changes), agreed over the ranks of
    the model's meshes when it is sharded: a rank's error (a name its model lacks, another
    shape, state already there) is raised on every rank, and ranks whose optimizers name
    other parameters raise ``RankDivergenceError`` together; without it the failing rank
    raised alone and the others waited for it in their first step's agreement."""
    plans, error = [], None
    try:
        for opt in opts:
            has_state = bool(getattr(opt, "_global_step", 0) or any(opt.state.values()))
            plans.append(rebind_plan(opt, model, has_state))
    except Exception as exc:  # into the one agreement below
        error = exc
    header = ["rebind"] + [
        f"{name}|{tuple(p.shape)}" for opt in opts for g in opt.param_groups
        for name, p in zip(g.get("param_names") or (), g["params"])]
    comm.agree_without_flags(list(model.parameters()), header, error)
    return plans


def install_rebind(opt: Optimizer, new_params: list[list[torch.Tensor]]) -> None:
    """Install what :func:`rebind_plan` returned."""
    for group, params in zip(opt.param_groups, new_params):
        group["params"] = params
    opt.state = defaultdict(dict)


def check_refresh_every(n) -> None:
    """``codebook_refresh_every`` is an int >= 0 (checked at construction and, as an
    attribute a user may change, by every step)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"codebook_refresh_every must be an int >= 0, got {n!r}")
    if n < 0:
        raise ValueError(f"codebook_refresh_every must be >= 0, got {n}")


def agree_on_load(comm, params: list, header: list[str], error: BaseException | None) -> None:
    """A load's one agreement (``comm.agree``): every rank raises the same error, or
    none does. A divergence in the incoming state (entries of
    :func:`_checkpoint.incoming_agreement`) says that the ranks load different
    checkpoints."""
    from ._comm import RankDivergenceError  # (a name of this function only)

    try:
        comm.agree_without_flags(params, header, error)
    except RankDivergenceError as exc:  # (the same message on every rank)
        if _checkpoint.LOADED not in str(exc):
            raise
        raise RankDivergenceError(
            f"{exc}; the ranks are loading different optimizer state: every rank must load "
            "the same checkpoint"
        ) from None
