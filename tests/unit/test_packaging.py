"""The wheel installs beside the torch already there, and its optimizer core runs on torch alone.

The wheel is built from the checkout's files and installed, with pip's dependency resolution but no index, into a
fresh venv that sees only torch and the distributions torch requires (symlinked, not copied). pip must find torch
already satisfied: a wheel that asked for another torch than the one installed fails to install here, where a
user's pip would replace their torch. Nothing is downloaded; pip's configuration files and ``PIP_*`` variables
are ignored, so no index, find-links or constraints file of the machine takes part.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# What the build reads: pyproject.toml names the readme and the license file; the package lives under src/.
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "src")
# Modules of dimuon's other layers (the harness) bring these; the optimizer core must not need them.
HARNESS_MODULES = {"numpy", "scipy", "tqdm", "tyro", "matplotlib", "safetensors", "PIL", "sklearn", "mlxtend"}

# Run by the new venv's interpreter: import the optimizer core, take 4 Periodic Row-wise Muon steps on two Linear
# layers (k=2: spectral and RowNorm steps) and report what was imported beyond torch's own imports and what changed,
# as one JSON line.
OPTIMIZER_SCRIPT = """
import json, os, sys
from importlib import metadata
import torch
from torch import nn

with_torch = {name.partition(".")[0] for name in sys.modules}
import dimuon
from dimuon.optim import PeriodicRowMuon, param_groups

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
before = {name: p.detach().clone() for name, p in model.named_parameters() if p.ndim == 2}
opt = PeriodicRowMuon(param_groups(model), lr=0.02, k=2)
x = torch.randn(5, 8)
for _ in range(4):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
after = dict(model.named_parameters())
print(json.dumps({
    "torch_version": torch.__version__,
    "torch_file": os.path.realpath(torch.__file__),
    "dimuon_file": os.path.realpath(dimuon.__file__),
    "dimuon_version": dimuon.__version__,
    "metadata_version": metadata.version("dimuon"),
    "new_top_modules": sorted({name.partition(".")[0] for name in sys.modules} - with_torch),
    "dimuon_modules": sorted(name for name in sys.modules if name.startswith("dimuon.")),
    "matrices": opt.refresh_stats()["matrices"],
    "changed": {name: not torch.equal(w, after[name]) for name, w in before.items()},
}))
"""


@dataclass
class Installed:
    """The built wheel and the venv it was installed into, with pip's and the script's outcomes."""

    wheel: Path
    env_python: Path
    site_packages: Path
    linked: Path
    install: subprocess.CompletedProcess[str]


def pip_environment() -> dict[str, str]:
    """This process's environment without pip's settings (no configuration file, no ``PIP_*`` variable) and without
    ``PYTHONPATH``: the installed package is run isolated (``-I``), so pip must not find it on a path it ignores."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_") and key != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip loads no configuration file at all (global, user or site)
    return env


