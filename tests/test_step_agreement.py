"""The step's agreement covers everything a rank can change between steps that changes
the step's collectives or numbers (DESIGN.md §4): the codebook refresh setting, each
parameter's step counter and every group option, on the full path and on the kept-plan
(steady) path. One rank differing makes every rank raise the same RankDivergenceError
naming it, before anything changes; once undone, every rank steps on.

The cases live in dist_cases_step_agree.py (they run inside the spawned ranks).
"""

import dist_cases_step_agree as D
import pytest

pytestmark = pytest.mark.distributed

CASES = [
    # kind, what rank 1 changes, keep plans, what the error names
    ("gefen", "refresh", True, "codebook_refresh_every=2"),  # setting differs, no refresh due
    ("gefen", "refresh_due", False, "codebook_refresh_every=3"),  # rank 1 alone would relearn
    ("muon", "refresh_due", False, "codebook_refresh_every=3"),
    ("gefen", "step", False, "|step=4"),  # full path
    ("gefen", "step", True, "|step=4"),  # kept-plan path
    ("muon", "step", False, "|step=4"),
    ("gefen", "factored", True, "factored=False"),  # an option on the kept-plan path
    ("gefen", "period", True, "period='row'"),
]


@pytest.mark.parametrize("kind,what,steady,names", CASES, ids=[f"{k}-{w}-{'kept' if s else 'full'}"
                                                                for k, w, s, _ in CASES])
def test_one_rank_differing_raises_everywhere_and_changes_nothing(gloo_pools, kind, what, steady, names):
    res = gloo_pools(2).run(D.diverge, kind, what, steady, timeout=60)
    for r in res:
        assert r["kept"] == (steady and kind == "gefen"), r  # the path the case means to take
        assert r["error"] is not None and r["error"][0] == "RankDivergenceError", r
        assert names in r["error"][1] and "nothing was changed" in r["error"][1], r
        assert r["unchanged"], r  # parameters, state and global step, bit for bit
        assert r["after"] == [None, None] and r["global_step"] == 5, r  # undone: steps on
    assert res[0]["error"] == res[1]["error"]  # the same message on every rank


def test_an_invalid_refresh_setting_on_one_rank_raises_everywhere(gloo_pools):
    # rank 1's attribute set to a str after construction: its local check fails and every
    # rank raises it (no rank left waiting in a collective)
    res = gloo_pools(2).run(D.diverge, "gefen", "refresh_bad", True, timeout=60)
    for r in res:
        assert r["error"][0] == "TypeError" and "codebook_refresh_every" in r["error"][1], r
        assert "raised on rank 1" in r["error"][1], r
        assert r["unchanged"] and r["after"] == [None, None] and r["global_step"] == 5, r
