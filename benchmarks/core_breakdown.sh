#!/usr/bin/env bash
# Builds and runs benchmarks/core_breakdown.c (one thread, each block primitive alone),
# then benchmarks/core_step.c (the whole C step on the 16M set, 1 and 2 threads, next to
# its memory floor). Arguments go to core_step (d, steps): `core_breakdown.sh 4096` for 64M.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for prog in core_breakdown core_step; do
  gcc -std=c11 -O3 -ffp-contract=off -fopenmp -I "$root/csrc/core" \
    "$root/benchmarks/$prog.c" "$root"/csrc/core/*.c -o "$out/$prog" -lm
done
grep -m1 "model name" /proc/cpuinfo || true
uptime
"$out/core_breakdown"
"$out/core_step" "$@"
