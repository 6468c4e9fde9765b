"""What a gefen optimizer promises about its state and its checkpoints, as data.

``optimizer.contract()`` returns a frozen, versioned :class:`Contract`: every state field
with its dtype and geometry, the layouts the optimizer steps, and every checkpoint
transition with whether it is supported, how, and which tests exercise it. The
"Checkpoint transitions" table of COMPATIBILITY.md is generated from it
(``python -m gefen.contract``) and a test fails if the two differ; every transition
declared supported is exercised by the tests it names, and every one declared
unsupported raises in the tests it names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: Version of the contract's own format (bumped when fields change meaning).
CONTRACT_VERSION = 1


@dataclass(frozen=True)
class StateField:
    """One entry of a parameter's state."""

    name: str
    dtype: str
    geometry: str  # global shape and placement
    present: str  # when the entry exists


@dataclass(frozen=True)
class Transition:
    """A change between the saving and the loading side of a checkpoint."""

    name: str
    supported: bool
    how: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Contract:
    """The frozen description ``optimizer.contract()`` returns."""

    version: int
    kind: str
    schema: int
    state: tuple[StateField, ...]
    layouts: tuple[str, ...]
    transitions: tuple[Transition, ...]

    def as_dict(self) -> dict:
        """Plain nested dicts and lists (JSON-serialisable)."""
        return asdict(self)


ROWS = "rows placed like the parameter (Shard(0) rows shard, Replicate() replicates)"

_COMMON_STATE = (
    StateField("codes", "uint8", "the parameter's global shape, placed like the parameter", "always"),
    StateField("magnitude", "float32", f"(R, S/P), {ROWS}", "always"),
    StateField("codebook", "float32", "(256,), replicated; one per optimizer (shared)", "always"),
    StateField("step", "int", "scalar, identical on every rank", "always"),
    StateField("global_step", "int", "scalar, identical on every rank", "always"),
    StateField("period", "int", "scalar P (divides S), identical on every rank", "always"),
    StateField("digest_rows", "int64", f"(R,), {ROWS}: BLAKE2b of each row's state bytes and global index",
               "in state dicts; live from the first state_dict() on"),
    StateField("digest", "int64", "(2,), replicated: digests of v_col and the codebook",
               "in state dicts; live from the first state_dict() on"),
)

GEFEN_STATE = _COMMON_STATE + (
    StateField("factored", "int", "scalar 0 or 1", "always"),
    StateField("vmean", "float32", f"(R, S/P), {ROWS}", "block form (factored=0)"),
    StateField("v_row", "float32", f"(R,), {ROWS}", "factored form (factored=1, ndim >= 2)"),
    StateField("v_col", "float32", "(S,), replicated", "factored form"),
)

MUON_STATE = _COMMON_STATE + (
    StateField("v", "float32", f"(R,), {ROWS}", "normuon=True"),
)

LAYOUTS = (
    "plain tensors (one process, DDP replicas)",
    "DTensor Shard(0) on a 1-D mesh of any size, uneven and empty shards (FSDP2)",
    "DTensor Replicate() on every mesh dimension",
    "DTensor (Replicate(), Shard(0)) on a 2-D mesh (HSDP)",
    "meshes over a subgroup of the world; parameters on several meshes",
)

