"""Bit-for-bit snapshots of tensors and state dicts, for the tests that check an error
left parameters and optimizer state exactly as they were (NaN payloads included)."""

from __future__ import annotations

import torch


def bits(x):
    """A comparable copy of a tensor, state dict or list: every tensor as its dtype,
    shape and raw bytes."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        return ("tensor", t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).clone())
    if isinstance(x, dict):
        return {k: bits(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [bits(v) for v in x]
    return x


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
