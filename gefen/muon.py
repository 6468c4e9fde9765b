"""``gefen.GefenMuon``: Muon with 8-bit block-quantised momentum (ALGORITHM.md §7).

The momentum lives as codes into the optimizer's one learned codebook times a float32
magnitude per block, exactly like Gefen's first moment; the C core updates and
requantises it and writes the Newton–Schulz input. Newton–Schulz itself is matrix
multiplication and runs through ``torch`` (bf16), as in ``torch.optim.Muon``.

The step is split so that sharded modes can later gather the Newton–Schulz input of
a row shard into the full matrix: momentum (local rows, C core) → orthogonalisation
(:func:`newton_schulz`, on a full matrix) → optional NorMuon row normalisation →
update of the local rows.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from ._base import StepPlan, _QuantizedOptimizer, block_state, row_vector
from ._comm import ShardBuffers
from ._device import group_by_device, stream_of
from ._ext import _C
from ._items import MuonItem
from ._layout import as_float, param_name
from ._orthogonalize import orthogonalize
from ._state import COMMON_KEYS, StateError, check_keys, check_tensor
from ._views import LOCAL, ParamView, local

#: NorMuon's rescale in "approx" mode uses the local rows' own norms.
_UNSHARDED = LOCAL

__all__ = [
    "GefenMuon",
    "NS_SCHEDULES",
    "SHARDED_MODES",
    "ADJUST_LR_FNS",
    "newton_schulz",
    "ns_coefficient_schedule",
    "lr_ratio",
    "normuon_normalize",
    "normuon_rows",
    "normuon_rescale",
]

#: Keller Jordan's quintic coefficients, ``torch.optim.Muon``'s default.
STANDARD_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

#: Named Newton–Schulz schedules: one ``(a, b, c)`` triple per iteration.
NS_SCHEDULES: dict[str, tuple[tuple[float, float, float], ...]] = {
    "tuned3": (
        (5.0067, -14.4125, 10.6001),
        (3.7534, -6.8083, 3.3840),
        (3.2080, -4.3501, 2.0330),
    ),
    "tuned4": (
        (5.4261, -15.5285, 11.2657),
        (3.0766, -4.9701, 2.1297),
        (3.0008, -6.4486, 4.3696),
        (2.8386, -4.1421, 2.5758),
    ),
}

#: How a sharded matrix is orthogonalised (DESIGN.md §4); one process: all the same.
SHARDED_MODES = ("exact", "distributed", "approx")

#: Learning-rate adjustments of ``torch.optim.Muon`` (None means "original").
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

#: Most elements whose Newton–Schulz inputs are materialised at once (bf16 scratch).
_CHUNK_ELEMENTS = 1 << 24

_MAX_NS_ITERATIONS = 100


# ------------------------------------------------------------------ math


def newton_schulz(
    x: torch.Tensor, coefficients: Sequence[Sequence[float]], eps: float
) -> torch.Tensor:
    """Orthogonalise a 2-D matrix by the Newton–Schulz iteration of ALGORITHM.md §7.

    In bf16: transpose when rows > cols, ``X ← X / max(‖X‖_F, eps)``, then for each
    ``(a, b, c)``: ``A = X Xᵀ``, ``B = b·A + c·A·A``, ``X ← a·X + B·X``; transpose back.
    The operations are those of ``torch.optim.Muon`` (``addmm``), so for the same input
    and coefficients the result is the same. ``x`` is not modified.
    """
    if x.dim() != 2:
        raise ValueError(f"Newton–Schulz needs a 2-D matrix, got shape {tuple(x.shape)}")
    out = x.to(torch.bfloat16)
    transposed = out.size(0) > out.size(1)
    if transposed:
        out = out.T
    out = out / out.norm().clamp(min=eps)
    for a, b, c in coefficients:
        gram = out @ out.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        out = torch.addmm(out, poly, out, beta=a)
    if transposed:
        out = out.T
    return out


def ns_coefficient_schedule(group: dict) -> tuple[tuple[float, float, float], ...]:
    """The ``(a, b, c)`` triple of every Newton–Schulz iteration of a parameter group.

    ``ns_schedule`` None or ``"standard"``: ``ns_coefficients`` repeated ``ns_steps``
    times (``torch.optim.Muon``'s iteration); ``"tuned3"``/``"tuned4"``: the named
    schedules; a sequence of triples: used as given (``ns_steps`` is then ignored).
    """
    schedule = group["ns_schedule"]
    if schedule is None or schedule == "standard":
        a, b, c = (float(v) for v in group["ns_coefficients"])
        return ((a, b, c),) * int(group["ns_steps"])
    if isinstance(schedule, str):
        return NS_SCHEDULES[schedule]
    return tuple((float(a), float(b), float(c)) for a, b, c in schedule)


def lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The learning-rate multiplier of a ``rows × cols`` matrix (its *global* shape).

    None/``"original"``: ``sqrt(max(1, rows/cols))``; ``"match_rms_adamw"``:
    ``0.2·sqrt(max(rows, cols))`` — the semantics of ``torch.optim.Muon``.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}")


def normuon_rows(
    o: torch.Tensor, v: torch.Tensor, beta2: float, eps: float, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon's row part (ALGORITHM.md §7) on the rows of ``o`` that ``v`` (fp32, one
    entry per row, updated in place) belongs to: ``r_i = ‖O_i‖²/cols``,
    ``v_i ← β2·v_i + (1-β2)·r_i``, ``O_i ← O_i / (sqrt(v̂_i) + eps)`` with
    ``v̂ = v / (1 - β2^step)``. Returns the fp32 rows and the float64 sums of squares of
    ``o`` before and after (to be summed over the ranks that share the matrix)."""
    o = o.float()
    before = o.double().square().sum()
    v.mul_(beta2).add_((o * o).mean(dim=1), alpha=1.0 - beta2)
    vhat = v / (1.0 - beta2**step)
    o = o / (vhat.sqrt() + eps).unsqueeze(1)
    return o, torch.stack([before, o.double().square().sum()])


def normuon_rescale(o: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Rescales NorMuon's rows to the Frobenius norm the whole matrix had before the
    normalisation (``sums``: the whole matrix's sums of squares before and after)."""
    before, after = sums.sqrt().tolist()
    # all-zero O stays zero (before is then 0 as well)
    return o * float(before / max(after, torch.finfo(torch.float32).tiny))


def normuon_normalize(
    o: torch.Tensor, v: torch.Tensor, beta2: float, eps: float, step: int
) -> torch.Tensor:
    """NorMuon (ALGORITHM.md §7) of one whole matrix: :func:`normuon_rows`, then
    :func:`normuon_rescale` so ``O`` keeps the Frobenius norm it had. Returns fp32."""
    rows, sums = normuon_rows(o, v, beta2, eps, step)
    return normuon_rescale(rows, sums)


# ------------------------------------------------------------ validation


def _is_bool(v) -> bool:
    return isinstance(v, bool) or (isinstance(v, int) and v in (0, 1))


def _finite_positive(v, what: str) -> None:
    f = float(v)
    if not (math.isfinite(f) and f > 0.0):
        raise ValueError(f"Invalid {what}: {v} (must be finite and > 0)")


def _check_triple(t, what: str) -> None:
    try:
        vals = [float(x) for x in t]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be three floats (a, b, c), got {t!r}") from None
    if len(vals) != 3 or not all(math.isfinite(x) for x in vals):
        raise ValueError(f"{what} must be three finite floats (a, b, c), got {t!r}")


def check_muon_hparams(group: dict) -> None:
    """The hyper-parameter rules of GefenMuon (ValueError on violation)."""
    lr = as_float(group["lr"], "lr")
    if not lr >= 0.0 or math.isinf(lr):
        raise ValueError(f"Invalid learning rate: {group['lr']}")
    wd = float(group["weight_decay"])
    if not (math.isfinite(wd) and wd >= 0.0):
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
    momentum = float(group["momentum"])
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Invalid momentum value: {group['momentum']} (must lie in [0, 1))")
    for key in ("nesterov", "normuon"):
        if not _is_bool(group[key]):
            raise ValueError(f"{key} must be a bool, got {group[key]!r}")
    _check_triple(group["ns_coefficients"], "ns_coefficients")
    _finite_positive(group["eps"], "eps")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < _MAX_NS_ITERATIONS:
        raise ValueError(f"ns_steps must be an int in [1, {_MAX_NS_ITERATIONS}), got {steps!r}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {group['adjust_lr_fn']!r}"
        )
    schedule = group["ns_schedule"]
    if isinstance(schedule, str):
        if schedule != "standard" and schedule not in NS_SCHEDULES:
            raise ValueError(
                f"ns_schedule must be 'standard', {', '.join(map(repr, NS_SCHEDULES))}, None or "
                f"a list of (a, b, c) triples, got {schedule!r}"
            )
    elif schedule is not None:
        if not isinstance(schedule, Sequence) or not 1 <= len(schedule) < _MAX_NS_ITERATIONS:
            raise ValueError(
                f"an explicit ns_schedule must be a list of 1 to {_MAX_NS_ITERATIONS - 1} "
                f"(a, b, c) triples, got {schedule!r}"
            )
        for i, t in enumerate(schedule):
            _check_triple(t, f"ns_schedule[{i}]")
    beta2 = float(group["normuon_beta2"])
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid normuon_beta2 value: {group['normuon_beta2']}")
    _finite_positive(group["normuon_eps"], "normuon_eps")
    if group["sharded_mode"] not in SHARDED_MODES:
        raise ValueError(
            f"sharded_mode must be one of {SHARDED_MODES}, got {group['sharded_mode']!r}"
        )


def _check_live_shape(v: ParamView) -> None:
    """The parameter as it is now: still a 2-D matrix, of the shape its layout was
    computed for (a parameter's ``.data`` can be replaced between steps)."""
    live = tuple(v.key.shape)
    if len(live) != 2 or v.param.dim() != 2:
        raise ValueError(
            f"parameter '{v.name}': GefenMuon only supports 2-D parameters, got shape {live}"
        )
    if live != tuple(v.shape) or v.param.shape[1] != v.cols:
        raise ValueError(
            f"parameter '{v.name}': its shape changed from {tuple(v.shape)} to {live} after the "
            "optimizer first saw it; a parameter must keep its shape (build a new optimizer)"
        )


def _check_step_state(v: ParamView, st: dict) -> None:
    """The entries of a parameter's state that the step reads or writes, checked cheaply
    (types, dtypes, shapes; no values): a bad entry must fail before the first write."""
    name = v.name
    step = st.get("step")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise StateError(f"parameter '{name}': state 'step' must be an int >= 0, got {step!r}")
    period = st.get("period")
    if (
        isinstance(period, bool) or not isinstance(period, numbers.Integral)
        or not 1 <= period <= max(v.cols, 1) or v.cols % period
    ):
        raise StateError(
            f"parameter '{name}': state 'period' must be an int dividing {v.cols} columns, "
            f"got {period!r}"
        )
    device = v.param.device
    _check_state_tensor(st, "codes", name, torch.uint8, (v.local_rows, v.cols), device)
    _check_state_tensor(st, "magnitude", name, torch.float32, (v.local_rows, v.cols // int(period)), device)
    if "v" in st:
        _check_state_tensor(st, "v", name, torch.float32, (v.local_rows,), device)


def _check_state_tensor(st: dict, key: str, name: str, dtype: torch.dtype, shape: tuple,
                        device: torch.device) -> None:
    t = st.get(key)
    if not isinstance(t, torch.Tensor):
        raise StateError(f"parameter '{name}': state '{key}' must be a tensor, got {type(t).__name__}")
    t = local(t)
    if t.dtype != dtype or t.shape != shape or t.device != device:
        raise StateError(
            f"parameter '{name}': state '{key}' is {t.dtype} {tuple(t.shape)} on {t.device}, "
            f"expected {dtype} {shape} on {device}"
        )


def _as_tuple(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _normalised_schedule(schedule):
    if schedule is None or isinstance(schedule, str):
        return schedule
    try:
        return tuple(tuple(float(x) for x in t) for t in schedule)
    except (TypeError, ValueError):
        return schedule  # check_muon_hparams names the problem


# ------------------------------------------------------------- optimizer


class GefenMuon(_QuantizedOptimizer):
    r"""Muon with about one byte of optimizer state per parameter.

    For every 2-D parameter: the momentum ``m ← m + (1-β)(g - m)`` is kept as 8-bit codes
    into one learned 256-entry codebook times a float32 magnitude per block (the layout
    and first-step learning of :class:`gefen.Gefen`); the Newton–Schulz input is
    ``β·m_q + (1-β)·g`` with Nesterov, else ``m_q``, where ``m_q`` is the requantised
    momentum. The orthogonalised update ``O`` (bf16 Newton–Schulz, optionally NorMuon
    row-normalised) is applied as ``p ← p·(1 - lr·wd)`` then ``p ← p - lr·ratio·O`` with
    ``ratio`` from the parameter's shape (``adjust_lr_fn``).

    The positional signature and defaults are those of ``torch.optim.Muon``.

    Args:
        params: 2-D tensors, ``(name, tensor)`` pairs from ``named_parameters()``, or
            group dicts overriding any hyper-parameter below. Parameters of any other
            dimensionality raise ``ValueError`` (route them to another optimizer, or use
            :class:`gefen.GefenMuonHybrid`).
        lr (float or Tensor): learning rate.
        weight_decay (float): decoupled weight decay (multiplied by the unscaled ``lr``).
        momentum (float): momentum coefficient ``β`` in ``[0, 1)``.
        nesterov (bool): Nesterov momentum.
        ns_coefficients (tuple[float, float, float]): Newton–Schulz coefficients used
            ``ns_steps`` times when ``ns_schedule`` is None or ``"standard"``.
        eps (float): lower bound of the Frobenius norm the matrix is divided by.
        ns_steps (int): Newton–Schulz iterations (1 to 99) for the standard schedule.
        adjust_lr_fn (str or None): None or ``"original"`` scales the learning rate by
            ``sqrt(max(1, rows/cols))``; ``"match_rms_adamw"`` by ``0.2·sqrt(max(rows, cols))``.
        ns_schedule (str, list or None): ``"standard"`` (same as None), ``"tuned3"``,
            ``"tuned4"``, or an explicit list of ``(a, b, c)`` triples, one per iteration.
        normuon (bool): NorMuon row normalisation of the orthogonalised update (adds one
            float32 per row of state).
        normuon_beta2 (float): decay of NorMuon's row second moment.
        normuon_eps (float): added to NorMuon's denominator after the square root.
        sharded_mode (str): ``"exact"``, ``"distributed"`` or ``"approx"`` — how a
            row-sharded matrix is orthogonalised (DESIGN.md §4); on one process all
            three compute the same thing.
        codebook_refresh_every (int): relearn the codebook every N steps (0: never).
    """

    KIND = "gefen_muon"

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = STANDARD_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_schedule: str | Sequence[Sequence[float]] | None = None,
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        sharded_mode: str = "exact",
        codebook_refresh_every: int = 0,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=_as_tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_schedule=_normalised_schedule(ns_schedule),
            normuon=normuon,
            normuon_beta2=normuon_beta2,
            normuon_eps=normuon_eps,
            sharded_mode=sharded_mode,
        )
        check_muon_hparams(defaults)
        super().__init__(params, defaults, codebook_refresh_every=codebook_refresh_every)

    # ------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group (as ``torch.optim``); every parameter must be 2-D."""
        if isinstance(param_group, dict) and "ns_schedule" in param_group:
            param_group["ns_schedule"] = _normalised_schedule(param_group["ns_schedule"])
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        for i, p in enumerate(group["params"]):
            if p.dim() != 2:
                self.param_groups.pop()
                raise ValueError(
                    f"parameter '{param_name(group, gi, i)}': GefenMuon only supports 2-D "
                    f"parameters, got shape {tuple(p.shape)} (route it to Gefen or AdamW, "
                    "e.g. with GefenMuonHybrid)"
                )

    def _check_group(self, group: dict) -> None:
        check_muon_hparams(group)

    # ------------------------------------------------------------ state

    def _new_state(self, view: ParamView, period: int) -> dict:
        st = block_state(view, period)
        if view.group["normuon"]:
            st["v"] = row_vector(view)
        return st

    #: Options of the live optimizer a load keeps (the rest come from the checkpoint).
    _LIVE_OPTIONS = ("sharded_mode",)

    def _check_state(self, st: dict, p: torch.Tensor, name: str, group: dict) -> None:
        normuon = "v" in st
        if normuon != bool(group["normuon"]):  # the saved group's (restored with the load)
            raise StateError(
                f"parameter '{name}': the state {'has' if normuon else 'lacks'} NorMuon's row "
                f"moment 'v' but its group says normuon={bool(group['normuon'])}"
            )
        check_keys(st, name, set(COMMON_KEYS) | ({"v"} if normuon else set()))
        if normuon:
            check_tensor(st, "v", name, torch.float32, (p.shape[0],), moment=True)

    # ------------------------------------------------------------ step

    def _check_step_inputs(self, views: list[ParamView]) -> None:
        """Every check of the stepped matrices that must pass before anything is mutated:
        the parameter's *live* shape (the cached layout may predate a reshape) and the
        state entries the step reads or writes (that no two parameters share memory is the
        base's check)."""
        for v in views:
            _check_live_shape(v)
            st = self.state.get(v.key)
            if st:
                if bool(v.group["normuon"]) != ("v" in st):
                    raise ValueError(
                        f"parameter '{v.name}': the group's normuon={v.group['normuon']} does not "
                        "match the parameter's state (normuon cannot be switched after the first "
                        "step)"
                    )
                _check_step_state(v, st)

    @staticmethod
    def _chunks(views: list[ParamView]):
        """Consecutive runs of matrices of at most ``_CHUNK_ELEMENTS`` global elements
        (at least one matrix each): the unit of the scratch buffer and of the
        collectives of the sharded modes."""
        chunk, size = [], 0
        for v in views:
            n = v.numel
            if chunk and size + n > _CHUNK_ELEMENTS:
                yield chunk
                chunk, size = [], 0
            chunk.append(v)
            size += n
        if chunk:
            yield chunk

    @staticmethod
    def _chunk_outputs(chunk: list[ParamView], scratch: torch.Tensor) -> list[torch.Tensor]:
        """The local Newton–Schulz inputs of a chunk: consecutive views of the scratch."""
        outs, offset = [], 0
        for v in chunk:
            n = v.param.numel()
            outs.append(scratch[offset : offset + n].view(v.param.shape))
            offset += n
        return outs

    def _prepare_update(self, plan: StepPlan) -> None:
        """Per device: chunk the matrices, allocate one bf16 buffer for the largest
        chunk's local Newton–Schulz inputs, and build one validated ``_C.MuonStep`` per
        chunk against the very views the update will write (reused chunk after chunk)."""
        payload = []
        for device, views in group_by_device(plan.views, lambda v: v.param.device).items():
            chunks = list(self._chunks(views))
            size = max(sum(v.param.numel() for v in chunk) for chunk in chunks)
            scratch = torch.empty(size, dtype=torch.bfloat16, device=device)
            steps = []
            for chunk in chunks:
                outs = self._chunk_outputs(chunk, scratch)
                items = []
                for v, out in zip(chunk, outs):
                    st = plan.state_of(self, v.key)
                    items.append(MuonItem(
                        name=v.name, grad=v.grad.contiguous(), codes=plan.codes_of(self, v.key, st),
                        magnitude=local(st["magnitude"]), out=out, period=int(st["period"]),
                        beta=float(v.group["momentum"]), nesterov=bool(v.group["nesterov"]),
                    ))
                steps.append((chunk, outs, _C.MuonStep(items)))
            payload.append((device, steps))
        plan.payload = payload

    def _run_update(self, plan: StepPlan) -> None:
        nt = self._nthreads()
        for device, steps in plan.payload:
            stream, table = stream_of(device), self._device_table(plan.quantizer, device)
            for chunk, outs, step in steps:
                # a chunk's inputs are consumed (Newton–Schulz copies them) before the next
                # chunk overwrites the buffer
                step.momentum(plan.quantizer, nt, stream, table)
                updates = self._orthogonalize_chunk(chunk, outs)
                updates = self._normuon_chunk(plan, chunk, updates)
                for v, update in zip(chunk, updates):
                    if update is not None:
                        self._apply_update(plan, v, update)

    def _orthogonalize_chunk(self, chunk: list[ParamView], outs: list[torch.Tensor]) -> list:
        """Newton–Schulz of every matrix of a chunk, by each group's ``sharded_mode``
        (the local rows of the result; None for a rank without rows)."""
        results: list = [None] * len(chunk)
        by_mode: dict[str, list[int]] = {}
        for i, v in enumerate(chunk):
            by_mode.setdefault(v.group["sharded_mode"], []).append(i)
        for mode, idx in by_mode.items():
            res = orthogonalize(mode, [chunk[i] for i in idx], [outs[i] for i in idx],
                                self._newton_schulz, self._comm)
            for i, r in zip(idx, res):
                results[i] = r
        return results

    @staticmethod
    def _newton_schulz(v: ParamView, x: torch.Tensor) -> torch.Tensor:
        group = v.group
        return newton_schulz(x, ns_coefficient_schedule(group), float(group["eps"]))

    def _normuon_chunk(self, plan: StepPlan, chunk: list[ParamView], updates: list) -> list:
        """NorMuon for the matrices of groups that enable it: row normalisation on the
        local rows, then one reduction per shard group of the norms the rescale needs
        (``"approx"`` keeps its rows' own norms: no communication)."""
        idx = [i for i, v in enumerate(chunk) if v.group["normuon"]]
        if not idx:
            return updates
        buffers = ShardBuffers(torch.device("cpu"))
        rows, keys = {}, {}
        for i in idx:
            v = chunk[i]
            reduce_over = v.layout if v.group["sharded_mode"] != "approx" else _UNSHARDED
            keys[i] = buffers.reserve(reduce_over, 2)
        buffers.allocate()
        for i in idx:
            v, o = chunk[i], updates[i]
            st = plan.state_of(self, v.key)
            if o is None:  # no local rows: contributes nothing, still reduces
                continue
            rows[i], sums = normuon_rows(
                o, local(st["v"]), float(v.group["normuon_beta2"]), float(v.group["normuon_eps"]),
                int(st["step"]) + 1,
            )
            buffers.view(*keys[i], 2).copy_(sums)
        buffers.reduce(self._comm, "normuon", None)
        out = list(updates)
        for i in idx:
            if i in rows:
                out[i] = normuon_rescale(rows[i], buffers.view(*keys[i], 2))
        return out

    @staticmethod
    def _apply_update(plan: StepPlan, v: ParamView, update: torch.Tensor) -> None:
        """``p ← p·(1 - lr·wd)``, then ``p ← p - lr·ratio·O`` on the local rows (ratio
        from the global shape)."""
        group = v.group
        lr = plan.lr(group)
        rows, cols = v.shape
        p = v.param
        p.mul_(1.0 - lr * float(group["weight_decay"]))
        p.add_(update, alpha=-lr * lr_ratio(group["adjust_lr_fn"], rows, cols))
