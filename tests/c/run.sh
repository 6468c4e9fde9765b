#!/usr/bin/env bash
# Builds and runs the core's C tests.
#   tests/c/run.sh            optimised build (-O2, OpenMP)
#   tests/c/run.sh sanitize   AddressSanitizer + UndefinedBehaviorSanitizer build
# The core is compiled once per mode (one object per source, as many compilers at once
# as there are CPUs) and every test is linked against those objects.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
mode=${1:-release}
out="$root/tests/c/build/$mode"
mkdir -p "$out"
cc=${CC:-gcc}
cflags=(-std=c11 -Wall -Wextra -Werror -Wno-missing-field-initializers -ffp-contract=off -fopenmp
        -I "$root/csrc/core")
case "$mode" in
  release) cflags+=(-O2 -g) ;;
  # no variable tracking: the AVX-512 kernels exceed its size limit and GCC compiles them
  # twice (line numbers in the reports stay; 194 -> 148 s for the core on 2 cores)
  sanitize) cflags+=(-O1 -g -fno-var-tracking-assignments -fno-omit-frame-pointer
                     -fsanitize=address,undefined -fno-sanitize-recover=all) ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
bash "$root/tools/core_objects.sh" "$out/core" "$cc" "${cflags[@]}"
core=("$out"/core/*.o)

status=0
for test in "$root"/tests/c/test_*.c; do
  name=$(basename "$test" .c)
  "$cc" "${cflags[@]}" "$test" "${core[@]}" -o "$out/$name" -lm
  echo "== $name ($mode)"
  if ! ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 "$out/$name"; then
    echo "!! $name failed" >&2
    status=1
  fi
done
exit $status
