"""What several test modules share, imported as a package (``from tests.helpers.runfiles import metrics``).

    trainer        TINY (the tiny trainer configuration), tiny() for a test's explicit changes to
                   it, run_main, torchrun_cmd and one_error_line
    runfiles       what a run directory holds (metrics, comparable, every_file), assert_same_steps
                   (two runs' MEANINGFUL metrics agree) and launch_all
    launches       LAUNCHES, the session's table of shared runs, each launched once (the
                   ``launched`` fixture of tests/conftest.py reads it)
    twins          python -m tests.helpers.twins: the runs of a session that trained the same
                   thing from scratch, the candidates for LAUNCHES
    longhand       the loss weights written out longhand, the oracle of the gradient tests
    decoding       the decode loop's batch sizes written out longhand
    jupyterlab     the session's JupyterLab server (serve, behind the lab fixture) and notebook_path
    oracle         the full-batch gradient oracle of the DDP/FSDP tests (oracle_gradient, flat) and
                   their modes (INVARIANT, MODES) and token-less minibatch (EMPTY)
    fakes          fake_model and fake_checkpoint: files the preflight takes for a model or checkpoint
    faults         fail_in_publish, Evil (a malicious pickle payload) and dead_pid
    audit_command  the audit command run in this process
    skipping       skip locally, fail in CI

ROOT is the repository, whatever the depth of the test module that uses it; EXAMPLES its
examples/arithmetic.jsonl.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "arithmetic.jsonl"
