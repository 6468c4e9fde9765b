#!/usr/bin/env bash
# Everything gefen checks on a GPU, in one call, most important first (each stage has its
# own time limit, so the early results come back even if the machine's time runs out):
#   1. build with the CUDA kernels (sm_90), the CUDA parity tests and the kernels'
#      bit-exact suite (CUDA vs the C core's emulation on the same inputs);
#   2. step time at GPT-2-family sizes (124M, 350M, 1.3B; fp32, bf16): Gefen, AdamW fused
#      and foreach, GefenMuon and torch Muon, their momentum stage; fraction of copy bandwidth;
#   3. FSDP2 with CPUOffloadPolicy (1 rank, and 2 ranks sharing the GPU): the step on the
#      host's C path, host memory against AdamW, an offloaded checkpoint resumed on the GPU;
#   4. loss parity on the GPU: an 8-layer d=512 GPT, AdamW vs Gefen vs the Hybrid, best of a
#      small lr grid.
# Fails at once, clearly, where there is no GPU. Sized for about 8 minutes on an H200.
#   bash tools/gpu_check.sh [OUTDIR]       (default: $OUT, else ./gpu_check_out)
# GPU_CHECK_STAGES="3 4" runs only those stages (the build always runs; default "1 2 3 4").
# GEFEN_PREBUILT=1 reuses what was built elsewhere (saves the GPU machine's minutes): the
# in-place extension gefen/_C.abi3.so if it has the CUDA kernels, kernels/test/build/parity
# (then the CUDA tests skip their own build of it) and build/cpu_only/gefen/_C.abi3.so (the
# CPU-only build the CUDA tests check) if they exist. Build them with nvcc on any machine:
#   GEFEN_CUDA=1 GEFEN_CUDA_ARCHS=90 python setup.py build_ext --inplace
#   bash kernels/test/run.sh gpu
#   GEFEN_CUDA=0 python setup.py build_ext -b build/cpu_only -t build/cpu_only_tmp
# At most 8 files land in OUTDIR: log.txt, env.txt, cuda_tests.txt (the CUDA tests' whole
# output), gpu_step.json, offload_1.json, offload_2.json, loss_parity.json, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log="$out/log.txt"
: > "$log"
status=0
step() { echo; echo "=== $1 ($(date +%T))" | tee -a "$log"; }
fail() { echo "FAILED: $1" | tee -a "$log"; status=1; }
want() { [[ " ${GPU_CHECK_STAGES:-1 2 3 4} " == *" $1 "* ]]; }

if ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False): nothing to check here." >&2
  echo "Run this script on a machine with an NVIDIA GPU, nvcc and a CUDA build of PyTorch." >&2
  exit 2
fi

step "environment"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvcc --version | tail -1
  $py -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0))"
} 2>&1 | tee "$out/env.txt" | tee -a "$log"

step "1. build (GEFEN_CUDA=1, sm_${GEFEN_CUDA_ARCHS:-90}), CUDA parity tests, kernel bit-exact suite"
export GEFEN_CUDA=1 GEFEN_CUDA_ARCHS=${GEFEN_CUDA_ARCHS:-90}
if [[ ${GEFEN_PREBUILT:-0} == 1 ]] && $py -c "import sys; from gefen import _C; sys.exit(0 if _C.built_with_cuda() else 1)" 2>/dev/null; then
  echo "GEFEN_PREBUILT=1: using the extension built in place" | tee -a "$log"
elif ! timeout 300 $py setup.py -q build_ext --inplace > "$out/build.tmp" 2>&1; then
  tail -40 "$out/build.tmp" | tee -a "$log"; rm -f "$out/build.tmp"
  echo "BUILD FAILED" | tee -a "$log"; exit 1
fi
rm -f "$out/build.tmp"
$py -c "import gefen; from gefen import _C; print('built_with_cuda', _C.built_with_cuda(), '| cuda_available', _C.cuda_available())" 2>&1 | tee -a "$log"
if want 1; then
pytest_args=() prebuilt_parity=0
if [[ ${GEFEN_PREBUILT:-0} == 1 && -x kernels/test/build/parity ]]; then  # it runs next
  prebuilt_parity=1
  pytest_args+=(--deselect tests/test_cuda_parity.py::test_kernel_level_parity_suite)
fi
if [[ ${GEFEN_PREBUILT:-0} == 1 && -f build/cpu_only/gefen/_C.abi3.so ]]; then
  export GEFEN_CPU_ONLY_EXT=$PWD/build/cpu_only/gefen/_C.abi3.so
fi
timeout 300 $py -m pytest tests/test_cuda_parity.py -q -rs --tb=short -p no:cacheprovider "${pytest_args[@]}" 2>&1 \
  | tee "$out/cuda_tests.txt" | tail -30 | tee -a "$log"
[ "${PIPESTATUS[0]}" = 0 ] || fail "tests/test_cuda_parity.py"
if [[ $prebuilt_parity == 1 ]]; then
  echo "GEFEN_PREBUILT=1: running kernels/test/build/parity" | tee -a "$log"
  timeout 300 kernels/test/build/parity 2>&1 | tail -30 | tee -a "$log"
else
  timeout 300 bash kernels/test/run.sh gpu 2>&1 | tail -30 | tee -a "$log"
fi
[ "${PIPESTATUS[0]}" = 0 ] || fail "kernels/test/run.sh gpu (bit-exact parity)"
fi

if want 2; then
step "2. step time at GPT-2-family sizes"
timeout 240 $py benchmarks/gpu_step.py --sizes "${GPU_SIZES:-124M,350M,1.3B}" --dtypes fp32,bf16 \
  --json "$out/gpu_step.json" 2>&1 | tee -a "$log" | grep -E "fused AdamW|momentum stage|per tensor|kept plans|Error|error"
[ "${PIPESTATUS[0]}" = 0 ] || fail "benchmarks/gpu_step.py"
fi

if want 3; then
step "3. FSDP2 + CPUOffloadPolicy (1 rank, then 2 ranks sharing the GPU)"
ck=$(mktemp -d)
for n in 1 2; do
  timeout 150 $py -m torch.distributed.run --standalone --nproc-per-node $n tools/offload_check.py \
    --out "$ck" 2>&1 | tee -a "$log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || fail "tools/offload_check.py on $n rank(s)"
  cp "$ck/offload_$n.json" "$out/" 2>/dev/null || true
done
rm -rf "$ck"
fi

if want 4; then
# the default lr grids are centred on the CPU benchmark's 4-layer d=128 model; this one is
# 8 layers at d=512, where every optimizer's best lr was the lowest of those grids (first
# run, 2026-12-04): a quarter of them spans the best
step "4. loss parity on the GPU (8 layers, d=512)"
timeout 240 $py benchmarks/loss_parity.py --device cuda --layers 8 --d-model 512 --heads 8 \
  --steps 300 --batch 32 --ctx 256 --corpus-mb 16 --lr-scale ${GPU_LR_SCALE:-0.25} \
  --optimizers adamw,gefen,hybrid-gefen --json "$out/loss_parity.json" 2>&1 | tee -a "$log" | tail -8
[ "${PIPESTATUS[0]}" = 0 ] || fail "benchmarks/loss_parity.py --device cuda"
fi

step "summary"
{
  grep -E "passed|failed|error" "$log" | grep -v "^E " | tail -6
  grep -E "fused AdamW|momentum stage|per tensor|kept plans" "$log"
  grep -E "PASS|MISS|reference" "$log" | tail -4
  echo "gpu_check exit status: $status"
} | tee "$out/summary.txt"
exit $status
