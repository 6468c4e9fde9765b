#!/usr/bin/env bash
# Builds and runs benchmarks/kernel_ab.c: two versions of the block kernels against each
# other in one process (outputs checked bit for bit, then timed in ABBA order).
#   bash benchmarks/kernel_ab.sh avx512vbmi avx512bf16
#   bash benchmarks/kernel_ab.sh avx512bf16-keys avx512bf16+keys 2048 8 400
#   bash benchmarks/kernel_ab.sh avx2@HEAD avx2      # a revision's AVX2 kernels (from git)
#                                                    # against the working tree's
#   bash benchmarks/kernel_ab.sh avx512bf16@HEAD avx512bf16   # the same for an AVX-512 table
#   bash benchmarks/kernel_ab.sh avx512bf16@HEAD-keys avx512bf16-keys   # both without the
#                                                    # key search (Intel's choice)
#   KERNEL_AB_UNCHECKED=1 bash benchmarks/kernel_ab.sh ...    # time versions whose outputs
#                                                    # differ (an upper bound; it says so)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# TABLE@REV (avx2, avx512bf16 or avx512vbmi): that revision's table, built in under
# another name (one revision per run; see table_at_rev.sh)
extra=()
spec_rev=
for arg in "${@:1:2}"; do
  case "$arg" in
    *@*)
      if [ -n "$spec_rev" ] && [ "$spec_rev" != "$arg" ]; then
        echo "kernel_ab.sh: one revision per run" >&2
        exit 2
      fi
      spec_rev=$arg
      ;;
  esac
done
if [ -n "$spec_rev" ]; then
  . "$root/benchmarks/table_at_rev.sh"
  rev=${spec_rev#*@}
  rev=${rev%+keys}
  rev=${rev%-keys}
  table_at_rev "$root" "${spec_rev%%@*}" "$rev" a "$out/a"
  extra=("$out/a/table_a.c")
fi
gcc -std=c11 -O3 -ffp-contract=off -fopenmp -I "$root/csrc/core" \
  "$root/benchmarks/kernel_ab.c" "$root"/csrc/core/*.c ${extra[@]+"${extra[@]}"} -o "$out/kernel_ab" -lm
grep -m1 "model name" /proc/cpuinfo || true
"$out/kernel_ab" "$@"
