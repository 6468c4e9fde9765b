#!/usr/bin/env bash
# Builds and runs benchmarks/kernel_ab.c: two versions of the block kernels against each
# other in one process (outputs checked bit for bit, then timed in ABBA order).
#   bash benchmarks/kernel_ab.sh avx512vbmi avx512bf16
#   bash benchmarks/kernel_ab.sh avx512bf16-keys avx512bf16+keys 2048 8 400
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
gcc -std=c11 -O3 -ffp-contract=off -fopenmp -I "$root/csrc/core" \
  "$root/benchmarks/kernel_ab.c" "$root"/csrc/core/*.c -o "$out/kernel_ab" -lm
grep -m1 "model name" /proc/cpuinfo || true
"$out/kernel_ab" "$@"