def pip(*args: str | Path, python: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run this interpreter's pip (on ``python``'s environment when given) with no cache and no configuration."""
    target = ["--python", str(python)] if python is not None else []
    command = [sys.executable, "-m", "pip", *target, "--no-input", "--disable-pip-version-check", "--no-cache-dir"]
    return subprocess.run(
        [*command, *map(str, args)], capture_output=True, text=True, env=pip_environment(), timeout=300, check=False
    )


def requirement_name(requirement: str) -> tuple[str, str]:
    """The distribution name and the environment marker ('' without one) of a ``Requires-Dist`` string."""
    spec, _, marker = requirement.partition(";")
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    assert match, f"unparsed requirement {requirement!r}"
    return match.group(1), marker.strip()


def link_distribution_closure(root: str, dest: Path) -> dict[str, str]:
    """Symlink into ``dest`` the installed files of ``root`` and of every distribution it requires, recursively.

    Each distribution's top-level entries (packages, modules, its ``.dist-info``) are found from its RECORD through
    ``importlib.metadata``; requirements behind an ``extra`` marker are left out, and a requirement with another
    marker is followed where it is installed (a missing one that pip needs makes the install fail, visibly).
    Returns ``{distribution: version}`` of what was linked.
    """
    linked: dict[str, str] = {}
    pending = [root]
    while pending:
        name = pending.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in linked:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if name == root:
                raise
            continue
        if dist.files is None:
            pytest.skip(f"{name} {dist.version} lists no installed files (no RECORD): it cannot be linked")
        base = Path(str(dist.locate_file("")))
        for top in sorted({file.parts[0] for file in dist.files}):
            if top in ("..", "__pycache__") or top.endswith(".pth") or (dest / top).exists():
                continue  # scripts outside site-packages, caches, path hooks; a shared namespace directory once
            if (base / top).exists():
                (dest / top).symlink_to(base / top)
        linked[key] = dist.version
        for requirement in dist.requires or []:
            dep, marker = requirement_name(requirement)
            if "extra" not in marker:
                pending.append(dep)
    return linked


def copy_build_inputs(dest: Path) -> None:
    """Copy the files the build reads into ``dest``: building in the checkout would write build/ and egg-info there
    (and setuptools' build/ keeps modules from earlier builds, which would end up in the wheel)."""
    dest.mkdir()
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(source, dest / name)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """Build the wheel from the checkout and install it into a fresh venv that holds only this torch (linked)."""
    tmp = tmp_path_factory.mktemp("packaging")
    copy_build_inputs(tmp / "source")
    built = pip("wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "wheels", tmp / "source")
    assert built.returncode == 0, f"building the wheel failed:\n{built.stdout}\n{built.stderr}"
    (wheel,) = (tmp / "wheels").glob("dimuon-*.whl")

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp / "env"], check=True, timeout=120)
    env_python = tmp / "env" / "bin" / "python"
    site_packages = Path(
        subprocess.run(
            [env_python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    )
    linked = tmp / "linked"
    linked.mkdir()
    link_distribution_closure("torch", linked)
    (site_packages / "linked-torch.pth").write_text(f"{linked}\n", encoding="utf-8")

    # Dependency resolution on, index off: torch must be found satisfied by the linked one.
    install = pip("install", "--no-index", "--no-compile", wheel, python=env_python)
    return Installed(wheel, env_python, site_packages, linked, install)


@pytest.fixture(scope="module")
def installed_ok(installed: Installed) -> Installed:
    """The installed venv, where the install succeeded (its own test reports pip's failure)."""
    if installed.install.returncode != 0:
        pytest.fail("the wheel did not install beside this torch: see test_wheel_installs_beside_the_torch_there")
    return installed


def wheel_metadata(wheel: Path) -> tuple[list[str], str]:
    """The wheel's file names and the text of its METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        return names, archive.read(meta).decode()


def checkout_version() -> str:
    """``dimuon.__version__`` as the checkout's source states it (read, not imported)."""
    tree = ast.parse((ROOT / "src" / "dimuon" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("src/dimuon/__init__.py assigns no __version__")


def test_wheel_ships_types_license_and_its_one_version(installed: Installed) -> None:
    """py.typed and LICENSE are in the wheel, and its metadata's version is ``dimuon.__version__``."""
    names, meta = wheel_metadata(installed.wheel)
    assert "dimuon/py.typed" in names
    assert any(re.fullmatch(r"dimuon-[^/]+\.dist-info/licenses/LICENSE", n) for n in names), names
    assert "\nLicense-Expression: Apache-2.0\n" in meta
    version = re.search(r"^Version: (\S+)$", meta, re.M)
    assert version and version.group(1) == checkout_version()


def test_wheel_requires_a_torch_range(installed: Installed) -> None:
    """The wheel's torch requirement is a range (a lower bound), never one version that pip would install."""
    _, meta = wheel_metadata(installed.wheel)
    torch_reqs = [
        line.removeprefix("Requires-Dist: ")
        for line in meta.splitlines()
        if line.startswith("Requires-Dist: ") and requirement_name(line.removeprefix("Requires-Dist: "))[0] == "torch"
    ]
    assert len(torch_reqs) == 1, torch_reqs
    spec, _, marker = torch_reqs[0].partition(";")
    assert not marker.strip(), f"torch is required under a marker only: {torch_reqs[0]!r}"
    clauses = [c.strip() for c in spec.removeprefix("torch").strip(" ()").split(",") if c.strip()]
    assert not any(c.startswith(("==", "===", "~=")) for c in clauses), f"torch is pinned: {torch_reqs[0]!r}"
    assert any(c.startswith(">=") for c in clauses), f"no lower bound on torch: {torch_reqs[0]!r}"


def test_wheel_installs_beside_the_torch_there(installed: Installed) -> None:
    """pip installs the wheel without an index, finding this torch satisfied, and leaves it where it was."""
    result = installed.install
    assert result.returncode == 0, (
        f"pip could not install the wheel beside torch {torch.__version__} without an index: the wheel asks for "
        f"another torch (or another missing distribution), which a user's pip would download in place of theirs.\n"
        f"{result.stdout}\n{result.stderr}"
    )
    listed = pip("list", "--verbose", "--format=json", python=installed.env_python)
    assert listed.returncode == 0, listed.stderr
    dists = {re.sub(r"[-_.]+", "-", d["name"]).lower(): d for d in json.loads(listed.stdout)}
    assert dists["torch"]["version"] == torch.__version__
    assert Path(dists["torch"]["location"]).resolve() == installed.linked.resolve(), dists["torch"]
    assert dists["dimuon"]["version"] == checkout_version()
    installed_here = {p.name for p in installed.site_packages.iterdir()}
    assert "torch" not in installed_here, "pip installed a second torch into the venv"


def test_optimizer_core_runs_on_torch_alone(installed_ok: Installed) -> None:
    """The installed ``dimuon.optim`` imports and steps with torch only, on this very torch."""
    run = subprocess.run(
        [installed_ok.env_python, "-I", "-c", OPTIMIZER_SCRIPT],
        capture_output=True,
        text=True,
        cwd=installed_ok.linked.parent,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, f"dimuon.optim failed in a venv with torch alone:\n{run.stderr}"
    seen = json.loads(run.stdout.strip().splitlines()[-1])

    assert seen["torch_version"] == torch.__version__
    assert seen["torch_file"] == os.path.realpath(torch.__file__)
    assert Path(seen["dimuon_file"]).is_relative_to(installed_ok.site_packages.resolve()), seen["dimuon_file"]
    assert seen["dimuon_version"] == seen["metadata_version"] == checkout_version()

    harness = HARNESS_MODULES & set(seen["new_top_modules"])
    assert not harness, f"dimuon.optim imported modules of the harness's dependencies: {sorted(harness)}"
    outside = [m for m in seen["dimuon_modules"] if not m.startswith("dimuon.optim")]
    assert not outside, f"dimuon.optim imported other dimuon modules: {outside}"

    assert set(seen["matrices"]) == {"0.weight", "1.weight"}, seen["matrices"]
    for name, counts in seen["matrices"].items():
        assert counts["steps"] == 4 and 0 < counts["spectral"] < 4, (name, counts)  # spectral and RowNorm steps
    assert seen["changed"] == {"0.weight": True, "1.weight": True}
