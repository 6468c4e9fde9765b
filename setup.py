"""Builds gefen._C from csrc/: C11 core + CPython binding, no libtorch link; optionally
the CUDA kernels of kernels/ (compiled with nvcc, linked with the static CUDA runtime).

The extension uses only the CPython limited API of the oldest Python the package supports
(Py_LIMITED_API, 3.10), so one `cp310-abi3` wheel serves every later CPython; it reads
tensors through DLPack, so it serves every PyTorch too. What the build used (compiler,
flags, OpenMP, CUDA architectures) is baked into the extension for `gefen.show_config()`.

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


def _nvcc_release(nvcc):
    """'13.0, V13.0.88' from `nvcc --version`, or '?'."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "release" in line:
            return line.split("release", 1)[1].strip()
    return "?"


def _c_string(text):
    """`text` as a C string literal (ASCII; anything else becomes '?')."""
    safe = "".join(c if " " <= c <= "~" else "?" for c in text)
    return '"' + safe.replace("\\", "\\\\").replace('"', '\\"') + '"'


class BuildExt(build_ext):
    def build_extensions(self):
        compiler = self.compiler
        cuda = _want_cuda()
        for ext in self.extensions:
            if compiler.compiler_type == "unix":
                ext.extra_compile_args += [
                    "-std=c11", "-O3", "-ffp-contract=off", "-fvisibility=hidden",
                    "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                ]
                if os.environ.get("GEFEN_OPENMP", "1") != "0" and _compiler_accepts(compiler, "-fopenmp"):
                    ext.extra_compile_args.append("-fopenmp")
                    ext.extra_link_args.append("-fopenmp")
            info = {"CUDA_ARCHS": "", "NVCC": ""}
            if cuda:
                info = self._add_cuda(ext)
            self._write_build_info(ext, info)
        super().build_extensions()

    def _write_build_info(self, ext, info):
        """gefen_build_info.h (in the build folder): the distribution, version, compiler and
        flags of this build and its CUDA architectures, for gefen.show_config(). The
        compiler's version and OpenMP come from its own macros (module.c)."""
        command = getattr(self.compiler, "compiler_so", None) or ["?"]
        info = {
            "DIST": self.distribution.metadata.get_name(),
            "VERSION": self.distribution.metadata.get_version(),
            "COMPILER": command[0],
            "CFLAGS": " ".join(command[1:] + ext.extra_compile_args),
            **info,
        }
        folder = os.path.join(self.build_temp, "generated")
        os.makedirs(folder, exist_ok=True)
        lines = ["/* Generated by setup.py: what this build of gefen._C used. */"]
        lines += [f"#define GEFEN_BUILD_{key} {_c_string(value)}" for key, value in info.items()]
        with open(os.path.join(folder, "gefen_build_info.h"), "w") as f:
            f.write("\n".join(lines) + "\n")
        ext.include_dirs.append(folder)

    def _add_cuda(self, ext):
        """Compile kernels/*.cu with nvcc and link them with the static CUDA runtime
        (symbols hidden, so it cannot clash with torch's own libcudart). Returns the
        build-info entries of the CUDA build."""
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
        return {"CUDA_ARCHS": " ".join(f"sm_{a}" for a in archs), "NVCC": _nvcc_release(nvcc)}


# The oldest CPython that requires-python admits: the extension keeps to its limited API,
# so the wheel is tagged cp310-abi3 and installs on every later CPython.
LIMITED_API_TAG, LIMITED_API_HEX = "cp310", "0x030A0000"

ext = Extension(
    "gefen._C",
    sources=_rel("csrc/core/*.c") + _rel("csrc/python/*.c"),
    include_dirs=[os.path.join(ROOT, "csrc/core"), os.path.join(ROOT, "csrc/python/third_party")],
    define_macros=[("Py_LIMITED_API", LIMITED_API_HEX)],
    py_limited_api=True,
    depends=_rel("csrc/core/*.h") + _rel("csrc/python/*.h") + _rel("kernels/*.cu")
    + _rel("kernels/*.h") + _rel("kernels/*.cuh"),
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": LIMITED_API_TAG}},
)
