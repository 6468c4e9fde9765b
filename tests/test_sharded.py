"""Sharded training on spawned gloo process groups (CPU): every optimizer on DTensor
parameters (FSDP2 ``Shard(0)``, replicated, HSDP, uneven and empty shards, several
meshes, subgroup meshes) against the same optimizer on one process; ranks that
disagree or fail raise together, never hang, change nothing.

The cases themselves live in dist_cases.py (they run inside the spawned ranks).
"""

import dist_cases as D
import pytest
from dist_harness import Pool

pytestmark = pytest.mark.distributed

GEFEN_SHAPES = [(5, 4), (1, 4), (7,), (6, 8), (3, 4, 2), (2, 3)]
MUON_SHAPES = [(5, 4), (1, 4), (6, 8), (16, 12)]


def _exact(res: dict) -> None:
    assert res["periods_equal"] and res["codebook_equal"] and res["steps_equal"], res
    assert res["codes_equal_frac"] == 1.0, res
    assert res["max_param_diff"] == 0.0 and res["max_state_diff"] == 0.0, res


def _close(res: dict, params: float = 1e-6, state: float = 1e-6) -> None:
    assert res["periods_equal"] and res["codebook_equal"] and res["steps_equal"], res
    assert res["codes_equal_frac"] >= 0.999, res
    assert res["max_param_diff"] <= params and res["max_state_diff"] <= state, res


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("factored", [True, False])
def test_gefen_row_shards_match_one_process(gloo_pools, world, factored):
    # (5, 4) on 3 ranks is 2/2/1 rows, (1, 4) leaves ranks without rows, (2, 3) on 3
    # ranks leaves one empty: every rank still holds (empty) state and takes part
    for res in gloo_pools(world).run(D.parity, "gefen", GEFEN_SHAPES, "shard", 3,
                                     {"factored": factored}):
        if factored:
            _close(res)  # column sums are float all-reduces: reduction order only
        else:
            _exact(res)  # nothing crosses rows: bit for bit
        # the agreement, and the column sums when rows are split over more than one rank
        assert res["collectives_last_step"] == (2 if factored and world > 1 else 1), res


def test_first_step_learns_with_two_integer_reductions(gloo_pools):
    # periods of every parameter in one all-reduce, the histogram in another, each
    # around the agreement; later steps only agree (and reduce column sums)
    res = gloo_pools(2).run(D.parity, "gefen", GEFEN_SHAPES, "shard", 1, {"factored": False})[0]
    assert res["comm_kinds_last_step"] == {"agree": 2, "period": 1, "histogram": 1}, res


def test_gefen_shards_on_4_ranks_and_replicated(gloo_pools):
    for res in gloo_pools(4).run(D.parity, "gefen", GEFEN_SHAPES, "shard", 2, {}):
        _close(res)
    for res in gloo_pools(2).run(D.parity, "gefen", GEFEN_SHAPES, "replicate", 2, {}):
        _exact(res)  # replicated: every rank steps the whole parameter
        assert res["comm_kinds_last_step"] == {"agree": 1}, res


def test_gefen_hsdp_2x2(gloo_pools):
    for res in gloo_pools(4).run(D.parity, "gefen", GEFEN_SHAPES, "hsdp", 3, {}, (2, 2)):
        _close(res)


def test_gefen_bf16_and_stochastic_rounding_use_global_indices(gloo_pools):
    for res in gloo_pools(3).run(D.parity, "gefen", [(7, 6), (5, 8)], "shard", 3,
                                 {"stochastic_round": True, "factored": False}, None, "bfloat16"):
        _exact(res)


@pytest.mark.parametrize("mode", ["exact", "distributed"])
@pytest.mark.parametrize("world", [2, 3])
def test_gefen_muon_modes_match_one_process(gloo_pools, mode, world):
    for res in gloo_pools(world).run(D.parity, "muon", MUON_SHAPES, "shard", 3,
                                     {"sharded_mode": mode}):
        _exact(res)  # the full matrices are reassembled bit for bit
    kinds = gloo_pools(world).run(D.parity, "muon", MUON_SHAPES, "shard", 2,
                                  {"sharded_mode": mode})[0]["comm_kinds_last_step"]
    assert kinds == ({"agree": 1, "all_gather": 1} if mode == "exact"
                     else {"agree": 1, "all_to_all": 2}), kinds


