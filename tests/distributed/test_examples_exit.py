"""The drop-in examples run exactly as the README types them, and exit 0.

``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/drop_in_ddp.py`` (and the SFT
and DPO ones): the command a user copies. Each ends with ``exit_without_finalizing(0)``; without it a
gloo thread could abort the finalizing interpreter (SIGABRT) and torchrun would report a finished
run as FAILED, now and then (about 1 run in 3 on a busy machine). One launch each, so this test
catches the abort only by chance; the 20-in-a-row counts are in docs/reliability.md.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"  # the console script a user types, beside this python


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.parametrize("example, denominator", [("drop_in_ddp", "token"), ("drop_in_sft", "token"),
                                                  ("drop_in_dpo", "pair")])  # each one's default --denominator
def test_an_example_run_as_the_readme_shows_exits_0_with_its_line(example, denominator):
    readme = (ROOT / "README.md").read_text()
    assert f"examples/{example}.py" in readme
    proc = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", f"examples/{example}.py"], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.fullmatch(rf"{denominator}: gradient norm \d+\.\d{{6}} on 2 ranks x 2 microbatches\n", proc.stdout), proc.stdout
    assert "terminate called" not in proc.stderr and "FAILED" not in proc.stderr
