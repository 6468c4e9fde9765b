#!/usr/bin/env bash
# Builds and runs the CUDA kernels' tests.
#   kernels/test/run.sh        host check; plus the GPU parity test when a device is visible
#   kernels/test/run.sh host   host check only (needs nvcc, no GPU): emulation vs CPU core
#   kernels/test/run.sh gpu    GPU parity only: kernels vs emulation, bit for bit
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
what=${1:-auto}
nvcc=${NVCC:-nvcc}
out="$root/kernels/test/build"
bash "$root/tools/core_objects.sh" "$out/core" "${CC:-gcc}" -std=c11 -O2 -ffp-contract=off -fopenmp \
  -Wall -Wextra -Wno-missing-field-initializers -I "$root/csrc/core"
flags=(-std=c++17 -O2 --fmad=false -Werror all-warnings
       -Xcompiler -Wall,-Wextra,-ffp-contract=off,-Wno-missing-field-initializers
       -I "$root/csrc/core" -I "$root/kernels" -I "$root/kernels/test")
arches=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
        -gencode arch=compute_90,code=compute_90)
status=0
if [[ $what == host || $what == auto ]]; then
  "$nvcc" "${flags[@]}" "$root/kernels/test/host_check.cu" "$out"/core/*.o -lgomp -lm \
    -o "$out/host_check"
  "$out/host_check" || status=1
fi
if [[ $what == gpu || $what == auto ]]; then
  "$nvcc" "${flags[@]}" "${arches[@]}" "$root"/kernels/*.cu "$root/kernels/test/parity.cu" \
    "$out"/core/*.o -lgomp -lm -o "$out/parity"
  rc=0
  "$out/parity" || rc=$?
  if [[ $rc == 77 && $what == auto ]]; then
    echo "(no CUDA device: GPU parity skipped)"
  elif [[ $rc != 0 ]]; then
    status=1
  fi
fi
exit $status
