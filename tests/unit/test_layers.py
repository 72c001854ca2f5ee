"""The layering of the package: every import inside ``dimuon`` points down (or within its own package).

```
cli.py                       dimuon train | sample | eval | groups | plan | bench: loads the commands lazily
  plan/                      counts with bench's census, builds models as groups.py does
  bench/                     may also drive the other two commands (bench quality runs dimuon train
  train/  eval/  groups.py   and dimuon eval --compare); train and eval never import each other
    metrics/                 may import data and dit
    dit/  data/              never each other, nor metrics
      io.py  log.py  optim/  import nothing else of dimuon
integrations/                other trainers' extension points (torchtitan): import optim only; nothing imports them
```
"""

from __future__ import annotations

import ast
from pathlib import Path

import dimuon

ROOT = Path(dimuon.__file__).parent
LOW = {"io", "log"}
BLOCKS = {"data", "dit", "metrics"}
# package (or top-level module) -> the dimuon packages it may import, besides itself
ALLOWED: dict[str, set[str]] = {
    "io": set(),
    "log": set(),
    "optim": set(),
    "data": LOW,
    "dit": LOW,
    "metrics": LOW | {"data", "dit"},
    "train": LOW | BLOCKS | {"optim"},
    "eval": LOW | BLOCKS | {"optim"},
    "bench": LOW | BLOCKS | {"optim", "train", "eval"},
    "groups": LOW | BLOCKS | {"optim"},
    "plan": LOW | BLOCKS | {"optim", "bench", "groups"},
    "integrations": {"optim"},
    "cli": set(),
    "__init__": set(),
}


def package_of(path: Path) -> str:
    """``train`` for src/dimuon/train/loop.py, ``io`` for src/dimuon/io.py."""
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_packages(source: str, module: str) -> list[tuple[int, str]]:
    """``(line, dimuon package)`` of every import in a module's source, lazy ones inside functions included.

    ``module`` is the importing module's dotted name (``dimuon.train.loop``, ``dimuon.train.__init__``), to
    resolve relative imports.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[: -node.level] if node.level else []
            names = [".".join([*base, *([node.module] if node.module else [])])]
            if names == ["dimuon"]:  # from dimuon import x: x is the package
                names = [f"dimuon.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "dimuon" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def module_name(path: Path) -> str:
    """The dotted name relative imports resolve against (a package's ``__init__`` keeps its last part)."""
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)


def test_every_import_points_down_the_layers() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        package = package_of(path)
        assert package in ALLOWED, f"{path}: a new package needs its place in the layering ({package})"
        for line, target in imported_packages(path.read_text(encoding="utf-8"), module_name(path)):
            if target != package and target not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} imports dimuon.{target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


# Modules that load other *packages* by name, and why (never a dimuon module: checked below).
LOADS_THIRD_PARTY_BY_NAME = {
    "bench/peers/registry.py": "the optional peer optimizer packages of the benchmarks, probed by name",
    "groups.py": "dimuon groups --builder module:callable, the user's model builder",
}


def test_only_the_cli_loads_modules_by_name() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "cli.py" or path.relative_to(ROOT).as_posix() in LOADS_THIRD_PARTY_BY_NAME:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            called = node.func if isinstance(node, ast.Call) else None
            name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", None)
            if name in ("import_module", "__import__"):
                offenders.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not offenders, "modules loaded by name outside the CLI: " + ", ".join(offenders)


def test_the_checker_sees_upward_lazy_and_relative_imports() -> None:
    source = (
        "import torch\nfrom dimuon.train.loop import train\n\n"
        "def f():\n    from dimuon import eval\n    from ..bench import quality\n    from .frechet import x\n"
    )
    found = imported_packages(source, "dimuon.metrics.probe")
    assert found == [(2, "train"), (5, "eval"), (6, "bench"), (7, "metrics")]
    assert [t for _, t in found if t != "metrics" and t not in ALLOWED["metrics"]] == ["train", "eval", "bench"]
    assert package_of(ROOT / "train" / "loop.py") == "train" and package_of(ROOT / "io.py") == "io"
    assert imported_packages("from .loop import train", module_name(ROOT / "train" / "__init__.py")) == [(1, "train")]


def test_name_loaders_load_no_dimuon_module() -> None:
    from dimuon.bench.peers import PEERS

    assert PEERS and not [p.module for p in PEERS.values() if p.module.split(".")[0] == "dimuon"]


def test_integrations_import_their_trainer_only_when_imported() -> None:
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import dimuon, dimuon.optim, dimuon.integrations\n"
        "assert 'torchtitan' not in sys.modules, 'dimuon imported torchtitan'\n"
        "sys.modules['torchtitan'] = None  # as if not installed\n"
        "try:\n"
        "    import dimuon.integrations.torchtitan\n"
        "except ImportError as error:\n"
        "    assert \"pip install 'dimuon[torchtitan]'\" in str(error), error\n"
        "else:\n"
        "    raise AssertionError('no ImportError without torchtitan')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
