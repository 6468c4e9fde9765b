"""``gefen.Gefen``: AdamW with 8-bit block-quantised momentum and a block-shared or
factored second moment — about one byte of state per parameter (ALGORITHM.md §1–§6)."""

from __future__ import annotations

import math
import numbers

import torch

from ._base import StepPlan, _QuantizedOptimizer, block_state, row_vector
from ._checkpoint import block_to_factored, factored_to_block
from ._comm import ShardBuffers
from ._device import stream_of
from ._ext import _C
from ._items import AdamItem
from ._layout import as_float, rows_cols
from ._state import COMMON_KEYS, StateError, as_int, check_keys, check_tensor
from ._steady import HYPER_FIELDS, SteadyStep, group_hyper
from ._tuning import FactoredTuner
from ._views import ParamView, local, make_replicated, make_row_state

__all__ = ["Gefen"]

#: Internal (tests, benchmarks): CPU parameters whose column sums need no all-reduce (not
#: row-sharded) take the whole step in one ``AdamStep.step()`` call; False sends them
#: through ``factored_stats()`` then ``update()`` as sharded and CUDA parameters go.
_WHOLE_CPU_STEP = True
#: Internal (tests, benchmarks): in that call, factored parameters may form their momentum
#: and codes in the statistics pass (``momentum_in_stats``) instead of reading the gradient
#: again. The bits are the same; which is faster depends on the machine (docs/performance.md,
#: "Reading the gradient once"), so by default (None) each optimizer times both on its first
#: steps and keeps the faster (``gefen._tuning.FactoredTuner``); True or False forces one.
_MOMENTUM_IN_STATS = None
#: Internal (tests, benchmarks): CUDA parameters keep their step plans across steps too
#: (``gefen._steady``). Off until a GPU run has checked it (tests/test_cuda_parity.py turns
#: it on; docs/gpu.md): on the CPU the path CUDA parameters take costs about 10.6 us of
#: host time per tensor, a kept plan about 2.3 (block form; benchmarks/step_overhead.py
#: --full --phased against --phased).
_KEEP_CUDA_PLANS = False


def _switches() -> tuple:
    """The module's internal switches now (a plan kept under others does not run)."""
    return (_WHOLE_CPU_STEP, _MOMENTUM_IN_STATS, _KEEP_CUDA_PLANS)

_CPU = torch.device("cpu")


