"""Shared pytest setup: the oracle module (tests/reference.py) is importable as `reference`."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
