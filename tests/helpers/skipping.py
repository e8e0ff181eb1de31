"""When a test may skip: locally, yes, with the reason; in CI (CI=true or 1), never.

A green CI run must have run what it claims to test: a missing browser, Playwright or notebook
there is a failure. tests/conftest.py and tests/notebooks/test_browser.py share this.
"""

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"true", "1"}


def skip_or_fail(reason: str, deselect_hint: str = ""):
    """pytest.skip(reason) locally; pytest.fail in CI. Never returns."""
    if in_ci():
        pytest.fail(f"{reason}; CI is set, so this is a failure, not a skip", pytrace=False)
    pytest.skip(f"{reason}{deselect_hint}")
