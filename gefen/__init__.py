"""gefen: memory-efficient PyTorch optimizers with a C core.

``Gefen`` replaces ``torch.optim.AdamW`` with about one byte of optimizer state per
parameter instead of eight.
"""

from .gefen import Gefen

__version__ = "0.1.0"

__all__ = ["Gefen", "__version__"]
