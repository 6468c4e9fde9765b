#!/usr/bin/env bash
# Builds and runs benchmarks/kernel_ab.c: two versions of the block kernels against each
# other in one process (outputs checked bit for bit, then timed in ABBA order).
#   bash benchmarks/kernel_ab.sh avx512vbmi avx512bf16
#   bash benchmarks/kernel_ab.sh avx512bf16-keys avx512bf16+keys 2048 8 400
#   bash benchmarks/kernel_ab.sh avx2@HEAD avx2      # a revision's AVX2 kernels (from git)
#                                                    # against the working tree's
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# avx2@REV: that revision's block_avx2.c, built in under another name (one revision)
extra=()
rev=
for arg in "${@:1:2}"; do
  case "$arg" in
    avx2@*)
      if [ -n "$rev" ] && [ "$rev" != "${arg#avx2@}" ]; then
        echo "kernel_ab.sh: one revision per run" >&2
        exit 2
      fi
      rev=${arg#avx2@}
      ;;
  esac
done
if [ -n "$rev" ]; then
  git -C "$root" show "$rev:csrc/core/block_avx2.c" |
    sed 's/gefen_block_ops_avx2/gefen_block_ops_a/g' > "$out/table_a.c"
  extra=("$out/table_a.c")
fi
gcc -std=c11 -O3 -ffp-contract=off -fopenmp -I "$root/csrc/core" \
  "$root/benchmarks/kernel_ab.c" "$root"/csrc/core/*.c ${extra[@]+"${extra[@]}"} -o "$out/kernel_ab" -lm
grep -m1 "model name" /proc/cpuinfo || true
"$out/kernel_ab" "$@"
