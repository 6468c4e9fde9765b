"""Validation of loaded per-parameter state (fail-before-mutation, DESIGN.md §5)."""

from __future__ import annotations

import numbers

import torch

from ._ext import _C
from ._layout import rows_cols
from ._views import local

#: Integrity digests every exported state carries (see _checkpoint.py).
DIGEST_KEYS = ("digest_rows", "digest")

#: What to do when a load brings less state than the checkpoint holds.
PREPARE_HINT = (
    "call gefen.dcp.prepare_load(optimizer, checkpoint) before loading, so that the "
    "optimizer allocates the state the checkpoint holds"
)

#: Keys every quantised parameter state in a state dict has.
COMMON_KEYS = ("step", "global_step", "period", "codes", "magnitude", "codebook", *DIGEST_KEYS)


class StateError(ValueError):
    """A loaded state entry is invalid; the message names the parameter."""


#: The largest step counter a checkpoint may hold: the extension takes the step as an
#: int64 and adds one.
MAX_STEP = 2**63 - 2


def as_int(st: dict, key: str, name: str) -> int:
    """An integer state entry (a Python or numpy int, an integral float, or a one-element
    integer/float tensor, as torch.optim checkpoints store ``step``), exactly: an int is
    never rounded through a float."""
    v = st[key]
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_complex() or v.dtype == torch.bool or v.is_meta:
            raise StateError(f"parameter '{name}': state '{key}' must be a single integer")
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise StateError(f"parameter '{name}': state '{key}' must be an integer, got {v!r}")
    if not isinstance(v, numbers.Integral):  # a float (Python's or numpy's)
        f = float(v)
        if not f.is_integer():  # (False for NaN and +-inf)
            raise StateError(f"parameter '{name}': state '{key}' must be an integer, got {v!r}")
        v = f
    return int(v)  # (numpy's integers become a plain int, exactly)


def check_tensor(
    st: dict,
    key: str,
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    moment: bool = False,
) -> torch.Tensor:
    """A state tensor of the given dtype and (global) shape; ``moment`` also rejects
    negative values, which the optimizer never makes (checked on this rank's part of a
    DTensor). NaN and +inf are accepted: a step with a non-finite gradient writes them
    (as torch.optim does, steps accept such gradients), and the optimizer's own state dict
    must load back; the digests still catch any value changed after the save."""
    v = st.get(key)
    if not isinstance(v, torch.Tensor):
        raise StateError(f"parameter '{name}': state '{key}' must be a tensor, got {type(v).__name__}")
    lv = local(v)
    if v.layout != torch.strided or lv.layout != torch.strided:
        raise StateError(
            f"parameter '{name}': state '{key}' must be a dense (strided) tensor, got layout "
            f"{lv.layout if v.layout == torch.strided else v.layout}"
        )
    if lv.is_meta:
        raise StateError(f"parameter '{name}': state '{key}' is on the meta device (it holds no data)")
    if v.dtype != dtype:
        raise StateError(f"parameter '{name}': state '{key}' has dtype {v.dtype}, expected {dtype}")
    if tuple(v.shape) != tuple(shape):
        raise StateError(
            f"parameter '{name}': state '{key}' has shape {tuple(v.shape)}, expected {tuple(shape)}"
        )
    if moment and lv.numel() and bool((lv < 0).any()):  # (NaN < 0 is False; -inf < 0)
        raise StateError(f"parameter '{name}': state '{key}' holds negative values")
    return v


def check_keys(st: dict, name: str, expected: set[str]) -> None:
    """Exactly the expected keys: no missing and no unknown ones."""
    if not isinstance(st, dict):
        raise StateError(f"parameter '{name}': state must be a dict, got {type(st).__name__}")
    keys = set(st)
    missing = sorted(expected - keys)
    extra = sorted(keys - expected, key=str)
    if missing:
        raise StateError(f"parameter '{name}': state is missing {missing}")
    if extra:
        raise StateError(f"parameter '{name}': state has unknown keys {extra}")


def valid_period(p: torch.Tensor, period: int) -> bool:
    """Whether ``period`` is a legal block length for ``p`` (divides S; 1 for tiny ones)."""
    rows, cols = rows_cols(p.shape)
    if rows * cols <= 1 or cols <= 1:
        return period == 1
    return 1 <= period <= cols and cols % period == 0


def check_common_state(st: dict, p: torch.Tensor, name: str) -> int:
    """Checks the entries shared by all kinds; returns the period."""
    if not isinstance(st, dict):
        raise StateError(f"parameter '{name}': state must be a dict, got {type(st).__name__}")
    for key in COMMON_KEYS:
        if key not in st:
            hint = ""
            if key in DIGEST_KEYS:  # what PyTorch's flattened load drops (it keeps live keys)
                hint = (
                    " (a gefen state dict carries integrity digests; PyTorch's flattened load "
                    "restores only the keys the live optimizer's state already has, and an "
                    "optimizer that never called state_dict() has no digests yet: "
                    + PREPARE_HINT + ")"
                )
            raise StateError(f"parameter '{name}': state is missing '{key}'{hint}")
    step = as_int(st, "step", name)
    global_step = as_int(st, "global_step", name)
    for key, value in (("step", step), ("global_step", global_step)):
        if value > MAX_STEP:
            raise StateError(
                f"parameter '{name}': state '{key}' {value} is out of range (at most "
                f"2**63 - 2 = {MAX_STEP})"
            )
    if step < 0 or global_step < step:
        raise StateError(
            f"parameter '{name}': step {step} and global_step {global_step} are inconsistent"
        )
    period = as_int(st, "period", name)
    if not valid_period(p, period):
        raise StateError(
            f"parameter '{name}': period {period} is not valid for shape {tuple(p.shape)}"
        )
    rows, cols = rows_cols(p.shape)
    check_tensor(st, "codes", name, torch.uint8, tuple(p.shape))
    check_tensor(st, "magnitude", name, torch.float32, (rows, cols // period), moment=True)
    check_tensor(st, "codebook", name, torch.float32, (_C.CODEBOOK_SIZE,))
    check_tensor(st, "digest_rows", name, torch.int64, (rows,))
    check_tensor(st, "digest", name, torch.int64, (2,))
    return period
