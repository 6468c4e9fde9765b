"""How the optimizer sees a parameter: its key, its local shard and its place in the
global grid (DESIGN.md §1 and §4).

A parameter is a plain tensor (one process, DDP) or a DTensor whose placements are
``Replicate()`` or ``Shard(0)`` on each mesh dimension (FSDP2: ``(Shard(0),)``; HSDP:
``(Replicate(), Shard(0))``). Every state tensor that follows the parameter's rows is
laid out on the parameter's global grid, so a rank holds whole rows ``[row_offset,
row_offset + local rows)`` and everything downstream reads global facts (shape, rows)
from the view, never from the local tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._layout import rows_cols

try:  # torch.distributed is optional (some builds have none)
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch without distributed
    dist = None
    DTensor = None  # type: ignore[assignment, misc]


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (False when torch has no distributed package)."""
    return DTensor is not None and isinstance(t, DTensor)


def layout_text(p) -> str:
    """A parameter's layout as ranks compare it in their agreement headers: ``"local"``,
    or its mesh's shape and ranks and its placements."""
    if not is_dtensor(p):
        return "local"
    mesh = p.device_mesh.mesh
    return f"{tuple(mesh.shape)}{mesh.flatten().tolist()}{tuple(p.placements)}"


def meshes_of(params) -> dict[int, object]:
    """The device meshes of ``params``' DTensors, by ``id``, in first-seen order."""
    return {id(p.device_mesh): p.device_mesh for p in params if is_dtensor(p)}


def mesh_ranks(meshes) -> set[int]:
    """Every rank of the device meshes ``meshes``."""
    ranks: set[int] = set()
    for mesh in meshes:
        ranks.update(int(r) for r in mesh.mesh.flatten().tolist())
    return ranks


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (no copy, no autograd), else the tensor itself."""
    return getattr(t, "_local_tensor", t)


@dataclass(frozen=True, eq=False)
class Layout:
    """Where a parameter's rows live.

    ``mesh`` is None for a plain tensor. ``shard_dim`` is the mesh dimension carrying
    ``Shard(0)`` (None when the parameter is replicated on every mesh dimension);
    ``shard_group`` its process group, over which row statistics are reduced.
    ``primary`` says whether this rank's copy counts in global statistics
    (replicated copies are counted once: coordinate 0 on every ``Replicate`` dim).
    """

    mesh: object = None
    placements: tuple = ()
    shard_dim: int | None = None
    shard_group: object = None
    shard_size: int = 1
    shard_rank: int = 0
    primary: bool = True

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def sharded(self) -> bool:
        return self.shard_dim is not None and self.shard_size > 1

    def describe(self) -> str:
        """A stable text of the layout for agreement digests and error messages."""
        if self.mesh is None:
            return "local"
        ranks = self.mesh.mesh.flatten().tolist()
        return f"mesh{tuple(self.mesh.mesh.shape)}{ranks}:{self.placements}"


LOCAL = Layout()


def layout_of(p: torch.Tensor, name: str) -> Layout:
    """The layout of a parameter; ``NotImplementedError`` naming the parameter and the
    placement for anything but ``Replicate()`` and ``Shard(0)``."""
    if not is_dtensor(p):
        return LOCAL
    mesh, placements = p.device_mesh, tuple(p.placements)
    shard_dim = None
    for dim, pl in enumerate(placements):
        if isinstance(pl, Replicate):
            continue
        if type(pl) is Shard and pl.dim == 0 and shard_dim is None:
            shard_dim = dim
            continue
        raise NotImplementedError(
            f"parameter '{name}': placement {pl} on mesh dimension {dim} (placements "
            f"{placements}) is not supported; gefen steps parameters that are replicated or "
            "row-sharded (Shard(0)) on each mesh dimension, e.g. FSDP2 and HSDP"
        )
    coord = mesh.get_coordinate()
    if coord is None:
        raise RuntimeError(f"parameter '{name}': this rank is not part of the parameter's mesh")
    primary = all(c == 0 for d, c in enumerate(coord) if d != shard_dim)
    if shard_dim is None:
        return Layout(mesh, placements, None, None, 1, 0, primary)
    return Layout(
        mesh, placements, shard_dim, mesh.get_group(shard_dim), mesh.size(shard_dim),
        coord[shard_dim], primary,
    )


def row_range(global_rows: int, layout: Layout) -> tuple[int, int]:
    """``(row_offset, local_rows)`` of this rank: ``torch.chunk`` semantics over the
    shard dimension, as DTensor's ``Shard(0)`` splits (uneven and empty shards)."""
    if layout.shard_dim is None:
        return 0, global_rows
    chunk = math.ceil(global_rows / layout.shard_size) if global_rows else 0
    start = min(layout.shard_rank * chunk, global_rows)
    return start, min(chunk, global_rows - start)


