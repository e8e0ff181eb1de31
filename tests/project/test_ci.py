"""In CI a test that cannot run fails; locally it skips with the reason (tests/helpers/skipping.py)."""

import pytest

from tests.helpers.jupyterlab import notebook_path
from tests.helpers.skipping import skip_or_fail


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("1", pytest.fail.Exception),
                                         ("", pytest.skip.Exception), ("false", pytest.skip.Exception)])
def test_skip_or_fail_fails_only_in_ci(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="needs a thing"):
        skip_or_fail("needs a thing")


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_a_missing_notebook_fails_the_browser_test_in_ci(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="notebook not present yet: notebooks/no_such_notebook.ipynb"):
        notebook_path("no_such_notebook.ipynb")
    assert notebook_path("01_token_imbalance.ipynb") == "notebooks/01_token_imbalance.ipynb"
