"""The state layout of DESIGN.md §1 and the checks every step runs on its inputs.

A parameter of global shape ``(d0, d1, ...)`` is an ``R x S`` matrix with ``R = d0`` and
``S = d1 * d2 * ...`` (``S = 1`` for 1-D and 0-D parameters, ``R = 1`` for 0-D).
"""

from __future__ import annotations

import math

import torch

#: Version of the state-dict schema written into every parameter group.
SCHEMA_VERSION = 2


#: The parameter dtypes the extension steps (csrc/python/tensor_view.c).
SUPPORTED_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16, torch.float64))


def rows_cols(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """Return ``(R, S)`` of a parameter shape: rows and elements per dim-0 slice."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), int(math.prod(shape[1:]))


def param_name(group: dict, group_index: int, index: int) -> str:
    """The name used in error messages: the ``named_parameters`` name when the optimizer
    was built from ``(name, tensor)`` pairs, else ``param_groups[g][i]``."""
    names = group.get("param_names")
    if names is not None and index < len(names):
        return str(names[index])
    return f"param_groups[{group_index}][{index}]"


#: Components of a parameter's name that module wrappers add and DCP's state-dict helpers
#: drop: ``torch.compile``'s ``OptimizedModule._orig_mod`` and activation checkpointing's
#: ``_checkpoint_wrapped_module`` (torch's ``_CHECKPOINT_PREFIX``).
WRAPPER_COMPONENTS = ("_orig_mod", "_checkpoint_wrapped_module")


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers' components: the same parameter before and
    after ``torch.compile`` or activation checkpointing, and the name DCP keys its state
    by (``_orig_mod.blocks.0._checkpoint_wrapped_module.w`` -> ``blocks.0.w``)."""
    return ".".join(c for c in name.split(".") if c not in WRAPPER_COMPONENTS)


def check_param(p: torch.Tensor, name: str) -> None:
    """Reject parameters the optimizer can never update (at construction)."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"parameter '{name}': expected a torch.Tensor, got {type(p).__name__}")
    if p.is_complex():
        raise ValueError(f"parameter '{name}': complex parameters are not supported")
    if not p.is_floating_point():
        raise ValueError(f"parameter '{name}': dtype {p.dtype} is not a floating-point dtype")
    if p.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"parameter '{name}': dtype {p.dtype} is not supported (gefen steps float32, "
            "bfloat16, float16 and float64 parameters)"
        )


def check_grad(p: torch.Tensor, g: torch.Tensor, name: str) -> None:
    """Reject a gradient before anything is mutated, naming the parameter (``p`` and
    ``g`` are the local shards)."""
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError(f"parameter '{name}': sparse gradients are not supported")
    if g.is_complex():
        raise TypeError(f"parameter '{name}': complex gradients are not supported")
    if p.is_meta or g.is_meta:
        raise RuntimeError(
            f"parameter '{name}': tensors on the meta device cannot be stepped; "
            "materialise the model (e.g. to_empty + init) first"
        )
    if g.shape != p.shape:
        raise ValueError(
            f"parameter '{name}': gradient shape {tuple(g.shape)} differs from parameter "
            f"shape {tuple(p.shape)}"
        )
    if g.dtype != p.dtype:
        raise TypeError(
            f"parameter '{name}': gradient dtype {g.dtype} differs from parameter dtype {p.dtype}"
        )
    if g.device != p.device:
        raise ValueError(
            f"parameter '{name}': gradient is on {g.device} but the parameter is on {p.device}"
        )


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether some elements of a (local, strided) tensor share memory, e.g. one made by
    ``expand()``: what torch's in-place ops refuse (metadata only)."""
    return t.layout == torch.strided and torch._debug_has_internal_overlap(t) == 1  # (2: too hard to tell)


def check_no_self_overlap(p: torch.Tensor, name: str) -> None:
    """Reject a parameter (local shard) whose elements share memory, e.g. one made by
    ``expand()``: the update could not write it (before anything is mutated)."""
    if overlaps_itself(p):
        raise ValueError(
            f"parameter '{name}': several of its elements share one memory location (e.g. a "
            f"tensor made by expand(); strides {tuple(p.stride())}); an optimizer cannot "
            "update it: give the parameter its own storage (e.g. p.data = p.data.clone())"
        )


def check_plain_grads(param_groups: list[dict]) -> None:
    """The gradient checks of :func:`check_grad` for every parameter with a gradient
    (what ``torch.optim.AdamW`` would otherwise find only while mutating)."""
    for gi, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            name = param_name(group, gi, i)
            if hasattr(g, "_local_tensor") and hasattr(p, "_local_tensor"):
                check_grad(p._local_tensor, g._local_tensor, name)
            else:
                check_grad(p, g, name)


def as_float(value, what: str) -> float:
    """A hyper-parameter as a Python float (accepts a one-element tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what} must be a float or a one-element tensor")
        return float(value.item())
    return float(value)
