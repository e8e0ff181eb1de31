"""A reader that closes the trainer's standard output (``| head -1``) does not end the run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.trainer import TINY

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.launch
def test_a_reader_that_closes_stdout_does_not_end_the_run(tmp_path):
    # `train.py ... | head -1`: before, the next step line raised BrokenPipeError and the run died
    # without its checkpoint. The control is the pipe itself: it really is closed after one line.
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "gradnorm" / "train.py"), *TINY, "--output-dir", str(out),
                             "--steps", "3", "--log-every", "1"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()  # what head -1 does after its line
    err = proc.communicate(timeout=300)[1]
    assert first.strip(), err
    assert proc.returncode == 0, err
    assert "warning: standard output was closed (a pipe into head?); the run goes on" in err
    assert "Traceback" not in err and "BrokenPipeError" not in err
    assert (out / "ckpt_step3").is_dir()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
