"""The collectives of a sharded step, all through ``torch.distributed`` (DESIGN.md §4).

One :class:`Comm` per optimizer. It knows the *agreement group* (every rank of every
mesh the optimizer's parameters live on), runs the one small header collective each
step (:meth:`Comm.agree`) through which every rank-local verdict passes before any rank
acts on it, batches the statistics reductions into flat buffers, and counts collectives
and bytes (``optimizer.comm_stats``) so tests and benchmarks can read them.

An optimizer whose parameters are all plain tensors has no ``Comm`` work to do: every
method is then a no-op (one process, or DDP where each rank steps identical replicas).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ._views import Layout, is_dtensor, mesh_ranks, meshes_of

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    dist = None


class RankDivergenceError(RuntimeError):
    """Ranks disagree about the optimizer (parameter list, shapes, placements, modes or
    which parameters have gradients). Raised on every rank, before anything changes."""


@dataclass
class CommStats:
    """Collectives issued by an optimizer: the last step's and the running totals."""

    collectives: int = 0
    bytes: int = 0
    total_collectives: int = 0
    total_bytes: int = 0
    by_kind: dict = field(default_factory=dict)

    def reset_step(self) -> None:
        self.collectives = 0
        self.bytes = 0
        self.by_kind = {}

    def count(self, kind: str, nbytes: int) -> None:
        self.collectives += 1
        self.bytes += nbytes
        self.total_collectives += 1
        self.total_bytes += nbytes
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1


#: Bits of the header digest compared across ranks (two int64 words).
_DIGEST_WORDS = 2

# Slots of the agreement buffer after the digest words (all reduced with MAX).
FLAG_ERROR = 0  # some rank's local checks raised
FLAG_ANY_GRAD = 1  # some rank has a non-zero gradient
FLAG_ANY_LR = 2  # some group has a non-zero learning rate (identical on every rank)
FLAG_NO_KEEP = 3  # some rank cannot keep this step's plan for the next steps (gefen/_steady.py)
_N_FLAGS = 4


def digest(parts: Iterable[str]) -> bytes:
    """A 128-bit digest of text parts (stdlib BLAKE2b), order-sensitive."""
    h = hashlib.blake2b(digest_size=8 * _DIGEST_WORDS)
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.digest()


def _words(d: bytes) -> list[int]:
    return [int.from_bytes(d[8 * i : 8 * i + 8], "little", signed=True) for i in range(_DIGEST_WORDS)]