@dataclass(eq=False)
class ParamView:
    """One parameter as a step sees it.

    ``key`` is the parameter the optimizer holds (an ``nn.Parameter``, possibly a
    DTensor); ``param``/``grad`` are its local shard and gradient (a DTensor's local
    shard detached; a plain parameter is ``key`` itself: steps run under ``no_grad``, and
    the C extension reads it through DLPack's exchange table, which needs no detach);
    ``shape`` is the *global* shape (``rows`` = R, ``cols`` = S) and ``row_offset`` the
    global index of the first of this rank's ``local_rows`` rows.
    """

    key: torch.Tensor
    name: str
    group: dict
    group_index: int
    index: int
    param: torch.Tensor
    grad: torch.Tensor | None
    shape: torch.Size
    row_offset: int
    layout: Layout
    rows: int
    cols: int
    local_rows: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True, eq=False)
class Placement:
    """What a step needs to know of a parameter that never changes: its name, layout
    and rows (global, and this rank's). Cached by the optimizer per parameter."""

    name: str
    layout: Layout
    shape: torch.Size
    rows: int
    cols: int
    row_offset: int
    local_rows: int


def place(key: torch.Tensor, name: str) -> Placement:
    """The :class:`Placement` of a parameter (its layout checked, its shard located)."""
    layout = layout_of(key, name)
    shape = key.shape
    rows, cols = rows_cols(shape)
    offset, nrows = row_range(rows, layout)
    lp = local(key)
    if layout.distributed and lp.dim() and lp.shape[0] != nrows:
        raise NotImplementedError(
            f"parameter '{name}': the local shard has {lp.shape[0]} rows where Shard(0) of "
            f"{shape[0]} rows over {layout.shard_size} ranks gives {nrows}; gefen supports "
            "even and torch.chunk-style uneven row shards"
        )
    local_rows = (lp.shape[0] if lp.dim() else 1) if layout.distributed else rows
    return Placement(name, layout, shape, rows, cols, offset, local_rows)


def laid_out_as(g, layout: Layout) -> bool:
    """Whether the DTensor gradient ``g`` has the placements and mesh of ``layout``."""
    return tuple(g.placements) == tuple(layout.placements) and (
        g.device_mesh is layout.mesh or g.device_mesh == layout.mesh
    )


def make_view(key: torch.Tensor, name: str, group: dict, gi: int, i: int,
              placement: Placement | None = None) -> ParamView:
    """The view of one parameter; ``placement``: its cached :func:`place`."""
    pl = placement if placement is not None else place(key, name)
    layout = pl.layout
    lp = local(key).detach() if layout.distributed else key  # a detach costs ~1 us
    g = key.grad
    if g is not None:
        lg = getattr(g, "_local_tensor", None)
        if lg is not None:
            if not laid_out_as(g, layout):
                raise NotImplementedError(
                    f"parameter '{name}': gradient placements {tuple(g.placements)} differ from "
                    f"the parameter's {tuple(layout.placements)}; gefen needs the gradient "
                    "sharded like the parameter (reduce it first)"
                )
            g = lg
        elif layout.distributed:
            raise TypeError(
                f"parameter '{name}': the parameter is a DTensor but its gradient is a plain "
                "tensor"
            )
        if g.requires_grad:  # a gradient that is itself part of a graph
            g = g.detach()
    local_rows = pl.local_rows if layout.distributed else (lp.shape[0] if lp.dim() else 1)
    return ParamView(key, name, group, gi, i, lp, g, pl.shape, pl.row_offset, layout, pl.rows,
                     pl.cols, local_rows)


