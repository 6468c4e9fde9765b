"""What this installation of gefen is.

- ``version()``: the installed distribution's version, read from its metadata (the single
  source is ``version`` in pyproject.toml; setup.py bakes the same value into gefen._C).
- ``check_single_install()``: other projects on the package index also import as ``gefen``
  (upstream Gefen is ``gefen``, its fork ``gefen-x``). Installed beside this one they write
  into the same ``gefen`` folder; the import refuses such a mixture with the way out.
- ``show_config()`` / ``python -m gefen``: version, build, the CPU kernels and threads chosen
  on this machine, and the torch in use: what a bug report needs.

Nothing here imports torch unless show_config() is asked for the torch version.
"""

import os
import platform
import sys
from importlib import metadata

DISTRIBUTION = "gefen-optim"
IMPORT_NAME = "gefen"

# Other distributions whose import package is also `gefen`. A full scan of every installed
# distribution's top-level names costs ~0.2 s per import; looking these up costs ~0.3 ms.
OTHER_DISTRIBUTIONS = ("gefen", "gefen-x")

# A version for a source tree that was never installed (no metadata to read it from).
UNINSTALLED_VERSION = "0+unknown"

_OPENMP_RELEASES = {200505: "2.5", 200805: "3.0", 201107: "3.1", 201307: "4.0", 201511: "4.5",
                    201811: "5.0", 202011: "5.1", 202111: "5.2"}


def version() -> str:
    """The version of the installed gefen-optim distribution."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNINSTALLED_VERSION


def other_installs() -> list:
    """The installed distributions, other than this one, that provide the package `gefen`."""
    found = []
    for name in OTHER_DISTRIBUTIONS:
        try:
            found.append(metadata.distribution(name))
        except metadata.PackageNotFoundError:
            pass
    return found


def check_single_install() -> None:
    """Raises ImportError when another distribution that imports as `gefen` is installed."""
    others = other_installs()
    if not others:
        return
    listed = "; ".join(
        f"{d.metadata['Name']} {d.version} ({d.metadata.get('Summary') or 'no summary'}) "
        f"in {os.path.abspath(d.locate_file(''))}"
        for d in others
    )
    names = " ".join(d.metadata["Name"] for d in others)
    raise ImportError(
        f"gefen: {DISTRIBUTION} cannot be imported because another installed distribution "
        f"also provides the import package 'gefen': {listed}. Distributions that share an "
        f"import name overwrite each other's files, so what `import gefen` would load is a "
        f"mixture of both. Keep one: pip uninstall -y {names} {DISTRIBUTION} && "
        f"pip install {DISTRIBUTION}"
    )


def _torch_line() -> str:
    try:
        import torch
    except ImportError:
        return "not installed (the optimizers need it; gefen._C does not)"
    cuda = torch.version.cuda
    devices = torch.cuda.device_count() if cuda else 0
    where = f"CUDA {cuda}, {devices} device(s) visible" if cuda else "CPU build"
    return f"{torch.__version__} ({where}) from {os.path.dirname(torch.__file__)}"


def _threads_line(ext) -> str:
    core = ext.default_threads()
    torch = sys.modules.get("torch")
    if torch is None:
        return f"{core} (OpenMP default; the optimizers pass torch.get_num_threads())"
    return f"{torch.get_num_threads()} (torch.get_num_threads(), what the optimizers pass; " \
           f"OpenMP default {core})"


def _search_line(ext) -> str:
    if ext.simd_path() not in ("avx512bf16", "avx512vbmi"):
        return "binary search over floats or the exact lookup table (no VBMI with GFNI here)"
    if ext.key_search():
        return ("over 16-bit keys for blocks of 512 or more, or of a multiple of 128 with the "
                "codebook's fixed keys (AMD; the first six levels by one byte look-up where the "
                "codebook allows), floats otherwise; same codes")
    return "binary search over floats (the 16-bit key search is slower on this CPU); same codes"


def _openmp_line(version_macro: int) -> str:
    if not version_macro:
        return "no (single-threaded core)"
    release = _OPENMP_RELEASES.get(version_macro)
    return f"yes ({version_macro}" + (f", OpenMP {release})" if release else ")")


def _cuda_build_line(info: dict) -> str:
    if not info["cuda"]:
        return "no (CPU-only build: CUDA parameters are refused)"
    return f"{info['cuda_archs']} (nvcc {info['nvcc']}, static CUDA runtime)"


def _limited_api_line(hex_version: int) -> str:
    major, minor = hex_version >> 24, (hex_version >> 16) & 0xFF
    return f"CPython limited API {major}.{minor} (abi3: one build serves CPython {major}.{minor}+)"


def report() -> dict:
    """show_config()'s report: {section: {label: value}}; the section "" comes first,
    unheaded."""
    from . import _C

    info = _C.build_info()
    return {
        "": {
            "gefen": f"{version()} (distribution {DISTRIBUTION}, import name {IMPORT_NAME}, "
                     f"{os.path.dirname(os.path.abspath(__file__))})",
            "python": f"{platform.python_version()} ({platform.python_implementation()}, "
                      f"{platform.system()} {platform.machine()})",
            "torch": _torch_line(),
        },
        "build": {
            "extension": f"{os.path.basename(_C.__file__)}, {_limited_api_line(info['limited_api'])}",
            "built as": f"{info['distribution']} {info['version']}, core version {info['core_version']}",
            "compiler": f"{info['compiler']} ({info['compiler_version']})",
            "flags": info["cflags"],
            "OpenMP": _openmp_line(info["openmp"]),
            "CUDA kernels": _cuda_build_line(info),
        },
        "this machine": {
            "CPU kernels": f"{_C.simd_path()} (chosen at run time; avx512bf16, avx512vbmi, avx512, "
                           f"avx2 and portable give the same bits)",
            "code search": _search_line(_C),
            "threads": _threads_line(_C),
            "CUDA device": "visible" if _C.cuda_available()
            else "none visible" if info["cuda"] else "not built in",
        },
    }


def show_config(file=None) -> None:
    """Prints gefen's version, build, the CPU kernels and threads it uses here, and the torch
    in use: paste it into a bug report."""
    out = file if file is not None else sys.stdout
    for section, rows in report().items():
        indent = "  " if section else ""
        if section:
            print(f"{section}:", file=out)
        for label, value in rows.items():
            print(f"{indent}{label + ':':<{16 - len(indent)}}{value}", file=out)
