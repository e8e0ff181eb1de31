"""The architecture of docs/design.md holds: which package may import which, no import cycle, only
gradnorm/dist/ touches torch.distributed, and the notebooks' side loads no distributed code.

The import table is read from the source with ``ast`` (imports inside functions count: a lazy
import is still a dependency), over every module of the package. Loading is checked in a fresh
interpreter, so that nothing this test session already imported hides what a notebook's imports
load. ``import torch`` itself (torch 2.13) already loads ``torch.distributed`` and
``torch.nn.parallel.distributed``: that check subtracts what a bare ``import torch`` loads and
asserts only on what gradnorm's imports add. Each check has a control that must trip it, so a
check that cannot fail would show.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gradnorm"

# Which of gradnorm's packages each part may import (its own always). "entry" is the package's
# top level: gradnorm/__init__.py and the commands gradnorm/train.py and gradnorm/export.py.
ALLOWED = {
    "core": set(),
    "cli": {"core"},
    "dist": {"core"},
    "models": {"core"},
    "tasks": {"cli"},
    "trainer": {"core", "cli", "dist", "models", "tasks"},
    "entry": {"core", "cli", "dist", "models", "tasks", "trainer", "audit"},  # audit: gradnorm.testing
    "teach": {"core", "dist", "models", "tasks", "trainer"},
    "audit": {"core", "cli", "teach", "dist"},  # dist: the trainer audit's worker leaves as the trainer's ranks do
    "integrations": set(),  # the fix inside other projects' trainers: their APIs only
}
# The teaching modules that exist to start processes (spawned gloo ranks, torchrun runs): the only
# ones a notebook imports that may load the distributed shell.
LAUNCHERS = {"gradnorm.teach.launch", "gradnorm.teach.harness", "gradnorm.teach.checks"}
# The distributed shell and what it wraps: none of it may come with a notebook's other imports.
SHELL = ("gradnorm.dist", "gradnorm.core.accumulate", "torch.nn.parallel.distributed", "torch.distributed.fsdp")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


MODULES = {module_name(p): p for p in library_files()}


def part_of(module: str) -> str:
    """The package of ``module`` under gradnorm/ ("core", "trainer"...), or "entry" for the top level."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and (PACKAGE / parts[1]).is_dir() else "entry"


def gradnorm_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every gradnorm module ``path`` imports, at any depth of the file.

    ``from gradnorm.trainer.checkpoint import store`` imports the module gradnorm.trainer.checkpoint.store;
    ``from gradnorm.tasks import RepeatTask`` imports the package gradnorm.tasks.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "gradnorm"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "gradnorm":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES else node.module))
    return found


def layer_violations(files: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in files.items():
        mine = part_of(name)
        for line, target in gradnorm_imports(path):
            theirs = part_of(target)
            if theirs != mine and theirs not in ALLOWED[mine] and target != "gradnorm":
                bad.append(f"{path}:{line}: {mine} imports {target} ({theirs})")
    return bad


def test_every_import_follows_the_table():
    assert layer_violations(MODULES) == []


def test_control_the_table_trips_on_a_shell_module_that_imports_the_trainer(tmp_path):
    rogue = tmp_path / "rogue.py"
    rogue.write_text("def f():\n    from gradnorm.trainer.checkpoint import store  # a lazy import counts\n")
    found = layer_violations({"gradnorm.dist.rogue": rogue})
    assert len(found) == 1 and found[0].endswith(":2: dist imports gradnorm.trainer.checkpoint.store (trainer)")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), or a self-import."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    return {name: {t for _, t in gradnorm_imports(path) if t in MODULES and t != name}
            for name, path in MODULES.items()}


def test_no_import_cycle_anywhere():
    assert cycles(import_graph()) == []


def test_control_a_cycle_is_found():
    graph = import_graph()
    graph["gradnorm.core.grpo"] = graph["gradnorm.core.grpo"] | {"gradnorm.trainer.step"}
    assert any("gradnorm.core.grpo" in c and "gradnorm.trainer.step" in c for c in cycles(graph))


def added_by_import(*modules: str) -> set[str]:
    """The modules a fresh interpreter loads for ``modules`` beyond what ``import torch`` loads."""
    code = ("import json, sys, torch\n"
            "before = set(sys.modules)\n"
            f"for name in {list(modules)!r}:\n"
            "    __import__(name)\n"
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def shell_modules(loaded: set[str]) -> list[str]:
    return sorted(m for m in loaded if any(m == s or m.startswith(s + ".") for s in SHELL))


# Everything the notebooks and the figure script import from gradnorm, launchers aside: every
# teaching module, the audit, the core, and the learning curve.
NOTEBOOK_FACING = sorted(
    name for name in MODULES
    if (part_of(name) in ("teach", "audit") or name.startswith("gradnorm.core.")) and name not in LAUNCHERS
    and name not in ("gradnorm.core.accumulate", "gradnorm.audit.__main__")
) + ["gradnorm.trainer.logs.curves"]


@pytest.mark.launch
def test_the_notebooks_imports_load_no_distributed_code():
    loaded = added_by_import(*NOTEBOOK_FACING)
    assert set(NOTEBOOK_FACING) <= loaded  # they were imported here, not by torch
    assert shell_modules(loaded) == []


@pytest.mark.launch
def test_control_the_launchers_import_the_shell():
    # The same check must trip on the multi-process harness ...
    loaded = added_by_import("gradnorm.teach.harness")
    assert {"gradnorm.dist", "gradnorm.dist.comm", "gradnorm.dist.wrap", "gradnorm.core.accumulate"} <= set(
        shell_modules(loaded))
    # ... and on FSDP, which the harness imports only when asked for it: the name is not one that
    # a bare `import torch` loads, so its absence above means something.
    assert "torch.distributed.fsdp" in shell_modules(added_by_import("torch.distributed.fsdp"))


def torch_distributed_uses(path: Path) -> list[str]:
    """Lines of ``path`` that import torch.distributed or reach it as ``torch.distributed``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            hits = [a.name for a in node.names if a.name.split(".")[:2] == ["torch", "distributed"]]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            hits = [module] if module.split(".")[:2] == ["torch", "distributed"] else []
            hits += [f"torch.{a.name}" for a in node.names if module == "torch" and a.name == "distributed"]
        elif isinstance(node, ast.Attribute):
            hits = ["torch.distributed"] if (node.attr == "distributed" and isinstance(node.value, ast.Name)
                                             and node.value.id == "torch") else []
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {h}" for h in hits]
    return found


def test_only_gradnorm_dist_touches_torch_distributed():
    outside = [p for p in library_files() if PACKAGE / "dist" not in p.parents]
    assert [use for p in outside for use in torch_distributed_uses(p)] == []
    # control: the scan finds the shell's own use
    assert torch_distributed_uses(PACKAGE / "dist" / "comm.py")
