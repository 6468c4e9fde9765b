"""What every gefen optimizer shares: the one codebook, first-step learning, the
zero-gradient rule, and fail-before-mutation ``load_state_dict``.

Subclasses say which state a parameter has (``_new_state``, ``_check_state``) and run the
update itself (``_update``).
"""

from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch.optim import Optimizer

from ._device import DeviceTables, code_map, stream_of
from ._ext import _C
from ._layout import SCHEMA_VERSION, Slot, check_param, collect_slots, param_name, rows_cols
from ._learning import Reducer, choose_period, learn_codebook
from ._state import StateError, check_common_state


@dataclass
class StepPlan:
    """A validated step that has not mutated anything yet (see ``_prepare_step``)."""

    slots: list[Slot]
    pending: dict  # parameter -> new state, installed only after the update
    new_codebook: torch.Tensor | None
    quantizer: Any
    payload: Any = None  # the kind's prepared kernel inputs

    def state_of(self, opt: "_QuantizedOptimizer", p: torch.Tensor) -> dict:
        """The state a parameter is stepped with (new or existing)."""
        st = self.pending.get(p)
        return st if st is not None else opt.state[p]


class _QuantizedOptimizer(Optimizer):
    """Base of Gefen and GefenMuon: 8-bit block-quantised state with one shared codebook."""

    #: Written into every parameter group; checked on load.
    KIND = ""

    def __init__(self, params, defaults: dict, *, codebook_refresh_every: int):
        if isinstance(codebook_refresh_every, bool) or not isinstance(codebook_refresh_every, int):
            raise TypeError("codebook_refresh_every must be an int >= 0")
        if codebook_refresh_every < 0:
            raise ValueError(f"codebook_refresh_every must be >= 0, got {codebook_refresh_every}")
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or "
                f"dicts, but got {torch.typename(params)}"
            )
        defaults = dict(defaults, gefen_schema=SCHEMA_VERSION, gefen_kind=self.KIND)
        self.codebook_refresh_every = codebook_refresh_every
        self._codebook: torch.Tensor | None = None
        self._quantizer = None
        self._global_step = 0
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
            self._check_group(group)
            for i, p in enumerate(group["params"]):
                check_param(p, param_name(group, gi, i))
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict) -> None:
        """Raise for an invalid hyper-parameter of ``group`` (subclasses extend)."""

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _nthreads() -> int:
        return torch.get_num_threads()

    def _reducer(self, slots: list[Slot]) -> Reducer | None:
        """How phase-1 buffers are summed over ranks (None: one process)."""
        return None

    def _set_codebook(self, codebook: torch.Tensor, quantizer=None) -> None:
        """Install a codebook: one shared tensor referenced from every parameter's state."""
        if quantizer is None:
            quantizer = _C.Quantizer(codebook)
        if self._codebook is None:
            self._codebook = codebook.clone()
        else:
            self._codebook.copy_(codebook)
        self._quantizer = quantizer
        for st in self.state.values():
            if "codebook" in st:
                st["codebook"] = self._codebook

    @staticmethod
    def _all_zero_lr_and_grads(param_groups, slots: list[Slot]) -> bool:
        """ALGORITHM.md §5: lr == 0 everywhere and every gradient exactly zero."""
        for group in param_groups:
            lr = group["lr"]
            if float(lr) != 0.0:
                return False
        return all(not bool(s.grad.any()) for s in slots)

    # ------------------------------------------------------------ first step

    def _plan_first_steps(self, slots: list[Slot]) -> dict[torch.Tensor, dict]:
        """New state (not yet installed) for every parameter stepped for the first time."""
        pending = {}
        reduce = self._reducer(slots)
        for s in slots:
            if s.param in self.state and self.state[s.param]:
                continue
            period = choose_period(
                s.name, s.grad, s.param.shape, self._period_mode(s.group), self._nthreads(), reduce
            )
            pending[s.param] = self._new_state(s.param, period, s.group)
        return pending

    def _period_mode(self, group: dict) -> str:
        return "auto"

    def _learn_codebook(self, slots: list[Slot], pending: dict) -> torch.Tensor:
        items = []
        for s in slots:
            st = pending[s.param] if s.param in pending else self.state[s.param]
            items.append((s.name, s.grad, st["period"]))
        return learn_codebook(items, self._nthreads(), self._reducer(slots))

    def _refresh_due(self) -> bool:
        n = self.codebook_refresh_every
        t = self._global_step + 1
        return n > 0 and self._codebook is not None and t > 1 and (t - 1) % n == 0

    # ------------------------------------------------------------ step

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
        plan = self._prepare_step()
        if plan is not None:
            self._apply_step(plan)
        return loss

    def _prepare_step(self) -> StepPlan | None:
        """Everything a step does before its first mutation: check every gradient, group
        and kernel input, choose the periods of new parameters and learn the codebook
        when due. Returns None when the step has nothing to do (no gradients, or the
        zero-gradient/zero-lr step of ALGORITHM.md §5). Mutates nothing."""
        slots = collect_slots(self.param_groups)
        if not slots or self._all_zero_lr_and_grads(self.param_groups, slots):
            return None
        for group in self.param_groups:
            self._check_group(group)
        self._check_step_inputs(slots)
        pending = self._plan_first_steps(slots)
        new_codebook = None
        if self._codebook is None or self._refresh_due():
            new_codebook = self._learn_codebook(slots, pending)
        plan = StepPlan(slots, pending, new_codebook, self._quantizer_for(new_codebook))
        self._prepare_update(plan)
        return plan

    def _apply_step(self, plan: StepPlan) -> None:
        """Run a prepared step: remap codes when the codebook was relearned, update,
        then install new state and count the step."""
        if plan.new_codebook is not None:
            self._remap_codes(plan.quantizer)
        self._run_update(plan)
        for s in plan.slots:
            plan.state_of(self, s.param)["step"] += 1
        self._install(plan.pending, plan.new_codebook, plan.quantizer)

    def _check_step_inputs(self, slots: list[Slot]) -> None:
        """Kind-specific checks that must pass before anything is learned or mutated."""

    def _install(self, pending: dict, new_codebook: torch.Tensor | None, quantizer) -> None:
        """After a successful update: install new state and the codebook, count the step."""
        if new_codebook is not None:
            self._set_codebook(new_codebook, quantizer)
        for p, st in pending.items():
            st["codebook"] = self._codebook
            self.state[p] = st
        self._global_step += 1
        for st in self.state.values():
            if "global_step" in st:
                st["global_step"] = self._global_step

    def _quantizer_for(self, new_codebook: torch.Tensor | None):
        """The quantiser this step requantises with (the new one when learning)."""
        if new_codebook is not None:
            return _C.Quantizer(new_codebook)
        return self._quantizer

    def _remap_codes(self, new_quantizer) -> None:
        """Codebook refresh: re-express every stored code in the new codebook."""
        if self._quantizer is None:
            return
        table = self._quantizer.remap_table(new_quantizer)
        maps = {}
        for st in self.state.values():
            if "codes" in st:
                codes = st["codes"]
                if codes.device not in maps:
                    maps[codes.device] = code_map(table, codes.device)
                _C.codes_remap(codes, maps[codes.device], self._nthreads(), stream_of(codes.device))

    def _device_table(self, quantizer, device: torch.device):
        """The quantiser's lookup table on ``device`` (None on the CPU), cached."""
        if device.type == "cpu":
            return None
        tables = self.__dict__.get("_tables")
        if tables is None or tables.quantizer is not quantizer:
            tables = self._tables = DeviceTables(quantizer)
        return tables.get(device)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The standard ``torch.optim`` state dict: ``state`` keyed by parameter index and
        ``param_groups``. Each parameter's state holds its period and representation as
        ints, its step, the optimizer's global step and the shared codebook tensor.
        Parameters that have never been stepped have no entry (also when something, such
        as DCP's state-dict helpers, created an empty one by looking them up)."""
        sd = super().state_dict()
        sd["state"] = {k: v for k, v in sd["state"].items() if v}
        return sd

    #: Attributes beyond torch.optim's that pickling and deepcopy must keep.
    _PICKLED = ("codebook_refresh_every", "_codebook", "_global_step")

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict produced by :meth:`state_dict`.

        Everything is validated first (schema, kind, group sizes, keys, shapes, dtypes,
        finite non-negative moments, a valid codebook shared by all parameters, one global
        step); on any error a ``ValueError`` names the parameter and the optimizer is left
        exactly as it was. Hyper-parameters are restored from the saved groups, as
        ``torch.optim`` does. Tensors keep their dtype (state stays float32) and move to
        the parameter's device.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("a state dict needs 'state' and 'param_groups'")
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer {len(groups)}"
            )
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"parameter group {gi}: the loaded state dict has {len(sg['params'])} "
                    f"parameters, the optimizer {len(g['params'])}"
                )
            schema = sg.get("gefen_schema")
            if schema != SCHEMA_VERSION:
                raise ValueError(
                    f"parameter group {gi}: state-dict schema version {schema!r} is not "
                    f"supported (this gefen reads version {SCHEMA_VERSION})"
                )
            if sg.get("gefen_kind") != self.KIND:
                raise ValueError(
                    f"parameter group {gi}: the state dict is from optimizer kind "
                    f"{sg.get('gefen_kind')!r}, not {self.KIND!r}"
                )
            merged = dict(sg, params=g["params"])
            self._check_group(merged)
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in groups),
            )
        )
        where = {}
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            for i, pid in enumerate(sg["params"]):
                where[pid] = (gi, i, g, sg)
        new_state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        codebook = None
        global_step = None
        for pid, st in state_dict["state"].items():
            if isinstance(st, dict) and not st:
                continue  # a parameter that was never stepped
            if pid not in id_map:
                raise ValueError(f"loaded state refers to parameter id {pid!r}, which no group holds")
            p = id_map[pid]
            gi, i, group, saved_group = where[pid]
            name = param_name(group, gi, i)
            try:
                check_common_state(st, p, name)
                self._check_state(st, p, name, saved_group)
            except StateError as exc:
                raise ValueError(str(exc)) from None
            if codebook is None:
                codebook = st["codebook"]
                try:
                    _C.codebook_validate(codebook.detach().cpu().contiguous())
                except ValueError as exc:
                    raise ValueError(f"parameter '{name}': state 'codebook' is invalid: {exc}") from None
                global_step = int(st["global_step"])
            else:
                if not torch.equal(st["codebook"].cpu(), codebook.cpu()):
                    raise ValueError(
                        f"parameter '{name}': state 'codebook' differs from the other parameters' "
                        "(an optimizer has one codebook)"
                    )
                if int(st["global_step"]) != global_step:
                    raise ValueError(
                        f"parameter '{name}': state 'global_step' {int(st['global_step'])} differs "
                        f"from the other parameters' ({global_step})"
                    )
            new_state[p] = {
                k: (v.detach().to(device=p.device, copy=True) if isinstance(v, torch.Tensor) else int(v))
                for k, v in st.items()
            }
        # Everything is valid: install.
        shared = codebook.detach().to(torch.float32).cpu().clone() if codebook is not None else None
        for st in new_state.values():
            st["codebook"] = shared
        param_groups = []
        for g, sg in zip(groups, saved_groups):
            sg["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                sg["param_names"] = g["param_names"]
            param_groups.append(sg)
        self.__setstate__({"state": new_state, "param_groups": param_groups})
        self._codebook = shared
        self._quantizer = _C.Quantizer(shared) if shared is not None else None
        self._global_step = global_step or 0
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ------------------------------------------------------------ subclass API

    def _new_state(self, p: torch.Tensor, period: int, group: dict) -> dict:
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


def block_state(p: torch.Tensor, period: int) -> dict:
    """Codes and block magnitudes (zero momentum) for a parameter with this period."""
    rows, cols = rows_cols(p.shape)
    nblocks = cols // period if cols else 0
    return {
        "step": 0,
        "global_step": 0,
        "period": int(period),
        "codes": torch.zeros(p.shape, dtype=torch.uint8, device=p.device),
        "magnitude": torch.zeros((rows, nblocks), dtype=torch.float32, device=p.device),
    }
