"""The benchmark scripts run end to end (their --quick modes), so they cannot rot.
They measure nothing here; the real numbers come from running them by hand."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "script, extra",
    [
        ("loss_parity.py", ["--optimizers", "adamw,gefen,hybrid-gefen"]),
        ("memory.py", ["--optimizers", "adamw,gefen,hybrid-gefen"]),
        ("step_time.py", ["--optimizers", "adamw-fused,gefen", "--dtypes", "fp32"]),
    ],
)
def test_benchmark_quick_mode_runs(script, extra, tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick", "--json", str(out), *extra],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["gefen"].startswith("0.")
    if script == "memory.py":
        per = {x["optimizer"]: x["bytes_per_param"] for x in result["results"]}
        assert per["adamw"] == pytest.approx(8.0, rel=1e-4) and per["gefen"] < 1.1
    if script == "loss_parity.py":
        names = {s["optimizer"] for s in result["summary"]}
        assert names == {"adamw", "gefen", "hybrid-gefen"}