class Comm:
    """Collectives over the ranks that share an optimizer's parameters."""

    def __init__(self) -> None:
        self.stats = CommStats()
        self._group_ranks: tuple[int, ...] | None = None
        self._mesh_ids: tuple[int, ...] | None = None
        self._group = None
        self._group_device: torch.device | None = None

    def __getstate__(self):
        # process groups are not picklable and belong to this process: rebuilt on use
        return {"stats": self.stats}

    def __setstate__(self, state):
        self.__init__()
        self.stats = state["stats"]

    # ------------------------------------------------------------ groups

    @staticmethod
    def distributed(params: Sequence[torch.Tensor]) -> bool:
        """Whether any parameter lives on a device mesh (then collectives are needed)."""
        return any(is_dtensor(p) for p in params)

    def group(self, params: Sequence[torch.Tensor]):
        """The agreement group: every rank of every mesh of ``params`` (WORLD when that
        is the whole world). Created once, by the member ranks only."""
        meshes = meshes_of(params)
        if self._mesh_ids == tuple(meshes):
            return self._group
        ranks = mesh_ranks(meshes.values())
        self._mesh_ids = tuple(meshes)
        key = tuple(sorted(ranks))
        if key != self._group_ranks:
            if key == tuple(range(dist.get_world_size())):
                self._group = dist.group.WORLD
            else:
                self._group = dist.new_group(list(key), use_local_synchronization=True)
            self._group_ranks = key
            self._group_device = None
        return self._group

    def device_for(self, group, like: torch.device) -> torch.device:
        """Where a buffer reduced over ``group`` must live: NCCL-only groups take CUDA
        tensors (host buffers, e.g. under CPU offload, are staged through the current
        CUDA device); gloo and mixed backends take the buffer where it is."""
        backend = str(dist.get_backend(group)).lower()
        if backend == "nccl" and like.type != "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return like

    def _reduce(self, kind: str, buf: torch.Tensor, group, op=None) -> torch.Tensor:
        """All-reduce ``buf`` in place over ``group`` (staging through the backend's
        device when needed); counted."""
        op = dist.ReduceOp.SUM if op is None else op
        dev = self.device_for(group, buf.device)
        self.stats.count(kind, buf.numel() * buf.element_size())
        if dev == buf.device:
            dist.all_reduce(buf, op=op, group=group)
            return buf
        staged = buf.to(dev)
        dist.all_reduce(staged, op=op, group=group)
        buf.copy_(staged)
        return buf

    # ------------------------------------------------------------ agreement

    def agree(
        self,
        params: Sequence[torch.Tensor],
        header: Sequence[str],
        flags: Sequence[int],
        error: BaseException | None,
    ) -> list[int]:
        """The step's one header collective: every rank's header digest, error flag and
        flags are reduced together (MAX), so every rank takes the same decision.

        Raises :class:`RankDivergenceError` on every rank when headers differ, and
        every rank raises the same error (type and message of the lowest failing rank)
        when a rank's local checks failed. Returns the reduced flags.
        """
        flags = list(flags)
        if len(flags) != _N_FLAGS:
            raise ValueError(f"gefen: an agreement takes {_N_FLAGS} flags, got {len(flags)}")
        flags[FLAG_ERROR] = 1 if error is not None else 0
        if not self.distributed(params):
            if error is not None:
                raise error
            return flags
        group = self.group(params)
        d = _words(digest(header))
        same, reduced, some_tried, _all_tried = self._agreement(group, d, flags, kept=False)
        if some_tried:  # a rank tried its kept plans: it takes the full path too, agree with it
            same, reduced, _some, _all = self._agreement(group, d, flags, kept=False)
        if reduced[FLAG_ERROR]:  # first: a failed rank's header may be incomplete
            self._raise_error(group, error)
        if not same:
            self._raise_divergence(group, header)
        if error is not None:  # unreachable: the flag was set
            raise error
        return reduced

    def agree_without_flags(self, params: Sequence[torch.Tensor], header: Sequence[str],
                            error: BaseException | None) -> None:
        """:meth:`agree` with no flags (a load's, a rebind's, ``prepare_load``'s): every
        rank raises the same error, or ranks whose headers differ raise
        :class:`RankDivergenceError` together, or none raises."""
        self.agree(params, header, [0] * _N_FLAGS, error)

    def all_fit(self, params: Sequence[torch.Tensor], header: Sequence[str], fits: bool) -> bool:
        """A kept step plan's agreement (gefen/_steady.py), in the place of the step's
        agreement: True on every rank when every rank tried its kept plans, every one
        fits and every header is equal; else False on every rank, and every rank that
        tried takes the full path. A rank already on the full path (it kept no plan, e.g.
        after a failure of its own) meets this collective with its :meth:`agree`, which
        sees that a rank tried and agrees once more, with it. Raises nothing of its own."""
        group = self.group(params)
        flags = [0] * _N_FLAGS
        flags[FLAG_ERROR] = 0 if fits else 1  # (read here only: "does not fit")
        same, reduced, _some, all_tried = self._agreement(group, _words(digest(header)), flags,
                                                          kept=True)
        return all_tried and not reduced[FLAG_ERROR] and same

    def _agreement(self, group, d: list[int], flags: list[int],
                   kept: bool) -> tuple[bool, list[int], bool, bool]:
        """One agreement collective (MAX) of the digest words, their negatives, the flags,
        whether this rank tried its kept plans and (negated) whether it did not. Returns
        whether every rank's digest is the same, the reduced flags, whether some rank
        tried its kept plans and whether every rank did."""
        tail = [1, -1] if kept else [0, 0]
        buf = torch.tensor(d + [-w for w in d] + flags + tail, dtype=torch.int64)
        self._reduce("agree", buf, group, dist.ReduceOp.MAX)
        vals = buf.tolist()
        hi, neg_lo = vals[:_DIGEST_WORDS], vals[_DIGEST_WORDS : 2 * _DIGEST_WORDS]
        reduced = vals[2 * _DIGEST_WORDS : 2 * _DIGEST_WORDS + _N_FLAGS]
        some_tried, neg_all = vals[-2:]
        return hi == [-w for w in neg_lo], reduced, bool(some_tried), neg_all == -1

    def _gather_objects(self, group, obj) -> list:
        out = [None] * dist.get_world_size(group)
        self.stats.count("gather_object", 0)
        dist.all_gather_object(out, obj, group=group)
        return out

    def _raise_divergence(self, group, header: Sequence[str]) -> None:
        headers = self._gather_objects(group, list(header))
        first = headers[0]
        for r, h in enumerate(headers):
            if h == first:
                continue
            for i in range(max(len(h), len(first))):
                a = first[i] if i < len(first) else "<nothing>"
                b = h[i] if i < len(h) else "<nothing>"
                if a != b:
                    raise RankDivergenceError(
                        f"gefen: ranks disagree about the optimizer: entry {i} is {a!r} on "
                        f"rank 0 of the group but {b!r} on rank {r} (every rank must build "
                        "the optimizer from the same parameters, in the same order, with the "
                        "same options, and give gradients to the same parameters); nothing "
                        "was changed"
                    )
        raise RankDivergenceError("gefen: ranks disagree about the optimizer; nothing was changed")

    def _raise_error(self, group, error: BaseException | None) -> None:
        mine = None if error is None else (type(error).__name__, str(error))
        errors = self._gather_objects(group, mine)
        rank, (kind, message) = next((r, e) for r, e in enumerate(errors) if e is not None)
        exc_type = {
            "ValueError": ValueError, "TypeError": TypeError,
            "NotImplementedError": NotImplementedError, "RankDivergenceError": RankDivergenceError,
        }.get(kind, RuntimeError)
        raise exc_type(f"{message} [raised on rank {rank} of the optimizer's group; nothing was changed]")

    # ------------------------------------------------------------ reductions

    def sum_int64(self, params: Sequence[torch.Tensor], buf: torch.Tensor, kind: str) -> torch.Tensor:
        """Sums an int64 buffer over the agreement group (exact). Callers zero the parts
        a rank must not count (replicated copies other than the primary one)."""
        if self.distributed(params):
            self._reduce(kind, buf, self.group(params))
        return buf

    def leader(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether this rank counts the plain (non-DTensor) parameters of a sharded
        optimizer in global statistics: they are replicas (as under DDP), counted once,
        by the group's first rank. Always True for one process."""
        if not self.distributed(params):
            return True
        self.group(params)
        return dist.get_rank() == self._group_ranks[0]

    def sum_by_shard_group(self, entries: Sequence[tuple[Layout, torch.Tensor]], kind: str) -> None:
        """Sums buffers over the shard group of their layout, one collective per group
        (buffers of one group must be views into one flat buffer: see
        :class:`ShardBuffers`)."""
        for layout, buf in entries:
            if layout.sharded:
                self._reduce(kind, buf, layout.shard_group)


class ShardBuffers:
    """Flat float64 buffers, one per shard group, handing out consecutive views: the
    factored column sums (and NorMuon's norms) of every parameter that shares a group
    are reduced in one collective. A trailing slot carries an error flag, so a rank
    that failed before the reduction makes every rank raise after it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sizes: dict[int, int] = {}
        self._layouts: dict[int, Layout] = {}
        self._flat: dict[int, torch.Tensor] = {}

    @staticmethod
    def _key(layout: Layout) -> int:
        return id(layout.shard_group) if layout.sharded else 0

    def reserve(self, layout: Layout, n: int) -> tuple[int, int]:
        """Reserve ``n`` slots in the buffer of ``layout``'s group: ``(key, offset)``."""
        key = self._key(layout)
        off = self._sizes.get(key, 0)
        self._sizes[key] = off + n
        self._layouts.setdefault(key, layout)
        return key, off

    def allocate(self) -> None:
        for key, size in self._sizes.items():
            self._flat[key] = torch.zeros(size + 1, dtype=torch.float64, device=self.device)

    def view(self, key: int, off: int, n: int) -> torch.Tensor:
        return self._flat[key][off : off + n]

    def reduce(self, comm: Comm, kind: str, error: BaseException | None) -> None:
        """Sum every sharded group's buffer; raise on every rank if any rank failed."""
        failed = 0
        for key, flat in self._flat.items():
            layout = self._layouts[key]
            if not layout.sharded:
                continue
            flat[-1] = 1.0 if error is not None else 0.0
            comm._reduce(kind, flat, layout.shard_group)
            failed = max(failed, int(flat[-1].item()))
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(
                f"gefen: {failed} rank(s) failed while computing this step's statistics "
                "(their own error says why); this rank raises too, before changing anything"
            )
