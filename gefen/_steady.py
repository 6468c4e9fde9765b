"""Gefen's steady step: the C plan of a CPU step kept for the next steps.

A step builds named items for every parameter and the extension parses them (about
twenty fields and five tensors each) into a C plan; on a model's many small tensors
that costs more than the update itself. When nothing but the gradients, the step
counters and the hyper-parameters changes from one step to the next -- the usual case
after the first steps -- the plan of the last step can run again. :class:`SteadyStep`
keeps it and, before each step, checks cheaply that it still describes the optimizer:
the same parameter objects in the same groups, the same parameters with gradients, the
same state dicts, the same codebook, no refresh due, a non-zero learning rate, every
group's hyper-parameters valid. The extension then re-reads each parameter and
gradient (``AdamStep.restep``) and runs only if they match what it parsed (the
parameter at the same address, the same dtype, shape and device, both contiguous).
Whatever differs -- or any check that raises -- sends the step down the full path,
which raises the error that input deserves, or builds and keeps a new plan: the fast
path never raises an error of its own and never changes a number.

Only plain (non-DTensor) CPU parameters taking the whole step in one call qualify:
sharded, CUDA and non-contiguous parameters always take the full path.
"""

from __future__ import annotations

import dataclasses
from itertools import compress

import torch

from ._ext import _C

#: Gradient types the extension reads directly (a subclass, e.g. a DTensor, takes the
#: full path, which unwraps or rejects it).
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))


#: The item fields :func:`group_hyper` gives, in its order.
HYPER_FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay", "stochastic_round")


def group_hyper(group: dict, lr: float) -> tuple:
    """``(lr, beta1, beta2, eps, weight_decay, stochastic_round)`` of a Gefen group, as the
    extension takes them (both paths read them with this)."""
    beta1, beta2 = group["betas"]
    return (lr, float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            bool(group["stochastic_round"]))


class SteadyStep:
    """The kept plan of one Gefen optimizer and what it was built from."""

    def __init__(self, opt, keys, items, switches):
        groups = opt.param_groups
        self.group_ids = [list(map(id, g["params"])) for g in groups]
        self.all_params = [p for g in groups for p in g["params"]]
        stepped = {id(k) for k in keys}
        self.present = [p.grad is not None for p in self.all_params]
        self.stepped = [id(p) in stepped for p in self.all_params]
        self.keys = list(keys)
        self.states = [opt.state[k] for k in keys]
        self.state_ids = list(map(id, self.states))
        index = {id(g): gi for gi, g in enumerate(groups)}
        self.item_group = [index[id(g)] for g in _groups_of(groups, keys)]
        self.quantizer = opt._quantizer
        self.switches = switches
        # the plan holds no gradient between steps: each item's parameter stands in for it
        self.plan = _C.AdamStep([dataclasses.replace(it, grad=it.param) for it in items])

    def run(self, opt, switches) -> bool:
        """Step ``opt`` with the kept plan; False (nothing changed) when it no longer
        fits, and the caller takes the full path. ``switches``: the optimizer module's
        internal switches now (tests flip them), compared with those of the build."""
        if switches != self.switches:
            return False
        try:
            inputs = self._inputs(opt)
        except Exception:  # the full path makes the same checks and raises properly
            return False
        if inputs is None:
            return False
        grads, steps, hypers = inputs
        if not self.plan.restep(self.keys, grads, steps, hypers, opt._global_step,
                                opt._quantizer, opt._nthreads()):
            return False
        for st in self.states:
            st["step"] += 1
        opt._count_global_step()
        return True

    def _inputs(self, opt):
        """This step's gradients, step counters and hyper-parameters, or None when the
        plan does not describe the optimizer any more (raises what the full path's checks
        would raise, which the caller treats as None)."""
        if opt._prepared or opt._quantizer is not self.quantizer or opt._refresh_due():
            return None
        groups = opt.param_groups
        if len(groups) != len(self.group_ids):
            return None
        for g, ids in zip(groups, self.group_ids):
            if list(map(id, g["params"])) != ids:
                return None
        grads = [p.grad for p in self.all_params]
        if [g is not None for g in grads] != self.present:
            return None
        grads = list(compress(grads, self.stepped))
        if not set(map(type, grads)) <= _PLAIN:
            return None
        if list(map(id, map(opt.state.get, self.keys))) != self.state_ids:
            return None
        lrs = opt._read_lrs()
        if not any(lr != 0.0 for lr in lrs.values()):  # the zero-lr step of ALGORITHM.md §5
            return None
        hyper = []
        for g in groups:
            lr = lrs[id(g)]
            opt._check_group(dict(g, lr=lr))
            hyper.append(group_hyper(g, lr))
        opt._comm.stats.reset_step()
        return grads, [st["step"] + 1 for st in self.states], [hyper[i] for i in self.item_group]


def _groups_of(groups: list[dict], keys: list) -> list[dict]:
    """The group of each of ``keys``."""
    where = {id(p): g for g in groups for p in g["params"]}
    return [where[id(k)] for k in keys]
