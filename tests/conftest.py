"""Shared pytest setup: the oracle module (tests/reference.py) is importable as `reference`."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gloo_pools():
    """Spawned gloo groups shared by every distributed test of the session, created on
    first use per world size (``pools(n)``) and closed at the end."""
    from dist_harness import Pool

    pools: dict[int, Pool] = {}

    def get(world_size: int) -> Pool:
        pool = pools.get(world_size)
        if pool is None or pool.broken:  # a timed-out case kills its pool: start anew
            pool = pools[world_size] = Pool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()
