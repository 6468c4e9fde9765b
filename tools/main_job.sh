#!/usr/bin/env bash
# The main job: set up an environment, build gefen, and train a byte-level transformer on
# the Python standard library's own source (no download) with AdamW and with gefen over a
# small learning-rate grid each, printing the best eval losses side by side.
#   bash tools/main_job.sh                    # AdamW vs Gefen (factored and block)
#   bash tools/main_job.sh --optimizers adamw,gefen,muon+adamw,hybrid-gefen,hybrid-adamw
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
python -m pip install -q -r requirements-test.txt
python -m pip install -q --no-build-isolation -e .
python benchmarks/loss_parity.py "$@"
