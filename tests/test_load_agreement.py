"""Distributed loads that differ between ranks (DESIGN.md §4–§5): ranks that load
different state dicts, a malformed local shard on one rank, state dicts whose entries
come in another order on one rank. Every rank raises the same error naming what is
wrong, nothing changes, and a good load and a step work after it; conversions pair
their collectives in the optimizer's own order.

The cases live in dist_cases_load_agree.py (they run inside the spawned ranks).
"""

import dist_cases_load_agree as D
import pytest

pytestmark = pytest.mark.distributed


def _same_error_everywhere(res: list, kind: str, *needles: str) -> None:
    for r in res:
        assert r["error"] is not None and r["error"][0] == kind, r
        for needle in needles:
            assert needle in r["error"][1], (needle, r)
        assert r["unchanged"], r
        assert r["good_load"] is None and r["step"] is None, r
    assert all(r["error"] == res[0]["error"] for r in res), res


@pytest.mark.parametrize("what, needles", [
    ("data", ["the loaded checkpoint:"]),
    ("steps", ["the loaded checkpoint: global_step=3", "global_step=4"]),
    ("lr", ["group 0 lr=0.01", "group 0 lr=0.02"]),
    ("param_step", ["parameter 'p0'", "step=2"]),
    ("v_col", ["parameter 'p0' v_col digest"]),
    ("replicated_rows", ["parameter 'p4'", "row digests"]),
])
def test_ranks_loading_different_state_raise_together(gloo_pools, what, needles):
    res = gloo_pools(2).run(D.divergent_load, what)
    _same_error_everywhere(res, "RankDivergenceError", "every rank must load the same checkpoint", *needles)


@pytest.mark.parametrize("field", ["codes", "magnitude", "vmean", "v_row"])
def test_misshaped_local_shard_on_one_rank_is_named(gloo_pools, field):
    res = gloo_pools(2).run(D.local_shard_shape, field)
    _same_error_everywhere(res, "ValueError", "parameter 'p0'", f"state '{field}'", "local shard",
                           "raised on rank 1")


def test_load_conversion_pairs_collectives_in_the_optimizers_order(gloo_pools):
    same = gloo_pools(2).run(D.convert_order, "same")
    reverse = gloo_pools(2).run(D.convert_order, "reverse")
    for r in same + reverse:
        assert r["error"] is None and r["step"] is None, r
        assert r["v_cols"], r
        for name, every in r["v_cols"].items():  # replicated: one value on every rank
            assert all(v == every[0] for v in every), (name, r)
    assert reverse[0]["v_cols"] == same[0]["v_cols"]
