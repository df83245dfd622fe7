"""The packages depend on each other one way (docs/architecture.md): checked on the source, and on
what importing the runtime actually loads."""

from __future__ import annotations

import ast
import json
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
    "bench": {"ckptlib", "workloads", "trainrun", "deployments"},  # deployments: SeaweedFS for the S3 runs
    "ckpt": {"ckptlib", "workloads", "trainrun", "flows", "deployments", "bench"},  # never tasks: flows run them
}
PROJECT = set(ALLOWED) | {"deployments"}
# third-party packages a layer must never import
FORBIDDEN = {"ckptlib": {"prefect", "prefect_dask", "typer", "rich"}, "trainrun": {"prefect", "prefect_dask", "typer"},
             "workloads": {"prefect"}, "bench": {"prefect", "prefect_dask"}}


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


# --- reading a run loads no torch --------------------------------------------------------------------

def _fresh_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter of this project; its stdout (it fails the test if it fails)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_watchdog_and_its_flow_load_no_torch():
    """Watching runs reads JSON (beats, fences, documents): no torch until a shard is rerun."""
    code = ("import sys; import trainrun.watchdog, trainrun.documents, trainrun.resume, trainrun.results; "
            "assert 'torch' not in sys.modules, 'trainrun.watchdog'; "
            "import flows.watchdog; assert 'torch' not in sys.modules, 'flows.watchdog'")
    _fresh_python(code)


def test_ckpt_status_of_a_running_run_loads_no_torch(tmp_path):
    """``ckpt status`` on a real run (step 0 committed, a shard's round beaten, the coordinator beating
    in round 1, a fence): the same view as ever, and no torch, no Prefect in its process."""
    from ckptlib import Checkpointer
    from trainrun.beats import CoordinatorBeat
    from trainrun.documents import CoordinatorInfo, Cut
    from trainrun.shard_round import train_shard_round
    from trainrun.spec import RunSpec
    from trainrun.step_zero import write_step_zero

    url = str(tmp_path / "runs" / "r1")
    spec = RunSpec(workload="tinylm", workload_extra={"d_model": 16, "n_layers": 1, "ctx": 8, "corpus_bytes": 32768},
                   shards=2, steps_per_round=3)
    with Checkpointer(url) as ck:
        write_step_zero(ck, spec)
        train_shard_round(ck, spec, 0, 1, Cut.of_step(0), heartbeat_every_s=0.05)
        assert ck.fence("shard-1", 1, reason="silent for the test", by="test")
        beat = CoordinatorBeat(ck.store, CoordinatorInfo(run_id="r1", spec=spec), every_s=60.0).start()
        beat.update(round_no=1, phase="shards", cut=Cut.of_step(0))
    code = (f"import json, sys; from ckpt.cli import app; app(['status', {str(tmp_path / 'runs')!r}, '--json'], "
            "standalone_mode=False); "
            "print(json.dumps(sorted(m for m in ('torch', 'prefect') if m in sys.modules)))")
    out = _fresh_python(code)
    beat.finish()
    runs, loaded = out.strip().rsplit("\n", 1)
    assert loaded == "[]", loaded
    [run] = json.loads(runs)
    assert (run["run"], run["state"], run["committed"]) == ("r1", "running", 0)
    assert (run["coordinator"]["round"], run["coordinator"]["phase"]) == (1, "shards")
    assert [(p["part"], p["state"], p["live"]) for p in run["parts"]] == [("shard-0", "finished", 0),
                                                                           ("shard-1", "waiting", 1)]
    assert [(f["part"], f["generation"], f["reason"]) for f in run["fences"]] == [("shard-1", 1, "silent for the test")]


def test_ckpt_help_loads_no_schema_torch_or_prefect():
    """``ckpt --help`` loads no pydantic; ``ckpt train --help`` shows the options' defaults without the
    schema they come from (flows.params, trainrun.spec: a test in test_train_units.py checks them
    against it). Typer itself imports pydantic to parse a command's options."""
    heavy = "('torch', 'prefect', 'flows.params', 'trainrun.spec')"
    code = ("import sys; from ckpt.cli import app\n"
            "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'pydantic' not in sys.modules, 'ckpt --help'\n"
            "try:\n    app(['train', '--help'])\nexcept SystemExit:\n    pass\n"
            f"loaded = [m for m in {heavy} if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    assert "--steps-per-round" in _fresh_python(code)


# --- no function longer than a page -------------------------------------------------------------------

MAX_FUNCTION_LINES = 100


def test_no_function_is_longer_than_a_page():
    """Every function (methods and nested ones included) of the project's packages fits in
    ``MAX_FUNCTION_LINES`` lines, from its ``def`` to its last line: a longer one does several jobs."""
    long = {}
    for package in ("ckptlib", "trainrun", "tasks", "flows", "ckpt"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long[(str(path.relative_to(ROOT)), node.name)] = lines
    assert not long, long


# --- one error tree -------------------------------------------------------------------------------------

# Raised on purpose but never meant to be caught as an error: a simulated process death (the protocol kits).
NOT_ERRORS = {"ckptlib.testing.faulty.SimulatedCrash"}


def test_every_public_error_class_is_a_checkpoint_error():
    """Every exception class the project defines is in ckptlib's tree (stdlib mixins allowed), so a
    caller catches one tree; private ones (``_Stop``) are control flow that never leaves its module."""
    import importlib
    import inspect
    import pkgutil

    from ckptlib import CheckpointError

    outside = []
    for name in ("ckptlib", "trainrun", "tasks", "flows", "ckpt", "bench", "deployments", "workloads"):
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            if info.name.endswith(".__main__"):  # runs the command
                continue
            module = importlib.import_module(info.name)
            for attr, obj in vars(module).items():
                qualname = f"{module.__name__}.{attr}"
                if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__
                        and not attr.startswith("_") and not issubclass(obj, CheckpointError)
                        and qualname not in NOT_ERRORS):
                    outside.append(qualname)
    assert not outside, f"error classes outside ckptlib.errors.CheckpointError: {outside}"


# --- no import circle -----------------------------------------------------------------------------------

CIRCLE_PACKAGES = ("ckptlib", "trainrun", "flows", "tasks", "deployments", "ckpt", "workloads", "bench")


def _project_modules() -> dict[str, Path]:
    """Every module of ``CIRCLE_PACKAGES`` (a package by its own name) -> its file."""
    modules = {}
    for package in CIRCLE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports, anywhere in it (module level, in a function, under
    ``TYPE_CHECKING``): relative imports resolved, ``from pkg import name`` to ``pkg.name`` when that
    is a module, else to the nearest enclosing module."""
    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [nearest(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [nearest(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else nearest(base)
                           for alias in node.names]
            graph[name] |= {t for t in targets if t and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(component)
    return circles


def test_no_import_circle_between_project_modules():
    """No module imports, even lazily inside a function, a module that imports it back, directly or
    through others: each circle is one idea split in two files, or a lower module reaching up."""
    circles = [sorted(c) for c in _circles(_import_graph(_project_modules()))]
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in sorted(circles))
