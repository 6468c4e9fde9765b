"""The benchmark scripts run end to end in their --quick modes and report what they say
they measure: every requested row, positive times, byte counts that follow the formulas
(ALGORITHM.md §4; step_time.py's bytes moved per step). The real numbers come from
running them by hand."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _run(script, *args, tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, os.path.join(BENCH, script), "--quick", "--json", str(out), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["gefen"].startswith("0.")
    return result


def _quick_model_shapes():
    """Parameter shapes of memory.py's --quick model (built here the same way)."""
    sys.path.insert(0, BENCH)
    try:
        import _common as C
        import memory
    finally:
        sys.path.remove(BENCH)
    return [tuple(p.shape) for p in C.GPT(memory.QUICK_CFG).parameters()]


def test_memory_benchmark_counts_what_the_formulas_give(tmp_path):
    result = _run("memory.py", "--optimizers", "adamw,gefen,hybrid-gefen", tmp_path=tmp_path)
    shapes = _quick_model_shapes()
    n = sum(math.prod(s) for s in shapes)
    assert result["params"] == n
    rows = {r["optimizer"]: r for r in result["results"]}
    assert list(rows) == ["adamw", "gefen", "hybrid-gefen"]
    for r in rows.values():
        assert r["params"] == n and r["seconds"] > 0
        assert r["state_bytes"] == sum(e["bytes"] for e in r["breakdown"].values())
        assert r["bytes_per_param"] == pytest.approx(r["state_bytes"] / n, rel=1e-12)

    # AdamW: exp_avg and exp_avg_sq are 4 B each per parameter, plus one step scalar each
    adamw = rows["adamw"]["breakdown"]
    assert adamw["exp_avg"]["bytes"] == adamw["exp_avg_sq"]["bytes"] == 4 * n
    assert rows["adamw"]["bytes_per_param"] == pytest.approx(8.0, rel=1e-4)

    # Gefen (factored): 1 B of codes per parameter, one shared 256-entry codebook, and with
    # the benchmark's i.i.d. gradients whole-row periods: a matrix R x S costs
    # RS + 4R (magnitudes) + 4R + 4S (v_row, v_col) bytes, a vector of n: 9n (P = 1)
    gefen_rows = rows["gefen"]["breakdown"]
    assert gefen_rows["codes"]["bytes"] == n
    assert gefen_rows["codebook"]["bytes"] == 256 * 4 and gefen_rows["codebook"]["tensors"] == 1
    matrices = [s for s in shapes if len(s) >= 2]
    assert gefen_rows["v_row"]["bytes"] == sum(4 * s[0] for s in matrices)
    assert gefen_rows["v_col"]["bytes"] == sum(4 * math.prod(s[1:]) for s in matrices)
    formula = 1024 + sum(
        math.prod(s) + 8 * s[0] + 4 * math.prod(s[1:]) if len(s) >= 2 else 9 * math.prod(s)
        for s in shapes
    )
    assert rows["gefen"]["state_bytes"] == pytest.approx(formula, rel=1e-3)
    assert rows["gefen"]["verdict"] == "PASS" and rows["gefen"]["bytes_per_param"] <= 1.05

    # the hybrid (Gefen backup): 1 B of codes per parameter in both children, two codebooks
    hybrid = rows["hybrid-gefen"]["breakdown"]
    assert hybrid["codes"]["bytes"] == n
    assert hybrid["codebook"]["bytes"] == 2 * 256 * 4
    assert 1.0 < rows["hybrid-gefen"]["bytes_per_param"] <= 1.1


def test_step_time_benchmark_reports_every_row(tmp_path):
    result = _run("step_time.py", "--optimizers", "adamw-fused,gefen", "--dtypes", "fp32,bf16",
                  tmp_path=tmp_path)
    rows = {(r["set"], r["dtype"], r["optimizer"]): r for r in result["results"]}
    sizes = list(result["shapes"])
    assert sizes, result["shapes"]
    expected = {(s, d, o) for s in sizes for d in ("fp32", "bf16") for o in ("adamw-fused", "gefen")}
    assert set(rows) == expected and len(result["results"]) == len(expected)
    for (size, dtype, opt), r in rows.items():
        n = sum(math.prod(s) for s in result["shapes"][size])
        assert r["params"] == n
        assert 0 < r["min_ms"] <= r["median_ms"]
        # bytes moved per step: read + write the parameter, read the gradient, read + write
        # the state
        elt = 4 if dtype == "fp32" else 2
        assert r["bytes_per_step"] == n * 3 * elt + 2 * r["state_bytes"]
        assert r["GB_per_s"] == pytest.approx(r["bytes_per_step"] / (r["median_ms"] * 1e6), rel=1e-9)
        reference = rows[(size, dtype, "adamw-fused")]
        assert r["ratio"] == pytest.approx(r["median_ms"] / reference["median_ms"], rel=1e-9)
        per_param = r["state_bytes"] / n
        if opt == "adamw-fused":  # exp_avg and exp_avg_sq in the parameter's dtype
            assert per_param == pytest.approx(2 * elt, rel=1e-3)
        else:
            assert 1.0 < per_param <= 1.05


