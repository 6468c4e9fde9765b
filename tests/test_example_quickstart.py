"""examples/quickstart.py as a user runs it: it trains, reports under AdamW's 8 bytes of
state per parameter, and its resumed run is bitwise the uninterrupted one."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_trains_and_resumes_bit_for_bit(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    first = float(re.search(r"loss after 200 steps: ([\d.]+)", out).group(1))
    final, resumed, same = re.search(
        r"loss after 400 steps: ([\d.]+) \(resumed run: ([\d.]+), bitwise identical: (\w+)\)", out).groups()
    assert same == "True" and final == resumed, out
    assert float(final) < first, out
    assert float(re.search(r"optimizer state: ([\d.]+) bytes per parameter", out).group(1)) < 8, out
