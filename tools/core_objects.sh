#!/usr/bin/env bash
# Compiles every csrc/core/*.c to an object in OUT, as many compilers at once as there
# are CPUs; fails if any compile fails. Used by the C tests and the CUDA host check.
#   tools/core_objects.sh OUT COMPILER FLAG...
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$1
shift
mkdir -p "$out"
rm -f "$out"/*.o
printf '%s\n' "$root"/csrc/core/*.c |
  xargs -P "$(nproc 2>/dev/null || echo 2)" -I{} \
    sh -c 'src=$1; out=$2; shift 2; exec "$@" -c "$src" -o "$out/$(basename "$src" .c).o"' \
    sh {} "$out" "$@"