def test_step_time_model_shaped_set(tmp_path):
    """The 146-tensor set of 12 GPT-2 layers (docs/performance.md): its shapes and
    parameter count as documented, every optimizer stepped on it."""
    result = _run("step_time.py", "--sizes", "12x256", "--optimizers", "gefen,gefen-block",
                  "--dtypes", "fp32", tmp_path=tmp_path)
    shapes = result["shapes"]["12x256"]
    assert len(shapes) == 146 and sum(len(s) == 1 for s in shapes) == 98
    assert sum(math.prod(s) for s in shapes) == 9_477_632
    rows = {r["optimizer"]: r for r in result["results"]}
    assert set(rows) == {"gefen", "gefen-block"}
    for r in rows.values():
        assert r["params"] == 9_477_632 and 0 < r["min_ms"] <= r["median_ms"]
        assert 1.0 < r["state_bytes"] / r["params"] <= 1.07


def test_loss_parity_benchmark_trains_every_optimizer(tmp_path):
    names = ["adamw", "gefen", "hybrid-gefen"]
    result = _run("loss_parity.py", "--optimizers", ",".join(names), tmp_path=tmp_path)
    steps = result["config"]["steps"]
    runs = {r["optimizer"]: r for r in result["runs"]}
    assert list(runs) == names  # --quick: one lr per optimizer
    for r in runs.values():
        assert not r["diverged"] and r["steps_run"] == steps
        assert r["train_time_s"] > 0 and r["ms_per_step"] > 0
        assert set(r["evals"]) == {str(steps // 2), str(steps)}
        # a byte-level model starts at about ln(256) and must have learned something
        assert r["final_eval"] == r["evals"][str(steps)] < math.log(256) - 1
    summary = {s["optimizer"]: s for s in result["summary"]}
    assert list(summary) == names
    for name, s in summary.items():
        assert s["best_eval"] == runs[name]["final_eval"]
        assert s["ratio_adamw"] == pytest.approx(s["best_eval"] / runs["adamw"]["final_eval"], rel=1e-12)
    assert summary["adamw"]["verdict"] == "reference"
    assert all(summary[n]["verdict"] in ("PASS", "MISS") for n in names[1:])


def test_step_overhead_times_the_c_calls_of_a_step(tmp_path):
    # the C work of a step runs in the methods of the plans _C builds (AdamStep.step for
    # CPU parameters, between AdamStep.rebind and unbind once a plan is kept): the
    # benchmark must time those, not only their construction
    for path, calls in (("steady", ("AdamStep.rebind", "AdamStep.unbind", "AdamStep.step")),
                        ("full", ("AdamStep", "AdamStep.step"))):
        result = _run("step_overhead.py", "--optimizers", "gefen,gefen-block", "--dtypes",
                      "fp32,bf16", *(["--full"] if path == "full" else []), tmp_path=tmp_path)
        assert result["path"] == path
        rows = result["results"]
        assert [(r["optimizer"], r["dtype"]) for r in rows] == [
            ("gefen", "fp32"), ("gefen-block", "fp32"), ("gefen", "bf16"), ("gefen-block", "bf16")]
        for r in rows:
            parts = r["parts_ms"]
            assert r["step_ms"] > 0 and all(parts[c] > 0 for c in calls), parts
            assert set(parts) == {"(outside C)", *calls}, parts
            assert parts[calls[-1]] < r["step_ms"] and parts["(outside C)"] < r["step_ms"]


def test_muon_momentum_runs_the_step_plan(tmp_path):
    # GefenMuon's momentum runs through the _C.MuonStep plan; the benchmark called a
    # function the extension no longer has until this test covered it
    result = _run("muon_momentum.py", tmp_path=tmp_path)
    (row,) = result["results"]
    assert row["set"] == "1M" and row["params"] == 4 * 512 * 512
    assert row["torch_ms"] > 0 and row["gefen_ms"] > 0


def test_factored_plan_compares_the_two_forms_and_the_choice(tmp_path):
    # three optimizers on one set: forced two-phase, forced momentum-in-statistics, and the
    # optimizer's own choice, which has finished measuring after the warm-up steps
    result = _run("factored_plan.py", tmp_path=tmp_path)
    (row,) = result["results"]
    assert row["set"] == "1M" and row["dtype"] == "fp32" and row["params"] == 4 * 512 * 512 + 2 * 512
    assert set(row["median_ms"]) == {"two-phase", "in-stats", "chosen"}
    assert all(t > 0 for t in row["median_ms"].values())
    assert row["chosen"] in ("two-phase", "in-stats") and row["bit_identical"] is True
    assert all(t > 0 for t in row["tuner_medians_ms"].values())


def test_checkpoint_benchmark_saves_and_loads_through_dcp(tmp_path):
    result = _run("checkpoint.py", "--optimizers", "adamw,gefen", "--repeats", "1",
                  tmp_path=tmp_path)
    rows = {r["optimizer"]: r for r in result["results"]}
    assert list(rows) == ["adamw", "gefen"] and result["params"] > 0
    for r in rows.values():
        assert r["bytes_on_disk"] > 0 and r["save_s"] > 0 and r["load_s"] > 0
        assert r["bytes_per_param"] == pytest.approx(r["bytes_on_disk"] / result["params"])
    # AdamW's two fp32 moments, plus DCP's metadata; Gefen's codes, far less
    assert 8.0 <= rows["adamw"]["bytes_per_param"] < 8.5
    assert rows["gefen"]["bytes_per_param"] < rows["adamw"]["bytes_per_param"] / 4
    assert rows["adamw"]["verdict"] == "" and rows["gefen"]["verdict"] in ("PASS", "MISS")


def test_sharded_step_benchmark_runs_fsdp2_on_two_ranks(tmp_path):
    result = _run("sharded_step.py", "--optimizers", "adamw-fused,gefen", "--steps", "2",
                  "--warmup", "1", tmp_path=tmp_path)
    rows = {r["optimizer"]: r for r in result["results"]}
    assert list(rows) == ["adamw-fused", "gefen"] and result["config"]["ranks"] == 2
    for r in rows.values():
        assert r["step_ms"] > 0 and len(r["state_bytes_per_rank"]) == 2
    assert rows["adamw-fused"]["collectives"] == 0
    # the factored form all-reduces its column statistics across the ranks
    assert rows["gefen"]["collectives"] > 0 and rows["gefen"]["comm_bytes"] > 0
    assert rows["adamw-fused"]["bytes_per_param"] == pytest.approx(8.0, rel=1e-3)
    assert rows["gefen"]["bytes_per_param"] < 1.2


def _cc():
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@pytest.mark.skipif(_cc() is None, reason="no C compiler")
def test_c_benchmarks_build_and_core_step_runs(tmp_path):
    """core_breakdown.c, core_step.c, kernel_ab.c and search_ports.c use the core's
    internal primitives (block_ops.h and the kernels' headers), whose signatures change
    with the kernels: all four must still compile and link, and core_step must run a
    tiny set (d = 64, two steps) through every phase it reports."""
    core = sorted(
        os.path.join(ROOT, "csrc", "core", f)
        for f in os.listdir(os.path.join(ROOT, "csrc", "core")) if f.endswith(".c")
    )
    flags = ["-std=c11", "-O1", "-ffp-contract=off", "-fopenmp", "-Wall", "-Werror",
             "-Wno-missing-field-initializers", "-I", os.path.join(ROOT, "csrc", "core")]
    r = subprocess.run([_cc(), *flags, "-c", *core], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)  # the core once, for both programs
    assert r.returncode == 0, r.stderr[-3000:]
    objects = sorted(str(f) for f in tmp_path.glob("*.o"))
    for prog in ("core_breakdown", "core_step", "kernel_ab", "search_ports"):
        r = subprocess.run(
            [_cc(), *flags, os.path.join(BENCH, prog + ".c"), *objects,
             "-o", str(tmp_path / prog), "-lm"], capture_output=True, text=True, timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(tmp_path / "core_step"), "64", "2", "fp32,bf16,fp16"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for dtype in ("fp32", "bf16", "fp16"):
        for nt in (1, 2):
            assert f"{dtype}, {nt} thread(s)" in r.stdout
    for what in ("block: update", "factored: whole step", "gefen_adam_step (one call)",
                 "GefenMuon momentum"):
        assert r.stdout.count(what) == 6, what
    # kernel_ab: the portable code against the table this CPU uses (the portable code
    # itself where it has none), outputs compared bit for bit before any timing
    for table in ("avx512bf16", "avx512vbmi", "avx512", "avx2", "portable"):
        r = subprocess.run([str(tmp_path / "kernel_ab"), "portable", table, "136", "3", "2"],
                           capture_output=True, text=True, timeout=120)
        if "has no" not in r.stderr:
            break
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "outputs identical" in r.stdout
    for what in ("fp32 block step", "bf16 block step", "fp16 block step", "fp32 factored step",
                 "muon momentum+fused", "requantize alone", "momentum alone"):
        assert r.stdout.count(what) == 1, what
    # kernel_ab's period_b: B runs the same elements as blocks of another length (what
    # a block costs besides its elements); the outputs then differ and are not compared
    r = subprocess.run([str(tmp_path / "kernel_ab"), "portable", "portable", "136", "4", "2",
                        "272"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "not compared" in r.stdout and "2 blocks of 272" in r.stdout, r.stdout[-3000:]
    r = subprocess.run([str(tmp_path / "kernel_ab"), "portable", "portable", "136", "3", "2",
                        "272"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "must divide" in r.stderr
    r = subprocess.run([str(tmp_path / "kernel_ab"), "portable", "avx3"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "a version is" in r.stderr
    # kernel_ab avx2@REV: another revision's AVX2 table built in under another name (what
    # kernel_ab.sh does from git; here the working tree's own, renamed), refused when
    # none is built in
    r = subprocess.run([str(tmp_path / "kernel_ab"), "avx2@HEAD", "portable"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no other revision's table" in r.stderr
    for spec in ("avx512@HEAD", "avx3@HEAD", "avx2@"):  # tables table_at_rev.sh does not take
        r = subprocess.run([str(tmp_path / "kernel_ab"), spec, "portable"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "a version is" in r.stderr, (spec, r.stderr)
    r = subprocess.run(  # the working tree's table ("-": no git needed), as kernel_ab.sh
        ["bash", "-c", '. "$0/table_at_rev.sh" && table_at_rev "$1" avx2 - a "$2"', BENCH,
         ROOT, str(tmp_path / "rev")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(
        [_cc(), *flags, os.path.join(BENCH, "kernel_ab.c"), str(tmp_path / "rev" / "table_a.c"),
         *objects, "-o", str(tmp_path / "kernel_ab_rev"), "-lm"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(tmp_path / "kernel_ab_rev"), "avx2@copy", "avx2", "136", "3", "2"],
                       capture_output=True, text=True, timeout=120)
    if "has no avx2 table" not in r.stderr:  # (a CPU without AVX2)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "A = avx2@copy" in r.stdout and "outputs identical" in r.stdout
        # a revision's table with the key search forced off and on (the sign after the
        # revision; one of the two is not this CPU's default)
        for sign, state in (("-keys", "off"), ("+keys", "on")):
            r = subprocess.run([str(tmp_path / "kernel_ab_rev"), "avx2@copy" + sign, "avx2",
                                "136", "3", "2"], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            assert f"A = avx2@copy{sign} (key search {state})" in r.stdout, r.stdout[-3000:]
    # zmm_costs: single instructions' costs where AVX-512 BW and VBMI run, one line
    # saying why not elsewhere
    r = subprocess.run([_cc(), "-O2", "-Wall", "-Werror", "-I", BENCH,
                        os.path.join(BENCH, "zmm_costs.c"), "-o", str(tmp_path / "zmm_costs")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(tmp_path / "zmm_costs"), "2000"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if "nothing to measure" not in r.stdout:
        for what in ("one cycle", "vpermt2w", "vdivps", "pairs: vpermw + vcvtps2pd",
                     "pairs: vfmadd231pd + vcvtps2pd", "pairs: vinsertf64x4 + vcvtps2pd",
                     "key search level, 8 chains"):
            assert what in r.stdout, what
    # search_ports: the search's stages in cycles of port 5 where the VBMI kernels run,
    # one line saying why not elsewhere
    r = subprocess.run([str(tmp_path / "search_ports"), "3"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if "nothing to measure" not in r.stdout:
        assert "one cycle of port 5" in r.stdout
        for what in ("search, codes stored ", "search, codes stored, values formed",
                     "decode of stored codes", "16-bit key search (counts and ties)"):
            assert r.stdout.count(what) == 1, what


def _skip_unless_git_checkout():
    """step_ab.sh reads a revision's kernels from git: skip outside a git checkout."""
    if shutil.which("git") is None or subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "--verify", "HEAD"], capture_output=True
    ).returncode != 0:
        pytest.skip("not a git checkout: step_ab.sh reads a revision's kernels from git")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc (step_ab.sh builds with gcc)")
def test_step_ab_builds_and_runs():
    """step_ab.sh builds the AVX2 kernels of a git revision and of the working tree under
    two names into one program and times whole C phases with each: it must print one line
    per dtype and phase, or, on a CPU without AVX2, say so and exit with 1."""
    _skip_unless_git_checkout()
    r = subprocess.run(
        ["bash", os.path.join(BENCH, "step_ab.sh"), "HEAD", "64", "2", "1", "fp32,bf16",
         "stats,block,factored,once"], capture_output=True, text=True, timeout=600,
    )
    _check_step_ab(r, ("block", "factored", "stats", "once"))


def _check_step_ab(r, phases=("block", "factored", "stats")):
    """One line per dtype and phase, or the refusal of a CPU without the table."""
    if "this CPU lacks the table" in r.stderr:
        assert r.returncode == 1
        return
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for dtype in ("fp32", "bf16"):
        for phase in phases:
            pattern = rf"d=64 {dtype} {phase} +1 thread\(s\): A +[0-9.]+ ms +B +[0-9.]+ ms +B/A-1"
            assert len(re.findall(pattern, r.stdout)) == 1, (dtype, phase, r.stdout)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc (step_ab.sh builds with gcc)")
def test_step_ab_avx512_table_and_bad_table():
    """step_ab.sh avx512bf16@REV: the AVX-512 table's file and kernel headers of a
    revision against the working tree's (each side with its own headers); runs, or says
    the CPU lacks it; an unknown table is refused (by kernel_ab.sh too) before anything
    is built."""
    _skip_unless_git_checkout()
    r = subprocess.run(
        ["bash", os.path.join(BENCH, "step_ab.sh"), "avx512bf16@HEAD", "64", "2", "1",
         "fp32,bf16", "stats,block,factored"], capture_output=True, text=True, timeout=600,
    )
    _check_step_ab(r)
    if r.returncode == 0:
        assert "A = the avx512bf16 table at HEAD" in r.stdout
    for script in ("step_ab.sh", "kernel_ab.sh"):  # refused before anything is built
        r = subprocess.run(["bash", os.path.join(BENCH, script), "avx3@HEAD", "avx2"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "not avx3" in r.stderr, (script, r.stderr)


def test_gpu_step_script_runs_its_rows_on_the_cpu(tmp_path):
    # the GPU benchmark's logic, on the CPU (its numbers mean nothing there): every row
    # it reports on a GPU, so that a GPU session's minutes are not lost to a script error
    result = _run("gpu_step.py", tmp_path=tmp_path)
    rows = {r["optimizer"]: r for r in result["results"]}
    assert set(rows) == {"adamw-fused", "adamw-foreach", "gefen", "gefen-block", "muon", "gefenmuon",
                         "adamw-fused/one-tensor", "gefen-block/one-tensor", "gefen/kept-plans",
                         "gefen-block/kept-plans"}
    n = rows["adamw-fused"]["params"]
    for name in ("adamw-fused", "adamw-foreach", "gefen", "gefen-block"):
        r = rows[name]
        assert r["params"] == n and r["step_ms"] > 0 and r["bytes_per_step"] > 0
        assert r["ratio_to_fused_adamw"] == pytest.approx(r["step_ms"] / rows["adamw-fused"]["step_ms"])
    for name in ("adamw-fused/one-tensor", "gefen-block/one-tensor"):
        r = rows[name]
        assert r["params"] == n and r["step_ms"] > 0 and r["tensors_in_model"] == 28
        base = rows[name.split("/")[0]]["step_ms"]
        assert r["per_tensor_us"] == pytest.approx(1e3 * (base - r["step_ms"]) / 28)
    for name in ("gefen/kept-plans", "gefen-block/kept-plans"):
        assert rows[name]["params"] == n and rows[name]["step_ms"] > 0, rows[name]
    assert rows["gefenmuon"]["state_bytes"] < rows["muon"]["state_bytes"]
