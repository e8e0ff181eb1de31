"""Shared test plumbing: examples/ on the path, hypothesis's fixed profile, the session's shared
launches and JupyterLab server, and the browser tests need Chromium and Playwright.

The property tests (hypothesis) run under the profile ``fixed``: derandomized (the examples are a
function of the test alone, so every run, local or CI, draws the same ones in the same time), a
fixed number of examples, no example database (nothing replayed from an earlier run) and no
deadline (no test fails on timing). HYPOTHESIS_PROFILE=explore draws fresh random examples.

Locally, tests marked `browser` skip with the reason when either is missing (or deselect them
with `pytest -m "not browser"`). With CI=true (or 1) a missing browser fails them instead: a
green CI run must have driven a real browser.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# examples/tiny_models.py builds the tiny random Hugging Face models the tests train (offline)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from tests.helpers.launches import Launched
from tests.helpers.skipping import skip_or_fail

settings.register_profile("fixed", derandomize=True, max_examples=100, database=None, deadline=None,
                          print_blob=False)
settings.register_profile("explore", max_examples=1000, database=None, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; Playwright's own download cannot work here


def _browser_missing():
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package (pip install -e '.[test]')")
    return missing


TRAINER_NOTEBOOKS = ("07_real_trainers.ipynb",)
"""Notebooks that run the trainer audit on transformers' and TRL's trainers: marked ``trainers``, so
they run with the rest of those audits (``make test-trainers``), not in ``make test``."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in TRAINER_NOTEBOOKS:
            item.add_marker(pytest.mark.trainers)


@pytest.hookimpl(tryfirst=True)  # before any fixture starts JupyterLab
def pytest_runtest_setup(item):
    if item.get_closest_marker("browser") is None:
        return
    missing = _browser_missing()
    if not missing:
        return
    skip_or_fail("browser test needs " + " and ".join(missing), "; deselect browser tests with -m 'not browser'")


@pytest.fixture(scope="session")
def chromium_executable():
    return str(CHROMIUM)


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    """The session's shared runs (tests/helpers/launches.py): ``launched(name)`` is the directory of
    ``LAUNCHES[name]``, launched once, on first use. At the end, none of them may have changed."""
    table = Launched(tmp_path_factory.mktemp("launches"))
    yield table
    changed = table.close()
    assert not changed, f"a test wrote into the shared runs {changed}: work on a copy (shutil.copytree)"


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """The session's JupyterLab server (tests/helpers/jupyterlab.py), for the browser and safety tests."""
    from tests.helpers.jupyterlab import serve

    yield from serve(tmp_path_factory)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module, restored afterwards.

    The gradients in the notebook-data (imbalance, sweeps, lengthbias), widget and figure tests
    are tiny; on a busy 2-core machine a second thread makes them an order of magnitude slower.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a directory on a tmpfs of ``size`` bytes; unmounted at the end (a full disk, for
    the tests of tests/reliability that fill one: ``tests.helpers.faults.fill``)."""
    mounted = []

    def mount(size: int) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], capture_output=True)
