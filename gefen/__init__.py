"""gefen: memory-efficient PyTorch optimizers with a C core.

``Gefen`` replaces ``torch.optim.AdamW``, ``GefenMuon`` replaces ``torch.optim.Muon``, and
``GefenMuonHybrid`` runs Muon on hidden matrices with Gefen or AdamW for the rest — each
with about one byte of optimizer state per parameter instead of AdamW's eight.

The package is distributed as ``gefen-optim`` (``pip install gefen-optim``) and imported as
``gefen``. ``gefen.show_config()`` (or ``python -m gefen``) prints what a bug report needs.

The optimizers, and with them torch, load on first use, so that ``import gefen._C``,
``gefen.show_config()`` and ``python -m gefen`` work where torch is not installed.
"""

import importlib
import importlib.util

from . import _config

_config.check_single_install()

__version__ = _config.version()
show_config = _config.show_config

# public name -> the submodule that defines it
_OPTIMIZERS = {"Gefen": "gefen", "GefenMuon": "muon", "GefenMuonHybrid": "hybrid"}

__all__ = ["Gefen", "GefenMuon", "GefenMuonHybrid", "show_config", "__version__"]


def __getattr__(name):
    """The optimizers on first use; a submodule (``gefen._C``, ``gefen.muon``) likewise, as
    if ``import gefen`` had imported it."""
    if name in _OPTIMIZERS:
        value = getattr(importlib.import_module(f"{__name__}.{_OPTIMIZERS[name]}"), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_OPTIMIZERS))
