"""Builds gefen._C from csrc/: C11 core + CPython binding, no libtorch link.

Environment:
  GEFEN_OPENMP=0   build the core single-threaded (default: OpenMP when the compiler has it)
  GEFEN_CUDA=0/1   force the CUDA kernels off/on (default: on when nvcc and a CUDA torch exist)
"""
import os
import sys
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
        super().build_extensions()


ext = Extension(
    "gefen._C",
    sources=_rel("csrc/core/*.c") + _rel("csrc/python/*.c"),
    include_dirs=[os.path.join(ROOT, "csrc/core"), os.path.join(ROOT, "csrc/python/third_party")],
    depends=_rel("csrc/core/*.h") + _rel("csrc/python/*.h"),
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
