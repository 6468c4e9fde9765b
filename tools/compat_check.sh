#!/usr/bin/env bash
# Opt-in compatibility check: the full pytest suite on each given PyTorch version (default:
# the oldest and the newest version pyproject.toml declares), each in its own venv, built
# from a scratch copy of this tree so the working tree is never touched.
#
#   bash tools/compat_check.sh                 # torch 2.13.0 and 2.14.1
#   bash tools/compat_check.sh 2.14.1          # one version
#   PYTHON=python3.12 bash tools/compat_check.sh 2.14.1
#
# Environment:
#   PYTHON                the interpreter for the venvs (default: python3)
#   GEFEN_COMPAT_DIR      where the venvs and copies live (default: /tmp/gefen-compat);
#                         a venv that already has the wanted torch is reused
#   GEFEN_COMPAT_CLEAN=1  delete each venv after its run (a CUDA build of torch makes a
#                         venv of about 5.5 GB)
#   GEFEN_CUDA            passed to the build (default here: 0, the CPU kernels only, since
#                         the suite runs on the CPU; set 1 to also compile the CUDA kernels)
#   GEFEN_OPENMP=0        passed to the build: the suite on the single-threaded core
#   GEFEN_WHEEL=PATH      install this wheel instead of building (e.g. the one CI built
#                         next to torch 2.13.0): one build, tested on every version
#
# Prints one line per version (pytest's summary and the wall time) and exits non-zero when
# any version fails. Not part of .ci/run: CUDA builds of torch are multi-GB installs.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="${GEFEN_COMPAT_DIR:-/tmp/gefen-compat}"
export GEFEN_CUDA="${GEFEN_CUDA:-0}"
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
  VERSIONS=(2.13.0 2.14.1)
fi
mkdir -p "$WORK"
pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
summary=()
status=0

for v in "${VERSIONS[@]}"; do
  echo "== torch $v on Python $pyver"
  start=$(date +%s)
  venv="$WORK/venv-py$pyver-torch$v"
  src="$WORK/src-py$pyver-torch$v"
  log="$WORK/pytest-py$pyver-torch$v.log"
  have=""
  if [ -x "$venv/bin/python" ]; then
    have=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
  fi
  if [ "$have" != "$v" ]; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "torch==$v" > "$WORK/pip.log" 2>&1 \
      || { grep -v '^WARNING: Location' "$WORK/pip.log" | tail -20; exit 1; }
  fi
  # everything else the tests need, without requirements-test.txt's torch pin
  grep -v -E '^[[:space:]]*torch([=<>!~ ]|$)' "$ROOT/requirements-test.txt" > "$WORK/requirements-no-torch.txt"
  "$venv/bin/python" -m pip install -q -r "$WORK/requirements-no-torch.txt" > "$WORK/pip.log" 2>&1 \
    || { grep -v '^WARNING: Location' "$WORK/pip.log" | tail -20; exit 1; }

  # a scratch copy of the tree (tracked and untracked, not ignored files) to build in
  rm -rf "$src"
  mkdir -p "$src"
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
     | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
     | tar --null -cf - -T -) | tar -xf - -C "$src"
  # a reused venv may hold an earlier build (or the distribution's former name)
  "$venv/bin/python" -m pip uninstall -q -y gefen-optim gefen > /dev/null 2>&1 || true
  if [ -n "${GEFEN_WHEEL:-}" ]; then
    # the given wheel, as CI tests it: the tests from the tree, gefen only from the wheel
    "$venv/bin/python" -m pip install -q --no-deps "$GEFEN_WHEEL" > "$WORK/build.log" 2>&1 \
      || { tail -40 "$WORK/build.log"; exit 1; }
    rm -rf "$src/gefen"
  else
    "$venv/bin/python" -m pip install -q --no-build-isolation -e "$src" > "$WORK/build.log" 2>&1 \
      || { tail -40 "$WORK/build.log"; exit 1; }
  fi

  got=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  build=$(cd "$src" && "$venv/bin/python" -c 'from gefen import _C
print(("OpenMP" if _C.has_threads() else "single-threaded")
      + (", CUDA kernels" if _C.built_with_cuda() else ", CPU kernels only"))')
  set +e
  (cd "$src" && "$venv/bin/python" -m pytest tests -q -p no:cacheprovider) > "$log" 2>&1
  rc=$?
  set -e
  last=$(grep -E '(passed|failed|error)' "$log" | tail -1)
  secs=$(( $(date +%s) - start ))
  echo "   $last"
  summary+=("torch $got, Python $pyver, gefen $build: $last (rc $rc, ${secs} s with setup; log: $log)")
  [ $rc -eq 0 ] || { status=1; grep -E '^(FAILED|ERROR)' "$log" | head -40 || true; }
  if [ "${GEFEN_COMPAT_CLEAN:-0}" = 1 ]; then
    rm -rf "$venv" "$src"
  fi
done

echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
