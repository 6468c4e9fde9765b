"""examples/fsdp2_train.py under torchrun on CPU (gloo): 2 and 4 ranks train the same
loss curve as one process, and a checkpoint saved on 2 ranks resumes on 3."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "fsdp2_train.py")


def _run(tmp_path, nproc, *args, name):
    out = os.path.join(tmp_path, f"{name}.json")
    if nproc == 1:
        cmd = [sys.executable, EXAMPLE]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", EXAMPLE]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*cmd, "--steps", "20", "--json", out, *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out) as f:
        return {int(k): v for k, v in json.load(f)["losses"].items()}, proc.stdout


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), 1, name="one")[0]


@pytest.mark.parametrize("nproc, extra", [(2, []), (4, []), (4, ["--hsdp", "2"])],
                         ids=["2-ranks", "4-ranks", "4-ranks-hsdp"])
def test_sharded_loss_curve_matches_one_process(tmp_path, one_process, nproc, extra):
    losses, _ = _run(tmp_path, nproc, *extra, name=f"n{nproc}")
    assert sorted(losses) == list(range(20))
    for step, loss in losses.items():
        # each rank averages its slice of the same global batch: reduction order only
        assert abs(loss - one_process[step]) <= 1e-4 * abs(one_process[step]), (step, loss, one_process[step])
    assert losses[19] < losses[0] - 1.0  # it learns


def test_save_on_2_ranks_resume_on_3(tmp_path, one_process):
    ckpt = os.path.join(tmp_path, "ckpt")
    _run(tmp_path, 2, "--save-every", "10", "--ckpt", ckpt, name="save")
    losses, out = _run(tmp_path, 3, "--resume", os.path.join(ckpt, "step10"), name="resume")
    assert "resumed at step 10" in out
    assert sorted(losses) == list(range(10, 20))
    for step, loss in losses.items():
        assert abs(loss - one_process[step]) <= 1e-4 * abs(one_process[step]), (step, loss, one_process[step])
