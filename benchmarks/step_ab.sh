#!/usr/bin/env bash
# Builds and runs benchmarks/step_ab.c: one table of block kernels as it was at git
# revision REV (A) against the working tree's (B), whole C phases on the 16.8M set (or
# d as given), with threads, in one process, ABBA.
#   bash benchmarks/step_ab.sh HEAD~1                       # the AVX2 table, all dtypes
#   bash benchmarks/step_ab.sh 95d38f3 4096 8 2 fp32 stats  # 67.1M, the statistics phase
#   bash benchmarks/step_ab.sh avx512bf16@HEAD 2048 12 2 fp16 block,factored
# TABLE@REV names the table: avx2 (the default; csrc/core/block_avx2.c), avx512bf16 or
# avx512vbmi (their .c file and the AVX-512 kernel headers it includes, which the two
# share; the helpers of block_avx512.c they call are the working tree's on both sides).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
spec=${1:?usage: step_ab.sh [TABLE@]REV [d] [rounds] [threads] [dtypes] [phases]}
shift
case "$spec" in
  *@*) table=${spec%%@*} rev=${spec#*@} ;;
  *) table=avx2 rev=$spec ;;
esac
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
. "$root/benchmarks/table_at_rev.sh"
table_at_rev "$root" "$table" "$rev" a "$out/a"
table_at_rev "$root" "$table" - b "$out/b"
# one object per source, compiled side by side (the AVX-512 kernels take most of it)
n=0
pids=()
for src in "$root/benchmarks/step_ab.c" "$root"/csrc/core/*.c "$out/a/table_a.c" \
  "$out/b/table_b.c"; do
  n=$((n + 1))
  gcc -std=c11 -O3 -ffp-contract=off -fopenmp -I "$root/csrc/core" -I "$root/benchmarks" \
    -c "$src" -o "$out/$n.o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done # set -e: a failed compile stops here
gcc -fopenmp "$out"/*.o -o "$out/step_ab" -lm
grep -m1 "model name" /proc/cpuinfo || true
echo "A = the $table table at $rev, B = the working tree's"
"$out/step_ab" "$@"
