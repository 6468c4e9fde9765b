"""Gefen's steady step: the C plans of a CPU step kept for the next steps.

A step builds named items for every parameter and the extension parses them (about
twenty fields and five tensors each) into C plans; on a model's many small tensors that
costs more than the update itself. When nothing but the gradients, the step counters and
the hyper-parameters changes from one step to the next -- the usual case after the first
steps -- the plans of the last step can run again. :class:`SteadyStep` keeps them and,
before each step, checks cheaply that they still describe the optimizer: the same
parameter objects in the same groups, the same parameters with gradients (of the
parameter's placements, for a DTensor), the same state dicts holding the same objects
(tensors, period and form: an entry the user replaced is validated by the full path),
the same codebook, no refresh due, a non-zero learning rate, every group's
hyper-parameters valid. The
extension then re-reads each parameter and gradient (``AdamStep.rebind``) and takes them
only if they match what it parsed (the parameter at the same address, the same dtype,
shape and device, both contiguous). Whatever differs -- or any check that raises -- sends
the step down the full path, which raises the error that input deserves, or builds and
keeps new plans: the kept plans never raise an error of their own and never change a
number.

Sharded (DTensor) parameters keep the step's agreement: the ranks reduce one small buffer
(every rank's verdict and a digest of the global step, the codebook refresh setting, the
learning rates, every group's options and every parameter's step counter: what the full
step's header covers that can change between steps) and all take the kept plans, or all the full path, whose own agreement then raises
what there is to raise. A plan is kept only when every rank can keep its own (an agreed
flag of the full step that built them); a rank that nevertheless has none (its own step
failed after the agreement) meets the others' kept-plan agreement with its full one,
which sees that they tried and agrees once more with them (``Comm.all_fit``).

Only parameters whose local shards are contiguous qualify, on the CPU; CUDA parameters
too when ``gefen.gefen._KEEP_CUDA_PLANS`` is set (off until a GPU run has checked it).
"""

from __future__ import annotations

import dataclasses
from itertools import chain, compress
from operator import is_, itemgetter

import torch

from ._base import StepPlan
from ._ext import _C
from ._views import laid_out_as

#: Gradient types the extension reads directly (a subclass, e.g. a DTensor for a plain
#: parameter, takes the full path, which unwraps or rejects it).
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))

#: The state entries a kept plan was built from (besides ``step``, read every step): a
#: parameter's entries must be the very objects they were, else the step takes the full
#: path (which validates whatever replaced them).
_GETTERS = (itemgetter("period", "factored", "codes", "magnitude", "vmean"),
            itemgetter("period", "factored", "codes", "magnitude", "v_row", "v_col"))


def _entries(get, states) -> chain:
    """The entries ``get`` reads of each state, flat (KeyError for a missing one)."""
    return chain.from_iterable(map(get, states))


#: The item fields :func:`group_hyper` gives, in its order.
HYPER_FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay", "stochastic_round")


def group_hyper(group: dict, lr: float) -> tuple:
    """``(lr, beta1, beta2, eps, weight_decay, stochastic_round)`` of a Gefen group, as the
    extension takes them (both paths read them with this)."""
    beta1, beta2 = group["betas"]
    return (lr, float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            bool(group["stochastic_round"]))


