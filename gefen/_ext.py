"""Loads the compiled core, with an error that says how to build it."""

try:
    from gefen import _C  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "gefen's C extension (gefen._C) is not built. Install the package with "
        "`pip install .` (or `pip install -e .`) from the source tree; a C compiler is needed."
    ) from exc

__all__ = ["_C"]
