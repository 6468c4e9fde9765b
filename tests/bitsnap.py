"""Bit-for-bit snapshots of tensors and state dicts, for the tests that check an error
left parameters and optimizer state exactly as they were (NaN payloads included)."""

from __future__ import annotations

import torch

from gefen._views import local


def bits(x):
    """A comparable copy of a tensor, state dict or list: every tensor as its dtype,
    shape and raw bytes (a DTensor: its local shard's)."""
    if isinstance(x, torch.Tensor):
        t = local(x).detach()
        return ("tensor", t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).clone())
    if isinstance(x, dict):
        return {k: bits(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [bits(v) for v in x]
    return x


def same_bits(a, b) -> bool:
    """Whether two :func:`bits` snapshots are identical."""
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return isinstance(b, tuple) and a[:3] == b[:3] and torch.equal(a[3], b[3])
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same_bits, a, b))
    return a == b


def assert_same_bits(a, b) -> None:
    """Assert two :func:`bits` snapshots are identical."""
    if isinstance(a, tuple) and a and a[0] == "tensor":
        assert a[:3] == b[:3] and torch.equal(a[3], b[3])
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_bits(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_bits(x, y)
    else:
        assert a == b
