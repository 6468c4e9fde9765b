"""COMPATIBILITY.md stays true: every row of its tables names the tests that check it
(`tests/FILE.py::test_name`, a C test `tests/c/FILE.c::function`, or a script) or says
**untested**, every named test exists, and the declared version ranges are pyproject's."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "COMPATIBILITY.md")
UNTESTED = "**untested**"
# a backticked repository path, optionally with ::name
REF = re.compile(r"`((?:tests|tools|kernels|benchmarks)/[\w./-]+)(?:::(\w+))?`")


def _rows():
    """(line number, cells) of every body row of every table with a 'tested by' column."""
    rows, header = [], None
    with open(DOC, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line.startswith("|"):
                header = None
                continue
            cells = [c.strip() for c in line.strip("|").split("|")]
            if header is None:
                header = cells
            elif set("".join(cells)) <= set("-: "):
                continue  # the separator row
            elif header[-1] == "tested by":
                rows.append((lineno, cells))
    return rows


def _python_tests(path):
    """Names of the test functions of a pytest file (module level and Test* classes)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names |= {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    return names


def _c_functions(path):
    with open(path, encoding="utf-8") as f:
        return set(re.findall(r"^(?:static\s+)?\w[\w\s\*]*?\b(\w+)\s*\([^;]*\)\s*\{", f.read(), re.M))


def _exists(path, name):
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):
        return False
    if name is None:
        return True
    if path.endswith(".py"):
        return name in _python_tests(full)
    if path.endswith(".c"):
        return name in _c_functions(full)
    return False


def test_the_document_has_tables_with_tested_by_columns():
    rows = _rows()
    assert len(rows) >= 25, len(rows)
    refs = [m for _, cells in rows for m in REF.finditer(cells[-1])]
    assert len(refs) >= 50, len(refs)


def test_every_row_names_its_tests_or_says_untested():
    bare = [
        f"COMPATIBILITY.md:{lineno}: {cells[0]!r}"
        for lineno, cells in _rows()
        if not REF.search(cells[-1]) and UNTESTED not in cells[-1] and cells[-1] != "see below"
    ]
    assert not bare, "rows that name no test and are not marked **untested**:\n" + "\n".join(bare)


def test_every_named_test_exists():
    missing = [
        f"COMPATIBILITY.md:{lineno}: {m.group(0)}"
        for lineno, cells in _rows()
        for m in REF.finditer(cells[-1])
        if not _exists(m.group(1), m.group(2))
    ]
    assert not missing, "named tests or files that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("path, name, found", [
    ("tests/test_gefen_api.py", "test_named_parameters_and_groups", True),
    ("tests/test_gefen_api.py", "test_no_such_thing", False),
    ("tests/test_gefen_api.py", "_train", False),  # a helper is not a test
    ("tests/c/test_kernels.c", "test_simd_blocks", True),
    ("tests/c/test_kernels.c", "test_no_such_thing", False),
    ("tools/compat_check.sh", None, True),
    ("tools/no_such_script.sh", None, False),
])
def test_the_checker_tells_existing_from_missing(path, name, found):
    assert _exists(path, name) is found


def test_declared_versions_are_the_documented_ones():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        pyproject = f.read()
    with open(DOC, encoding="utf-8") as f:
        doc = f.read()
    python = re.search(r'^requires-python\s*=\s*"([^"]+)"', pyproject, re.M).group(1)
    deps = re.search(r"^dependencies\s*=\s*\[([^\]]*)\]", pyproject, re.M).group(1)
    torch_spec = re.search(r'"torch([^"]*)"', deps).group(1)
    assert f"declared `{python}`" in doc
    assert f"declared `torch{torch_spec}`" in doc