T = "tests/test_checkpoint_dcp.py::"
_TRANSITIONS = (
    Transition("same topology", True, "continued training is bit for bit the uninterrupted run",
               (T + "test_same_topology_continues_bitwise", "tests/test_gefen_api.py::test_state_dict_round_trip_continues_bitwise")),
    Transition("world size N -> M (uneven and empty shards)", True,
               "DCP reshards the state, which lives on the parameter's global grid; each rank re-checks its rows' digests",
               (T + "test_resume_on_another_topology", T + "test_matrix")),
    Transition("one process <-> sharded", True, "plain tensors are whole DTensors to DCP",
               (T + "test_resume_on_another_topology", T + "test_matrix")),
    Transition("replicated <-> Shard(0)", True, "resharded by DCP", (T + "test_resume_on_another_topology",)),
    Transition("HSDP (Replicate, Shard(0)) <-> FSDP Shard(0)", True, "resharded by DCP",
               (T + "test_resume_on_another_topology",)),
    Transition("dcp.save <-> dcp.async_save", True, "state_dict() returns copies; DCP stages them",
               (T + "test_resume_on_another_topology", T + "test_same_topology_continues_bitwise")),
    Transition("plain <-> flattened optimizer state dicts", True,
               "a flattened load into an optimizer without state needs gefen.dcp.prepare_load (else it raises)",
               (T + "test_resume_on_another_topology", "tests/test_gefen_api.py::test_dcp_state_dict_helpers_on_one_process",
                "tests/test_hybrid.py::test_dcp_state_dict_helpers_on_one_process")),
    Transition("fresh optimizer (no step taken)", True,
               "gefen.dcp.prepare_load(optimizer, checkpoint) allocates the saved layout first; without it the load raises. "
               "It matches state by parameter name, as DCP keys it (without torch.compile's `_orig_mod.` and activation "
               "checkpointing's `_checkpoint_wrapped_module.`): an optimizer built without names, or over a DDP model "
               "(`module.`), takes `model=` for a checkpoint keyed by the model's names (without it, or for another "
               "model's checkpoint, prepare_load raises before anything changes)",
               (T + "test_fresh_optimizer_without_prepare_load_raises", T + "test_resume_on_another_topology",
                "tests/test_prepare_load.py::test_checkpoint_under_names_the_optimizer_lacks_raises",
                "tests/test_prepare_load.py::test_checkpoint_of_another_model_raises_in_prepare_load",
                "tests/test_prepare_load.py::test_prepare_load_matches_names_through_wrappers",
                T + "test_ddp_model_prepares_with_model")),
    Transition("a full state dict held by rank 0 only (broadcast_from_rank0)", True,
               "gefen.dcp.prepare_load(optimizer, checkpoint, broadcast_from_rank0=True) gives every rank rank 0's "
               "layout, then torch's set_model_state_dict / set_optimizer_state_dict with broadcast_from_rank0; "
               "without it the ranks would prepare different state and raise together",
               ("tests/test_prepare_load.py::test_full_state_dict_broadcast_from_rank0",
                "tests/test_prepare_load.py::test_prepare_load_of_different_checkpoints_raises_on_every_rank")),
    Transition("Gefen factored -> block, block -> factored", True,
               "projected: vmean[i,b] = v_row[i] mean_b(v_col) / mean(v_row); v_row[i] = mean_b vmean[i,b], v_col[j] = mean_i vmean[i, j//P]",
               (T + "test_representation_changes_by_projection",)),
    Transition("GefenMuon sharded_mode -> any sharded_mode", True,
               "the state is row-sharded like the parameter in every mode", (T + "test_muon_modes_reshard_into_each_other",)),
    Transition("CPU offload on <-> off", True,
               "the state layout does not depend on the device. Run on an H200 (one rank, 2026-12-04): a checkpoint "
               "saved with offload resumes on the GPU, and one saved on the GPU (`dcp.async_save`, pinned-memory "
               "stager) resumes with offload, each with the same state. Needs a GPU (FSDP2 pins host memory): "
               "tools/gpu_check.sh's stage 3.",
               ("tools/gpu_check.sh",)),
    Transition("optimizer kind changes (Gefen <-> GefenMuon)", False, "raises before anything changes",
               (T + "test_checkpoint_of_another_model_or_optimizer", T + "test_bad_state_dict_raises_on_every_rank")),
    Transition("GefenMuonHybrid backup gefen <-> adamw", False, "raises before anything changes",
               ("tests/test_hybrid.py::test_bad_load_leaves_both_children_untouched",)),
    Transition("another model (names, shapes)", False, "raises before anything changes",
               (T + "test_checkpoint_of_another_model_or_optimizer",)),
    Transition("a newer state-dict schema", False, "raises before anything changes",
               (T + "test_bad_state_dict_raises_on_every_rank",)),
    Transition("damaged files (flipped byte, truncated, missing)", False,
               "raises on every rank before any optimizer state changes (digests; DCP's own read errors)",
               (T + "test_damaged_checkpoint_raises_everywhere_and_changes_nothing",)),
)


def contract_for(kind: str, schema: int) -> Contract:
    """The contract of an optimizer kind ("gefen", "gefen_muon", "gefen_muon_hybrid")."""
    state = {"gefen": GEFEN_STATE, "gefen_muon": MUON_STATE}.get(kind)
    if state is None:  # the hybrid: its children's fields
        state = MUON_STATE + tuple(f for f in GEFEN_STATE if f not in MUON_STATE)
    return Contract(CONTRACT_VERSION, kind, schema, state, LAYOUTS, _TRANSITIONS)


def transitions_markdown() -> str:
    """The "Checkpoint transitions" table of COMPATIBILITY.md."""
    lines = ["| transition | status | tested by |", "|---|---|---|"]
    for t in _TRANSITIONS:
        status = ("supported: " if t.supported else "refused: ") + t.how
        tests = ", ".join(f"`{x}`" for x in t.tests)
        lines.append(f"| {t.name} | {status} | {tests} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(transitions_markdown(), end="")