def check_adam_hparams(lr, betas, eps, weight_decay) -> None:
    """The hyper-parameter rules of ALGORITHM.md §1 (ValueError on violation)."""
    lr_f = as_float(lr, "lr")
    if not lr_f >= 0.0 or math.isinf(lr_f):
        raise ValueError(f"Invalid learning rate: {lr}")
    try:
        beta1, beta2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of floats, got {betas!r}") from None
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    eps_f = float(eps)
    if not (math.isfinite(eps_f) and eps_f > 0.0):
        raise ValueError(f"Invalid epsilon value: {eps} (must be finite and > 0)")
    wd = float(weight_decay)
    if not (math.isfinite(wd) and wd >= 0.0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_bool(value, what: str) -> None:
    """An on/off option must be a bool: Python's or numpy's, or the int 0 or 1 (as
    GefenMuon's options); anything else (a string such as ``"no"``) is not coerced."""
    if isinstance(value, numbers.Integral) and value in (0, 1):  # (bool included)
        return
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and isinstance(value.item(), bool):
        return
    raise TypeError(f"{what} must be a bool, got {value!r}")


class Gefen(_QuantizedOptimizer):
    r"""AdamW with about one byte of optimizer state per parameter.

    The first moment is stored as 8-bit codes into one learned 256-entry codebook times a
    float32 magnitude per block of ``P`` consecutive elements of a dim-0 slice; the second
    moment is shared per block (``factored=False``) or factored into row and column
    statistics (``factored=True``, for parameters with two or more dimensions). Periods
    and the codebook are learned from the first real step's gradients. The update is
    decoupled weight decay followed by the Adam step with bias correction.

    Args:
        params: tensors, ``(name, tensor)`` pairs from ``named_parameters()``, or group
            dicts overriding ``lr``, ``betas``, ``eps``, ``weight_decay``, ``factored``,
            ``period`` or ``stochastic_round``.
        lr (float or Tensor): learning rate (default ``1e-3``; start from your AdamW
            learning rate: on gefen's loss-parity benchmark Gefen's best learning rate was
            AdamW's, and 0.6x of it trained 0.6% worse).
        betas (tuple[float, float]): coefficients of the running averages.
        eps (float): added to the denominator after the square root.
        weight_decay (float): decoupled weight decay.
        factored (bool): factored second moment for parameters with ``ndim >= 2``.
        period (str): ``"auto"`` learns the block length per parameter; ``"row"`` uses
            whole dim-0 slices.
        codebook_refresh_every (int): relearn the codebook every N steps (0: never).
        stochastic_round (bool): round momentum codes stochastically (unbiased) instead
            of to the nearest entry.
        deterministic (bool): accepted for compatibility with upstream Gefen and changes
            nothing: gefen is always deterministic -- the same inputs give the same bits on
            every run, for any number of threads, on one process and sharded (integer or
            fixed-order reductions; the CUDA kernels use no floating-point atomics).
        fused (bool or None): gefen's update is always fused; ``False`` is rejected.

    On the CPU, factored parameters that are not row-sharded can take their step reading
    the gradient twice or once (the momentum formed in the statistics pass); the bits are
    the same and which is faster depends on the machine, so the optimizer times both on
    its first steps (steps 3-10, and again every 1000 steps) and keeps the faster. The
    choice is logged at DEBUG level on the ``"gefen"`` logger.
    """

    KIND = "gefen"
    _PICKLED = (*_QuantizedOptimizer._PICKLED, "deterministic")

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        factored: bool = True,
        period: str = "auto",
        codebook_refresh_every: int = 0,
        stochastic_round: bool = False,
        deterministic: bool = False,
        fused: bool | None = None,
    ):
        check_adam_hparams(lr, betas, eps, weight_decay)
        if period not in ("auto", "row"):
            raise ValueError(f"period must be 'auto' or 'row', got {period!r}")
        for what, value in (("factored", factored), ("stochastic_round", stochastic_round),
                            ("deterministic", deterministic)):
            check_bool(value, what)
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be None or a bool, got {fused!r}")
        if fused is False:
            raise ValueError("gefen's update is always fused; fused=False is not available")
        self.deterministic = bool(deterministic)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            factored=bool(factored),
            period=period,
            stochastic_round=bool(stochastic_round),
        )
        super().__init__(params, defaults, codebook_refresh_every=codebook_refresh_every)

    def _check_group(self, group: dict) -> None:
        check_adam_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        if group["period"] not in ("auto", "row"):
            raise ValueError(f"period must be 'auto' or 'row', got {group['period']!r}")
        check_bool(group["factored"], "factored")
        check_bool(group["stochastic_round"], "stochastic_round")

    def _period_mode(self, group: dict) -> str:
        return group["period"]

    # ------------------------------------------------------------ state

    @staticmethod
    def _is_factored(p: torch.Tensor, group: dict) -> bool:
        return bool(group["factored"]) and p.dim() >= 2

    def _new_state(self, view: ParamView, period: int) -> dict:
        st = block_state(view, period)
        rows, cols = rows_cols(view.shape)
        if self._is_factored(view.key, view.group):
            st["factored"] = 1
            st["v_row"] = row_vector(view)
            st["v_col"] = make_replicated(
                view, torch.zeros(cols, dtype=torch.float32, device=view.param.device)
            )
        else:
            st["factored"] = 0
            mag = st["magnitude"]
            st["vmean"] = make_row_state(view, torch.zeros_like(local(mag)), mag.shape)
        return st

    def _check_state(self, st: dict, p: torch.Tensor, name: str, group: dict) -> None:
        """A saved state in either form (``load_state_dict`` converts it to the live
        group's ``factored`` setting)."""
        factored = as_int(st, "factored", name) if "factored" in st else None
        if factored not in (0, 1):
            raise StateError(f"parameter '{name}': state 'factored' must be 0 or 1, got {factored!r}")
        if factored and p.dim() < 2:
            raise StateError(
                f"parameter '{name}': state is factored but the parameter has shape "
                f"{tuple(p.shape)} (the factored form needs two or more dimensions)"
            )
        extra = ("v_row", "v_col") if factored else ("vmean",)
        check_keys(st, name, set(COMMON_KEYS) | {"factored", *extra})
        rows, cols = rows_cols(p.shape)
        if factored:
            check_tensor(st, "v_row", name, torch.float32, (rows,), moment=True)
            check_tensor(st, "v_col", name, torch.float32, (cols,), moment=True)
        else:
            period = as_int(st, "period", name)
            check_tensor(st, "vmean", name, torch.float32, (rows, cols // period), moment=True)

    #: Options of the live optimizer a load keeps (the rest come from the checkpoint).
    _LIVE_OPTIONS = ("factored",)

    def _convert_loaded(self, view: ParamView, st: dict, saved_group: dict) -> dict:
        """A loaded state (local parts) in the live group's representation: block and
        factored second moments are projected onto each other (COMPATIBILITY.md)."""
        want = int(self._is_factored(view.key, view.group))
        if int(st["factored"]) == want:
            return st
        st = dict(st)
        period = int(st["period"])
        if want:
            st["v_row"], st["v_col"] = block_to_factored(view, st.pop("vmean"), period, self._comm)
        else:
            st["vmean"] = factored_to_block(view, st.pop("v_row"), st.pop("v_col"), period, self._comm)
        st["factored"] = want
        return st

    # ------------------------------------------------------------ update

    def _prepare_update(self, plan: StepPlan) -> None:
        """Validated ``_C.AdamStep`` plans per device: one for the parameters that take
        the two phases (row-sharded or CUDA: the factored column sums are reduced between
        them) and one for the CPU parameters that take the whole step in one call
        (``step()``, with ``momentum_in_stats``; their factored statistics live in the C
        plan); the flat buffers of the two-phase items' factored column sums (one per shard
        group), and the (parameter, contiguous copy) pairs to write back
        for non-contiguous parameters."""
        items, copies = [], []
        seed = self._global_step
        buffers = {}
        reserved = []
        by_device = {}  # device -> (items of two-phase plans, items of whole-step plans)
        hyper = {}  # id(group) -> the group's scalars, read once
        for v in plan.views:
            st = plan.state_of(self, v.key)
            group = v.group
            h = hyper.get(id(group))
            if h is None:
                h = hyper[id(group)] = dict(zip(HYPER_FIELDS, group_hyper(group, plan.lr(group))))
            p = v.param
            if not p.is_contiguous():
                pc = p.contiguous()
                copies.append((p, pc))
                p = pc
            device = _CPU if p.is_cpu else p.device  # (p.device costs ~0.4 us)
            whole = _WHOLE_CPU_STEP and device is _CPU and not v.layout.sharded
            row_stats = col_key = None
            if st["factored"] and not whole:  # (a whole step's come from the C plan)
                row_stats = torch.empty(v.local_rows, dtype=torch.float64, device=device)
                buf = buffers.setdefault(device, ShardBuffers(device))
                col_key = (buf, *buf.reserve(v.layout, v.cols + 1))
            mag, vmean, v_row, v_col = st["magnitude"], st.get("vmean"), st.get("v_row"), st.get("v_col")
            if v.layout.distributed:  # DTensor state: its local shards
                mag, vmean, v_row, v_col = (local(t) for t in (mag, vmean, v_row, v_col))
            item = AdamItem(
                name=v.name, param=p, grad=v.grad.contiguous(), codes=plan.codes_of(self, v.key, st),
                magnitude=mag, vmean=vmean, v_row=v_row, v_col=v_col, col_stats=None, row_stats=row_stats,
                period=st["period"], row_offset=v.row_offset, global_rows=v.rows, step=st["step"] + 1,
                seed=seed, momentum_in_stats=whole and _MOMENTUM_IN_STATS is True, **h,
            )
            items.append(item)
            reserved.append(col_key)
            by_device.setdefault(device, ([], []))[whole].append(item)
        for buf in buffers.values():
            buf.allocate()
        for item, key in zip(items, reserved):
            if key is not None:
                buf, k, off = key
                item.col_stats = buf.view(k, off, item.v_col.numel() + 1)
        steps = [(d, _C.AdamStep(phased), phased) for d, (phased, _) in by_device.items() if phased]
        whole = [(d, _C.AdamStep(one_call), one_call) for d, (_, one_call) in by_device.items() if one_call]
        plan.payload = (steps, whole, list(buffers.values()), copies)

    def _run_update(self, plan: StepPlan) -> None:
        steps, whole, buffers, copies = plan.payload
        nt = self._nthreads()
        error = None
        try:
            for device, step, _items in steps:
                step.factored_stats(nt, stream_of(device))
        except Exception as exc:  # every rank that shares a parameter must hear of it
            error = exc
        for buf in buffers:
            buf.reduce(self._comm, "factored", error)
        if error is not None:
            raise error
        # the whole steps (no reduction needed) fail, if at all, before changing anything,
        # as an update does; they come first so that a failure leaves every plan unapplied
        for _device, step, _items in whole:
            if _MOMENTUM_IN_STATS is None and step.factored:
                self._factored_tuner().step(step, plan.quantizer, nt)
            else:
                step.step(plan.quantizer, nt)
        for device, step, _items in steps:
            step.update(plan.quantizer, nt, stream_of(device), self._device_table(plan.quantizer, device))
        for p, pc in copies:
            p.copy_(pc)

    def _factored_tuner(self) -> FactoredTuner:
        """The timing that chooses how the whole CPU step runs factored parameters
        (``gefen._tuning``), made on first use."""
        tuner = self.__dict__.get("_tuner")
        if tuner is None:
            tuner = self._tuner = FactoredTuner()
        return tuner

    # ------------------------------------------------------------ steady steps

    def _steady_step(self) -> bool:
        """Run the step with the plan kept from the last one (``gefen._steady``) when it
        still fits; False when there is none or it does not fit."""
        steady = self.__dict__.get("_steady")
        if steady is not None and steady.run(self, _switches()):
            return True
        self._steady = None
        return False

    def _can_keep(self, plan: StepPlan) -> bool:
        """A steady step's plan (asked only of steps that create no state and relearn no
        codebook) can be kept when every parameter stepped here is on the CPU (or CUDA,
        with ``_KEEP_CUDA_PLANS``) and contiguous (no copies to write back)."""
        steps, whole, _buffers, copies = plan.payload
        return not copies and all(d is _CPU or (_KEEP_CUDA_PLANS and d.type == "cuda")
                                  for d, *_ in steps + whole)

    def _keep_steady(self, plan: StepPlan) -> None:
        """After a full step: keep its C plans for the next steps when every rank can."""
        if plan.keep:
            self._steady = SteadyStep(self, plan, _switches())
