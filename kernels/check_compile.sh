#!/usr/bin/env bash
# Compiles every kernels/**/*.cu for sm_80 and sm_90 and fails on any error or
# warning. Needs nvcc only (no GPU).
#   kernels/check_compile.sh          NVCC=/path/to/nvcc kernels/check_compile.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
nvcc=${NVCC:-nvcc}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
flags=(-std=c++17 -O3 --fmad=false
       -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
       -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror,-ffp-contract=off
       -I "$root/csrc/core" -I "$root/kernels")
status=0
while IFS= read -r cu; do
  rel=${cu#"$root"/}
  obj="$out/$(echo "$rel" | tr / _).o"
  if "$nvcc" "${flags[@]}" -c "$cu" -o "$obj"; then
    echo "ok   $rel"
  else
    echo "FAIL $rel" >&2
    status=1
  fi
done < <(find "$root/kernels" -name '*.cu' | sort)
exit $status
