"""GefenMuonHybrid(backup_optimizer="adamw") on DTensor parameters: ranks whose AdamW
half differs (a learning rate, a missing gradient, a step counter; a loaded lr or step)
raise the same error naming the parameter, on every rank, before either child changes
anything (a load whose Muon half differs on one rank, too); the next good step (or load) then works (DESIGN.md §4, §6).

The cases live in dist_cases_hybrid_agree.py (they run inside the spawned ranks).
"""

import dist_cases_hybrid_agree as H
import pytest

pytestmark = pytest.mark.distributed


def _all_raise_together(results, kind="RankDivergenceError") -> None:
    errors = [r["error"] for r in results]
    assert all(e is not None for e in errors), results
    assert all(e == errors[0] for e in errors), errors  # the same error on every rank
    assert errors[0][0] == kind, errors[0]
    assert results[0]["name"] in errors[0][1], errors[0]  # names the parameter
    assert "nothing was changed" in errors[0][1], errors[0]
    for r in results:
        assert r["unchanged"], r  # parameters, both children's state: bit for bit
        assert r["next_error"] is None, r
        assert r["next_stepped"] and r["same_across_ranks"], r


@pytest.mark.parametrize("what", ["lr", "grad", "step"])
def test_divergent_adamw_half_raises_on_every_rank_before_any_change(gloo_pools, what):
    results = gloo_pools(2).run(H.step_divergence, what)
    _all_raise_together(results)
    assert all(r["hybrid_collectives"] == 0 for r in results), results  # no extra agreement


def test_adamw_only_hybrid_agrees_on_its_own(gloo_pools):
    _all_raise_together(gloo_pools(2).run(H.adamw_only_missing_grad))


@pytest.mark.parametrize("what", ["lr", "step", "muon_lr", "muon_step"])
def test_divergent_half_of_a_load_is_refused_on_every_rank(gloo_pools, what):
    results = gloo_pools(2).run(H.load_divergence, what)
    _all_raise_together(results)
    assert all(r["good_load"] is None for r in results), results
