"""Validation of loaded per-parameter state (fail-before-mutation, DESIGN.md §5)."""

from __future__ import annotations

import torch

from ._ext import _C
from ._layout import rows_cols
from ._views import local

#: Integrity digests every exported state carries (see _checkpoint.py).
DIGEST_KEYS = ("digest_rows", "digest")

#: Keys every quantised parameter state in a state dict has.
COMMON_KEYS = ("step", "global_step", "period", "codes", "magnitude", "codebook", *DIGEST_KEYS)


class StateError(ValueError):
    """A loaded state entry is invalid; the message names the parameter."""


def as_int(st: dict, key: str, name: str) -> int:
    """An integer state entry (a Python int or a one-element integer/float tensor)."""
    v = st[key]
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise StateError(f"parameter '{name}': state '{key}' must be a single integer")
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)) or float(v) != int(v):
        raise StateError(f"parameter '{name}': state '{key}' must be an integer, got {v!r}")
    return int(v)


def check_tensor(
    st: dict,
    key: str,
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    moment: bool = False,
) -> torch.Tensor:
    """A state tensor of the given dtype and (global) shape; ``moment`` also requires
    finite non-negative values (checked on this rank's part of a DTensor)."""
    v = st.get(key)
    if not isinstance(v, torch.Tensor):
        raise StateError(f"parameter '{name}': state '{key}' must be a tensor, got {type(v).__name__}")
    if v.dtype != dtype:
        raise StateError(f"parameter '{name}': state '{key}' has dtype {v.dtype}, expected {dtype}")
    if tuple(v.shape) != tuple(shape):
        raise StateError(
            f"parameter '{name}': state '{key}' has shape {tuple(v.shape)}, expected {tuple(shape)}"
        )
    lv = local(v)
    if moment and lv.numel():
        if not bool(torch.isfinite(lv).all()):
            raise StateError(f"parameter '{name}': state '{key}' holds non-finite values")
        if bool((lv < 0).any()):
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
            raise StateError(f"parameter '{name}': state is missing '{key}'")
    step = as_int(st, "step", name)
    global_step = as_int(st, "global_step", name)
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
