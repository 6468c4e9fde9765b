"""gefen: memory-efficient PyTorch optimizers with a C core.

``Gefen`` replaces ``torch.optim.AdamW``, ``GefenMuon`` replaces ``torch.optim.Muon``, and
``GefenMuonHybrid`` runs Muon on hidden matrices with Gefen or AdamW for the rest — each
with about one byte of optimizer state per parameter instead of AdamW's eight.
"""

from .gefen import Gefen
from .hybrid import GefenMuonHybrid
from .muon import GefenMuon

__version__ = "0.1.0"

__all__ = ["Gefen", "GefenMuon", "GefenMuonHybrid", "__version__"]
