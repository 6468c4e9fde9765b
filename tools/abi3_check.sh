#!/usr/bin/env bash
# The abi3 check: ONE wheel, built once, installed into a fresh virtual environment of every
# CPython found and used there without torch: `import gefen._C`, calls into the C core with
# numpy arrays as the DLPack producers (a read-only one must be refused), `python -m gefen`.
# The newest CPython older than the wheel's tag must refuse to install it. Prints a Markdown
# table (the one README.md shows); exits 1 when any row fails.
#
#   tools/abi3_check.sh WHEEL [PYTHON ...]
#
# Without PYTHONs: every CPython 3.x that pyenv keeps, else python3.8 ... python3.14 on PATH.
set -uo pipefail
wheel=$(realpath "${1:?usage: tools/abi3_check.sh WHEEL [PYTHON ...]}")
shift
pythons=("$@")
if [[ ${#pythons[@]} -eq 0 ]]; then
  if command -v pyenv >/dev/null 2>&1; then
    pythons=("$(pyenv root)"/versions/3.*/bin/python3)
  else
    for minor in 8 9 10 11 12 13 14; do
      command -v "python3.$minor" >/dev/null 2>&1 && pythons+=("$(command -v "python3.$minor")")
    done
  fi
fi
# the wheel's oldest CPython, from its tag: cp310-abi3 -> 310
tag_min=$(basename "$wheel" | sed -E 's/.*-cp3([0-9]+)-abi3-.*/3\1/')
[[ $tag_min =~ ^3[0-9]+$ ]] || { echo "not a cp3X-abi3 wheel: $wheel" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/smoke.py" <<'PY'
"""Runs in a fresh venv with only the wheel and numpy: gefen._C is the installed one, torch
is never imported, and the core answers through DLPack."""
import sys

import numpy as np

import gefen._C as C

assert C.__file__.startswith(sys.prefix), f"gefen._C from {C.__file__}, not the venv"
cb = np.linspace(-1.0, 1.0, C.CODEBOOK_SIZE, dtype=np.float32)
q = C.Quantizer(cb)
u = np.array([-1.0, -0.3, 0.0, 0.004, 0.77, 1.0], dtype=np.float32)
codes = np.zeros(u.size, dtype=np.uint8)
q.nearest(u, codes)
expected = np.abs(cb[None, :] - u[:, None]).argmin(axis=1)
assert (codes == expected).all(), (codes, expected)
hist = np.zeros(C.HIST_BINS, dtype=np.int64)
hist[:: C.HIST_BINS // 512] = 3
solved = np.zeros(C.CODEBOOK_SIZE, dtype=np.float32)
C.codebook_solve(hist, solved)
C.codebook_validate(solved)
assert C.exact_sum(np.array([1e16, 1.0, 1.0])) == 1e16 + 2.0
frozen = np.zeros(u.size, dtype=np.uint8)
frozen.flags.writeable = False
try:
    q.nearest(u, frozen)
    raise AssertionError("a read-only output was accepted")
except ValueError as exc:
    assert "read-only" in str(exc), exc
assert C.build_info()["limited_api"] >> 16 == 0x030A, hex(C.build_info()["limited_api"])
assert "torch" not in sys.modules, "importing gefen._C imported torch"
print(f"ok ({C.simd_path()})")
PY

ver() { "$1" -c 'import platform; print(platform.python_version())'; }
num() { "$1" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")'; }

supported=()
older=""
for py in "${pythons[@]}"; do
  if [[ $(num "$py") -ge $tag_min ]]; then
    supported+=("$py")
  elif [[ -z $older || $(num "$py") -gt $(num "$older") ]]; then
    older=$py
  fi
done

status=0
echo "abi3 check of $(basename "$wheel") (built once), numpy as the DLPack producer, no torch:"
echo
echo "| CPython | install | import gefen._C | core calls (SIMD path) | python -m gefen |"
echo "|---|---|---|---|---|"
for py in "${supported[@]}"; do
  v=$(ver "$py")
  env="$work/venv-$v"
  install=FAIL imported=- core=- config=-
  if "$py" -m venv "$env" >"$work/log-$v" 2>&1 &&
     "$env/bin/python" -m pip install -q --no-deps "$wheel" >>"$work/log-$v" 2>&1; then
    install=ok
    "$env/bin/python" -m pip install -q numpy >>"$work/log-$v" 2>&1 || core="numpy unavailable"
    if (cd "$work" && "$env/bin/python" -I -c 'import gefen._C') >>"$work/log-$v" 2>&1; then
      imported=ok
      if [[ $core == - ]]; then
        core=$(cd "$work" && "$env/bin/python" -I smoke.py 2>>"$work/log-$v") || core=FAIL
      fi
      config=$(cd "$work" && "$env/bin/python" -I -m gefen 2>>"$work/log-$v")
      if grep -q "torch:.*not installed" <<<"$config" && grep -q "limited API 3" <<<"$config"; then
        config=ok
      else
        echo "$config" >>"$work/log-$v"
        config=FAIL
      fi
    else
      imported=FAIL
    fi
  fi
  echo "| $v | $install | $imported | $core | $config |"
  if [[ "$install $imported $core $config" != "ok ok ok ("*") ok" ]]; then
    status=1
    sed 's/^/    /' "$work/log-$v" | tail -30 >&2
  fi
done
if [[ -n $older ]]; then
  v=$(ver "$older")
  env="$work/venv-$v"
  if "$older" -m venv "$env" >"$work/log-$v" 2>&1 &&
     ! "$env/bin/python" -m pip install -q --no-deps "$wheel" >>"$work/log-$v" 2>&1 &&
     grep -q "is not a supported wheel on this platform" "$work/log-$v"; then
    echo "| $v | refused, as it must (older than the wheel's cp${tag_min} tag) | - | - | - |"
  else
    echo "| $v | FAIL: installed a wheel for CPython >= ${tag_min:0:1}.${tag_min:1} | - | - | - |"
    status=1
  fi
fi
[[ ${#supported[@]} -gt 0 ]] || { echo "no CPython >= ${tag_min:0:1}.${tag_min:1} found" >&2; status=1; }
exit $status
