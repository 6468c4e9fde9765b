#!/usr/bin/env bash
# Builds and runs benchmarks/core_breakdown.c (one thread, each block primitive alone).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
gcc -std=c11 -O3 -ffp-contract=off -fopenmp -I "$root/csrc/core" \
  "$root/benchmarks/core_breakdown.c" "$root"/csrc/core/*.c -o "$out/core_breakdown" -lm
grep -m1 "model name" /proc/cpuinfo || true
"$out/core_breakdown"
