#!/usr/bin/env bash
# One script for a machine with an NVIDIA GPU (sized to finish in under 8 minutes on an
# H100/H200): build gefen with its CUDA kernels, run the CUDA parity tests, the kernels'
# bit-exact parity suite, and the CUDA step-time benchmark; print a summary.
#   bash tools/gpu_check.sh [OUTDIR]       (default OUTDIR: ./gpu_check_out)
# Needs nvcc and a CUDA build of PyTorch (python3 must import torch with CUDA).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0
step() { echo; echo "=== $1"; }

step "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/env.txt"
nvcc --version | tail -1 | tee -a "$out/env.txt"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  2>&1 | tee -a "$out/env.txt"

step "build (GEFEN_CUDA=1, sm_${GEFEN_CUDA_ARCHS:-90})"
export GEFEN_CUDA=1 GEFEN_CUDA_ARCHS=${GEFEN_CUDA_ARCHS:-90}
if ! $py setup.py -q build_ext --inplace > "$out/build.log" 2>&1; then
  tail -40 "$out/build.log"; echo "BUILD FAILED"; exit 1
fi
$py -c "import gefen; from gefen import _C; print('built_with_cuda', _C.built_with_cuda(), 'cuda_available', _C.cuda_available())" \
  | tee -a "$out/env.txt"

step "CUDA parity tests (pytest)"
PYTHONPATH=. timeout 300 $py -m pytest tests/test_cuda_parity.py -q -rs -p no:cacheprovider \
  2>&1 | tee "$out/pytest_cuda.txt" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || status=1

step "step time on CUDA (fp32 and bf16; 16M, 64M, 128M, 256M)"
PYTHONPATH=. timeout 240 $py benchmarks/step_time.py --device cuda --sizes 16M,64M,128M,256M \
  --dtypes fp32,bf16 --optimizers adamw-fused,adamw-foreach,gefen,gefen-block --steps 20 \
  --json "$out/step_time_cuda.json" 2>&1 | tee "$out/step_time_cuda.txt" | tail -40
[ "${PIPESTATUS[0]}" = 0 ] || status=1

step "summary"
grep -E "passed|failed|error" "$out/pytest_cuda.txt" | tail -2
grep -E " gefen " "$out/step_time_cuda.txt" || true
echo "gpu_check exit status: $status"
exit $status
