"""``gefen.Gefen``: AdamW with 8-bit block-quantised momentum and a block-shared or
factored second moment — about one byte of state per parameter (ALGORITHM.md §1–§6)."""

from __future__ import annotations

import math

import torch

from ._base import StepPlan, _QuantizedOptimizer, block_state
from ._device import group_by_device, stream_of
from ._ext import _C
from ._layout import as_float, rows_cols
from ._state import COMMON_KEYS, StateError, as_int, check_keys, check_tensor

__all__ = ["Gefen"]


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
        lr (float or Tensor): learning rate (default ``1e-3``; Gefen usually wants about
            0.6x the AdamW learning rate).
        betas (tuple[float, float]): coefficients of the running averages.
        eps (float): added to the denominator after the square root.
        weight_decay (float): decoupled weight decay.
        factored (bool): factored second moment for parameters with ``ndim >= 2``.
        period (str): ``"auto"`` learns the block length per parameter; ``"row"`` uses
            whole dim-0 slices.
        codebook_refresh_every (int): relearn the codebook every N steps (0: never).
        stochastic_round (bool): round momentum codes stochastically (unbiased) instead
            of to the nearest entry.
        deterministic (bool): accepted for API compatibility; the CPU core is always
            deterministic (results do not depend on the thread count).
        fused (bool or None): gefen's update is always fused; ``False`` is rejected.
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

    def _period_mode(self, group: dict) -> str:
        return group["period"]

    # ------------------------------------------------------------ state

    @staticmethod
    def _is_factored(p: torch.Tensor, group: dict) -> bool:
        return bool(group["factored"]) and p.dim() >= 2

    def _new_state(self, p: torch.Tensor, period: int, group: dict) -> dict:
        st = block_state(p, period)
        rows, cols = rows_cols(p.shape)
        if self._is_factored(p, group):
            st["factored"] = 1
            st["v_row"] = torch.zeros(rows, dtype=torch.float32, device=p.device)
            st["v_col"] = torch.zeros(cols, dtype=torch.float32, device=p.device)
        else:
            st["factored"] = 0
            st["vmean"] = torch.zeros_like(st["magnitude"])
        return st

    def _check_state(self, st: dict, p: torch.Tensor, name: str, group: dict) -> None:
        factored = as_int(st, "factored", name) if "factored" in st else None
        if factored not in (0, 1):
            raise StateError(f"parameter '{name}': state 'factored' must be 0 or 1, got {factored!r}")
        if bool(factored) != self._is_factored(p, group):
            raise StateError(
                f"parameter '{name}': state is {'factored' if factored else 'block'} but the "
                f"group's factored={group['factored']} gives the "
                f"{'factored' if self._is_factored(p, group) else 'block'} form for shape "
                f"{tuple(p.shape)}"
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

    # ------------------------------------------------------------ update

    def _prepare_update(self, plan: StepPlan) -> None:
        """The C step items (validated by ``_C.adam_validate``) and the (parameter,
        contiguous copy) pairs to write back for non-contiguous parameters."""
        items, copies = [], []
        seed = self._global_step
        for s in plan.slots:
            st = plan.state_of(self, s.param)
            group = s.group
            p = s.param
            pc = p
            if not p.is_contiguous():
                pc = p.detach().contiguous()
                copies.append((p, pc))
            g = s.grad if s.grad.is_contiguous() else s.grad.contiguous()
            rows, cols = rows_cols(p.shape)
            col_stats = row_stats = None
            if st["factored"]:
                col_stats = torch.empty(cols + 1, dtype=torch.float64, device=p.device)
                row_stats = torch.empty(rows, dtype=torch.float64, device=p.device)
            beta1, beta2 = group["betas"]
            items.append(
                (
                    s.name, pc, g, st["codes"], st["magnitude"], st.get("vmean"),
                    st.get("v_row"), st.get("v_col"), col_stats, row_stats,
                    st["period"], 0, rows, st["step"] + 1,
                    as_float(group["lr"], "lr"), float(beta1), float(beta2),
                    float(group["eps"]), float(group["weight_decay"]),
                    bool(group["stochastic_round"]), seed,
                )
            )
        for group_items in group_by_device(items, lambda it: it[1].device).values():
            _C.adam_validate(group_items)
        plan.payload = (items, copies)

    def _run_update(self, plan: StepPlan) -> None:
        items, copies = plan.payload
        nt = self._nthreads()
        for device, group in group_by_device(items, lambda it: it[1].device).items():
            stream = stream_of(device)
            _C.adam_factored_stats(group, nt, stream)
            table = self._device_table(plan.quantizer, device)
            _C.adam_update(group, plan.quantizer, nt, stream, table)
        for p, pc in copies:
            p.copy_(pc)