def test_gefen_muon_normuon_reduces_norms(gloo_pools):
    # NorMuon's rescale sums squares over the ranks' rows (float64): reduction order only
    for mode in ("exact", "distributed"):
        for res in gloo_pools(2).run(D.parity, "muon", MUON_SHAPES, "shard", 1,
                                     {"sharded_mode": mode, "normuon": True}):
            _close(res, params=1e-6, state=1e-8)


def test_gefen_muon_approx_is_deterministic_and_sane(gloo_pools):
    a = gloo_pools(2).run(D.parity, "muon", MUON_SHAPES, "shard", 3, {"sharded_mode": "approx"})
    b = gloo_pools(2).run(D.parity, "muon", MUON_SHAPES, "shard", 3, {"sharded_mode": "approx"})
    assert a == b  # against itself: the same run twice gives the same numbers
    for res in a:
        # local rows are orthogonalised alone: not one process's numbers, but close
        assert res["periods_equal"] and res["codebook_equal"], res
        assert 0.0 < res["max_param_diff"] < 0.05, res
        assert res["comm_kinds_last_step"] == {"agree": 1}, res


def test_parameters_on_several_meshes(gloo_pools):
    for kind in ("gefen", "muon"):
        for res in gloo_pools(4).run(D.mixed_meshes, kind, {}):
            _close(res)


def test_mesh_over_a_subgroup(gloo_pools):
    res = gloo_pools(3).run(D.subgroup_mesh, "gefen")
    assert res[2] is None
    for r in res[:2]:
        _close(r)


# ------------------------------------------------------------------ FSDP2


@pytest.mark.parametrize("kind", ["gefen", "gefen-block"])
def test_fsdp2_training_matches_one_process(gloo_pools, kind):
    for res in gloo_pools(2).run(D.fsdp_training, kind, 4):
        assert res["losses"] == res["ref_losses"], res
        assert res["max_param_diff"] <= 1e-6, res



@pytest.mark.parametrize("kind", ["gefen", "gefen-block"])
def test_fsdp2_mixed_precision_matches_one_process(gloo_pools, kind):
    # bf16 compute, float32 reduction and master parameters (what the optimizer sees)
    for res in gloo_pools(2).run(D.fsdp_mixed_precision_training, kind, 4):
        assert res["dtypes"] == ["torch.float32"], res
        assert res["losses"] == res["ref_losses"] and res["same"], res

@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_fsdp2_hybrid_matches_one_process(gloo_pools, backup):
    for res in gloo_pools(2).run(D.fsdp_training, f"hybrid-{backup}", 4):
        # NorMuon's float64 norm sums differ by reduction order; bf16 Newton–Schulz
        # amplifies that over steps, so compare the losses
        assert res["losses"][0] == res["ref_losses"][0], res
        for a, b in zip(res["losses"], res["ref_losses"]):
            assert abs(a - b) <= 1e-4 * abs(b), res


def test_fsdp2_hsdp_training(gloo_pools):
    for res in gloo_pools(4).run(D.fsdp_training, "gefen", 3, (2, 2)):
        assert res["losses"] == res["ref_losses"], res


def test_fsdp2_on_gloo_averages_gradients(gloo_pools):
    # PyTorch issue 162338: older FSDP2 summed gradients on gloo. With the pinned torch
    # they are averaged like NCCL, which the parity tests above rely on.
    for ratios in gloo_pools(2).run(D.fsdp_grads_are_averaged):
        assert all(abs(r - 1.0) < 1e-5 for r in ratios), ratios


# ------------------------------------------------------------------ failures


def test_unsupported_placement_is_refused_at_construction(gloo_pools):
    for msg in gloo_pools(2).run(D.unsupported_placement):
        assert msg is not None and "'w'" in msg and "S(1)" in msg and "not supported" in msg


