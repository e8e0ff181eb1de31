"""A Slurm stop keeps its checkpoint: torchrun's grace period (how long it waits after forwarding
SIGTERM before it SIGKILLs the workers) is what examples/slurm/node.sh sets, and it is shorter than
the warning examples/slurm/train.sbatch asks Slurm for; torchrun's own default is 30 s
(torch/distributed/run.py, ``--shutdown-timeout``), too short for a large model's step plus its checkpoint.

node.sh runs here with ``PYTHON`` a stub that prints the torchrun command it would exec (and hands
``--help`` to the real torchrun, which has the flag), so no run starts. The control: a torchrun
whose help lacks the flag gets no flag, and a line on stderr says that 30 s applies.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "7", "RDZV_HOST": "localhost"}


def default_grace(script: str) -> int:
    return int(re.search(r'STOP_GRACE_S="\$\{STOP_GRACE_S:-(\d+)\}"', (ROOT / script).read_text()).group(1))


def node_sh(tmp_path: Path, help_has_flag: bool, **env) -> subprocess.CompletedProcess:
    stub = tmp_path / "python"
    help_cmd = f'exec {sys.executable} "$@"' if help_has_flag else 'echo "usage: torchrun [--nnodes NNODES]"; exit 0'
    stub.write_text(f'#!/bin/bash\nfor a in "$@"; do [ "$a" = --help ] && {{ {help_cmd}; }}; done\n'
                    'printf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    return subprocess.run(["bash", "examples/slurm/node.sh", "--steps", "3"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **SLURM, "PYTHON": str(stub), **env}, timeout=120)


def test_the_grace_period_is_below_slurms_warning():
    lead = int(re.search(r"^#SBATCH --signal=B:TERM@(\d+)$", (ROOT / "examples/slurm/train.sbatch").read_text(),
                         re.M).group(1))
    grace = default_grace("examples/slurm/node.sh")
    assert grace == default_grace("examples/slurm/train.sbatch")  # the two files say the same
    assert 30 < grace < lead  # more than torchrun's default, and SIGKILL comes before Slurm's own


@pytest.mark.launch
def test_node_sh_gives_torchrun_the_grace_period(tmp_path):
    proc = node_sh(tmp_path, help_has_flag=True)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    assert f"--shutdown-timeout={default_grace('examples/slurm/node.sh')}" in argv
    assert argv.index("gradnorm/train.py") > argv.index("--max-restarts=2")  # torchrun's flags, not the trainer's
    assert node_sh(tmp_path, help_has_flag=True, STOP_GRACE_S="300").stdout.count("--shutdown-timeout=300") == 1
    assert proc.stderr == ""


@pytest.mark.launch
def test_control_a_torchrun_without_the_flag_gets_none_and_a_line_says_30_s(tmp_path):
    proc = node_sh(tmp_path, help_has_flag=False)
    assert proc.returncode == 0, proc.stderr
    assert not any(a.startswith("--shutdown-timeout") for a in proc.stdout.splitlines())
    assert "SIGKILLs the workers 30 s after" in proc.stderr and proc.stderr.count("\n") == 1
