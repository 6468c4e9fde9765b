"""The installed package: its name and version, the abi3 extension's build report
(gefen.show_config, python -m gefen), the refusal to mix with other distributions that import
as `gefen`, and the lazy top-level imports that let gefen._C load without torch. CI runs this
suite against the installed wheel, so these facts are checked on what users install."""

import io
import os
import platform
import re
import subprocess
import sys
from importlib import metadata

import pytest
import torch

import gefen
from gefen import _C, _config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, cwd, **env):
    """Runs `code` in a fresh interpreter from `cwd` (never the source tree's root)."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **env))


def test_distribution_name_and_single_sourced_version():
    assert _config.DISTRIBUTION == "gefen-optim"
    assert gefen.__version__ == metadata.version("gefen-optim")
    info = _C.build_info()
    assert (info["distribution"], info["version"]) == ("gefen-optim", gefen.__version__)


def test_version_is_pyprojects():
    path = os.path.join(ROOT, "pyproject.toml")
    if not os.path.exists(path):
        pytest.skip("no pyproject.toml beside tests/")
    with open(path) as f:
        declared = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M).group(1)
    assert gefen.__version__ == declared


def test_extension_is_abi3_for_python_3_10():
    assert os.path.basename(_C.__file__).startswith("_C.abi3.")
    assert _C.build_info()["limited_api"] == 0x030A0000


def test_show_config_reports_what_a_bug_report_needs():
    out = io.StringIO()
    gefen.show_config(file=out)
    text = out.getvalue()
    info = _C.build_info()
    assert text.startswith(f"gefen:          {gefen.__version__} (distribution gefen-optim")
    assert f"torch:          {torch.__version__} (" in text
    assert f"python:         {platform.python_version()} (" in text
    assert f"compiler:     {info['compiler']} ({info['compiler_version']})" in text
    assert f"flags:        {info['cflags']}" in text
    assert "CPython limited API 3.10 (abi3" in text
    assert f"CPU kernels:  {_C.simd_path()} (chosen at run time" in text
    search = ("over 16-bit keys" if _C.key_search() else "binary search over floats")
    assert f"code search:  {search}" in text
    assert f"threads:      {torch.get_num_threads()} (torch.get_num_threads()" in text
    openmp = "OpenMP:       yes (" if _C.has_threads() else "OpenMP:       no"
    assert openmp in text
    cuda = info["cuda_archs"] if _C.built_with_cuda() else "no (CPU-only build"
    assert f"CUDA kernels: {cuda}" in text


def test_python_m_gefen_prints_show_config(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gefen"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    expected = io.StringIO()
    gefen.show_config(file=expected)
    assert r.stdout.splitlines()[0] == expected.getvalue().splitlines()[0]
    assert f"CPU kernels:  {_C.simd_path()}" in r.stdout and "OpenMP:" in r.stdout


def _cpu_flags():
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        pytest.skip("the SIMD paths are x86-64 ones; /proc/cpuinfo tells their flags")
    with open("/proc/cpuinfo") as f:
        line = next(x for x in f if x.startswith("flags"))
    return set(line.split(":", 1)[1].split())


def test_simd_path_is_the_one_this_cpu_supports():
    flags = _cpu_flags()
    # the VBMI tables also need GFNI (one affine transform reverses the search's bits)
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vbmi", "gfni", "avx512_bf16"} <= flags:
        expected = "avx512bf16"
    elif {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vbmi", "gfni"} <= flags:
        expected = "avx512vbmi"
    elif {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        expected = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2"
    else:
        expected = "portable"
    assert _C.simd_path() == expected
    # the 16-bit key search: AMD CPUs with VBMI only (measured slower on Intel)
    with open("/proc/cpuinfo") as f:
        amd = any(x.startswith("vendor_id") and "AuthenticAMD" in x for x in f)
    assert _C.key_search() == (amd and expected in ("avx512bf16", "avx512vbmi"))


@pytest.mark.parametrize("threads", ["1", "3"])
def test_default_threads_is_openmps(threads, tmp_path):
    r = run_python("from gefen import _C; print(_C.default_threads(), _C.has_threads())",
                   tmp_path, OMP_NUM_THREADS=threads)
    assert r.returncode == 0, r.stderr
    count, has_threads = r.stdout.split()
    assert count == (threads if has_threads == "True" else "1")


def test_gefen_C_loads_without_importing_torch(tmp_path):
    r = run_python("import sys, gefen, gefen._C; print('torch' in sys.modules); "
                   "gefen.Gefen; print('torch' in sys.modules)", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]


def test_lazy_names_are_the_real_ones():
    from gefen.gefen import Gefen
    from gefen.hybrid import GefenMuonHybrid
    from gefen.muon import GefenMuon

    assert (gefen.Gefen, gefen.GefenMuon, gefen.GefenMuonHybrid) == (Gefen, GefenMuon, GefenMuonHybrid)
    assert {"Gefen", "GefenMuon", "GefenMuonHybrid", "show_config"} <= set(dir(gefen))
    assert gefen._C is _C
    namespace = {}
    exec("from gefen import *", namespace)
    assert namespace["GefenMuon"] is GefenMuon and namespace["__version__"] == gefen.__version__
    with pytest.raises(AttributeError, match="module 'gefen' has no attribute 'Adam'"):
        gefen.Adam  # noqa: B018


def _fake_distribution(folder, name, version, summary):
    """A dist-info folder as pip leaves it for `name`, providing nothing importable."""
    info = folder / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n")
    (info / "top_level.txt").write_text("gefen\n")
    return info


@pytest.mark.parametrize("name, version", [("gefen", "1.2.3"), ("gefen-x", "0.5.0")])
def test_import_refuses_a_mix_with_another_gefen_distribution(name, version, tmp_path):
    _fake_distribution(tmp_path, name, version, "Another optimizer")
    r = run_python("import gefen", tmp_path, PYTHONPATH=str(tmp_path))
    assert r.returncode == 1
    assert (f"ImportError: gefen: gefen-optim cannot be imported because another installed "
            f"distribution also provides the import package 'gefen': {name} {version} "
            f"(Another optimizer) in {tmp_path}") in r.stderr
    assert f"Keep one: pip uninstall -y {name} gefen-optim && pip install gefen-optim" in r.stderr


def test_check_single_install_names_every_other_distribution(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "gefen", "1.2.3", "Gefen")
    _fake_distribution(tmp_path, "gefen-x", "0.5.0", "Gefen fork")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"'gefen': gefen 1\.2\.3 \(Gefen\) in .*; gefen-x 0\.5\.0 "
                                          r"\(Gefen fork\) in .*pip uninstall -y gefen gefen-x "
                                          r"gefen-optim"):
        _config.check_single_install()


def test_check_single_install_accepts_this_distribution_alone():
    assert _config.other_installs() == []
    _config.check_single_install()


def test_quantizer_is_an_immutable_heap_type():
    q = _C.Quantizer(torch.linspace(-1, 1, 256))
    assert type(q).__module__ == "gefen._C" and type(q).__qualname__ == "Quantizer"
    with pytest.raises(TypeError, match="cannot set 'extra' attribute of immutable type 'gefen._C.Quantizer'"):
        _C.Quantizer.extra = 1
    with pytest.raises(TypeError, match="remap_table expects a Quantizer"):
        q.remap_table(object())
    with pytest.raises(TypeError, match=r"argument 1 must be gefen\._C\.Quantizer, not object"):
        _C.AdamStep([]).update(object())
    assert len(q.remap_table(q)) == 256
