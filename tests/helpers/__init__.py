"""What several test modules share, imported as a package (``from tests.helpers.runfiles import metrics``).

    trainer        TINY (the tiny trainer configuration), tiny() for a test's explicit changes to
                   it, run_main, torchrun_cmd and one_error_line
    runfiles       what a run directory holds (metrics, comparable) and launch_all
    longhand       the loss weights written out longhand, the oracle of the gradient tests
    audit_command  the audit command run in this process
    skipping       skip locally, fail in CI

ROOT is the repository, whatever the depth of the test module that uses it.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
