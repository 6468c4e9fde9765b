#!/usr/bin/env bash
# Builds and runs benchmarks/step_ab.c: the AVX2 kernels (csrc/core/block_avx2.c) of git
# revision REV (A) against the working tree's (B), whole C phases on the 16.8M set (or
# d as given), with threads, in one process, ABBA.
#   bash benchmarks/step_ab.sh HEAD~1                       # all dtypes, stats/block/factored
#   bash benchmarks/step_ab.sh 95d38f3 4096 8 2 fp32 stats  # 67.1M, the statistics phase
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rev=${1:?usage: step_ab.sh REV [d] [rounds] [threads] [dtypes] [phases]}
shift
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
git -C "$root" show "$rev:csrc/core/block_avx2.c" |
  sed 's/gefen_block_ops_avx2/gefen_block_ops_a/g' > "$out/table_a.c"
sed 's/gefen_block_ops_avx2/gefen_block_ops_b/g' "$root/csrc/core/block_avx2.c" > "$out/table_b.c"
gcc -std=c11 -O3 -ffp-contract=off -fopenmp -I "$root/csrc/core" -I "$root/benchmarks" \
  "$root/benchmarks/step_ab.c" "$root"/csrc/core/*.c "$out/table_a.c" "$out/table_b.c" \
  -o "$out/step_ab" -lm
grep -m1 "model name" /proc/cpuinfo || true
echo "A = block_avx2.c at $rev, B = the working tree's"
"$out/step_ab" "$@"
