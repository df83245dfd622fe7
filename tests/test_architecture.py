"""The packages depend on each other one way (docs/architecture.md): checked on the source, and on
what importing the runtime actually loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> the project packages it may import (besides itself)
ALLOWED = {
    "ckptlib": set(),
    "workloads": set(),
    "trainrun": {"ckptlib", "workloads"},
    "tasks": {"ckptlib", "workloads", "trainrun"},
    "flows": {"ckptlib", "workloads", "trainrun", "tasks"},
    "ckpt": {"ckptlib", "workloads", "trainrun", "flows", "deployments"},  # never tasks: flows run them
}
PROJECT = set(ALLOWED) | {"deployments"}
# third-party packages a layer must never import
FORBIDDEN = {"ckptlib": {"prefect", "prefect_dask", "typer", "rich"}, "trainrun": {"prefect", "prefect_dask", "typer"},
             "workloads": {"prefect"}}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_the_layers_below_it(package):
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        imports = _imports(path)
        wrong = (imports & PROJECT) - ALLOWED[package] - {package}
        wrong |= imports & FORBIDDEN.get(package, set())
        if wrong:
            bad[str(path.relative_to(ROOT))] = sorted(wrong)
    assert not bad, f"{package} may import only {sorted(ALLOWED[package])}: {bad}"


def test_the_runtime_loads_no_prefect_and_the_form_no_torch():
    code = ("import sys; import trainrun.watchdog, trainrun.cut, trainrun.checks, trainrun.beats; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('prefect', 'prefect_dask')], 'prefect'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    code = ("import sys; import flows.params; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'prefect')], sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