def test_state_stays_beside_host_shards_of_an_accelerator_mesh():
    # FSDP2 + CPUOffloadPolicy: a CUDA mesh whose shards live on the host (found on an
    # H200, 2026-12-04: the state was copied to the GPU and the step refused it). The
    # case relabels a mesh, which torch's caches keep: a pool of its own, closed after
    pool = Pool(2)
    try:
        res = pool.run(D.host_shards_on_an_accelerator_mesh, ("gefen", "muon"))
    finally:
        pool.close()
    for by_kind in res:
        for kind in ("gefen", "muon"):
            r = by_kind[kind]
            assert r["global_step"] == 2, (kind, r)
            assert r["state"] == r["exported"] == r["prepared"] == ["cpu"], (kind, r)


@pytest.mark.parametrize("what", ["order", "option", "grad"])
def test_divergent_ranks_raise_everywhere(gloo_pools, what):
    res = gloo_pools(2).run(D.divergence, what, timeout=60)
    for r in res:
        assert r["unchanged"], r
        assert r["error"] is not None and r["error"][0] == "RankDivergenceError", r
        assert "ranks disagree" in r["error"][1], r
    assert res[0]["error"] == res[1]["error"]  # the same message on every rank


def test_divergent_muon_mode_raises_everywhere(gloo_pools):
    for r in gloo_pools(2).run(D.divergence, "option", "muon", timeout=60):
        assert r["unchanged"] and r["error"][0] == "RankDivergenceError", r
        assert "sharded_mode" in r["error"][1], r


@pytest.mark.parametrize("kind", ["gefen", "muon"])
def test_a_rank_failing_validation_makes_every_rank_raise(gloo_pools, kind):
    res = gloo_pools(2).run(D.rank_fails, "grad", kind, timeout=60)
    for r in res:
        assert r["unchanged"], r
        assert r["error"][0] == "NotImplementedError", r
        assert "parameter 'b': gradient placements" in r["error"][1], r
        assert "raised on rank 1" in r["error"][1], r


def test_a_rank_failing_in_the_statistics_phase_makes_every_rank_raise(gloo_pools):
    res = gloo_pools(2).run(D.rank_fails, "stats", timeout=60)
    assert res[1]["error"] == ("RuntimeError", "simulated failure in the statistics phase")
    assert res[0]["error"][0] == "RuntimeError" and "1 rank(s) failed" in res[0]["error"][1]
    assert all(r["unchanged"] for r in res), res


@pytest.mark.parametrize("kind", ["gefen", "hybrid-adamw"])
def test_rebind_after_fully_shard(gloo_pools, kind):
    for res in gloo_pools(2).run(D.fsdp_rebind, kind):
        assert res["same"] and res["dtensors"], res
        assert "only allowed before the optimizer's first step" in res["late"], res
        assert "is not a parameter of the model" in res["one_rank"], res
        assert "raised on rank 1" in res["one_rank"] and res["unchanged"], res


# ------------------------------------------------------------ steady steps


@pytest.mark.parametrize("factored", [True, False])
def test_kept_plans_step_sharded_parameters_bit_for_bit(gloo_pools, factored):
    # the two-phase plans of row-sharded parameters (and the whole step of the
    # replicated one) kept and run again, against an optimizer that never keeps them
    for res in gloo_pools(2).run(D.steady_steps, factored, None, timeout=120):
        assert all(res["same"]), res
        assert res["runs"][:2] == [None, None] and all(res["runs"][2:]), res
        assert all(e == [None, None] for e in res["errors"]), res


@pytest.mark.parametrize("event", ["transposed", "no_grad", "lr", "dropped"])
def test_one_rank_leaving_the_kept_plans_takes_every_rank_with_it(gloo_pools, event):
    # rank 1 alone sees the event: the kept plans' agreement sends every rank down the
    # full path (no rank waits in another collective), which proceeds with the same bits
    # or raises the same error everywhere, changing nothing; a rank that kept no plan
    # ("dropped") meets the others' kept-plan agreement with its full agreement
    res = gloo_pools(2).run(D.steady_steps, True, event, timeout=120)
    for r in res:
        assert all(r["same"]), r
        assert all(r["runs"][2:4]) and not any(r["runs"][4:]), r
        for step, errors in enumerate(r["errors"]):
            assert errors[0] == errors[1], r  # kept side == never-kept side
            if step < 4 or event in ("transposed", "dropped"):
                assert errors[0] is None, r
            else:
                assert errors[0][0] == "RankDivergenceError", r
    assert res[0]["errors"] == res[1]["errors"]