def wrap_local(local_tensor: torch.Tensor, mesh, placements, shape=None, stride=None) -> torch.Tensor:
    """A DTensor around ``local_tensor`` as it is, on the device it is on.

    ``DTensor.from_local`` would copy the local tensor to the mesh's device type: under
    FSDP2's ``CPUOffloadPolicy`` the mesh is a CUDA mesh while the parameters' shards (and
    so the optimizer's state) live on the host. FSDP2 wraps its offloaded shards with
    this same constructor (``_from_local_no_grad``). No autograd, no communication: the
    caller vouches for the global ``shape`` and ``stride`` (default: the local ones)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = torch.Size(local_tensor.shape if shape is None else shape)
    stride = tuple(local_tensor.stride() if stride is None else stride)
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local_tensor.dtype))
    return DTensor(local_tensor, spec, requires_grad=False)


def make_row_state(view: ParamView, local_state: torch.Tensor, global_shape) -> torch.Tensor:
    """A state tensor that follows the parameter's rows: a DTensor with the parameter's
    mesh and placements when the parameter is one, else the local tensor."""
    if not view.layout.distributed:
        return local_state
    return wrap_local(local_state, view.layout.mesh, view.layout.placements,
                      global_shape, _contiguous_stride(global_shape))


def make_replicated(view: ParamView, t: torch.Tensor) -> torch.Tensor:
    """A state tensor every rank holds whole (column statistics, the codebook)."""
    if not view.layout.distributed:
        return t
    return wrap_local(t, view.layout.mesh, (Replicate(),) * view.layout.mesh.ndim)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def _byte_span(t: torch.Tensor) -> tuple[int, int, bool]:
    """``(begin, end, dense)``: the addresses a tensor can touch, ``[begin, end)``, and
    whether it touches every byte of them (strides are never negative in torch)."""
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    size = t.element_size()
    begin = t.data_ptr()
    return begin, begin + (extent + 1) * size, extent + 1 == t.numel()


def _share_memory(a: torch.Tensor, b: torch.Tensor, a0: int, b0: int) -> bool:
    """Whether two non-empty tensors whose spans intersect have a byte in common: their
    elements marked on a boolean map of the addresses they span (no data is read). The
    map has one entry per ``unit`` bytes, the largest unit that aligns both."""
    na, nb = a.element_size(), b.element_size()
    unit = math.gcd(na, nb, abs(a0 - b0))
    lo = min(a0, b0)
    hi = max(_byte_span(a)[1], _byte_span(b)[1])
    seen = torch.zeros((hi - lo) // unit, dtype=torch.bool)

    def cells(t: torch.Tensor, begin: int, n: int) -> torch.Tensor:
        k = n // unit
        return seen.as_strided(
            (*t.shape, k), (*(s * k for s in t.stride()), 1), (begin - lo) // unit
        )

    cells(a, a0, na).fill_(True)
    return bool(cells(b, b0, nb).any())


def check_disjoint(views: Sequence[ParamView]) -> None:
    """ValueError naming both parameters when a parameter is listed twice or two
    parameters' local tensors share memory. Address intervals are compared first (sorted,
    so ordinary models cost O(n log n)); two intervals that intersect are an overlap when
    both tensors are dense, otherwise their elements are compared exactly."""
    seen: dict[int, ParamView] = {}
    for v in views:
        first = seen.setdefault(id(v.key), v)
        if first is not v:  # (each listing is named by its own entry: _base._views)
            raise ValueError(
                f"parameters '{first.name}' and '{v.name}' are the same tensor: a "
                "parameter must be listed once"
            )
    spans = sorted(
        ((str(v.param.device), *_byte_span(v.param), i) for i, v in enumerate(views) if v.param.numel()),
        key=lambda s: (s[0], s[1]),
    )
    active: list[tuple] = []  # earlier spans of the same device that may reach further
    for span in spans:
        device, begin, _, dense, i = span
        active = [s for s in active if s[0] == device and s[2] > begin]
        for other in active:
            j = other[4]
            a, b = views[j].param, views[i].param
            if (dense and other[3]) or _share_memory(a, b, other[1], begin):
                first, second = sorted((i, j))
                raise ValueError(
                    f"parameters '{views[first].name}' and '{views[second].name}' overlap in "
                    "memory; each parameter must own its storage"
                )
        active.append(span)
