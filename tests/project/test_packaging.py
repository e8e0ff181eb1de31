"""The project's plumbing: dependency lists in step, module names that cannot shadow others."""

import importlib.machinery
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

import gradnorm

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(gradnorm.__file__).resolve().parent
# Extras that the conda environment carries; others (GPU-only or heavy stacks) stay opt-in.
CONDA_EXTRAS = ("notebooks", "test", "report", "trainers")  # trainers: notebook 07 audits real trainers


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"])
    for extra in CONDA_EXTRAS:
        wanted |= set(project["optional-dependencies"][extra])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    listed = {line for line in pip_section if not line.startswith("-")}  # skip "-e ."
    assert listed == wanted


def test_no_module_shadows_a_standard_or_installed_module():
    # `torchrun gradnorm/train.py` puts gradnorm/ first on sys.path: a gradnorm/random.py would
    # replace the standard `random` for every import of the run.
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != PACKAGE_DIR]
    for module in pkgutil.iter_modules([str(PACKAGE_DIR)]):
        assert module.name not in sys.stdlib_module_names, module.name
        found = importlib.machinery.PathFinder.find_spec(module.name, elsewhere)
        assert found is None, f"gradnorm/{module.name}.py would shadow {found.origin}"


@pytest.mark.launch
def test_worked_example_runs():
    out = subprocess.run([sys.executable, "-m", "gradnorm.teach.worked_example"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert "local" in out and "1/12" in out and "1/41" in out
