"""The named items Python hands the C extension (DESIGN.md §7: a boundary is a named
structure). ``csrc/python/steps.c`` reads every field by its name, so adding a field
touches this file and the one parser there.

Tensors are local shards (``DTensor.to_local()``), detached, on one device per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AdamItem:
    """One parameter's local shard for a Gefen step (``_C.AdamStep``).

    Block form: ``vmean`` is set and ``v_row``/``v_col``/``col_stats``/``row_stats`` are
    None. Factored form: ``vmean`` is None; ``col_stats`` (float64, ``cols + 1``) and
    ``row_stats`` (float64, local rows) are the phase-1 buffers, ``col_stats`` being
    all-reduced over the ranks that share the parameter between the phases. On the CPU
    they may be None: the plan then allocates them itself (what ``Gefen`` does for the
    items of a whole step, whose column sums are not reduced).
    """

    name: str
    param: torch.Tensor  # local rows, contiguous, written in place
    grad: torch.Tensor  # local rows, same dtype and shape
    codes: torch.Tensor  # uint8, the parameter's local shape
    magnitude: torch.Tensor  # float32 (local rows, cols / period)
    vmean: torch.Tensor | None
    v_row: torch.Tensor | None
    v_col: torch.Tensor | None  # float32 (cols,), replicated
    col_stats: torch.Tensor | None
    row_stats: torch.Tensor | None
    period: int
    row_offset: int  # global index of the first local row
    global_rows: int  # R over all ranks
    step: int  # the parameter's step after this step's increment
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    stochastic_round: bool
    seed: int  # the optimizer's global step before this step
    #: Factored items run through ``AdamStep.step()`` (CPU, no column sums to reduce): form
    #: the momentum and codes in the statistics pass, while the gradient's rows are in cache
    #: (the two-phase ``factored_stats()``/``update()`` refuse it; CUDA ignores it).
    momentum_in_stats: bool = False


@dataclass(slots=True)
class MuonItem:
    """One matrix's local rows for GefenMuon's quantised momentum (``_C.MuonStep``)."""

    name: str
    grad: torch.Tensor  # local rows, contiguous
    codes: torch.Tensor  # uint8, the local rows' shape
    magnitude: torch.Tensor  # float32 (local rows, cols / period)
    out: torch.Tensor  # float32 or bfloat16, the local rows' shape: Newton–Schulz input
    period: int
    beta: float  # momentum
    nesterov: bool
