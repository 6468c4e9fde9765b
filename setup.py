"""Builds gefen._C from csrc/: C11 core + CPython binding, no libtorch link; optionally
the CUDA kernels of kernels/ (compiled with nvcc, linked with the static CUDA runtime).

Environment:
  GEFEN_OPENMP=0   build the core single-threaded (default: OpenMP when the compiler has it)
  GEFEN_CUDA=0/1   force the CUDA kernels off/on (default: on when nvcc is found AND the
                   installed torch is a CUDA build; a CPU torch has no CUDA tensors to step)
  CUDA_HOME        where the CUDA toolkit lives (default: derived from `which nvcc`)
  GEFEN_CUDA_ARCHS space-separated compute capabilities (default: "80 90")
"""

import os
import shutil
import subprocess
import tempfile
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob(os.path.join(ROOT, pattern)))


def _compiler_accepts(compiler, flag):
    """True when the C compiler accepts `flag` (compiling and linking a stub)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("int main(void) { return 0; }\n")
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=[flag])
            compiler.link_executable(objs, "probe", output_dir=tmp, extra_postargs=[flag])
        except Exception:
            return False
    return True


def _cudart_static(home):
    """The static CUDA runtime of a toolkit, or None."""
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        path = os.path.join(home, sub, "libcudart_static.a")
        if os.path.exists(path):
            return path
    return None


def _cuda_home():
    """The CUDA toolkit: $CUDA_HOME, the parent of nvcc's bin/, or /usr/local/cuda
    (the first that holds nvcc and the static runtime)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")) and _cudart_static(home):
            return home
    return None


def _torch_has_cuda():
    try:
        import torch
    except Exception:
        return False
    return torch.version.cuda is not None


def _want_cuda():
    flag = os.environ.get("GEFEN_CUDA")
    if flag == "0":
        return False
    home = _cuda_home()
    if flag == "1":
        if not home:
            raise RuntimeError(
                "GEFEN_CUDA=1 but no CUDA toolkit (nvcc and libcudart_static.a) was found; "
                "set CUDA_HOME"
            )
        return True
    return home is not None and _torch_has_cuda()


class BuildExt(build_ext):
    def build_extensions(self):
        compiler = self.compiler
        for ext in self.extensions:
            if compiler.compiler_type == "unix":
                ext.extra_compile_args += [
                    "-std=c11", "-O3", "-ffp-contract=off", "-fvisibility=hidden",
                    "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                ]
                if os.environ.get("GEFEN_OPENMP", "1") != "0" and _compiler_accepts(compiler, "-fopenmp"):
                    ext.extra_compile_args.append("-fopenmp")
                    ext.extra_link_args.append("-fopenmp")
            if _want_cuda():
                self._add_cuda(ext)
        super().build_extensions()

    def _add_cuda(self, ext):
        """Compile kernels/*.cu with nvcc and link them with the static CUDA runtime
        (symbols hidden, so it cannot clash with torch's own libcudart)."""
        home = _cuda_home()
        nvcc = os.path.join(home, "bin", "nvcc")
        archs = os.environ.get("GEFEN_CUDA_ARCHS", "80 90").split()
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
        out = os.path.join(self.build_temp, "kernels")
        os.makedirs(out, exist_ok=True)
        for cu in _rel("kernels/*.cu"):
            obj = os.path.join(out, os.path.basename(cu) + ".o")
            cmd = [nvcc, "-std=c++17", "-O3", "--fmad=false", *gencode,
                   "-Xcompiler", "-fPIC,-fvisibility=hidden,-ffp-contract=off",
                   "-I", os.path.join(ROOT, "csrc/core"), "-I", os.path.join(ROOT, "kernels"),
                   "-c", os.path.join(ROOT, cu), "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            ext.extra_objects.append(obj)
        ext.define_macros.append(("GEFEN_WITH_CUDA", "1"))
        ext.include_dirs.append(os.path.join(ROOT, "kernels"))
        ext.extra_link_args += [_cudart_static(home), "-ldl", "-lrt",
                                "-lpthread", "-lstdc++", "-Wl,--exclude-libs,ALL"]


ext = Extension(
    "gefen._C",
    sources=_rel("csrc/core/*.c") + _rel("csrc/python/*.c"),
    include_dirs=[os.path.join(ROOT, "csrc/core"), os.path.join(ROOT, "csrc/python/third_party")],
    depends=_rel("csrc/core/*.h") + _rel("csrc/python/*.h") + _rel("kernels/*.cu")
    + _rel("kernels/*.h") + _rel("kernels/*.cuh"),
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
