"""The scripts under examples/, imported as modules by the tests that run them."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def import_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (examples/ is on the path only while it imports)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))