class SteadyStep:
    """The kept plans of one Gefen optimizer and what they were built from."""

    def __init__(self, opt, plan, switches):
        groups = opt.param_groups
        self.group_ids = [list(map(id, g["params"])) for g in groups]
        self.all_params = [p for g in groups for p in g["params"]]
        views = plan.views
        self.keys = [v.key for v in views]
        stepped = {id(k) for k in self.keys}
        self.present = [p.grad is not None for p in self.all_params]
        self.stepped = [id(p) in stepped for p in self.all_params]
        # the parameters this plan does not step (no gradient, or no element): their step
        # counters join the ranks' header too (almost always none)
        self.idle = [p for p, s in zip(self.all_params, self.stepped) if not s]
        self.states = [opt.state[k] for k in self.keys]
        # what the plans read of each state (its tensors, period and form), compared by
        # identity: (getter, the states of that form, their entries now)
        self.entries = []
        for get in _GETTERS:
            states = [st for st in self.states if _GETTERS[bool(st["factored"])] is get]
            if states:
                self.entries.append((get, states, list(_entries(get, states))))
        index = {id(g): gi for gi, g in enumerate(groups)}
        self.item_group = [index[id(v.group)] for v in views]
        self.quantizer = plan.quantizer
        self.switches = switches
        self.distributed = opt._comm.distributed(self.all_params)
        # a DTensor parameter's gradient must be laid out as the parameter
        self.layouts = [v.layout if v.layout.distributed else None for v in views]
        at = {id(v.param): i for i, v in enumerate(views)}

        def keep(prepared):
            # the plans hold no gradient between steps: each item's parameter stands in
            out = []
            for device, _plan, items in prepared:
                idx = [at[id(it.param)] for it in items]
                out.append((device, _C.AdamStep([dataclasses.replace(it, grad=it.param) for it in items]),
                            None if idx == list(range(len(views))) else idx))
            return out

        steps, whole, buffers, _copies = plan.payload
        # (device, plan, the indices of its items in self.keys, None for all of them in
        # order: the usual single plan): the two-phase plans of row-sharded parameters and
        # the whole-step ones, run as the full path runs them
        self.phased, self.whole = keep(steps), keep(whole)
        self.run_plan = StepPlan([], [], {}, quantizer=plan.quantizer,
                                 payload=(self.phased, self.whole, buffers, []))

    def run(self, opt, switches) -> bool:
        """Step ``opt`` with the kept plans; False (nothing changed; on every rank when
        sharded) when they no longer fit, and the caller takes the full path.
        ``switches``: the optimizer module's internal switches now (tests flip them),
        compared with those of the build."""
        fits = False
        try:
            header = ""
            try:
                if switches == self.switches:
                    fits, header = self._bind(opt)
            except Exception:  # the full path makes the same checks and raises properly
                fits = False
            if self.distributed:
                fits = opt._comm.all_fit(self.all_params, [header], fits)
            if fits:  # (the quantiser is the kept one: _bind checked)
                opt._run_update(self.run_plan)
        finally:
            self._unbind()  # (the plans hold no gradient between steps)
        if not fits:
            return False
        for st in self.states:
            st["step"] += 1
        opt._count_global_step()
        return True

    def _unbind(self) -> None:
        for _device, plan, _idx in self.phased + self.whole:
            plan.unbind()

    def _bind(self, opt) -> tuple[bool, str]:
        """This step's gradients, step counters and hyper-parameters into the kept plans:
        ``(fits, header)``; the header is what the ranks compare (may raise what the full
        path's checks would raise, which the caller treats as not fitting)."""
        if opt._prepared or opt._quantizer is not self.quantizer or opt._refresh_due():
            return False, ""
        groups = opt.param_groups
        if len(groups) != len(self.group_ids):
            return False, ""
        for g, ids in zip(groups, self.group_ids):
            if list(map(id, g["params"])) != ids:
                return False, ""
        grads = [p.grad for p in self.all_params]
        if [g is not None for g in grads] != self.present:
            return False, ""
        grads = list(compress(grads, self.stepped))
        if self.distributed:
            params, grads = self._locals(grads)
            if params is None:
                return False, ""
        else:
            if not set(map(type, grads)) <= _PLAIN:
                return False, ""
            params = self.keys
        if not all(map(is_, map(opt.state.get, self.keys), self.states)):
            return False, ""
        for get, states, entries in self.entries:  # an entry replaced: the full path checks it
            if not all(map(is_, _entries(get, states), entries)):
                return False, ""
        lrs = opt._read_lrs()
        if not any(lr != 0.0 for lr in lrs.values()):  # the zero-lr step of ALGORITHM.md §5
            return False, ""
        hyper = []
        for g in groups:
            lr = lrs[id(g)]
            opt._check_group(dict(g, lr=lr))
            hyper.append(group_hyper(g, lr))
        steps = [st["step"] + 1 for st in self.states]
        hypers = [hyper[i] for i in self.item_group]
        seed = opt._global_step
        for _device, plan, idx in self.phased + self.whole:
            args = (params, grads, steps, hypers) if idx is None else (
                [xs[i] for i in idx] for xs in (params, grads, steps, hypers))
            if not plan.rebind(*args, seed):
                return False, ""
        if not self.distributed:
            return True, ""
        return True, self._header(opt, groups, lrs, steps)

    def _header(self, opt, groups, lrs, steps) -> str:
        """What the ranks compare before taking their kept plans: what the full step's
        header covers that can change between steps (the parameter list, gradients and
        state are the kept ones, checked above): the global step, the optimizer's options,
        every group's learning rate and options and every parameter's step counter. A
        difference sends every rank down the full path, whose agreement names it."""
        first = steps[0] if steps else None
        if steps.count(first) == len(steps):  # the usual case: one counter (no long repr)
            steps = first
        idle = [st.get("step") if st else None for st in map(opt.state.get, self.idle)] if self.idle else ()
        return (f"steady|{opt._global_step}|{opt.codebook_refresh_every!r}"
                f"|{[lrs[id(g)] for g in groups]!r}|{list(map(opt._group_header, groups))!r}"
                f"|steps={steps!r}|{idle!r}")

    def _locals(self, grads):
        """The local shards of the parameters and gradients, or (None, None) when a
        gradient is not laid out as its parameter."""
        params, local_grads = [], []
        for key, g, layout in zip(self.keys, grads, self.layouts):
            if layout is None:
                if type(g) not in _PLAIN:
                    return None, None
                params.append(key)
                local_grads.append(g)
                continue
            lg = getattr(g, "_local_tensor", None)
            if lg is None or not laid_out_as(g, layout):
                return None, None
            params.append(key._local_tensor)
            local_grads.append(lg)
        return params, local_grads
