"""The layers of DESIGN.md hold: the notebooks' side loads no distributed code, only gradnorm/dist/
touches torch.distributed, and every library file stays small.

Imports are checked in a fresh interpreter, so that nothing this test session already imported
hides what a notebook's imports load. ``import torch`` itself (torch 2.13) already loads
``torch.distributed`` and ``torch.nn.parallel.distributed``: the check subtracts what a bare
``import torch`` loads and asserts only on what gradnorm's imports add. Each check has a control
that must trip it, so a check that cannot fail would show.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradnorm"

# Everything the notebooks, the widgets and the figure script import from gradnorm.
NOTEBOOK_FACING = (
    "gradnorm.teach.toy", "gradnorm.core.modes", "gradnorm.teach.imbalance", "gradnorm.teach.sweeps", "gradnorm.teach.lengthbias",
    "gradnorm.teach.runs", "gradnorm.teach.plotting", "gradnorm.teach.lengthplots", "gradnorm.teach.widgets", "gradnorm.trainer.curves",
    "gradnorm.core.simulate", "gradnorm.teach.worked_example",
)
# The distributed shell and what it wraps: none of it may come with a notebook's imports.
SHELL = ("gradnorm.dist", "gradnorm.core.accumulate", "torch.nn.parallel.distributed", "torch.distributed.fsdp")

MAX_LINES = 350
# Files over MAX_LINES that are being split elsewhere; each may not grow, and must leave this list
# once it fits (the test fails on a stale entry).
KNOWN_LONG: dict[str, int] = {}  # files allowed over MAX_LINES for now: none


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


def test_the_notebooks_imports_load_no_distributed_code():
    loaded = added_by_import(*NOTEBOOK_FACING)
    assert set(NOTEBOOK_FACING) <= loaded  # they were imported here, not by torch
    assert shell_modules(loaded) == []


def test_control_the_harness_imports_the_shell():
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


def library_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_only_gradnorm_dist_touches_torch_distributed():
    outside = [p for p in library_files() if PACKAGE / "dist" not in p.parents]
    assert [use for p in outside for use in torch_distributed_uses(p)] == []
    # control: the scan finds the shell's own use
    assert torch_distributed_uses(PACKAGE / "dist" / "comm.py")


def test_every_library_file_is_small():
    lengths = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in library_files()}
    too_long = {name: n for name, n in lengths.items() if n > KNOWN_LONG.get(name, MAX_LINES)}
    assert too_long == {}, f"split these by concern (at most {MAX_LINES} lines each)"
    stale = [name for name in KNOWN_LONG if lengths.get(name, 0) <= MAX_LINES]
    assert stale == [], "these now fit: remove them from KNOWN_LONG"
