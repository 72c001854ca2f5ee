"""The scripts under examples/ and scripts/, imported as modules by the tests that run them."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def import_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (examples/ is on the path only while it imports)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def import_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``name`` (scripts/ is no package), loaded once: registered in
    ``sys.modules`` before it runs, since its dataclasses look their module up by name."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
